"""Which tensors the recipe decides and how without a budget: the tensors that always stay bf16, `keep`,
kept routed experts, and experts.method rules / uniform (rules_assignment).

Everything else follows the recipe: the router and the shared-expert gate always stay bf16;
norms, embeddings, biases and unknown tensors are never quantized; attention, shared experts,
dense MLPs and lm_head take `non_experts.format` unless `keep` names them.
"""

from __future__ import annotations

import fnmatch

from moequant.errors import UserError
from moequant.plan.context import PlanContext, relative_shares
from moequant.plan.model import NON_EXPERT_ROLES, TensorInfo
from moequant.plan.options import dedupe_specs
from moequant.plan.recipe import Recipe, resolve_format
from moequant.plan.serving import check_uniform_groups
from moequant.targets import get_target

ALWAYS_BF16_ROLES = {
    "router": "the router always stays bf16",
    "shared_expert_gate": "the shared-expert gate always stays bf16",
    "norm": "norms are not quantized",
    "embedding": "embeddings are not quantized",
    "other": "tensors of unknown role are not quantized",
}


KEEP_GROUP_ROLES = {
    "router": "router",
    "shared_expert_gate": "shared_expert_gate",
    "shared_experts": "shared_expert",
    "attention": "attention",
    "dense_mlp": "dense_mlp",
    "embeddings": "embedding",
    "lm_head": "lm_head",
    "routed_experts": "routed_expert",
}


def _keep_match(recipe: Recipe, t: TensorInfo) -> str | None:
    for entry in recipe.keep:
        if entry in KEEP_GROUP_ROLES:
            if KEEP_GROUP_ROLES[entry] == t.role:
                return f"keep: {entry}"
        elif fnmatch.fnmatchcase(t.name, entry) or t.name.startswith(entry.rstrip(".") + "."):
            return f"keep: {entry}"
    return None


def needs_statistics(recipe: Recipe) -> bool:
    """Whether the plan depends on calibration statistics: a budget (sensitivities) or rules on
    routing shares. Uniform formats and layer rules need none: such a run calibrates nothing
    (the quantize pass collects GPTQ / AWQ's inputs itself)."""
    if recipe.experts.method == "budget":
        return True
    if recipe.experts.method == "rules":
        return any(r.share_at_least is not None or r.share_below is not None for r in recipe.experts.rules or [])
    return False


def _apply_rules(ctx: PlanContext, recipe: Recipe, free) -> dict:
    rules = recipe.experts.rules
    needs_share = any(r.share_at_least is not None or r.share_below is not None for r in rules)
    if needs_share and ctx.stats is None:
        raise UserError(
            "experts.rules use share_at_least / share_below, which need calibration statistics; "
            "run `moequant calibrate` first and pass its statistics."
        )
    specs = [resolve_format(recipe, r.format) for r in rules]
    layer_sets = [r.layer_set() for r in rules]
    assignment = {}
    shares = {}
    for layer, expert in free:
        if needs_share and layer not in shares:
            shares[layer] = relative_shares(ctx.stats, layer, ctx.num_experts[layer])
        for i, rule in enumerate(rules):
            if layer_sets[i] is not None and layer not in layer_sets[i]:
                continue
            share = shares[layer][expert] if needs_share else None
            if rule.share_at_least is not None and not share >= rule.share_at_least:
                continue
            if rule.share_below is not None and not share < rule.share_below:
                continue
            assignment[(layer, expert)] = specs[i]
            break
        else:
            detail = f" (routing share {shares[layer][expert]:.3g}x the layer mean)" if needs_share else ""
            raise UserError(
                f"no rule in experts.rules matches layer {layer} expert {expert}{detail}; "
                f"accepted: end the rules with one without conditions, such as {{format: int4}}."
            )
    return assignment


def rules_assignment(ctx: PlanContext, recipe: Recipe, free, shapes_only: bool) -> dict:
    """experts.method uniform / rules: expert -> spec, refused where the target cannot serve it. With
    shapes_only and rules on routing shares (which rule matches needs statistics) the rules' formats
    are checked and the assignment is empty."""
    target, method = get_target(recipe.target), recipe.experts.method
    if method == "uniform":
        spec = resolve_format(recipe, recipe.experts.format)
        assignment = {e: spec for e in free}
    elif shapes_only and needs_statistics(recipe):
        assignment = {}
        for rule in recipe.experts.rules:
            spec = resolve_format(recipe, rule.format)
            why = target.check(spec, routed=True)
            if why:
                raise UserError(
                    f"experts.rules gives routed experts {spec.key}, which target {target} cannot "
                    f"serve: {why}; accepted: {target.routed_formats}, or target transformers."
                )
    else:
        assignment = _apply_rules(ctx, recipe, free)
    for spec in dedupe_specs(assignment.values()):
        why = target.check(spec, routed=True)
        if why:
            key = "experts.format" if method == "uniform" else "experts.rules"
            raise UserError(
                f"{key} gives routed experts {spec.key}, which target {target} cannot serve: {why}; "
                f"accepted: {target.routed_formats}, or target transformers."
            )
    check_uniform_groups(ctx, target, assignment)
    return assignment


def non_expert_kept_reason(recipe: Recipe, t: TensorInfo) -> str | None:
    """Why a non-routed tensor stays bf16 whatever non_experts.format says, or None."""
    why = ALWAYS_BF16_ROLES.get(t.role)
    if why is None and (len(t.shape) < 2 or t.name.endswith("bias") or t.role == "routed_expert"):
        why = "biases and vectors are not quantized"
    if why is None:
        why = _keep_match(recipe, t)
    if why is None and t.role not in NON_EXPERT_ROLES:
        why = f"role {t.role} is not quantized"
    return why


def kept_routed_experts(recipe: Recipe, tensors: list[TensorInfo]) -> dict[tuple[int, int], str]:
    """(layer, expert) -> the keep entry that holds it bf16 (any one of its projections matching)."""
    kept: dict[tuple[int, int], str] = {}
    for t in tensors:
        if t.is_routed_weight:
            why = _keep_match(recipe, t)
            if why:
                kept.setdefault((t.layer, t.expert), why)
    return kept


def check_kept_experts(ctx: PlanContext, recipe: Recipe, kept_experts: dict, notes: list[str]) -> None:
    """Note keep entries that match only some projections of an expert; refuse kept experts that
    split a group the target serves in one format."""
    target = get_target(recipe.target)
    for (layer, expert), why in kept_experts.items():
        projs = {t.proj for t in ctx.experts[(layer, expert)] if _keep_match(recipe, t)}
        if len(projs) < len(ctx.experts[(layer, expert)]):
            notes.append(
                f"{why} matches only some projections of layer {layer} expert {expert}; the whole expert "
                f"stays bf16, since one format covers an expert's gate, up and down."
            )
    unit = target.granularity
    if unit != "expert" and kept_experts:
        for scope in {L for L, _ in kept_experts}:  # kept layers are ignored ones, also where the unit is the model
            members = [e for e in ctx.experts if unit == "model" or e[0] == scope]
            partial = [e for e in members if e not in kept_experts]
            if partial:
                where = f"layer {scope}"
                raise UserError(
                    f"keep holds only some routed experts of {where} in bf16, which target {target} "
                    f"cannot serve (one format per {unit}); accepted: keep whole layers "
                    f"(e.g. model.layers.3.mlp.experts.*), routed_experts, or target transformers."
                )
