"""The policy engine: recipe + calibration statistics -> one format per tensor (plan.json).

make_plan builds a plan, check_plan refuses before calibration what shapes alone decide; both start from
plan_shapes' PlanShapes, which the precheck makes once and the plan stage reuses. By concern,
beside it in moequant.plan: the planning context and the statistics readers with the predicted loss
(context), what each serving target allows (serving), keep / rules / uniform (rules), the budget
(budget, over the option tables of options and the knapsack of solver), the summary dict and its text
(summary), the frontier of several budgets (frontier), the plan's data and plan.json's layout (model)
and its I/O (plan_io).
"""

from __future__ import annotations

import dataclasses

from moequant.errors import UserError
from moequant.plan.budget import budget_assignment
from moequant.plan.context import PlanContext, as_tensor_infos, loaded_stats, tensors_from_checkpoint
from moequant.plan.model import Plan, TensorInfo, TensorPlan, _formats, spec_params
from moequant.plan.options import dedupe_specs
from moequant.plan.recipe import Recipe, recipe_to_dict, resolve_format
from moequant.plan.rules import check_kept_experts, kept_routed_experts, non_expert_kept_reason, rules_assignment
from moequant.plan.summary import plan_summary
from moequant.targets import get_target


def make_plan(recipe: Recipe, checkpoint_or_tensors, stats=None, shapes: PlanShapes | None = None) -> Plan:
    """Decide a format for every tensor.

    checkpoint_or_tensors: an open checkpoint (its adapter classifies the tensors), or a list of
    TensorInfo / (name, role, layer, expert, proj, shape) tuples. stats: a loaded statistics
    object, a statistics directory, or None (allowed for uniform plans and layer-only rules).
    shapes: check_plan's PlanShapes of this recipe and model, reused instead of made again.
    """
    if shapes is None or shapes.recipe is not recipe:
        shapes = plan_shapes(recipe, checkpoint_or_tensors)
    return _make_plan(recipe, shapes, loaded_stats(stats), shapes_only=False)


def check_plan(recipe: Recipe, checkpoint_or_tensors, shapes: PlanShapes | None = None) -> list[str]:
    """Refuse, before any calibration, what the recipe and the tensor shapes alone decide: an
    infeasible budget (the smallest plan is known from shapes), a format that cannot hold a tensor,
    a format the target cannot serve, keep entries the target cannot serve. Returns the plan's notes
    (e.g. a candidate not offered to some layers, and why). Reads no weights or statistics. shapes: the
    recipe's PlanShapes when the caller keeps them for make_plan (plan_shapes)."""
    return _make_plan(recipe, shapes or plan_shapes(recipe, checkpoint_or_tensors), None, shapes_only=True)


@dataclasses.dataclass
class PlanShapes:
    """What a plan takes from the recipe and the tensors' shapes alone, made once: the precheck's shape checks
    and the plan stage's plan both start from it (the context's byte lookups too)."""

    recipe: Recipe
    tensors: list[TensorInfo]
    ctx: PlanContext  # without statistics until the plan stage attaches them
    non_expert_spec: object
    plans: list[TensorPlan]  # the non-routed tensors' plans at non_experts.format (the plan takes copies)
    kept_experts: dict
    notes: list[str]  # what checking the kept experts said


def plan_shapes(recipe: Recipe, checkpoint_or_tensors) -> PlanShapes:
    """The shape part of a plan (PlanShapes): tensors, their context, the non-routed tensors' plans, the kept
    experts. Refuses a model without routed experts and keep entries the target cannot serve."""
    config = adapter = None
    if hasattr(checkpoint_or_tensors, "keys") and hasattr(checkpoint_or_tensors, "shape"):
        tensors = tensors_from_checkpoint(checkpoint_or_tensors)
        config, adapter = checkpoint_or_tensors.config, checkpoint_or_tensors.adapter
    else:
        tensors = as_tensor_infos(checkpoint_or_tensors)
    ctx = PlanContext(recipe, tensors, None, config, adapter)
    if not ctx.experts:
        raise UserError(f"model {recipe.model} has no routed expert weights for moequant to plan.")
    non_expert_spec = resolve_format(recipe, recipe.non_experts.format)
    plans = _non_expert_plans(ctx, recipe, tensors, non_expert_spec)
    kept_experts = kept_routed_experts(recipe, tensors)
    notes: list[str] = []
    check_kept_experts(ctx, recipe, kept_experts, notes)
    return PlanShapes(recipe, tensors, ctx, non_expert_spec, plans, kept_experts, notes)


def _make_plan(recipe: Recipe, shapes: PlanShapes, stats, shapes_only: bool):
    """make_plan from the shape part, or with shapes_only the checks of check_plan (its notes returned, no plan)."""
    ctx = shapes.ctx
    ctx.use_stats(stats)
    tensors, non_expert_spec, kept_experts = shapes.tensors, shapes.non_expert_spec, shapes.kept_experts
    target = recipe.target
    notes = list(shapes.notes)
    plans = [dataclasses.replace(p) for p in shapes.plans]  # the budget may move some to other formats
    free = [e for e in sorted(ctx.experts) if e not in kept_experts]
    sizes = _byte_sizes(ctx, plans, kept_experts)

    # Routed experts.
    method = recipe.experts.method
    dropped: dict[str, str] = {}
    budget_info = None
    if method == "budget":
        solved = budget_assignment(ctx, recipe, plans, non_expert_spec, free, sizes, shapes_only, notes)
        if solved is None:  # shapes_only: the smallest plan fits the budget
            return notes
        assignment, specs, dropped, budget_info = solved
    else:
        assignment = rules_assignment(ctx, recipe, free, shapes_only)
        specs = dedupe_specs(assignment.values())
    _check_expert_bytes(ctx, assignment)
    if shapes_only:
        return notes

    bf16 = _formats().get_format("bf16")
    for e in kept_experts:
        assignment[e] = bf16
    plans += _routed_plans(ctx, recipe, tensors, assignment, kept_experts)
    used_specs = dedupe_specs([*specs, *assignment.values()])
    plan = Plan(
        model=recipe.model,
        target=target,
        method=method,
        budget=budget_info,
        candidates=[s.key for s in specs],
        dropped_candidates=dropped,
        usage_floor=recipe.experts.usage_floor,
        formats={
            s.key: {"name": s.name, "params": spec_params(s), "algorithm": recipe.algorithm_for(s.name)}
            for s in used_specs
        },
        tensors=plans,
        notes=notes,
        recipe=recipe_to_dict(recipe),
    )
    plan.summary = plan_summary(plan, ctx, free, budget_info)
    return plan


def _non_expert_plans(ctx: PlanContext, recipe: Recipe, tensors: list[TensorInfo], non_expert_spec) -> list[TensorPlan]:
    """The plans of every tensor but the routed experts: non_experts.format, or bf16 with the reason."""
    reason = get_target(recipe.target).check(non_expert_spec, routed=False)
    if reason and non_expert_spec.quantized:
        raise UserError(
            f"non_experts.format {non_expert_spec.key} cannot be served by target {recipe.target}: "
            f"{reason}; accepted: bf16, fp8, int8, int4 (symmetric or not), mxfp4, nvfp4."
        )
    bf16 = _formats().get_format("bf16")
    plans: list[TensorPlan] = []
    for t in tensors:
        if t.is_routed_weight:
            continue
        why = non_expert_kept_reason(recipe, t) or ctx.layout_kept.get(t.name)
        spec = bf16 if why else non_expert_spec
        if not spec.quantized and not why:
            why = "non_experts.format is bf16"
        try:
            nbytes = ctx.nbytes(spec, t)
        except UserError as error:  # a kept tensor: the type the export layout stores it in (GGUF's gguf_output)
            where = f"non_experts.format {spec.key}" if spec.quantized else f"export.format {recipe.export.format}"
            raise UserError(f"{where} cannot hold tensor {t.name}: {str(error).rstrip('.')}.") from None
        plans.append(_row(t, spec, recipe, nbytes, kept=None if spec.quantized else why))
    plans += _copied_tensors(ctx, tensors)
    return plans


def _copied_tensors(ctx: PlanContext, tensors: list[TensorInfo]) -> list[TensorPlan]:
    """Kept entries for the tensors the export layout adds (GGUF: output.weight, a copy of tied
    embeddings; Gemma-4's rope_freqs, made from the config), so the plan's bytes and a gigabytes budget count them."""
    by_name = {t.name: t for t in tensors}
    bf16 = _formats().get_format("bf16")
    out = []
    for name, role, source in ctx.layout_copies:
        t = dataclasses.replace(by_name[source], name=name, role=role)
        kept = f"the {ctx.layout.name} export writes {source} again as {name}"
        out.append(_row(t, bf16, ctx.recipe, ctx.nbytes(bf16, t), kept=kept))
    for name, role, shape, nbytes in ctx.layout_added:
        t = TensorInfo(name, role, None, None, None, shape)
        out.append(_row(t, bf16, ctx.recipe, nbytes, kept=f"the {ctx.layout.name} export adds {name}"))
    return out


def _byte_sizes(ctx: PlanContext, plans: list[TensorPlan], kept_experts: dict) -> tuple[int, int, int]:
    """(routed_numel, other_bytes, fixed_routed): the routed experts' element count, the bytes of the
    non-routed tensors as planned, the bytes of the kept experts in bf16 (what a budget counts)."""
    bf16 = _formats().get_format("bf16")
    other_bytes = sum(p.bytes for p in plans)
    routed_numel = sum(t.numel for ts in ctx.experts.values() for t in ts)
    fixed_routed = sum(ctx.expert_bytes(e, bf16) for e in kept_experts)
    return routed_numel, other_bytes, fixed_routed


def _check_expert_bytes(ctx: PlanContext, assignment: dict) -> None:
    """Refuse a format that cannot hold an expert (or an expert's projection) it was given."""
    for key, spec in assignment.items():
        try:
            ctx.expert_bytes(key, spec)
        except UserError as error:
            what = f"layer {key[0]} expert {key[1]}" + (f" ({key[2]})" if len(key) == 3 else "")
            raise UserError(f"format {spec.key} cannot hold {what}: {str(error).rstrip('.')}.") from None


def _routed_plans(
    ctx: PlanContext, recipe: Recipe, tensors: list[TensorInfo], assignment: dict, kept_experts: dict
) -> list[TensorPlan]:
    """The plans of the routed-expert tensors in their assigned formats, with usage and predicted loss."""
    plans = []
    for t in tensors:
        if not t.is_routed_weight:
            continue
        spec = assignment.get((t.layer, t.expert, t.proj)) or assignment[(t.layer, t.expert)]
        usage = ctx.usage(t.layer)
        loss = ctx.tensor_loss(t, spec.key) if ctx.stats is not None else None
        kept = kept_experts.get((t.layer, t.expert))
        usage = None if usage is None else float(usage[t.expert])
        plans.append(_row(t, spec, recipe, ctx.nbytes(spec, t), kept=kept, usage=usage, predicted_loss=loss))
    return plans


def _row(t: TensorInfo, spec, recipe: Recipe, nbytes: int, **extra) -> TensorPlan:
    """One tensor's plan row: the tensor as the planner sees it, in `spec`, with the recipe's algorithm for it."""
    return TensorPlan(
        t.name,
        t.role,
        t.layer,
        t.expert,
        t.proj,
        t.shape,
        spec.key,
        spec_params(spec),
        recipe.algorithm_for(spec.name),
        nbytes,
        **extra,
    )
