"""What the library's own calibration defaults were before they followed the recipe: 64 x 256 samples,
token-weighted Hessians, GPTQ as published and an RTN probe. Tests and benchmarks whose expectations were
set with them ask for them by name."""

from __future__ import annotations

from moequant.algorithms.registry import PLAIN_GPTQ
from moequant.measure.settings import CalibrationSettings

PLAIN = dict(samples=64, seq_len=256, hessian_weighting="tokens", gptq=PLAIN_GPTQ, probe_algorithm="rtn")


def plain_settings(**fields) -> CalibrationSettings:
    """CalibrationSettings from PLAIN, with `fields` on top."""
    return CalibrationSettings(**{**PLAIN, **fields})
