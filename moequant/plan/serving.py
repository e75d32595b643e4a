"""What the serving target lets the planner do with routed experts: the groups that share one format
(routed_groups, by the target's unit), the budget solve over every unit the target offers (solve_for_target:
SGLang, say, takes one format per layer for some formats and one for the model otherwise; the better plan
wins) and the check that a rules / uniform plan gives each unit one format (check_uniform_groups). The
targets themselves, with their kernel facts, are moequant.targets; nothing here names one.

Routed experts are decided per expert (one format for an expert's gate, up and down) within the target's
unit: each expert on its own, one format per (layer, projection) (GGUF), per layer (vLLM's fused MoE) or
for the whole model.
"""

from __future__ import annotations

from collections import defaultdict

from moequant.errors import UserError
from moequant.plan.context import PlanContext, predicted_loss
from moequant.plan.model import PROJECTIONS
from moequant.plan.options import solve_groups
from moequant.targets import get_target


def expert_names(ctx: PlanContext) -> set[str]:
    """The on-disk names of the routed expert tensors (a target's unit may depend on them)."""
    return {t.name for ts in ctx.experts.values() for t in ts}


def routed_groups(ctx: PlanContext, unit: str, free: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """The groups of `free` experts that share one format in `unit` (moequant.targets.UNITS)."""
    if unit == "expert":
        return [[e] for e in free]
    if unit == "layer_proj":  # one group per (layer, projection), of (layer, expert, proj) items; per on-disk
        # tensor where one holds several projections (gpt-oss's fused gate_up: one format on disk)
        by_proj: dict[tuple, list] = defaultdict(list)
        items = [(L, e, t) for L, e in free for t in ctx.experts[(L, e)]]
        holds = defaultdict(set)
        for _, _, t in items:
            holds[t.name].add(t.proj)
        for L, e, t in items:
            key = (L, t.name) if len(holds[t.name]) > 1 else (L, PROJECTIONS.index(t.proj))
            by_proj[key].append((L, e, t.proj))
        return [by_proj[k] for k in sorted(by_proj, key=lambda k: (k[0], str(k[1])))]
    if unit == "layer":
        by_layer: dict[int, list] = defaultdict(list)
        for e in free:
            by_layer[e[0]].append(e)
        return [by_layer[L] for L in sorted(by_layer)]
    return [list(free)] if free else []


def solve_for_target(ctx: PlanContext, target, free, specs, limit: int, notes, extra=None) -> tuple[dict, int] | None:
    """Budget solve for one target: over the groups of each unit it offers (with the formats it allows
    there), the plan of least predicted loss."""
    best, why_not_finer = None, []
    for i, (unit, allowed) in enumerate(get_target(target).units(specs, expert_names(ctx), why_not_finer)):
        if not allowed:
            continue
        solved = solve_groups(ctx, routed_groups(ctx, unit, free), allowed, limit, notes if i == 0 else None, extra)
        if solved is not None and (best is None or predicted_loss(ctx, solved[0]) <= predicted_loss(ctx, best[0])):
            best = solved
    if notes is not None:
        notes.extend(why_not_finer)
    return best


def check_uniform_groups(ctx: PlanContext, target, assignment: dict) -> None:
    target = get_target(target)
    unit = target.unit_of(set(assignment.values()), expert_names(ctx))
    if unit == "expert":
        return
    keys = defaultdict(lambda: defaultdict(list))
    for (layer, expert), spec in sorted(assignment.items()):
        keys[layer if unit in ("layer", "layer_proj") else "all"][spec.key].append(expert)
    for scope, by_key in keys.items():
        if len(by_key) > 1:
            where = f"layer {scope}" if unit in ("layer", "layer_proj") else "the model"
            parts = "; ".join(f"{k} (experts {_short_list(v)})" for k, v in by_key.items())
            raise UserError(
                f"with target {target} every routed expert of {where} needs one format, but "
                f"experts.rules give {where} {parts}; accepted: rules by layers only, or target transformers."
            )


def _short_list(values: list[int]) -> str:
    return ", ".join(map(str, values[:6])) + (", ..." if len(values) > 6 else "")
