"""Round-to-nearest: the format's own scales, no calibration data."""

from __future__ import annotations

import torch


def rtn(weight: torch.Tensor, spec, *, device: torch.device | str | None = None, name: str | None = None):
    """Quantize `weight` ([E, out, in] or [out, in]) to `spec` by round-to-nearest -> QuantizedTensor.

    Scales are per expert. `device`: where to compute (default the weight's); the result comes
    back on the weight's device.
    """
    from moequant import formats

    out_device = weight.device
    work = weight if device is None else weight.to(device)
    q = formats.quantize(work, spec, name=name)
    return q.to(out_device) if q.codes.device != out_device else q
