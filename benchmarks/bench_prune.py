"""Quality per byte of pruning on a specialised workload (issue 58): drop the experts the workload does not need,
then quantize, against quantizing every expert.

    python benchmarks/bench_prune.py [--models tiny-qwen3moe,tiny-qwen2moe] [--samples 64] [--eval-samples 32]
        [--domain stdlib-code] [--other stdlib-prose] [--variants int4,reap+int4,kl+int4,drop-budget,reap+budget]

Per model, every variant is one `moequant apply` calibrated on `builtin:DOMAIN`:
- int4: every routed expert int4 (the uniform-int4 recipe: GPTQ, g32 symmetric);
- SALIENCY+int4: experts.prune drops ceil(20 %) of each layer's experts by SALIENCY (reap | frequency | weight | kl:
  moequant.measure.saliency; kl: the measured KL of dropping each expert), then every kept expert int4, i.e.
  pruning-then-quantizing at <= 0.8x int4's bytes;
- SALIENCY+budget: the same drop, then the selective recipe's budget over int8 / int4 / int3 at 0.8x int4's
  routed bytes (the byte target spread over the kept experts);
- budget: no drop, the same budget over every expert at 0.8x int4's routed bytes (quantization alone at those bytes);
- drop-budget: experts.prune {by: budget}, the budget at 0.8x int4's routed bytes choosing how many experts every
  layer drops and the formats (int8 / int4, per layer: vLLM's) of the rest (moequant.plan.drop);
- drop-budget3: the same with int3 offered too, for target transformers (per expert; int3 is no vLLM format), so
  the solver weighs dropping against lowering bits.
Each checkpoint is compared with the ORIGINAL model (moequant.pipeline.prune.pruning_cost: logits, layer by layer)
on the evaluation split of the calibration domain (held out from calibration) and of another domain: KL mean,
p99 and top-1 agreement. bytes = the plan's routed-expert bytes (plan.json summary.routed_bytes), ratio to int4's.
Prints a table and writes runs/bench_prune/results.json. Asserts nothing; dated results: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _apply(model, variant, out, args) -> Path:
    from moequant.pipeline.apply import apply

    saliency, _, kind = variant.rpartition("+")
    recipe = "uniform-int4" if kind == "int4" else "selective"
    sets = [
        f"model=zoo:{model}",
        f"calibration.dataset=builtin:{args.domain}",
        f"calibration.samples={args.samples}",
        "calibration.seq_len=256",
        f"evaluate.dataset=builtin:{args.domain}",
        "evaluate.samples=4",
        "evaluate.seq_len=256",
    ]
    from moequant.io.checkpoint import open_checkpoint

    E = open_checkpoint(f"zoo:{model}").adapter.num_experts
    k = math.ceil(0.2 * E) if saliency else 0
    if saliency:
        sets.append(f"experts.prune={{experts: {k}, saliency: {saliency}}}")
    if kind.startswith("drop-budget"):  # the count is the budget's: the limit is 0.8x int4's bytes of all E experts
        recipe = "selective"
        formats = "[int8, int4, int3]" if kind == "drop-budget3" else "[int8, int4]"
        sets += [f"experts.budget={{bits_per_weight: {0.8 * args.int4_bits[model]:.4f}}}", f"experts.formats={formats}"]
        sets += [
            "experts.prune={by: budget}",
            "formats={int4: {group_size: 32, symmetric: true}, int3: {group_size: 32, symmetric: true}}",
        ]
        if kind == "drop-budget3":
            sets.append("target=transformers")
    if kind == "budget":  # 0.8x int4's routed bytes over the E - k kept experts
        bits = 0.8 * args.int4_bits[model] * E / (E - k)
        sets += [f"experts.budget={{bits_per_weight: {bits:.4f}}}", "experts.formats=[int8, int4, int3]"]
        sets.append("formats={int4: {group_size: 32, symmetric: true}, int3: {group_size: 32, symmetric: true}}")
    apply(recipe, output=str(out), overrides=sets, progress=False, log=lambda *a: None, overwrite=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny-qwen3moe,tiny-qwen2moe")
    p.add_argument("--variants", default="int4,drop-budget,reap+int4,kl+int4,drop-budget3,reap+budget")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--eval-samples", type=int, default=32)
    p.add_argument("--domain", default="stdlib-code")
    p.add_argument("--other", default="stdlib-prose")
    p.add_argument("--output", default=str(ROOT / "runs" / "bench_prune"))
    args = p.parse_args(argv)
    from moequant.io.checkpoint import open_checkpoint
    from moequant.pipeline.prune import pruning_cost

    root = Path(args.output)
    results, args.int4_bits = [], {}
    for model in args.models.split(","):
        base = None
        done = root / model / "int4" / "plan.json"  # an earlier int4 run into the same output: its bytes are the base
        if "int4" not in args.variants.split(",") and done.exists():
            summary = json.loads(done.read_text())["summary"]
            base, args.int4_bits[model] = summary["routed_bytes"], summary["bits_per_weight"]["routed_experts"]
        for variant in args.variants.split(","):
            t0 = time.perf_counter()
            out = _apply(model, variant, root / model / variant.replace("+", "_"), args)
            plan = json.loads((out / "plan.json").read_text())["summary"]
            routed = plan["routed_bytes"]
            if variant == "int4":
                base = routed
                args.int4_bits[model] = plan["bits_per_weight"]["routed_experts"]
            row = {"model": model, "variant": variant, "routed_bytes": routed, "ratio": routed / base if base else None}
            source, checkpoint = open_checkpoint(f"zoo:{model}"), open_checkpoint(out / "checkpoint")
            for name, domain in (("domain", args.domain), ("other", args.other)):
                cost = pruning_cost(source, checkpoint, f"builtin:{domain}", args.eval_samples, 256, 0)
                row[name] = {k: cost[k] for k in ("kl_mean", "kl_p99", "top1")}
            prune = out / "prune" / "prune.json"
            if prune.exists():
                layers = json.loads(prune.read_text())["layers"].values()
                row["routing_mass_dropped"] = max(v["routing_mass"] for v in layers)
                row["dropped_per_layer"] = len(next(iter(layers))["dropped"])
            chosen = out / "prune" / "budget.json"
            if chosen.exists():  # what the budget weighed: per count tried, drop KL + predicted formats' KL
                row["budget_counts"] = json.loads(chosen.read_text())["counts"]
            row["seconds"] = time.perf_counter() - t0
            results.append(row)
            d, o = row["domain"], row["other"]
            print(
                f"{model:16s} {variant:16s} drops {row.get('dropped_per_layer', 0)}  "
                f"bytes {routed:>10d} ({row['ratio'] or 1:.3f}x int4)  "
                f"{args.domain} KL {d['kl_mean']:.4f} top1 {d['top1']:.3f}  {args.other} KL {o['kl_mean']:.4f} "
                f"top1 {o['top1']:.3f}",
                flush=True,
            )
    root.mkdir(parents=True, exist_ok=True)
    (root / "results.json").write_text(json.dumps({"args": vars(args), "rows": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
