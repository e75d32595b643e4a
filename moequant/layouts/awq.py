"""The awq layout: AutoAWQ GEMM int4 (one group size and one zero-point mode for the whole model)."""

from __future__ import annotations

from moequant import formats
from moequant.errors import UserError
from moequant.layouts.base import Layout, module_name


class Awq(Layout):
    name = "awq"
    symmetric_zeros = True

    @staticmethod
    def refuses(spec, target):
        return None if spec.name == "int4" and spec.granularity == "group" else "int4 with groups only (AutoAWQ GEMM)"

    def check(self) -> None:
        self._require_unfused()
        self._refuse_formats()
        if not self.items:
            raise UserError("the awq layout needs at least one quantized tensor.")
        specs = {(q.spec.group_size, q.spec.symmetric) for q in self.items.values()}
        if len(specs) > 1:
            raise UserError(
                f"the awq layout holds one group size and one zero-point mode for the whole model; "
                f"the plan has {len(specs)} int4 variants ({', '.join(sorted({q.spec.key for q in self.items.values()}))})."
            )
        self.group, self.symmetric = specs.pop()

    def pack(self, name, q):
        module = module_name(name)
        return {f"{module}.{k}": v for k, v in formats.pack_awq(q).items()}

    def quantization_config(self) -> dict:
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": self.group,
            "zero_point": not self.symmetric,
            "version": "gemm",
            "modules_to_not_convert": sorted(self._linear_modules_kept()),
        }
