"""plan.json on disk: a Plan to and from its JSON dict (schema plan.model.SCHEMA; the layout is in
plan.model's docstring), written atomically and read back with a sentence for a missing, invalid or
malformed file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from moequant.errors import UserError
from moequant.plan.model import SCHEMA, Plan, TensorPlan


def plan_to_dict(plan: Plan) -> dict:
    data = dataclasses.asdict(plan)
    data["tensors"] = [{**t, "shape": list(t["shape"])} for t in data["tensors"]]
    return {"schema": SCHEMA, **data}


def plan_from_dict(data: dict, source: str = "<plan>") -> Plan:
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise UserError(f"plan {source} has schema {found!r}; accepted: {SCHEMA!r} (write it with `moequant plan`).")
    try:
        tensors = [TensorPlan(**{**t, "shape": tuple(t["shape"])}) for t in data["tensors"]]
        fields = {f.name for f in dataclasses.fields(Plan)} - {"tensors"}
        return Plan(tensors=tensors, **{k: data[k] for k in fields if k in data})
    except (KeyError, TypeError) as error:
        raise UserError(
            f"plan {source} is malformed ({error}); accepted: a plan.json written by `moequant plan`."
        ) from None


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
