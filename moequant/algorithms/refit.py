"""Least-squares scales for fixed integer codes: the scale refit after GPTQ.

GPTQ fixes every group's scale before its sweep (static groups) and then chooses codes that
compensate each other's error through the Hessian. Once the codes are chosen, the scales are no
longer the best ones for them: for one output row w (inputs d, groups g with codes q_g and zero
points z_g), the dequantized row is sum_g s_g (q_g - z_g), and its output error on the calibration
inputs, (w - sum_g s_g c_g)^T H (w - sum_g s_g c_g) with c_g = q_g - z_g (zero outside group g), is
a quadratic in the G scales: the minimum solves A s = b with A_gh = c_g^T H c_h and b_g = c_g^T H w.

The refit solves that system per row, stores the scales in bf16 and keeps, per row, whichever of
the old and new scales gives the smaller error with the stored values (so it never makes the
calibration objective worse). Rows whose solution is not finite or changes a scale's sign (the searched
grid's choice, formats.core.signed_scales) keep their scales.
Codes and zero points are unchanged, so the format and its bytes are too.
"""

from __future__ import annotations

import dataclasses

import torch

from moequant.algorithms import refit_triton
from moequant.errors import UserError


def refit_scales(
    q, weight: torch.Tensor, hessian: torch.Tensor, *, budget_bytes: int | None = None, triton: bool = True
):
    """q (integer group format, [E, out, in] or [out, in]) with each row's scales re-solved for the least
    output error tr((W - Wq) H (W - Wq)^T) given its codes; weight / hessian as given to GPTQ.

    Batched over experts and rows: per chunk of experts, A = [c_g^T H c_h] and b = [c_g^T H w] for
    every row, then all [G, G] systems are solved at once. On CUDA (formats of <= 7 bits, groups of
    32 / 64 / 128) A and b come from one Triton kernel (moequant.algorithms.refit_triton: int8
    tensor-core products with H in three int8 pieces, float32 sums) that never forms the G x
    weight-sized intermediate Y = C_g H; otherwise Y is formed, in float64 on the CPU and in
    split TF32 on accelerators (H = H_hi + H_lo, both TF32 numbers; the codes are small
    integers, exact in TF32), about 2^-20 relative. The systems are solved by Cholesky (A is a
    Gram matrix, lightly damped) on accelerators, by LU in float64 on the CPU. Chunks hold at
    most `budget_bytes` of the work (default: moequant.memory_budget's share for temporaries). The
    per-row check keeps the old scales wherever the solve does not help. triton=False: never the kernel (the
    recipe's gptq.gpu_math.triton)."""
    return refit_scales_shared([q], [weight], hessian, budget_bytes=budget_bytes, triton=triton)[0]


def refit_scales_shared(qs, weights, hessian: torch.Tensor, *, budget_bytes: int | None = None, triton: bool = True):
    """`refit_scales` of projections that read the same input (gate and up): one Hessian, whose
    preparation (the kernel's int8 pieces) is made once per chunk of experts for all of them;
    the same scales as one `refit_scales` per projection."""
    from moequant import memory_budget

    for q in qs:
        if not (q.spec.is_int and q.spec.granularity == "group"):
            raise UserError(f"the scale refit applies to integer group formats, not {q.spec.key}")
    spec = qs[0].spec
    single = len(qs[0].shape) == 2
    lift = (lambda t: None if t is None else t[None]) if single else (lambda t: t)  # noqa: E731
    codes = [lift(q.codes) for q in qs]
    scales = [lift(q.scales) for q in qs]
    zeros = [lift(q.zeros) for q in qs]
    w_all = [lift(w) for w in weights]
    h_all = lift(hessian)
    device = codes[0].device
    work = torch.float64 if device.type == "cpu" else torch.float32
    num_experts, _, cols = codes[0].shape
    groups = scales[0].shape[-1]
    gs = cols // groups
    kernel = triton and refit_triton.usable(spec.bits, gs, cols, device) and work == torch.float32
    rows = max(c.shape[1] for c in codes)  # one projection's systems are alive at a time
    if kernel:
        # A, its damped copy and Cholesky factor, b and its per-column-block sums, the centred codes, H and
        # its int8 pieces
        per_expert = (
            4 * (3 * rows * groups * groups + 2 * rows * cols)
            + 8 * cols * cols
            + refit_triton.b_parts_bytes(rows, cols, gs)
        )
    else:
        # Y and one Y-sized temporary (its second product, then the A reduction's), codes, weights, W H,
        # the Hessian and its two TF32 halves
        per_expert = work.itemsize * (2 * groups * rows * cols + 3 * rows * cols + 3 * cols * cols)
    limit = budget_bytes if budget_bytes is not None else memory_budget.temporary_bytes(device) // 2
    chunk = max(1, min(num_experts, limit // per_expert))
    parts, e0 = [[] for _ in qs], 0
    while e0 < num_experts:
        e1 = min(num_experts, e0 + chunk)
        try:
            h = h_all[e0:e1].to(device=device, dtype=work)
            if kernel:
                h = refit_triton.hessian_pieces(h, gs)
            new = []
            for k in range(len(qs)):
                z = None if zeros[k] is None else zeros[k][e0:e1].repeat_interleave(gs, dim=-1)
                if kernel:  # centred codes as int8 (|q - z| <= 2^B - 1), the weights as given
                    c = codes[k][e0:e1] if z is None else codes[k][e0:e1] - z
                    a, b = refit_triton.normal_equations(c, w_all[k][e0:e1].to(device), h, gs)
                else:
                    c = codes[k][e0:e1].to(work) if z is None else codes[k][e0:e1].to(work) - z.to(work)
                    a, b = _normal_equations(c, w_all[k][e0:e1].to(device=device, dtype=work), h, groups)
                c = z = None
                new.append(_solve(a, b, scales[k][e0:e1]))
                a = b = None
            h = None
        except torch.OutOfMemoryError:  # the estimate was too optimistic (fragmentation): smaller chunks
            if chunk == 1:
                raise
            a = b = c = z = h = new = None
            torch.cuda.empty_cache()
            chunk = max(1, chunk // 2)
            continue
        for k, s_new in enumerate(new):
            parts[k].append(s_new)
        e0 = e1
    out = []
    for q, p in zip(qs, parts):
        s_new = torch.cat(p) if len(p) > 1 else p[0]
        out.append(dataclasses.replace(q, scales=s_new[0] if single else s_new))
    return out


def _normal_equations(c, w, h, groups: int):
    """A [e, r, G, G] and b [e, r, G] for centred codes c [e, r, in], weights w [e, r, in], Hessians h [e, in, in]."""
    e, r, n = c.shape
    gs = n // groups
    cg = c.view(e, r, groups, gs).transpose(1, 2)  # [e, G, r, gs]
    hg = h.view(e, groups, gs, n)  # rows of H by group
    y = _times_hessian(cg, hg)  # [e, G, r, n]: y[:, g, i] = c_g of row i times H
    a = (y.view(e, groups, r, groups, gs) * cg.transpose(1, 2).unsqueeze(1)).sum(-1)  # [e, G(g), r, G(h)]
    del y
    a = a.transpose(1, 2)  # [e, r, G, G]
    b = (c * _times_hessian(w, h, split_left=True)).view(e, r, groups, gs).sum(-1)  # c_g^T (H w): [e, r, G]
    return a, b


def _solve(a, b, old):
    """Per row, the bf16 scales solving A s = b, kept where they beat the old scales `old` [e, r, G]."""
    diag = a.diagonal(dim1=-2, dim2=-1)
    live = diag > 0  # a group whose codes are all zero has no say in the output
    damped = a.clone()  # A + damping on the diagonal (in place: one A-sized copy, not two)
    damped.diagonal(dim1=-2, dim2=-1).add_(torch.where(live, 1e-9 * diag, torch.ones_like(diag)))
    b = torch.where(live, b, torch.zeros_like(b))
    if damped.is_cuda:  # Cholesky: half LU's work, and batched faster on GPUs (measured 2.3x at G = 224)
        factor, info = torch.linalg.cholesky_ex(damped)
        del damped
        s = torch.cholesky_solve(b.unsqueeze(-1), factor).squeeze(-1)
        del factor
    else:
        s, info = torch.linalg.solve_ex(damped, b)
        del damped
    old_w = old.to(s.dtype)
    s = torch.where(live, s, old_w)
    ok = (info == 0) & torch.isfinite(s).all(-1) & ((s * old_w > 0) | ~live).all(-1)  # each keeps its sign
    s_new = torch.where(ok[..., None], s, old_w).to(old.dtype)

    # The output error of scales s is w^T H w - 2 s^T b + s^T A s: compare the last two terms.

    def excess(scale):
        sc = scale.to(a.dtype)
        return (sc.unsqueeze(-2) @ a @ sc.unsqueeze(-1)).squeeze(-1).squeeze(-1) - 2 * (sc * b).sum(-1)

    better = excess(s_new) < excess(old)
    return torch.where(better[..., None], s_new, old)


def _times_hessian(x, h, split_left: bool = False):
    """x @ h (batched); on CUDA in split TF32 (refit_scales' doc): h = h_hi + h_lo, and with `split_left` x too
    (weights need not be TF32 numbers; the codes are small integers, exact in TF32)."""
    if not x.is_cuda or x.dtype != torch.float32:
        return torch.matmul(x, h)
    from moequant.algorithms.tf32 import tf32_products

    def split(t):
        hi = (t.view(torch.int32) & -8192).view(torch.float32)  # the top 11 significant bits: a TF32 number
        return hi, t - hi

    h_hi, h_lo = split(h)
    with tf32_products(True):
        y = torch.matmul(x, h_lo)
        if split_left:
            x_hi, x_lo = split(x)
            y += torch.matmul(x_lo, h_hi)
            y += torch.matmul(x_hi, h_hi)
        else:
            y += torch.matmul(x, h_hi)
    return y
