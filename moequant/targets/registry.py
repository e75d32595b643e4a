"""The serving targets by name: each engine's file registers its target here, and every caller asks here (the
recipe's `target`, the planner, the precheck, the export)."""

from __future__ import annotations

from moequant.registry import Registry
from moequant.targets.base import Target

TARGETS: Registry = Registry("target", "target {name!r} is not a target; accepted: {accepted}.")


def register(target: Target) -> Target:
    """Make `target` known by its name: recipes, the planner, the precheck and the export then take it."""
    return TARGETS.add(target, target.name)


def get_target(name) -> Target:
    """The registered target `name` (a Target is returned as it is)."""
    if isinstance(name, Target):
        return name
    return TARGETS.find(name)
