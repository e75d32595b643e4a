"""plan.json on disk: its schema (PlanFile, "moequant.plan/1", the one definition of the file's shape),
a Plan to and from that shape, written atomically and read back with one sentence naming the file and
the bad key for a missing, invalid or malformed file.

The plan stays plan.model's dataclasses in memory (the planner fills and edits them); PlanFile is the
file. Writing validates the plan's dict through PlanFile and writes PlanFile's dump; reading validates
the file through PlanFile and builds the dataclasses from it. Field order is the file's key order.
Numbers a user may give as whole numbers (budgets, usage_floor) are `int | float`, so a value is written
as it was given; values moequant computes as floats are `float`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
    model_serializer,
    model_validator,
)

from moequant.errors import UserError, schema_refusal
from moequant.plan.model import SCHEMA, Plan, TensorPlan

Number = Union[int, float]  # a JSON number kept as given (5 stays 5, 5.0 stays 5.0)


class _Part(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _KeysAsGiven(_Part):
    """A part whose optional keys are written only when they were given (absent, not null)."""

    @model_serializer(mode="wrap")
    def _given_keys_only(self, handler):
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}


class BudgetEntry(_Part):
    bits_per_weight: Optional[Number]
    gigabytes: Optional[Number]
    routed_bytes_limit: int  # bytes the routed experts may use


class FormatEntry(_Part):
    name: str
    params: dict[str, Any]
    algorithm: str


class TensorEntry(_Part):
    """One tensor; fused on-disk tensors (gpt-oss) appear once per expert and projection, same name."""

    name: str
    role: str
    layer: Optional[int]
    expert: Optional[int]
    proj: Optional[str]  # gate / up / down for routed experts
    shape: list[int]  # [out, in] for routed experts, else the on-disk shape
    format: str  # format key
    params: dict[str, Any]
    algorithm: str  # rtn / gptq / awq / imatrix / none
    bytes: int  # as the export writes it
    kept: Optional[str] = None  # why it stays bf16
    usage: Optional[float] = None  # routed experts with statistics
    predicted_loss: Optional[float] = None


class LayerMap(_Part):
    map: str  # one character per expert (see the legend)
    counts: dict[str, int]  # format key -> experts


class Alternative(_KeysAsGiven):
    """The budget plan of another target (per_expert_alternative: transformers) or, for rules / uniform
    plans, the solver at their bytes (budget_alternative)."""

    predicted_loss: Optional[float]
    routed_bytes: int
    candidates: list[str]
    counts: dict[str, int]
    routed_bits_per_weight: Optional[float] = None  # absent in plans made before it was written


class UniformAlternative(_KeysAsGiven):
    format: str
    routed_bytes: int
    predicted_loss: Optional[float]
    routed_bits_per_weight: Optional[float] = None


class ProbeLayer(_Part):
    kl: float
    scale: Union[float, dict[str, float]]  # one per projection where the probe measured them alone


class Probe(_KeysAsGiven):
    """The per-layer KL probe: {used: false, why} or {used: true, format, samples, tokens, algorithm,
    held_out, layers}; a file holds the keys of its case only."""

    used: bool
    why: Optional[str] = None
    format: Optional[str] = None
    samples: Optional[int] = None
    tokens: Optional[int] = None
    algorithm: Optional[str] = None  # rtn / gptq
    held_out: Optional[bool] = None
    layers: Optional[dict[str, ProbeLayer]] = None

    @model_validator(mode="after")
    def _keys_of_its_case(self):
        keys = (
            {"used", "format", "samples", "tokens", "algorithm", "held_out", "layers"} if self.used else {"used", "why"}
        )
        if self.model_fields_set != keys:
            raise ValueError(f"a probe with used {str(self.used).lower()} has the keys {', '.join(sorted(keys))}")
        return self


class BitsPerWeight(_Part):
    overall: float
    routed_experts: float


class Summary(_Part):
    layers: dict[str, LayerMap]
    legend: dict[str, str]  # map character -> format key
    bytes_by_role: dict[str, int]
    weights_by_role: dict[str, int]
    total_bytes: int
    bits_per_weight: BitsPerWeight
    routed_bytes: int
    predicted_loss: Optional[float]
    per_expert_alternative: Optional[Alternative]
    budget_alternative: Optional[Alternative]
    uniform_alternatives: list[UniformAlternative]
    probe: Optional[Probe]  # None: planned without statistics


class PlanFile(_Part):
    """plan.json. Keys of the top level it does not know are ignored when read (as they always were)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    schema_: Literal[SCHEMA] = Field(alias="schema")
    model: str
    target: str  # the serving target (moequant.targets)
    method: Literal["budget", "rules", "uniform"]
    budget: Optional[BudgetEntry]
    candidates: list[str]  # offered to the routed experts
    dropped_candidates: dict[str, str]  # format key -> why the target refuses it
    usage_floor: Number
    formats: dict[str, FormatEntry]
    tensors: list[TensorEntry]  # every tensor
    summary: Optional[Summary] = None  # {} in the file and in memory until make_plan fills it
    notes: list[str] = Field(default_factory=list)
    recipe: dict[str, Any] = Field(default_factory=dict)  # the resolved recipe (plan.recipe.Recipe)
    run_fingerprint: Optional[str] = None  # of the run that made it (moequant.io.fingerprint)

    @field_validator("summary", mode="before")
    @classmethod
    def _no_summary(cls, value):
        return None if value == {} else value

    @field_serializer("summary")
    def _summary_dict(self, summary: Optional[Summary]):
        return {} if summary is None else summary.model_dump()


def plan_to_dict(plan: Plan) -> dict:
    """plan.json's dict (PlanFile's dump) of a plan; a plan PlanFile refuses is a bug (ValidationError)."""
    tensors = [{**vars(t), "shape": list(t.shape)} for t in plan.tensors]
    data = {"schema": SCHEMA, **vars(plan), "tensors": tensors}
    return PlanFile.model_validate(data).model_dump(by_alias=True)  # the dump copies every container


def plan_from_dict(data: dict, source: str = "<plan>") -> Plan:
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise UserError(f"plan {source} has schema {found!r}; accepted: {SCHEMA!r} (write it with `moequant plan`).")
    try:
        file = PlanFile.model_validate(data)
    except ValidationError as error:
        raise UserError(
            f"plan {source} is malformed: {schema_refusal(error.errors()[0])}; "
            f"accepted: a plan.json written by `moequant plan`."
        ) from None
    fields = file.model_dump(exclude={"schema_", "tensors"})
    tensors = [TensorPlan(**{**dict(t), "shape": tuple(t.shape)}) for t in file.tensors]  # fresh containers
    return Plan(tensors=tensors, **fields)


def write_plan(plan: Plan, path: str | Path) -> Path:
    """Write plan.json atomically (temp file beside it, then rename)."""
    from moequant.io.checkpoint import atomic_write_text

    path = Path(path)
    atomic_write_text(path, json.dumps(plan_to_dict(plan), indent=1) + "\n")
    return path


def read_plan(path: str | Path) -> Plan:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"plan {path} does not exist; write it with `moequant plan`.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"plan {path} is not valid JSON; accepted: a plan.json written by `moequant plan`.") from None
    return plan_from_dict(data, str(path))
