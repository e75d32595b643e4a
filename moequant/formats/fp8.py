"""fp8 (float8_e4m3fn elements) with an fp32 scale per output row, per 128x128 block or per tensor.

s = amax / 448 in fp32 (amax over the row / block / tensor), q = e4m3(w / s), w = q * s. 128x128
blocks follow DeepSeek-V3: ceil(out/128) x ceil(in/128) scales, the last block row and column
cover what is left (ragged); the scale is what DeepSeek calls weight_scale_inv.
"""

from __future__ import annotations

import math

import torch

from moequant.errors import UserError
from moequant.formats.elements import FP8_MAX
from moequant.formats.specs import FP8_BLOCK, FP8_GRANULARITIES, Format, FormatSpec, register, take_params


class Fp8(Format):
    names = ("fp8",)
    ct_format = "float-quantized"

    def spec(self, name, params):
        p = take_params(name, params, {"granularity": "channel", "block_size": FP8_BLOCK})
        if p["granularity"] not in FP8_GRANULARITIES:
            raise UserError(
                "fp8 granularity %r is not supported; accepted: %s" % (p["granularity"], ", ".join(FP8_GRANULARITIES))
            )
        if p["granularity"] == "block":
            if p["block_size"] != FP8_BLOCK:
                raise UserError("fp8 block_size %r is not supported; accepted: %d" % (p["block_size"], FP8_BLOCK))
            return FormatSpec("fp8", 8, "block", FP8_BLOCK)
        if "block_size" in params:
            raise UserError("fp8 block_size applies only to granularity='block', not %r" % p["granularity"])
        return FormatSpec("fp8", 8, p["granularity"])

    def key(self, spec):
        return "fp8-block%d" % spec.group_size if spec.granularity == "block" else "fp8-" + spec.granularity

    def keys(self):
        return ["fp8-channel", "fp8-block128", "fp8-tensor"]

    def parse_key(self, key):
        if key in ("fp8-channel", "fp8-tensor"):
            return self.spec("fp8", {"granularity": key[4:]})
        if key.startswith("fp8-block") and key[9:].isdigit():
            return self.spec("fp8", {"granularity": "block", "block_size": int(key[9:])})
        return None

    def default_algorithm(self, name):
        return "rtn"

    def nbytes(self, spec, rows, cols, symmetric_zeros):
        if spec.granularity == "channel":
            n_scales = rows
        elif spec.granularity == "tensor":
            n_scales = 1
        else:
            n_scales = math.ceil(rows / spec.group_size) * math.ceil(cols / spec.group_size)
        return rows * cols + 4 * n_scales

    def check_cols(self, spec, cols):
        return None  # blocks allow ragged edges

    def fit(self, spec, xg, gs, name):
        from moequant.formats.core import absmax_checked

        return (absmax_checked(xg, name).double() / FP8_MAX).to(torch.float32), None

    def encode(self, spec, x, s, z, gs):
        s = s.to(torch.float32)
        y = x / torch.where(s > 0, s, torch.inf)
        return y.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)

    def decode(self, spec, codes, s, z, gs):
        return codes.to(torch.float32) * s.to(torch.float32)

    def ct_weight_args(self, spec):
        args = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": spec.granularity}
        if spec.granularity == "block":
            args["block_structure"] = [spec.group_size, spec.group_size]
        return args

    def pack_ct(self, q):
        from moequant.formats.packing import per_expert_scalar

        scale = q.scales if q.spec.granularity != "tensor" else per_expert_scalar(q.scales.reshape(q.scales.shape[:-2]))
        return {"weight": q.codes, "weight_scale": scale}

    def unpack_ct(self, tensors, spec):
        from moequant.formats.core import QuantizedTensor

        w, s = tensors["weight"], tensors["weight_scale"].to(torch.float32)
        if spec.granularity == "tensor":
            s = s.reshape(w.shape[:-2] + (1, 1))
        return QuantizedTensor(spec, tuple(w.shape), w, s)


register(Fp8())
