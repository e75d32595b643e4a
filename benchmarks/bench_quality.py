"""Quality per byte of the routed experts: moequant's integer grids and algorithms against
llama.cpp's own Q4_0 / Q4_K / Q4_K + imatrix / Q4_K_M, on the same held-out windows.

    python benchmarks/bench_quality.py [--models tiny-qwen2moe,tiny-mixtral,tiny-qwen3moe,tiny-deepseek-v3] [--samples 128]
        [--eval-samples 256] [--q4-k-m]

Only the routed experts are quantized; everything else keeps the original float32 weights, so the
KL (original || quantized, per token as evaluate.evaluate computes it, on the evaluation split, 256 x 256 tokens by default: every
window the split has at that length; with 32 windows, the default until 2026-12-05, the ratios' 95% range
was +-5-8% and their values 3-7% lower on tiny-deepseek-v3 than over all 256)
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
table and writes runs/bench_quality/results.json (with every variant's mean KL per evaluation
window). The ratios to llama.cpp's rows come with a 95% range: the evaluation windows resampled with
replacement, the same windows for both variants (paired bootstrap), i.e. how far the ratio moves with
the evaluation text at this many windows. Prints numbers; asserts nothing.

Dated results, each with its command: benchmarks/RESULTS.md, section bench_quality.py.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests/support: llama.cpp's own quantizer and tensor types
# (format, algorithm, grid, Hessian weighting): the grids alone (RTN), GPTQ on each grid, the
# Hessian weightings on the best of them, and the asymmetric formats
OURS = (
    ("int4-g32-sym", "rtn", "minmax", "tokens"),
    ("int4-g32-sym", "rtn", "searched", "tokens"),
    ("int4-g32-sym", "gptq", "minmax", "tokens"),
    ("int4-g32-sym", "gptq", "searched", "tokens"),
    ("int4-g32-sym", "gptq", "searched", "routing"),
    ("int4-g64-asym", "gptq", "minmax", "tokens"),
    ("int4-g64-asym", "gptq", "searched", "tokens"),
    ("int4-g32-asym", "gptq", "minmax", "tokens"),
    ("int4-g32-asym", "gptq", "searched", "tokens"),
    # the least-squares scale refit for GPTQ's codes (algorithms.refit)
    ("int4-g32-sym", "gptq+refit", "searched", "tokens"),
    ("int4-g32-asym", "gptq+refit", "searched", "tokens"),
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
    from moequant.formats.ggml import dequantize_tensor
    from moequant.io.checkpoint import load_tokenizer, open_checkpoint
    from moequant.io.loader import from_pretrained_complete
    from moequant.llamacpp.runner import ggml_quantize
    from moequant.measure.calibrate import MIN_ROUTED_TOKENS, HessianRule, calibrate
    from moequant.measure.data import load_samples
    from moequant.measure.stats import chosen_hessian, load_stats
    from moequant.metrics import token_statistics
    from moequant.zoo import path as zoo_path
    from tests.support.plain import plain_settings

    p = argparse.ArgumentParser()
    p.add_argument("--models", default="tiny-qwen2moe,tiny-mixtral,tiny-qwen3moe,tiny-deepseek-v3")
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--eval-samples", type=int, default=256)
    p.add_argument("--weightings", default="tokens,routing")
    p.add_argument(
        "--q4-k-m", action="store_true", help="also Q4_K_M's mixture (a BF16 GGUF through llama_model_quantize)"
    )
    p.add_argument(
        "--scopes",
        default="experts",
        help="experts: every routed projection quantized; gate_up: gate / up only (down kept)",
    )
    p.add_argument(
        "--plans",
        default="selective uniform-int4 per-expert per-expert;target=vllm-moequant",
        help="bundled recipes run through `moequant apply` at --plan-bits (routed experts only), space "
        "separated; RECIPE;KEY=VALUE;... adds recipe overrides (as `apply --set`)",
    )
    p.add_argument("--plan-bits", type=float, default=4.5)
    p.add_argument("--plan-device", default="cpu", help="the device the plans' `moequant apply` runs on")
    p.add_argument(
        "--no-uniform", action="store_true", help="skip moequant's uniform variants (plans and llama.cpp only)"
    )
    p.add_argument("--no-gguf", action="store_true", help="skip moequant's own Q4_K (its GGUF quantizer)")
    p.add_argument(
        "--no-llama",
        action="store_true",
        help="skip llama.cpp's rows (a machine without llama-cpp-python; no ratios are printed)",
    )
    p.add_argument(
        "--uniform",
        default=None,
        help="only these uniform variants, comma separated FORMAT/ALGORITHM/GRID/WEIGHTING "
        "(e.g. int4-g32-sym/gptq+refit/searched/tokens); default: all of OURS",
    )
    p.add_argument("--output", default=str(ROOT / "runs" / "bench_quality"))
    p.add_argument(
        "--pass-damp",
        type=float,
        default=None,
        help="GPTQ's relative damping in the plans' quantize pass and probe (a benchmark-only lever: "
        "algorithms.gptq.gptq_shared_hessian's default, 0.01, replaced while the plans run)",
    )
    args = p.parse_args(argv)
    if args.pass_damp is not None:
        from moequant.algorithms import gptq as gptq_module

        gptq_module.gptq_shared_hessian.__kwdefaults__["damp"] = args.pass_damp
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
            settings = plain_settings(
                dataset="builtin:mix",
                samples=args.samples,
                seq_len=args.seq_len,
                seed=0,
                all_experts=True,
                save_hessians=True,
                hessian_weighting=wt,
                formats=("int4-g128-sym",),
                probe_samples=0,
            )
            stats[wt] = load_stats(calibrate(str(src), out / f"stats-{wt}", settings, overwrite=True, progress=False))

        with torch.no_grad():  # the float model's logits per window, computed once for every variant
            ref_logits = [ref(input_ids=w.input_ids[None]).logits[0] for w in windows]

        def token_kls(q_model) -> tuple[list, torch.Tensor]:
            """Per window: the KL of every token (metrics.token_statistics, float64, as evaluate.evaluate
            computes it), and whether each token's top-1 agrees."""
            kls, same = [], []
            with torch.no_grad():
                for r, w in zip(ref_logits, windows):
                    kl, agree, *_ = token_statistics(r, q_model(input_ids=w.input_ids[None]).logits[0])
                    kls.append(kl)
                    same.append(agree)
            return kls, torch.cat(same)

        def kl_of(deq: dict, label: str, nbytes: dict, scope, bits=None) -> dict:
            """KL of the model whose `scope` projections are `deq`'s (the others original)."""
            deq = {k: (v if k[1] in scope else original[k]) for k, v in deq.items()}
            q_model = copy.deepcopy(ref)
            with torch.no_grad():
                for L in ad.moe_layers:
                    ex = ad.experts_module(q_model, L)
                    ex.gate_up_proj.copy_(torch.cat([deq[(L, "gate")], deq[(L, "up")]], dim=1))
                    ex.down_proj.copy_(deq[(L, "down")])
            kls, same = token_kls(q_model)
            every = torch.cat(kls).numpy()
            if bits is None:
                stored = sum(b for k, b in nbytes.items() if k[1] in scope)
                bits = 8 * stored / sum(w.numel() for k, w in original.items() if k[1] in scope)
            row = {
                "kl_mean": float(every.mean()),
                "kl_p99": float(np.quantile(every, 0.99)),
                "top1": float(same.float().mean()),
                "bits": bits,
                "window_kl": [float(k.mean()) for k in kls],  # for the paired bootstrap of the ratios
            }
            print(
                f"  {label:<48}{row['bits']:>6.3f}{row['kl_mean']:>10.5f}{row['kl_p99']:>9.4f}{row['top1']:>8.4f}",
                flush=True,
            )
            return row

        # every variant's dequantized experts and bytes, (layer, proj) -> [E, out, in]
        variants = {}
        importance = {
            (L, pj): stats[weightings[0]]
            .layers[L]
            .tensors[f"input.{'down' if pj == 'down' else 'gate_up'}.sq_mean"]
            .float()
            for (L, pj) in original
        }
        types_m, _ = (
            q4_k_m_types(src, out, ad, {k: w.shape[-1] for k, w in original.items()}) if args.q4_k_m else (None, None)
        )
        # (type, imatrix, label, type of rows too narrow for it: None = llama.cpp's own fallback)
        llama = [(t, None, f"llama.cpp {t.upper()}", None) for t in LLAMA_TYPES]
        llama += [("q4_k", "imatrix", "llama.cpp Q4_K + our imatrix", None)]
        # Q4_K at its own 4.5 bits on every scope: narrow rows in llama.cpp's 4.5-bit Q4_0 instead of Q5_0
        if any(w.shape[-1] % 256 for w in original.values()):  # else these are Q4_K's rows again
            llama += [("q4_k", None, Q4_K_45, "q4_0"), ("q4_k", "imatrix", Q4_K_45 + " + our imatrix", "q4_0")]
        if types_m:
            llama += [
                ("q4_k_m", "imatrix", "llama.cpp Q4_K_M + our imatrix", None),
                ("q4_k_m", None, "llama.cpp Q4_K_M", None),
            ]
        for name, im, label, narrow in () if args.no_llama else llama:  # llama.cpp's own quantizer
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
        for key, algo_opts, grid, wt in () if args.no_uniform else ours:  # moequant
            if wt not in stats:
                continue
            algo, opts = lever_options(algo_opts)
            spec = formats.parse_key(key)
            nbytes = {k: formats.nbytes(spec, tuple(w.shape)) for k, w in original.items()}
            deq = {}
            for (L, pj), w in original.items():
                group = "down" if pj == "down" else "gate_up"
                if algo == "rtn":
                    imp = importance[(L, pj)] if grid == "searched" else None
                    deq[(L, pj)] = formats.quantize(w, spec, grid=grid, importance=imp).dequantize()
                else:
                    tensors = stats[wt].layers[L].tensors
                    _, H = chosen_hessian(tensors, group, torch.arange(ad.num_experts), HessianRule(MIN_ROUTED_TOKENS))
                    H = H.float()
                    if opts["blend"]:  # + blend x the all-tokens Hessian, both at unit mean diagonal
                        h_all = tensors[f"hessian.{group}"].float().expand_as(H)
                        H = unit_diag(H) + opts["blend"] * unit_diag(h_all)
                    s = None
                    if opts["awq"]:  # AWQ's input-channel scale before GPTQ: quantize W s under H / (s s^T)
                        # gate / up: one scale per layer (folded into the norm, router and shared experts),
                        # from the experts' mean input RMS; down: per expert (folded into up's rows), from diag(H)
                        imp_l = importance[(L, pj)].reshape(-1, w.shape[-1])
                        m = imp_l.mean(0, keepdim=True) if group == "gate_up" else H.diagonal(dim1=-2, dim2=-1)
                        s = m.clamp_min(1e-12).sqrt() ** opts["awq"]
                        s = s / (s.amax(-1, keepdim=True) * s.amin(-1, keepdim=True)).sqrt()
                        w, H = w * s[:, None, :], H / (s[:, :, None] * s[:, None, :])
                    with importance_transform(opts["imp"]):
                        q, _ = gptq(
                            w, H, spec, act_order=opts["order"], static_groups=True, grid=grid, damp=opts["damp"]
                        )
                    if algo == "gptq+refit":
                        q = refit_scales(q, w, H)
                        for _ in range(int(opts["iters"]) - 1):  # GPTQ again on the refitted scales, refit again
                            with importance_transform(opts["imp"]), given_scales(q.scales):
                                q, _ = gptq(
                                    w,
                                    H,
                                    spec,
                                    act_order=opts["order"],
                                    static_groups=True,
                                    grid=grid,
                                    damp=opts["damp"],
                                )
                            q = refit_scales(q, w, H)
                    deq[(L, pj)] = q.dequantize() if s is None else q.dequantize() / s[:, None, :]
            label = f"{key} {algo_opts} {grid}" + (f" H:{wt}" if algo != "rtn" else "")
            variants[label] = (deq, nbytes, None)

        # moequant's own GGUF quantizer on the routed experts (what recipes/gguf.yaml's algorithms give them):
        # Q4_K with the narrow rows in Q4_0 (4.5 bits) or Q5_0 (llama.cpp's fallback), imatrix = our scale
        # search weighted by the inputs' second moments, gptq = GPTQ on the type's grid
        for narrow, algo in (
            () if args.no_uniform or args.no_gguf else (("q4_0", "imatrix"), ("q4_0", "gptq"), (None, "gptq"))
        ):
            wt = weightings[-1]
            deq, nbytes, used = {}, {}, {}
            for (L, pj), w in original.items():
                t = llama_fallback("q4_k", w.shape[-1], narrow)
                used.setdefault(pj, set()).add(t)
                if algo == "gptq":
                    _, H = chosen_hessian(
                        stats[wt].layers[L].tensors,
                        "down" if pj == "down" else "gate_up",
                        torch.arange(ad.num_experts),
                        HessianRule(MIN_ROUTED_TOKENS),
                    )
                    q = formats.quantize_ggml(w, t, hessian=H.float())
                else:
                    q = formats.quantize_ggml(w, t, importance=importance[(L, pj)])
                deq[(L, pj)] = q.dequantize()
                nbytes[(L, pj)] = formats.nbytes(formats.parse_key(t), tuple(w.shape))
            label = (
                f"moequant Q4_K {algo}"
                + (f" H:{wt}" if algo == "gptq" else "")
                + (", narrow rows Q4_0" if narrow else "")
            )
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
                if base_label not in rows:
                    continue  # --no-llama
                base = rows[base_label]["kl_mean"]
                print(
                    f"  KL / {base_label}'s ({rows[base_label]['bits']:.2f} bits), moequant at <= 4.5 bits "
                    "[95% range over the evaluation windows, paired bootstrap]: "
                    + ", ".join(
                        f"{k}: {v['kl_mean'] / base:.3f} [%.3f, %.3f]"
                        % ratio_range(v["window_kl"], rows[base_label]["window_kl"])
                        for k, v in rows.items()
                        if v["bits"] <= 4.5 + 1e-9 and not k.startswith("llama")
                    )
                )
            results.setdefault(model, {})[scope_name] = rows
            results[model]["seconds"] = time.time() - t0
            Path(args.output).mkdir(parents=True, exist_ok=True)
            (Path(args.output) / "results.json").write_text(json.dumps(results, indent=2))
    return 0


def ratio_range(a, b, draws: int = 4000, seed: int = 0) -> tuple[float, float]:
    """2.5 and 97.5 percentiles of sum(a) / sum(b) over the evaluation windows resampled with
    replacement, the same windows for both (paired): how far the ratio of two variants' mean KLs moves
    with the evaluation text, at this many windows."""
    a, b = np.asarray(a), np.asarray(b)
    idx = np.random.default_rng(seed).integers(0, len(a), (draws, len(a)))
    r = a[idx].sum(1) / b[idx].sum(1)
    return float(np.percentile(r, 2.5)), float(np.percentile(r, 97.5))


# GPTQ levers of a uniform variant, ALGORITHM:KEY=VALUE:... (e.g. gptq+refit:damp=0.001:order=off):
# damp (relative damping, 0.01), order (act order on / off), blend (the all-tokens Hessian added at this
# weight, both at unit mean diagonal, 0 = off), imp (the searched grid's per-column weights: h = diag(H),
# the pass's; none = unweighted; sqrt = diag(H) ** 0.5), awq (AWQ's exponent alpha of the input-channel
# scale s = rms^alpha applied before GPTQ, 0 = off), iters (GPTQ + refit rounds: each further round runs
# GPTQ on the previous round's refitted scales, then refits)
LEVERS = {"damp": 0.01, "order": True, "blend": 0.0, "imp": "h", "awq": 0.0, "iters": 1}


@contextlib.contextmanager
def gptq_fixed_params(wrap):
    """Within the block, algorithms.gptq's `_fixed_params` (GPTQ's static group scales) is
    `wrap(original, *its arguments)` (the benchmark-only levers below)."""
    from moequant.algorithms import gptq as g

    original = g._fixed_params
    g._fixed_params = functools.partial(wrap, original)
    try:
        yield
    finally:
        g._fixed_params = original


def given_scales(scales):
    """Within the block, GPTQ's static group scales are `scales` ([E, out, G]) instead of the grid's."""

    def wrap(original, *args):
        params = original(*args)
        for per_group in params:
            for i, p in enumerate(per_group):
                per_group[i] = dataclasses.replace(
                    p, scales=scales[..., i : i + 1].to(p.scales.dtype).reshape(p.scales.shape)
                )
        return params

    return gptq_fixed_params(wrap)


def lever_options(text: str) -> tuple[str, dict]:
    algo, *pairs = text.split(":")
    opts = dict(LEVERS)
    for pair in pairs:
        k, v = pair.split("=")
        if k not in LEVERS:
            raise SystemExit(f"unknown GPTQ lever {k!r} in {text!r}; accepted: {', '.join(LEVERS)}")
        opts[k] = v in ("on", "true") if k == "order" else v if k == "imp" else float(v)
    return algo, opts


def unit_diag(h):
    return h / h.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)[..., None, None]


def importance_transform(imp: str):
    """Within the block, the searched grid's column weights diag(H) become `imp`'s."""
    if imp == "h":
        return contextlib.nullcontext()
    fn = {"none": lambda t: None, "sqrt": lambda t: None if t is None else t.clamp_min(0).sqrt()}[imp]

    def wrap(original, cqs, ws, spec, per_row, static_groups, importance, squeeze):
        return original(cqs, ws, spec, per_row, static_groups, fn(importance), squeeze)

    return gptq_fixed_params(wrap)


def plan_variant(entry: str, index: int, model: str, args, out: Path, ad, original: dict):
    """`moequant apply` of a bundled recipe at --plan-bits bits per routed-expert weight, everything
    but the routed experts kept: (label, {(layer, proj): dequantized [E, out, in]}, the plan's bits)."""
    import torch

    from moequant.evaluate import load_quantized
    from moequant.pipeline.apply import apply
    from moequant.plan.plan_io import read_plan

    recipe_name, *extra = entry.split(";")
    run = out / f"plan-{index}-{recipe_name}"
    overrides = [
        *extra,
        f"model=zoo:{model}",
        f"output={run}",
        f"experts.budget.bits_per_weight={args.plan_bits}",
        f"calibration.samples={args.samples}",
        f"calibration.seq_len={args.seq_len}",
        "evaluate.samples=1",
        "evaluate.seq_len=16",
    ]  # the bench evaluates on its own windows
    apply(recipe_name, overrides=overrides, device=args.plan_device, progress=False, log=lambda *a, **k: None)
    plan = read_plan(run / "plan.json")
    q_model = load_quantized(run / "checkpoint", dtype=torch.float32)
    deq = {}
    for L in ad.moe_layers:
        for pj in ad.projections:
            deq[(L, pj)] = torch.stack(
                [
                    ad.expert_from_module(ad.experts_module(q_model, L), e, pj).detach().float()
                    for e in range(ad.num_experts)
                ]
            )
            assert deq[(L, pj)].shape == original[(L, pj)].shape
    label = f"plan {recipe_name} ({plan.target}) @ {args.plan_bits} bits" + "".join(f" {x}" for x in extra)
    if args.pass_damp is not None:
        label += f" damp={args.pass_damp}"
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

    return {
        (L, pj): llama_fallback("q6_k" if pj == "down" and more_bits(L) else "q4_k", cols[(L, pj)])
        for L in ad.moe_layers
        for pj in ad.projections
    }


def q4_k_m_types(src, out: Path, ad, cols: dict) -> tuple[dict, str]:
    """({(layer, proj): ggml type} that llama_model_quantize's Q4_K_M gives the routed-expert tensors,
    where they came from): read back from llama.cpp's output for a BF16 GGUF of the model, checked
    against `q4_k_m_rule`; the rule alone where moequant's GGUF export does not take the architecture."""
    from moequant.errors import UserError
    from moequant.export.gguf import GGUF_FILE
    from moequant.export.write import export_checkpoint
    from tests.support.verify_llamacpp import quantize, tensor_types

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
