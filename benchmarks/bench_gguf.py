"""moequant's GGUF vs llama.cpp's own mixtures — Q4_K_M, Q3_K_M, Q3_K_S, Q2_K, each from our BF16
GGUF by llama_model_quantize with the imatrix from our statistics and without — each compared at
llama.cpp's own bytes, KL measured by llama.cpp on held-out text (the evaluation split).

    python benchmarks/bench_gguf.py [--models tiny-qwen2moe,tiny-mixtral,tiny-qwen3moe,tiny-deepseek-v3] [--ftypes Q4_K_M,Q3_K_M,Q3_K_S,Q2_K]
                                    [--recipe recipes/gguf-lowbit.yaml] [--samples 64] [--seq-len 256]

Per model: one calibration with the settings `moequant apply` uses for the recipe (all-experts
statistics, sensitivities of every ggml candidate down to Q2_K, the per-layer probe and the per-tensor
probe of the non-expert weights; every apply below reuses it); its imatrix
(`moequant.export.gguf.write_imatrix`); a BF16 GGUF. Per llama.cpp type: llama_model_quantize of the
BF16 GGUF with and without that imatrix; then `moequant apply` with the recipe and the routed-expert
budget set so that the whole file is no larger than the smaller of the two (the bits column counts
every tensor of the file: bytes x 8 / all weights), token_embd / output in the recipe's types. A budget the
recipe's menu cannot meet is refused by apply before any work; then the row is made again with token_embd /
output in the types llama.cpp's own file has (as a user told so would lower them), and says so when still refused. All GGUFs are run by llama.cpp on the same evaluation
windows; KL against transformers (float32) on the original weights. Prints a table and writes
runs/bench_gguf/results.json. Prints numbers; asserts nothing.

Dated results, each with its command: benchmarks/RESULTS.md, section bench_gguf.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests/support: llama.cpp's own quantizer and tensor types


def main(argv=None) -> int:  # noqa: C901
    import shutil

    import gguf
    import torch

    from moequant import formats
    from moequant.arch import adapter_for
    from moequant.errors import UserError
    from moequant.export.gguf import GGUF_FILE, gguf_bytes, reshaped_reason, write_imatrix
    from moequant.export.write import export_checkpoint
    from moequant.io.checkpoint import open_checkpoint
    from moequant.llamacpp.evaluate import evaluate_gguf
    from moequant.measure.calibrate import calibrate
    from moequant.pipeline.apply import apply, calibration_settings, resolve_recipe
    from moequant.plan.model import NON_EXPERT_ROLES
    from moequant.zoo import path as zoo_path
    from tests.support.verify_llamacpp import quantize

    p = argparse.ArgumentParser()
    p.add_argument("--models", default="tiny-qwen2moe,tiny-mixtral,tiny-qwen3moe,tiny-deepseek-v3")
    p.add_argument("--ftypes", default="Q4_K_M,Q3_K_M,Q3_K_S,Q2_K")
    p.add_argument("--recipe", default=str(ROOT / "recipes" / "gguf-lowbit.yaml"))
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--eval-samples", type=int, default=64)
    p.add_argument("--output", default=str(ROOT / "runs" / "bench_gguf"))
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    results = {}
    for model in args.models.split(","):
        t0 = time.time()
        out = Path(args.output) / model
        out.mkdir(parents=True, exist_ok=True)
        src = zoo_path(model)
        ckpt = open_checkpoint(src)
        ad = adapter_for(ckpt.config)
        base = [
            f"calibration.samples={args.samples}",
            f"calibration.seq_len={args.seq_len}",
            f"evaluate.samples={args.eval_samples}",
            f"evaluate.seq_len={args.seq_len}",
        ]
        recipe = resolve_recipe(args.recipe, f"zoo:{model}", str(out / "moequant"), base)
        bf16 = export_checkpoint(src, {}, out / "bf16", layout="gguf", target="llama.cpp")
        all_weights = sum(math.prod(ckpt.shape(n)) for n in ckpt.keys())
        if "lm_head.weight" not in ckpt.keys():
            all_weights += math.prod(ckpt.shape("model.embed_tokens.weight"))  # GGUF's output.weight copy

        routed_numel = sum(
            ad.num_experts * math.prod(ad.expert_shape(pj)) for _ in ad.moe_layers for pj in ad.projections
        )

        def non_routed_bytes(types: dict, tag: str) -> int:
            """Our non-routed bytes (non-experts in non_experts.format, token_embd / output in `types`, the rest
            F32 / BF16): what the routed experts may use beside them."""
            probe = {}
            for name in ckpt.keys():
                role = ad.classify(name).role
                if (
                    role in NON_EXPERT_ROLES
                    and name.endswith("weight")
                    and len(ckpt.shape(name)) == 2  # as the plan has them
                    and reshaped_reason(ckpt.config.get("model_type"), name) is None
                ):
                    probe[name] = formats.quantize(ckpt.get(name).float(), recipe.non_experts.format)
            probe_dir = export_checkpoint(
                src, probe, out / f"probe-{tag}", layout="gguf", target="llama.cpp", gguf_types=types
            )
            acct = gguf_bytes(probe_dir / GGUF_FILE)
            header = os.path.getsize(probe_dir / GGUF_FILE) - acct["total"]  # metadata, tokenizer, alignment
            return acct["total"] - acct["by_role"]["routed_expert"] + header

        # one calibration, with the settings apply uses (every apply below reuses it): its imatrix for llama.cpp
        stats = out / "stats"
        calibrate(str(src), stats, calibration_settings(recipe), overwrite=True, progress=False)
        imatrix = write_imatrix(stats, out / "imatrix.gguf")
        rows = {}

        def _moequant_row(ftype: str, types: dict, limit: int) -> dict:
            """moequant's GGUF at `limit` bytes with token_embd / output in `types` (its row, or why it is refused)."""
            non_routed = non_routed_bytes(types, ftype.lower())
            bits = math.floor((limit - non_routed) * 8 / routed_numel * 1e4) / 1e4 - 0.01  # slack for alignment padding
            run = out / f"moequant-{ftype.lower()}"
            shutil.rmtree(run, ignore_errors=True)
            shutil.copytree(stats, run / "stats")  # the same statistics: apply reuses them
            row = {"routed_bits_budget": bits, "token_embd / output": types}
            try:
                if bits <= 0:
                    raise UserError(
                        f"the non-routed tensors alone ({non_routed:,} bytes as the recipe types them) "
                        f"exceed {ftype}'s file ({limit:,} bytes)."
                    )
                apply(
                    args.recipe,
                    model=f"zoo:{model}",
                    output=str(run),
                    progress=False,
                    log=lambda *_: None,
                    overrides=[
                        *base,
                        f"experts.budget.bits_per_weight={bits}",
                        f"export.gguf_token_embd={types['token_embd.weight']}",
                        f"export.gguf_output={types['output.weight']}",
                    ],
                )
                plan = json.loads((run / "plan.json").read_text())
                row["types"] = {
                    f"{t['layer']}.{t['proj']}": t["format"] for t in plan["tensors"] if t["role"] == "routed_expert"
                }
                q = json.loads((run / "report.json").read_text())["quality"]  # llama.cpp on the same windows
                row["moequant"] = _row(run / "checkpoint" / GGUF_FILE, q, all_weights)
            except UserError as e:
                row["moequant"] = {"refused": str(e)}
            return row

        for ftype in args.ftypes.split(","):
            q_im, q_no = out / f"{ftype.lower()}-imatrix.gguf", out / f"{ftype.lower()}.gguf"
            for dst, im in ((q_im, imatrix), (q_no, None)):
                rc = quantize(bf16 / GGUF_FILE, dst, ftype, imatrix=im)["rc"]
                assert rc == 0, f"llama_model_quantize {ftype} failed ({rc})"
            limit = min(os.path.getsize(q_im), os.path.getsize(q_no))
            # token_embd / output as the recipe types them (the budget does not choose them yet); where that
            # leaves the recipe no feasible plan, in the types llama.cpp's own mixture gives them at this size,
            # as a user told "below the smallest feasible plan" would lower them
            theirs = {t.name: t.tensor_type.name.lower() for t in gguf.GGUFReader(str(q_im)).tensors}
            recipe_types = {
                "token_embd.weight": recipe.export.gguf_token_embd,
                "output.weight": recipe.export.gguf_output,
            }
            for types in (recipe_types, {n: theirs[n] for n in recipe_types}):
                row = _moequant_row(ftype, types, limit)
                if "refused" not in row["moequant"]:
                    break
            for label, path in ((f"{ftype}+our_imatrix", q_im), (ftype, q_no)):
                q = evaluate_gguf(path, src, samples=args.eval_samples, seq_len=args.seq_len, seed=0)
                row[label] = _row(path, q, all_weights)
            rows[ftype] = row
            results[model] = {"ftypes": rows, "seconds": time.time() - t0}
            (Path(args.output) / "results.json").write_text(json.dumps(results, indent=2))
        print(f"\n{model} ({time.time() - t0:.0f} s)")
        print(f"{'GGUF':<26}{'bytes':>10}{'bits':>7}{'KL mean':>10}{'KL p99':>9}{'top-1':>7}  ratio to +imatrix")
        for ftype, row in rows.items():
            ref = row[f"{ftype}+our_imatrix"]["kl_mean"]
            for label in ("moequant", f"{ftype}+our_imatrix", ftype):
                r = row[label]
                embd = row["token_embd / output"]["token_embd.weight"]
                name = f"moequant @ {ftype} ({embd})" if label == "moequant" else label
                if "refused" in r:
                    print(f"{name:<26}refused: {r['refused']}")
                    continue
                print(
                    f"{name:<26}{r['bytes']:>10}{r['bits']:>7.3f}{r['kl_mean']:>10.5f}{r['kl_p99']:>9.4f}"
                    f"{r['top1']:>7.3f}  {r['kl_mean'] / ref:.3f}"
                )
    return 0


def _row(path, q, all_weights) -> dict:
    size = os.path.getsize(path)
    return {
        "bytes": size,
        "bits": size * 8 / all_weights,
        "kl_mean": q["kl_mean"],
        "kl_p99": q["kl_p99"],
        "top1": q["top1_agreement"],
        "ppl": q["ppl_quantized"],
        "ppl_bf16": q["ppl_original"],
        "tokens": q["tokens"],
    }


if __name__ == "__main__":
    raise SystemExit(main())
