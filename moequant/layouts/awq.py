"""The awq layout: AutoAWQ GEMM int4 (one group size and one zero-point mode for the whole model)."""

from __future__ import annotations

from moequant import formats
from moequant.errors import UserError
from moequant.formats import QuantizedTensor
from moequant.layouts.base import Layout, module_name
from moequant.layouts.reading import Encoding, dims, modules_with, need


def read_awq(qc, stored, where, read):
    if str(qc.get("version", "gemm")).lower() != "gemm" or qc.get("bits", 4) != 4:
        raise UserError(
            f"{where}: AWQ version {qc.get('version')!r} with {qc.get('bits')} bits is not a source format "
            "moequant reads; accepted: AWQ GEMM 4-bit."
        )
    spec = formats.get_format("int4", group_size=qc.get("group_size"), symmetric=not qc.get("zero_point", True))
    out = {}
    for module in modules_with(stored, "qweight"):
        parts = {r: f"{module}.{r}" for r in ("qweight", "qzeros", "scales")}
        need(stored, where, parts["qweight"], ("I32",))
        cols = dims(stored, where, parts["qweight"], 2)[0]
        need(stored, where, parts["scales"], ("F16", "BF16", "F32"))
        groups, rows = dims(stored, where, parts["scales"], 2)
        if groups * spec.group_size != cols or rows % 8:
            raise UserError(
                f"{where}: tensor {parts['scales']!r} has shape {[groups, rows]}, which does not fit "
                f"{parts['qweight']!r} as {spec.key}."
            )
        need(stored, where, parts["qweight"], ("I32",), (cols, rows // 8))
        need(stored, where, parts["qzeros"], ("I32",), (groups, rows // 8))
        out[f"{module}.weight"] = Encoding(f"{module}.weight", (rows, cols), spec, "awq", parts)
    return out


def unpack_awq_encoding(enc: Encoding, t: dict) -> QuantizedTensor:
    return formats.unpack_awq(t, enc.spec, enc.shape)


class Awq(Layout):
    name = "awq"
    quant_methods = ("awq",)  # the quantization_config.quant_method values it reads back
    read_encodings = staticmethod(read_awq)
    unpack = staticmethod(unpack_awq_encoding)
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
