"""Helpers several test files share (the tiny models are in tiny.py): plain functions, imported as
`from helpers import ...` (tests/conftest.py puts this folder on the import path)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch


def make_layer(experts, out, n_in, tokens, seed=0, dtype=torch.float32):
    """Random experts and per-expert inputs that, like real activations, are correlated across
    channels (decaying spectrum) and have uneven channel scales."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(experts, out, n_in, generator=g, dtype=torch.float64) / n_in**0.5
    channel_scale = torch.exp(0.7 * torch.randn(n_in, generator=g, dtype=torch.float64))
    spectrum = torch.arange(1, n_in + 1, dtype=torch.float64) ** -1.0
    mix = torch.linalg.qr(torch.randn(n_in, n_in, generator=g, dtype=torch.float64))[0] * spectrum.sqrt()[:, None]
    x = torch.randn(experts, 2 * tokens, n_in, generator=g, dtype=torch.float64) @ mix * channel_scale
    calib, held_out = x[:, :tokens], x[:, tokens:]
    h = calib.transpose(1, 2) @ calib / tokens
    return w.to(dtype), h.to(dtype), held_out


def output_error(w, w_hat, x):
    """Relative squared error of the layer's outputs on inputs x [E, n, in]."""
    ref = x @ w.double().transpose(1, 2)
    return float(((x @ w_hat.double().transpose(1, 2) - ref) ** 2).sum() / (ref**2).sum())


def make_weight(shape, kind="normal", seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        w = torch.randn(shape, generator=g) * 0.02
    else:  # heavy tails: Student-t with 2.5 degrees of freedom (finite variance, large outliers)
        z = torch.randn(shape, generator=g, dtype=torch.float64)
        chi2 = (torch.randn(shape + (5,), generator=g, dtype=torch.float64) ** 2).sum(-1) / 2.5 * 0.5
        w = (z / chi2.sqrt() * 0.01).float()
    return w.to(dtype)


def header_only_checkpoint(directory: Path, config) -> None:
    """config.json and one safetensors file of every tensor the architecture expects, in bf16, whose
    data region is a hole (a sparse file): the shapes of a real model without its bytes."""
    from moequant.arch import adapter_for

    directory.mkdir(parents=True)
    config.save_pretrained(directory)
    expected = adapter_for(json.loads((directory / "config.json").read_text())).expected_tensors()
    header, offset = {}, 0
    for name, (shape, _role) in sorted(expected.items()):
        size = 2 * int(torch.Size(shape).numel())
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(directory / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
