"""The scale refit's normal equations as one Triton kernel (CUDA; optional).

For one output row with centred codes c (c_i = q_i - z_i) and weights w, the refit
(moequant.algorithms.refit) needs A[g, h] = c_g^T H[g, h] c_h and b[g] = c_g^T (H w)_g for all
groups g, h. In torch that is Y = C_g H, an intermediate G times the weight's size in float32,
and the refit is bound by moving it. Here one program takes a tile of rows and one group g,
walks the column blocks of H's row block g, and per block forms T = C_g H[g, block] with the
tensor cores, then A[g, h] = rowsum(T * c_h) for the groups h of the block and b[g] += rowsum(T * w):
rows x in^2 multiply-adds (one matrix product's worth) and no intermediate in memory.

Exactness: the codes are small integers (int8 for formats of <= 7 bits). H is written per column of
each group's row block as s * (P1 * 2^14 + P2 * 2^7 + P3) with int8 pieces P (`hessian_pieces`):
about 2^-22 of the column's largest entry there. The three products C_g P are
integer products (int8 in, int32 sums: exact), combined in float32; the row sums with c_h and
w are float32. So A and b carry float32-level rounding, like the split-TF32 products they replace.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is optional: without it (or without CUDA) the refit's torch products run.
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means "not available"
    triton = None

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # Triton's CPU interpreter (development)
GROUP_SIZES = (32, 64, 128)  # group widths the kernel takes (the int8 products' depth)
BASE = 128.0  # the pieces' radix: P1 * BASE^2 + P2 * BASE + P3
LAUNCH = (64, 4)  # rows per program, warps (measured on the H200: benchmarks/bench_gptq.py --profile-refit)


def column_block(group_size: int, cols: int) -> int | None:
    """Columns of H per step (a multiple of the group width dividing `cols`), or None."""
    for block in (128, 64, 32):
        if block >= group_size and cols % block == 0:
            return block
    return None


def usable(bits: int, group_size: int, cols: int, device: torch.device) -> bool:
    """Whether the kernel can form these normal equations (centred codes fit int8; supported widths)."""
    if triton is None or os.environ.get("MOEQUANT_TRITON", "1") == "0":
        return False
    if bits > 7 or group_size not in GROUP_SIZES or column_block(group_size, cols) is None:
        return False
    return device.type == "cuda" or INTERPRETED


def hessian_pieces(h: torch.Tensor, group_size: int):
    """H [e, n, n] float32 -> (P1, P2, P3 int8 [e, n, n], scales [e, G, n] float32) with
    H[i, j] ~ s[g, j] * (P1 * 128^2 + P2 * 128 + P3) for the rows i of group g: one scale per column
    of each group's row block, so an outlier channel's large column costs the others no precision.
    Off by at most 0.625 * s, about 2.4e-7 of the largest |H[i, j]| of the group's rows in that
    column (P1 in +-127; P2, P3 in +-64)."""
    e, n, _ = h.shape
    g = n // group_size
    rows = h.view(e, g, group_size, n)
    s = rows.abs().amax(dim=2) / (127.0 * BASE * BASE)
    s = torch.where(s > 0, s, torch.ones_like(s))
    v = rows / s[:, :, None, :]  # |v| <= 127 * 128^2
    pieces = []
    for step in (BASE * BASE, BASE, 1.0):
        p = torch.round(v / step).clamp_(-127, 127)
        v -= p * step  # exact: both are multiples of v's last bit
        pieces.append(p.to(torch.int8).view(e, n, n))
        del p
    return pieces[0], pieces[1], pieces[2], s.contiguous()


def normal_equations(codes: torch.Tensor, weight: torch.Tensor, hessian: torch.Tensor, group_size: int):
    """A [e, r, G, G] and b [e, r, G] (float32) of the refit: codes [e, r, n] centred int8, weight
    [e, r, n] (float32 or bf16), hessian [e, n, n] float32."""
    e, rows, n = codes.shape
    groups = n // group_size
    block = column_block(group_size, n)
    p1, p2, p3, scales = hessian_pieces(hessian, group_size)
    codes, weight = codes.contiguous(), weight.contiguous()
    a = torch.empty(e, rows, groups, groups, dtype=torch.float32, device=codes.device)
    b = torch.empty(e, rows, groups, dtype=torch.float32, device=codes.device)
    block_r, warps = LAUNCH
    grid = (groups, triton.cdiv(rows, block_r), e)
    _normal_kernel[grid](codes, weight, p1, p2, p3, scales, a, b, rows, n, groups,
                         NBLOCKS=n // block, GS=group_size, BLOCK_R=block_r, BLOCK_N=block, num_warps=warps)
    return a, b


if triton is not None:

    @triton.jit
    def _normal_kernel(C, W, P1, P2, P3, S, A, B, rows, n, groups,
                       NBLOCKS: tl.constexpr, GS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
        g = tl.program_id(0)  # groups vary fastest: the programs of one row tile share its codes in L2
        e = tl.program_id(2).to(tl.int64)
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = r < rows
        r64 = tl.where(live, r, 0).to(tl.int64)
        row_off = e * rows * n + r64 * n  # [R] offsets of the rows in C and W
        kk = tl.arange(0, GS)
        cg = tl.load(C + row_off[:, None] + (g * GS + kk)[None, :])  # [R, GS] int8
        h_rows = e * n * n + (g * GS + kk).to(tl.int64) * n  # [GS] offsets of H's rows of group g
        s_row = S + (e * groups + g) * n
        b_acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        NPB: tl.constexpr = BLOCK_N // GS  # groups per column block
        for j in range(0, NBLOCKS):
            cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
            hp = h_rows[:, None] + cols[None, :]
            acc = tl.dot(cg, tl.load(P1 + hp), out_dtype=tl.int32) * 128  # |acc| < 2^26: int32 is exact
            acc = tl.dot(cg, tl.load(P2 + hp), acc, out_dtype=tl.int32)
            t = acc.to(tl.float32) * 128.0 + tl.dot(cg, tl.load(P3 + hp), out_dtype=tl.int32).to(tl.float32)
            t = t * tl.load(s_row + cols)[None, :]  # T = C_g H[g, block]  [R, BLOCK_N]
            ch = tl.load(C + row_off[:, None] + cols[None, :]).to(tl.float32)
            wh = tl.load(W + row_off[:, None] + cols[None, :]).to(tl.float32)
            b_acc += tl.sum(t * wh, axis=1)
            a_blk = tl.sum(tl.reshape(t * ch, [BLOCK_R, NPB, GS]), axis=2)  # [R, NPB]: A[g, h] of this block
            hs = j * NPB + tl.arange(0, NPB)
            a_off = (e * rows + r64) * groups * groups + g * groups
            tl.store(A + a_off[:, None] + hs[None, :], a_blk, mask=live[:, None])
        tl.store(B + (e * rows + r64) * groups + g, b_acc, mask=live)
