"""Quantized checkpoints read as the dense model they encode, one tensor at a time.

A checkpoint whose config.json has a `quantization_config` stores some weights encoded (codes
plus scales under their own tensor names). `encodings(config, stored, where)` looks only at the
safetensors headers and returns, per encoded weight, an `Encoding`: the logical tensor's name
and shape (what the bf16 checkpoint would hold under that name), its moequant format, and the
stored tensors that hold it. `decode(encoding, read)` reads those tensors back through
moequant.formats' unpackers and dequantizer (the code the exporters' round-trip tests check
against compressed-tensors, ml_dtypes and transformers) and returns the weight in float32.

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

import math
import re
from dataclasses import dataclass
from typing import Callable

import torch

from moequant import formats
from moequant.errors import UserError
from moequant.formats import QuantizedTensor

QUANT_METHODS = ("compressed-tensors", "fp8", "mxfp4", "gptq", "awq", "moequant")
CT_FORMATS = (
    "pack-quantized",
    "int-quantized",
    "naive-quantized",
    "float-quantized",
    "mxfp4-pack-quantized",
    "nvfp4-pack-quantized",
)


def _ct_formats() -> tuple[str, ...]:
    """The compressed-tensors formats moequant reads: those above and every registered format's own."""
    return tuple(dict.fromkeys(CT_FORMATS + tuple(f.ct_format for f in formats.REGISTRY.values() if f.quantized)))


FLOAT8 = ("F8_E4M3", "F8_E5M2")
FLOATS = ("F32", "BF16", "F16")


@dataclass(frozen=True)
class Encoding:
    """One logical weight stored encoded.

    name:   the logical tensor name (e.g. `model.layers.3.mlp.experts.7.down_proj.weight`)
    shape:  its logical shape, as the bf16 checkpoint stores it
    spec:   its moequant FormatSpec
    layout: how it is stored: a compressed-tensors format name, `deepseek-fp8`, `gpt-oss-mxfp4`,
            `gptq` or `awq`
    parts:  role (the layout's parameter name, e.g. `weight_packed`) -> stored tensor name
    """

    name: str
    shape: tuple
    spec: formats.FormatSpec
    layout: str
    parts: dict

    @property
    def description(self) -> str:
        return f"{self.layout} {self.spec.key}"


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
    readers = {
        "compressed-tensors": _compressed_tensors,
        "fp8": _deepseek_fp8,
        "mxfp4": _gpt_oss_mxfp4,
        "gptq": _gptq,
        "awq": _awq,
        "moequant": _compressed_tensors,
    }  # compressed-tensors + a per-expert format map (moequant.vllm_plugin)
    if method not in readers:
        raise UserError(
            f"{where}/config.json has quantization_config.quant_method {method!r}, a source format "
            f"moequant cannot read; accepted: {', '.join(QUANT_METHODS)}."
        )
    found = readers[method](qc, stored, where, read)
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
    q = _quantized(enc, t)
    for role in ("weight_scale", "weight_scale_inv", "scales", "blocks_scales", "weight_global_scale"):
        if role in t:
            _check_scales(enc, role, t[role])
    w = formats.dequantize(q, torch.float32)
    if enc.layout == "gpt-oss-mxfp4":
        w = w.transpose(-2, -1).contiguous()  # dequantized [E, out, in]; the parameter is [E, in, out]
    bad = ~torch.isfinite(w)
    if bad.any():
        raise UserError(
            f"tensor {enc.name!r} ({enc.description}) decodes to {int(bad.sum())} NaN or infinite "
            f"values (its codes in {enc.parts[_codes_role(enc)]!r} are broken)."
        )
    return w


# ---------------------------------------------------------------------------------------------
# decoding per layout


def _codes_role(enc: Encoding) -> str:
    return next(iter(enc.parts))


def _quantized(enc: Encoding, t: dict) -> QuantizedTensor:
    spec, layout, shape = enc.spec, enc.layout, enc.shape
    if layout == "deepseek-fp8":
        return QuantizedTensor(spec, shape, t["weight"], t["weight_scale_inv"].to(torch.float32))
    if layout == "gpt-oss-mxfp4":
        return formats.unpack_gpt_oss_mxfp4(t["blocks"], t["blocks_scales"])
    if layout == "gptq":
        return formats.unpack_gptq(t, spec, shape, version=1)
    if layout == "awq":
        return formats.unpack_awq(t, spec, shape)
    if layout in ("int-quantized", "naive-quantized"):
        return QuantizedTensor(spec, shape, t["weight"], t["weight_scale"])
    if layout == "pack-quantized":
        if "weight_shape" in t and tuple(int(v) for v in t["weight_shape"].tolist()) != tuple(shape):
            raise UserError(
                f"tensor {enc.parts['weight_shape']!r} says {t['weight_shape'].tolist()}, but "
                f"{enc.parts['weight_packed']!r} and its scales hold a weight of shape {list(shape)}."
            )
        t = {**t, "weight_shape": torch.tensor(shape, dtype=torch.int64)}
    return formats.unpack_compressed_tensors(t, spec)


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


# ---------------------------------------------------------------------------------------------
# index building per quant_method (headers only)


def _need(stored, where, name: str, dtypes, shape=None, what: str = ""):
    entry = stored.get(name)
    if entry is None:
        raise UserError(f"{where} lacks tensor {name!r}, which its quantization_config implies{what}.")
    if entry.dtype not in dtypes:
        raise UserError(f"{where}: tensor {name!r} is {entry.dtype}; accepted there: {', '.join(dtypes)}.")
    if shape is not None and tuple(entry.shape) != tuple(shape):
        raise UserError(f"{where}: tensor {name!r} has shape {list(entry.shape)}, but its weight needs {list(shape)}.")
    return entry


def _dims(stored, where, name, ndim: int) -> tuple:
    shape = tuple(stored[name].shape)
    if len(shape) != ndim or not all(shape):
        raise UserError(f"{where}: tensor {name!r} has shape {list(shape)}; a {ndim}-D non-empty tensor is needed.")
    return shape


def _modules_with(stored, param: str) -> list[str]:
    return sorted(n[: -len(param) - 1] for n in stored if n.endswith("." + param))


# ---- compressed-tensors ------------------------------------------------------------------------


def spec_from_ct_scheme(scheme: dict):
    """The moequant format of a compressed-tensors config group (UserError if it has none)."""
    w = scheme.get("weights") or {}
    kind, bits, strategy, group = w.get("type", "int"), w.get("num_bits"), w.get("strategy"), w.get("group_size")
    try:
        if kind == "int":
            if strategy == "channel" and bits == 8:
                return formats.get_format("int8")
            if strategy == "group":
                return formats.get_format(f"int{bits}", group_size=group, symmetric=bool(w.get("symmetric", True)))
        if kind == "float" and bits == 8 and strategy in ("channel", "tensor"):
            return formats.get_format("fp8", granularity=strategy)
        if kind == "float" and bits == 8 and strategy == "block" and list(w.get("block_structure") or []) == [128, 128]:
            return formats.get_format("fp8", granularity="block")
        if kind == "float" and bits == 4 and group == 32:
            return formats.get_format("mxfp4")
        if kind == "float" and bits == 4 and group == 16:
            return formats.get_format("nvfp4")
    except UserError:
        pass
    spec = _registered_ct_spec(w)
    if spec is not None:
        return spec
    raise UserError(
        f"compressed-tensors weights scheme {w} is not a format moequant reads (int2..int8 group, int8 "
        "channel, fp8 tensor / channel / 128x128 block, mxfp4, nvfp4)."
    )


def _registered_ct_spec(w: dict):
    """The registered format whose own compressed-tensors weight args the scheme has (None if none)."""
    given = {"symmetric": True, "dynamic": False, **w}
    for key in formats.all_keys():
        args = formats.compressed_tensors_weight_args(key) or {}
        if args and all(given.get(k) == v for k, v in args.items()):
            return formats.parse_key(key)
    return None


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern == module


def _ct_modules(targets, ignore, modules: list[str], where) -> list[str]:
    out = []
    for t in targets:
        if t.startswith("re:") or t in modules:
            out += [m for m in modules if _matches(t, m)]
        elif t[:1].isupper():  # a class name (Linear): what stores quantization parameters
            out += list(modules)
        else:
            raise UserError(
                f"compressed-tensors target {t!r} in {where}/config.json matches no module of the checkpoint."
            )
    return [m for m in dict.fromkeys(out) if not any(_matches(p, m) for p in ignore)]


def _compressed_tensors(qc, stored, where, read):
    quantized_modules = sorted({n.rsplit(".", 1)[0] for n in stored if n.endswith((".weight_packed", ".weight_scale"))})
    groups, ignore, top = qc.get("config_groups") or {}, qc.get("ignore") or [], qc.get("format")
    if not (
        isinstance(groups, dict)
        and all(
            isinstance(g, dict)
            and isinstance(g.get("targets", []), list)
            and all(isinstance(t, str) for t in g.get("targets", []))
            and isinstance(g.get("weights") or {}, dict)
            for g in groups.values()
        )
        and isinstance(ignore, list)
        and all(isinstance(i, str) for i in ignore)
    ):
        raise UserError(
            f"{where}/config.json: the compressed-tensors quantization_config is malformed; it needs "
            "config_groups {name: {targets: [names], weights: {...}}} and ignore [names]."
        )
    out = {}
    for group, scheme in groups.items():
        if not scheme.get("weights"):
            continue  # activations only: the weights stay as they are
        spec = spec_from_ct_scheme(scheme)
        fmt = scheme.get("format") or top
        if fmt in (None, "mixed-precision"):  # unsaid: the format compressed-tensors infers for the scheme
            fmt = formats.compressed_tensors_format(spec)
        if fmt not in _ct_formats():
            raise UserError(
                f"{where}/config.json: compressed-tensors format {fmt!r} (config group {group}) is not one "
                f"moequant reads; accepted: {', '.join(_ct_formats())}."
            )
        if spec.is_int and fmt in ("int-quantized", "naive-quantized") and (not spec.symmetric or spec.bits != 8):
            raise UserError(
                f"{where}/config.json: {fmt} {spec.key} (config group {group}) is not one moequant reads; "
                "accepted there: symmetric int8."
            )
        for module in _ct_modules(scheme.get("targets", []), ignore, quantized_modules, where):
            name = f"{module}.weight"
            if name in out:
                raise UserError(f"module {module} is targeted by two config groups in {where}/config.json.")
            if f"{module}.weight_g_idx" in stored:
                raise UserError(
                    f"{where}: {module}.weight_g_idx (activation reordering) is not supported; accepted: "
                    "compressed-tensors weights without act-order."
                )
            out[name] = _ct_encoding(stored, where, module, spec, fmt, read)
    return out


def _ct_encoding(stored, where, module: str, spec, fmt: str, read) -> Encoding:
    p = lambda role: f"{module}.{role}"  # noqa: E731
    name = p("weight")
    if spec.family.ct_format == fmt and fmt not in CT_FORMATS:  # a registered format with no rules below
        return _registered_ct_encoding(stored, where, module, spec, fmt)
    if spec.name == "fp8":
        _need(stored, where, name, FLOAT8[:1])
        rows, cols = _dims(stored, where, name, 2)
        scale = {"channel": (rows, 1), "block": (math.ceil(rows / 128), math.ceil(cols / 128))}.get(spec.granularity)
        s = _need(stored, where, p("weight_scale"), FLOATS, scale)
        if spec.granularity == "tensor" and math.prod(s.shape) != 1:
            raise UserError(
                f"{where}: tensor {p('weight_scale')!r} has shape {list(s.shape)}; a per-tensor scale holds one value."
            )
        return Encoding(name, (rows, cols), spec, fmt, {"weight": name, "weight_scale": p("weight_scale")})
    if spec.is_fp4:
        packed = p("weight_packed")
        _need(stored, where, packed, ("U8",))
        rows, half = _dims(stored, where, packed, 2)
        cols = 2 * half
        group = 32 if spec.name == "mxfp4" else 16
        if cols % group:
            raise UserError(
                f"{where}: tensor {packed!r} holds {cols} columns, not a multiple of {spec.key}'s group of {group}."
            )
        parts = {"weight_packed": packed, "weight_scale": p("weight_scale")}
        _need(
            stored, where, parts["weight_scale"], ("U8",) if spec.name == "mxfp4" else FLOAT8[:1], (rows, cols // group)
        )
        if spec.name == "nvfp4":
            parts["weight_global_scale"] = p("weight_global_scale")
            g = _need(stored, where, parts["weight_global_scale"], FLOATS)
            if math.prod(g.shape) != 1:
                raise UserError(
                    f"{where}: tensor {parts['weight_global_scale']!r} has shape {list(g.shape)}; it holds one value."
                )
        return Encoding(name, (rows, cols), spec, fmt, parts)
    if fmt in ("int-quantized", "naive-quantized"):
        _need(stored, where, name, ("I8",))
        rows, cols = _dims(stored, where, name, 2)
        _need(stored, where, p("weight_scale"), FLOATS, (rows, 1))
        return Encoding(name, (rows, cols), spec, fmt, {"weight": name, "weight_scale": p("weight_scale")})
    packed = p("weight_packed")
    _need(stored, where, packed, ("I32",))
    rows, words = _dims(stored, where, packed, 2)
    scale = _need(stored, where, p("weight_scale"), FLOATS)
    if spec.granularity == "group":
        cols = tuple(scale.shape)[-1] * spec.group_size if len(scale.shape) == 2 else -1
        groups = cols // spec.group_size
    else:  # per channel: the column count is only in weight_shape (int8: up to 3 unused codes per row)
        if p("weight_shape") not in stored:
            raise UserError(
                f"{where} lacks tensor {p('weight_shape')!r}, which a per-channel pack-quantized weight needs."
            )
        _need(stored, where, p("weight_shape"), ("I64", "I32"), (2,))
        cols = int(read(p("weight_shape"))[1])
        groups = 1
    if cols <= 0 or tuple(scale.shape) != (rows, groups) or math.ceil(cols * spec.bits / 32) != words:
        raise UserError(
            f"{where}: tensor {p('weight_scale')!r} has shape {list(scale.shape)}, which does not fit "
            f"{packed!r} {[rows, words]} as {spec.key}."
        )
    parts = {"weight_packed": packed, "weight_scale": p("weight_scale")}
    if p("weight_shape") in stored:
        _need(stored, where, p("weight_shape"), ("I64", "I32"), (2,))
        parts["weight_shape"] = p("weight_shape")
    if not spec.symmetric:
        parts["weight_zero_point"] = p("weight_zero_point")
        _need(stored, where, parts["weight_zero_point"], ("I32",), (math.ceil(rows * spec.bits / 32), groups))
    return Encoding(name, (rows, cols), spec, fmt, parts)


def _registered_ct_encoding(stored, where, module: str, spec, fmt: str) -> Encoding:
    """A registered format's compressed-tensors tensors, checked against what its own packer writes for
    one group (names, dtypes; how many logical columns one stored column of the codes holds)."""
    probe_cols = spec.group_size or 1
    probe = formats.pack_compressed_tensors(formats.quantize(torch.zeros(1, probe_cols), spec))
    codes_role = next(iter(probe))
    parts = {role: f"{module}.{role}" for role in probe}
    for role, t in probe.items():
        _need(stored, where, parts[role], (_SAFETENSORS_DTYPE[t.dtype],))
    rows, stored_cols = _dims(stored, where, parts[codes_role], 2)
    cols = stored_cols * probe_cols // probe[codes_role].shape[-1]
    formats.check_shape(spec, (rows, cols), parts[codes_role])
    one_row = formats.pack_compressed_tensors(formats.quantize(torch.zeros(1, cols), spec))  # per row: shapes [1, ...]
    for role, t in one_row.items():
        _need(stored, where, parts[role], (_SAFETENSORS_DTYPE[t.dtype],), (rows,) + tuple(t.shape[1:]))
    return Encoding(f"{module}.weight", (rows, cols), spec, fmt, parts)


_SAFETENSORS_DTYPE = {
    torch.float8_e4m3fn: "F8_E4M3",
    torch.uint8: "U8",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int8: "I8",
}


# ---- DeepSeek FP8 / gpt-oss MXFP4 ----------------------------------------------------------------


def _deepseek_fp8(qc, stored, where, read):
    if list(qc.get("weight_block_size") or []) != [128, 128]:
        raise UserError(
            f"{where}/config.json: fp8 with weight_block_size {qc.get('weight_block_size')!r} is not a source "
            "format moequant reads; accepted: weight_block_size [128, 128] (DeepSeek-V3's)."
        )
    spec = formats.get_format("fp8", granularity="block")
    out = {}
    for module in _modules_with(stored, "weight_scale_inv"):
        name, scale = f"{module}.weight", f"{module}.weight_scale_inv"
        _need(stored, where, name, FLOAT8[:1])
        rows, cols = _dims(stored, where, name, 2)
        _need(stored, where, scale, FLOATS, (math.ceil(rows / 128), math.ceil(cols / 128)))
        out[name] = Encoding(name, (rows, cols), spec, "deepseek-fp8", {"weight": name, "weight_scale_inv": scale})
    return out


def _gpt_oss_mxfp4(qc, stored, where, read):
    spec = formats.get_format("mxfp4")
    out = {}
    for stem in sorted(n[: -len("_blocks")] for n in stored if n.endswith("_blocks")):
        blocks, scales = f"{stem}_blocks", f"{stem}_scales"
        _need(stored, where, blocks, ("U8",))
        E, rows, groups, sixteen = _dims(stored, where, blocks, 4)
        if sixteen != 16:
            raise UserError(
                f"{where}: tensor {blocks!r} has shape {list(stored[blocks].shape)}; MXFP4 blocks are "
                "[experts, out, in/32, 16]."
            )
        _need(stored, where, scales, ("U8",), (E, rows, groups), " (the e8m0 scales of its blocks)")
        out[stem] = Encoding(
            stem, (E, groups * 32, rows), spec, "gpt-oss-mxfp4", {"blocks": blocks, "blocks_scales": scales}
        )
    return out


# ---- GPTQ / AWQ (as moequant writes them) -----------------------------------------------------------


def _gptq(qc, stored, where, read):
    if qc.get("checkpoint_format", "gptq") != "gptq" or qc.get("desc_act"):
        raise UserError(
            f"{where}: GPTQ checkpoints with act-order or checkpoint_format "
            f"{qc.get('checkpoint_format')!r} are not a source format moequant reads; accepted: GPTQ v1 "
            "without act-order."
        )
    symmetric = bool(qc.get("sym", True))
    out = {}
    for module in _modules_with(stored, "qweight"):
        parts = {r: f"{module}.{r}" for r in ("qweight", "qzeros", "scales", "g_idx")}
        for r, dtypes in (
            ("qweight", ("I32",)),
            ("qzeros", ("I32",)),
            ("scales", ("F16", "BF16", "F32")),
            ("g_idx", ("I32", "I64")),
        ):
            _need(stored, where, parts[r], dtypes)
        cols = math.prod(stored[parts["g_idx"]].shape)
        groups, rows = _dims(stored, where, parts["scales"], 2)
        words = _dims(stored, where, parts["qweight"], 2)[0]
        bits = words * 32 // cols if cols else 0
        try:
            spec = (
                formats.get_format("int8")
                if bits == 8 and groups == 1
                else formats.get_format(f"int{bits}", group_size=cols // groups, symmetric=symmetric)
            )
        except UserError:
            raise UserError(
                f"{where}: GPTQ module {module} ({words} x {rows} qweight words for {cols} inputs in "
                f"{groups} groups) is not a format moequant reads."
            ) from None
        _need(stored, where, parts["qweight"], ("I32",), (math.ceil(cols * bits / 32), rows))
        out[f"{module}.weight"] = Encoding(f"{module}.weight", (rows, cols), spec, "gptq", parts)
    return out


def _awq(qc, stored, where, read):
    if str(qc.get("version", "gemm")).lower() != "gemm" or qc.get("bits", 4) != 4:
        raise UserError(
            f"{where}: AWQ version {qc.get('version')!r} with {qc.get('bits')} bits is not a source format "
            "moequant reads; accepted: AWQ GEMM 4-bit."
        )
    spec = formats.get_format("int4", group_size=qc.get("group_size"), symmetric=not qc.get("zero_point", True))
    out = {}
    for module in _modules_with(stored, "qweight"):
        parts = {r: f"{module}.{r}" for r in ("qweight", "qzeros", "scales")}
        _need(stored, where, parts["qweight"], ("I32",))
        cols = _dims(stored, where, parts["qweight"], 2)[0]
        _need(stored, where, parts["scales"], ("F16", "BF16", "F32"))
        groups, rows = _dims(stored, where, parts["scales"], 2)
        if groups * spec.group_size != cols or rows % 8:
            raise UserError(
                f"{where}: tensor {parts['scales']!r} has shape {[groups, rows]}, which does not fit "
                f"{parts['qweight']!r} as {spec.key}."
            )
        _need(stored, where, parts["qweight"], ("I32",), (cols, rows // 8))
        _need(stored, where, parts["qzeros"], ("I32",), (groups, rows // 8))
        out[f"{module}.weight"] = Encoding(f"{module}.weight", (rows, cols), spec, "awq", parts)
    return out
