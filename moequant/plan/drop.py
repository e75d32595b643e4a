"""Drop as a precision in the budget (issue 58, recipe `experts.prune: {by: budget}`): one memory budget spent over
drop / the recipe's formats across layers.

Engines take one expert count per model, so the choice is the count d dropped from every MoE layer (each layer
choosing which, DeepSeek's groups kept equal: moequant.plan.prune) and then the formats of the experts left. For
every count the model can take (d = 0 .. E - top_k, those prune_layout accepts), each layer drops its d experts
of least measured drop loss (moequant.measure.drop_probe: KL of dropping that expert alone), and the ordinary budget
solve (plan.serving.solve_for_target, the exact knapsack) spends the byte limit on the experts left, a dropped
expert costing 0 bytes. The plan of least total loss wins:

    loss(d) = drop loss(d) + the predicted KL of the kept experts' formats

drop loss(d) is measured: the KL of the model with that count's experts dropped from every layer at once (`apply`
measures one stream per count, moequant.measure.drop_probe.run_drop_sets); without that measurement, the sum of the
dropped experts' single-drop KLs, which is first order (on tiny-qwen3moe, mix, 4 x 48 probe tokens, two
experts per layer: 0.242 measured at once, 0.236 summed). Which experts a count drops follows the single-drop KLs.

Both terms are KL on the calibration workload's held-out windows only when the quantization losses are scaled by
the per-layer KL probe (plan.context), so a budget that may drop needs that probe; the two terms add (first order,
as the probe's layers do). Ties go to fewer drops. The byte limit is the recipe's budget read against
the unpruned model (bits_per_weight: per routed weight of all E experts), so "0.8x int4's bytes" means the same
bytes with or without dropping.

`drop_budget` returns plain data; `apply`'s prune stage writes the smaller model it chooses and the rest of the run
plans that model at the same byte limit (`pruned_recipe`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from moequant.errors import UserError
from moequant.plan.budget import _budget_candidates, _budget_limit, _infeasible_budget
from moequant.plan.context import PlanContext, as_tensor_infos, predicted_loss, tensors_from_checkpoint
from moequant.plan.options import group_options
from moequant.plan.prune import PruneLayout, _lowest, prune_layout
from moequant.plan.recipe import Prune, Recipe, resolve_format
from moequant.plan.serving import routed_groups, solve_for_target
from moequant.targets import get_target


@dataclass
class DropChoice:
    """The budget's choice: d experts dropped per layer (layout None: none), which, and what each count cost."""

    layout: PruneLayout | None
    drops: dict[int, list[int]]
    drop_loss: float  # summed drop KL of the dropped experts
    quant_loss: float  # predicted KL of the kept experts' formats
    routed_bytes: int  # of the kept routed experts (kept-bf16 experts included)
    counts: list[dict] = field(default_factory=list)  # per count tried: count, loss / bytes, or why not


def drop_layouts(adapter) -> list[PruneLayout | None]:
    """Every count the model can drop from all its MoE layers: None (no drop), then the accepted layouts."""
    out: list[PruneLayout | None] = [None]
    for d in range(1, adapter.num_experts - adapter.top_k + 1):
        try:
            out.append(prune_layout(Prune(experts=d), adapter))
        except UserError:
            continue  # breaks the groups: not a count this model takes
    return out


def choose_by_loss(drop_kl: dict[int, np.ndarray], layout: PruneLayout | None, never: set) -> dict[int, list[int]]:
    """{layer: the experts it drops}: the least drop KL first (groups as `layout` says); `never` (layer, expert)
    pairs (kept bf16 by the recipe) are dropped last."""
    if layout is None:
        return {L: [] for L in drop_kl}
    out = {}
    for L, kl in drop_kl.items():
        score = np.array([math.inf if (L, e) in never else float(v) for e, v in enumerate(kl)])
        out[L] = sorted(_lowest(score, layout))
    return out


def drop_budget(
    recipe: Recipe,
    model,
    stats,
    drop_kl: dict[int, np.ndarray] | None,
    layouts: list,
    shapes_only: bool = False,
    measure=None,
):
    """The budget's choice over drop and formats (DropChoice). model: an open checkpoint or a tensor list (as
    make_plan takes); stats: loaded, with the KL probe; drop_kl: {MoE layer: [E] KL of dropping each expert};
    layouts: the counts to try (drop_layouts). measure: optional, {count: {layer: experts}} -> {count: KL of the
    model with all those experts dropped at once}, which then replaces the summed single-expert KLs as each count's
    drop loss (the sum underestimates it where drops interact). shapes_only (stats and drop_kl None): refuse a
    budget that no count can meet, in one sentence, and return None."""
    from moequant.plan.policy import _byte_sizes, _non_expert_plans
    from moequant.plan.rules import kept_routed_experts

    if recipe.non_experts.formats:
        raise UserError(
            "experts.prune by: budget does not yet solve non_experts.formats in the same budget; "
            "give non_experts.format alone."
        )
    base = recipe.model_copy(update={"experts": recipe.experts.model_copy(update={"prune": None})})
    if hasattr(model, "keys") and hasattr(model, "shape"):
        tensors, config, adapter = tensors_from_checkpoint(model), model.config, model.adapter
    else:
        tensors, config, adapter = as_tensor_infos(model), None, None
    ctx = PlanContext(base, tensors, stats, config, adapter)
    if not shapes_only and not ctx.layer_scale:
        raise UserError(
            "experts.prune by: budget weighs dropping (measured KL) against quantizing, which needs the "
            f"calibration's per-layer KL probe ({ctx.probe_info['why']}); set calibration.probe_samples above 0."
        )
    plans = _non_expert_plans(ctx, base, tensors, resolve_format(base, base.non_experts.format))
    kept = kept_routed_experts(base, tensors)
    sizes = _byte_sizes(ctx, plans, kept)
    specs, _ = _budget_candidates(base)
    limit = _budget_limit(base, *sizes)
    free = [e for e in sorted(ctx.experts) if e not in kept]
    unit = get_target(base.target).granularity
    layers = sorted({L for L, _ in ctx.experts})
    shapes_kl = {L: np.zeros(ctx.num_experts[L]) for L in layers}  # which experts a count drops: bytes alike
    counts, solved, smallest = [], {}, None
    for layout in layouts:
        drops = choose_by_loss(drop_kl if drop_kl is not None else shapes_kl, layout, set(kept))
        gone = {(L, e) for L, d in drops.items() for e in d}
        left = [e for e in free if e not in gone]
        count = 0 if layout is None else layout.count
        minimum = sum(min(o[1] for o in group_options(ctx, g, specs, None)) for g in routed_groups(ctx, unit, left))
        smallest = minimum if smallest is None else min(smallest, minimum)
        fits = minimum <= limit and (shapes_only or solve_for_target(ctx, base.target, left, specs, limit, None))
        counts.append({"count": count, "fits": bool(fits)})
        if fits and not shapes_only:
            solved[count] = (layout, drops, gone, fits)
    if not any(c["fits"] for c in counts):
        raise _infeasible_budget(base, smallest, *sizes, [s.key for s in specs])
    if shapes_only:
        return None
    joint = measure({c: v[1] for c, v in solved.items() if c > 0}) if measure is not None else {}
    best = None
    for row in counts:
        if not row["fits"]:
            continue
        layout, drops, gone, (assignment, used) = solved[row["count"]]
        summed = sum(float(drop_kl[L][e]) for L, e in gone)
        lost = float(joint[row["count"]]) if row["count"] in joint else summed
        quant = predicted_loss(ctx, assignment)
        row.update(drop_loss=lost, drop_loss_summed=summed, quant_loss=quant, routed_bytes=used)
        if best is None or lost + quant < best.drop_loss + best.quant_loss:  # ties: the fewer drops, tried first
            best = DropChoice(layout, {L: d for L, d in drops.items()}, lost, quant, used + sizes[2])
    best.counts = counts
    return best


def pruned_recipe(recipe: Recipe, layout: PruneLayout | None) -> Recipe:
    """The recipe the rest of the run plans the smaller model with: no prune, and the same byte limit (a
    bits_per_weight budget counts the E experts of the unpruned model: per kept routed weight it is E / kept
    times as many bits, floored to 1e-9 so the limit never grows)."""
    experts = recipe.experts.model_copy(update={"prune": None})
    budget = recipe.experts.budget
    if layout is not None and budget.bits_per_weight is not None:
        bits = Fraction(str(budget.bits_per_weight)) * layout.experts / layout.kept
        experts = experts.model_copy(
            update={"budget": budget.model_copy(update={"bits_per_weight": math.floor(bits * 10**9) / 10**9})}
        )
    return recipe.model_copy(update={"experts": experts})
