"""The awq layout: AutoAWQ GEMM int4 (asymmetric or symmetric; one group size and one zero-point mode
for the whole model).

Packing (pack_awq / unpack_awq): qweight [in, out/8] and qzeros [groups, out/8], packing along the output
axis, nibble p of each word holding column 8j + (0, 2, 4, 6, 1, 3, 5, 7)[p]; zeros unsigned
as is; scales fp16 [groups, out].
"""

from __future__ import annotations

import torch

from moequant import formats
from moequant.errors import UserError
from moequant.formats import QuantizedTensor, get_format
from moequant.formats.packing import pack_int32, signed, unpack_int32, unsigned
from moequant.layouts.base import Layout, fp16_scales, module_name, require_int_bits
from moequant.layouts.reading import Encoding, dims, modules_with, need

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_INVERSE = tuple(AWQ_ORDER.index(c) for c in range(8))  # (0, 4, 1, 5, 2, 6, 3, 7)


def pack_awq(q: QuantizedTensor) -> dict:
    """AutoAWQ GEMM tensors: qweight [in, out/8], qzeros [groups, out/8], scales [groups, out]."""
    spec = q.spec
    require_int_bits(spec, "AWQ", (4,))
    rows = q.shape[-2]
    if rows % 8:
        raise UserError("the AWQ layout needs output features divisible by 8, got %d" % rows)
    order = torch.tensor(AWQ_ORDER, device=q.codes.device)

    def interleave(u_t):  # [..., n, out] -> words [..., n, out/8]
        v = u_t.unflatten(-1, (rows // 8, 8))[..., order]
        return pack_int32(v.flatten(-2), 4)

    u = unsigned(q.codes, 4).transpose(-2, -1).contiguous()
    if q.zeros is None:
        z = torch.full(q.scales.shape, 8, dtype=torch.uint8, device=u.device)
    else:
        z = unsigned(q.zeros, 4)
    return {
        "qweight": interleave(u),
        "qzeros": interleave(z.transpose(-2, -1).contiguous()),
        "scales": fp16_scales(q, "AWQ"),
    }


def unpack_awq(tensors: dict, spec, shape) -> QuantizedTensor:
    """Inverse of pack_awq (a symmetric spec ignores qzeros, which hold 8)."""
    spec = get_format(spec)
    require_int_bits(spec, "AWQ", (4,))
    shape = tuple(shape)
    rows = shape[-2]
    inverse = torch.tensor(AWQ_INVERSE, device=tensors["qweight"].device)

    def deinterleave(words):  # [..., n, out/8] -> [..., n, out]
        v = unpack_int32(words, 4, rows).unflatten(-1, (rows // 8, 8))[..., inverse]
        return v.flatten(-2)

    codes = signed(deinterleave(tensors["qweight"]), 4).transpose(-2, -1).contiguous()
    zeros = None if spec.symmetric else signed(deinterleave(tensors["qzeros"]), 4).transpose(-2, -1).contiguous()
    return QuantizedTensor(spec, shape, codes, tensors["scales"].transpose(-2, -1).contiguous(), zeros)


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
    return unpack_awq(t, enc.spec, enc.shape)


class Awq(Layout):
    name = "awq"
    quant_methods = ("awq",)  # the quantization_config.quant_method values it reads back
    read_encodings = staticmethod(read_awq)
    unpack = staticmethod(unpack_awq_encoding)
    symmetric_zeros = True

    @staticmethod
    def refuses(spec):
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
        return {f"{module}.{k}": v for k, v in pack_awq(q).items()}

    def quantization_config(self) -> dict:
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": self.group,
            "zero_point": not self.symmetric,
            "version": "gemm",
            "modules_to_not_convert": sorted(self._linear_modules_kept()),
        }
