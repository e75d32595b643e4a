"""nvfp4 (compressed-tensors / ModelOpt convention): e2m1 elements, a float8_e4m3fn scale per
16 inputs and one fp32 global scale per expert.

g = 448 * 6 / amax(tensor) (fp32; 1 for an all-zero tensor); per 16 inputs s = e4m3(g * (amax / 6))
in compressed-tensors' float32 operation order; q = e2m1(w / (s / g)); w = q * (s / g).
"""

from __future__ import annotations

import torch

from moequant.formats.elements import E2M1_MAX, FP8_MAX, decode_e2m1, encode_e2m1, to_e4m3
from moequant.formats.specs import NV_GROUP, Format, fixed_group_spec, register


class Nvfp4(Format):
    names = ("nvfp4",)
    e2m1 = True
    global_scale = True
    ct_format = "nvfp4-pack-quantized"

    def spec(self, name, params):
        return fixed_group_spec(name, params, NV_GROUP, bits=4)

    def nbytes(self, spec, rows, cols, symmetric_zeros):
        return rows * cols // 2 + rows * cols // NV_GROUP + 4

    def default_global_scale(self, amax_tensor):
        """The per-expert global scale from each expert's absolute maximum."""
        g = (FP8_MAX * E2M1_MAX) / amax_tensor
        return torch.where(amax_tensor > 0, g, torch.ones_like(g))

    def fit(self, spec, xg, gs, name):
        from moequant.formats.core import absmax_checked

        return to_e4m3(gs * (absmax_checked(xg, name) / E2M1_MAX)), None

    def encode(self, spec, x, s, z, gs):
        s = s.to(torch.float32) / gs
        return encode_e2m1(x / torch.where(s > 0, s, torch.inf))

    def decode(self, spec, codes, s, z, gs):
        return decode_e2m1(codes) * (s.to(torch.float32) / gs)

    def ct_weight_args(self, spec):
        return {
            "num_bits": 4,
            "type": "float",
            "symmetric": True,
            "dynamic": False,
            "strategy": "tensor_group",
            "group_size": NV_GROUP,
            "scale_dtype": "torch.float8_e4m3fn",
        }

    def pack_ct(self, q):
        from moequant.formats.packing import pack_e2m1, per_expert_scalar

        return {
            "weight_packed": pack_e2m1(q.codes),
            "weight_scale": q.scales,
            "weight_global_scale": per_expert_scalar(q.global_scale),
        }

    def unpack_ct(self, tensors, spec):
        from moequant.formats.core import QuantizedTensor
        from moequant.formats.packing import unpack_e2m1

        codes = unpack_e2m1(tensors["weight_packed"])
        gs = tensors["weight_global_scale"].to(torch.float32).reshape(codes.shape[:-2])
        return QuantizedTensor(spec, tuple(codes.shape), codes, tensors["weight_scale"], None, gs)


register(Nvfp4())
