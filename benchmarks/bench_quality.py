"""Quality per byte of the routed experts: moequant's integer grids and algorithms against
llama.cpp's own Q4_0 / Q4_K / Q4_K + imatrix / Q4_K_M, on the same held-out windows.

    python benchmarks/bench_quality.py [--models tiny-qwen2moe,tiny-mixtral,tiny-qwen3moe,tiny-deepseek-v3] [--samples 128]
        [--eval-samples 32] [--q4-k-m]

Only the routed experts are quantized; everything else keeps the original float32 weights, so the
KL (original || quantized, evaluate.evaluate on the evaluation split, 32 x 256 tokens by default)
measures the experts alone. Per model: one calibration per Hessian weighting (tokens / routing /
calibrate.HESSIAN_WEIGHTINGS, and routing2 = its square, measured and dropped; full Hessians kept), then each variant's dequantized
experts are written into a copy of the float32 model:

- moequant: RTN and GPTQ (act order, static groups, `chosen_hessian`'s routed-or-all Hessian, as
  the quantize pass) on int4 g32 sym / g64 asym / g32 asym, each with the min/max grid and the
  searched grid (`formats.searched_fit`; RTN's weighted by the all-token input second moments);
- llama.cpp: its own quantizer (ggml_quantize_chunk through llama-cpp-python) of every expert
  tensor, without data and with our imatrix (all-token input second moments, what
  `export_gguf.write_imatrix` writes). Q4_K rows need 256 inputs; where an expert's input is
  narrower (down_proj of both bundled models) llama.cpp itself converts Q4_K to Q5_0
  (llama_tensor_get_type's fallback), and so does this benchmark: the bits column says what it
  costs. Q4_K_M's types are the ones llama_model_quantize gives the expert tensors of a BF16
  GGUF of the model (read back from its output).

bits = stored bits per routed-expert weight (codes, scales, zero points / block bytes). Prints a
table and writes runs/bench_quality/results.json. Prints numbers; asserts nothing.

Measured 2026-12-03 at real expert widths, on the two bundled models whose expert widths are multiples
of 256 (tiny-qwen3moe: 8 x 256, top-4; tiny-deepseek-v3: 8 routed x 256 + shared, grouped sigmoid
top-2), where llama.cpp stores every routed tensor Q4_K as it is (no fallback: its bits column is its
own), on this 2-core CPU under heavy load from other jobs; defaults (128 x 256 calibration, 32 x 256
held-out tokens, routing-weighted Hessians):
`python benchmarks/bench_quality.py --models tiny-qwen3moe,tiny-deepseek-v3 --weightings routing --q4-k-m
--no-gguf --uniform int4-g32-sym/gptq+refit/searched/routing,int4-g64-asym/gptq+refit/searched/routing,int4-g32-asym/gptq+refit/searched/routing
--plans "selective uniform-int4 per-expert;target=vllm-moequant"`. KL, and its ratio to llama.cpp's
Q4_K + our imatrix (llama.cpp's own quantizer, ggml_quantize_chunk). Q4_K_M's expert types are
llama.cpp's rules (`q4_k_m_rule`: ffn_down Q6_K in blocks 2 and 3 of 4) because moequant's GGUF export
does not take these architectures yet (issue 37); on tiny-qwen2moe the rule equals llama_model_quantize's
output.

| routed experts as (every projection) | bits | qwen3moe | deepseek-v3 |
|---|---|---|---|
| llama.cpp Q4_0 | 4.50 | 0.01798 (1.45) | 0.01714 (1.47) |
| llama.cpp Q4_K (as llama.cpp stores it) | 4.50 | 0.01267 (1.02) | 0.01181 (1.01) |
| llama.cpp Q4_K + our imatrix | 4.50 | 0.01240 (1.00) | 0.01167 (1.00) |
| llama.cpp Q4_K_M (down Q6_K in blocks 2, 3) | 4.84 / 4.96 | 0.01031 (0.83) | 0.00982 (0.84) |
| llama.cpp Q4_K_M + our imatrix | 4.84 / 4.96 | 0.01018 (0.82) | 0.00993 (0.85) |
| int4-g32-sym GPTQ searched + refit (the bench's own pass) | 4.50 | 0.01307 (1.05) | 0.01305 (1.12) |
| plan uniform-int4 (recipe default, vllm) | 4.50 | 0.01297 (1.05) | 0.01337 (1.15) |
| plan selective (vllm) at 4.5 | 4.50 | 0.01297 (1.05) | 0.01337 (1.15) |
| plan per-expert, target vllm-moequant, at 4.5 | 4.50 | 0.01297 (1.05) | 0.01337 (1.15) |
| int4-g64-asym GPTQ searched + refit (needs vLLM's CUDA kernels) | 4.31 | 0.01377 (1.11) | 0.01291 (1.11) |
| int4-g32-asym GPTQ searched + refit (needs vLLM's CUDA kernels) | 4.63 | 0.01092 (0.88) | 0.01096 (0.94) |

The issue's targets are not met: at 4.5 bits the vLLM-servable plans are 1.05x / 1.15x llama.cpp's
Q4_K + imatrix (targets: selective <= 0.9x, uniform int4 <= 1.0x, per-expert vllm-moequant <= 0.7x).
All three plans are the same checkpoint: at 4.5 bits the selective menu (int8, int4 g32 sym) has no room
for an int8 layer, and the vllm-moequant solver found no per-expert int8 / int4-g64 mix it predicted to
be better than all int4 g32. The grid is the gap: Q4_K's asymmetric 32-groups with 6-bit scales and mins
cost 4.5 bits, symmetric g32 with bf16 scales costs the same; asymmetric g32 with bf16 scales and zero
points (4.63 bits) beats Q4_K + imatrix by 12% / 6%, g64 asymmetric (4.31 bits) loses by 11% / 11% (on
deepseek-v3 it ties symmetric g32 at 0.19 bits less). Target `vllm-cuda` (vLLM's Marlin / Triton MoE
kernels, which take zero points) now offers asymmetric int4 to the plan; its selective plan at 4.5
(layers mixing g32 / g64 asymmetric, on these 4-layer models a coarse mix) was not measured in time,
so nothing became a default. Run time: about 60 min per model on the loaded 2-core CPU (each plan
calibrates again through `moequant apply`).

Measured 2026-12-03 on this 2-core CPU (an AVX-512 AMD EPYC), the current defaults: 128 x 256 calibration
tokens, routing-weighted Hessians, 32 x 256 held-out tokens (`python benchmarks/bench_quality.py --weightings
routing --uniform int4-g32-sym/gptq+refit/searched/routing`, plans "selective per-expert" at 4.5 bits; the
moequant Q4_K rows from the same command with `--plans ""`). KL, and its ratio to llama.cpp's Q4_K at its
own 4.5 bits (narrow down_proj rows in Q4_0); the llama.cpp rows reproduce 2026-12-02's to the digit:

| routed experts as (every projection) | bits | qwen2moe | mixtral |
|---|---|---|---|
| llama.cpp Q4_K, narrow rows Q4_0 | 4.50 | 0.01130 (1.00) | 0.02627 (1.00) |
| llama.cpp Q4_K as llama.cpp stores it (narrow rows Q5_0) | 4.83 | 0.00646 (0.57) | 0.01539 (0.59) |
| int4-g32-sym GPTQ searched + refit (vLLM-servable uniform int4) | 4.50 | 0.00872 (0.77) | 0.02051 (0.78) |
| plan selective (vllm) at 4.5 | 4.50 | 0.00886 (0.78) | 0.02025 (0.77) |
| plan per-expert (transformers) at 4.5 | 4.50 | 0.00583 (0.52) | 0.01595 (0.61) |
| moequant Q4_K, imatrix (our scale search), narrow rows Q4_0 | 4.50 | 0.01119 (0.99) | 0.02432 (0.93) |
| moequant Q4_K, GPTQ on the type's grid, narrow rows Q4_0 | 4.50 | 0.00774 (0.68) | 0.01780 (0.68) |
| moequant Q4_K, GPTQ on the type's grid, narrow rows Q5_0 | 4.83 | 0.00400 (0.35) | 0.01015 (0.39) |

At 64 calibration samples (the 2026-12-02 tables below) the selective plan was 0.804x / 0.753x and the
per-expert plan 0.546x / 0.617x: 128 samples help qwen2moe (-2.5%) and cost mixtral 2.4%, so on these
models the sample count moves the plans by about their evaluation noise. At the bytes llama.cpp spends
(4.83), moequant's own GGUF quantizer (GPTQ on the Q4_K / Q5_0 grids, what recipes/gguf.yaml runs)
gives 0.62x / 0.66x llama.cpp's Q4_K KL.

Measured 2026-12-02 on this 2-core CPU (shared with other jobs), defaults (64 x 256 calibration,
32 x 256 held-out tokens), `--q4-k-m --scopes experts,gate_up`. KL mean, and its ratio to llama.cpp's
Q4_K on the same scope. "experts": every routed projection; llama.cpp's Q4_K then spends 4.83 bits,
because both bundled models' down_proj rows have 64 inputs and llama.cpp stores them Q5_0.
"gate_up": down_proj kept, so Q4_K is Q4_K at 4.5 bits, the like-for-like grid comparison.

| routed experts as | bits | qwen2moe experts | gate_up | mixtral experts | gate_up |
|---|---|---|---|---|---|
| llama.cpp Q4_0 | 4.50 | 0.01384 (2.14) | 0.00684 (1.46) | 0.03088 (2.01) | 0.01684 (1.38) |
| llama.cpp Q4_K (down Q5_0 in "experts") | 4.83 / 4.50 | 0.00646 (1.00) | 0.00470 (1.00) | 0.01539 (1.00) | 0.01219 (1.00) |
| llama.cpp Q4_K + our imatrix | 4.83 / 4.50 | 0.00624 (0.97) | 0.00460 (0.98) | 0.01443 (0.94) | 0.01180 (0.97) |
| llama.cpp Q4_K_M (+ our imatrix) | 5.33 / 4.50 | 0.00587 (+im 0.00581) | 0.00470 (+im 0.00460) | 0.01426 (+im 0.01348) | 0.01219 (+im 0.01180) |
| int4-g32-sym RTN, min/max / searched | 4.50 | 0.01704 / 0.01403 | 0.00853 / 0.00692 | 0.03665 / 0.02962 | 0.02144 / 0.01687 |
| int4-g32-sym GPTQ, min/max grid (the earlier pass) | 4.50 | 0.01068 (1.65) | 0.00376 (0.80) | 0.02631 (1.71) | 0.01241 (1.02) |
| int4-g32-sym GPTQ, searched grid | 4.50 | 0.00952 (1.48) | 0.00361 (0.77) | 0.02140 (1.39) | 0.01096 (0.90) |
| ... routing-weighted Hessian | 4.50 | 0.00891 (1.38) | 0.00348 (0.74) | 0.02082 (1.35) | 0.01010 (0.83) |
| ... routing^2-weighted Hessian (dropped) | 4.50 | 0.00924 (1.43) | 0.00348 (0.74) | 0.02153 (1.40) | 0.01083 (0.89) |
| ... searched + scale refit (gptq_pass) | 4.50 | 0.00925 (1.43) | 0.00347 (0.74) | 0.02093 (1.36) | 0.01061 (0.87) |
| int4-g64-asym GPTQ, min/max / searched | 4.31 | 0.00985 / 0.00929 | 0.00365 / 0.00333 | 0.02286 / 0.02194 | 0.01037 / 0.01031 |
| int4-g32-asym GPTQ, min/max / searched / + refit | 4.63 | 0.00803 / 0.00752 / 0.00743 | 0.00288 / 0.00278 / 0.00271 | 0.01834 / 0.01715 / 0.01671 | 0.00855 / 0.00856 / 0.00797 |
| plan selective (vllm) at 4.5, earlier pass | 4.50 | 0.01088 (1.69) | | 0.02512 (1.63) | |
| plan selective (vllm) at 4.5, searched + refit | 4.50 | 0.00922 (1.43) | | 0.02100 (1.36) | |
| plan per-expert (transformers) at 4.5, earlier pass | 4.50 | 0.00722 (1.12) | | 0.01956 (1.27) | |
| plan per-expert (transformers) at 4.5, searched + refit | 4.50 | 0.00635 (0.98) | | 0.01741 (1.13) | |
| plan selective (vllm) at 4.5, + routing-weighted Hessians | 4.50 | 0.00905 (1.40) | | 0.01978 (1.29) | |
| plan per-expert (transformers) at 4.5, + routing-weighted Hessians | 4.50 | 0.00628 (0.97) | | 0.01633 (1.06) | |

(Plans: `moequant apply` of the bundled recipe with `experts.budget.bits_per_weight=4.5`; per-expert.yaml
offers asymmetric int4 g32 / g64 too. The "earlier pass" rows are the same run before the quantize pass
took the searched grid and the refit; a selective menu with int4 g64 / g128 added planned the same.)

What it shows: on the like-for-like scope moequant's vLLM-servable int4-g32-sym GPTQ beats llama.cpp's
Q4_K at the same 4.5 bits (0.74x / 0.87x with the quantize pass's grid and refit; 0.74x / 0.83x with
routing-weighted Hessians). Over all routed projections llama.cpp spends 5.5 bits on down_proj (Q5_0:
its K types need 256-wide rows), which our 4.5-bit int4 does not match: 1.36-1.43x. The searched grid
takes 10-19% off GPTQ's KL, the refit 1-3% more, routing-weighted Hessians 3-8%.
Run time: tiny-qwen2moe 31 min under load, tiny-mixtral 5 min.

Measured 2026-12-02 (second run, same defaults and windows; the llama.cpp and uniform rows reproduce the
table above to the digit): llama.cpp's Q4_K at its own 4.5 bits over every routed projection, i.e. with
the narrow down_proj rows in llama.cpp's Q4_0 instead of Q5_0 (`python benchmarks/bench_quality.py --uniform
int4-g32-sym/gptq/minmax/tokens,int4-g32-sym/gptq+refit/searched/tokens,int4-g32-sym/gptq+refit/searched/routing`,
then `--no-uniform --plans "selective;gptq.grid=searched;gptq.refit=true;calibration.hessian_weighting=routing
per-expert;gptq.grid=searched;gptq.refit=true;calibration.hessian_weighting=routing"`). KL, and its ratio
to that equal-bytes Q4_K:

| routed experts as (every projection) | bits | qwen2moe | mixtral |
|---|---|---|---|
| llama.cpp Q4_K, narrow rows Q4_0 | 4.50 | 0.01130 (1.00) | 0.02627 (1.00) |
| ... + our imatrix | 4.50 | 0.01112 (0.98) | 0.02378 (0.91) |
| llama.cpp Q4_K as llama.cpp stores it (narrow rows Q5_0) | 4.83 | 0.00646 (0.57) | 0.01539 (0.59) |
| int4-g32-sym GPTQ, plain (min/max grid, token Hessians: the pass before these became defaults) | 4.50 | 0.01068 (0.94) | 0.02631 (1.00) |
| int4-g32-sym GPTQ, searched + refit | 4.50 | 0.00925 (0.82) | 0.02093 (0.80) |
| ... + routing-weighted Hessians | 4.50 | 0.00887 (0.79) | 0.01958 (0.75) |
| plan selective (vllm) at 4.5, plain GPTQ | 4.50 | 0.01088 (0.96) | 0.02512 (0.96) |
| plan selective (vllm) at 4.5, gptq searched + refit, routing Hessians | 4.50 | 0.00905 (0.80) | 0.01978 (0.75) |
| plan per-expert (transformers) at 4.5, plain GPTQ | 4.50 | 0.00722 (0.64) | 0.01956 (0.74) |
| plan per-expert (transformers) at 4.5, gptq searched + refit, routing Hessians | 4.50 | 0.00628 (0.56) | 0.01633 (0.62) |

At equal bytes the vLLM-servable int4 beats Q4_K with the recipe's `gptq: {grid: searched, refit: true}` and
`calibration.hessian_weighting: routing` (0.79x / 0.75x), and so do the plans (selective 0.80x / 0.75x,
per-expert 0.56x / 0.62x); plain GPTQ ties it (0.94x / 1.00x). Against the 4.83 bits llama.cpp
actually spends, every 4.5-bit variant loses (see the first table). Since 2026-12-02 routing Hessians,
the searched grid and the refit are the recipe's defaults (the rows with them are what `moequant apply`
of a bundled recipe now gives; `gptq.grid=minmax`, `gptq.refit=false`,
`calibration.hessian_weighting=tokens` give the plain rows).

Measured 2026-12-02, then dropped (same defaults and windows, ratio to the equal-bytes Q4_K above): two
further GPTQ refinements from the literature, prototyped in the quantize pass and run through
`--no-uniform --weightings routing --plans "selective selective;gptq.true_sequential=true ..."`:
true-sequential within a layer (down_proj's Hessian from the *quantized* gate/up activations) and
GPTAQ's asymmetric calibration inside a layer (W* = W C (H_q + lambda I)^-1, C the cross-moment of
full-precision and quantized inputs).

| plan at 4.5 bits | qwen2moe | mixtral |
|---|---|---|
| selective (recipe defaults) | 0.00909 (0.80) | 0.01978 (0.75) |
| ... + true-sequential | 0.00896 (0.79) | 0.02010 (0.77) |
| ... + GPTAQ within the layer | 0.00999 (0.88) | 0.02142 (0.82) |
| per-expert (recipe defaults) | 0.00617 (0.55) | 0.01622 (0.62) |
| ... + true-sequential | 0.00625 (0.55) | 0.01637 (0.62) |
| ... + GPTAQ within the layer | 0.00711 (0.63) | 0.01682 (0.64) |

True-sequential helps one of the four (qwen2moe selective, by 1.4%, inside the evaluation's noise) and
hurts the other three; GPTAQ within a layer hurts all four (with 64 x 256 calibration tokens spread over
16 experts its cross-moment is noisier than the Hessian it corrects). Neither is in the product.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (format, algorithm, grid, Hessian weighting): the grids alone (RTN), GPTQ on each grid, the
# Hessian weightings on the best of them, and the asymmetric formats
OURS = (
    ("int4-g32-sym", "rtn", "minmax", "tokens"), ("int4-g32-sym", "rtn", "searched", "tokens"),
    ("int4-g32-sym", "gptq", "minmax", "tokens"), ("int4-g32-sym", "gptq", "searched", "tokens"),
    ("int4-g32-sym", "gptq", "searched", "routing"),
    ("int4-g64-asym", "gptq", "minmax", "tokens"), ("int4-g64-asym", "gptq", "searched", "tokens"),
    ("int4-g32-asym", "gptq", "minmax", "tokens"), ("int4-g32-asym", "gptq", "searched", "tokens"),
    # the least-squares scale refit for GPTQ's codes (algorithms.refit)
    ("int4-g32-sym", "gptq+refit", "searched", "tokens"), ("int4-g32-asym", "gptq+refit", "searched", "tokens"),
)
LLAMA_TYPES = ("q4_0", "q4_k")
Q4_K_45 = "llama.cpp Q4_K, narrow rows Q4_0"


def llama_fallback(name: str, cols: int, narrow: str | None = None) -> str:
    """llama.cpp's type for a row of `cols` inputs: K types need 256 (Q4_K -> Q5_0, as llama.cpp
    converts), or `narrow` where given (Q4_0 keeps Q4_K's 4.5 bits on narrow rows)."""
    from moequant.formats.ggml import TYPES

    if cols % TYPES[name].block == 0:
        return name
    return narrow or {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0", "q3_k": "q4_0", "q2_k": "q4_0"}[name]


def main(argv=None) -> int:
    import torch

    from moequant import formats
    from moequant.algorithms.gptq import gptq
    from moequant.algorithms.refit import refit_scales
    from moequant.arch import adapter_for
    from moequant.calib.calibrate import (
        MIN_ROUTED_TOKENS,
        CalibrationSettings,
        calibrate,
        load_tokenizer,
    )
    from moequant.calib.data import load_samples
    from moequant.calib.stats import chosen_hessian, load_stats
    from moequant.evaluate import evaluate
    from moequant.export.verify_llamacpp import ggml_quantize
    from moequant.formats.ggml import dequantize_tensor
    from moequant.io.checkpoint import open_checkpoint
    from moequant.io.loader import from_pretrained_complete
    from moequant.zoo import path as zoo_path

    p = argparse.ArgumentParser()
    p.add_argument("--models", default="tiny-qwen2moe,tiny-mixtral,tiny-qwen3moe,tiny-deepseek-v3")
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--eval-samples", type=int, default=32)
    p.add_argument("--weightings", default="tokens,routing")
    p.add_argument("--q4-k-m", action="store_true", help="also Q4_K_M's mixture (a BF16 GGUF through llama_model_quantize)")
    p.add_argument("--scopes", default="experts",
                   help="experts: every routed projection quantized; gate_up: gate / up only (down kept)")
    p.add_argument("--plans", default="selective uniform-int4 per-expert per-expert;target=vllm-moequant",
                   help="bundled recipes run through `moequant apply` at --plan-bits (routed experts only), space "
                        "separated; RECIPE;KEY=VALUE;... adds recipe overrides (as `apply --set`)")
    p.add_argument("--plan-bits", type=float, default=4.5)
    p.add_argument("--no-uniform", action="store_true", help="skip moequant's uniform variants (plans and llama.cpp only)")
    p.add_argument("--no-gguf", action="store_true", help="skip moequant's own Q4_K (its GGUF quantizer)")
    p.add_argument("--uniform", default=None,
                   help="only these uniform variants, comma separated FORMAT/ALGORITHM/GRID/WEIGHTING "
                        "(e.g. int4-g32-sym/gptq+refit/searched/tokens); default: all of OURS")
    p.add_argument("--output", default=str(ROOT / "runs" / "bench_quality"))
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    weightings = args.weightings.split(",")
    results = {}
    for model in args.models.split(","):
        t0 = time.time()
        out = Path(args.output) / model
        src = zoo_path(model)
        ckpt = open_checkpoint(src)
        ad = adapter_for(ckpt.config)
        windows = load_samples("builtin:mix", load_tokenizer(src), args.eval_samples, args.seq_len, split="evaluation")
        ref = from_pretrained_complete(src, torch.float32).eval()
        original = {(L, pj): ad.read_experts(ckpt, L, pj).float() for L in ad.moe_layers for pj in ad.projections}
        stats = {}
        for wt in weightings:
            settings = CalibrationSettings(dataset="builtin:mix", samples=args.samples, seq_len=args.seq_len, seed=0,
                                           all_experts=True, save_hessians=True, hessian_weighting=wt,
                                           formats=("int4-g128-sym",), probe_samples=0)
            stats[wt] = load_stats(calibrate(str(src), out / f"stats-{wt}", settings, overwrite=True, progress=False))

        def kl_of(deq: dict, label: str, nbytes: dict, scope, bits=None) -> dict:
            """KL of the model whose `scope` projections are `deq`'s (the others original)."""
            deq = {k: (v if k[1] in scope else original[k]) for k, v in deq.items()}
            q_model = copy.deepcopy(ref)
            with torch.no_grad():
                for L in ad.moe_layers:
                    ex = ad.experts_module(q_model, L)
                    ex.gate_up_proj.copy_(torch.cat([deq[(L, "gate")], deq[(L, "up")]], dim=1))
                    ex.down_proj.copy_(deq[(L, "down")])
            q = evaluate(ref, q_model, windows, per_expert=False)
            if bits is None:
                stored = sum(b for k, b in nbytes.items() if k[1] in scope)
                bits = 8 * stored / sum(w.numel() for k, w in original.items() if k[1] in scope)
            row = {"kl_mean": q["kl_mean"], "kl_p99": q["kl_p99"], "top1": q["top1_agreement"], "bits": bits}
            print(f"  {label:<48}{row['bits']:>6.3f}{row['kl_mean']:>10.5f}{row['kl_p99']:>9.4f}{row['top1']:>8.4f}",
                  flush=True)
            return row

        # every variant's dequantized experts and bytes, (layer, proj) -> [E, out, in]
        variants = {}
        importance = {(L, pj): stats[weightings[0]].layers[L].tensors[
            f"input.{'down' if pj == 'down' else 'gate_up'}.sq_mean"].float() for (L, pj) in original}
        types_m, _ = q4_k_m_types(src, out, ad, {k: w.shape[-1] for k, w in original.items()}) if args.q4_k_m \
            else (None, None)
        # (type, imatrix, label, type of rows too narrow for it: None = llama.cpp's own fallback)
        llama = [(t, None, f"llama.cpp {t.upper()}", None) for t in LLAMA_TYPES]
        llama += [("q4_k", "imatrix", "llama.cpp Q4_K + our imatrix", None)]
        # Q4_K at its own 4.5 bits on every scope: narrow rows in llama.cpp's 4.5-bit Q4_0 instead of Q5_0
        llama += [("q4_k", None, Q4_K_45, "q4_0"), ("q4_k", "imatrix", Q4_K_45 + " + our imatrix", "q4_0")]
        if types_m:
            llama += [("q4_k_m", "imatrix", "llama.cpp Q4_K_M + our imatrix", None),
                      ("q4_k_m", None, "llama.cpp Q4_K_M", None)]
        for name, im, label, narrow in llama:  # llama.cpp's own quantizer
            deq, nbytes, used = {}, {}, {}
            for (L, pj), w in original.items():
                t = types_m[(L, pj)] if name == "q4_k_m" else llama_fallback(name, w.shape[-1], narrow)
                used.setdefault(pj, set()).add(t)
                E, o, i = w.shape
                items = [(t, w[e].numpy(), None if im is None else importance[(L, pj)][e].numpy()) for e in range(E)]
                blocks = ggml_quantize(items)
                deq[(L, pj)] = torch.stack([dequantize_tensor(torch.from_numpy(b), t, (o, i)) for b in blocks])
                nbytes[(L, pj)] = sum(b.nbytes for b in blocks)
            variants[label] = (deq, nbytes, used)
        ours = OURS if args.uniform is None else [tuple(v.split("/")) for v in args.uniform.split(",")]
        for key, algo, grid, wt in () if args.no_uniform else ours:  # moequant
            if wt not in stats:
                continue
            spec = formats.parse_key(key)
            nbytes = {k: formats.nbytes(spec, tuple(w.shape)) for k, w in original.items()}
            deq = {}
            for (L, pj), w in original.items():
                group = "down" if pj == "down" else "gate_up"
                if algo == "rtn":
                    imp = importance[(L, pj)] if grid == "searched" else None
                    deq[(L, pj)] = formats.quantize(w, spec, grid=grid, importance=imp).dequantize()
                else:
                    _, H = chosen_hessian(stats[wt].layers[L].tensors, group, torch.arange(ad.num_experts),
                                          MIN_ROUTED_TOKENS)
                    q, _ = gptq(w, H.float(), spec, act_order=True, static_groups=True, grid=grid)
                    if algo == "gptq+refit":
                        q = refit_scales(q, w, H)
                    deq[(L, pj)] = q.dequantize()
            label = f"{key} {algo} {grid}" + (f" H:{wt}" if algo != "rtn" else "")
            variants[label] = (deq, nbytes, None)

        # moequant's own GGUF quantizer on the routed experts (what recipes/gguf.yaml's algorithms give them):
        # Q4_K with the narrow rows in Q4_0 (4.5 bits) or Q5_0 (llama.cpp's fallback), imatrix = our scale
        # search weighted by the inputs' second moments, gptq = GPTQ on the type's grid
        for narrow, algo in () if args.no_uniform or args.no_gguf else (("q4_0", "imatrix"), ("q4_0", "gptq"),
                                                                         (None, "gptq")):
            wt = weightings[-1]
            deq, nbytes, used = {}, {}, {}
            for (L, pj), w in original.items():
                t = llama_fallback("q4_k", w.shape[-1], narrow)
                used.setdefault(pj, set()).add(t)
                if algo == "gptq":
                    _, H = chosen_hessian(stats[wt].layers[L].tensors, "down" if pj == "down" else "gate_up",
                                          torch.arange(ad.num_experts), MIN_ROUTED_TOKENS)
                    q = formats.quantize_ggml(w, t, hessian=H.float())
                else:
                    q = formats.quantize_ggml(w, t, importance=importance[(L, pj)])
                deq[(L, pj)] = q.dequantize()
                nbytes[(L, pj)] = formats.nbytes(formats.parse_key(t), tuple(w.shape))
            label = f"moequant Q4_K {algo}" + (f" H:{wt}" if algo == "gptq" else "") + (
                ", narrow rows Q4_0" if narrow else "")
            variants[label] = (deq, nbytes, used)

        plans = {}
        for i, entry in enumerate(args.plans.split()):  # the product: calibrate, plan, quantize
            label, deq, bits = plan_variant(entry, i, model, args, out, ad, original)
            plans[label] = bits
            variants[label] = (deq, None, None)

        for scope_name in args.scopes.split(","):
            scope = ad.projections if scope_name == "experts" else ("gate", "up")
            print(f"\n{model}, {scope_name} quantized: {len(windows)} x {args.seq_len} held-out tokens")
            print(f"  {'variant':<48}{'bits':>6}{'KL mean':>10}{'KL p99':>9}{'top-1':>8}")
            rows = {}
            for label, (deq, nbytes, used) in variants.items():
                if label in plans and scope_name != "experts":
                    continue  # a plan's budget covers every routed projection
                types = "" if used is None else " (%s)" % "/".join(sorted(set().union(*(used[p] for p in scope))))
                rows[label] = kl_of(deq, label + types, nbytes, scope, bits=plans.get(label))
            for base_label in ("llama.cpp Q4_K", "llama.cpp Q4_K + our imatrix", Q4_K_45):
                base = rows[base_label]["kl_mean"]
                print(f"  KL / {base_label}'s ({rows[base_label]['bits']:.2f} bits), moequant at <= 4.5 bits: " +
                      ", ".join(f"{k}: {v['kl_mean'] / base:.3f}" for k, v in rows.items()
                                if v["bits"] <= 4.5 + 1e-9 and not k.startswith("llama")))
            results.setdefault(model, {})[scope_name] = rows
            results[model]["seconds"] = time.time() - t0
            Path(args.output).mkdir(parents=True, exist_ok=True)
            (Path(args.output) / "results.json").write_text(json.dumps(results, indent=2))
    return 0


def plan_variant(entry: str, index: int, model: str, args, out: Path, ad, original: dict):
    """`moequant apply` of a bundled recipe at --plan-bits bits per routed-expert weight, everything
    but the routed experts kept: (label, {(layer, proj): dequantized [E, out, in]}, the plan's bits)."""
    import torch

    from moequant.evaluate import load_quantized
    from moequant.pipeline.apply import apply
    from moequant.plan.policy import read_plan

    recipe_name, *extra = entry.split(";")
    run = out / f"plan-{index}-{recipe_name}"
    overrides = [*extra, f"model=zoo:{model}", f"output={run}", f"experts.budget.bits_per_weight={args.plan_bits}",
                 f"calibration.samples={args.samples}", f"calibration.seq_len={args.seq_len}",
                 "evaluate.samples=1", "evaluate.seq_len=16"]  # the bench evaluates on its own windows
    apply(recipe_name, overrides=overrides, progress=False, log=lambda *a, **k: None)
    plan = read_plan(run / "plan.json")
    q_model = load_quantized(run / "checkpoint", dtype=torch.float32)
    deq = {}
    for L in ad.moe_layers:
        for pj in ad.projections:
            deq[(L, pj)] = torch.stack([ad.expert_from_module(ad.experts_module(q_model, L), e, pj).detach().float()
                                        for e in range(ad.num_experts)])
            assert deq[(L, pj)].shape == original[(L, pj)].shape
    label = f"plan {recipe_name} ({plan.target}) @ {args.plan_bits} bits" + "".join(f" {x}" for x in extra)
    return label, deq, plan.summary["bits_per_weight"]["routed_experts"]


def q4_k_m_rule(ad, cols: dict) -> dict:
    """{(layer, proj): ggml type} of llama.cpp's Q4_K_M for the routed experts, from its rules
    (llama-quant.cpp of llama-cpp-python 0.3.36, llama_tensor_get_type): in a model with experts a
    tensor's layer is its block index and n_layer counts every block; ffn_down is Q6_K where
    use_more_bits(i, n) = i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2, else Q4_K; gate / up stay Q4_K;
    then tensor_type_fallback for rows a block does not divide (Q4_K -> Q5_0, Q6_K -> Q8_0).
    `q4_k_m_types` checks this against llama_model_quantize itself where our GGUF export runs."""
    n = ad.num_layers

    def more_bits(i):
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

    return {(L, pj): llama_fallback("q6_k" if pj == "down" and more_bits(L) else "q4_k", cols[(L, pj)])
            for L in ad.moe_layers for pj in ad.projections}


def q4_k_m_types(src, out: Path, ad, cols: dict) -> tuple[dict, str]:
    """({(layer, proj): ggml type} that llama_model_quantize's Q4_K_M gives the routed-expert tensors,
    where they came from): read back from llama.cpp's output for a BF16 GGUF of the model, checked
    against `q4_k_m_rule`; the rule alone where moequant's GGUF export does not take the architecture."""
    from moequant.errors import UserError
    from moequant.export.gguf import GGUF_FILE
    from moequant.export.layouts import export_checkpoint
    from moequant.export.verify_llamacpp import quantize, tensor_types

    rule = q4_k_m_rule(ad, cols)
    try:
        bf16 = export_checkpoint(src, {}, out / "bf16", layout="gguf", target="llama.cpp")
    except UserError as e:
        print(f"  Q4_K_M types from llama.cpp's rules (q4_k_m_rule), not its quantizer: {e}", flush=True)
        return rule, "rule"
    dst = out / "q4_k_m.gguf"
    rc = quantize(bf16 / GGUF_FILE, dst, "Q4_K_M")["rc"]
    assert rc == 0, f"llama_model_quantize failed ({rc})"
    types = tensor_types(dst)["types"]
    gguf_proj = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps"}
    types = {(L, pj): types[f"blk.{L}.{gguf_proj[pj]}.weight"].lower() for L in ad.moe_layers for pj in ad.projections}
    assert types == rule, (types, rule)
    return types, "llama_model_quantize"


if __name__ == "__main__":
    raise SystemExit(main())
