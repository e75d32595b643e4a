"""`moequant.load(path)`: any checkpoint moequant wrote or reads (a quantized source: FP8-block,
compressed-tensors, gpt-oss MXFP4, GPTQ, AWQ; see moequant.io.dequant), as a transformers model with
dequantized weights.

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
from pathlib import Path

import torch

from moequant.arch import adapter_for
from moequant.errors import UserError
from moequant.io.checkpoint import open_checkpoint

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load(path, dtype: torch.dtype | None = None, device: str = "cpu"):
    """A transformers causal-LM with every weight of checkpoint `path` dequantized (eval mode).

    Built in place, with no dense copy on disk: the model is made on the meta device from
    config.json (moequant.io.layers.build_skeleton), then each decoder layer is filled from the
    checkpoint through the architecture adapter's in-memory layout (the same code that
    calibration runs layer by layer), each quantized weight decoded as it is read."""
    from moequant.io.layers import build_skeleton, fill_computed_buffers, make_head_real

    gguf_file = gguf_export_file(path)
    if gguf_file is not None:  # a GGUF export: one file in llama.cpp's names, read back through gguf-py
        return _load_gguf(gguf_file, dtype, device)
    ckpt = open_checkpoint(path)
    adapter = adapter_for(
        ckpt.config
    )  # a known architecture (else one UserError), so transformers needs no custom code
    require_complete(ckpt, adapter)
    dtype = dtype or _config_dtype(ckpt.config)
    model = build_skeleton(ckpt, dtype)
    for i, layer in enumerate(adapter.decoder(model)[1]):
        layer.to_empty(device="cpu")
        fill_computed_buffers(model, layer, "cpu")
        layer.load_state_dict(adapter.layer_state_dict(ckpt, i, list(layer.state_dict()), dtype), strict=True)
    make_head_real(model, ckpt, adapter, "cpu", dtype)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"moequant.load left {left[0]} unfilled")  # a module the adapter does not know
    if (ckpt.directory / "generation_config.json").is_file():  # as from_pretrained sets it
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(ckpt.directory))
    ckpt.close()
    return model.to(device).eval()


def gguf_export_file(path) -> Path | None:
    """The model.gguf of a GGUF export directory (or that file given itself), else None (also for an open
    Checkpoint)."""
    from moequant.layouts.gguf import GGUF_FILE

    if not isinstance(path, (str, os.PathLike)):
        return None
    path = Path(path)
    if path.is_file() and path.name == GGUF_FILE:
        return path
    return path / GGUF_FILE if (path / GGUF_FILE).is_file() and not (path / "config.json").exists() else None


def _load_gguf(file: Path, dtype: torch.dtype | None, device: str):
    """`load` of a GGUF export: the transformers model built from the config.json the export recorded in
    moequant_export.json, every weight gguf-py's dequantization of the file (moequant.layouts.gguf
    read_gguf_weights) put through the adapter's in-memory layout as `load` does for safetensors."""
    import json
    import tempfile
    import types

    from moequant.io.checkpoint import EXPORT_INFO
    from moequant.io.layers import build_skeleton, fill_computed_buffers, make_head_real
    from moequant.layouts.gguf import read_gguf_weights

    info_path = file.parent / EXPORT_INFO
    try:
        config = json.loads(info_path.read_text()).get("config")
    except (OSError, ValueError, AttributeError):
        config = None
    if not isinstance(config, dict):
        raise UserError(
            f"{file} has no model config next to it ({info_path} holds none: a GGUF export made before moequant "
            "recorded it); export it again with `moequant apply`, or run the file in llama.cpp."
        )
    adapter = adapter_for(config)
    tensors, experts = read_gguf_weights(file, adapter, config)
    dtype = dtype or _config_dtype(config)
    with tempfile.TemporaryDirectory() as tmp:  # build_skeleton reads a config.json, and the weights by name
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        source = types.SimpleNamespace(directory=Path(tmp), config=config, get=lambda name, device=None: tensors[name])
        model = build_skeleton(source, dtype)
    for i, layer in enumerate(adapter.decoder(model)[1]):
        layer.to_empty(device="cpu")
        fill_computed_buffers(model, layer, "cpu")
        mine = {p: experts.pop((i, p)) for p in adapter.projections if (i, p) in experts}
        state = adapter.layer_state_dict(source, i, list(layer.state_dict()), dtype, experts=mine, tensors=tensors)
        layer.load_state_dict(state, strict=True)
        del mine, state
    make_head_real(model, source, adapter, "cpu", dtype)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"moequant.load left {left[0]} unfilled")  # a module the adapter does not know
    return model.to(device).eval()


def require_complete(ckpt, adapter) -> None:
    """Refuse a checkpoint that lacks tensors its config implies (one sentence naming one)."""
    missing = sorted(set(adapter.expected_tensors()) - set(ckpt.keys()))
    if missing:
        raise UserError(
            f"checkpoint {ckpt.path} lacks {len(missing)} tensors the {adapter.model_type} model needs "
            f"(e.g. {missing[0]}); accepted: a checkpoint under the model's own on-disk tensor names."
        )


def from_pretrained_complete(directory, dtype, shown_as=None):
    """transformers' from_pretrained, refusing a checkpoint that lacks tensors the model needs:
    transformers initialises those at random and goes on, which would make every number wrong."""
    from transformers.utils import logging as hf_logging

    from moequant.arch import register_for_transformers
    from moequant.arch.generic import model_class
    from moequant.layouts.compressed_tensors import has_fused_stop, without_transformers_stop

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # only our own (rich) bars on screen: its tqdm would interleave with them
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
        if has_fused_stop(config):  # our export of a family transformers reads fused
            register_for_transformers(without_transformers_stop(config))
        model, info = model_class(config).from_pretrained(
            str(directory), dtype=dtype, trust_remote_code=False, output_loading_info=True
        )
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        unexpected = sorted(info.get("unexpected_keys") or [])
        also = f"; its own names (e.g. {unexpected[0]}) are not the architecture's" if unexpected else ""
        raise UserError(
            f"checkpoint {shown_as or directory} lacks {len(missing)} tensors the "
            f"{model.config.model_type} model needs (e.g. {missing[0]}){also}; accepted: a checkpoint "
            "under the model's own on-disk tensor names."
        )
    return model


def _config_dtype(config: dict) -> torch.dtype:
    name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return _DTYPES.get(str(name).replace("torch.", ""), torch.bfloat16)


def dequantized_state_dict(path_or_ckpt, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Tensor name (as a bf16 checkpoint names it) -> dense tensor, for every tensor of the checkpoint.

    The decoding is the checkpoint's own (moequant.io.dequant through open_checkpoint): each quantized
    weight dequantized in float32, then cast once to `dtype`."""
    ckpt = path_or_ckpt if hasattr(path_or_ckpt, "entries") else open_checkpoint(path_or_ckpt)
    out: dict[str, torch.Tensor] = {}
    for name in ckpt.keys():
        t = ckpt.get(name)
        out[name] = t.to(dtype) if t.is_floating_point() else t
    return out


if __name__ == "__main__":  # pragma: no cover - a quick manual check
    import sys

    m = load(sys.argv[1])
    print(type(m).__name__, sum(p.numel() for p in m.parameters()), os.path.abspath(sys.argv[1]))
