"""Bit streams, element packings and compressed-tensors packing, and the matching unpackers.

Every packer takes a QuantizedTensor ([out, in] or stacked [E, out, in]; stacked tensors keep
the leading expert axis on every output) and returns a dict of tensors named as the target
format names them; the unpackers invert them exactly. Layout facts (checked against the
readers in the tests):

- Integer bit packing (compressed-tensors pack-quantized, GPTQ): codes are offset to unsigned
  (q + 2^(B-1)) and written as one little-endian bit stream per row, element i at bits
  [i*B, i*B + B) of the stream, 32 bits per int32 word; ceil(n*B/32) words per row, no padding
  between elements. For B = 2 / 4 / 8 that is 16 / 8 / 4 codes per word, lowest bits first; for
  B = 3 codes straddle words (32 codes in 3 words), as GPTQ's 3-bit layout and compressed-tensors
  0.20 (the version we test against) do. Older compressed-tensors releases packed floor(32/B)
  codes per word (10 per word, 2 bits unused, for B = 3; identical for 2 / 4 / 8 bits), so int3
  pack-quantized checkpoints need a reader of the dense layout. compressed-tensors packs along the input axis ([out, ceil(in*B/32)]) and
  packs asymmetric zero points the same way along the *output* axis ([ceil(out*B/32), groups]).
- GPTQ and AWQ: moequant.layouts.gptq / awq (their packers, readers and facts).
- e2m1 (mxfp4, nvfp4): two codes per byte along the input axis, element 2k in the low nibble,
  2k+1 in the high nibble ([..., out, in/2] uint8), as compressed-tensors and the gpt-oss
  checkpoints (transformers' dequantizer) store them.
- fp8: float8_e4m3fn codes as they are, fp32 scales.
"""

from __future__ import annotations

import math
import sys

import torch

from moequant.formats.core import QuantizedTensor
from moequant.formats.specs import get_format

_BYTE_ALIGNED = sys.byteorder == "little"


# ---------------------------------------------------------------- bit streams


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [..., n] (0 <= v < 2^bits) -> int32 words [..., ceil(n*bits/32)], dense
    little-endian bit stream along the last axis."""
    n = values.shape[-1]
    n_words = math.ceil(n * bits / 32)
    pad = -n % 32
    if pad:
        values = torch.cat([values, values.new_zeros(values.shape[:-1] + (pad,))], dim=-1)
    if _BYTE_ALIGNED and bits in _BYTE_RUNS:
        # k codes fill exactly k*bits/8 bytes (k = 8/gcd(8, bits)): assemble each run in an int32,
        # split it into little-endian bytes, and read the byte stream as int32 words.
        k, nbytes = _BYTE_RUNS[bits]
        v = values.unflatten(-1, (values.shape[-1] // k, k))
        if nbytes == 1:  # whole runs fit one byte: stay in uint8
            stream = v[..., 0].to(torch.uint8, copy=True)  # never write into the caller's tensor
            for i in range(1, k):  # fields of one byte (at most 8), not rows or groups
                stream |= v[..., i].to(torch.uint8) << (bits * i)
        else:
            run = v[..., 0].to(torch.int32, copy=True)
            for i in range(1, k):
                run |= v[..., i].to(torch.int32) << (bits * i)
            stream = torch.stack([((run >> (8 * j)) & 0xFF).to(torch.uint8) for j in range(nbytes)], dim=-1).flatten(-2)
        return stream.contiguous().view(torch.int32)[..., :n_words]
    v = values.to(torch.int64).unflatten(-1, (values.shape[-1] // 32, 32))
    start = torch.arange(32, device=values.device) * bits
    words = []
    for w in range(bits):  # the `bits` words of each 32-code chunk
        shift = start - 32 * w
        take = ((shift > -bits) & (shift < 32)).nonzero().flatten()
        sh = shift[take]
        part = v[..., take]
        part = torch.where(sh >= 0, part << sh.clamp(min=0), part >> (-sh).clamp(min=0))
        words.append((part & 0xFFFFFFFF).sum(-1))
    out = torch.stack(words, dim=-1).flatten(-2)
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    return out[..., :n_words]


_BYTE_RUNS = {1: (8, 1), 2: (4, 1), 3: (8, 3), 4: (2, 1), 6: (4, 3), 8: (1, 1)}  # bits: (codes, bytes), runs <= 24 bits


def unpack_int32(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of pack_int32: int32 words [..., w] -> unsigned codes uint8 [..., n]."""
    if words.dtype != torch.int32:
        raise ValueError("packed codes must be int32, got %s" % words.dtype)
    mask = (1 << bits) - 1
    if _BYTE_ALIGNED and bits in _BYTE_RUNS:
        k, nbytes = _BYTE_RUNS[bits]
        stream = words.contiguous().view(torch.uint8)
        pad = -stream.shape[-1] % nbytes
        if pad:
            stream = torch.cat([stream, stream.new_zeros(stream.shape[:-1] + (pad,))], dim=-1)
        b = stream.unflatten(-1, (stream.shape[-1] // nbytes, nbytes)).to(torch.int32)
        run = b[..., 0]
        for j in range(1, nbytes):
            run = run | (b[..., j] << (8 * j))
        fields = [((run >> (bits * i)) & mask).to(torch.uint8) for i in range(k)]
        return torch.stack(fields, dim=-1).flatten(-2)[..., :n]
    pad = -words.shape[-1] % bits
    if pad:
        words = torch.cat([words, words.new_zeros(words.shape[:-1] + (pad,))], dim=-1)
    w = (words.to(torch.int64) & 0xFFFFFFFF).unflatten(-1, (words.shape[-1] // bits, bits))
    start = torch.arange(32, device=words.device) * bits
    idx, off = start // 32, start % 32
    lo = w[..., idx] >> off
    spill = off + bits > 32
    hi = w[..., (idx + 1).clamp(max=bits - 1)] << (32 - off)
    vals = (lo | torch.where(spill, hi, torch.zeros_like(hi))) & mask
    return vals.flatten(-2)[..., :n].to(torch.uint8)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes [..., n] (uint8 0..15, n even) -> bytes [..., n/2]: element 2k low nibble, 2k+1 high."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., m] -> e2m1 codes [..., 2m] (low nibble first)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def unsigned(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed int8 codes -> offset unsigned codes (two's complement wraps to exactly q + 2^(B-1))."""
    return codes.view(torch.uint8) + (1 << (bits - 1))


def signed(u: torch.Tensor, bits: int) -> torch.Tensor:
    return (u.to(torch.int16) - (1 << (bits - 1))).to(torch.int8)


def along_rows(fn, t: torch.Tensor, *args):
    """Apply a last-axis packer along the second-to-last axis instead."""
    return fn(t.transpose(-2, -1), *args).transpose(-2, -1).contiguous()


def per_expert_scalar(t: torch.Tensor) -> torch.Tensor:
    """[] -> [1] and [E] -> [E, 1]: how per-tensor scalars are written."""
    return t.reshape(t.shape + (1,)).contiguous()


# ---------------------------------------------------------------- compressed-tensors


def compressed_tensors_format(spec) -> str:
    """compressed-tensors `format` string for a spec."""
    return get_format(spec).family.ct_format


def compressed_tensors_weight_args(spec) -> dict | None:
    """The `weights` quantization args of a compressed-tensors config group for `spec`, as
    plain JSON data (None for bf16, which stays unquantized)."""
    spec = get_format(spec)
    return spec.family.ct_weight_args(spec)


def pack_compressed_tensors(q: QuantizedTensor) -> dict:
    """Tensors of one module in compressed-tensors layout (names without the module prefix).

    int:   weight_packed int32, weight_scale bf16, [weight_zero_point int32 (asym)], weight_shape int64
    fp8:   weight float8_e4m3fn, weight_scale fp32 ([out,1] | [ceil(out/128), ceil(in/128)] | [1])
    mxfp4: weight_packed uint8 [out, in/2], weight_scale uint8 e8m0 [out, in/32]
    nvfp4: weight_packed uint8 [out, in/2], weight_scale float8_e4m3fn [out, in/16], weight_global_scale fp32 [1]
    bf16:  weight bfloat16
    (each format's family, moequant.formats.<family>.pack_ct, writes its own)
    """
    return q.spec.family.pack_ct(q)


def unpack_compressed_tensors(tensors: dict, spec) -> QuantizedTensor:
    """Inverse of pack_compressed_tensors."""
    spec = get_format(spec)
    return spec.family.unpack_ct(tensors, spec)


# Stored tensors that describe a layout rather than encode weights (a shape, an identity column
# order): `nbytes` and the report's byte account leave them out, so the two agree.
LAYOUT_METADATA = ("weight_shape", "g_idx")


def packed_nbytes(tensors: dict) -> int:
    """Bytes of the tensors that `nbytes` accounts for (LAYOUT_METADATA left out)."""
    return sum(t.numel() * t.element_size() for k, t in tensors.items() if k not in LAYOUT_METADATA)
