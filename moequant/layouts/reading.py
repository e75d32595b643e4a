"""What the layouts' readers share: the `Encoding` of one stored weight, and the header checks each
layout's `read_encodings` runs (moequant.io.dequant dispatches to them by quantization_config.quant_method)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moequant.errors import UserError
from moequant.formats import FormatSpec

FLOAT8 = ("F8_E4M3", "F8_E5M2")
FLOATS = ("F32", "BF16", "F16")
SAFETENSORS_DTYPE = {
    torch.float8_e4m3fn: "F8_E4M3",
    torch.uint8: "U8",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int8: "I8",
}


@dataclass(frozen=True)
class Encoding:
    """One logical weight stored encoded.

    name:   the logical tensor name (e.g. `model.layers.3.mlp.experts.7.down_proj.weight`)
    shape:  its logical shape, as the bf16 checkpoint stores it
    spec:   its moequant FormatSpec
    layout: how it is stored: a compressed-tensors format name, `deepseek-fp8`, `gpt-oss-mxfp4`,
            `gptq` or `awq`
    parts:  role (the layout's parameter name, e.g. `weight_packed`) -> stored tensor name
    reader: the name of the layout whose `unpack` decodes it
    """

    name: str
    shape: tuple
    spec: FormatSpec
    layout: str
    parts: dict
    reader: str = ""  # the registered layout that reads it (moequant.layouts.registry)

    @property
    def description(self) -> str:
        return f"{self.layout} {self.spec.key}"


def need(stored, where, name: str, dtypes, shape=None, what: str = ""):
    entry = stored.get(name)
    if entry is None:
        raise UserError(f"{where} lacks tensor {name!r}, which its quantization_config implies{what}.")
    if entry.dtype not in dtypes:
        raise UserError(f"{where}: tensor {name!r} is {entry.dtype}; accepted there: {', '.join(dtypes)}.")
    if shape is not None and tuple(entry.shape) != tuple(shape):
        raise UserError(f"{where}: tensor {name!r} has shape {list(entry.shape)}, but its weight needs {list(shape)}.")
    return entry


def dims(stored, where, name, ndim: int) -> tuple:
    shape = tuple(stored[name].shape)
    if len(shape) != ndim or not all(shape):
        raise UserError(f"{where}: tensor {name!r} has shape {list(shape)}; a {ndim}-D non-empty tensor is needed.")
    return shape


def modules_with(stored, param: str) -> list[str]:
    return sorted(n[: -len(param) - 1] for n in stored if n.endswith("." + param))
