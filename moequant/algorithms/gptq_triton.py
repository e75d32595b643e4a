"""Fused in-block GPTQ column sweep for integer formats (Triton, CUDA only; optional).

GPTQ here is written with the reversed Cholesky factor of the Hessian itself instead of the
Cholesky factor of its inverse. With H = V V^T (V upper triangular; `moequant.algorithms.gptq`
gets V from one Cholesky of the order-reversed H), the GPTQ factor is U = V^-1, and GPTQ's
updates w_k -= sum_{i<k} e_i U_ik with e_i = (w_i^(i) - q_i) / U_ii are, in closed form,

    w_k^(k) = w_k + sum_{i<k} d_i V'_ik,   d_i = w_i - q_i (original weight minus its quantized
                                           value),  V'_ik = V_ik / V_kk,

because W - Q = E U gives E = (W - Q) V. So no triangular inverse is needed, and the lazy
update between blocks is one matmul with V': W[:, later] += D[:, block] @ V'[block, later].

`sweep_block` does the in-block part of one block of columns for a batch of experts: one
program per (row tile, expert) keeps its [rows, block] tile of the current weights in
registers and walks the block's columns, quantizing each with the precomputed (static)
scales of its group, which is what the torch sweep does with ~25 kernels per column.
`sweep_block_reference` is the same arithmetic in torch (it defines what the kernel computes;
tests compare the two on CUDA). Integer formats (symmetric or asymmetric, per group or per
channel) only; every other format keeps moequant.algorithms.gptq's torch sweep.

Arithmetic, as the formats' column quantizer: y = x / s (IEEE division; 0 when s == 0),
rounded half to even, + z, clamped to the code range; value (code - z) * s, all float32.
The kernel is compiled without floating-point contraction so its rounding is the reference's.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is an optional dependency: without it (or without CUDA) the torch path is used.
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means "not available"
    triton = None

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # Triton's CPU interpreter (development)


def usable(spec, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fused sweep can run this format on this device (the caller asks whether it is switched off)."""
    if triton is None:
        return False
    if dtype != torch.float32 or not spec.is_int or spec.granularity not in ("group", "channel"):
        return False
    return device.type == "cuda" or INTERPRETED


LAUNCH = (32, 4)  # rows per program, warps per program (for 128-column blocks)
# launch shape per block width (power of two); widths not listed scale LAUNCH's rows by 128 / width
# measured fastest (benchmarks/RESULTS.md, bench_gptq.py: the column kernel's launch shapes)
LAUNCH_BY_BLOCK: dict[int, tuple[int, int]] = {64: (32, 1)}


def launch_shape(block: int) -> tuple[int, int]:
    """(rows per program, warps) for a block of `block` columns (a power of two >= 16)."""
    if block in LAUNCH_BY_BLOCK:
        return LAUNCH_BY_BLOCK[block]
    return max(1, LAUNCH[0] * 128 // block), LAUNCH[1]


def code_range(spec) -> tuple[int, int]:
    return -(2 ** (spec.bits - 1)), 2 ** (spec.bits - 1) - 1


def sweep_block_reference(x, w0d, vn, vd, scales, zeros, group_idx, codes, loss, i1, i2, qmin, qmax, loss_parts=None):
    """In-block GPTQ sweep over columns i1..i2 (torch; the kernel's definition).

    x:      [c, rows, n] current weights (original + updates from earlier blocks); columns
            i1..i2 are updated in place (scratch).
    w0d:    [c, rows, n] original weights; columns i1..i2 are overwritten with d = w - q.
    vn:     [c, n, n] V' (V with each column divided by its diagonal); vd: [c, n] diag(V).
    scales: [c, rows, G] float32; zeros: same or None; group_idx: [c, n] int (group of each column).
    codes:  [c, rows, n] int8, columns i1..i2 written.  loss: [c] float64, += GPTQ's proxy loss.
    """
    for k in range(i1, i2):
        g = group_idx[:, k].long()[:, None, None].expand(-1, x.shape[1], 1)
        s = torch.gather(scales, 2, g)  # [c, rows, 1]
        xk = x[..., k : k + 1].to(torch.float32)
        y = torch.where(s != 0, xk / torch.where(s != 0, s, 1.0), 0.0).round()  # s < 0: signed scales
        if zeros is not None:
            z = torch.gather(zeros, 2, g)
            code = (y + z).clamp(qmin, qmax)
            q = (code - z) * s
        else:
            code = y.clamp(qmin, qmax)
            q = code * s
        codes[..., k : k + 1] = code.to(codes.dtype)
        q = q.to(x.dtype)
        d = w0d[..., k : k + 1] - q
        w0d[..., k : k + 1] = d
        err = (x[..., k : k + 1] - q) * vd[:, None, k : k + 1]
        loss += err.double().square().sum(dim=(1, 2)) / 2
        x[..., k + 1 : i2] += d * vn[:, None, k, k + 1 : i2]
    return loss_parts


def sweep_block(
    x,
    w0d,
    vn,
    vd,
    scales,
    zeros,
    group_idx,
    codes,
    loss,
    i1,
    i2,
    qmin,
    qmax,
    loss_parts=None,
    tile_rows=None,
    num_warps=None,
):
    """The fused kernel: same arguments and results as `sweep_block_reference` (float32 only).

    loss_parts: optional [c, row_tiles] float32 scratch, reused between blocks of one solve.
    tile_rows, num_warps: launch shape (default `LAUNCH`; benchmarks/bench_gptq.py --profile times others).
    """
    c, rows, _ = x.shape
    width = i2 - i1
    for t in (x, w0d, vn, scales, group_idx, codes):
        assert t.stride(-1) == 1, "the fused sweep needs unit stride along the last axis"
    block = max(16, triton.next_power_of_2(width))
    default_rows, default_warps = launch_shape(block)
    tile_rows = tile_rows or default_rows
    num_warps = num_warps or default_warps
    grid = (triton.cdiv(rows, tile_rows), c)
    if loss_parts is None or loss_parts.shape != (c, grid[0]):
        loss_parts = torch.empty(c, grid[0], dtype=torch.float32, device=x.device)
    has_zeros = zeros is not None
    _sweep_kernel[grid](
        x,
        w0d,
        vn,
        vd,
        scales,
        zeros if has_zeros else scales,
        group_idx,
        codes,
        loss_parts,
        rows,
        i1,
        x.stride(0),
        x.stride(1),
        w0d.stride(0),
        w0d.stride(1),
        vn.stride(0),
        vn.stride(1),
        vd.stride(0),
        scales.stride(0),
        scales.stride(1),
        group_idx.stride(0),
        codes.stride(0),
        codes.stride(1),
        float(qmin),
        float(qmax),
        HAS_ZEROS=has_zeros,
        TILE_ROWS=tile_rows,
        BLOCK=block,
        WIDTH=width,
        num_warps=num_warps,
        **({} if INTERPRETED else {"enable_fp_fusion": False}),
    )
    loss += loss_parts.sum(dim=1, dtype=torch.float64) / 2
    return loss_parts


if triton is not None:

    @triton.jit
    def _sweep_kernel(
        X,
        W0D,
        VN,
        VD,
        S,
        Z,
        GI,
        CODES,
        LOSS,
        rows,
        i1,
        sx_e,
        sx_r,
        sw_e,
        sw_r,
        sv_e,
        sv_r,
        svd_e,
        ss_e,
        ss_r,
        sg_e,
        sc_e,
        sc_r,
        qmin,
        qmax,
        HAS_ZEROS: tl.constexpr,
        TILE_ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
        WIDTH: tl.constexpr,
    ):
        pid_r = tl.program_id(0)
        e = tl.program_id(1).to(tl.int64)
        r = pid_r * TILE_ROWS + tl.arange(0, TILE_ROWS)
        cols = tl.arange(0, BLOCK)
        rmask = r < rows
        cmask = cols < WIDTH
        r64 = r.to(tl.int64)
        x_ptrs = X + e * sx_e + r64[:, None] * sx_r + (i1 + cols)[None, :]
        tile = tl.load(x_ptrs, mask=rmask[:, None] & cmask[None, :], other=0.0)
        w_row = W0D + e * sw_e + r64 * sw_r + i1
        s_row = S + e * ss_e + r64 * ss_r
        z_row = Z + e * ss_e + r64 * ss_r
        code_tile = tl.zeros((TILE_ROWS, BLOCK), dtype=tl.int8)
        loss = tl.zeros((TILE_ROWS,), dtype=tl.float32)
        for k in range(0, WIDTH):
            sel = cols[None, :] == k
            xk = tl.sum(tl.where(sel, tile, 0.0), axis=1)  # column k of the tile (exact: one term)
            g = tl.load(GI + e * sg_e + i1 + k)
            s = tl.load(s_row + g, mask=rmask, other=1.0)
            y = tl.where(s != 0, tl.div_rn(xk, tl.where(s != 0, s, 1.0)), 0.0)
            y = tl.minimum(tl.maximum(y, -4194304.0), 4194304.0)
            y = (y + 12582912.0) - 12582912.0  # round half to even (|y| <= 2^22)
            if HAS_ZEROS:
                z = tl.load(z_row + g, mask=rmask, other=0.0)
                code = tl.minimum(tl.maximum(y + z, qmin), qmax)
                q = (code - z) * s
            else:
                code = tl.minimum(tl.maximum(y, qmin), qmax)
                q = code * s
            d = tl.load(w_row + k, mask=rmask, other=0.0) - q
            vdk = tl.load(VD + e * svd_e + i1 + k)
            err = (xk - q) * vdk
            loss += err * err
            v = tl.load(VN + e * sv_e + (i1 + k) * sv_r + i1 + cols, mask=cmask & (cols > k), other=0.0)
            # columns after k get d_k's update; column k, no longer needed, now holds d_k
            # (columns before k hold their d already: v is 0 there, adding 0 keeps them)
            tile = tl.where(sel, d[:, None], tile + d[:, None] * v[None, :])
            code_tile = tl.where(sel, code.to(tl.int8)[:, None], code_tile)
        mask2 = rmask[:, None] & cmask[None, :]
        tl.store(W0D + e * sw_e + r64[:, None] * sw_r + (i1 + cols)[None, :], tile, mask=mask2)
        tl.store(CODES + e * sc_e + r64[:, None] * sc_r + (i1 + cols)[None, :], code_tile, mask=mask2)
        tl.store(LOSS + e * tl.num_programs(0) + pid_r, tl.sum(tl.where(rmask, loss, 0.0), axis=0))
