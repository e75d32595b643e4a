"""ggml block types (llama.cpp / GGUF): exact byte costs, quantization with a weighted scale
search, and the block packing, written from the block layouts of ggml-common.h.

A ggml-typed QuantizedTensor holds the packed blocks themselves: `codes` is uint8
[..., out, in / block * block_bytes] (the bytes a GGUF tensor stores for each row), `scales`
is None. Every row is split along the input axis into blocks of 32 (Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1) or super-blocks of 256 (K types); a row length the block does not divide is a UserError.

Block layouts (little endian, `half` = IEEE fp16):

| type | bytes | fields, in order | value of element i |
|------|-------|------------------|--------------------|
| Q8_0 | 34 | d, qs int8[32] | d*q |
| Q4_0 | 18 | d, qs[16]: element j low nibble, j+16 high | d*(q-8) |
| Q4_1 | 20 | d, m, qs[16] as Q4_0 | d*q + m |
| Q5_0 | 22 | d, qh u32 (bit i = bit 4 of element i), qs[16] as Q4_0 | d*(q-16) |
| Q5_1 | 24 | d, m, qh, qs as Q5_0 | d*q + m |
| Q2_K | 84 | scales[16] (low nibble scale, high min), qs[64], d, dmin | d*sc*q - dmin*m, 16 sub-blocks of 16 |
| Q3_K | 110 | hmask[32], qs[64], scales[12] (6-bit, -32), d | d*(sc-32)*q, q = 2 low bits - (hmask bit ? 0 : 4) |
| Q4_K | 144 | d, dmin, scales[12] (6-bit scales+mins), qs[128] | d*sc*q - dmin*m, 8 sub-blocks of 32 |
| Q5_K | 176 | d, dmin, scales[12], qh[32], qs[128] | as Q4_K with a 5th bit |
| Q6_K | 210 | ql[128], qh[64], scales int8[16], d | d*sc*(q-32), 16 sub-blocks of 16 |

Bit positions inside a K super-block: 2-bit codes (Q2_K, Q3_K) — element 128h + 32j + l is bits
2j of qs[32h + l] (and, for Q3_K, bit 4h + j of hmask[l]); 4-bit codes (Q4_K, Q5_K) — element
64c + l is the low nibble of qs[32c + l], element 64c + 32 + l its high nibble (Q5_K's 5th bits:
bits 2c / 2c+1 of qh[l]); Q6_K — element 128h + 32k + l takes the low (k < 2) / high (k >= 2)
nibble of ql[64h + 32(k % 2) + l] and bits 2k of qh[32h + l]. Sub-blocks are in element order.
The 12 scale bytes of Q4_K / Q5_K hold 8 six-bit scales and mins: for j < 4, scale j and min j
are the low 6 bits of bytes j and j+4; for j >= 4 their low 4 bits are the nibbles of byte j+4
and their top 2 bits the top 2 bits of bytes j-4 and j. Q3_K's 12 bytes hold 16 six-bit scales:
low 4 bits of scale i in nibble i // 8 of byte i % 8, top 2 bits in bits 2(i // 4) of byte 8 + i % 4.

Quantization (ours, not llama.cpp's): per block or sub-block, a grid of candidate scales
(and for types with a minimum, candidate ranges) is tried; each candidate's codes are rounded,
its scale (and minimum) refitted by weighted least squares, and the candidate with the least
weighted squared error kept. Weights are the input's second moments per column (the
diagonal of the Hessian, i.e. llama.cpp's imatrix) when given, else 1. K types then quantize
the sub-block scales (and mins) on the super-block scale, round the codes again with the
stored scales and refit the super-block scale(s) the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moequant.formats.specs import Format, FormatSpec, register, take_params

GGML_TYPES = ("q8_0", "q6_k", "q5_k", "q5_1", "q5_0", "q4_k", "q4_1", "q4_0", "q3_k", "q2_k")


@dataclass(frozen=True)
class BlockType:
    name: str  # moequant's format name, e.g. "q4_k"
    ggml_id: int  # GGMLQuantizationType value
    block: int  # weights per block
    nbytes: int  # bytes per block
    bits: int  # bits of one code


TYPES = {
    t.name: t
    for t in (
        BlockType("q4_0", 2, 32, 18, 4),
        BlockType("q4_1", 3, 32, 20, 4),
        BlockType("q5_0", 6, 32, 22, 5),
        BlockType("q5_1", 7, 32, 24, 5),
        BlockType("q8_0", 8, 32, 34, 8),
        BlockType("q2_k", 10, 256, 84, 2),
        BlockType("q3_k", 11, 256, 110, 3),
        BlockType("q4_k", 12, 256, 144, 4),
        BlockType("q5_k", 13, 256, 176, 5),
        BlockType("q6_k", 14, 256, 210, 6),
    )
}
GGML_NAME = {t.name: t.name.upper() for t in TYPES.values()}  # llama.cpp's spelling, "Q4_K"

_SEARCH = torch.linspace(-0.6, 1.2, 19).tolist()  # offsets of the code range tried per block


def row_bytes(name: str, cols: int) -> int:
    t = TYPES[name]
    return cols // t.block * t.nbytes


# ------------------------------------------------------------------------------- fitting


def _lsq_scale(x, w, L):
    """argmin_s sum w (x - s L)^2 over the last axis (0 where L is all zero)."""
    num = (w * x * L).sum(-1)
    den = (w * L * L).sum(-1)
    return torch.where(den > 0, num / den.clamp_min(1e-30), torch.zeros_like(num))


def _fit_symmetric(x, w, qmin: int, qmax: int):
    """Best scale per block (last axis) for codes in [qmin, qmax]: scale [...], codes [..., b]."""
    idx = x.abs().argmax(-1, keepdim=True)
    xm = x.gather(-1, idx).squeeze(-1)  # the signed extreme
    best_err = best_s = best_L = None
    for off in _SEARCH:
        for end in (qmin,) if qmin == -qmax else (qmin, qmax):  # an uneven range: try both ends for the extreme
            denom = end - off if end < 0 else end + off
            if denom == 0:
                continue
            s = xm / denom
            s = torch.where(s == 0, torch.ones_like(s), s)
            L = torch.clamp(torch.round(x / s[..., None]), qmin, qmax)
            s = _lsq_scale(x, w, L)
            err = (w * (x - s[..., None] * L) ** 2).sum(-1)
            if best_err is None:
                best_err, best_s, best_L = err, s, L
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_s = torch.where(better, s, best_s)
                best_L = torch.where(better[..., None], L, best_L)
    return best_s, best_L


def _lsq_scale_min(x, w, L, min_le_zero: bool):
    """argmin_{s, m} sum w (x - s L - m)^2, with m <= 0 when asked (then s >= 0 too)."""
    sw, sl, sll = w.sum(-1), (w * L).sum(-1), (w * L * L).sum(-1)
    sx, slx = (w * x).sum(-1), (w * L * x).sum(-1)
    det = sw * sll - sl * sl
    ok = det > 1e-20 * (sw * sll).clamp_min(1e-30)
    s = torch.where(ok, (sw * slx - sl * sx) / torch.where(ok, det, 1.0), torch.zeros_like(det))
    m = torch.where(ok, (sll * sx - sl * slx) / torch.where(ok, det, 1.0), sx / sw.clamp_min(1e-30))
    if min_le_zero:
        pos = m > 0  # refit the scale alone with m = 0
        s = torch.where(pos, torch.where(sll > 0, slx / sll.clamp_min(1e-30), 0.0), s)
        m = torch.where(pos, torch.zeros_like(m), m)
        s = s.clamp_min(0)
    return s, m


def _fit_scale_min(x, w, nmax: int, min_le_zero: bool):
    """Best (scale, min) per block for codes 0..nmax: x ~ s*L + m."""
    lo = x.amin(-1)
    if min_le_zero:
        lo = lo.clamp(max=0)
    hi = x.amax(-1)
    rng = (hi - lo).clamp_min(1e-30)
    best_err = best = None
    for off in _SEARCH:
        s = rng / (nmax + off)
        L = torch.clamp(torch.round((x - lo[..., None]) / s[..., None]), 0, nmax)
        s2, m2 = _lsq_scale_min(x, w, L, min_le_zero)
        err = (w * (x - s2[..., None] * L - m2[..., None]) ** 2).sum(-1)
        if best_err is None:
            best_err, best = err, (s2, m2, L)
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = tuple(
                torch.where(better if t.dim() == better.dim() else better[..., None], t, b)
                for t, b in zip((s2, m2, L), best)
            )
    return best


def _half(t):
    return t.to(torch.float16).to(torch.float32)


# ------------------------------------------------------------------------------- per type


def _q_simple(x, w, t: BlockType):
    """Q8_0 / Q4_0 / Q5_0 (d) and Q4_1 / Q5_1 (d, m): x [N, 32] -> dict of fields."""
    if t.name in ("q4_1", "q5_1"):
        nmax = 2**t.bits - 1
        s, m, _ = _fit_scale_min(x, w, nmax, False)
        d, mm = _half(s), _half(m)
        L = torch.clamp(torch.round((x - mm[:, None]) / torch.where(d == 0, 1.0, d)[:, None]), 0, nmax)
        return {"d": d, "m": mm, "q": L}
    qmin, qmax = {"q8_0": (-127, 127), "q4_0": (-8, 7), "q5_0": (-16, 15)}[t.name]
    s, _ = _fit_symmetric(x, w, qmin, qmax)
    d = _half(s)
    L = torch.clamp(torch.round(x / torch.where(d == 0, 1.0, d)[:, None]), qmin, qmax)
    return {"d": d, "q": L - qmin if t.name != "q8_0" else L}


def _q_k_symmetric(x, w, t: BlockType):
    """Q3_K / Q6_K: x [N, 256] -> d [N], integer sub-scales [N, 16], codes [N, 256] (signed)."""
    qmin, qmax, smax = (-4, 3, 31) if t.name == "q3_k" else (-32, 31, 127)
    xs, ws = x.reshape(-1, 16, 16), w.reshape(-1, 16, 16)
    s, _ = _fit_symmetric(xs, ws, qmin, qmax)  # [N, 16]
    amax = s.abs().amax(-1)
    d = _half(amax / smax)
    sc = torch.clamp(torch.round(s / torch.where(d == 0, 1.0, d)[:, None]), -smax - 1, smax)
    for _ in range(2):  # codes under the stored scales, then the super-block scale refitted
        eff = d[:, None] * sc
        L = torch.clamp(torch.round(xs / torch.where(eff == 0, 1.0, eff)[..., None]), qmin, qmax)
        L = torch.where(eff[..., None] == 0, torch.zeros_like(L), L)
        d = _half(_lsq_scale(x, w, (sc[..., None] * L).reshape(x.shape)).clamp_min(0))
    eff = d[:, None] * sc
    L = torch.clamp(torch.round(xs / torch.where(eff == 0, 1.0, eff)[..., None]), qmin, qmax)
    L = torch.where(eff[..., None] == 0, torch.zeros_like(L), L)
    return d, sc, L.reshape(x.shape)


def _q_k_scale_min(x, w, t: BlockType):
    """Q2_K / Q4_K / Q5_K -> d, dmin [N], scales, mins [N, n_sub] (unsigned), codes [N, 256]."""
    sub = 16 if t.name == "q2_k" else 32
    nmax = 2**t.bits - 1
    smax = 15 if t.name == "q2_k" else 63
    xs, ws = x.reshape(x.shape[0], -1, sub), w.reshape(x.shape[0], -1, sub)
    s, m, _ = _fit_scale_min(xs, ws, nmax, True)  # s >= 0, m <= 0
    d = _half(s.amax(-1) / smax)
    dmin = _half((-m).amax(-1) / smax)
    sc = torch.clamp(torch.round(s / torch.where(d == 0, 1.0, d)[:, None]), 0, smax)
    mn = torch.clamp(torch.round(-m / torch.where(dmin == 0, 1.0, dmin)[:, None]), 0, smax)
    for _ in range(2):
        eff, off = d[:, None] * sc, dmin[:, None] * mn
        L = torch.clamp(torch.round((xs + off[..., None]) / torch.where(eff == 0, 1.0, eff)[..., None]), 0, nmax)
        L = torch.where(eff[..., None] == 0, torch.zeros_like(L), L)
        # refit (d, dmin) of each super-block: x ~ d * (sc L) - dmin * mn
        a = (sc[..., None] * L).reshape(x.shape)
        b = mn[..., None].expand_as(xs).reshape(x.shape)
        saa, sbb, sab = (w * a * a).sum(-1), (w * b * b).sum(-1), (w * a * b).sum(-1)
        sxa, sxb = (w * x * a).sum(-1), (w * x * b).sum(-1)
        det = saa * sbb - sab * sab
        ok = det > 1e-12 * (saa * sbb).clamp_min(1e-30)
        nd = torch.where(ok, (sbb * sxa - sab * sxb) / torch.where(ok, det, 1.0), d)
        nm = torch.where(ok, (sab * sxa - saa * sxb) / torch.where(ok, det, 1.0), dmin)
        good = ok & (nd >= 0) & (nm >= 0)
        d, dmin = torch.where(good, _half(nd), d), torch.where(good, _half(nm), dmin)
    eff, off = d[:, None] * sc, dmin[:, None] * mn
    L = torch.clamp(torch.round((xs + off[..., None]) / torch.where(eff == 0, 1.0, eff)[..., None]), 0, nmax)
    L = torch.where(eff[..., None] == 0, torch.zeros_like(L), L)
    return d, dmin, sc, mn, L.reshape(x.shape)


# ------------------------------------------------------------------------------- packing


def _u8(t):
    return t.to(torch.uint8)


def _half_bytes(t):
    return t.to(torch.float16).contiguous().view(torch.uint8).reshape(t.shape[0], 2)


def _nibbles(lo, hi):
    return _u8(lo) | (_u8(hi) << 4)


def _pack_k_scales(sc, mn):
    """8 six-bit scales and mins -> the 12 bytes of Q4_K / Q5_K."""
    sc, mn = _u8(sc), _u8(mn)
    out = torch.zeros(sc.shape[0], 12, dtype=torch.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return out


def _unpack_k_scales(b):
    sc = torch.empty(b.shape[0], 8, dtype=torch.uint8)
    mn = torch.empty_like(sc)
    sc[:, 0:4], mn[:, 0:4] = b[:, 0:4] & 63, b[:, 4:8] & 63
    sc[:, 4:8] = (b[:, 8:12] & 15) | ((b[:, 0:4] >> 6) << 4)
    mn[:, 4:8] = (b[:, 8:12] >> 4) | ((b[:, 4:8] >> 6) << 4)
    return sc, mn


def _pack_q3_scales(sc):
    """16 six-bit scales (already offset by +32) -> 12 bytes."""
    sc = _u8(sc)
    out = torch.zeros(sc.shape[0], 12, dtype=torch.uint8)
    out[:, 0:8] = (sc[:, 0:8] & 15) | ((sc[:, 8:16] & 15) << 4)
    for i in range(16):
        out[:, 8 + i % 4] |= (sc[:, i] >> 4) << (2 * (i // 4))
    return out


def _unpack_q3_scales(b):
    sc = torch.empty(b.shape[0], 16, dtype=torch.uint8)
    for i in range(16):
        low = (b[:, i % 8] >> (4 * (i // 8))) & 15
        sc[:, i] = low | (((b[:, 8 + i % 4] >> (2 * (i // 4))) & 3) << 4)
    return sc


def _pack_2bit(L):
    """codes 0..3 [N, 256] -> qs [N, 64]: element 128h + 32j + l at bits 2j of byte 32h + l."""
    q = _u8(L).reshape(-1, 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def _unpack_2bit(qs):
    q = qs.reshape(-1, 2, 1, 32)
    return ((q >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)) & 3).reshape(-1, 256)


def _pack_4bit_k(L):
    """codes 0..15 [N, 256] -> qs [N, 128]: element 64c + l low nibble, 64c + 32 + l high."""
    q = _u8(L).reshape(-1, 4, 2, 32)
    return _nibbles(q[:, :, 0], q[:, :, 1]).reshape(-1, 128)


def _unpack_4bit_k(qs):
    q = qs.reshape(-1, 4, 1, 32)
    return torch.cat([q & 15, q >> 4], dim=2).reshape(-1, 256)


def pack(name: str, fields) -> torch.Tensor:
    """Fields of N blocks -> uint8 [N, block_bytes]."""
    if name == "q8_0":
        d, q = fields["d"], fields["q"]
        return torch.cat([_half_bytes(d), q.to(torch.int8).view(torch.uint8)], dim=1)
    if name in ("q4_0", "q4_1", "q5_0", "q5_1"):
        q = _u8(fields["q"])
        head = [_half_bytes(fields["d"])] + ([_half_bytes(fields["m"])] if "m" in fields else [])
        if name.startswith("q5"):
            bits = (q >> 4).to(torch.int64) << torch.arange(32, dtype=torch.int64)
            qh = bits.sum(-1, keepdim=True).contiguous().view(torch.uint8)[:, :4]  # little endian u32
            head.append(qh)
        return torch.cat(head + [_nibbles(q[:, :16] & 15, q[:, 16:] & 15)], dim=1)
    if name == "q2_k":
        sc, mn, L = fields["sc"], fields["mn"], fields["q"]
        return torch.cat([_nibbles(sc, mn), _pack_2bit(L), _half_bytes(fields["d"]), _half_bytes(fields["dmin"])], 1)
    if name == "q3_k":
        u = _u8(fields["q"] + 4)  # 0..7: bit 2 is the hmask bit
        hm = (u >> 2).reshape(-1, 2, 4, 32)
        hmask = torch.zeros(u.shape[0], 32, dtype=torch.uint8)
        for h in range(2):
            for j in range(4):
                hmask |= hm[:, h, j] << (4 * h + j)
        return torch.cat([hmask, _pack_2bit(u & 3), _pack_q3_scales(fields["sc"] + 32), _half_bytes(fields["d"])], 1)
    if name in ("q4_k", "q5_k"):
        u = _u8(fields["q"])
        parts = [_half_bytes(fields["d"]), _half_bytes(fields["dmin"]), _pack_k_scales(fields["sc"], fields["mn"])]
        if name == "q5_k":
            hb = (u >> 4).reshape(-1, 8, 32)  # sub-block s = 2c + (0|1) -> bit s of qh[l]
            qh = torch.zeros(u.shape[0], 32, dtype=torch.uint8)
            for s in range(8):
                qh |= hb[:, s] << s
            parts.append(qh)
        return torch.cat(parts + [_pack_4bit_k(u & 15)], 1)
    if name == "q6_k":
        u = _u8(fields["q"] + 32).reshape(-1, 2, 4, 32)  # [N, half, quarter, l]
        lo, hi = u & 15, u >> 4
        ql = torch.cat([_nibbles(lo[:, :, 0], lo[:, :, 2]), _nibbles(lo[:, :, 1], lo[:, :, 3])], dim=2)  # [N, 2, 64]
        qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # [N, 2, 32]
        sc = fields["sc"].to(torch.int8).view(torch.uint8)
        return torch.cat([ql.reshape(-1, 128), qh.reshape(-1, 64), sc, _half_bytes(fields["d"])], 1)
    raise KeyError(name)


def _f16(b):
    return b.contiguous().view(torch.float16).reshape(-1).to(torch.float32)


def unpack(name: str, blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [N, block_bytes] -> float32 [N, block] (our own reader of the layouts above)."""
    b = blocks
    if name == "q8_0":
        return _f16(b[:, :2])[:, None] * b[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    if name in ("q4_0", "q4_1", "q5_0", "q5_1"):
        d = _f16(b[:, :2])
        at = 2
        m = None
        if name.endswith("_1"):
            m, at = _f16(b[:, 2:4]), 4
        qs = b[:, -16:]
        q = torch.cat([qs & 15, qs >> 4], dim=1).to(torch.int64)
        if name.startswith("q5"):
            qh = b[:, at : at + 4].contiguous().view(torch.int32).to(torch.int64)
            q = q | (((qh >> torch.arange(32)) & 1) << 4)
        q = q.to(torch.float32)
        if m is not None:
            return d[:, None] * q + m[:, None]
        return d[:, None] * (q - (8 if name == "q4_0" else 16))
    if name == "q2_k":
        scales, qs = b[:, :16], b[:, 16:80]
        d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
        q = _unpack_2bit(qs).reshape(-1, 16, 16).to(torch.float32)
        y = (
            d[:, None, None] * (scales & 15).to(torch.float32)[..., None] * q
            - dmin[:, None, None] * (scales >> 4).to(torch.float32)[..., None]
        )
        return y.reshape(-1, 256)
    if name == "q3_k":
        hmask, qs, sb, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
        low = _unpack_2bit(qs).reshape(-1, 2, 4, 32).to(torch.int32)
        hbit = torch.stack([torch.stack([(hmask >> (4 * h + j)) & 1 for j in range(4)], 1) for h in range(2)], 1)
        q = (low - 4 * (1 - hbit.to(torch.int32))).reshape(-1, 16, 16).to(torch.float32)
        sc = _unpack_q3_scales(sb).to(torch.float32) - 32
        return (d[:, None, None] * sc[..., None] * q).reshape(-1, 256)
    if name in ("q4_k", "q5_k"):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = _unpack_k_scales(b[:, 4:16])
        q = _unpack_4bit_k(b[:, -128:]).to(torch.int32)
        if name == "q5_k":
            qh = b[:, 16:48]
            q = q | torch.cat([((qh >> s) & 1).to(torch.int32)[:, None] for s in range(8)], 1).reshape(-1, 256) << 4
        q = q.reshape(-1, 8, 32).to(torch.float32)
        y = (
            d[:, None, None] * sc.to(torch.float32)[..., None] * q
            - dmin[:, None, None] * mn.to(torch.float32)[..., None]
        )
        return y.reshape(-1, 256)
    if name == "q6_k":
        ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
        ql = ql.reshape(-1, 2, 2, 32)  # [N, half, 32-byte part, l]
        lo = torch.stack([ql[:, :, 0] & 15, ql[:, :, 1] & 15, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], 2)
        qh = qh.reshape(-1, 2, 1, 32)
        hi = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)) & 3
        q = (lo | (hi << 4)).to(torch.float32).reshape(-1, 16, 16) - 32
        s = sc.contiguous().view(torch.int8).to(torch.float32)
        return (d[:, None, None] * s[..., None] * q).reshape(-1, 256)
    raise KeyError(name)


# ------------------------------------------------------------------------------- entry points


def fit_blocks(name: str, x: torch.Tensor, w: torch.Tensor | None = None) -> dict:
    """float32 [N, block] (weights w, same shape, or None) -> the fields of N blocks (see `pack`)."""
    t = TYPES[name]
    x = x.to(torch.float32)
    w = torch.ones_like(x) if w is None else w.to(torch.float32).expand_as(x)
    if t.block == 32:
        return _q_simple(x, w, t)
    if name in ("q3_k", "q6_k"):
        d, sc, L = _q_k_symmetric(x, w, t)
        return {"d": d, "sc": sc, "q": L}
    d, dmin, sc, mn, L = _q_k_scale_min(x, w, t)
    return {"d": d, "dmin": dmin, "sc": sc, "mn": mn, "q": L}


def quantize_blocks(name: str, x: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [N, block] (weights w, same shape, or None) -> packed uint8 [N, block_bytes]."""
    return pack(name, fit_blocks(name, x, w))


def grid(name: str, fields: dict):
    """The affine grid of every element under fixed block fields: value = eff * code + off with
    code in [lo, hi] in the fields' own "q" convention -> (eff [N, block], off [N, block], lo, hi)."""
    t = TYPES[name]
    d = fields["d"][:, None]
    if name == "q8_0":
        return d.expand(-1, 32), torch.zeros_like(d).expand(-1, 32), -127, 127
    if name in ("q4_0", "q5_0"):
        qmin = -(2 ** (t.bits - 1))
        return d.expand(-1, 32), (d * qmin).expand(-1, 32), 0, 2**t.bits - 1
    if name in ("q4_1", "q5_1"):
        return d.expand(-1, 32), fields["m"][:, None].expand(-1, 32), 0, 2**t.bits - 1
    sub = 16 if name in ("q2_k", "q3_k", "q6_k") else 32
    eff = (d * fields["sc"].to(torch.float32))[..., None].expand(-1, -1, sub).reshape(-1, t.block)
    if name in ("q3_k", "q6_k"):
        lo, hi = (-4, 3) if name == "q3_k" else (-32, 31)
        return eff, torch.zeros_like(eff), lo, hi
    off = (
        -(fields["dmin"][:, None] * fields["mn"].to(torch.float32))[..., None].expand(-1, -1, sub).reshape(-1, t.block)
    )
    return eff, off, 0, 2**t.bits - 1


def gptq_tensor(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    name: str,
    *,
    damp: float = 0.01,
    block_size: int = 128,
    max_damp_tries: int = 6,
) -> torch.Tensor:
    """GPTQ on the type's grid: block scales / mins fitted first from the weights (the scale search
    weighted by diag(H)), then the column sweep (codes in order, the rounding error spread over the
    remaining columns through the Cholesky factor of H^-1). weight [E, out, in] (or [out, in]),
    hessian [E, in, in] (or [in, in]) -> packed uint8 like `quantize_tensor`."""
    t = TYPES[name]
    squeeze = weight.dim() == 2
    W = (weight[None] if squeeze else weight).to(torch.float32).clone()
    H = (hessian[None] if hessian.dim() == 2 else hessian).to(torch.float64).expand(W.shape[0], -1, -1).clone()
    E, rows, n = W.shape
    diag = H.diagonal(dim1=-2, dim2=-1)
    dead = diag <= 0
    W.masked_fill_(dead[:, None, :], 0.0)
    diag.masked_fill_(dead, 1.0)
    x = W.reshape(E, rows, n // t.block, t.block)
    w = _block_weights(diag.to(torch.float32), x)  # as quantize_tensor with importance = diag(H)
    fields = fit_blocks(name, x.reshape(-1, t.block), w.reshape(-1, t.block))
    eff, off, lo, hi = grid(name, fields)
    eff, off = eff.reshape(E, rows, n), off.reshape(E, rows, n)
    U = torch.empty_like(H)
    for e in range(E):  # upper Cholesky factor of H^-1, damping grown tenfold until it factorizes
        mean = float(H[e].diagonal().mean())
        for k in range(max_damp_tries):
            Hd = H[e] + (damp * 10**k) * mean * torch.eye(n, dtype=H.dtype)
            L, info = torch.linalg.cholesky_ex(Hd)
            if int(info) == 0:
                U[e] = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
                break
        else:
            U[e] = torch.eye(n, dtype=H.dtype)  # round-to-nearest on the fixed grid
    U = U.to(torch.float32)
    Q = torch.zeros(E, rows, n, dtype=torch.float32)
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        W1, Err1, U1 = W[..., i1:i2].clone(), torch.zeros(E, rows, i2 - i1), U[:, i1:i2, i1:i2]
        for i in range(i2 - i1):
            col, e_, o_ = W1[..., i], eff[..., i1 + i], off[..., i1 + i]
            q = torch.clamp(torch.round((col - o_) / torch.where(e_ == 0, 1.0, e_)), lo, hi)
            q = torch.where(e_ == 0, torch.zeros_like(q).clamp(lo, hi), q)
            err = (col - (e_ * q + o_)) / U1[:, i, i][:, None]
            W1[..., i + 1 :] -= err[..., None] * U1[:, None, i, i + 1 :]
            Err1[..., i], Q[..., i1 + i] = err, q
        if i2 < n:
            W[..., i2:] -= torch.bmm(Err1, U[:, i1:i2, i2:])
    fields["q"] = Q.reshape(-1, t.block)
    out = pack(name, fields).reshape(E, rows, n // t.block * t.nbytes)
    return out[0] if squeeze else out


CHUNK_BLOCKS = 1 << 14


def _block_weights(importance: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per-column importance ([in] or [E, in]) -> weights shaped like x [E, rows, blocks, block], mean 1."""
    nb, block = x.shape[-2:]
    imp = importance.to(torch.float32).contiguous()  # one memory order: the same sums, the same search
    imp = imp.reshape(-1, 1, nb, block) if imp.dim() > 1 else imp.reshape(1, 1, nb, block)
    imp = imp / imp.mean(-1, keepdim=True).mean(-2, keepdim=True).clamp_min(1e-30)
    return imp.expand_as(x).clamp_min(1e-8)


def quantize_tensor(weight: torch.Tensor, name: str, importance: torch.Tensor | None = None) -> torch.Tensor:
    """weight [..., out, in] -> packed uint8 [..., out, in / block * bytes].

    importance: per input column, [in] or [..., in] matching the leading (expert) axes: the
    weight of each element's squared error (input second moments); None for plain MSE.
    """
    t = TYPES[name]
    shape = weight.shape
    rows, cols = shape[-2], shape[-1]
    nb = cols // t.block
    x = weight.to(torch.float32).reshape(-1, rows, nb, t.block)
    w = None if importance is None else _block_weights(importance, x)
    xf = x.reshape(-1, t.block)
    wf = None if w is None else w.reshape(-1, t.block)
    out = [
        quantize_blocks(name, xf[i : i + CHUNK_BLOCKS], None if wf is None else wf[i : i + CHUNK_BLOCKS])
        for i in range(0, xf.shape[0], CHUNK_BLOCKS)
    ]
    return torch.cat(out).reshape(*shape[:-1], nb * t.nbytes)


def dequantize_tensor(codes: torch.Tensor, name: str, shape) -> torch.Tensor:
    t = TYPES[name]
    y = unpack(name, codes.reshape(-1, t.nbytes))
    return y.reshape(tuple(shape))


def bits_per_weight(name: str) -> float:
    t = TYPES[name]
    return 8.0 * t.nbytes / t.block


def check_cols(name: str, cols: int) -> bool:
    return cols % TYPES[name].block == 0 and math.isfinite(cols)


# ---------------------------------------------------------------- the registered format

_SYMMETRIC = ("q8_0", "q6_k", "q5_0", "q4_0", "q3_k")  # no per-block minimum


class GgmlBlocks(Format):
    """llama.cpp's block types as formats: one name per type, no parameters; only GGUF holds them."""

    names = GGML_TYPES
    ggml = True

    def spec(self, name, params):
        take_params(name, params, {})
        t = TYPES[name]
        return FormatSpec(name, t.bits, "group", t.block, name in _SYMMETRIC)

    def map_char(self, spec):
        return None

    def default_algorithm(self, name):
        return "imatrix"  # round-to-nearest with the scale search weighted by the inputs' second moments

    def nbytes(self, spec, rows, cols, symmetric_zeros):  # whole blocks: 34 / 18 / ... per 32, 84 ... 210 per 256
        return rows * row_bytes(spec.name, cols)

    def quantize(self, x: torch.Tensor, spec, importance=None, hessian=None) -> torch.Tensor:
        """float32 weight [..., out, in] -> packed blocks; a Hessian runs GPTQ on the type's grid."""
        if hessian is not None:
            return gptq_tensor(x, hessian, spec.name)
        return quantize_tensor(x, spec.name, importance)

    def dequantize(self, codes: torch.Tensor, spec, shape) -> torch.Tensor:
        return dequantize_tensor(codes.cpu(), spec.name, shape)


register(GgmlBlocks())
