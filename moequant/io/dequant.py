"""Quantized checkpoints read as the dense model they encode, one tensor at a time.

A checkpoint whose config.json has a `quantization_config` stores some weights encoded (codes
plus scales under their own tensor names). `encodings(config, stored, where)` looks only at the
safetensors headers and returns, per encoded weight, an `Encoding`: the logical tensor's name
and shape (what the bf16 checkpoint would hold under that name), its moequant format, and the
stored tensors that hold it. `decode(encoding, read)` reads those tensors back through
moequant.formats' unpackers and dequantizer (the code the exporters' round-trip tests check
against compressed-tensors, ml_dtypes and transformers) and returns the weight in float32.

Each layout reads its own (moequant.layouts, `read_encodings` and `unpack`, found by quant_method in the
layout registry); this module dispatches and checks what every decoded weight must satisfy.

`moequant.io.checkpoint.Checkpoint` uses both, so `ckpt.get(name)` of an encoded weight is its
dequantized float32 tensor and every consumer (calibrate, quantize, export, evaluate, inspect,
moequant.load) sees the logical model; nothing is upcast to disk, and only the tensor being
read is ever dense in memory. Readable sources (quantization_config.quant_method):

- `compressed-tensors`, compressed-tensors' own formats: `pack-quantized` (int2..int8, group or
  channel, symmetric or asymmetric; Kimi-K2-Thinking is int4 group 32), `int-quantized` /
  `naive-quantized` (int8 codes as they are), `float-quantized` (fp8 e4m3 per tensor / channel /
  128x128 block), `mxfp4-pack-quantized`, `nvfp4-pack-quantized`, per config group or
  `mixed-precision`. Targets are exact module names, `re:` patterns or a class name such as
  `Linear` (then: every module that stores quantization parameters, less `ignore`).
- `fp8` (DeepSeek-V3/R1, Qwen3 -FP8): `weight` float8_e4m3fn + `weight_scale_inv` fp32 per
  128x128 block (`weight_block_size: [128, 128]`).
- `mxfp4` (gpt-oss): `X_blocks` uint8 [E, out, in/32, 16] + `X_scales` e8m0 [E, out, in/32]
  encode the fused expert parameter `X` [E, in, out].
- `gptq` (v1, no act-order) and `awq` (GEMM 4-bit), as moequant exports them.
- `moequant` (export target vllm-moequant): compressed-tensors with a per-expert format map
  (`expert_formats`, read by moequant.vllm_plugin), read as compressed-tensors.

Bad input is one UserError sentence naming the tensor: a missing part, codes or scales of the
wrong dtype / shape (checked from the headers when the checkpoint is opened), NaN or infinite
scales or decoded values (checked when the tensor is read). A `quant_method` or format not
listed above is refused by name when the checkpoint is opened.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from moequant import formats
from moequant.errors import UserError
from moequant.formats import QuantizedTensor
from moequant.layouts import LAYOUTS
from moequant.layouts.reading import FLOAT8, Encoding
from moequant.layouts.registry import quant_methods, reader_for


def encodings(config: dict, stored: dict, where, read: Callable[[str], torch.Tensor]) -> dict[str, Encoding]:
    """Logical name -> Encoding for every encoded weight of a checkpoint.

    `stored` maps stored tensor names to entries with `.dtype` (safetensors spelling) and
    `.shape`; `where` names the checkpoint in messages. Only headers are looked at, except the
    2-element `weight_shape` of per-channel pack-quantized weights (read with `read`)."""
    qc = config.get("quantization_config")
    if not qc:
        return {}
    if not isinstance(qc, dict):
        raise UserError(f"{where}/config.json has a quantization_config that is not a JSON object.")
    method = qc.get("quant_method")
    layout = reader_for(method)
    if layout is None:
        raise UserError(
            f"{where}/config.json has quantization_config.quant_method {method!r}, a source format "
            f"moequant cannot read; accepted: {', '.join(quant_methods())}."
        )
    found = {n: replace(e, reader=layout.name) for n, e in layout.read_encodings(qc, stored, where, read).items()}
    consumed = {p for e in found.values() for p in e.parts.values()}
    for name, entry in stored.items():  # an fp8 weight nobody explains would be read as raw codes
        if entry.dtype in FLOAT8 and name not in consumed:
            raise UserError(
                f"{where}: tensor {name!r} is stored in {entry.dtype} but its quantization_config "
                f"({method}) gives it no scale; moequant cannot read it as a weight."
            )
    return found


def decode(enc: Encoding, read: Callable[[str], torch.Tensor], device=None) -> torch.Tensor:
    """The dequantized float32 tensor of `enc`, its parts read with `read(stored_name)`; with `device`,
    the stored bytes (codes and scales as the file holds them) go there and are decoded there."""
    t = {role: read(name) for role, name in enc.parts.items()}
    if device is not None:
        t = {role: v.to(device, non_blocking=True) for role, v in t.items()}
    q = quantized_tensor(enc, t)
    for role in ("weight_scale", "weight_scale_inv", "scales", "blocks_scales", "weight_global_scale"):
        if role in t:
            _check_scales(enc, role, t[role])
    w = formats.dequantize(q, torch.float32)
    if LAYOUTS[enc.reader].stored_transposed:
        w = w.transpose(-2, -1).contiguous()  # dequantized [E, out, in]; the parameter is [E, in, out]
    bad = ~torch.isfinite(w)
    if bad.any():
        raise UserError(
            f"tensor {enc.name!r} ({enc.description}) decodes to {int(bad.sum())} NaN or infinite "
            f"values (its codes in {enc.parts[_codes_role(enc)]!r} are broken)."
        )
    return w


def quantized_tensor(enc: Encoding, t: dict) -> QuantizedTensor:
    """The codes and scales of `enc` as a QuantizedTensor, from its stored tensors `t` ({role: tensor})."""
    return LAYOUTS[enc.reader].unpack(enc, t)


def _codes_role(enc: Encoding) -> str:
    return next(iter(enc.parts))


def _check_scales(enc: Encoding, role: str, s: torch.Tensor) -> None:
    if s.dtype == torch.uint8:  # e8m0: 255 is NaN
        bad = int((s == 255).sum())
    else:
        bad = int((~torch.isfinite(s.to(torch.float32))).sum())
    if bad:
        raise UserError(
            f"tensor {enc.parts[role]!r} (scales of {enc.name}) holds {bad} NaN or infinite scales; "
            "the checkpoint is damaged."
        )
