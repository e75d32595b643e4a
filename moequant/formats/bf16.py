"""bf16: the weights as they are (bfloat16), no scales. Every target loads it."""

from __future__ import annotations

from moequant.formats.specs import Format, FormatSpec, register, take_params


class Bf16(Format):
    names = ("bf16",)
    quantized = False
    ct_format = "dense"

    def spec(self, name, params):
        take_params(name, params, {})
        return FormatSpec("bf16", 16, "none")

    def default_algorithm(self, name):
        return "none"

    def nbytes(self, spec, rows, cols, symmetric_zeros):
        return 2 * rows * cols

    def ct_weight_args(self, spec):
        return None

    def pack_ct(self, q):
        return {"weight": q.codes}

    def unpack_ct(self, tensors, spec):
        import torch

        from moequant.formats.core import QuantizedTensor

        w = tensors["weight"]
        return QuantizedTensor(spec, tuple(w.shape), w.to(torch.bfloat16))


register(Bf16())
