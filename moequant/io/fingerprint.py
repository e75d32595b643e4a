"""The run fingerprint: which run made a plan, a checkpoint and a report.

A short hash (16 hex digits) of everything that decides the checkpoint: the recipe (without its
`output` and `model` paths and its `evaluate` section), the model's own fingerprint (config and
tensor list, calibrate.model_fingerprint), the calibration data settings and the plan. It is
written into
- plan.json (`pipeline.apply.run_fingerprint` computes it),
- the checkpoint's config.json (`moequant: {run_fingerprint}`, so it travels with a copied
  checkpoint) and apply's `checkpoint.json` marker,
- report.json (`run_fingerprint`).
A rerun remakes a checkpoint whose fingerprint is not the run's; `eval` of OUTPUT/checkpoint,
the report (build_report) and `moequant report` refuse parts of one directory that disagree.
Evaluation settings are left out: changing them redoes the evaluation, not the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

from moequant.errors import UserError

KEY = "run_fingerprint"


def stamp_checkpoint(checkpoint_dir, fingerprint: str) -> None:
    """Record the run in the checkpoint's config.json (atomically; serving engines ignore the key)."""
    from moequant.io.checkpoint import atomic_write_text

    path = _record_file(checkpoint_dir)
    config = json.loads(path.read_text())
    config["moequant"] = {**(config.get("moequant") or {}), KEY: fingerprint}
    atomic_write_text(path, json.dumps(config, indent=2) + "\n")


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _record_file(checkpoint_dir) -> Path:
    """config.json, or for a checkpoint without one (GGUF: one model.gguf) moequant's export record."""
    from moequant.io.checkpoint import EXPORT_INFO

    config = Path(checkpoint_dir) / "config.json"
    return config if config.exists() else Path(checkpoint_dir) / EXPORT_INFO


def checkpoint_fingerprint(checkpoint_dir) -> str | None:
    ours = (_read(_record_file(checkpoint_dir)) or {}).get("moequant")
    return ours.get(KEY) if isinstance(ours, dict) else None


def file_fingerprint(path) -> str | None:
    """`run_fingerprint` of plan.json / report.json / checkpoint.json, None when absent."""
    return (_read(Path(path)) or {}).get(KEY)


RECORDS = ("checkpoint.json", "pareto_run.json")  # apply's / pareto's record that checkpoint/ was made from plan.json


def _records(output: Path) -> dict[str, str | None]:
    return {name: file_fingerprint(output / name) for name in RECORDS if (output / name).exists()}


def check_checkpoint_in_run(checkpoint) -> None:
    """OUTPUT/checkpoint must exist and carry OUTPUT/plan.json's fingerprint: refuse one swapped in from another
    run (or made by another tool) instead of evaluating it as this run's. Other paths are not checked."""
    checkpoint = Path(checkpoint)
    plan_path = checkpoint.parent / "plan.json"
    expected = file_fingerprint(plan_path)
    if checkpoint.name != "checkpoint" or expected is None:
        return
    if not checkpoint.is_dir():
        raise UserError(
            f"{checkpoint} does not exist although {plan_path} plans it; run `moequant apply` for "
            f"{checkpoint.parent} to make it."
        )
    found = checkpoint_fingerprint(checkpoint)
    if found != expected:
        raise UserError(
            f"{checkpoint} does not belong to the run in {checkpoint.parent}: its run fingerprint is "
            f"{found or 'missing'} but {plan_path} has {expected}; rerun that directory's `moequant apply` "
            "to remake it, or move the checkpoint out of the directory to evaluate it alone."
        )


def check_checkpoint_recorded(checkpoint) -> None:
    """`moequant eval OUTPUT/checkpoint`: also the record that made it (checkpoint.json) must be there and of
    plan.json's run (apply and pareto evaluate before they write it, so they check only the fingerprint)."""
    check_checkpoint_in_run(checkpoint)
    checkpoint = Path(checkpoint)
    plan_path = checkpoint.parent / "plan.json"
    expected = file_fingerprint(plan_path)
    if checkpoint.name != "checkpoint" or expected is None:
        return
    records = _records(checkpoint.parent)
    if not records or any(fp != expected for fp in records.values()):
        what = (
            ", ".join(f"{n} has {fp or 'no run fingerprint'}" for n, fp in records.items())
            or "checkpoint.json is missing"
        )
        raise UserError(
            f"{checkpoint} has no record of being made by the run in {checkpoint.parent} ({what}, "
            f"{plan_path} has {expected}); rerun that directory's `moequant apply` to remake and record "
            "it, or move the checkpoint out of the directory to evaluate it alone."
        )


def check_report_directory(output) -> str | None:
    """`moequant report`: the checkpoint the report describes and apply's record of it are there, and every
    part is of one run (check_run_directory)."""
    output = Path(output)
    if not (output / "checkpoint").is_dir():
        raise UserError(
            f"{output} has no checkpoint/, the checkpoint its report describes; rerun `moequant apply` "
            "to make it again."
        )
    if not _records(output):
        raise UserError(
            f"{output} has no checkpoint.json, apply's record that checkpoint/ was made from its plan; "
            "rerun `moequant apply` to remake and record it."
        )
    return check_run_directory(output)


def check_run_directory(output) -> str | None:
    """plan.json, checkpoint/ and report.json of `output` carry one fingerprint: return it (None when
    none has one), else raise UserError naming the parts that disagree."""
    output = Path(output)
    parts = {}
    for name, read in (
        ("plan.json", file_fingerprint),
        ("checkpoint", checkpoint_fingerprint),
        *((record, file_fingerprint) for record in RECORDS),
        ("report.json", file_fingerprint),
    ):
        if (output / name).exists():
            parts[name] = read(output / name)
    found = set(parts.values())
    if len(found) > 1:
        listed = ", ".join(f"{name} {fp or 'without one'}" for name, fp in parts.items())
        raise UserError(
            f"{output} mixes the outputs of different runs (run fingerprints: {listed}); rerun its "
            "`moequant apply` to make them one run again."
        )
    return next(iter(found), None)
