"""What an algorithm's per-layer preparation reads and hands back (`Algorithm.prepare_layer`, registry.py).

An algorithm that changes a whole MoE layer's weights before they are rounded (AWQ scales them and folds the
scales into tensors around them) gets, once per layer, the layer's routed experts as float32 host copies, the
statistics of one forward of the original layer and the MoE block's recorded input tokens; it changes the
weights in place and says what else it changed. The quantize pass then rounds every plan row as usual
(`Algorithm.quantize`), runs the layer with the result and lets the preparation add its report entries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch


@dataclass
class LayerToPrepare:
    algorithm: str  # the preparing algorithm's name: its plan rows are those of `rows` that name it
    adapter: object
    ckpt: object
    layer: int
    rows: list  # the layer's routed-expert plan rows (every algorithm's)
    weights: dict  # proj -> [E, out, in] float32 on the host, changed in place
    statistics: dict  # the experts' input statistics from the forward (measure.collector.LayerCollector)
    # (group, expert ids) -> (own [c] bool, routed tokens [c], Hessian [c, d, d], mean |x| [c, d], tokens used
    # [c]): each expert's routed-token statistics when it has at least rule.min_tokens, else all tokens'
    choose: Callable
    tokens: dict  # the MoE block's input: "x", "indices", "weights" (lists per batch), "act" (its activation)
    rule: object  # the run's measure.settings.HessianRule, which `choose` applies (min_tokens, prior)
    device: object


@dataclass
class PreparedLayer:
    input_scale: torch.Tensor | None = None  # gate / up now read x / input_scale: their Hessians are divided by it
    replaced: dict = field(default_factory=dict)  # full-precision tensors it changed {on-disk name: float32}
    changed: dict = field(default_factory=dict)  # proj -> bool [E]: experts whose weights it changed
    # (layer report, routing before, routing after [per batch: top-k sets], attention quantized, a diagnostics
    # file in work/) -> None: its entries into the layer's report, once the quantized layer has run
    finish: Callable[[dict, list, list, bool, Path], None] | None = None
