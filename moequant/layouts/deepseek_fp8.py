"""The deepseek-fp8 layout: weight float8_e4m3fn + weight_scale_inv per 128x128 block (`weight_block_size`), as
DeepSeek-V3 ships.

What it writes: weight float8_e4m3fn + weight_scale_inv per 128x128 block, `weight_block_size`.
"""

from __future__ import annotations

import math

import torch

from moequant import formats
from moequant.errors import UserError
from moequant.formats import QuantizedTensor
from moequant.layouts.base import Layout, module_name
from moequant.layouts.reading import FLOAT8, FLOATS, Encoding, dims, modules_with, need


def holds(spec) -> bool:
    """The one format the layout holds (its packer and its rules ask here)."""
    return spec.key == "fp8-block128"


def pack_deepseek_fp8(q: QuantizedTensor) -> dict:
    """DeepSeek-V3 layout: weight float8_e4m3fn [out, in], weight_scale_inv fp32 [ceil(out/128), ceil(in/128)]."""
    if not holds(q.spec):
        raise UserError("the DeepSeek FP8 layout holds fp8-block128, not %s" % q.spec.key)
    return {"weight": q.codes, "weight_scale_inv": q.scales}


def read_deepseek_fp8(qc, stored, where, read):
    if list(qc.get("weight_block_size") or []) != [128, 128]:
        raise UserError(
            f"{where}/config.json: fp8 with weight_block_size {qc.get('weight_block_size')!r} is not a source "
            "format moequant reads; accepted: weight_block_size [128, 128] (DeepSeek-V3's)."
        )
    spec = formats.get_format("fp8", granularity="block")
    out = {}
    for module in modules_with(stored, "weight_scale_inv"):
        name, scale = f"{module}.weight", f"{module}.weight_scale_inv"
        need(stored, where, name, FLOAT8[:1])
        rows, cols = dims(stored, where, name, 2)
        need(stored, where, scale, FLOATS, (math.ceil(rows / 128), math.ceil(cols / 128)))
        out[name] = Encoding(name, (rows, cols), spec, "deepseek-fp8", {"weight": name, "weight_scale_inv": scale})
    return out


def unpack_deepseek_fp8(enc: Encoding, t: dict) -> QuantizedTensor:
    return QuantizedTensor(enc.spec, enc.shape, t["weight"], t["weight_scale_inv"].to(torch.float32))


class DeepseekFp8(Layout):
    name = "deepseek-fp8"
    quant_methods = ("fp8",)  # the quantization_config.quant_method values it reads back
    read_encodings = staticmethod(read_deepseek_fp8)
    unpack = staticmethod(unpack_deepseek_fp8)
    recipe_name = "fp8-block"

    @staticmethod
    def refuses(spec):
        return None if holds(spec) else "fp8-block128 only (DeepSeek-V3's FP8 layout)"

    def check(self) -> None:
        self._require_unfused()
        self._refuse_formats()

    def carries(self, encoding) -> bool:
        return encoding.reader == self.name

    def pack(self, name, q):
        module = module_name(name)
        return {f"{module}.{k}": v for k, v in pack_deepseek_fp8(q).items()}

    def quantization_config(self) -> dict:
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": sorted(self._linear_modules_kept()),
        }
