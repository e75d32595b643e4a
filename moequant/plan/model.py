"""The plan's data: TensorInfo (a tensor as the planner sees it), TensorPlan (one tensor's format) and
Plan (plan.json in memory), the schema name SCHEMA, the projections of a routed expert, the roles
non_experts.format applies to and spec_params (a format spec's parameters as the plan stores them).
plan.policy builds plans, plan.plan_io reads and writes them, plan.summary prints them.

plan.json's shape is defined once, by plan.plan_io.PlanFile (a pydantic schema), through which these
dataclasses are written and read.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass, field

SCHEMA = "moequant.plan/1"
PROJECTIONS = ("gate", "up", "down")
NON_EXPERT_ROLES = ("attention", "shared_expert", "dense_mlp", "lm_head")


def _formats():
    from moequant import formats  # imported lazily: the plan's data classes load without torch

    return formats


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the plan sees it; routed experts are one entry per (layer, expert, proj)
    with shape [out, in], even when the checkpoint fuses them (then `name` repeats)."""

    name: str
    role: str
    layer: int | None
    expert: int | None
    proj: str | None
    shape: tuple[int, ...]
    element_size: int = 2  # bytes per element of a copy kept as stored (F32 routers stay F32)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_routed_weight(self) -> bool:
        return (
            self.role == "routed_expert"
            and self.expert is not None
            and self.proj in PROJECTIONS
            and len(self.shape) == 2
        )


@dataclass
class TensorPlan:
    name: str
    role: str
    layer: int | None
    expert: int | None
    proj: str | None
    shape: tuple[int, ...]
    format: str
    params: dict
    algorithm: str
    bytes: int
    kept: str | None = None
    usage: float | None = None

    @property
    def quantized(self) -> bool:
        """False for a tensor the plan keeps as it is (its format's family does not quantize: bf16)."""
        return _formats().spec_of(self.format).quantized

    predicted_loss: float | None = None


@dataclass
class Plan:
    model: str
    target: str
    method: str
    budget: dict | None
    candidates: list[str]
    dropped_candidates: dict[str, str]
    usage_floor: float
    formats: dict[str, dict]
    tensors: list[TensorPlan]
    summary: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    recipe: dict = field(default_factory=dict)
    run_fingerprint: str | None = (
        None  # of the run that made it (moequant.io.fingerprint), set by apply / plan / pareto
    )

    def expert_formats(self) -> dict[tuple[int, int], str]:
        """(layer, expert) -> format key of its routed weights."""
        return {
            (t.layer, t.expert): t.format
            for t in self.tensors
            if t.role == "routed_expert" and t.expert is not None and t.proj in PROJECTIONS
        }

    def layer_formats(self) -> dict[int, set[str]]:
        out: dict[int, set[str]] = defaultdict(set)
        for (layer, _), key in self.expert_formats().items():
            out[layer].add(key)
        return dict(out)


def spec_params(spec) -> dict:
    return {k: v for k, v in dataclasses.asdict(spec).items() if k != "name"}
