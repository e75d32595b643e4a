"""moequant: per-expert quantization for Mixture-of-Experts language models."""

__version__ = "0.1.0"

from moequant.errors import UserError  # noqa: E402,F401


def load(path, dtype=None, device: str = "cpu"):
    """Any checkpoint moequant wrote (per-expert mixes included) as a transformers model with
    dequantized weights. See moequant.io.loader.load."""
    from moequant.io.loader import load as _load

    return _load(path, dtype=dtype, device=device)


def register_for_transformers(path) -> bool:
    """Let plain transformers' from_pretrained load moequant's export at `path` of a family whose own
    checkpoints keep experts fused (Gemma-4, GraniteMoE, Qwen3-VL-MoE ...): call it once before loading.
    Returns False (and does nothing) for the families transformers loads as they are."""
    import json
    from pathlib import Path

    from moequant.arch import register_for_transformers as _register
    from moequant.layouts.compressed_tensors import without_transformers_stop

    return _register(without_transformers_stop(json.loads((Path(path) / "config.json").read_text())))
