"""moequant's GGUF vs llama.cpp's own Q4_K_M (with the imatrix from our statistics, and without),
at no more file bytes, KL measured by llama.cpp on held-out text (the evaluation split).

    python benchmarks/bench_gguf.py [--models tiny-qwen2moe,tiny-mixtral] [--samples 64] [--seq-len 256]

Per model: one calibration with the settings `moequant apply` uses for recipes/gguf.yaml (all-experts
statistics, sensitivities of the ggml candidates, the per-layer probe and the per-tensor probe of the
non-expert weights; apply reuses it); its imatrix (`moequant.export.gguf.write_imatrix`); a BF16 GGUF
that llama_model_quantize turns into Q4_K_M with and without that imatrix; then `moequant apply` with
recipes/gguf.yaml as it is (token_embd / output Q5_K, attention / shared-expert types per tensor from
their measured KL, counted at q5_0 by the budget) and the routed-expert budget set so that the whole
file is no larger than llama.cpp's Q4_K_M. All three GGUFs are run by llama.cpp on the same
evaluation windows; KL against transformers (float32) on the original weights. Prints a table
and writes runs/bench_gguf/results.json. Prints numbers; asserts nothing.

Measured 2026-12-02 on this 2-core CPU (defaults: 64 x 256 calibration tokens, 64 x 256 evaluation
tokens, routed experts GPTQ on the types' grids; 24 / 33 min for qwen2moe / mixtral under load):

| model | GGUF | bytes | KL mean | KL p99 | top-1 |
|---|---|---|---|---|---|
| tiny-qwen2moe | moequant (4.75 bits/routed weight) | 4,482,016 | 0.0119 | 0.079 | 0.936 |
| tiny-qwen2moe | Q4_K_M + our imatrix | 4,486,624 | 0.0373 | 0.232 | 0.891 |
| tiny-qwen2moe | Q4_K_M | 4,486,624 | 0.0374 | 0.231 | 0.889 |
| tiny-mixtral | moequant (5.25 bits/routed weight) | 4,319,456 | 0.0177 | 0.142 | 0.927 |
| tiny-mixtral | Q4_K_M + our imatrix | 4,324,576 | 0.0347 | 0.302 | 0.899 |
| tiny-mixtral | Q4_K_M | 4,324,576 | 0.0354 | 0.294 | 0.898 |

KL ratio moequant / (Q4_K_M + our imatrix): 0.32 on tiny-qwen2moe (0.58 before), 0.51 on tiny-mixtral
(1.01 before; target 0.8); our imatrix vs none: 0.997 and 0.982.

Where tiny-mixtral's KL was (2026-12-01: ratio 1.01, all attention q5_0, token_embd / output Q4_K /
Q6_K as Q4_K_M has them). Hybrids of the GGUFs, one tensor kind swapped, 16 x 256 evaluation tokens
(Q4_K_M + imatrix 0.0320, moequant then 0.0327): Q4_K_M's embeddings in Q4_K cost 0.012 of its KL
(BF16 instead: 0.0197), its output in Q6_K 0.0007; token_embd / output both Q5_K (the same bytes)
gave Q4_K_M 0.0242 and moequant 0.0263. Our attn_v in q5_0 cost 0.0061 against Q4_K_M's q8_0
(llama.cpp gives 8-expert models attn_k / attn_v Q8_0, attn_output Q5_K). Now the solver picks each
attention tensor's type from its measured KL (tiny-mixtral: attn_v q8_0 / q6_k, attn_o q6_k / q8_0,
attn_q q5_0 .. q6_k; tiny-qwen2moe: attn_v / attn_o q6_k / q8_0, shared experts q5_0 .. q8_0), paid
for by the routed experts (5.51 -> 5.25 bits on tiny-mixtral, 5.12 -> 4.75 on tiny-qwen2moe).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    import torch

    from moequant import formats
    from moequant.arch import adapter_for
    from moequant.calib.calibrate import calibrate
    from moequant.export.gguf import GGUF_FILE, gguf_bytes, write_imatrix
    from moequant.export.layouts import export_checkpoint
    from moequant.export.verify_llamacpp import evaluate_gguf, quantize
    from moequant.io.checkpoint import open_checkpoint
    from moequant.pipeline.apply import apply, calibration_settings, resolve_recipe
    from moequant.zoo import path as zoo_path

    p = argparse.ArgumentParser()
    p.add_argument("--models", default="tiny-qwen2moe,tiny-mixtral")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--eval-samples", type=int, default=64)
    p.add_argument("--non-experts", default=None, help="non_experts.format (default: the recipe's)")
    p.add_argument("--output", default=str(ROOT / "runs" / "bench_gguf"))
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    recipe_path = ROOT / "recipes" / "gguf.yaml"
    results = {}
    for model in args.models.split(","):
        t0 = time.time()
        out = Path(args.output) / model
        out.mkdir(parents=True, exist_ok=True)
        src = zoo_path(model)
        ckpt = open_checkpoint(src)
        ad = adapter_for(ckpt.config)
        base = [f"calibration.samples={args.samples}", f"calibration.seq_len={args.seq_len}",
                f"evaluate.samples={args.eval_samples}", f"evaluate.seq_len={args.seq_len}"]
        if args.non_experts:
            base.append(f"non_experts.format={args.non_experts}")
        recipe = resolve_recipe(str(recipe_path), f"zoo:{model}", str(out / "moequant"), base)
        non_experts = recipe.non_experts.format
        types = {"token_embd.weight": recipe.export.gguf_token_embd, "output.weight": recipe.export.gguf_output}
        bf16 = export_checkpoint(src, {}, out / "bf16", layout="gguf", target="llama.cpp")

        # our non-routed bytes (non-experts in non_experts.format, token_embd / output in the recipe's
        # types, the rest F32 / BF16): what the routed experts may use beside them
        probe = {}
        for name in ckpt.keys():
            role = ad.classify(name).role
            if role in ("attention", "shared_expert", "lm_head") and name.endswith("weight") and len(ckpt.shape(name)) == 2:
                probe[name] = formats.quantize(ckpt.get(name).float(), non_experts)
        probe_dir = export_checkpoint(src, probe, out / "probe", layout="gguf", target="llama.cpp", gguf_types=types)
        acct = gguf_bytes(probe_dir / GGUF_FILE)
        header = os.path.getsize(probe_dir / GGUF_FILE) - acct["total"]  # metadata, tokenizer, alignment
        non_routed = acct["total"] - acct["by_role"]["routed_expert"] + header

        # one calibration, with the settings apply uses (apply then reuses it): its imatrix for llama.cpp
        stats = out / "moequant" / "stats"
        calibrate(str(src), stats, calibration_settings(recipe), overwrite=True, progress=False)
        imatrix = write_imatrix(stats, out / "imatrix.gguf")
        q_im, q_no = out / "q4_k_m-imatrix.gguf", out / "q4_k_m.gguf"
        for dst, im in ((q_im, imatrix), (q_no, None)):
            rc = quantize(bf16 / GGUF_FILE, dst, "Q4_K_M", imatrix=im)["rc"]
            assert rc == 0, f"llama_model_quantize failed ({rc})"
        limit = min(os.path.getsize(q_im), os.path.getsize(q_no))
        routed_numel = sum(ad.num_experts * math.prod(ad.expert_shape(pj)) for _ in ad.moe_layers for pj in ad.projections)
        bits = math.floor((limit - non_routed) * 8 / routed_numel * 1e4) / 1e4 - 0.01  # slack for alignment padding
        apply(str(recipe_path), model=f"zoo:{model}", output=str(out / "moequant"), progress=False,
              log=lambda *_: None, overrides=[*base, f"experts.budget.bits_per_weight={bits}"])
        ours = out / "moequant" / "checkpoint" / GGUF_FILE
        plan = json.loads((out / "moequant" / "plan.json").read_text())
        chosen = {}
        for t in plan["tensors"]:
            if t["role"] == "routed_expert":
                chosen[f"{t['layer']}.{t['proj']}"] = t["format"]
        row = {"routed_bits_budget": bits, "types": chosen}
        for label, path in (("moequant", ours), ("q4_k_m+our_imatrix", q_im), ("q4_k_m", q_no)):
            if label == "moequant":  # apply's own evaluation: llama.cpp on the same windows
                q = json.loads((out / "moequant" / "report.json").read_text())["quality"]
            else:
                q = evaluate_gguf(path, src, samples=args.eval_samples, seq_len=args.seq_len, seed=0)
            row[label] = {"bytes": os.path.getsize(path), "kl_mean": q["kl_mean"], "kl_p99": q["kl_p99"],
                          "top1": q["top1_agreement"], "ppl": q["ppl_quantized"], "ppl_bf16": q["ppl_original"],
                          "tokens": q["tokens"]}
        row["seconds"] = time.time() - t0
        results[model] = row
        (Path(args.output) / "results.json").write_text(json.dumps(results, indent=2))
        print(f"\n{model}: routed-expert budget {bits} bits; moequant types {chosen}")
        print(f"{'GGUF':<22}{'bytes':>10}{'KL mean':>12}{'KL p99':>10}{'top-1':>8}{'ppl':>9}")
        for label in ("moequant", "q4_k_m+our_imatrix", "q4_k_m"):
            r = row[label]
            print(f"{label:<22}{r['bytes']:>10}{r['kl_mean']:>12.5f}{r['kl_p99']:>10.4f}{r['top1']:>8.3f}{r['ppl']:>9.3f}")
        ratio = row["moequant"]["kl_mean"] / row["q4_k_m+our_imatrix"]["kl_mean"]
        print(f"KL ratio moequant / (Q4_K_M + our imatrix) = {ratio:.3f}; imatrix vs none: "
              f"{row['q4_k_m+our_imatrix']['kl_mean'] / row['q4_k_m']['kl_mean']:.3f}; {row['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
