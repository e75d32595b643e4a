"""CPU and wall time of calibration's per-tensor probe alone (what `non_experts.formats` makes calibrate measure:
the KL of every attention / shared-expert weight in every candidate format), on random token ids, with the
number of torch threads given. Prints the times; writes the probe's dict to --output when given.

    python benchmarks/bench_probe.py [--model tiny-qwen2moe] [--samples 4] [--threads 1]
                                     [--formats q8_0,q6_k,q5_k,q5_0,q4_k] [--output probe.json]

Dated results, each with its command: benchmarks/RESULTS.md, section bench_gguf.py (the GGUF recipes' probe).
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv=None) -> int:
    import torch

    from moequant.arch import adapter_for
    from moequant.io.checkpoint import open_checkpoint
    from moequant.measure.probe import run_tensor_probe
    from moequant.zoo import path as zoo_path

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny-qwen2moe")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--formats", default="q8_0,q6_k,q5_k,q5_0,q4_k")  # recipes/gguf.yaml's non_experts menu
    p.add_argument("--output")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    ckpt = open_checkpoint(zoo_path(args.model))
    vocab = int(ckpt.config["vocab_size"])
    ids = torch.randint(0, vocab, (args.samples, args.seq_len), generator=torch.Generator().manual_seed(0))
    wall, cpu = time.perf_counter(), time.process_time()
    result = run_tensor_probe(ckpt, adapter_for(ckpt.config), ids, args.formats.split(","))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    units = sum(len(f) for f in result["tensors"].values())
    print(
        f"{args.model}: {units} tensor formats, {args.samples} x {args.seq_len} tokens: CPU {cpu:.1f} s, wall {wall:.1f} s"
    )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
