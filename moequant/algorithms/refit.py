"""Least-squares scales for fixed integer codes: the scale refit after GPTQ.

GPTQ fixes every group's scale before its sweep (static groups) and then chooses codes that
compensate each other's error through the Hessian. Once the codes are chosen, the scales are no
longer the best ones for them: for one output row w (inputs d, groups g with codes q_g and zero
points z_g), the dequantized row is sum_g s_g (q_g - z_g), and its output error on the calibration
inputs, (w - sum_g s_g c_g)^T H (w - sum_g s_g c_g) with c_g = q_g - z_g (zero outside group g), is
a quadratic in the G scales: the minimum solves A s = b with A_gh = c_g^T H c_h and b_g = c_g^T H w.

The refit solves that system per row, stores the scales in bf16 and keeps, per row, whichever of
the old and new scales gives the smaller error with the stored values (so it never makes the
calibration objective worse). Rows whose solution is not positive and finite keep their scales.
Codes and zero points are unchanged, so the format and its bytes are too.
"""

from __future__ import annotations

import dataclasses

import torch

from moequant.errors import UserError


def refit_scales(q, weight: torch.Tensor, hessian: torch.Tensor):
    """q (integer group format, [E, out, in] or [out, in]) with each row's scales re-solved for the least
    output error tr((W - Wq) H (W - Wq)^T) given its codes; weight / hessian as given to GPTQ."""
    spec = q.spec
    if not (spec.is_int and spec.granularity == "group"):
        raise UserError(f"the scale refit applies to integer group formats, not {spec.key}")
    single = len(q.shape) == 2
    codes = q.codes[None] if single else q.codes
    scales = q.scales[None] if single else q.scales
    zeros = None if q.zeros is None else (q.zeros[None] if single else q.zeros)
    w = (weight[None] if single else weight).to(torch.float32)
    # float64 on the CPU; float32 on accelerators, where float64 is slow and the per-row check below
    # still keeps the old scales wherever the solve does not help
    work = torch.float64 if codes.device.type == "cpu" else torch.float32
    h = (hessian[None] if single else hessian).to(device=codes.device, dtype=work)
    num_experts, rows, cols = codes.shape
    groups = scales.shape[-1]
    gs = cols // groups
    new_scales = scales.clone()
    chunk_rows = max(1, min(rows, 2**25 // (cols * groups)))  # [rows, in, G] float64 temporaries <= 256 MiB
    for e in range(num_experts):
        he = h[e]
        for r0 in range(0, rows, chunk_rows):
            r1 = min(rows, r0 + chunk_rows)
            c = codes[e, r0:r1].to(work)  # [r, in]
            if zeros is not None:
                c = c - zeros[e, r0:r1].to(work).repeat_interleave(gs, dim=-1)
            new_scales[e, r0:r1] = _refit_rows(c, w[e, r0:r1].to(work), he, scales[e, r0:r1], groups, gs)
    out = new_scales[0] if single else new_scales
    return dataclasses.replace(q, scales=out)


def _refit_rows(c, w, h, old, groups: int, gs: int):
    """Scales [r, G] (bf16) for rows with centred codes c [r, in], weights w [r, in], Hessian h [in, in]."""
    r = c.shape[0]
    block = c.reshape(r, groups, gs)
    a = torch.einsum("rga,gahb,rhb->rgh", block, h.reshape(groups, gs, groups, gs), block)  # [r, G, G]
    b = torch.einsum("rga,rga->rg", block, (w @ h).reshape(r, groups, gs))  # [r, G]
    diag = a.diagonal(dim1=-2, dim2=-1)
    live = diag > 0  # a group whose codes are all zero has no say in the output
    a = a + torch.diag_embed(torch.where(live, 1e-9 * diag, torch.ones_like(diag)))
    b = torch.where(live, b, torch.zeros_like(b))
    s, info = torch.linalg.solve_ex(a, b)
    s = torch.where(live, s, old.to(s.dtype))
    ok = (info == 0) & torch.isfinite(s).all(-1) & ((s > 0) | ~live).all(-1)
    s_new = torch.where(ok[:, None], s, old.to(s.dtype)).to(old.dtype)

    def error(scale):
        d = w - (block * scale.to(w.dtype)[:, :, None]).reshape(r, -1)
        return ((d @ h) * d).sum(-1)

    better = error(s_new) < error(old)
    return torch.where(better[:, None], s_new, old)
