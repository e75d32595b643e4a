"""The factorizations GPTQ solves with: the damped Cholesky factor of each expert's Hessian (or of its inverse),
retried with tenfold damping where it fails, and on CUDA a blocked Cholesky made of batched matrix products
(split-TF32 products by default: moequant.algorithms.gpu_math)."""

from __future__ import annotations

import torch

from moequant.algorithms.tf32 import tf32_products


def inverse_cholesky(h, damp, max_tries, skip, inverse=True, tf32=False, how="auto"):
    """U = upper Cholesky factor of (H + lambda I)^-1 per expert, lambda = f * mean(diag(H)).

    f starts at `damp` and grows tenfold for the experts whose factorization failed, up to
    `max_tries` tries. Experts flagged in `skip` (round-to-nearest) get U = I.
    With inverse=False, V = U^-1 instead (upper triangular, H + lambda I = V V^T), which the
    fused sweep uses. tf32, how: as `cholesky_ex`'s.
    Returns (U or V [c, in, in], f used per expert, None where skipped or every try failed).
    """
    c, n = h.shape[0], h.shape[-1]
    mean_diag = h.diagonal(dim1=-2, dim2=-1).mean(dim=-1)
    u = None  # allocated (as identities) only when some expert is skipped or fails
    used: list[float | None] = [None] * c
    todo = torch.tensor([not s for s in skip], device=h.device)
    factor = damp
    for _ in range(max_tries):
        if not bool(todo.any()):
            break
        rows = todo.nonzero().flatten()
        every = len(rows) == c
        # U without forming H^-1: with J the order-reversing permutation and J H J = L L^T,
        # H^-1 = (J L^-1 J)^T (J L^-1 J) and J L^-1 J is upper triangular. One Cholesky and one
        # triangular solve, half the work of inverse-then-Cholesky. V = J L J.
        damped = torch.flip(h if every else h[rows], dims=(-2, -1))
        damped.diagonal(dim1=-2, dim2=-1).add_((factor * mean_diag[rows])[:, None])
        chol, info = cholesky_ex(damped, tf32, how)
        del damped
        if inverse:
            eye = torch.eye(n, device=h.device, dtype=h.dtype).expand(len(rows), n, n)
            upper = torch.flip(torch.linalg.solve_triangular(chol, eye, upper=False), dims=(-2, -1))
            ok = (info == 0) & torch.isfinite(upper).flatten(1).all(dim=1)
        else:
            upper = torch.flip(chol, dims=(-2, -1))
            ok = (info == 0) & torch.isfinite(upper.diagonal(dim1=-2, dim2=-1)).all(dim=1)
        del chol
        ok &= (upper.diagonal(dim1=-2, dim2=-1) > 0).all(dim=1)
        if every and u is None and bool(ok.all()):  # the usual case: no copy into identities
            u = upper
            used = [factor] * c
            break
        if u is None:
            u = torch.eye(n, device=h.device, dtype=h.dtype).repeat(c, 1, 1)
        done = rows[ok]
        u[done] = upper[ok]
        del upper
        for j in done.tolist():
            used[j] = factor
        todo[done] = False
        factor = factor * 10 if factor > 0 else 1e-4
    if u is None:
        u = torch.eye(n, device=h.device, dtype=h.dtype).repeat(c, 1, 1)
    return u, used


def cholesky_ex(a, tf32=False, how="auto"):
    """torch.linalg.cholesky_ex (lower factor, info per matrix), on CUDA for large batched
    matrices as a blocked left-looking Cholesky whose work is batched matrix products over all
    experts. how (the recipe's gptq.gpu_math.cholesky): torch (torch's batched one), looped (torch's,
    one matrix at a time), blocked (`blocked_cholesky`, split-TF32 products with tf32), auto (blocked on
    CUDA for n >= 1024, else torch)."""

    n = a.shape[-1]
    if how == "auto":
        how = "blocked" if a.is_cuda and a.dim() == 3 and n >= 1024 else "torch"
    if how == "looped" and a.dim() == 3:
        out = [torch.linalg.cholesky_ex(m) for m in a]
        return torch.stack([o[0] for o in out]), torch.stack([o[1] for o in out])
    if how != "blocked" or a.dim() != 3:
        return torch.linalg.cholesky_ex(a)
    return blocked_cholesky(a, 512, split=tf32)


def blocked_cholesky(a, nb, split=False):
    """Lower Cholesky factors of a batch [c, n, n], overwriting `a` (left-looking, panels of nb
    columns: one batched product with the finished columns, a small batched Cholesky of the
    diagonal block, a batched triangular solve below it). Returns (L, info) like cholesky_ex.

    split: the products with the finished columns as three TF32 tensor-core products: each
    finished column is split exactly into hi (its top 11 significant bits, a TF32 number) + lo
    (the rest) once, and L L^T = hi hi^T + hi lo^T + lo hi^T up to the lo lo^T term and lo's
    rounding to TF32, about 2^-20 relative (~16 float32 roundings) instead of plain TF32's 2^-11,
    which lets some damped Hessians lose positive definiteness (measured). `a` holds hi while
    it runs and hi + lo (= L exactly) at the end."""
    c, n = a.shape[0], a.shape[-1]
    info = torch.zeros(c, dtype=torch.int32, device=a.device)
    lo = torch.empty_like(a) if split else None
    for j in range(0, n, nb):
        j2 = min(j + nb, n)
        panel = a[:, j:, j:j2]
        if j > 0:
            if split:
                hi_rows, lo_rows = a[:, j:, :j], lo[:, j:, :j]
                with tf32_products(True):
                    panel.baddbmm_(lo_rows, hi_rows[:, : j2 - j].mT, alpha=-1)  # small terms first
                    panel.baddbmm_(hi_rows, lo_rows[:, : j2 - j].mT, alpha=-1)
                    panel.baddbmm_(hi_rows, hi_rows[:, : j2 - j].mT, alpha=-1)
            else:
                panel.baddbmm_(a[:, j:, :j], a[:, j:j2, :j].mT, alpha=-1)
        d, bad = torch.linalg.cholesky_ex(panel[:, : j2 - j])
        info = torch.where((info == 0) & (bad > 0), bad + j, info)
        panel[:, : j2 - j] = d
        if j2 < n:
            panel[:, j2 - j :] = torch.linalg.solve_triangular(d.mT, panel[:, j2 - j :], upper=True, left=False)
            if split:  # finished columns j..j2 (rows j..n): hi in place, lo beside it
                hi = (panel.view(torch.int32) & -8192).view(torch.float32)
                torch.sub(panel, hi, out=lo[:, j:, j:j2])
                panel.copy_(hi)
                del hi
    if split:
        for j in range(0, n - nb, nb):  # the last panel was never split
            a[:, j:, j : j + nb] += lo[:, j:, j : j + nb]
        del lo
    return a.tril_(), info
