"""The Hessian prior's A/B: `moequant apply` of uniform int4 GPTQ with `calibration.hessian_prior` 0 (each expert's own
routed-token Hessian alone) and 1 (shrunk toward the layer's all-token one by d pseudo-tokens), the same
calibration and evaluation tokens, several calibration seeds; prints the held-out KL of each run and the ratio.

    python benchmarks/bench_hessian_prior.py [--models tiny-qwen3moe,tiny-deepseek-v3,tiny-mixtral,tiny-qwen2moe]
        [--samples 16] [--seq-len 64] [--seeds 1,2,3] [--priors 0,1]

Few calibration tokens (16 x 64 by default) put the zoo models' experts where large models' are: a tiny expert then
sees a few hundred routed tokens for its 256-wide input, as a DeepSeek-V3 expert sees 2-3k of 65k for its 7168-wide
one. int4 at group 128 (32 where an expert's input is narrower). Prints numbers; asserts nothing. Dated results:
benchmarks/RESULTS.md, section bench_quality.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path


def run(model: str, samples: int, seq_len: int, seed: int, prior: float, eval_samples: int, out: Path) -> dict:
    from moequant.io.checkpoint import open_checkpoint
    from moequant.pipeline.apply import apply

    adapter = open_checkpoint(f"zoo:{model}").adapter
    group = 128 if min(adapter.expert_shape(p)[1] for p in adapter.projections) % 128 == 0 else 32
    apply(
        "uniform-int4",
        model=f"zoo:{model}",
        output=str(out),
        overrides=[
            f"calibration.samples={samples}",
            f"calibration.seq_len={seq_len}",
            "calibration.probe_samples=0",
            f"calibration.hessian_prior={prior}",
            f"seed={seed}",
            f"evaluate.samples={eval_samples}",
            "evaluate.seq_len=256",
            f"formats.int4.group_size={group}",
        ],
        progress=False,
        log=lambda *a: None,
        overwrite=True,
    )
    quality = json.loads((out / "report.json").read_text())["quality"]
    return {"kl": quality["kl_mean"], "top1": quality["top1_agreement"], "group": group}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny-qwen3moe,tiny-deepseek-v3,tiny-mixtral,tiny-qwen2moe")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--priors", default="0,1")
    p.add_argument("--eval-samples", type=int, default=32)
    a = p.parse_args()
    priors = [float(x) for x in a.priors.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-prior-"))
    print(f"{'model':18s} {'seed':>4s} " + " ".join(f"{'KL prior ' + str(x):>14s}" for x in priors) + "   ratio")
    try:
        for model in a.models.split(","):
            ratios = []
            for seed in [int(s) for s in a.seeds.split(",")]:
                kl = []
                for prior in priors:
                    kl.append(run(model, a.samples, a.seq_len, seed, prior, a.eval_samples, work / "out")["kl"])
                    shutil.rmtree(work / "out", ignore_errors=True)
                ratios.append(kl[-1] / kl[0])
                print(
                    f"{model:18s} {seed:4d} " + " ".join(f"{v:14.5f}" for v in kl) + f"   {ratios[-1]:.3f}", flush=True
                )
            print(f"{model:18s} mean ratio (last prior / first) {sum(ratios) / len(ratios):.3f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
