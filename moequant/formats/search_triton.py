"""The searched integer grid (`formats.core.searched_fit`) as one Triton kernel (CUDA; optional).

`searched_fit` tries ~46 candidate scales per group (symmetric: amax / d for 23 divisors d, each
also refitted by weighted least squares; asymmetric: 21 range divisors on the group's own min,
each with its least-squares (scale, offset) refit). In torch every candidate is a handful of
full passes over the weights, ~1,400 passes per projection. Here one program loads a tile of
groups once and evaluates every candidate in registers: one read of the weights and the
importance, one write of the chosen scales (and zero points). A symmetric group is searched on both
code ranges in that pass, its own and the mirrored one of a negative scale (core._search says why
that is the search on -x): the candidates' codes are rounded once and clamped twice. With `signed`
the kernel also makes core._choose_sign's choice between the two, on the codes `_encode` stores:
in torch that choice is a dozen more passes over the weights (benchmarks/RESULTS.md, bench_gptq.py:
the sign choice inside the Triton kernel).

Arithmetic is searched_fit's torch loop, operation for operation: candidate scales are
spread * (1 / d) with 1 / d in float32 (`factors`); in a candidate's error an element's code is
round(x * (1 / s)) with 1 / s one IEEE division (div_rn) per group; the codes a least-squares
candidate is fitted on, and its quotients, are IEEE divisions;
rounding is half to even, scales are rounded to bf16 before their codes and error are computed,
and a candidate replaces the best so far only when its error is strictly smaller (candidates in
searched_fit's order). The sums over a group run in another order than torch's, so a group whose
two best candidates tie to within a float32 rounding may pick the other one
(tests/test_formats_cuda.py counts them). Compiled without floating-point contraction, as
moequant.algorithms.gptq_triton.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is optional: without it (or without CUDA) searched_fit's torch loop runs.
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means "not available"
    triton = None

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # Triton's CPU interpreter (development)
GROUP_SIZES = (16, 32, 64, 128, 256)  # group widths the kernel takes (one tile row per group)


def usable(spec, xg: torch.Tensor) -> bool:
    """Whether the kernel runs this search: integer groups of a listed width, on CUDA (or the interpreter)."""
    if triton is None:
        return False
    if not (spec.is_int and spec.granularity == "group") or xg.shape[-1] not in GROUP_SIZES:
        return False
    return xg.is_cuda or INTERPRETED


def _lead3(t: torch.Tensor, shape) -> tuple[torch.Tensor, tuple[int, ...]]:
    """t broadcast to `shape` (leading dims + group axis), as a view with 3 leading dims and its strides."""
    t = t.expand(shape)
    for i in reversed(range(len(shape) - 1)):  # size-1 dims carry no offset (views, in order)
        if shape[i] == 1 and t.dim() > 2:
            t = t.squeeze(i)
    lead = t.shape[:-1]
    if len(lead) > 3:  # merge the leading dims (copies only when their strides do not allow a view)
        t = t.reshape((-1,) + tuple(lead[-2:]) + (t.shape[-1],))
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t, tuple(t.stride())


def searched_fit_triton(
    spec,
    x: torch.Tensor,
    importance,
    start_scales: torch.Tensor,
    start_zeros,
    factors: torch.Tensor,
    signed: bool = False,
):
    """core._search on CUDA. x: float32 [..., k] groups; importance broadcasting against x (or None);
    start_scales / start_zeros: the min/max rule's bf16 scales / int8 zero points [...] (the first
    candidate); factors: float32 [candidates], 1 / the symmetric divisors or 1 / the asymmetric
    level counts, in searched_fit's order; signed (symmetric only): each group's scale sign chosen
    as core._choose_sign does. Returns (scales bf16, zeros int8 or None) shaped x.shape[:-1]."""
    k = x.shape[-1]
    shape = tuple(x.shape)
    xv, xs = _lead3(x, shape)
    w = (
        torch.ones((1,) * x.dim(), dtype=torch.float32, device=x.device)
        if importance is None
        else importance.to(torch.float32)
    )
    wv, ws = _lead3(w, shape)
    n0, n1, n2 = xv.shape[:3]
    m = n0 * n1 * n2
    s_in = start_scales.reshape(-1).contiguous()
    out_s = torch.empty(m, dtype=torch.bfloat16, device=x.device)
    symmetric = start_zeros is None
    z_in = s_in if symmetric else start_zeros.reshape(-1).contiguous()
    out_z = out_s if symmetric else torch.empty(m, dtype=torch.int8, device=x.device)
    factors = factors.to(device=x.device, dtype=torch.float32)
    block_m, warps = LAUNCH.get(k, (max(1, 2048 // k), 4))
    grid = (triton.cdiv(m, block_m),)
    _search_kernel[grid](
        xv,
        wv,
        s_in,
        z_in,
        out_s,
        out_z,
        factors,
        m,
        n1,
        n2,
        xs[0],
        xs[1],
        xs[2],
        xs[3],
        ws[0],
        ws[1],
        ws[2],
        ws[3],
        float(-(2 ** (spec.bits - 1))),
        float(2 ** (spec.bits - 1) - 1),
        float(2**spec.bits - 1),
        SYMMETRIC=symmetric,
        SIGNED=symmetric and signed,
        K=k,
        BLOCK_M=block_m,
        N_CAND=len(factors),
        num_warps=warps,
        **({} if INTERPRETED else {"enable_fp_fusion": False}),
    )
    lead = shape[:-1]
    return out_s.reshape(lead), None if symmetric else out_z.reshape(lead)


# groups per program and warps, by group width (default: 2048 elements per program, 4 warps);
# measured within 5% of the default (benchmarks/RESULTS.md, bench_gptq.py: the search kernel's launch shapes)
LAUNCH: dict[int, tuple[int, int]] = {128: (8, 4), 32: (16, 2)}


if triton is not None:

    @triton.jit
    def _round(y):
        """Half to even for |y| <= 2^22 (callers clamp to the code range first)."""
        return (y + 12582912.0) - 12582912.0

    @triton.jit
    def _finite_positive(s):
        return (s == s) & (s > 0) & (s < float("inf"))

    @triton.jit
    def _reciprocal(s, default):
        """1 / s where s > 0 (one IEEE division per group), else `default`."""
        return tl.where(s > 0, tl.div_rn(1.0, tl.where(s > 0, s, 1.0)), default)

    @triton.jit
    def _codes_of_quotient(x, s, qmin, qmax):
        """round(clamp(x / s)) per element with x / s an IEEE division, as searched_fit's torch loop, for
        s > 0 [M]: y = x * (1 / s) is within 2^-22 |y| of the quotient, so the two round alike unless y
        lies within 2^-13 of a half-integer (|y| <= 512) or is not finite; only a tile holding such an
        element does the divisions (the candidates are scales, |x| / s <= the largest divisor)."""
        y = x * tl.div_rn(1.0, s)[:, None]
        k = _round(y)
        near = ~(tl.abs(tl.abs(y - k) - 0.5) > 1.0 / 8192.0) | ~(tl.abs(y) <= 512.0)
        codes = tl.minimum(tl.maximum(k, qmin), qmax)
        if tl.max(near.to(tl.int32)) > 0:
            codes = _round(tl.minimum(tl.maximum(tl.div_rn(x, s[:, None]), qmin), qmax))
        return codes

    @triton.jit
    def _error(x, w, s, z, qmin, qmax, SYMMETRIC: tl.constexpr):
        """sum w (x - dequantized)^2 per group for bf16-valued scales s [M] (zero points z [M]): codes
        round(x * (1 / s)) (+ z), clamped (clamping first gives the same integers: rounding is monotone)."""
        sc = s[:, None]
        y = x * _reciprocal(s, 0.0)[:, None]
        if SYMMETRIC:
            back = _round(tl.minimum(tl.maximum(y, qmin), qmax)) * sc
        else:
            zc = z[:, None]
            back = _round(tl.minimum(tl.maximum(y, qmin - zc), qmax - zc)) * sc
        d = x - back
        return tl.sum(w * (d * d), axis=1)

    @triton.jit
    def _error_pair(x, w, s, qmin, qmax):
        """_error of a symmetric candidate on the code range qmin..qmax and on the mirrored one
        -qmax..-qmin (the search on -x), from one rounding: rounded on qmin..-qmin, then each range's
        end level cut (clamping and rounding commute on integer bounds)."""
        sc = s[:, None]
        k = _round(tl.minimum(tl.maximum(x * _reciprocal(s, 0.0)[:, None], qmin), -qmin))
        d = x - tl.minimum(k, qmax) * sc
        d_m = x - tl.maximum(k, -qmax) * sc
        return tl.sum(w * (d * d), axis=1), tl.sum(w * (d_m * d_m), axis=1)

    @triton.jit
    def _stored_error(x, w, s, qmin, qmax):
        """sum w (x - dequantized)^2 per group with the codes `_encode` stores, round(x / s) (IEEE
        divisions) on qmin..qmax; a zero scale dequantizes to 0 whatever the codes."""
        d = x - _codes_of_quotient(x, tl.where(s > 0, s, 1.0), qmin, qmax) * s[:, None]
        return tl.sum(w * (d * d), axis=1)

    @triton.jit
    def _consider(x, w, s, z, best, best_s, best_z, qmin, qmax, SYMMETRIC: tl.constexpr):
        """The candidate (s, z) replaces the best so far in the groups where its error is strictly smaller."""
        err = _error(x, w, s, z, qmin, qmax, SYMMETRIC)
        better = err < best
        return tl.where(better, err, best), tl.where(better, s, best_s), tl.where(better, z, best_z)

    @triton.jit
    def _store_scale(s32):
        """A candidate scale as searched_fit stores it: 0 unless finite and positive, then bf16."""
        s32 = tl.where(_finite_positive(s32), s32, 0.0)
        # bf16, round to nearest even, in integer arithmetic (as cvt.rn.bf16.f32; Triton's CPU
        # interpreter truncates in .to(tl.bfloat16)); s32 is finite and >= 0 here
        b = s32.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        return b.to(tl.float32, bitcast=True)

    @triton.jit
    def _zero_point(v, s, qmin, qmax):
        """qmin + round(v) as an int8-valued zero point: NaN -> 0, clamped; 0 where the scale is 0."""
        v = tl.minimum(tl.maximum(v, -4194304.0), 4194304.0)  # in _round's range (saturates below anyway)
        z = tl.where(v == v, tl.minimum(tl.maximum(qmin + _round(v), qmin), qmax), 0.0)
        return tl.where(s > 0, z, 0.0)

    @triton.jit
    def _search_kernel(
        X,
        W,
        S0,
        Z0,
        OUT_S,
        OUT_Z,
        F,
        m,
        n1,
        n2,
        sx0,
        sx1,
        sx2,
        sx3,
        sw0,
        sw1,
        sw2,
        sw3,
        qmin,
        qmax,
        steps,
        SYMMETRIC: tl.constexpr,
        SIGNED: tl.constexpr,
        K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        N_CAND: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        live = rows < m
        r = tl.where(live, rows, 0).to(tl.int64)
        i2 = r % n2
        i1 = (r // n2) % n1
        i0 = r // (n1 * n2)
        cols = tl.arange(0, K).to(tl.int64)
        x = tl.load(X + (i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None] + cols[None, :] * sx3)
        w = tl.load(W + (i0 * sw0 + i1 * sw1 + i2 * sw2)[:, None] + cols[None, :] * sw3)
        best_s = tl.load(S0 + r).to(tl.float32)
        if SYMMETRIC:
            best_z = best_s * 0.0
        else:
            best_z = tl.load(Z0 + r).to(tl.float32)
        best = _error(x, w, best_s, best_z, qmin, qmax, SYMMETRIC)
        if SYMMETRIC:  # both code ranges (the search on x and on -x), one rounding per candidate
            best_m = _error(x, w, best_s, best_z, -qmax, -qmin, SYMMETRIC)
            best_sm = best_s
            amax = tl.max(tl.abs(x), axis=1)
            for i in range(0, N_CAND):
                s32 = amax * tl.load(F + i)
                s = _store_scale(s32)
                err, err_m = _error_pair(x, w, s, qmin, qmax)
                best_s = tl.where(err < best, s, best_s)
                best = tl.where(err < best, err, best)
                best_sm = tl.where(err_m < best_m, s, best_sm)
                best_m = tl.where(err_m < best_m, err_m, best_m)
                # each range's weighted least-squares refit on its codes of the unrounded candidate
                both = _codes_of_quotient(x, tl.where(s32 > 0, s32, 1.0), qmin, -qmin)
                codes = tl.minimum(both, qmax)
                s = _store_scale(tl.div_rn(tl.sum(w * x * codes, axis=1), tl.sum(w * (codes * codes), axis=1)))
                best, best_s, best_z = _consider(x, w, s, best_z, best, best_s, best_z, qmin, qmax, SYMMETRIC)
                codes = tl.maximum(both, -qmax)
                s = _store_scale(tl.div_rn(tl.sum(w * x * codes, axis=1), tl.sum(w * (codes * codes), axis=1)))
                best_m, best_sm, best_z = _consider(x, w, s, best_z, best_m, best_sm, best_z, -qmax, -qmin, SYMMETRIC)
            if SIGNED:  # core._choose_sign: -s of the mirrored search where its error is strictly smaller
                e = _stored_error(x, w, best_s, qmin, qmax)
                e_m = _stored_error(x, w, best_sm, -qmax, -qmin)
                best_s = tl.where(e_m < e, -best_sm, best_s)
        else:
            lo = tl.min(x, axis=1)
            hi = tl.max(x, axis=1)
            sw = tl.sum(w, axis=1)
            sx = tl.sum(w * x, axis=1)
            for i in range(0, N_CAND):
                s0 = (hi - lo) * tl.load(F + i)
                s = _store_scale(s0)
                z = _zero_point(tl.div_rn(-lo, s), s, qmin, qmax)
                best, best_s, best_z = _consider(x, w, s, z, best, best_s, best_z, qmin, qmax, SYMMETRIC)
                # weighted least squares x ~ s * l + m on the candidate's codes l in 0..steps
                step = tl.where(s0 > 0, s0, 1.0)
                lev = _round(tl.minimum(tl.maximum(tl.div_rn(x - lo[:, None], step[:, None]), 0.0), steps))
                sl = tl.sum(w * lev, axis=1)
                sll = tl.sum(w * lev * lev, axis=1)
                slx = tl.sum(w * lev * x, axis=1)
                det = sw * sll - sl * sl
                s_ls = tl.div_rn(sw * slx - sl * sx, det)
                m_ls = tl.div_rn(sll * sx - sl * slx, det)
                s = _store_scale(s_ls)
                z = _zero_point(tl.div_rn(-m_ls, s), s, qmin, qmax)
                best, best_s, best_z = _consider(x, w, s, z, best, best_s, best_z, qmin, qmax, SYMMETRIC)
        tl.store(OUT_S + r, best_s.to(tl.bfloat16), mask=live)
        if not SYMMETRIC:
            tl.store(OUT_Z + r, best_z.to(tl.int8), mask=live)
