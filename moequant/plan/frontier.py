"""The quality-memory frontier predicted from one set of statistics: budget_frontier (plans at several
budgets, per target and per expert, and every candidate as a uniform plan)."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from moequant.errors import UserError
from moequant.plan.context import loaded_stats, tensors_from_checkpoint
from moequant.plan.policy import make_plan
from moequant.plan.recipe import Recipe, resolve_format
from moequant.targets import ANY_MIX


def budget_frontier(recipe: Recipe, checkpoint_or_tensors, stats, bits_per_weight: Sequence[float]) -> dict:
    """Predicted loss vs routed-expert bytes for several budgets (the quality-memory frontier).

    For each budget in bits per routed-expert weight: the plan for the recipe's target and the
    per-expert plan (target transformers, the recipe's full candidate list), or the sentence
    saying why that budget is infeasible; plus every candidate as a uniform plan. Measured KL
    for these points comes from `moequant eval` on the plans' checkpoints.
    """
    if hasattr(checkpoint_or_tensors, "keys") and hasattr(checkpoint_or_tensors, "shape"):
        checkpoint_or_tensors = tensors_from_checkpoint(checkpoint_or_tensors)
    stats = loaded_stats(stats)
    experts = recipe.experts.model_copy(update={"method": "budget"})

    def point(target: str, bits: float) -> dict:
        budget = (
            experts.budget.model_copy(update={"bits_per_weight": bits, "gigabytes": None}) if experts.budget else None
        )
        if budget is None:
            from moequant.plan.recipe import Budget

            budget = Budget(bits_per_weight=bits)
        variant = recipe.model_copy(update={"target": target, "experts": experts.model_copy(update={"budget": budget})})
        try:
            plan = make_plan(variant, checkpoint_or_tensors, stats)
        except UserError as error:
            return {"bits_per_weight": bits, "error": str(error)}
        s = plan.summary
        counts = Counter(plan.expert_formats().values())
        return {
            "bits_per_weight": bits,
            "routed_bytes": s["routed_bytes"],
            "total_bytes": s["total_bytes"],
            "routed_bits_per_weight": s["bits_per_weight"]["routed_experts"],
            "predicted_loss": s["predicted_loss"],
            "counts": dict(counts),
        }

    budgets = [float(b) for b in bits_per_weight]
    out = {
        "target": recipe.target,
        "budgets": budgets,
        "serving": [point(recipe.target, b) for b in budgets],
        "per_expert": [point(ANY_MIX, b) for b in budgets] if recipe.target != ANY_MIX else None,
        "uniform": [],
    }
    for entry in _dedupe_entries(recipe):
        variant = recipe.model_copy(
            update={
                "target": ANY_MIX,
                "experts": experts.model_copy(update={"method": "uniform", "format": entry}),
            }
        )
        try:
            plan = make_plan(variant, checkpoint_or_tensors, stats)
        except UserError as error:
            out["uniform"].append({"format": entry, "error": str(error)})
            continue
        s = plan.summary
        out["uniform"].append(
            {
                "format": next(iter(plan.expert_formats().values())),
                "routed_bytes": s["routed_bytes"],
                "routed_bits_per_weight": s["bits_per_weight"]["routed_experts"],
                "predicted_loss": s["predicted_loss"],
            }
        )
    return out


def _dedupe_entries(recipe: Recipe) -> list[str]:
    seen, out = set(), []
    for entry in recipe.experts.formats:
        key = resolve_format(recipe, entry).key
        if key not in seen:
            seen.add(key)
            out.append(entry)
    return out
