"""`moequant.load(path)`: any checkpoint moequant wrote, as a transformers model with dequantized weights.

Every quantized tensor is read back with moequant's own unpackers and dequantized once
(float32 arithmetic, cast to the model dtype), so per-expert mixes that no engine loads work
too. transformers' own quantization loaders are never involved: its compressed-tensors loader
picks one experts scheme for the whole model and decodes per-layer mixes wrongly.

    model = moequant.load("out/checkpoint")               # dtype from config.json
    weights = dequantized_state_dict("out/checkpoint")    # on-disk names -> dense tensors
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import torch

from moequant import formats
from moequant.arch import adapter_for
from moequant.checkpoint import ShardWriter, open_checkpoint
from moequant.errors import UserError
from moequant.formats import QuantizedTensor

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load(path, dtype: torch.dtype | None = None, device: str = "cpu"):
    """A transformers causal-LM with every weight of checkpoint `path` dequantized (eval mode)."""
    from transformers import AutoModelForCausalLM

    ckpt = open_checkpoint(path)
    adapter_for(ckpt.config)  # a known architecture (else one UserError), so transformers needs no custom code
    dtype = dtype or _config_dtype(ckpt.config)
    weights = dequantized_state_dict(ckpt, dtype)
    config = {k: v for k, v in ckpt.config.items() if k != "quantization_config"}
    with tempfile.TemporaryDirectory(prefix="moequant-load-") as tmp:
        writer = ShardWriter(Path(tmp))
        for name, tensor in weights.items():
            writer.add(name, tensor)
        writer.finish()
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        model = from_pretrained_complete(tmp, dtype, shown_as=ckpt.path)
    return model.to(device).eval()


def from_pretrained_complete(directory, dtype, shown_as=None):
    """transformers' from_pretrained, refusing a checkpoint that lacks tensors the model needs:
    transformers initialises those at random and goes on, which would make every number wrong."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # only our own (rich) bars on screen: its tqdm would interleave with them
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, trust_remote_code=False,
                                                           output_loading_info=True)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        unexpected = sorted(info.get("unexpected_keys") or [])
        also = f"; its own names (e.g. {unexpected[0]}) are not the architecture's" if unexpected else ""
        raise UserError(f"checkpoint {shown_as or directory} lacks {len(missing)} tensors the "
                        f"{model.config.model_type} model needs (e.g. {missing[0]}){also}; accepted: a checkpoint "
                        "under the model's own on-disk tensor names.")
    return model


def _config_dtype(config: dict) -> torch.dtype:
    name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return _DTYPES.get(str(name).replace("torch.", ""), torch.bfloat16)


def dequantized_state_dict(path_or_ckpt, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Tensor name (as a bf16 checkpoint names it) -> dense tensor, for every tensor of the checkpoint."""
    ckpt = path_or_ckpt if hasattr(path_or_ckpt, "entries") else open_checkpoint(path_or_ckpt)
    qc = ckpt.config.get("quantization_config") or {}
    method = qc.get("quant_method")
    readers = {None: _read_nothing, "compressed-tensors": _read_compressed_tensors, "gptq": _read_gptq,
               "awq": _read_awq, "fp8": _read_deepseek_fp8, "mxfp4": _read_gpt_oss_mxfp4}
    if method not in readers:
        raise UserError(f"{ckpt.path}/config.json has quantization_config.quant_method {method!r}; moequant.load reads "
                        f"{', '.join(m for m in readers if m)} checkpoints.")
    quantized = readers[method](ckpt, qc)  # on-disk weight name -> (QuantizedTensor, consumed tensor names)
    out: dict[str, torch.Tensor] = {}
    consumed: set[str] = set()
    for name, (q, used) in quantized.items():
        w = formats.dequantize(q, dtype)
        out[name] = w.transpose(-2, -1).contiguous() if name.endswith(("_proj",)) and w.dim() == 3 else w
        consumed.update(used)
    for name in ckpt.keys():
        if name not in consumed:
            t = ckpt.get(name)
            out[name] = t.to(dtype) if t.is_floating_point() else t
    return out


def _read_nothing(ckpt, qc):
    return {}


def _gather(ckpt, module: str, params) -> dict[str, torch.Tensor]:
    missing = [p for p in params if f"{module}.{p}" not in ckpt]
    if missing:
        raise UserError(f"checkpoint {ckpt.path} lacks {module}.{missing[0]}, which its quantization_config implies.")
    return {p: ckpt.get(f"{module}.{p}") for p in params}


# ---- compressed-tensors -----------------------------------------------------------------------

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
        if kind == "float" and bits == 8 and strategy == "block":
            return formats.get_format("fp8", granularity="block", block_size=(w.get("block_structure") or [128])[0])
        if kind == "float" and bits == 4 and group == 32:
            return formats.get_format("mxfp4")
        if kind == "float" and bits == 4 and group == 16:
            return formats.get_format("nvfp4")
    except UserError:
        pass
    raise UserError(f"compressed-tensors weights scheme {w} is not a format moequant writes.")


def _ct_modules(ckpt, targets: list[str]) -> list[str]:
    modules = sorted({n.rsplit(".", 1)[0] for n in ckpt.keys()
                      if n.endswith((".weight_packed", ".weight_scale", ".weight"))})
    out = []
    for t in targets:
        if t.startswith("re:"):
            rx = re.compile(t[3:])
            out += [m for m in modules if rx.match(m)]
        elif t in modules:
            out.append(t)
        else:
            raise UserError(f"compressed-tensors target {t!r} in {ckpt.path}/config.json matches no module of the checkpoint.")
    return out


def _read_compressed_tensors(ckpt, qc):
    out = {}
    for group_name, scheme in (qc.get("config_groups") or {}).items():
        spec = spec_from_ct_scheme(scheme)
        for module in _ct_modules(ckpt, scheme.get("targets", [])):
            if f"{module}.weight" in out:
                raise UserError(f"module {module} is targeted by two config groups in {ckpt.path}/config.json.")
            if f"{module}.weight_packed" in ckpt:
                params = ["weight_packed", "weight_scale"]
                if spec.is_int:
                    params.append("weight_shape")
                    if not spec.symmetric:
                        params.append("weight_zero_point")
                if spec.name == "nvfp4":
                    params.append("weight_global_scale")
                tensors = _gather(ckpt, module, params)
                q = formats.unpack_compressed_tensors(tensors, spec)
            else:  # int-quantized (W8A8) or float-quantized: codes stored as they are
                tensors = _gather(ckpt, module, ["weight", "weight_scale"])
                w, s = tensors["weight"], tensors["weight_scale"]
                if spec.name == "fp8":
                    q = formats.unpack_compressed_tensors(tensors, spec)
                else:
                    q = QuantizedTensor(spec, tuple(w.shape), w, s)
            out[f"{module}.weight"] = (q, {f"{module}.{p}" for p in tensors})
    return out


# ---- GPTQ / AWQ ------------------------------------------------------------------------------------

def _modules_with(ckpt, param: str) -> list[str]:
    return sorted(n[: -len(param) - 1] for n in ckpt.keys() if n.endswith("." + param))


def _read_gptq(ckpt, qc):
    if qc.get("checkpoint_format", "gptq") != "gptq" or qc.get("desc_act"):
        raise UserError(f"{ckpt.path}: moequant.load reads GPTQ v1 checkpoints without act-order, as moequant writes them.")
    symmetric = bool(qc.get("sym", True))
    out = {}
    for module in _modules_with(ckpt, "qweight"):
        t = _gather(ckpt, module, ["qweight", "qzeros", "scales", "g_idx"])
        cols = t["g_idx"].numel()
        rows = t["scales"].shape[-1]
        bits = t["qweight"].shape[0] * 32 // cols
        groups = t["scales"].shape[0]
        if bits == 8 and groups == 1:
            spec = formats.get_format("int8")
        else:
            spec = formats.get_format(f"int{bits}", group_size=cols // groups, symmetric=symmetric)
        q = formats.unpack_gptq(t, spec, (rows, cols), version=1)
        out[f"{module}.weight"] = (q, {f"{module}.{p}" for p in t})
    return out


def _read_awq(ckpt, qc):
    if qc.get("version", "gemm").lower() != "gemm" or qc.get("bits", 4) != 4:
        raise UserError(f"{ckpt.path}: moequant.load reads AWQ GEMM 4-bit checkpoints, as moequant writes them.")
    spec = formats.get_format("int4", group_size=qc["group_size"], symmetric=not qc.get("zero_point", True))
    out = {}
    for module in _modules_with(ckpt, "qweight"):
        t = _gather(ckpt, module, ["qweight", "qzeros", "scales"])
        shape = (t["scales"].shape[-1], t["qweight"].shape[0])
        q = formats.unpack_awq(t, spec, shape)
        out[f"{module}.weight"] = (q, {f"{module}.{p}" for p in t})
    return out


# ---- DeepSeek FP8 / gpt-oss MXFP4 -------------------------------------------------------------------

def _read_deepseek_fp8(ckpt, qc):
    if list(qc.get("weight_block_size") or []) != [128, 128]:
        raise UserError(f"{ckpt.path}: moequant.load reads FP8 checkpoints with weight_block_size [128, 128].")
    spec = formats.get_format("fp8", granularity="block")
    out = {}
    for module in _modules_with(ckpt, "weight_scale_inv"):
        t = _gather(ckpt, module, ["weight", "weight_scale_inv"])
        q = QuantizedTensor(spec, tuple(t["weight"].shape), t["weight"], t["weight_scale_inv"].to(torch.float32))
        out[f"{module}.weight"] = (q, {f"{module}.{p}" for p in t})
    return out


def _read_gpt_oss_mxfp4(ckpt, qc):
    out = {}
    for stem in sorted(n[: -len("_blocks")] for n in ckpt.keys() if n.endswith("_blocks")):
        if f"{stem}_scales" not in ckpt:
            raise UserError(f"checkpoint {ckpt.path} has {stem}_blocks but no {stem}_scales.")
        q = formats.unpack_gpt_oss_mxfp4(ckpt.get(f"{stem}_blocks"), ckpt.get(f"{stem}_scales"))
        out[stem] = (q, {f"{stem}_blocks", f"{stem}_scales"})  # dequantized [E, out, in], stored [E, in, out]
    return out


if __name__ == "__main__":  # pragma: no cover - a quick manual check
    import sys

    m = load(sys.argv[1])
    print(type(m).__name__, sum(p.numel() for p in m.parameters()), os.path.abspath(sys.argv[1]))
