"""mxfp4 (OCP microscaling): e2m1 elements, one e8m0 (power-of-two) scale per 32 inputs.

The scale rule is documented in `elements.e8m0_from_amax`; q = e2m1(w / s). Codes are uint8 e2m1
codes (0..15) in memory, two per byte on disk.
"""

from __future__ import annotations

from moequant.formats.elements import decode_e2m1, e8m0_from_amax, e8m0_to_float, encode_e2m1
from moequant.formats.specs import MX_GROUP, Format, fixed_group_spec, register


class Mxfp4(Format):
    names = ("mxfp4",)
    e2m1 = True
    ct_format = "mxfp4-pack-quantized"

    def spec(self, name, params):
        return fixed_group_spec(name, params, MX_GROUP, bits=4)

    def nbytes(self, spec, rows, cols, symmetric_zeros):
        return rows * cols // 2 + rows * cols // MX_GROUP

    def fit(self, spec, xg, gs, name):
        from moequant.formats.core import absmax_checked

        return e8m0_from_amax(absmax_checked(xg, name)), None

    def encode(self, spec, x, s, z, gs):
        return encode_e2m1(x / e8m0_to_float(s))

    def decode(self, spec, codes, s, z, gs):
        return decode_e2m1(codes) * e8m0_to_float(s)

    def ct_weight_args(self, spec):
        return {
            "num_bits": 4,
            "type": "float",
            "symmetric": True,
            "dynamic": False,
            "strategy": "group",
            "group_size": MX_GROUP,
            "scale_dtype": "torch.uint8",
        }

    def pack_ct(self, q):
        from moequant.formats.packing import pack_e2m1

        return {"weight_packed": pack_e2m1(q.codes), "weight_scale": q.scales}

    def unpack_ct(self, tensors, spec):
        from moequant.formats.core import QuantizedTensor
        from moequant.formats.packing import unpack_e2m1

        codes = unpack_e2m1(tensors["weight_packed"])
        return QuantizedTensor(spec, tuple(codes.shape), codes, tensors["weight_scale"])


register(Mxfp4())
