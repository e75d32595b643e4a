"""moequant: per-expert quantization for Mixture-of-Experts language models."""

__version__ = "0.1.0"

from moequant.errors import UserError  # noqa: E402,F401
