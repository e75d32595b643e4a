"""The serving targets by name: each engine's file registers its target here, and every caller asks here (the
recipe's `target`, the planner, the precheck, the export)."""

from __future__ import annotations

from moequant.errors import UserError
from moequant.targets.base import Target

TARGETS: dict[str, Target] = {}


def register(target: Target) -> Target:
    """Make `target` known by its name: recipes, the planner, the precheck and the export then take it."""
    TARGETS[target.name] = target
    return target


def get_target(name) -> Target:
    """The registered target `name` (a Target is returned as it is)."""
    if isinstance(name, Target):
        return name
    target = TARGETS.get(name)
    if target is None:
        raise UserError(f"target {name!r} is not a target; accepted: {', '.join(TARGETS)}.")
    return target
