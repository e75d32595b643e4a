"""Which experts to drop: the recipe's `experts.prune` checked against the model's shapes, and the choice per layer.

Engines take one expert count per model, so the same number of experts is dropped from every MoE layer, each
layer choosing its own (the lowest saliency, moequant.measure.saliency). A count that leaves fewer experts than
the router's top-k is refused, and so is one that breaks grouped routing (DeepSeek's `n_group`): its groups stay
equal, either by dropping the same number from every group (each keeping at least 2, as DeepSeek-V3's group
score sums a group's best two) or, where that cannot be, by dropping whole groups (the group score of a dropped
group is then never chosen, so the smaller model's groups route as the original's did among the rest).

`prune_layout(prune, adapter)` says how (count, mode), before any calibration; `choose_drops` picks the experts
from the statistics. Both are plain functions over plain data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moequant.errors import UserError
from moequant.measure.saliency import saliency

MIN_PER_GROUP = 2  # DeepSeek-V3's group score is the sum of a group's two best experts


@dataclass(frozen=True)
class PruneLayout:
    """How many experts each MoE layer drops, and how grouped routing stays equal."""

    count: int  # experts dropped from every MoE layer
    experts: int  # experts before
    groups: int = 1  # the router's groups (n_group), 1 without grouped routing
    mode: str = "any"  # any | per_group (count / groups from every group) | whole_groups (count / group size groups)
    topk_groups: int = 1  # groups each token may use after pruning (whole_groups: at most the groups left)

    @property
    def kept(self) -> int:
        return self.experts - self.count


def prune_layout(prune, adapter, where: str = "experts.prune") -> PruneLayout:
    """The recipe's prune settings (plan.recipe.Prune) against the model (an Adapter); one UserError sentence
    for a count the model cannot take."""
    E, k = adapter.num_experts, adapter.top_k
    count = prune.experts if prune.experts is not None else round(prune.fraction * E)
    given = f"{where}.experts {prune.experts}" if prune.experts is not None else f"{where}.fraction {prune.fraction:g}"
    if count < 1:
        raise UserError(f"{given} drops no expert of the {E} per layer; accepted: a count of at least 1.")
    if E - count < k:
        raise UserError(
            f"{given} leaves {E - count} of {E} experts per layer, fewer than the router's top-k ({k}); "
            f"accepted: at most {E - k} experts dropped."
        )
    routing = adapter.routing
    groups, topk_groups = routing.groups, routing.topk_groups
    if groups <= 1:
        return PruneLayout(count, E)
    size = E // groups
    if count % groups == 0 and size - count // groups >= MIN_PER_GROUP:
        return PruneLayout(count, E, groups, "per_group", topk_groups)
    left = groups - count // size
    if count % size == 0 and left >= 1 and k <= min(topk_groups, left) * size:
        return PruneLayout(count, E, groups, "whole_groups", min(topk_groups, left))
    raise UserError(
        f"{given} breaks the router's {groups} expert groups of {size} (n_group): accepted: a multiple of {groups} "
        f"leaving at least {MIN_PER_GROUP} experts per group, or a multiple of {size} (whole groups) leaving "
        f"enough experts for the top-{k} choice."
    )


def choose_drops(layer_stats: dict, layout: PruneLayout, criterion: str) -> dict[int, list[int]]:
    """{MoE layer: the experts it drops, ascending} from each layer's statistics tensors (LayerStats.tensors),
    the lowest `criterion` saliency first (ties: the higher expert number goes first, so the choice is stable)."""
    drops = {}
    for L, tensors in sorted(layer_stats.items()):
        score = saliency(tensors, criterion)
        if score.numel() != layout.experts:
            raise UserError(
                f"the statistics of layer {L} hold {score.numel()} experts, the model {layout.experts}; "
                "calibrate this model again."
            )
        drops[L] = sorted(_lowest(score, layout))
    return drops


def _lowest(score: torch.Tensor, layout: PruneLayout) -> list[int]:
    E = layout.experts
    # order by (score, -index): among equal scores the later expert is dropped first
    order = sorted(range(E), key=lambda e: (float(score[e]), -e))
    if layout.mode == "any":
        return order[: layout.count]
    size = E // layout.groups
    if layout.mode == "per_group":
        per = layout.count // layout.groups
        return [e for g in range(layout.groups) for e in [x for x in order if x // size == g][:per]]
    group_score = [float(score[g * size : (g + 1) * size].sum()) for g in range(layout.groups)]
    dropped = sorted(range(layout.groups), key=lambda g: (group_score[g], -g))[: layout.count // size]
    return [e for g in dropped for e in range(g * size, (g + 1) * size)]


def kept_experts(drops: dict[int, list[int]], experts: int) -> dict[int, list[int]]:
    """{layer: the experts it keeps, in their original order} (new expert i = the i-th kept one)."""
    return {L: [e for e in range(experts) if e not in set(d)] for L, d in drops.items()}


def routing_mass(layer_stats: dict, drops: dict[int, list[int]]) -> dict[int, float]:
    """{layer: the share of the calibration workload's top-k choices that went to its dropped experts}."""
    out = {}
    for L, dropped in drops.items():
        count = layer_stats[L]["routing.count"].double()
        out[L] = float(count[dropped].sum() / count.sum().clamp_min(1))
    return out
