"""Readers of what a run left behind that only the tests and benchmarks ask for."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from moequant.pipeline.pareto import find


def load_awq_scales(work_dir, layer: int) -> dict[str, torch.Tensor] | None:
    """The AWQ scales the quantize pass used in `layer` (from `work/awq_LLL.safetensors`), or None:
    "input" [hidden] (the shared gate/up scale: the norm was divided by it, its consumers'
    input columns multiplied) and "down" [E, expert_intermediate] (down_proj columns multiplied,
    up_proj rows divided; 1 for experts without AWQ)."""
    path = Path(work_dir) / f"awq_{layer:03d}.safetensors"
    return load_file(str(path)) if path.exists() else None


def interpolate_uniform(points: list[dict], bits: float, low: str, high: str) -> float:
    """KL of the straight line between two uniform points of a pareto run (by name) at `bits` per routed
    weight: what mixing the two formats at random over the layers gives, to first order."""
    a, b = find(points, low), find(points, high)
    x0, x1 = a["bits_per_weight_experts"], b["bits_per_weight_experts"]
    t = (bits - x0) / (x1 - x0)
    return a["kl_mean"] + t * (b["kl_mean"] - a["kl_mean"])
