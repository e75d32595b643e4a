"""mxfp8 (OCP microscaling): float8_e4m3fn elements, one e8m0 (power-of-two) scale per 32 inputs.

Scale rule: the e8m0 exponent is floor(log2(amax)) - 8 (8 = floor(log2(448)), e4m3's largest
exponent), plus one when amax's mantissa is >= 1.75, so amax / scale stays in [224, 448): never
clipped. That is `elements.e8m0_from_amax`'s rule (written for e2m1, whose exponent offset is 2)
applied to amax / 2^6, and compressed-tensors' MXFP8 rule, so our checkpoints are bit-identical to
its. q = e4m3(w / s), saturating at +-448; w = q * s. All-zero groups get code 0 (2^-127) and
decode to exact zeros. On disk (compressed-tensors `mxfp8-quantized`, which vLLM loads for linear
and fused-MoE layers): `weight` float8_e4m3fn [out, in], `weight_scale` uint8 [out, in/32].
"""

from __future__ import annotations

import torch

from moequant.formats.elements import e8m0_from_amax, e8m0_to_float, to_e4m3
from moequant.formats.specs import Format, fixed_group_spec, register

GROUP = 32
E2M1_TO_E4M3_OFFSET = 2.0**6  # 2^(8 - 2): the scale exponents of e4m3 and e2m1 elements differ by 6


class Mxfp8(Format):
    names = ("mxfp8",)
    ct_format = "mxfp8-quantized"

    def spec(self, name, params):
        return fixed_group_spec(name, params, GROUP, bits=8)

    def default_algorithm(self, name):
        return "rtn"  # 8-bit elements: GPTQ buys little

    def map_char(self, spec):
        return "X"

    def nbytes(self, spec, rows, cols, symmetric_zeros):
        return rows * cols + rows * cols // GROUP

    def fit(self, spec, xg, gs, name):
        from moequant.formats.core import absmax_checked

        return e8m0_from_amax(absmax_checked(xg, name) / E2M1_TO_E4M3_OFFSET), None

    def encode(self, spec, x, s, z, gs):
        return to_e4m3(x / e8m0_to_float(s))

    def decode(self, spec, codes, s, z, gs):
        return codes.to(torch.float32) * e8m0_to_float(s)

    def ct_weight_args(self, spec):
        return {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "dynamic": False,
            "strategy": "group",
            "group_size": GROUP,
            "scale_dtype": "torch.uint8",
        }

    def pack_ct(self, q):
        return {"weight": q.codes, "weight_scale": q.scales}

    def unpack_ct(self, tensors, spec):
        from moequant.formats.core import QuantizedTensor

        w = tensors["weight"]
        return QuantizedTensor(spec, tuple(w.shape), w, tensors["weight_scale"])


register(Mxfp8())
