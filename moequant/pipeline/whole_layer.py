"""A layer's routed experts quantized at once on host copies (a CPU run, and any layer an algorithm prepares):
one forward of the original layer collects the experts' statistics and records what a preparation reads (the
routing, the MoE block's first input tokens); the preparation (`Algorithm.prepare_layer`, AWQ's scales) changes
the weights; every plan row is then rounded by its algorithm, and experts the preparation changed but the plan
keeps in full precision are handed back as replacements."""

from __future__ import annotations

import functools

import torch

from moequant.algorithms.layer import LayerToPrepare
from moequant.measure.calibrate import collect_moe_stats
from moequant.measure.collector import LayerCollector
from moequant.pipeline.experts import _chosen_statistics, _quantize_experts


def _token_recorder(adapter, module, layer: int, store: dict, limit: int):
    """Hooks that keep the MoE block's first `limit` input tokens and their routing (a layer preparation's)."""
    routing = {}

    def on_router(_module, _args, output):
        routing["now"] = (
            output[2].reshape(-1, adapter.top_k).cpu(),
            output[1].reshape(-1, adapter.top_k).float().cpu(),
        )

    def on_experts(_module, args, kwargs):
        x = (args[0] if args else kwargs["hidden_states"]).detach()
        x = x.reshape(-1, x.shape[-1]).float().cpu()
        room = limit - sum(t.shape[0] for t in store.setdefault("x", []))
        if room > 0:
            store["x"].append(x[:room])
            store.setdefault("indices", []).append(routing["now"][0][:room])
            store.setdefault("weights", []).append(routing["now"][1][:room])

    store["act"] = adapter.experts_in_layer(module, layer).act_fn
    return [
        adapter.router_module(adapter.block_in_layer(module, layer)).register_forward_hook(on_router),
        adapter.experts_in_layer(module, layer).register_forward_pre_hook(on_experts, with_kwargs=True),
    ]


def routing_recorder(adapter, module, layer: int, store: list):
    """Forward hook on the layer's router that appends each batch's top-k expert sets (sorted)."""

    def hook(_module, _args, output):
        store.append(output[2].reshape(-1, adapter.top_k).sort(-1).values.cpu())

    return adapter.router_module(adapter.block_in_layer(module, layer)).register_forward_hook(hook)


# ----------------------------------------------------------------------------- the pass


def prepare_statistics(runner, adapter, L: int, hidden, weights: dict, hessian_weighting: str, max_tokens: int):
    """One forward of a layer an algorithm prepares, with its original weights (`weights`, host copies): the
    experts' statistics, and for the preparation the routing and the MoE block's first `max_tokens` tokens.
    Returns (statistics on the CPU, routed tokens per expert, routing [per batch], recorded tokens)."""
    routing_before, tokens = [], {}
    with runner.materialized(L, experts=weights) as module:
        col = LayerCollector(
            adapter,
            adapter.experts_in_layer(module, L),
            adapter.num_experts,
            adapter.top_k,
            [],
            True,
            True,
            hessian_weighting=hessian_weighting,
        )
        col.token_domains = torch.zeros(0, dtype=torch.long)
        hooks = [
            routing_recorder(adapter, module, L, routing_before),
            *(_token_recorder(adapter, module, L, tokens, max_tokens) if max_tokens else []),
        ]
        try:
            collect_moe_stats(runner, module, L, col, hidden)
        finally:
            for hook in hooks:
                hook.remove()
        collected = col.finish()
        col.t.clear()  # the raw sums: the normalised copies above are what the layer uses
        # the pass's own routing (inputs from the quantized layers before): the report's
        # usage signal when the recipe ran no calibration
        routed_tokens = collected["routing.count"].tolist()
        collected = {k: v.cpu() for k, v in collected.items()}
    return collected, routed_tokens, routing_before, tokens


def quantize_whole_layer(
    run,
    L: int,
    expert_rows: list,
    mine: list,
    weights: dict,
    collected: dict | None,
    tokens: dict,
    preparer,
):
    """The layer's routed experts in one go (no chunks): the `preparer`'s preparation first (AWQ's scales),
    then every row by its algorithm (`_quantize_experts`).
    Returns (quantized, report, dequantized experts, full-precision replacements, the preparation or None)."""
    prepared, changed, replaced, input_scale = None, {}, {}, None
    if preparer is not None:
        rule = run.settings.hessian_rule
        choose = functools.partial(_chosen_statistics, collected, rule=rule)
        prepared = preparer.prepare_layer(
            LayerToPrepare(
                preparer.name,
                run.adapter,
                run.ckpt,
                L,
                expert_rows,
                weights,
                collected,
                choose,
                tokens,
                rule,
                run.settings.device,
            )
        )
        input_scale, replaced, changed = prepared.input_scale, dict(prepared.replaced), prepared.changed
    quantized, report, experts_dq = _quantize_experts(
        run.adapter,
        L,
        mine,
        collected,
        run.settings.hessian_rule,
        run.settings.device,
        weights=weights,
        input_scale=input_scale,
        first_expert=run.own.start if run.own is not None else 0,
        options=run.settings.algorithm_options,
        store=run.export.store if run.export is not None else None,
    )
    # experts the folds changed but the plan keeps in full precision: written as folded
    planned = {(t.expert, t.proj) for t in mine if t.quantized}
    for proj, mask in changed.items():
        for e in mask.nonzero().flatten().tolist():
            if (e, proj) not in planned:
                name = run.adapter.expert_tensor_name(L, e, proj)
                replaced[name] = weights[proj][e]
    return quantized, report, experts_dq, replaced, prepared
