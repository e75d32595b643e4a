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


def check_checkpoint_in_run(checkpoint) -> None:
    """OUTPUT/checkpoint must carry OUTPUT/plan.json's fingerprint: refuse one swapped in from another
    run (or made by another tool) instead of evaluating it as this run's. Other paths are not checked."""
    checkpoint = Path(checkpoint)
    if checkpoint.name != "checkpoint" or not checkpoint.is_dir():
        return
    plan_path = checkpoint.parent / "plan.json"
    expected = file_fingerprint(plan_path)
    found = checkpoint_fingerprint(checkpoint)
    if expected is not None and found != expected:
        raise UserError(f"{checkpoint} does not belong to the run in {checkpoint.parent}: its run fingerprint is "
                        f"{found or 'missing'} but {plan_path} has {expected}; rerun that directory's `moequant apply` "
                        "to remake it, or move the checkpoint out of the directory to evaluate it alone.")


def check_run_directory(output) -> str | None:
    """plan.json, checkpoint/ and report.json of `output` carry one fingerprint: return it (None when
    none has one), else raise UserError naming the parts that disagree."""
    output = Path(output)
    parts = {}
    for name, read in (("plan.json", file_fingerprint), ("checkpoint", checkpoint_fingerprint),
                       ("report.json", file_fingerprint)):
        if (output / name).exists():
            parts[name] = read(output / name)
    found = set(parts.values())
    if len(found) > 1:
        listed = ", ".join(f"{name} {fp or 'without one'}" for name, fp in parts.items())
        raise UserError(f"{output} mixes the outputs of different runs (run fingerprints: {listed}); rerun its "
                        "`moequant apply` to make them one run again.")
    return next(iter(found), None)
