"""Activation-aware weight quantization (AWQ, Lin et al. 2023) for the experts of one MoE layer.

AWQ scales input channel j of a weight by s_j before quantizing and divides the input by s_j,
so channels that see large activations get finer quantization:
    y = x W^T = (x / s) (W * s)^T  ~  (x / s) Q(W * s)^T.
s = m^alpha, m = mean |x_j| over the calibration tokens, normalised by sqrt(max(s) * min(s));
alpha is picked from a grid (0, 1/grid, ..., 1 - 1/grid) by the calibration output error
    sum over weights of tr((Q(W s)/s - W) H (Q(W s)/s - W)^T),  H = X^T X / n,
computed for all experts at once from their Hessians. alpha = 0 is plain round-to-nearest, so
on the calibration tokens AWQ is never worse than RTN.

Where 1/s can go (the caller applies it; every function returns it as plain data):
- down_proj: its input act(gate x) * (up x) is divided by s when the same expert's up_proj
  output rows are divided by s: per-expert scales, folded exactly (`awq_down`).
- gate_proj / up_proj: they read the layer's normalised hidden state, which every expert, the
  router and the shared experts share. A per-expert scale cannot be folded there, so this is
  the shared variant: one scale per layer for all experts' gate and up, searched on the token-
  weighted error of all experts together (`awq_gate_up`). The caller divides the post-attention
  norm weight by it and multiplies the input columns of the router and of the shared experts'
  gate / up by it (the routed experts' scaled weights are returned). `awq_shared_scale` is the
  same search over several weight groups in different formats; `awq_shared_scale_moe` searches
  it on the MoE block's routed output over the calibration tokens, as the quantize pass will
  quantize the block (down_proj quantized too), and keeps alpha = 0 unless the chosen scale
  also lowers the error on a held-out fold of those tokens.

Weight clipping (`awq_clip`, AWQ's second step): after scaling, each group's quantization range
may shrink to r * max|w| (r = 1, 0.975, ..., 0.525); per (expert, output row, group) the r with
the smallest output error w_g H_gg w_g^T (the group's block of the Hessian of the scaled input)
is kept, and a row keeps its clipping only where its full error (cross-group terms included)
is lower than without. The clipped weight is quantized by plain round-to-nearest, so the
format's own scale rule stores the clipped range: no new tensor kinds in the checkpoint.
r = 1 everywhere is round-to-nearest.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import torch

from moequant.errors import UserError


@dataclass
class AWQReport:
    """Per expert (lists indexed by expert); plain data, `to_dict()` is JSON."""

    method: list[str]  # "awq"; "rtn" where the expert had no calibration tokens; "awq-shared" (layer scale)
    reason: list[str]
    alpha: list[float]  # chosen exponent (shared variant: the layer's one alpha for every expert)
    error_rtn: list[float]  # calibration output error with s = 1, relative to ||X W^T||^2
    error_awq: list[float]  # the same with the chosen scales
    tokens: list[int] | None = None
    settings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class AWQDown:
    """Result of `awq_down`: quantize `down_scaled`, use `up_folded` in place of up_proj."""

    quantized: object  # QuantizedTensor of down * s (round-to-nearest)
    down_scaled: torch.Tensor  # [E, H, I] down * s (for GPTQ after AWQ)
    up_folded: torch.Tensor  # [E, I, H] up / s on its output rows; the layer's output is unchanged
    scales: torch.Tensor  # [E, I]
    report: AWQReport


@dataclass
class AWQGateUp:
    """Result of `awq_gate_up` (shared variant): one input scale for the whole layer."""

    quantized_gate: object  # QuantizedTensor of gate * s
    quantized_up: object  # QuantizedTensor of up * s
    gate_scaled: torch.Tensor  # [E, I, H]
    up_scaled: torch.Tensor  # [E, I, H]
    input_scale: torch.Tensor  # [H]: divide the post-attention norm weight by it, multiply the
    #                            router's and shared experts' gate/up input columns by it
    report: AWQReport


def input_stats(inputs: Sequence[torch.Tensor], device=None):
    """Per-expert statistics AWQ needs from per-expert token lists [n_e, in]:
    (hessian [E, in, in] = X^T X / n, mean_abs [E, in] = mean |x|, tokens [E])."""
    n_in = inputs[0].shape[-1]
    device = torch.device(device) if device is not None else inputs[0].device
    h = torch.zeros(len(inputs), n_in, n_in, dtype=torch.float32, device=device)
    m = torch.zeros(len(inputs), n_in, dtype=torch.float32, device=device)
    counts = []
    for e, x in enumerate(inputs):
        x = x.reshape(-1, n_in).to(device, torch.float32)
        counts.append(int(x.shape[0]))
        if x.shape[0]:
            h[e] = x.T @ x / x.shape[0]
            m[e] = x.abs().mean(dim=0)
    return h, m, counts


def awq_scales(
    weights: Sequence[torch.Tensor],
    spec,
    *,
    hessian: torch.Tensor,
    mean_abs: torch.Tensor,
    tokens: Sequence[int] | None = None,
    shared: bool = False,
    grid: int = 20,
    chunk_experts: int | None = None,
    device=None,
):
    """Search the AWQ scales of weights [E, out_k, in] that read one input -> (scales, AWQReport).

    hessian [E, in, in] and mean_abs [E, in]: each expert's X^T X / n and mean |x| (`input_stats`).
    shared=False: one scale vector per expert, scales [E, in]. shared=True: one for the layer,
    scales [in], from the token-weighted mean |x| and error of all experts (`tokens` required).
    Cost: grid x E x out x in^2 multiply-adds per weight (the error through H), in chunks of
    `chunk_experts` experts moved to `device` (default: the weight's device; sized to free memory).
    """
    from moequant import formats

    spec = formats.get_format(spec)
    num_experts = weights[0].shape[0]
    _check(weights, hessian, mean_abs)
    if grid < 1:
        raise UserError(f"AWQ grid must be a positive number of alpha steps, got {grid}.")
    counts = _token_counts(tokens, num_experts, shared)
    device = torch.device(device) if device is not None else weights[0].device
    no_data = (hessian.diagonal(dim1=-2, dim2=-1).sum(-1) <= 0).to(device)
    if counts is not None:
        no_data |= torch.tensor(counts, device=device) == 0

    if shared:
        weight = torch.tensor(counts, dtype=torch.float32, device=device)
        magnitude = (mean_abs.to(device, torch.float32) * weight[:, None]).sum(0) / weight.sum().clamp(min=1)
    else:
        weight = None
        magnitude = mean_abs.to(device, torch.float32)

    alphas = [i / grid for i in range(grid)]
    errors, reference = _alpha_errors(weights, spec, hessian, magnitude, alphas, shared, chunk_experts, device)
    if shared:
        best = int(torch.argmin((errors * weight[None, :].double()).sum(1)))
        best_per_expert = torch.full((num_experts,), best, device=device)
        scales = _scales(magnitude, alphas[best])
    else:
        best_per_expert = torch.argmin(errors, dim=0)  # ties (e.g. no data) pick alpha = 0
        best_per_expert = torch.where(no_data, torch.zeros_like(best_per_expert), best_per_expert)
        scales = torch.stack([_scales(magnitude[e], alphas[int(b)]) for e, b in enumerate(best_per_expert)])

    ref = reference.clamp(min=1e-30)
    chosen = errors.gather(0, best_per_expert[None, :]).squeeze(0)
    if shared:
        method = ["awq-shared"] * num_experts
        reason = ["no calibration tokens: gets the layer's shared scale" if bool(nd) else "" for nd in no_data]
    else:
        method = ["rtn" if bool(nd) else "awq" for nd in no_data]
        reason = ["no calibration tokens: alpha = 0 (round-to-nearest)" if bool(nd) else "" for nd in no_data]
    report = AWQReport(
        method=method,
        reason=reason,
        alpha=[alphas[int(b)] for b in best_per_expert],
        error_rtn=[float(x) for x in errors[0] / ref],
        error_awq=[float(x) for x in chosen / ref],
        tokens=counts,
        settings=dict(spec=spec.key, grid=grid, shared=shared),
    )
    return scales, report


def _token_counts(tokens, num_experts: int, shared: bool) -> list[int] | None:
    """awq_scales' `tokens` as one int per expert (None when not given; the shared scale needs them)."""
    counts = None if tokens is None else [int(t) for t in torch.as_tensor(tokens).flatten().tolist()]
    if counts is not None and len(counts) != num_experts:
        raise UserError(f"tokens has {len(counts)} entries; expected one per expert ({num_experts}).")
    if shared and counts is None:
        raise UserError("AWQ with a shared (per-layer) scale needs the per-expert token counts (tokens=...).")
    return counts


def _alpha_errors(weights, spec, hessian, magnitude, alphas, shared: bool, chunk_experts, device):
    """awq_scales' search grid: (errors [alphas, E] = tr(dW H dW^T) summed over the weights at each
    alpha, reference [E] = ||X W^T||^2 / n), in chunks of `chunk_experts` experts on `device`."""
    from moequant import formats

    num_experts, n_in = weights[0].shape[0], weights[0].shape[-1]
    errors = torch.zeros(len(alphas), num_experts, dtype=torch.float64, device=device)  # [alphas, E]
    reference = torch.zeros(num_experts, dtype=torch.float64, device=device)  # ||X W^T||^2 / n
    if chunk_experts is None:  # after the allocations above: sized to the memory they leave free
        chunk_experts = _default_chunk(num_experts, sum(w.shape[1] for w in weights), n_in, device)
    for start in range(0, num_experts, max(1, int(chunk_experts))):
        part = slice(start, min(start + chunk_experts, num_experts))
        h = hessian[part].to(device, torch.float32)
        ws = [w[part].to(device, torch.float32) for w in weights]
        reference[part] = sum(_quadratic(w, h) for w in ws)
        for a, alpha in enumerate(alphas):
            s = _scales(magnitude if shared else magnitude[part], alpha)
            s_cols = s[None, None, :] if shared else s[:, None, :]
            for w in ws:
                w_hat = formats.quantize(w * s_cols, spec).dequantize(torch.float32) / s_cols
                errors[a, part] += _quadratic(w_hat - w, h)
        del h, ws
    return errors, reference


def awq(weight: torch.Tensor, spec, *, inputs=None, hessian=None, mean_abs=None, tokens=None, grid=20, device=None):
    """Per-expert AWQ of one projection -> (QuantizedTensor of weight * s, scales [E, in], AWQReport).

    Give either `inputs` (per-expert token tensors [n_e, in]) or `hessian` + `mean_abs`.
    The caller must divide the projection's input by `scales` upstream (see `awq_down` for the
    case where that fold is exact).
    """
    from moequant import formats

    h, m, counts = _stats(inputs, hessian, mean_abs, tokens, device or weight.device)
    scales, report = awq_scales([weight], spec, hessian=h, mean_abs=m, tokens=counts, grid=grid, device=device)
    scaled = weight.to(scales.device, torch.float32) * scales[:, None, :]
    return formats.quantize(scaled, spec), scales, report


def awq_down(
    down: torch.Tensor,
    up: torch.Tensor,
    spec,
    *,
    inputs=None,
    hessian=None,
    mean_abs=None,
    tokens=None,
    grid=20,
    device=None,
) -> AWQDown:
    """Per-expert AWQ of down_proj [E, H, I], its scales folded into the same expert's up_proj [E, I, H].

    inputs / hessian + mean_abs describe down_proj's input act(gate x) * (up x) per expert.
    down * s (columns) and up / s (output rows) compute the same layer as before in exact arithmetic.
    """
    from moequant import formats

    if up.shape[0] != down.shape[0] or up.shape[1] != down.shape[2]:
        raise UserError(
            f"awq_down: up_proj shape {tuple(up.shape)} does not match down_proj {tuple(down.shape)} "
            "(expected up [E, I, H] for down [E, H, I])."
        )
    h, m, counts = _stats(inputs, hessian, mean_abs, tokens, device or down.device)
    scales, report = awq_scales([down], spec, hessian=h, mean_abs=m, tokens=counts, grid=grid, device=device)
    down_scaled = down.to(scales.device, torch.float32) * scales[:, None, :]
    up_folded = up.to(scales.device, torch.float32) / scales[:, :, None]
    return AWQDown(formats.quantize(down_scaled, spec), down_scaled, up_folded, scales, report)


def awq_gate_up(
    gate: torch.Tensor,
    up: torch.Tensor,
    spec,
    *,
    inputs=None,
    hessian=None,
    mean_abs=None,
    tokens=None,
    grid=20,
    device=None,
) -> AWQGateUp:
    """Shared-variant AWQ of all experts' gate_proj and up_proj [E, I, H]: one input scale [H] per layer.

    Per-expert scales cannot be folded into the post-attention norm, which all experts share, so
    one scale is searched on the token-weighted error of every expert's gate and up together.
    inputs / hessian + mean_abs: each expert's routed tokens of the normalised hidden state.
    """
    from moequant import formats

    h, m, counts = _stats(inputs, hessian, mean_abs, tokens, device or gate.device)
    scale, report = awq_scales(
        [gate, up], spec, hessian=h, mean_abs=m, tokens=counts, shared=True, grid=grid, device=device
    )
    gate_scaled = gate.to(scale.device, torch.float32) * scale
    up_scaled = up.to(scale.device, torch.float32) * scale
    return AWQGateUp(
        formats.quantize(gate_scaled, spec), formats.quantize(up_scaled, spec), gate_scaled, up_scaled, scale, report
    )


@dataclass
class SharedGroup:
    """One set of weights [E, out, in] that reads the shared input, in one format (`awq_shared_scale`)."""

    weight: torch.Tensor  # [E, out, in]
    spec: object  # format spec or key
    hessian: torch.Tensor  # [E, in, in] or [1, in, in] (one Hessian for every expert)
    importance: torch.Tensor  # [E] weight of each expert's error in the objective (e.g. its routed tokens)


@dataclass
class AWQShared:
    """Result of `awq_shared_scale`: one input scale for every group."""

    scale: torch.Tensor  # [in]
    alpha: float
    objective: list[float]  # per alpha of the grid, relative to the unquantized outputs' energy
    error_rtn: list[list[float]]  # per group, per expert: relative calibration error with s = 1
    error_awq: list[list[float]]  # the same with the chosen scale
    validation: dict = field(default_factory=dict)  # awq_shared_scale_moe with holdout: the held-out check


def awq_shared_scale(
    groups: Sequence[SharedGroup],
    magnitude: torch.Tensor,
    *,
    grid: int = 20,
    chunk_experts: int | None = None,
    device=None,
) -> AWQShared:
    """One AWQ input scale [in] for several weight groups that read the same input, each in its own format.

    The objective of alpha is sum over groups and experts of importance_e * tr(dW_e H_e dW_e^T)
    with dW = Q(W s) / s - W (round-to-nearest in the group's format); s = magnitude^alpha
    normalised as in `awq_scales`. alpha = 0 (s = 1) is on the grid, so the chosen scale is
    never worse than round-to-nearest on this objective.
    """
    from moequant import formats

    if grid < 1:
        raise UserError(f"AWQ grid must be a positive number of alpha steps, got {grid}.")
    if not groups:
        raise UserError("awq_shared_scale needs at least one weight group.")
    n_in = magnitude.shape[-1]
    device = torch.device(device) if device is not None else groups[0].weight.device
    magnitude = magnitude.to(device, torch.float32)
    alphas = [i / grid for i in range(grid)]
    scales = [_scales(magnitude, a) for a in alphas]
    errors = [torch.zeros(len(alphas), g.weight.shape[0], dtype=torch.float64, device=device) for g in groups]
    refs = [torch.zeros(g.weight.shape[0], dtype=torch.float64, device=device) for g in groups]
    for gi, g in enumerate(groups):
        spec = formats.get_format(g.spec)
        num_experts = g.weight.shape[0]
        if g.weight.dim() != 3 or g.weight.shape[-1] != n_in:
            raise UserError(f"AWQ shared group {gi} weight must be [E, out, {n_in}]; got {tuple(g.weight.shape)}.")
        if g.hessian.shape[0] not in (1, num_experts) or tuple(g.hessian.shape[1:]) != (n_in, n_in):
            raise UserError(
                f"AWQ shared group {gi} hessian has shape {tuple(g.hessian.shape)}; expected "
                f"({num_experts} or 1, {n_in}, {n_in})."
            )
        step = chunk_experts or _default_chunk(num_experts, g.weight.shape[1], n_in, device)
        for start in range(0, num_experts, max(1, int(step))):
            part = slice(start, min(start + step, num_experts))
            w = g.weight[part].to(device, torch.float32)
            h = (g.hessian if g.hessian.shape[0] == 1 else g.hessian[part]).to(device, torch.float32)
            h = h.expand(w.shape[0], -1, -1)
            refs[gi][part] = _quadratic(w, h)
            for a, s in enumerate(scales):
                w_hat = formats.quantize(w * s, spec).dequantize(torch.float32) / s
                errors[gi][a, part] = _quadratic(w_hat - w, h)
            del w, h
    importance = [g.importance.to(device, torch.float64) for g in groups]
    total = sum((e * imp[None, :]).sum(1) for e, imp in zip(errors, importance))  # [alphas]
    energy = float(sum((r * imp).sum() for r, imp in zip(refs, importance)))
    best = int(torch.argmin(total))
    rel = [[float(x) for x in e[i] / r.clamp(min=1e-30)] for e, r in zip(errors, refs) for i in (0, best)]
    return AWQShared(
        scale=scales[best],
        alpha=alphas[best],
        objective=[float(t) / max(energy, 1e-30) for t in total],
        error_rtn=rel[0::2],
        error_awq=rel[1::2],
    )


def awq_shared_scale_moe(
    x: torch.Tensor,
    indices: torch.Tensor,
    routing_weights: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    specs: Sequence,
    act,
    magnitude: torch.Tensor,
    *,
    grid: int = 20,
    device=None,
    down_hat: torch.Tensor | None = None,
    holdout: float = 0.0,
    clip: bool = False,
) -> AWQShared:
    """One AWQ input scale [H] for all routed experts' gate and up, searched on the MoE block's output.

    x [n, H]: the layer's normalised hidden states; indices / routing_weights [n, k]: the router's
    choices. gate / up [E, I, H], down [E, H, I]: the block's full-precision weights (the
    reference). down_hat [E, H, I]: down_proj as the quantized block will have it (dequantized;
    default: `down`, unquantized). specs[e] = (gate format, up format) of expert e, or None where
    the expert's gate/up are not AWQ-quantized (they are scaled exactly and left as they are).
    objective(alpha) = sum_t || sum_k w_tk (y_e(x_t; Q(G s)/s, Q(U s)/s, down_hat) - y_e(x_t; G, U, down)) ||^2:
    the routed experts' contribution to the block output, weighted by the routing as the model
    does (a token's experts' errors add up before they are measured). alpha = 0 is on the grid.

    holdout > 0: the objective is measured on the first (1 - holdout) of the tokens (the fit fold)
    and the best alpha is kept only if the block, quantized as the pass will do it (with `clip`:
    gate/up clipped by `awq_clip` on the fit fold's routed-token Hessians), also has a lower
    error on the remaining tokens (the held-out fold) than with s = 1; else alpha = 0 (RTN). The
    in-sample minimum of 20 nearly equal errors is otherwise chosen by noise as often as by signal.
    """
    if grid < 1:
        raise UserError(f"AWQ grid must be a positive number of alpha steps, got {grid}.")
    if not 0.0 <= holdout < 1.0:
        raise UserError(f"AWQ holdout must be a fraction in [0, 1), got {holdout}.")
    device = torch.device(device) if device is not None else x.device
    x = x.to(device, torch.float32)
    indices, routing_weights = indices.to(device), routing_weights.to(device, torch.float32)
    gate, up, down = (w.to(device, torch.float32) for w in (gate, up, down))
    down_hat = down if down_hat is None else down_hat.to(device, torch.float32)
    E = gate.shape[0]
    holdout, n_fit, folds = _token_folds(x.shape[0], holdout)
    # (token, slot) of each expert's routed tokens, per fold
    routed = {name: [(indices[part] == e).nonzero(as_tuple=True) for e in range(E)] for name, part in folds.items()}

    def block(g, u, d, fold):
        return _routed_block_output(x[folds[fold]], routing_weights[folds[fold]], routed[fold], g, u, d, act, device)

    reference = {f: block(gate, up, down, f) for f in folds if folds[f].stop > folds[f].start}
    energy = float((reference["fit"].double() ** 2).sum())
    groups = _awq_gate_up_groups(specs)

    def quantized(s, hessians=None):
        return _quantized_gate_up(gate, up, groups, s, hessians, device)

    def error(g, u, fold):
        return float(((block(g, u, down_hat, fold) - reference[fold]).double() ** 2).sum())

    alphas = [i / grid for i in range(grid)]
    magnitude = magnitude.to(device, torch.float32)
    objective = [error(*quantized(_scales(magnitude, a)), "fit") for a in alphas]
    best = min(range(len(alphas)), key=objective.__getitem__)
    validation = {}
    if holdout > 0:
        validation = {"fit_tokens": n_fit, "held_out_tokens": x.shape[0] - n_fit, "alpha_fit": alphas[best]}
        if best != 0:
            hessians = _routed_hessians(x[folds["fit"]], routed["fit"], E) if clip else None
            candidates = {0: None, best: None}
            for a in candidates:
                candidates[a] = error(*quantized(_scales(magnitude, alphas[a]), hessians), "held_out")
            held_energy = max(float((reference["held_out"].double() ** 2).sum()), 1e-30)
            validation.update(
                held_out_error_rtn=candidates[0] / held_energy, held_out_error_awq=candidates[best] / held_energy
            )
            if not candidates[best] < candidates[0]:
                best = 0
        validation["kept"] = best != 0
    return AWQShared(
        scale=_scales(magnitude, alphas[best]),
        alpha=alphas[best],
        objective=[o / max(energy, 1e-30) for o in objective],
        error_rtn=[],
        error_awq=[],
        validation=validation,
    )


def _token_folds(n: int, holdout: float) -> tuple[float, int, dict[str, slice]]:
    """(holdout, fit tokens, {"fit": first tokens, "held_out": the rest}); holdout 0 when too few tokens."""
    n_fit = n - int(round(holdout * n)) if holdout > 0 else n
    if holdout > 0 and not 0 < n_fit < n:
        holdout, n_fit = 0.0, n  # too few tokens to hold any out: in-sample search only
    return holdout, n_fit, {"fit": slice(0, n_fit), "held_out": slice(n_fit, n)}


def _routed_block_output(xs, rw, routed, g, u, d, act, device) -> torch.Tensor:
    """The routed experts' contribution to the MoE block output of tokens xs [n, H]: sum_k rw_tk y_e(x_t)
    with gate g, up u, down d; routed[e] = (token, slot) of expert e's tokens, rw [n, k] the routing weights."""
    out = torch.zeros(xs.shape[0], d.shape[1], dtype=torch.float32, device=device)
    for e, (tok, slot) in enumerate(routed):
        if tok.numel():
            xe = xs[tok]
            y = (act(xe @ g[e].T) * (xe @ u[e].T)) @ d[e].T
            out.index_add_(0, tok, y * rw[tok, slot][:, None])
    return out


def _awq_gate_up_groups(specs) -> dict[tuple, list[int]]:
    """(projection, format key) -> the experts whose gate / up are AWQ-quantized in that format."""
    from moequant import formats

    groups: dict[tuple, list[int]] = {}
    for e, pair in enumerate(specs):
        if pair is not None:
            for proj, key in zip(("gate", "up"), pair):
                if key is not None:  # the other projection is not AWQ: scaled exactly, left as it is
                    groups.setdefault((proj, formats.get_format(key).key), []).append(e)
    return groups


def _quantized_gate_up(gate, up, groups: dict, s, hessians, device):
    """(gate, up) with every AWQ group quantized at input scale s, dequantized and divided by s
    (clipped first by awq_clip on `hessians` of the scaled input when given); the rest as they are."""
    from moequant import formats

    w_hat = {"gate": gate.clone(), "up": up.clone()}
    for (proj, key), experts in groups.items():
        idx = torch.tensor(experts, device=device)
        w = w_hat[proj][idx] * s
        if hessians is not None:
            w = awq_clip(w, key, hessians[idx] / (s[:, None] * s[None, :])).weight
        w_hat[proj][idx] = formats.quantize(w, key).dequantize(torch.float32) / s
    return w_hat["gate"], w_hat["up"]


@dataclass
class AWQClip:
    """Result of `awq_clip`: quantize `weight` (round-to-nearest) in place of the unclipped one."""

    weight: torch.Tensor  # [E, out, in] clipped to the chosen range per (expert, row, group)
    ratio: torch.Tensor  # [E, out, groups] chosen r (1 = unclipped)
    error_before: torch.Tensor  # [E] tr(dW H dW^T) of round-to-nearest without clipping
    error_after: torch.Tensor  # [E] the same with the clipped weight


CLIP_STEPS = 20  # r = 1 - i / CLIP_STEPS for i < CLIP_STEPS * CLIP_MAX_SHRINK
CLIP_MAX_SHRINK = 0.5


def awq_clip(
    weight: torch.Tensor,
    spec,
    hessian: torch.Tensor,
    *,
    steps: int = CLIP_STEPS,
    max_shrink: float = CLIP_MAX_SHRINK,
    chunk_experts: int | None = None,
    device=None,
) -> AWQClip:
    """AWQ's weight clipping of weight [E, out, in] (already AWQ-scaled) read by inputs with Hessian
    hessian [E, in, in] (or [1, in, in]) -> AWQClip; see the module docstring.

    Formats whose scale covers one group of inputs per row (int, mxfp4, nvfp4) or a whole row
    (channel) are clipped per group / row; fp8 block and tensor scales are left as they are
    (their range is shared across rows). Experts whose clipped error is not lower keep r = 1.
    """
    from moequant import formats

    spec = formats.get_format(spec)
    E, out_features, n_in = weight.shape
    device = torch.device(device) if device is not None else weight.device
    size = spec.group_size if spec.granularity == "group" else n_in
    if not spec.quantized or spec.granularity in ("block", "tensor") or n_in % size:
        zero = torch.zeros(E, dtype=torch.float64)
        return AWQClip(weight, torch.ones(E, out_features, 1), zero, zero.clone())
    n_groups = n_in // size
    ratios = [1 - i / steps for i in range(max(1, int(steps * max_shrink)))]
    out_w = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    chosen = torch.ones(E, out_features, n_groups)
    before = torch.zeros(E, dtype=torch.float64)
    after = torch.zeros(E, dtype=torch.float64)
    step = chunk_experts or _default_chunk(E, 2 * out_features, n_in, device)
    for start in range(0, E, max(1, int(step))):
        part = slice(start, min(start + step, E))
        w = weight[part].to(device, torch.float32)
        h = (hessian if hessian.shape[0] == 1 else hessian[part]).to(device, torch.float32).expand(w.shape[0], -1, -1)
        e = w.shape[0]
        wg = w.reshape(e, out_features, n_groups, size)
        g = torch.arange(n_groups, device=device)
        h_blocks = h.reshape(e, n_groups, size, n_groups, size)[:, g, :, g, :].transpose(
            0, 1
        )  # [e, groups, size, size]
        amax = wg.abs().amax(-1, keepdim=True)
        best_w, best_err, best_r = wg, None, torch.ones(e, out_features, n_groups, device=device)
        for r in ratios:
            wc = wg if r == 1 else torch.maximum(torch.minimum(wg, r * amax), -r * amax)
            d = formats.quantize(wc.reshape(e, out_features, n_in), spec).dequantize(torch.float32)
            d = d.reshape(wg.shape) - wg
            err = torch.einsum("eogi,egij,eogj->eog", d, h_blocks, d)
            if best_err is None:
                best_err = err
                continue
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_r = torch.where(better, torch.full_like(best_r, r), best_r)
            best_w = torch.where(better[..., None], wc, best_w)
        clipped = best_w.reshape(e, out_features, n_in)

        def row_errors(v):
            d = formats.quantize(v, spec).dequantize(torch.float32) - w  # noqa: F821
            return ((d @ h) * d).sum(-1).double()  # [e, out]  # noqa: F821

        rows_plain, rows_clipped = row_errors(w), row_errors(clipped)
        keep = rows_clipped < rows_plain
        result = torch.where(keep[..., None], clipped, w)
        rows_final = row_errors(result)  # (nvfp4: a row's clipping can move the expert's global scale)
        worse = rows_final.sum(-1) >= rows_plain.sum(-1)
        result = torch.where(worse[:, None, None], w, result)
        keep &= ~worse[:, None]
        out_w[part] = result.to(out_w.device)
        chosen[part] = torch.where(keep[..., None], best_r, torch.ones_like(best_r)).cpu()
        before[part] = rows_plain.sum(-1).cpu()
        after[part] = torch.where(worse, rows_plain.sum(-1), rows_final.sum(-1)).cpu()
        del w, h, h_blocks, wg, best_w
    return AWQClip(out_w, chosen, before, after)


def _routed_hessians(x: torch.Tensor, routed, num_experts: int) -> torch.Tensor:
    """Per expert X_e^T X_e / n_e of its routed tokens; an expert no token reached gets all tokens'."""
    h, _, counts = input_stats([x[tok] for tok, _slot in routed], x.device)
    h[torch.tensor(counts, device=x.device) == 0] = x.T @ x / max(x.shape[0], 1)
    return h


# ---------------------------------------------------------------------------------------------


def _scales(magnitude: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = m^alpha, kept away from 0 and normalised so that max(s) * min(s) = 1 (AWQ's rule)."""
    s = magnitude.clamp(min=1e-8).pow(alpha).clamp(min=1e-4)
    return s / (s.amax(-1, keepdim=True) * s.amin(-1, keepdim=True)).sqrt()


def _quadratic(delta: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Per expert tr(delta H delta^T) in float64: the mean squared output error over the tokens of H."""
    return ((delta @ h) * delta).sum(dim=(1, 2)).double()


def _stats(inputs, hessian, mean_abs, tokens, device):
    if inputs is not None:
        if hessian is not None or mean_abs is not None:
            raise UserError("AWQ takes either inputs or hessian + mean_abs, not both.")
        return input_stats(inputs, device)
    if hessian is None or mean_abs is None:
        raise UserError("AWQ needs calibration data: inputs (per-expert tokens) or hessian + mean_abs.")
    return hessian, mean_abs, tokens


def _default_chunk(num_experts, rows, n_in, device):
    from moequant import memory_budget

    per_expert = 4 * (2 * n_in * n_in + 6 * rows * n_in)  # H, its product with delta; W, W*s, codes, W_hat
    return max(1, min(num_experts, int(memory_budget.temporary_bytes(device) // per_expert)))


def _check(weights, hessian, mean_abs):
    e, _, n = weights[0].shape
    for w in weights:
        if w.dim() != 3 or w.shape[0] != e or w.shape[2] != n:
            raise UserError(f"AWQ weights must all be [E, out, in] with E={e}, in={n}; got {tuple(w.shape)}.")
    if tuple(hessian.shape) != (e, n, n):
        raise UserError(f"AWQ hessian has shape {tuple(hessian.shape)}; expected ({e}, {n}, {n}).")
    if tuple(mean_abs.shape) != (e, n):
        raise UserError(f"AWQ mean_abs has shape {tuple(mean_abs.shape)}; expected ({e}, {n}).")
