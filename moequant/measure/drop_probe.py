"""The measured loss of dropping each routed expert (issue 58): KL(original || the model with only expert e of
layer L dropped), on the calibration workload's held-out probe windows, as the quantization probe measures KL
(moequant.measure.probe: float64, mean per token).

Dropping an expert is what the pruned export does (moequant.export.prune): the router no longer offers it, so its
top-k slots go to the next-best experts and the weights are normalised by the family's own rule. Here the model's
own router runs with the expert's score pushed to a huge negative value (its logit: softmax gives it 0 and the top-k
passes it over; DeepSeek-V3's selection bias too, so the sigmoid score + bias that chooses never picks it), which
is the same routing among the experts left. Each (layer, expert) is one stream branched off the original hidden
states at its layer, so a walk costs O(L^2 E) layer forwards on the probe tokens.

The losses of several experts of a layer are taken as additive (first order, as the quantization probe's layers):
the budget solver (moequant.plan.drop) compares them with the probe-scaled predicted KL of quantizing.

drop_probe.json (schema "moequant.drop_probe/1"): {"schema", "samples", "tokens", "layers": {"L": [KL per expert]}}.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

from moequant.errors import UserError
from moequant.measure.probe import MAX_STREAM_BYTES, _forward, _head, _kl_sums

DROP_PROBE_SCHEMA = "moequant.drop_probe/1"
MASKED = -1e30  # finite: sums and differences of masked scores stay finite (no inf - inf = NaN)


class _MaskedRouter(TorchFunctionMode):
    """Every F.linear through the router's weight returns the columns of `experts` at MASKED; `hits` counts them."""

    def __init__(self, weight: torch.Tensor, experts: list[int]):
        super().__init__()
        self.weight, self.experts, self.hits = weight, list(experts), 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.nn.functional.linear and len(args) > 1 and args[1] is self.weight:
            out = out.clone()
            out[..., self.experts] = MASKED
            self.hits += 1
        return out


@contextlib.contextmanager
def dropped(adapter, module, layer: int, experts: list[int]):
    """Decoder layer `module` (materialised) routing as if `experts` were not there."""
    router = adapter.router_module(adapter.block_in_layer(module, layer))
    bias = getattr(router, "e_score_correction_bias", None)
    saved = None
    if isinstance(bias, torch.Tensor):  # DeepSeek-V3: the score that chooses is sigmoid + bias
        saved = bias.detach().clone()
        with torch.no_grad():
            bias[list(experts)] = MASKED
    mode = _MaskedRouter(router.weight, experts)
    try:
        with mode:
            yield
    finally:
        if saved is not None:
            with torch.no_grad():
                bias.copy_(saved)
    if mode.hits == 0:
        raise UserError(
            f"the drop probe found no router projection in this {adapter.model_type} model's layer {layer} "
            "(its router does not compute F.linear over its weight); use experts.prune.saliency reap."
        )


def run_drop_probe(
    checkpoint,
    adapter,
    input_ids: torch.Tensor,
    batch_size: int = 8,
    device: str = "cpu",
    max_stream_bytes: int = MAX_STREAM_BYTES,
) -> dict:
    """drop_probe.json's dict: per MoE layer, the KL of dropping each of its routed experts alone on `input_ids`."""
    from moequant.io.layers import LayerRunner

    runner = LayerRunner(checkpoint, adapter, input_ids, batch_size=batch_size, device=device)
    head = _head(runner, checkpoint)
    tokens = int(input_ids.numel())
    units = [(L, e) for L in adapter.moe_layers for e in range(adapter.num_experts)]
    stream_bytes = tokens * adapter.hidden * torch.finfo(runner.dtype).bits // 8
    per_walk = max(1, int(max_stream_bytes // max(stream_bytes, 1)) - 2)
    kl: dict[tuple[int, int], float] = {}
    for start in range(0, len(units), per_walk):  # one walk per chunk of streams
        chunk = units[start : start + per_walk]
        original, streams = runner.embedded, {}
        for L in range(adapter.num_layers):
            before = original
            with runner.materialized(L) as module:
                original = _forward(runner, module, L, original)
                for u in streams:
                    streams[u] = _forward(runner, module, L, streams[u])
                for u in (u for u in chunk if u[0] == L):
                    with dropped(adapter, module, L, [u[1]]):
                        streams[u] = _forward(runner, module, L, before)
        kl.update({u: total / tokens for u, total in _kl_sums(runner, head, original, streams).items()})
    return {
        "schema": DROP_PROBE_SCHEMA,
        "samples": int(input_ids.shape[0]),
        "tokens": tokens,
        "layers": {str(L): [kl[(L, e)] for e in range(adapter.num_experts)] for L in adapter.moe_layers},
    }


def run_drop_sets(checkpoint, adapter, input_ids: torch.Tensor, sets: dict, batch_size: int = 8, device="cpu") -> dict:
    """{key: KL(original || the model with sets[key] = {layer: experts} all dropped at once)} on `input_ids`: what
    each count the budget weighs really costs (one stream per set, from the embeddings)."""
    from moequant.io.layers import LayerRunner

    runner = LayerRunner(checkpoint, adapter, input_ids, batch_size=batch_size, device=device)
    head = _head(runner, checkpoint)
    original, streams = runner.embedded, dict.fromkeys(sets, runner.embedded)
    for L in range(adapter.num_layers):
        with runner.materialized(L) as module:
            original = _forward(runner, module, L, original)
            for key, drops in sets.items():
                with dropped(adapter, module, L, drops[L]) if drops.get(L) else contextlib.nullcontext():
                    streams[key] = _forward(runner, module, L, streams[key])
    tokens = int(input_ids.numel())
    return {key: total / tokens for key, total in _kl_sums(runner, head, original, streams).items()}
