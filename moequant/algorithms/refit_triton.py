"""The scale refit's normal equations as one Triton kernel (CUDA; optional).

For one output row with centred codes c (c_i = q_i - z_i) and weights w, the refit
(moequant.algorithms.refit) needs A[g, h] = c_g^T H[g, h] c_h and b[g] = c_g^T (H w)_g for all
groups g, h. In torch that is Y = C_g H, an intermediate G times the weight's size in float32,
and the refit is bound by moving it. Here one program takes a tile of rows and one column block of
H (their codes and weights loaded and widened to float32 once), and walks every group g: T = C_g
H[g, block] with the tensor cores, then A[g, h] = rowsum(T * c_h) for the groups h of the block and
b[g]'s share rowsum(T * w), stored per column block and added up afterwards in a fixed order:
rows x in^2 multiply-adds (one matrix product's worth) and no intermediate in memory. Rows x G x
in float32 operations remain in those row sums, which bound the kernel at narrow groups (g32);
the int32 products become float32 by two full-rate operations each (they are below 2^22), not by
conversion instructions, which run at a quarter of the float32 rate.

Exactness: the codes are small integers (int8 for formats of <= 7 bits). H is written, per row j
and group g, as s[g, j] * (P1 * 2^14 + P2 * 2^7 + P3) with int8 pieces P (`hessian_pieces`): about
2^-22 of the largest |H[j, i]| over the group. The three products C_g P are integer products (int8
in, int32 sums: exact), combined in float32; the row sums with c_h and w are float32. So A and b
carry float32-level rounding, as the split-TF32 torch products they replace (measured against
float64: benchmarks/RESULTS.md, bench_gptq.py).
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
# rows per program, warps, pipeline stages, by group width: the fastest measured (benchmarks/RESULTS.md,
# bench_gptq.py: the refit kernel's launch shapes). Fixed, not tuned per run: results must not depend on timings.
LAUNCH = {128: (64, 8, 3), 64: (64, 8, 3), 32: (64, 8, 3)}


def column_block(group_size: int, cols: int) -> int | None:
    """Columns of H per step (a multiple of the group width dividing `cols`), or None."""
    for block in (128, 64, 32):
        if block >= group_size and cols % block == 0:
            return block
    return None


def usable(bits: int, group_size: int, cols: int, device: torch.device) -> bool:
    """Whether the kernel can form these normal equations (centred codes fit int8; supported widths)."""
    if triton is None:
        return False
    if bits > 7 or group_size not in GROUP_SIZES or column_block(group_size, cols) is None:
        return False
    return device.type == "cuda" or INTERPRETED


def hessian_pieces_reference(h: torch.Tensor, group_size: int):
    """`hessian_pieces` in torch (its definition; tests compare the two)."""
    e, n, _ = h.shape
    rows = h.view(e, n, n // group_size, group_size)  # H[j, group g's columns i]
    s = rows.abs().amax(dim=-1) * (1.0 / (127.0 * BASE * BASE))  # [e, n (j), G]
    s = torch.where(s > 0, s, torch.ones_like(s))
    v = rows / s[..., None]  # |v| <= 127 * 128^2
    pieces = []
    for step in (BASE * BASE, BASE, 1.0):
        p = torch.round(v / step).clamp_(-127, 127)
        v -= p * step  # exact: both are multiples of v's last bit
        pieces.append(p.to(torch.int8).view(e, n, n))
        del p
    return pieces[0], pieces[1], pieces[2], s.transpose(1, 2).contiguous()


def hessian_pieces(h: torch.Tensor, group_size: int):
    """H [e, n, n] float32 (symmetric) -> (P1, P2, P3 int8 [e, n, n], scales [e, G, n] float32) with
    H[j, i] ~ s[g, j] * (P1 * 128^2 + P2 * 128 + P3)[j, i] for the columns i of group g: one scale per
    row j and group, so an outlier channel's large entries cost the others no precision. Off by at
    most 0.625 * s, about 2.4e-7 of the largest |H[j, i]| over the group (P1 in +-127; P2, P3 in
    +-64). Row j of group g's pieces is column j of H's row block g (H is symmetric up to
    its rounding), stored with the group's columns contiguous: the K-major operand the int8 tensor-core products take."""
    e, n, _ = h.shape
    if not (h.is_cuda or INTERPRETED) or group_size not in GROUP_SIZES:
        return hessian_pieces_reference(h, group_size)
    h = h.contiguous()
    p1, p2, p3 = (torch.empty(e, n, n, dtype=torch.int8, device=h.device) for _ in range(3))
    s = torch.empty(e, n // group_size, n, dtype=torch.float32, device=h.device)
    rows = 64
    _pieces_kernel[(triton.cdiv(n, rows), n // group_size, e)](
        h, p1, p2, p3, s, n, n // group_size, GS=group_size, BLOCK_J=rows, num_warps=4
    )
    return p1, p2, p3, s


def normal_equations(codes: torch.Tensor, weight: torch.Tensor, hessian, group_size: int):
    """A [e, r, G, G] and b [e, r, G] (float32) of the refit: codes [e, r, n] centred int8, weight
    [e, r, n] (float32 or bf16), hessian [e, n, n] float32 or its `hessian_pieces` (projections that
    share a Hessian share its pieces)."""
    e, rows, n = codes.shape
    groups = n // group_size
    block = column_block(group_size, n)
    nblocks = n // block
    p1, p2, p3, scales = hessian_pieces(hessian, group_size) if isinstance(hessian, torch.Tensor) else hessian
    codes, weight = codes.contiguous(), weight.contiguous()
    a = torch.empty(e, rows, groups, groups, dtype=torch.float32, device=codes.device)
    # b's sums per column block, added up afterwards in a fixed order (no atomics: results must not
    # depend on timings)
    b_parts = torch.empty(e, nblocks, rows, groups, dtype=torch.float32, device=codes.device)
    block_r, warps, stages = LAUNCH[group_size]
    # row tiles vary fastest: the programs of one column block read its columns of H while they are in L2
    grid = (triton.cdiv(rows, block_r), nblocks, e)
    _normal_kernel[grid](
        codes,
        weight,
        p1,
        p2,
        p3,
        scales,
        a,
        b_parts,
        rows,
        n,
        nblocks,
        GROUPS=groups,
        GS=group_size,
        BLOCK_R=block_r,
        BLOCK_N=block,
        num_warps=warps,
        **({} if INTERPRETED else {"num_stages": stages}),
    )
    return a, b_parts.sum(1)


def b_parts_bytes(rows: int, cols: int, group_size: int) -> int:
    """Bytes per expert of `normal_equations`' per-column-block sums of b (for chunk sizing)."""
    block = column_block(group_size, cols) or group_size
    return 4 * rows * (cols // block) * (cols // group_size)


if triton is not None:

    @triton.jit
    def _pieces_kernel(H, P1, P2, P3, S, n, groups, GS: tl.constexpr, BLOCK_J: tl.constexpr):
        j = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)
        g = tl.program_id(1)
        e = tl.program_id(2).to(tl.int64)
        live = j < n
        cols = g * GS + tl.arange(0, GS)
        off = e * n * n + tl.where(live, j, 0).to(tl.int64)[:, None] * n + cols[None, :]
        h = tl.load(H + off)
        s = tl.max(tl.abs(h), axis=1) * (1.0 / (127.0 * 128.0 * 128.0))
        s = tl.where(s > 0, s, 1.0)
        v = tl.div_rn(h, s[:, None])
        p1 = tl.minimum(tl.maximum((v * (1.0 / 16384.0) + 12582912.0) - 12582912.0, -127.0), 127.0)
        v = v - p1 * 16384.0
        p2 = tl.minimum(tl.maximum((v * (1.0 / 128.0) + 12582912.0) - 12582912.0, -127.0), 127.0)
        v = v - p2 * 128.0
        p3 = tl.minimum(tl.maximum((v + 12582912.0) - 12582912.0, -127.0), 127.0)
        tl.store(P1 + off, p1.to(tl.int8), mask=live[:, None])
        tl.store(P2 + off, p2.to(tl.int8), mask=live[:, None])
        tl.store(P3 + off, p3.to(tl.int8), mask=live[:, None])
        tl.store(S + (e * groups + g) * n + j, s, mask=live)

    @triton.jit
    def _int_to_float(x):
        """int32 -> float32 for |x| < 2^22, exactly: two full-rate operations instead of a conversion
        instruction (a quarter of the float32 rate); callers' products are bounded by 128 * 127 * 127."""
        return (x + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0

    @triton.jit
    def _normal_kernel(
        C,
        W,
        P1,
        P2,
        P3,
        S,
        A,
        BP,
        rows,
        n,
        nblocks,
        GROUPS: tl.constexpr,
        GS: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # one program: BLOCK_R rows x one column block of BLOCK_N columns (their codes and weights
        # loaded and widened once), every group g: T = C_g H[g, block], then A[g, h] for the block's
        # groups h and b[g]'s share of the block
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        jb = tl.program_id(1)
        e = tl.program_id(2).to(tl.int64)
        live = r < rows
        r64 = tl.where(live, r, 0).to(tl.int64)
        row_off = e * rows * n + r64 * n  # [R] offsets of the rows in C and W
        cols = jb * BLOCK_N + tl.arange(0, BLOCK_N)
        ch = tl.load(C + row_off[:, None] + cols[None, :]).to(tl.float32)
        wh = tl.load(W + row_off[:, None] + cols[None, :]).to(tl.float32)
        kk = tl.arange(0, GS)
        NPB: tl.constexpr = BLOCK_N // GS  # groups per column block
        hs = jb * NPB + tl.arange(0, NPB)
        groups = GROUPS
        a_off = (e * rows + r64) * groups * groups
        b_off = ((e * nblocks + jb) * rows + r64) * groups
        h_off = e * n * n + cols.to(tl.int64)[:, None] * n  # [BLOCK_N, 1]
        for g in range(0, GROUPS):
            cg = tl.load(C + row_off[:, None] + (g * GS + kk)[None, :])  # [R, GS] int8
            hp = h_off + (g * GS + kk)[None, :]  # [BLOCK_N, GS], K-major
            # each product is an exact int32 below 2^22 (|c| <= 127, |P| <= 127, GS <= 128)
            t1 = _int_to_float(tl.dot(cg, tl.trans(tl.load(P1 + hp)), out_dtype=tl.int32))
            t2 = _int_to_float(tl.dot(cg, tl.trans(tl.load(P2 + hp)), out_dtype=tl.int32))
            t3 = _int_to_float(tl.dot(cg, tl.trans(tl.load(P3 + hp)), out_dtype=tl.int32))
            t = (t1 * 128.0 + t2) * 128.0 + t3
            t = t * tl.load(S + (e * groups + g) * n + cols)[None, :]  # T = C_g H[g, block]  [R, BLOCK_N]
            tl.store(BP + b_off + g, tl.sum(t * wh, axis=1), mask=live)
            a_blk = tl.sum(tl.reshape(t * ch, [BLOCK_R, NPB, GS]), axis=2)  # [R, NPB]: A[g, h]
            tl.store(A + (a_off + g * groups)[:, None] + hs[None, :], a_blk, mask=live[:, None])
