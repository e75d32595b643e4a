"""moequant: per-expert quantization for Mixture-of-Experts language models."""

__version__ = "0.1.0"

from moequant.errors import UserError  # noqa: E402,F401


def load(path, dtype=None, device: str = "cpu"):
    """Any checkpoint moequant wrote (per-expert mixes included) as a transformers model with
    dequantized weights. See moequant.io.loader.load."""
    from moequant.io.loader import load as _load

    return _load(path, dtype=dtype, device=device)
