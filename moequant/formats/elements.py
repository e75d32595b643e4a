"""Element and scale encodings shared by the formats: e2m1, e8m0, e4m3, scale dtypes.

All rounding is round-half-to-even (torch.round and torch's float casts do that).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0
# e2m1 code -> value: bit 3 is the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6 (OCP MX spec).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127
FP16_MAX = 65504.0

_lut_cache: dict = {}


def e2m1_lut(device) -> torch.Tensor:
    key = str(device)
    if key not in _lut_cache:
        _lut_cache[key] = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return _lut_cache[key]


def encode_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Float values -> e2m1 codes (uint8, 0..15), nearest with ties to even, saturating at +-6.

    The magnitude code counts the decision thresholds |y| has passed. The thresholds are the
    midpoints of the grid 0, .5, 1, 1.5, 2, 3, 4, 6; at a midpoint the tie goes to the neighbour
    with the even mantissa, so it counts as passed with ">=" where the upper neighbour is even
    (.75 -> 1, 1.75 -> 2, 3.5 -> 4) and with ">" where the lower one is (.25 -> 0, 1.25 -> 1,
    2.5 -> 2, 5 -> 4). Negative inputs keep the sign bit even when they round to zero (-0), as
    ml_dtypes and compressed-tensors do.
    """
    a = y.abs()
    code = (a > 0.25).to(torch.uint8)
    code += a >= 0.75
    code += a > 1.25
    code += a >= 1.75
    code += a > 2.5
    code += a >= 3.5
    code += a > 5.0
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 0..15) -> float32 values."""
    return e2m1_lut(codes.device)[codes.long()]


def e8m0_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """MXFP4 block scale from the block's absolute maximum, as a biased e8m0 exponent (uint8).

    Rule: exponent = floor(log2(amax)) - 2, plus one when amax's mantissa is >= 1.75, clamped
    to the e8m0 range [2^-127, 2^127] (code 255 = NaN is never produced). All-zero blocks get
    code 0 (scale 2^-127), which decodes them to exact zeros.

    Why: OCP MX v1.0 prescribes floor(log2(amax)) - emax(e2m1)=2, which maps amax into [4, 8)
    and clips everything above 6 to 6 -- up to 2 scale units of error on the block's largest
    element when its mantissa is near 2. Rounding amax to the nearest power of two first (the
    mantissa >= 1.75 bump) keeps amax / scale in [3.5, 7): the clipping error on the largest
    element never exceeds 1 unit, the half-spacing of the top of the e2m1 grid (4 -> 6), while
    every other block keeps the finer OCP scale. The "always round up" rule (ceil(log2(amax/6)),
    used by OpenAI's triton_kernels for gpt-oss) never clips but doubles the step for about half
    of all blocks. Measured (benchmarks/bench_formats.py, 512x4096 weights), relative MSE of
    round-to-nearest: normal 1.250% (this rule) vs 1.322% (OCP) vs 1.330% (ceil); Student-t(3)
    1.916% vs 1.984% vs 2.256%. This is also exactly the rule compressed-tensors (0.20) and llm-compressor
    use, so our MXFP4 checkpoints are bit-identical to theirs; readers (vLLM, transformers'
    gpt-oss dequantizer, compressed-tensors) decode any e8m0 exponent the same way.
    """
    amax = amax.to(torch.float32)
    mant, exp = torch.frexp(amax)  # amax = mant * 2^exp, mant in [0.5, 1)
    unbiased = (exp - 1) + (mant >= 0.875).to(exp.dtype) - 2  # 2*mant >= 1.75 rounds up
    code = torch.clamp(unbiased + E8M0_BIAS, 0, 254)
    code = torch.where(amax > 0, code, torch.zeros_like(code))
    return code.to(torch.uint8)


def e8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Biased e8m0 exponents (uint8) -> float32 powers of two, built from the bits (exact).

    Code c >= 1 is the float32 with exponent field c and zero mantissa; code 0 is 2^-127, the
    float32 subnormal with only mantissa bit 22 set.
    """
    c = codes.to(torch.int32)
    return torch.where(c > 0, c << 23, torch.full_like(c, 1 << 22)).view(torch.float32)


def to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Float -> float8_e4m3fn, nearest-even, saturating at +-448 (the cast alone would give NaN)."""
    return torch.clamp(y, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
