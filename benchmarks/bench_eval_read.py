"""The streamed evaluation's reads, A/B in one process: one thread reading both models' layers expert after
expert (`one-thread`, the reader before moequant.evaluate.compare._read_states) against slices of experts on several
threads, both models at once (`threads`, the library's reader).

For each layer count, a random-weight model of a real config (bench_e2e.py's, reused when bench_e2e
--keep-models left it in --work) is quantized with uniform int4-g128 round-to-nearest (no forward, fast),
then its checkpoint is evaluated against the source with each reader in turn, `--repeats` times
alternating. Printed: each evaluation's seconds, the least-squares seconds per layer of each reader
over the layer counts, and whether both readers' results are equal to the bit (they must be: the
same tensors are read).

    python benchmarks/bench_eval_read.py --config qwen3-235b-a22b --layers 1 2 3 --work /tmp/e2e --eval-samples 8

Dated results, each with its command: benchmarks/RESULTS.md, section bench_e2e.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import tempfile
import time
from pathlib import Path

from bench_e2e import ROOT, build, fit_per_layer


def one_thread(runs, adapter, L, pool):
    """The reader before the slices: each run's layer read in turn on the read-ahead thread."""
    return [r.read_layer(L) for r in runs]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, nargs="+", default=(1, 2, 3))
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--eval-samples", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--work", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--set-config", action="append", default=[], help="config key=value (JSON) for the built model")
    a = p.parse_args()

    import torch

    import moequant.evaluate.compare as evaluation
    from moequant.evaluate import evaluate_checkpoints
    from moequant.pipeline.apply import apply

    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"{datetime.date.today()} on {card}, torch {torch.__version__}", flush=True)
    work = Path(a.work or tempfile.mkdtemp(prefix="bench-eval-"))
    library = evaluation._read_states
    seconds: dict[str, list] = {"one-thread": [], "threads": []}
    for layers in a.layers:
        model = work / f"{a.config}-bf16-{layers}L"  # bench_e2e's name: its kept models are reused
        if not model.exists():
            build(a.config, layers, a.vocab, model, a.device, a.set_config)
        out = work / f"bench-eval-read-{layers}L"
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        apply(
            str(ROOT / "recipes" / "uniform-int4.yaml"),
            model=str(model),
            output=str(out),
            overrides=["algorithms.int4=rtn", "formats.int4.group_size=128", f"evaluate.samples={a.eval_samples}"],
            device=a.device,
            progress=False,
            log=lambda *_: None,
        )
        print(f"{layers}L: RTN apply {time.perf_counter() - t0:.1f} s", flush=True)
        results = {}
        for _ in range(a.repeats):
            for mode, reader in (("one-thread", one_thread), ("threads", library)):
                evaluation._read_states = reader
                t0 = time.perf_counter()
                q = evaluate_checkpoints(
                    out / "checkpoint",
                    model,
                    samples=a.eval_samples,
                    seq_len=a.seq_len,
                    device=a.device,
                    progress=False,
                )
                dt = time.perf_counter() - t0
                seconds[mode].append((layers, dt))
                results[mode] = json.dumps({k: v for k, v in q.items() if "seconds" not in k}, sort_keys=True)
                print(f"{layers}L {mode:10s} {dt:6.2f} s  KL {q['kl_mean']:.6g}", flush=True)
        evaluation._read_states = library
        print(f"{layers}L results equal to the bit: {results['one-thread'] == results['threads']}", flush=True)
        shutil.rmtree(out, ignore_errors=True)
    if len(set(a.layers)) > 1:
        for mode, points in seconds.items():
            slope, intercept, rms = fit_per_layer(points)
            print(f"{mode:10s} {slope:6.2f} s/layer (least squares, rms {rms:.2f}; intercept {intercept:.1f} s)")


if __name__ == "__main__":
    main()
