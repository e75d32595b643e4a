"""AWQ in the quantize pass: the layer preparation (`prepare_layer`), refusals (`refusal`) and report entries
that the algorithm registry joins to the pass (registry.Algorithm's hooks; the search itself is awq.py).

For each MoE layer whose plan rows name awq (round-to-nearest after scaling):
- down_proj: one scale per expert, searched on the expert's own routed tokens (all tokens for an
  expert with fewer than `min_tokens`: reported), folded into the output rows of the same
  expert's up_proj (exact in float);
- gate_proj / up_proj read the layer's normalised hidden state, shared by every expert, the
  router and the shared expert, so a per-expert scale cannot be folded: one scale per layer
  (the shared variant) is searched on the error of all AWQ experts together (each in its own
  format, weighted by its routed tokens) and folded into `post_attention_layernorm` (divided)
  and every consumer of its output (multiplied): all routed experts' gate/up, the router, the
  shared expert's gate/up and shared_expert_gate. These full-precision tensors keep their dtype
  and are returned beside the quantized ones (plain tensors, exported as they are); the layer's
  routing with them is compared with the original routing (report). The shared scale's alpha is
  searched on the MoE block's routed output with down_proj quantized as the pass quantizes it, on
  the first 3/4 of the recorded calibration tokens, and kept only if the clipped, quantized block
  is also better on the last 1/4 (else s = 1: round-to-nearest);
- after scaling, every AWQ weight's per-group range is clipped where that lowers its calibration
  output error (`awq_clip`, AWQ's second step), then rounded to nearest by the pass.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from moequant import formats
from moequant.algorithms.awq import SharedGroup, awq_clip, awq_scales, awq_shared_scale, awq_shared_scale_moe
from moequant.algorithms.layer import LayerToPrepare, PreparedLayer
from moequant.io.checkpoint import save_atomic

GRID = 20  # alpha steps of the AWQ scale search
HOLDOUT = 0.25  # share of the recorded calibration tokens that validates the shared gate/up scale


def refusal(adapter, rows, processes: int) -> str | None:
    """Why AWQ cannot run here, or None: it runs on routed experts of architectures whose folds are exact, in
    one process. `rows`: the plan rows that name it (none when precheck asks before the plan exists)."""
    if adapter.fused_experts:
        return (
            f"algorithm awq is not supported for {adapter.model_type}: its experts are fused on disk and "
            "its activation clamps up_proj, so the down_proj scale cannot be folded exactly; use gptq or rtn."
        )
    for layer in sorted({t.layer for t in rows if t.role == "routed_expert"}):
        norm = f"model.layers.{layer}.post_attention_layernorm.weight"
        if norm not in adapter.expected_tensors():
            return (
                f"algorithm awq needs {norm} to fold the shared gate/up scale into; {adapter.model_type} "
                "has none; use gptq or rtn."
            )
    if processes > 1:
        return (
            "algorithm awq runs in one process only (its shared gate/up scale is searched over all of a "
            "layer's experts together); run it without torchrun, or use gptq or rtn."
        )
    other = sorted(t.name for t in rows if t.role != "routed_expert")
    if other:
        return (
            f"algorithm awq is implemented for routed experts only; the plan asks it for {other[0]} "
            "(a non-expert tensor); use rtn or gptq for that format."
        )
    return None


def prepare_layer(layer: LayerToPrepare) -> PreparedLayer:
    """AWQ scales of one MoE layer, applied to `layer.weights` (proj -> [E, out, in] float32, in place).

    down_proj: per expert, on the expert's own routed-token statistics (`awq_scales`). gate/up:
    one scale for the layer, searched on the MoE block's routed output over the calibration
    `tokens` (x, indices, weights, act; `awq_shared_scale_moe`), else on each expert's gate/up
    output error through its Hessian, weighted by its tokens (`awq_shared_scale`).

    Returns the input scale [H] (or None), the full-precision replacements {on-disk name: float32 tensor},
    which experts' weights the folds changed, and the report entries `finish` writes."""
    adapter, plan_rows = layer.adapter, layer.rows
    E = adapter.num_experts
    changed = {p: torch.zeros(E, dtype=torch.bool) for p in adapter.projections}
    report, replaced = {}, {}
    down_scales = torch.ones(E, adapter.expert_intermediate)
    by = {}
    for t in plan_rows:
        if t.quantized and t.algorithm == layer.algorithm:
            by.setdefault((t.proj, t.format), []).append(t.expert)

    # down_proj: per expert, folded into the output rows of the same expert's up_proj
    for (proj, key), experts in sorted(by.items()):
        if proj != "down":
            continue
        idx = torch.tensor(sorted(experts))
        scales, entry = _awq_down(layer, key, idx)
        down_scales[idx] = scales
        report[f"down:{key}"] = entry
        changed["down"][idx] = changed["up"][idx] = True

    # gate_proj / up_proj: one scale for the layer (they share the normalised input)
    shared = {(proj, key): experts for (proj, key), experts in by.items() if proj in ("gate", "up")}
    scale = None
    if shared:
        scale, folded, shared_replaced, shared_report = _awq_shared_gate_up(layer, shared)
        replaced.update(shared_replaced)
        report.update(shared_report)
        # every routed expert reads the folded norm's output; without a fold (s = 1) only the down_proj
        # fold changed experts (their up rows)
        for proj in ("gate", "up"):
            changed[proj][:] = folded
        changed["up"] |= changed["down"]
    report["scales"] = {"down": down_scales, "input": scale if scale is not None else torch.ones(adapter.hidden)}
    return PreparedLayer(scale, replaced, changed, functools.partial(_finish, report))


def _awq_down(layer: LayerToPrepare, key: str, idx: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """AWQ of the down_proj of experts `idx` in format `key`: per-expert scales (on each expert's own
    routed-token statistics) folded into the same experts' up_proj rows, then the scaled weights clipped;
    `weights` changed in place. Returns (the scales [len(idx), I], report entry)."""
    weights, device, min_tokens = layer.weights, layer.device, layer.rule.min_tokens
    own, counts, H, m, used = layer.choose("down", idx)
    scales, rep = awq_scales([weights["down"][idx]], key, hessian=H, mean_abs=m, tokens=used, grid=GRID, device=device)
    scales = scales.to("cpu", torch.float32)
    weights["down"][idx] *= scales[:, None, :]
    weights["up"][idx] /= scales[:, :, None]
    clipped = awq_clip(weights["down"][idx], key, H / (scales[:, :, None] * scales[:, None, :]), device=device)
    weights["down"][idx] = clipped.weight.to("cpu", torch.float32)
    ids = idx.tolist()
    fallbacks = {
        str(e): f"all-tokens statistics: {int(counts[i])} routed tokens < {min_tokens}"
        for i, e in enumerate(ids)
        if not own[i]
    }
    fallbacks.update({str(ids[i]): f"{rep.method[i]}: {rep.reason[i]}" for i in range(len(ids)) if rep.reason[i]})
    return scales, {
        "variant": "per expert, folded into the same expert's up_proj rows",
        "alpha": dict(zip(map(str, ids), rep.alpha)),
        "calibration_error_rtn": dict(zip(map(str, ids), rep.error_rtn)),
        "calibration_error_awq": dict(zip(map(str, ids), rep.error_awq)),
        "clip": _clip_report(clipped, ids),
        "fallbacks": fallbacks,
    }


def _awq_shared_gate_up(layer: LayerToPrepare, shared: dict):
    """The layer's one gate/up input scale (`shared`: (proj, format) -> AWQ experts): searched, multiplied
    into every routed expert's gate/up (in place), the AWQ rows clipped, and folded into the
    post-attention norm and its other consumers unless it is 1.
    Returns (scale [H], folded, full-precision replacements, report entries)."""
    adapter, ckpt, weights, device = layer.adapter, layer.ckpt, layer.weights, layer.device
    shared_keys = sorted(shared)
    groups, info = [], []
    for proj, key in shared_keys:
        idx = torch.tensor(sorted(shared[(proj, key)]))
        own, counts, H, _, _ = layer.choose("gate_up", idx)
        # each expert's error counts once per routed token (sum over experts = error over all
        # tokens); an expert no token reached still counts as one
        groups.append(SharedGroup(weights[proj][idx], key, H, counts.clamp(min=1).double()))
        info.append((proj, key, idx.tolist(), own, counts))
    res, objective = _search_shared_scale(layer, groups, layer.statistics["input.gate_up.abs_mean"][0])
    scale = res.scale.to("cpu", torch.float32)
    for proj in ("gate", "up"):
        weights[proj] *= scale  # every routed expert reads the folded norm's output
    clips = {}
    for (proj, key), (g, (_, _, ids, _, _)) in zip(shared_keys, zip(groups, info)):
        idx = torch.tensor(ids)
        clipped = awq_clip(weights[proj][idx], key, g.hessian / (scale[:, None] * scale[None, :]), device=device)
        weights[proj][idx] = clipped.weight.to("cpu", torch.float32)
        clips[(proj, key)] = _clip_report(clipped, ids)
    norm = f"model.layers.{layer.layer}.post_attention_layernorm.weight"
    consumers = _input_consumers(adapter, ckpt, layer.layer)
    folded = bool((scale != 1).any())  # alpha = 0: s = 1, nothing to fold (tensors stay as they are)
    replaced = {}
    if folded:
        replaced[norm] = ckpt.get(norm).float() / scale
        for name in consumers:
            replaced[name] = ckpt.get(name).float() * scale
    report = _shared_scale_report(res, scale, objective, info, clips, [norm] + consumers if folded else [])
    return scale, folded, replaced, report


def _search_shared_scale(layer: LayerToPrepare, groups: list, magnitude: torch.Tensor):
    """The shared gate/up scale's search: on the MoE block's routed output over the recorded calibration
    tokens when there are any, else on each expert's gate/up output error through its Hessian.
    Returns (the search's result, the objective in words)."""
    plan_rows, weights, tokens, device = layer.rows, layer.weights, layer.tokens, layer.device
    if not (tokens and tokens.get("x")):
        res = awq_shared_scale(groups, magnitude, grid=GRID, device=device)
        return res, "each expert's gate/up output error through its Hessian, weighted by its routed tokens"
    specs = [None] * layer.adapter.num_experts  # per expert: (gate format, up format) of its AWQ rows
    for t in plan_rows:
        if t.quantized and t.proj in ("gate", "up") and t.algorithm == layer.algorithm:
            pair = list(specs[t.expert] or (None, None))
            pair[("gate", "up").index(t.proj)] = t.format
            specs[t.expert] = tuple(pair)
    # down_proj as the quantized block will have it: AWQ rows are round-to-nearest of the
    # scaled, clipped weights; other quantized rows are approximated by round-to-nearest
    down_hat = weights["down"].clone()
    for key in sorted({t.format for t in plan_rows if t.proj == "down" and t.quantized}):
        idx = torch.tensor(sorted(t.expert for t in plan_rows if t.proj == "down" and t.format == key))
        down_hat[idx] = formats.quantize(down_hat[idx], key).dequantize(torch.float32)
    res = awq_shared_scale_moe(
        torch.cat(tokens["x"]),
        torch.cat(tokens["indices"]),
        torch.cat(tokens["weights"]),
        weights["gate"],
        weights["up"],
        weights["down"],
        specs,
        tokens["act"],
        magnitude,
        grid=GRID,
        device=device,
        down_hat=down_hat,
        holdout=HOLDOUT,
        clip=True,
    )
    return res, (
        "MoE block output over the calibration tokens (routing-weighted; down quantized as the pass "
        f"does); alpha chosen on the first {1 - HOLDOUT:.0%} of the tokens, kept only if the "
        f"clipped, quantized block is also better on the last {HOLDOUT:.0%}"
    )


def _shared_scale_report(
    res, scale: torch.Tensor, objective: str, info: list, clips: dict, folded_into: list[str]
) -> dict:
    """Report entries of the shared gate/up scale: one per (proj, format) of `info`, and "shared_scale"."""
    report = {}
    for proj, key, ids, own, counts in info:
        report[f"{proj}:{key}"] = {
            "variant": (
                "shared gate/up scale folded into post_attention_layernorm, router"
                + (", shared expert" if any("shared_expert" in n for n in folded_into) else "")
            )
            if folded_into
            else "shared gate/up scale s = 1 (alpha = 0: no gain confirmed), nothing folded",
            "alpha": res.alpha,
            "clip": clips[(proj, key)],
            "routed_tokens": dict(zip(map(str, ids), counts.tolist())),
            "fallbacks": {
                str(e): "0 routed tokens: gets the layer's shared scale"
                for i, e in enumerate(ids)
                if int(counts[i]) == 0
            },
        }
    report["shared_scale"] = {
        "alpha": res.alpha,
        "objective": objective,
        "folded_into": folded_into,
        "scale_min": float(scale.min()),
        "scale_max": float(scale.max()),
        "objective_rtn": res.objective[0],
        "objective_awq": res.objective[int(round(res.alpha * GRID))],
        "objective_best": min(res.objective),
        "validation": res.validation,
    }
    return report


def _clip_report(clipped, ids) -> dict:
    """Per expert: share of weight groups whose range AWQ clipped, and the calibration output error
    of round-to-nearest after scaling, without and with the clipping (relative to each other)."""
    share = (clipped.ratio < 1).double().mean(dim=(1, 2))
    gain = clipped.error_after / clipped.error_before.clamp(min=1e-30)
    return {
        "clipped_groups": dict(zip(map(str, ids), share.tolist())),
        "error_ratio": dict(zip(map(str, ids), gain.tolist())),
    }


def _input_consumers(adapter, ckpt, layer: int) -> list[str]:
    """Non-expert tensors of an MoE layer that read the normalised hidden state (their input columns
    are multiplied by the shared gate/up scale): router, shared expert gate/up, shared_expert_gate."""
    out = []
    for name in adapter.layer_tensor_names(layer):
        role = adapter.classify(name)
        shape = tuple(ckpt.shape(name))
        reads_input = role.role in ("router", "shared_expert_gate") or (
            role.role == "shared_expert" and role.proj in ("gate", "up")
        )
        if reads_input and name.endswith(".weight") and len(shape) == 2 and shape[1] == adapter.hidden:
            out.append(name)
    return out


def _finish(
    awq_report: dict, report: dict, routing_before, routing_after, attention_quantized: bool, scales_file: Path
) -> None:
    """AWQ's per-expert diagnostics into the layer report; its scales into `scales_file` (diagnostics for
    tests and reports: the checkpoint holds the folds themselves)."""
    scales = awq_report.pop("scales", None)
    if scales is not None:
        save_atomic(scales, scales_file, {})
    shared = awq_report.pop("shared_scale", None)
    for k, v in awq_report.items():
        report[k]["awq"] = v
    if shared is None:
        return
    report["awq_shared_scale"] = shared
    if routing_after:
        same = sum(int((a == b).all(-1).sum()) for a, b in zip(routing_before, routing_after))
        total = sum(a.shape[0] for a in routing_before)
        shared["routing_agreement"] = same / max(total, 1)
        shared["routing_note"] = (
            "top-k expert sets of the calibration tokens, original layer vs. the exported one (folded "
            "norm/router in their dtype" + (", quantized attention" if attention_quantized else "") + ")"
        )
