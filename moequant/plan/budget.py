"""experts.method budget: the candidates a target can serve, the byte limit, the sentence for an infeasible
budget, the non-expert tensors a budget may move (non_experts.formats) and the solve
(budget_assignment); also the budget plan a summary compares against (alternative_budget_plan).

`experts.budget.bits_per_weight` counts only routed-expert weight matrices: their bytes (codes,
scales, zero points, from `formats.nbytes`) * 8 / their element count, so it reads like the
usual "4.25 bits" of an int4 model and does not depend on how much of the model is attention.
`experts.budget.gigabytes` counts the whole model (10^9 bytes): every tensor of the plan, kept
ones included as the export layout writes them (bf16; GGUF: F32 norms, biases and routers, the
rest in export.gguf_float, and the output.weight copy of tied embeddings; see context._layout_for);
the routed experts get what the others leave. The solver minimises the
predicted loss subject to the byte limit exactly (bytes in Python integers, the decimal budget
read exactly): a multiple-choice knapsack, solved by LP relaxation, reduced-cost fixing and a
dynamic program over the few groups left open (see `solve_choices`; a DeepSeek-V3-sized
per-expert problem, 14848 experts x 5 formats, takes seconds, where HiGHS' MILP had not closed
its gap after 120 s). A budget below the smallest feasible plan fails with a sentence giving
that minimum; a budget exactly at it is feasible.
"""

from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction

from moequant.errors import UserError
from moequant.plan.context import PlanContext, predicted_loss
from moequant.plan.model import NON_EXPERT_ROLES, PROJECTIONS, TensorPlan, spec_params
from moequant.plan.options import dedupe_specs, group_options, layer_text, option_table
from moequant.plan.recipe import Recipe, resolve_format
from moequant.plan.serving import routed_groups, solve_for_target
from moequant.targets import get_target


def _budget_candidates(recipe: Recipe) -> tuple[list, dict[str, str]]:
    """experts.formats the target can serve, and {format key: why} of those it cannot."""
    target = get_target(recipe.target)
    dropped: dict[str, str] = {}
    specs = []
    for spec in dedupe_specs(resolve_format(recipe, f) for f in recipe.experts.formats):
        why = target.check(spec, routed=True)
        if why:
            dropped[spec.key] = why
        else:
            specs.append(spec)
    if not specs:
        raise UserError(
            f"experts.formats offers no format that target {target} can serve "
            f"({'; '.join(f'{k}: {v}' for k, v in dropped.items())}); accepted: {target.routed_formats}."
        )
    return specs, dropped


def _budget_limit(recipe: Recipe, routed_numel: int, other_bytes: int, fixed_routed: int) -> int:
    """Bytes the decided routed experts may use (may be negative: infeasible)."""
    budget = recipe.experts.budget
    if budget.bits_per_weight is not None:
        return math.floor(Fraction(str(budget.bits_per_weight)) * routed_numel / 8) - fixed_routed
    return math.floor(Fraction(str(budget.gigabytes)) * 10**9) - other_bytes - fixed_routed


def _infeasible_budget(
    recipe: Recipe, min_group_bytes: int, routed_numel: int, other_bytes: int, fixed_routed: int, candidates: list[str]
) -> UserError:
    budget = recipe.experts.budget
    if budget.bits_per_weight is not None:
        minimum = Fraction((min_group_bytes + fixed_routed) * 8, routed_numel)
        shown = math.ceil(minimum * 10**4) / 10**4
        return UserError(
            f"experts.budget.bits_per_weight {budget.bits_per_weight} is below the smallest feasible plan for "
            f"target {recipe.target} with candidates {', '.join(candidates)}: {shown:.4f} bits per routed-expert "
            f"weight; accepted: bits_per_weight >= {shown:.4f}."
        )
    minimum_bytes = min_group_bytes + fixed_routed + other_bytes
    shown = math.ceil(minimum_bytes / 10**3) / 10**6
    return UserError(
        f"experts.budget.gigabytes {budget.gigabytes} is below the smallest feasible plan for target "
        f"{recipe.target} with candidates {', '.join(candidates)}: {minimum_bytes} bytes for the whole model; "
        f"accepted: gigabytes >= {shown:.6f}."
    )


def _non_expert_options(ctx: PlanContext, recipe: Recipe, plans: list, reference, shapes_only: bool) -> dict:
    """{tensor name: [(spec, bytes, measured KL)]} of the non-expert tensors planned in `reference`
    (non_experts.format) that the budget may move to one of non_experts.formats."""
    if recipe.experts.method != "budget" or not recipe.non_experts.formats or not reference.quantized:
        return {}
    target = get_target(recipe.target)
    if not target.non_expert_choice:
        raise UserError(
            f"non_experts.formats (a per-tensor choice) is not offered for target {target}; use non_experts.format."
        )
    specs = []
    for spec in dedupe_specs(
        resolve_format(recipe, f) for f in [recipe.non_experts.format, *recipe.non_experts.formats]
    ):
        why = target.check(spec, routed=False)
        if why and spec.quantized:
            raise UserError(f"non_experts.formats offers {spec.key}, which target {recipe.target} cannot serve: {why}.")
        specs.append(spec)
    measured = None if shapes_only else (getattr(ctx.stats, "tensor_probe", None) or {}).get("tensors")
    out = {}
    for p in plans:
        if p.kept is not None or p.format != reference.key or p.role not in NON_EXPERT_ROLES:
            continue
        options = []
        for spec in specs:
            try:
                nbytes = ctx.nbytes(spec, p)
            except UserError:
                continue  # cannot hold this tensor: not offered
            loss = 0.0
            if spec.quantized and not shapes_only:
                kl = (measured or {}).get(p.name, {}).get(spec.key)
                if kl is None:
                    raise UserError(
                        f"the calibration statistics hold no per-tensor KL of {p.name} in {spec.key} "
                        f"(non_experts.formats); rerun `moequant calibrate --recipe` with this recipe."
                    )
                loss = float(kl)
            options.append((spec, nbytes, loss))
        out[p.name] = options
    return out


def _min_bytes(ctx: PlanContext, target: str, free, specs) -> int:
    groups = routed_groups(ctx, get_target(target).granularity, free)
    return sum(min(o[1] for o in group_options(ctx, g, specs, None)) for g in groups)


def budget_assignment(
    ctx: PlanContext,
    recipe: Recipe,
    plans: list[TensorPlan],
    non_expert_spec,
    free,
    sizes: tuple[int, int, int],
    shapes_only: bool,
    notes: list[str],
):
    """experts.method budget: (expert -> spec, candidates, dropped candidates, the plan's budget), with
    the non-expert tensors of non_experts.formats moved to their chosen formats in `plans`. With
    shapes_only None, once the smallest plan is known to fit. sizes: _byte_sizes."""
    target = recipe.target
    if ctx.stats is None and not shapes_only:
        raise UserError(
            "experts.method budget needs calibration statistics (routing and sensitivity); "
            "run `moequant calibrate` first and pass its statistics."
        )
    specs, dropped = _budget_candidates(recipe)
    limit = _budget_limit(recipe, *sizes)
    flexible = _non_expert_options(ctx, recipe, plans, non_expert_spec, shapes_only)
    flex_bytes = sum(p.bytes for p in plans if p.name in flexible)
    limit += flex_bytes  # the budget counts them at non_experts.format; the solve may move bytes
    if shapes_only:  # feasibility is the smallest option of every group against the limit
        groups = routed_groups(ctx, get_target(target).granularity, free)
        table = option_table(ctx, groups, specs, notes) + list(flexible.values())
        minimum = sum(min(o[1] for o in options) for options in table)
        notes.extend(_unfit_notes(ctx))
        if minimum > limit:  # shown per routed weight, the flexible tensors counted at non_experts.format
            raise _infeasible_budget(recipe, minimum - flex_bytes, *sizes, [s.key for s in specs])
        return None
    if not (free or flexible):
        solved = ({}, 0)
    else:
        solved = solve_for_target(ctx, target, free, specs, limit, notes, extra=flexible)
    notes.extend(_unfit_notes(ctx))
    if solved is None:
        raise _infeasible_budget(recipe, _min_bytes(ctx, target, free, specs), *sizes, [s.key for s in specs])
    assignment, _ = solved
    _set_non_expert_choices(recipe, plans, flexible, assignment)
    budget_info = {
        "bits_per_weight": recipe.experts.budget.bits_per_weight,
        "gigabytes": recipe.experts.budget.gigabytes,
        "routed_bytes_limit": limit + sizes[2],
    }
    return assignment, specs, dropped, budget_info


def _unfit_notes(ctx: PlanContext) -> list[str]:
    """One note per set of layers and projections that some candidates cannot hold: the candidates, where, and
    the first one's reason (five K types refused by one narrow down_proj are one note, not five)."""
    where: dict[tuple, list[tuple[str, str]]] = {}
    for key, (layers, projs, why) in ctx.unfit.items():
        where.setdefault((tuple(sorted(layers)), tuple(p for p in PROJECTIONS if p in projs)), []).append((key, why))
    notes = []
    for (layers, projs), refused in where.items():
        which = f"{', '.join(f'{p}_proj' for p in projs)} of " if projs else ""
        keys = [key for key, _ in refused]
        named = keys[0] + " is" if len(keys) == 1 else f"{', '.join(keys[:-1])} and {keys[-1]} are"
        notes.append(f"{named} not offered to {which}layer(s) {layer_text([(L, 0) for L in layers])}: {refused[0][1]}.")
    return notes


def _set_non_expert_choices(recipe: Recipe, plans: list[TensorPlan], flexible: dict, assignment: dict) -> None:
    """Move the solved non-expert tensors (popped from `assignment`) to their chosen formats, with their measured KL."""
    for p in plans:
        if p.name in flexible:
            spec = assignment.pop(p.name)
            p.format, p.params, p.algorithm = spec.key, spec_params(spec), recipe.algorithm_for(spec.name)
            p.bytes = next(b for s_, b, _ in flexible[p.name] if s_.key == spec.key)
            p.predicted_loss = next(loss for s_, _, loss in flexible[p.name] if s_.key == spec.key)
            p.kept = None if spec.quantized else "non_experts.formats"


def alternative_budget_plan(ctx: PlanContext, target: str, free, entries, limit: int, fixed_bytes: int) -> dict | None:
    """The budget plan for `target` over `entries` (servable, with sensitivities) within `limit`."""
    specs = []
    for spec in dedupe_specs(resolve_format(ctx.recipe, f) for f in entries):
        if get_target(target).check(spec, routed=True):
            continue
        try:
            for e in free:
                ctx.expert_loss(e, spec.key)
        except UserError:
            continue
        specs.append(spec)
    try:
        solved = solve_for_target(ctx, target, free, specs, limit, None) if specs else None
    except UserError:
        return None
    if solved is None:
        return None
    assignment, used = solved
    return {
        "predicted_loss": predicted_loss(ctx, assignment),  # kept experts are bf16: loss 0
        "routed_bytes": used + fixed_bytes,
        "candidates": [s.key for s in specs],
        "counts": dict(Counter(s.key for s in assignment.values())),
    }
