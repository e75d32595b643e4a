"""GPTQ for all routed experts of one MoE layer at once.

Every routed expert of a layer has the same shapes, so their GPTQ problems are solved as one
batch: the Hessians `[E, in, in]` are damped and factored with batched Cholesky, and the column
sweep quantizes column j of every expert in the same tensor operation. Experts are processed
in chunks (`chunk_experts`, sized to the device's free memory, halved and retried if a chunk
runs out of memory). Projections that read the same input (gate and up) share one
factorization (`gptq_shared_hessian`).

Two sweeps:
- fused (integer formats with fixed scales, float32, on CUDA when Triton imports; the report's
  settings["sweep"] == "triton"; the recipe's gptq.gpu_math.triton=false turns it off): GPTQ written on V, the upper
  triangular factor with H = V V^T (one Cholesky of the order-reversed Hessian, no inverse), a
  Triton kernel for the columns inside each 64-column block (moequant.algorithms.gptq_triton
  explains both), and the updates between blocks as batched matrix products (TF32 by default,
  below) in two levels (64-column blocks and 1024-column super-blocks). On CUDA the Cholesky of large
  matrices is a blocked one made of batched matrix products (`cholesky.cholesky_ex`), about 2x faster
  than cuSOLVER's batched one.
- torch (every other case, and always on the CPU): U, the Cholesky factor of H^-1, and the
  column loop in torch; on CUDA the block sweep is captured once as a CUDA graph and replayed
  for every block (gpu_math.cuda_graphs=false turns that off; the codes are the same).

TF32 on CUDA (the fused sweep only; gpu_math.update_matmul=fp32 forces float32 products
throughout, gpu_math.cholesky_matmul=fp32 only in the factorization; the report's settings
say what ran). `gpu_math` (moequant.algorithms.gpu_math.GpuMath, the recipe's gptq.gpu_math) carries
these choices to every function here. Both phases are bound by float32 matrix products, so:
- the lazy updates between blocks, W[:, later] += D[:, block] @ V'[block, later], are plain TF32
  products (10-bit mantissa inputs, float32 sums). D = W - Q is the quantization error itself, so
  a ~2^-11 relative error of its update is far below the quantization step; the columns inside
  a block (the Triton kernel) stay float32.
- the blocked Cholesky's products are split-TF32 ("tf32x3": every finished column split once,
  exactly, into hi + lo, and L L^T = hi hi^T + hi lo^T + lo hi^T as three TF32 products), about
  2^-20 relative, 4x float32's factor error against a float64 factor at the DeepSeek-V3 shape.
  Plain TF32 is not used there: at the DeepSeek-V3 shape it made damped Hessians lose positive
  definiteness (failed factorizations, which the retry answers with 10x damping).
TF32 keeps the held-out error per projection of float32 and is faster; its codes differ from a
float32 run's, and that is no loss: GPTQ's column recursion is chaotic (one flipped code changes
the error fed to every later column), so any change of rounding spreads, as a float64 Cholesky
factor's does (the measurements: benchmarks/RESULTS.md, bench_gptq.py).

Same numbers as one expert at a time: tests/test_gptq.py checks batched against one-by-one
and both against an independent float64 GPTQ, code for code, on the CPU, and the fused
sweep's formulation (through its torch definition) against the torch sweep. On a GPU, batched
and single solves run different cuBLAS / cuSOLVER kernels, whose float32 rounding differs, and a
small share of the codes flip at equal held-out error (benchmarks/bench_gptq.py --verify;
tests/test_gptq_cuda.py bounds the fused, torch, TF32 and float32 sweeps against each other;
measured shares: benchmarks/RESULTS.md, bench_gptq.py).

The algorithm is GPTQ (Frantar et al., 2022) with lazy block updates: for column j,
    q_j = quantize(w_j);  e_j = (w_j - q_j) / U_jj;  w_{k>j} -= e_j * U_{j,k}
where U is the upper Cholesky factor of H^-1. Element quantization goes through the format's
column quantizer (`moequant.formats.column_quantizer`), so every format with per-group,
per-block or per-channel scales works (int4/int3/int2, int8, fp8, mxfp4, nvfp4).

Per-expert fallbacks, always recorded in the report (`GPTQReport.fallbacks()`):
- an expert with fewer than `min_tokens` calibration tokens, or whose Hessian is all zeros or
  not finite, uses `shared_hessian` (the Hessian of all the layer's tokens, when the caller
  gives one), else round-to-nearest with the format's own scales;
- when a Cholesky fails, that expert's damping grows tenfold and it is factored again, up to
  `max_damp_tries` times (the damping used is in the report); an expert that still fails gets
  round-to-nearest.
Dead input columns (H_ii == 0: an input channel that was always zero) get H_ii = 1 and their
weights are set to 0, as in the GPTQ reference; their value cannot change the layer's output
on the calibration data.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from moequant import timing
from moequant.algorithms import gptq_triton
from moequant.algorithms.cholesky import inverse_cholesky
from moequant.algorithms.columns import cq_call, cq_fit, squeeze_params, stack_chunks, tree_map
from moequant.algorithms.gpu_math import GpuMath
from moequant.algorithms.tf32 import tf32_products as _tf32_products
from moequant.errors import UserError

# GPTQ report's names for what each expert got.
GPTQ = "gptq"
GPTQ_SHARED_HESSIAN = "gptq-shared-hessian"
RTN = "rtn"


@dataclass
class GPTQReport:
    """What happened to each expert (lists indexed by expert). Plain data: `to_dict()` is JSON."""

    method: list[str]  # "gptq", "gptq-shared-hessian" or "rtn"
    reason: list[str]  # why an expert did not get plain GPTQ ("" when it did)
    damp: list[float | None]  # damping used, as a fraction of mean(diag(H)); None for RTN
    dead_columns: list[int]  # input columns with H_ii == 0 (weights set to 0)
    proxy_loss: list[float | None]  # GPTQ's own objective sum((w-q)^2 / U_jj^2) / 2; None for RTN
    tokens: list[int] | None = None  # calibration tokens per expert, as the caller gave them
    settings: dict = field(default_factory=dict)
    # wall time per phase: copies to the device and Hessian checks, scales / ordering, factorization,
    # column sweep, codes back in order (synchronised clocks; they add up to the solve's time)
    seconds: dict = field(
        default_factory=lambda: dict.fromkeys(("load", "prepare", "factorize", "sweep", "finish"), 0.0)
    )

    def fallbacks(self) -> dict[int, str]:
        """Experts that did not get GPTQ on their own Hessian: {expert: "method: reason"}."""
        return {e: f"{m}: {r}" for e, (m, r) in enumerate(zip(self.method, self.reason)) if m != GPTQ}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def gptq(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    spec,
    *,
    block_size: int = 128,
    damp: float = 0.01,
    act_order: bool = False,
    static_groups: bool = True,
    chunk_experts: int | None = None,
    tokens: Sequence[int] | torch.Tensor | None = None,
    min_tokens: int = 1,
    shared_hessian: torch.Tensor | None = None,
    max_damp_tries: int = 6,
    device: torch.device | str | None = None,
    grid: str = "minmax",
    gpu_math: GpuMath = GpuMath(),
):
    """GPTQ-quantize the experts of one projection; returns (QuantizedTensor, GPTQReport).

    weight: [E, out, in] (or [out, in] for a single matrix); hessian: [E, in, in] (or [in, in]),
    any positive multiple of X^T X of the expert's inputs (the scale does not matter).
    spec: a `moequant.formats` spec or format key string.
    block_size: columns per lazy-update block (rounded to a multiple of the format's group width;
        the fused CUDA sweep uses at most 64, measured fastest there).
    damp: relative damping, lambda = damp * mean(diag(H)), grown tenfold per failed Cholesky
        (from 1e-4 when damp is 0).
    act_order: quantize columns in order of decreasing H_ii. Only with `static_groups=True`:
        groups stay contiguous in the original column order (no dynamic g_idx, which vLLM rejects).
    static_groups: fit every group's scales on the (dead-column-zeroed) weights before the sweep.
        With False, a group's scales are fitted on the already-updated weights when the sweep
        reaches the group (the GPTQ reference's default; usually a little more accurate).
    chunk_experts: experts per batch; default sized to the device's free memory.
    tokens, min_tokens, shared_hessian: per-expert token counts and the fallback (module doc).
    device: where to compute; default the weight's device. Results come back on the weight's device.
    grid: "minmax" (the format's own scales) or "searched" (integer formats, static groups: each
        group's scale / zero point searched for the least diag(H)-weighted error of rounding the
        original weights, `formats.searched_fit`; the grid GPTQ then rounds onto).
    gpu_math: how it computes on a GPU (module doc); on the CPU only its `cholesky` choice applies.
    """
    quantized, report = gptq_shared_hessian(
        [weight],
        hessian,
        spec,
        block_size=block_size,
        damp=damp,
        act_order=act_order,
        static_groups=static_groups,
        chunk_experts=chunk_experts,
        tokens=tokens,
        min_tokens=min_tokens,
        shared_hessian=shared_hessian,
        max_damp_tries=max_damp_tries,
        device=device,
        grid=grid,
        gpu_math=gpu_math,
    )
    return quantized[0], report


def gptq_pass(weight, hessian, spec, device=None, grid: str = "minmax", refit: bool = False, gpu_math=GpuMath()):
    """GPTQ as the quantize pass and the probe run it: activation order with static groups (vLLM takes
    no dynamic g_idx); for integer formats the `grid` GPTQ rounds onto (minmax | searched) and, with
    `refit`, the least-squares scale refit of integer group formats (moequant.algorithms.refit).
    The defaults here are plain GPTQ; the recipe's `gptq: {grid, refit}` defaults to searched + refit.
    Quality and cost: benchmarks/bench_quality.py, bench_gptq.py."""
    (q,), report = gptq_pass_shared([weight], hessian, spec, device=device, grid=grid, refit=refit, gpu_math=gpu_math)
    return q, report


def gptq_pass_shared(
    weights, hessian, spec, device=None, grid: str = "minmax", refit: bool = False, gpu_math=GpuMath()
):
    """`gptq_pass` of projections that read the same input (gate and up): one factorization and one
    sweep for all (`gptq_shared_hessian`), each weight's own scales and refit; the same codes and
    scales as one `gptq_pass` per weight. Returns ([QuantizedTensor per weight], GPTQReport)."""
    from moequant import formats
    from moequant.algorithms.refit import refit_scales_shared

    spec = formats.get_format(spec)
    qs, report = gptq_shared_hessian(
        weights,
        hessian,
        spec,
        act_order=spec.is_int,
        static_groups=True,
        device=device,
        grid=grid if spec.is_int else "minmax",
        gpu_math=gpu_math,
    )
    if refit and spec.is_int and spec.granularity == "group":  # one Hessian preparation for all weights
        with timing.stage("gptq_refit"):
            qs = refit_scales_shared(qs, weights, hessian, triton=gpu_math.triton)
    return qs, report


def gptq_shared_hessian(
    weights: Sequence[torch.Tensor],
    hessian: torch.Tensor,
    spec,
    *,
    block_size: int = 128,
    damp: float = 0.01,
    act_order: bool = False,
    static_groups: bool = True,
    chunk_experts: int | None = None,
    tokens: Sequence[int] | torch.Tensor | None = None,
    min_tokens: int = 1,
    shared_hessian: torch.Tensor | None = None,
    max_damp_tries: int = 6,
    device: torch.device | str | None = None,
    grid: str = "minmax",
    gpu_math: GpuMath = GpuMath(),
):
    """GPTQ of several projections that read the same input (gate and up): one factorization.

    weights: tensors [E, out_k, in] sharing `hessian` [E, in, in]. Their rows are swept together
    (GPTQ treats rows independently, so the codes equal separate `gptq` calls) while each keeps
    its own scales. Returns ([QuantizedTensor per weight], GPTQReport). Arguments as in `gptq`.
    """
    from moequant import formats

    spec = formats.get_format(spec)
    if act_order and not static_groups:
        raise UserError(
            "GPTQ act_order=True needs static_groups=True: dynamic group indices (g_idx) are "
            "rejected by vLLM; pass static_groups=True or act_order=False."
        )
    if not weights:
        raise UserError("gptq_shared_hessian needs at least one weight tensor.")
    if grid not in formats.GRIDS:
        raise UserError(f"unknown GPTQ grid {grid!r}; accepted: {', '.join(formats.GRIDS)}.")
    if grid == "searched" and not (spec.is_int and static_groups):
        raise UserError(
            f"GPTQ's searched grid needs an integer format and static_groups=True (got {spec.key}, "
            f"static_groups={static_groups})."
        )
    single = weights[0].dim() == 2
    ws = [w.unsqueeze(0) if single else w for w in weights]
    h_all = hessian.unsqueeze(0) if hessian.dim() == 2 else hessian
    _check_shapes(ws, h_all)
    num_experts, _, num_in = ws[0].shape
    out_device = ws[0].device
    # float64 weights are solved in float64 (exact comparisons in tests); everything else in float32
    work_dtype = torch.float64 if ws[0].dtype == torch.float64 else torch.float32
    device = torch.device(device) if device is not None else out_device

    token_counts = _token_counts(tokens, num_experts)
    if shared_hessian is not None and tuple(shared_hessian.shape) != (num_in, num_in):
        raise UserError(
            f"shared_hessian has shape {tuple(shared_hessian.shape)}; expected ({num_in}, {num_in}) "
            "(the Hessian of all the layer's tokens for this projection)."
        )

    report = GPTQReport(
        method=[GPTQ] * num_experts,
        reason=[""] * num_experts,
        damp=[None] * num_experts,
        dead_columns=[0] * num_experts,
        proxy_loss=[None] * num_experts,
        tokens=None if token_counts is None else [int(t) for t in token_counts],
        settings=dict(
            spec=spec.key,
            block_size=block_size,
            damp=damp,
            act_order=act_order,
            static_groups=static_groups,
            min_tokens=min_tokens,
            grid=grid,
        ),
    )

    rows = [w.shape[1] for w in ws]
    if chunk_experts is None:
        chunk_experts = _default_chunk(num_experts, sum(rows), num_in, device)
    chunk_experts = max(1, int(chunk_experts))

    parts: list[list[Any]] = [[] for _ in ws]  # per weight: QuantizedTensor of each chunk
    start = 0
    while start < num_experts:
        experts = range(start, min(start + chunk_experts, num_experts))
        try:
            quantized = _solve_chunk(
                ws,
                h_all,
                spec,
                experts,
                report,
                device,
                work_dtype,
                token_counts,
                min_tokens,
                shared_hessian,
                block_size=block_size,
                damp=damp,
                act_order=act_order,
                static_groups=static_groups,
                max_damp_tries=max_damp_tries,
                squeeze=single,
                grid=grid,
                gpu_math=gpu_math,
            )
        except torch.OutOfMemoryError:
            if chunk_experts == 1:
                raise
            torch.cuda.empty_cache()
            chunk_experts = max(1, chunk_experts // 2)  # the estimate was too optimistic: smaller batches
            continue
        for k, q in enumerate(quantized):
            parts[k].append(q.to(out_device) if out_device != device else q)
        del quantized
        start = experts.stop
    report.settings["chunk_experts"] = chunk_experts
    return [stack_chunks(p) for p in parts], report


# ---------------------------------------------------------------------------------------------
# the batched solve


def _solve_chunk(
    ws, h_all, spec, experts, report, device, work_dtype, token_counts, min_tokens, shared_hessian, **options
):
    for e in experts:  # a retried chunk starts from a clean report
        report.method[e], report.reason[e], report.damp[e], report.proxy_loss[e] = GPTQ, "", None, None
    t0 = _clock(h_all)
    w_chunk = [w[experts.start : experts.stop].to(device, work_dtype, copy=True) for w in ws]
    h_chunk = h_all[experts.start : experts.stop].to(device, work_dtype, copy=True)
    h_chunk = _choose_hessians(h_chunk, experts, token_counts, min_tokens, shared_hessian, report, device)
    report.seconds["load"] += _clock(h_chunk) - t0
    # handed over in lists that _gptq_chunk empties, so it can free them as it goes
    return _gptq_chunk(w_chunk, [h_chunk], spec, experts, report, **options)


def _gptq_chunk(
    ws, h, spec, experts, report, *, block_size, damp, act_order, static_groups, max_damp_tries, squeeze, grid, gpu_math
):
    """GPTQ of one chunk of experts. ws: list of [c, out_k, in] float32; h: [c, in, in] float32.

    Experts whose report says "rtn" (set by _choose_hessians) are quantized with one pass of
    fitted scales and no error feedback (their Hessian is replaced by the identity, which makes
    GPTQ's update vanish: with U = I every e_j * U_{j,k>j} is 0).
    """
    from moequant import formats

    t_start = _clock(ws[0])
    if isinstance(h, list):
        h = h.pop()
    ws_given, ws = ws, list(ws)
    ws_given.clear()
    num_in = h.shape[-1]
    idx = list(experts)
    h, diag = _identity_for_rtn_and_dead_columns(h, ws, idx, report)

    # The searched grid weighs each column's rounding error by H_ii (original column order).
    importance = diag.clone() if grid == "searched" else None  # [c, in]
    # The column quantizers see each whole (zeroed) weight once, e.g. for per-tensor scales.
    cqs = [formats.column_quantizer(spec, w[0] if squeeze else w, grid=grid, triton=gpu_math.triton) for w in ws]
    group_width = cqs[0].group_width
    per_row = group_width >= num_in  # per-channel / per-tensor scales: one fit for all columns
    if not per_row:
        block_size = max(1, block_size // group_width) * group_width  # groups never straddle blocks

    perm = None
    if act_order:
        perm = torch.argsort(h.diagonal(dim1=-2, dim2=-1), dim=-1, descending=True)  # [c, in]
        h = torch.gather(h, 1, perm[:, :, None].expand(-1, -1, num_in))
        h = torch.gather(h, 2, perm[:, None, :].expand(-1, num_in, -1))

    with timing.stage("gptq_grid"):  # the scales GPTQ rounds onto (the searched grid's search)
        fixed_params = _fixed_params(cqs, ws, spec, per_row, static_groups, importance, squeeze)

    if perm is not None:
        ws = [torch.gather(w, 2, perm[:, None, :].expand(-1, w.shape[1], -1)) for w in ws]

    # Integer formats with fixed scales on CUDA: the fused Triton sweep, which works with the
    # reversed Cholesky factor V of H itself (no inverse; see gptq_triton's module doc).
    fused = fixed_params is not None and gpu_math.triton and gptq_triton.usable(spec, h.device, h.dtype)
    report.settings["sweep"] = "triton" if fused else "torch"
    tf32 = fused and h.is_cuda and gpu_math.update_matmul == "tf32"
    report.settings["update_matmul"] = "tf32" if tf32 else "fp32"
    tf32_chol = tf32 and gpu_math.cholesky_matmul == "tf32x3"
    report.settings["cholesky_matmul"] = "tf32x3" if tf32_chol else "fp32"
    t0 = _clock(h)
    report.seconds["prepare"] += t0 - t_start
    u = _factorize(h, idx, report, damp, max_damp_tries, inverse=not fused, tf32=tf32_chol, how=gpu_math.cholesky)
    report.seconds["factorize"] += _clock(u) - t0
    del h

    out_rows = [w.shape[1] for w in ws]
    w_all = torch.cat(ws, dim=1) if len(ws) > 1 else ws[0]  # [c, sum(out), in]
    del ws
    if fused:
        t_sweep = _clock(w_all)
        codes, losses = _sweep_fused(
            w_all, u, fixed_params, perm, group_width, per_row, min(block_size, _FUSED_BLOCK or block_size), spec, tf32
        )
        t0 = _clock(w_all)
        report.seconds["sweep"] += t0 - t_sweep
        del u, w_all
        out = _finish(cqs, [codes], out_rows, True, perm, idx, report, losses, fixed_params, squeeze)
        report.seconds["finish"] += _clock(codes) - t0
        return out
    t_sweep = _clock(w_all)
    codes, losses, merge, params = _sweep_torch(
        w_all,
        u,
        cqs,
        fixed_params,
        perm,
        group_width,
        per_row,
        block_size,
        spec,
        out_rows,
        squeeze,
        gpu_math.cuda_graphs,
    )
    t0 = _clock(w_all)
    report.seconds["sweep"] += t0 - t_sweep
    del u, w_all
    out = _finish(cqs, codes, out_rows, merge, perm, idx, report, losses, params, squeeze)
    report.seconds["finish"] += _clock(codes[0]) - t0
    return out


def _identity_for_rtn_and_dead_columns(h, ws, idx, report):
    """Experts the report sends to round-to-nearest get the identity Hessian (GPTQ's update vanishes);
    dead input columns get H_ii = 1 and zeroed weights, as in GPTQ. Returns (h, its diagonal view)."""
    num_in = h.shape[-1]
    rtn_mask = torch.tensor([report.method[e] == RTN for e in idx], device=h.device)
    if rtn_mask.any():
        eye = torch.eye(num_in, device=h.device, dtype=h.dtype)
        h = torch.where(rtn_mask[:, None, None], eye, h)
    diag = h.diagonal(dim1=-2, dim2=-1)
    dead = diag == 0
    if dead.any():
        diag.masked_fill_(dead, 1.0)
        for w in ws:
            w.masked_fill_(dead[:, None, :], 0.0)
    for j, e in enumerate(idx):
        report.dead_columns[e] = 0 if report.method[e] == RTN else int(dead[j].sum())
    return h, diag


def _fixed_params(cqs, ws, spec, per_row, static_groups, importance, squeeze):
    """Scales fitted before the sweep (per-row formats; static groups, always with act_order), one
    list of per-group params per weight; None: groups are fitted during the sweep."""
    num_in, group_width = ws[0].shape[-1], cqs[0].group_width
    if per_row:
        imp = None if importance is None else importance[:, None, :]
        return [[cq_fit(cq, w, squeeze, imp)] for cq, w in zip(cqs, ws)]
    if static_groups and spec.is_int and spec.granularity == "group" and num_in % group_width == 0:
        # all groups in one call (the fit is elementwise per group: same numbers as group by group)
        fixed_params = []
        imp = None if importance is None else importance.unflatten(-1, (num_in // group_width, group_width))[:, :, None]
        for cq, w in zip(cqs, ws):
            groups = w.unflatten(-1, (num_in // group_width, group_width)).transpose(-3, -2)  # [c, G, out, width]
            fitted = cq_fit(cq, groups, squeeze, imp)
            fixed_params.append([tree_map(lambda t: t[:, g], fitted) for g in range(num_in // group_width)])
        return fixed_params
    if static_groups:
        return [
            [cq_fit(cq, w[..., g : g + group_width], squeeze) for g in range(0, num_in, group_width)]
            for cq, w in zip(cqs, ws)
        ]
    return None


def _factorize(h, idx, report, damp, max_damp_tries, *, inverse, tf32, how):
    """The (inverse) Cholesky factor of each damped Hessian; an expert whose every damping fails falls
    back to round-to-nearest (identity factor), and the report says so."""
    num_in = h.shape[-1]
    u, used_damp = inverse_cholesky(
        h, damp, max_damp_tries, [report.method[e] == RTN for e in idx], inverse=inverse, tf32=tf32, how=how
    )
    for j, e in enumerate(idx):
        if report.method[e] == RTN:
            continue
        if used_damp[j] is None:  # every damping failed: round-to-nearest for this expert
            report.method[e], report.reason[e] = (
                RTN,
                (f"Cholesky of the damped Hessian failed {max_damp_tries} times (damp grown tenfold from {damp:g})"),
            )
            u[j] = torch.eye(num_in, device=u.device, dtype=u.dtype)
        else:
            report.damp[e] = used_damp[j]
    return u


def _sweep_torch(
    w_all, u, cqs, fixed_params, perm, group_width, per_row, block_size, spec, out_rows, squeeze, cuda_graphs=True
):
    """GPTQ's column sweep in torch ops, block by block (CUDA graphs replay the full blocks): returns
    (codes in the sweep's layout, per-expert loss, whether projections were merged, the params used)."""
    c, num_in = w_all.shape[0], w_all.shape[-1]
    losses = torch.zeros(c, device=w_all.device, dtype=torch.float64)
    fixed = fixed_params is not None
    # Fixed params of all groups side by side (leaves [c, X, groups]), gathered per block into
    # per-column params (leaves [c, X, block]) so every column's params are a view.
    stacked = [tree_map(lambda *leaves: torch.cat(leaves, dim=-1), *ps) for ps in fixed_params] if fixed else None
    dynamic_params: list[list[Any]] = [[] for _ in cqs]

    # Rows of projections with per-row scales and nothing per tensor (not nvfp4's global scale,
    # fp8's tensor scale or 128-row blocks) are quantized by one call: fewer kernels per column.
    merge = fixed and len(cqs) > 1 and spec.granularity in ("group", "channel") and not spec.family.global_scale
    sweep_cqs, sweep_rows = ([cqs[0]], [sum(out_rows)]) if merge else (cqs, out_rows)

    def block_params(i1, i2):
        if not fixed:
            return None
        if merge:
            per_weight = _block_params_per_weight(i1, i2)
            return [tree_map(lambda *leaves: torch.cat(leaves, dim=1), *per_weight)]
        return _block_params_per_weight(i1, i2)

    def _block_params_per_weight(i1, i2):
        if per_row:
            group = torch.zeros(c, i2 - i1, dtype=torch.long, device=w_all.device)  # noqa: F821
        elif perm is not None:
            group = perm[:, i1:i2] // group_width  # each expert's own column order
        else:
            group = (torch.arange(i1, i2, device=w_all.device) // group_width).expand(c, -1)  # noqa: F821
        return [
            tree_map(lambda t: _widen(_gather_last(t, group[:, None, :].expand(-1, t.shape[1], -1))), st)
            for st in stacked
        ]

    def sweep_block(w1, u1, err1, codes1, params1):
        """GPTQ's inner loop over the columns of one block, in place on w1 / err1 / codes1."""
        for i in range(w1.shape[-1]):
            if not fixed and i % group_width == 0:  # dynamic groups: fit on the updated columns
                params1 = []
                for k, (cq, piece) in enumerate(zip(cqs, w1[..., i : i + group_width].split(out_rows, dim=1))):
                    dynamic_params[k].append(cq_fit(cq, piece, squeeze))
                    params1.append(tree_map(lambda t: t.expand(*t.shape[:-1], group_width), dynamic_params[k][-1]))
                offset = i
            else:
                offset = 0 if fixed else offset
            w = w1[..., i : i + 1]  # [c, rows, 1]
            values = []
            for k, (cq, piece) in enumerate(zip(sweep_cqs, w.split(sweep_rows, dim=1))):
                p = tree_map(lambda t: t[..., i - offset : i - offset + 1], params1[k])
                column_codes = cq_call(cq.quantize, piece, p, squeeze)
                codes1[k][..., i : i + 1] = column_codes
                values.append(cq_call(cq.dequantize, column_codes, p, squeeze).to(w.dtype))
            q = torch.cat(values, dim=1) if len(values) > 1 else values[0]
            err = (w - q) / u1[:, i, i][:, None, None]
            w1[..., i + 1 :] -= err * u1[:, None, i, i + 1 :]
            err1[..., i : i + 1] = err

    # Codes dtype of the format, from one column (cheap).
    probe = (
        [
            cq_call(cq.quantize, piece[..., :1], tree_map(lambda t: t[..., :1], bp), squeeze)
            for cq, piece, bp in zip(sweep_cqs, w_all[..., :1].split(sweep_rows, dim=1), block_params(0, 1))
        ]
        if fixed
        else [
            cq_call(cq.quantize, piece[..., :1], cq_fit(cq, piece[..., :1], squeeze), squeeze)
            for cq, piece in zip(cqs, w_all[..., :1].split(out_rows, dim=1))
        ]
    )
    codes = [
        torch.zeros(w_all.shape[0], r, num_in, dtype=pr.dtype, device=w_all.device) for r, pr in zip(sweep_rows, probe)
    ]

    graph = None
    use_graph = fixed and w_all.is_cuda and cuda_graphs
    for i1 in range(0, num_in, block_size):
        i2 = min(i1 + block_size, num_in)
        if use_graph and i1 > 0 and i2 - i1 == block_size:
            # Replaying a captured block removes the launch overhead of thousands of tiny kernels.
            if graph is None:
                static = _BlockBuffers(w_all, u, codes, block_params(i1, i2), block_size)
                graph = torch.cuda.CUDAGraph()
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    sweep_block(static.w1, static.u1, static.err1, static.codes1, static.params1)
            static.load(w_all, u, block_params(i1, i2), i1, i2)
            graph.replay()
            w1, err1, codes1 = static.w1, static.err1, static.codes1
        else:
            w1 = w_all[..., i1:i2].clone()
            err1 = torch.zeros_like(w1)
            codes1 = [torch.zeros_like(t[..., i1:i2]) for t in codes]
            sweep_block(w1, u[:, i1:i2, i1:i2], err1, codes1, block_params(i1, i2))
        for t, t1 in zip(codes, codes1):
            t[..., i1:i2] = t1
        losses += err1.double().square().sum(dim=(1, 2)) / 2
        if i2 < num_in:
            w_all[..., i2:] -= torch.bmm(err1, u[:, i1:i2, i2:])
    del graph
    return codes, losses, merge, (fixed_params if fixed else dynamic_params)


def _finish(cqs, codes, out_rows, merge, perm, idx, report, losses, params, squeeze):
    """Codes in the sweep's layout -> one QuantizedTensor per weight (original column order)."""
    if merge:
        codes = list(codes[0].split(out_rows, dim=1))
    if perm is not None:
        inv = torch.argsort(perm, dim=-1)
        codes = [_gather_last(t, inv[:, None, :].expand(-1, t.shape[1], -1)) for t in codes]
    for j, e in enumerate(idx):
        if report.method[e] != RTN:
            report.proxy_loss[e] = float(losses[j])
    return [
        cq.assemble(t[0] if squeeze else t, [squeeze_params(p, squeeze) for p in ps])
        for cq, t, ps in zip(cqs, codes, params)
    ]


def _sweep_fused(w_all, v, fixed_params, perm, group_width, per_row, block_size, spec, tf32=False):
    """GPTQ of integer formats with fixed scales through gptq_triton's fused block sweep.

    w_all: [c, rows, n] (all weights' rows; consumed); v: [c, n, n] reversed Cholesky factor of
    H (consumed). tf32: the lazy updates between blocks as TF32 products (module doc).
    Returns (int8 codes [c, rows, n], proxy loss [c] float64)."""
    c, rows, n = w_all.shape
    scales = torch.cat([_widen(tree_map(lambda *t: torch.cat(t, dim=-1), *ps).scales) for ps in fixed_params], dim=1)
    zeros = None
    if fixed_params[0][0].zeros is not None:
        zeros = torch.cat([_widen(tree_map(lambda *t: torch.cat(t, dim=-1), *ps).zeros) for ps in fixed_params], dim=1)
    scales = scales.contiguous()
    zeros = None if zeros is None else zeros.contiguous()
    if per_row:
        group_idx = torch.zeros(c, n, dtype=torch.int32, device=w_all.device)
    elif perm is not None:
        group_idx = (perm // group_width).to(torch.int32)
    else:
        group_idx = (torch.arange(n, device=w_all.device) // group_width).to(torch.int32).expand(c, -1)
    group_idx = group_idx.contiguous()
    vd = v.diagonal(dim1=-2, dim2=-1).clone()
    # V'_ik = V_ik / V_kk, row-major: the kernel reads its rows (the blocked Cholesky's factors are
    # row-major already; cuSOLVER's come column-major and are copied)
    vn = v.contiguous().div_(vd[:, None, :])
    del v
    x = w_all.clone()  # current weights; w_all keeps the originals and becomes d = w - q block by block
    codes = torch.empty(c, rows, n, dtype=torch.int8, device=w_all.device)
    losses = torch.zeros(c, dtype=torch.float64, device=w_all.device)
    qmin, qmax = gptq_triton.code_range(spec)
    scratch = None
    # Two levels of lazy updates: inside a super-block of `outer` columns each block updates the
    # rest of its super-block (products with 128-deep sums); the columns after a super-block
    # get its whole update at once, a matrix product with `outer`-deep sums, which runs about
    # twice as fast per flop on a GPU in float32.
    outer = block_size * max(1, _SUPER_BLOCK // block_size)
    with _tf32_products(tf32):
        for s1 in range(0, n, outer):
            s2 = min(s1 + outer, n)
            for i1 in range(s1, s2, block_size):
                i2 = min(i1 + block_size, s2)
                scratch = gptq_triton.sweep_block(
                    x, w_all, vn, vd, scales, zeros, group_idx, codes, losses, i1, i2, qmin, qmax, scratch
                )
                if i2 < s2:
                    x[..., i2:s2].baddbmm_(w_all[..., i1:i2], vn[:, i1:i2, i2:s2])
            if s2 < n:
                x[..., s2:].baddbmm_(w_all[..., s1:s2], vn[:, s1:s2, s2:])
    return codes, losses


_SUPER_BLOCK = 1024  # columns per outer lazy-update block of the fused sweep
# Columns per block of the fused sweep, at most (a smaller block_size wins). The kernel's work per
# column grows with the block width while the lazy updates between blocks are cheap TF32 products:
# 64 measured fastest (benchmarks/RESULTS.md, bench_gptq.py: the fused sweep's block width).
_FUSED_BLOCK = 64


def _widen(t):
    """bf16 / fp16 / fp8 scales and int8 zero points as float32 (exact): the column quantizer
    converts them to float32 anyway, so converting once per block saves kernels per column.
    Other dtypes (e8m0 exponents stored as uint8) stay as they are."""
    if t.dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8):
        return t.to(torch.float32)
    return t


def _gather_last(t, index):
    """torch.gather on the last axis, also for float8 tensors (gathered as their bytes)."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.gather(t.view(torch.uint8), -1, index).view(t.dtype)
    return torch.gather(t, -1, index)


class _BlockBuffers:
    """Fixed-address tensors a captured block sweep reads and writes."""

    def __init__(self, w_all, u, codes, params1, width):
        c, rows, _ = w_all.shape
        self.w1 = torch.empty(c, rows, width, dtype=w_all.dtype, device=w_all.device)
        self.u1 = torch.empty(c, width, width, dtype=u.dtype, device=u.device)
        self.err1 = torch.zeros_like(self.w1)
        self.codes1 = [torch.zeros(t.shape[0], t.shape[1], width, dtype=t.dtype, device=t.device) for t in codes]
        self.params1 = [tree_map(torch.empty_like, p) for p in params1]

    def load(self, w_all, u, params1, i1, i2):
        self.w1.copy_(w_all[..., i1:i2])
        self.u1.copy_(u[:, i1:i2, i1:i2])
        for dst, src in zip(self.params1, params1):
            tree_map(lambda d, s_: d.copy_(s_), dst, src)


def _clock(t: torch.Tensor) -> float:
    """Wall time after the device finished the work queued so far (for the report's phase times)."""
    import time

    if t.is_cuda:
        torch.cuda.synchronize(t.device)
    return time.perf_counter()


def _choose_hessians(h, experts, token_counts, min_tokens, shared_hessian, report, device):
    """Replace the Hessians of experts without enough data by the shared one (or mark RTN)."""
    # One pass and one device sync for the whole chunk: a finite sum means finite entries; only
    # experts whose sum is not finite (a non-finite entry, or an overflowing sum) are looked at.
    sum_finite = torch.isfinite(h.sum(dim=(-2, -1))).tolist()
    any_diag = (h.diagonal(dim1=-2, dim2=-1) > 0).any(dim=-1).tolist()
    for j, e in enumerate(experts):
        reason = ""
        if token_counts is not None and token_counts[e] < min_tokens:
            reason = f"{int(token_counts[e])} calibration tokens < min_tokens={min_tokens}"
        elif not sum_finite[j] and not bool(torch.isfinite(h[j]).all()):
            reason = "Hessian has non-finite entries"
        elif not any_diag[j]:
            reason = "Hessian is all zeros (no tokens reached this expert)"
        if not reason:
            continue
        if shared_hessian is not None:
            h[j] = shared_hessian.to(device, h.dtype)
            report.method[e], report.reason[e] = GPTQ_SHARED_HESSIAN, reason
        else:
            report.method[e], report.reason[e] = RTN, reason
    return h


# ---------------------------------------------------------------------------------------------
# checks and sizing


def _check_shapes(ws, h):
    e, _, n = ws[0].shape
    for w in ws:
        if w.dim() != 3 or w.shape[0] != e or w.shape[2] != n:
            raise UserError(f"GPTQ weights must all be [E, out, in] with E={e} and in={n}; got {tuple(w.shape)}.")
        if not bool(torch.isfinite(w).all()):
            raise UserError("GPTQ weight has NaN or infinite values; the checkpoint is damaged.")
    if tuple(h.shape) != (e, n, n):
        raise UserError(
            f"GPTQ Hessian has shape {tuple(h.shape)}; expected ({e}, {n}, {n}) for weights {tuple(ws[0].shape)}."
        )


def _token_counts(tokens, num_experts):
    if tokens is None:
        return None
    counts = torch.as_tensor(tokens).flatten().tolist()
    if len(counts) != num_experts:
        raise UserError(f"tokens has {len(counts)} entries; expected one per expert ({num_experts}).")
    return counts


def _default_chunk(num_experts, rows, num_in, device):
    """Experts per batch so the working set (H, its factors, W, Q, updates) fits the run's memory
    budget (moequant.memory_budget: --max-gpu-memory, default what is free)."""
    from moequant import memory_budget

    # float32: H, its flipped copy, Cholesky factor (+ its split low part), U (act order: gathers);
    # W copies, updates, codes.
    # An optimistic estimate is fine: a chunk that runs out of memory is retried at half the size.
    per_expert = 4 * (6 * num_in * num_in + 4 * rows * num_in)
    return max(1, min(num_experts, int(memory_budget.temporary_bytes(device) // per_expert)))
