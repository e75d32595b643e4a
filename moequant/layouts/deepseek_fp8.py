"""The deepseek-fp8 layout: weight float8_e4m3fn + weight_scale_inv per 128x128 block (`weight_block_size`), as DeepSeek-V3 ships."""

from __future__ import annotations

from moequant import formats
from moequant.layouts.base import Layout, module_name


class DeepseekFp8(Layout):
    name = "deepseek-fp8"
    recipe_name = "fp8-block"

    @staticmethod
    def refuses(spec, target):
        return None if spec.key == "fp8-block128" else "fp8-block128 only (DeepSeek-V3's FP8 layout)"

    def check(self) -> None:
        self._require_unfused()
        self._refuse_formats()

    def carries(self, encoding) -> bool:
        return encoding.layout == "deepseek-fp8"

    def pack(self, name, q):
        module = module_name(name)
        return {f"{module}.{k}": v for k, v in formats.pack_deepseek_fp8(q).items()}

    def quantization_config(self) -> dict:
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": sorted(self._linear_modules_kept()),
        }
