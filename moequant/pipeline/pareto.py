"""The quality–memory frontier: several plans against one set of calibration statistics.

    result = pareto("recipes/per-expert.yaml", budgets=["int3", "int4", "int4..int8", 6.0],
                    output="runs/pareto")

Calibrates once (`OUTPUT/stats`, every candidate's sensitivity measured; reused when a run of the
same settings left them), then for every budget and target makes the budget plan, quantizes, exports
and evaluates it into `OUTPUT/pareto/<name>/` (plan.json, checkpoint/, report.json, report.md,
report.html), and the same for each uniform format. Every run is evaluated on the same
evaluation-split tokens (disjoint from calibration, see data.py). Writes `OUTPUT/pareto.json` and
`OUTPUT/pareto.png` (KL vs bytes); each run's report.html shows the frontier of its sibling runs.
The frontier (pareto.json's `frontier`) is the points no other point beats: none has at most their
bits per routed-expert weight and at most their KL, one of the two lower; points of equal bits and KL
(two budgets that led to one plan) are one frontier point, the first.

A budget is bits per routed-expert weight (scales included), given as
- a number, e.g. 4.5;
- a format entry, e.g. `int4`: exactly the routed-expert bytes of that format as a uniform plan;
- `A..B`, e.g. `int4..int8`: half way between the bytes of uniform A and uniform B.

Candidates are the recipe's `experts.formats` (e.g. bf16, int8, int4, int3, int2); for targets
vllm / sglang the policy drops what those engines cannot load for MoE layers (int3, int2,
asymmetric int4) and offers bf16 only for whole layers. Uniform baselines use target vllm when
vLLM can serve them, else transformers.

Reruns reuse the statistics and every run whose plan and evaluation settings are unchanged.

The model is opened once (moequant.pipeline.run); each point is that Run with the point's recipe and
directory, made by apply's own stages: quantize_and_export (which stamps the checkpoint), evaluate_output
and report_stage.

pareto.json (schema "moequant.pipeline.pareto/1")
----------------------------------------
{"schema", "model", "recipe": {...}, "evaluate": {dataset, samples, seq_len, seed},
 "calibration": {dataset, samples, seq_len, seed}, "routed_weights": int,
 "points": [{"name", "kind": "uniform" | "plan" | "outside", "target", "format" (uniform) | null,
             "budget": str | null (as given), "budget_bits": float | null,
             "routed_bytes": int | null, "bits_per_weight_experts": float, "bytes_quantized": int,
             "kl_mean", "kl_p99", "top1_agreement", "routing_agreement", "ppl_quantized",
             "predicted_loss": float | null, "counts": {format key: experts} | null,
             "report": path of the run's report.json | the outside JSON}],
 "ppl_original": float,
 "frontier": [names of the non-dominated points, by bits],
 "skipped": [{"name", "target", "budget", "budget_bits", "error"}]}   # infeasible budget / target pairs
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from fractions import Fraction
from pathlib import Path
from typing import Iterable, Sequence

from moequant.errors import UserError
from moequant.targets import ANY_MIX, TARGETS, get_target

SCHEMA = "moequant.pipeline.pareto/1"
DEFAULT_TARGETS = ("vllm", ANY_MIX)
DEFAULT_UNIFORM = ("int8", "int4", "int3")
RUN_MARKER = "pareto_run.json"  # in each run directory: what produced its report (for reuse)
RUNS_DIR = "pareto"  # OUTPUT/pareto/<name>/: one directory per point


# ----------------------------------------------------------------------------- recipes


def _variant(recipe, **experts_update):
    """The recipe with some `experts` fields replaced (target given separately as `target=`)."""
    target = experts_update.pop("target", recipe.target)
    experts = recipe.experts.model_copy(update=experts_update)
    return recipe.model_copy(update={"target": target, "experts": experts})


def _budget_recipe(recipe, target: str, bits: float):
    from moequant.plan.recipe import Budget

    return _variant(recipe, target=target, method="budget", budget=Budget(bits_per_weight=bits))


def _uniform_recipe(recipe, entry: str):
    from moequant.plan.recipe import resolve_format

    spec = resolve_format(recipe, entry)
    target = "vllm" if get_target("vllm").check(spec, routed=True) is None else ANY_MIX
    return _variant(recipe, target=target, method="uniform", format=entry), spec


def _routed(plan) -> tuple[int, int]:
    """(routed-expert bytes, routed-expert weights) of a plan."""
    rows = [
        t
        for t in plan.tensors
        if t.role == "routed_expert" and t.expert is not None and t.proj in ("gate", "up", "down")
    ]
    return sum(t.bytes for t in rows), sum(math.prod(t.shape) for t in rows)


def bits_for_bytes(nbytes: int, numel: int) -> float:
    """The float budget whose byte limit (policy: floor(Fraction(str(bits)) * numel / 8)) is
    exactly `nbytes`: the nearest float at or above nbytes * 8 / numel."""
    exact = Fraction(nbytes * 8, numel)
    bits = float(exact)
    while Fraction(str(bits)) < exact:
        bits = math.nextafter(bits, math.inf)
    return bits


def resolve_budget(recipe, ckpt, entry, cache: dict | None = None) -> float:
    """A budget entry (number, format entry, or 'A..B') -> bits per routed-expert weight."""
    from moequant.plan.policy import make_plan

    cache = {} if cache is None else cache

    def uniform_bytes(name: str) -> tuple[int, int]:
        name = name.strip()
        if name not in cache:
            try:
                variant, _ = _uniform_recipe(recipe, name)
            except UserError as error:
                raise UserError(
                    f"budget {entry!r}: {str(error).rstrip('.')}; accepted: a number of bits per "
                    "routed-expert weight, a format such as int4, or A..B such as int4..int8."
                ) from None
            cache[name] = _routed(make_plan(variant, ckpt, None))
        return cache[name]

    if isinstance(entry, (int, float)) and not isinstance(entry, bool):
        bits = float(entry)
    else:
        text = str(entry).strip()
        try:
            bits = float(text)
        except ValueError:
            if ".." in text:
                a, b = text.split("..", 1)
                (bytes_a, numel), (bytes_b, _) = uniform_bytes(a), uniform_bytes(b)
                return bits_for_bytes((bytes_a + bytes_b) // 2, numel)
            nbytes, numel = uniform_bytes(text)
            return bits_for_bytes(nbytes, numel)
    if not (bits > 0 and math.isfinite(bits)):
        raise UserError(
            f"budget {entry!r} is not a positive number of bits per routed-expert weight; "
            "accepted: e.g. 4.5, a format such as int4, or A..B such as int4..int8."
        )
    return bits


def _label(bits: float) -> str:
    return f"{bits:.4f}".rstrip("0").rstrip(".")


# ----------------------------------------------------------------------------- one run


def tensor_formats(plan) -> str:
    """What the quantize pass does with a plan: every tensor's format, params and algorithm.
    Two plans with the same text give the same checkpoint (e.g. uniform int4 and the vLLM plan at
    its bytes, when no other format fits), so the second run reuses the first one's."""
    return json.dumps(
        [[t.name, t.expert, t.proj, t.format, t.params, t.algorithm] for t in plan.tensors], sort_keys=True, default=str
    )


def point_run(run, recipe, directory):
    """The Run (moequant.pipeline.run) of one point: the frontier's source, adapter and device, the point's
    recipe and directory; apply's stages log nothing there (each point says its own line)."""
    return dataclasses.replace(run, recipe=recipe, directory=Path(directory), log=_quiet, output=None)


def _run_one(name: str, run, plan, stats_dir: Path, settings, log, same_as: Path | None = None) -> dict:
    """Quantize, export, evaluate and report one plan into run.directory (reused when unchanged), `run`
    being the point's (point_run). `same_as`: a finished run directory whose plan quantizes every
    tensor the same way: its checkpoint (hard links where possible) and its evaluation are reused."""
    from moequant.io.fingerprint import KEY, checkpoint_fingerprint, stamp_checkpoint
    from moequant.pipeline.apply import evaluate_output, quantize_and_export, report_stage, run_fingerprint
    from moequant.plan.plan_io import plan_to_dict, write_plan

    recipe, run_dir = run.recipe, run.directory
    plan.run_fingerprint = run_fingerprint(recipe, run.source, settings, plan)  # this run's, also for library callers
    plan_dict = json.loads(json.dumps(plan_to_dict(plan)))
    e = recipe.evaluate
    marker = {
        "plan": json.dumps(plan_dict, sort_keys=True),
        "evaluate": {"dataset": e.dataset, "samples": e.samples, "seq_len": e.seq_len, "seed": recipe.seed},
        "calibration": settings.fingerprint_fields() | {"formats": list(settings.formats)},
        "export": [recipe.export.format, recipe.target],
        KEY: plan.run_fingerprint,
    }
    marker_path = run_dir / RUN_MARKER
    if (
        marker_path.exists()
        and (run_dir / "report.json").exists()
        and json.loads(marker_path.read_text()) == marker
        and checkpoint_fingerprint(run_dir / "checkpoint") == plan.run_fingerprint
    ):  # not one swapped in
        log(f"{name}: unchanged, reused")
        return json.loads((run_dir / "report.json").read_text())
    from moequant.io.checkpoint import atomic_write_text

    run_dir.mkdir(parents=True, exist_ok=True)
    marker_path.unlink(missing_ok=True)
    write_plan(plan, run_dir / "plan.json")
    checkpoint_dir = run_dir / "checkpoint"
    if checkpoint_dir.exists():
        shutil.rmtree(checkpoint_dir)
    if (
        same_as is not None
        and (same_as / "quality.json").exists()
        and json.loads((same_as / RUN_MARKER).read_text()).get("export") == marker["export"]
    ):
        shutil.copytree(same_as / "checkpoint", checkpoint_dir, copy_function=_link_or_copy)
        stamp_checkpoint(checkpoint_dir, plan.run_fingerprint)  # replaces the linked config.json, not the sibling's
        quality = json.loads((same_as / "quality.json").read_text())
        quality["checkpoint"] = str(checkpoint_dir)
        run.output = checkpoint_dir
        log(f"{name}: quantizes every tensor as {same_as.name} does; its checkpoint and evaluation are reused")
        timings = json.loads((same_as / "report.json").read_text()).get("timings", {})
    else:  # apply's own stages: the quantize pass and export, then the evaluation of the output
        timings = {}
        quantize_and_export(run, plan, settings, marker["plan"], None, timings)
        run.output, quality = evaluate_output(run, timings)
    atomic_write_text(run_dir / "quality.json", json.dumps(quality, default=str))
    report = report_stage(run, plan_dict, quality, stats_dir, timings)
    atomic_write_text(marker_path, json.dumps(marker))
    q = report["quality"] or {}
    log(
        f"{name}: KL {q.get('kl_mean', float('nan')):.4g}, top-1 {q.get('top1_agreement', float('nan')):.4f}, "
        f"{report['memory']['bits_per_weight_experts']:.3f} bits per routed-expert weight"
    )
    return report


def _quiet(*_args, **_kwargs) -> None:
    """apply's stage log inside a pareto run (each run says its own line)."""


def _link_or_copy(src, dst):
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


def _point(
    name: str,
    kind: str,
    report: dict,
    report_path: Path,
    *,
    target=None,
    format=None,
    budget=None,
    budget_bits=None,
    plan=None,
) -> dict:
    q = report.get("quality") or {}
    point = {
        "name": name,
        "kind": kind,
        "target": target,
        "format": format,
        "budget": None if budget is None else str(budget),
        "budget_bits": budget_bits,
        "routed_bytes": None,
        "bits_per_weight_experts": report["memory"]["bits_per_weight_experts"],
        "bytes_quantized": report["memory"]["bytes_quantized"],
        "kl_mean": q.get("kl_mean"),
        "kl_p99": q.get("kl_p99"),
        "top1_agreement": q.get("top1_agreement"),
        "routing_agreement": q.get("routing_agreement"),
        "ppl_quantized": q.get("ppl_quantized"),
        "predicted_loss": None,
        "counts": None,
        "report": str(report_path),
    }
    if plan is not None:
        from collections import Counter

        point["routed_bytes"] = _routed(plan)[0]
        point["predicted_loss"] = plan.summary.get("predicted_loss")
        point["counts"] = dict(Counter(plan.expert_formats().values()))
    return point


def outside_point(path, reference, evaluate_settings: dict) -> dict:
    """A point for an outside checkpoint: its directory (evaluated here on the frontier's
    evaluation tokens) or the JSON file of `moequant eval --json`, with bytes from the
    checkpoint's safetensors headers. A JSON evaluation must have used the same dataset, samples,
    seq_len and seed, so that its KL is over the same tokens. `reference`: the original model's
    directory or its open Checkpoint."""
    from moequant.plan.memory import memory_account

    path = Path(path)
    if path.is_dir():
        from moequant.evaluate import evaluate_checkpoints

        result = evaluate_checkpoints(str(path), reference, progress=False, **evaluate_settings)
        report = {"memory": memory_account(reference, path), "quality": result}
        return _point(path.name, "outside", report, path)
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(
            f"outside evaluation {path} is not a readable JSON file; accepted: the output of "
            "`moequant eval CHECKPOINT --reference ORIGINAL --json`."
        ) from None
    if not isinstance(result, dict) or "kl_mean" not in result or "checkpoint" not in result:
        raise UserError(
            f"outside evaluation {path} has no kl_mean / checkpoint; accepted: the output of "
            "`moequant eval CHECKPOINT --reference ORIGINAL --json`."
        )
    used = {
        "dataset": result.get("dataset"),
        "samples": result.get("samples"),
        "seq_len": result.get("seq_len"),
        "seed": result.get("seed"),
    }
    if used != evaluate_settings:
        raise UserError(
            f"outside evaluation {path} was made with {used}, not on the frontier's evaluation tokens "
            f"{evaluate_settings}; rerun `moequant eval` with --dataset, --samples, --seq-len and --seed "
            "set to those."
        )
    checkpoint = Path(result["checkpoint"])
    if not checkpoint.is_absolute() and not checkpoint.exists():
        checkpoint = path.parent / checkpoint
    memory = memory_account(reference, checkpoint)
    report = {"memory": memory, "quality": result}
    return _point(path.stem, "outside", report, path)


# ----------------------------------------------------------------------------- the frontier


def pareto(
    recipe_path=None,
    budgets: Sequence = ("int3", "int4", "int4..int8"),
    model=None,
    output=None,
    overrides: Iterable[str] = (),
    targets: Sequence[str] = DEFAULT_TARGETS,
    uniform: Sequence[str] = DEFAULT_UNIFORM,
    extra_reports: Sequence = (),
    device: str = "cpu",
    progress: bool = True,
    log=print,
    overwrite: bool = False,
) -> dict:
    """Run the budget plans (each budget x each target) and the uniform baselines against one set
    of statistics; write OUTPUT/pareto.json and OUTPUT/pareto.png. Returns pareto.json's dict."""
    from moequant.io.run_lock import output_lock
    from moequant.memory_budget import check_device
    from moequant.pipeline.apply import resolve_recipe
    from moequant.pipeline.run import open_run

    recipe = resolve_recipe(recipe_path, model, output, overrides)
    check_device(device)  # a device this machine lacks, before the directory is touched
    with output_lock(recipe.output, "pareto"):  # before anything is written into the directory
        _check_targets(targets, budgets, uniform)
        run = open_run(recipe, device, progress, log)
        run.overwrite = overwrite  # statistics of other settings in OUTPUT/stats: replaced, else refused
        return _pareto(run, budgets, targets, uniform, extra_reports)


def _pareto(run, budgets, targets, uniform, extra_reports) -> dict:
    recipe, ckpt, log = run.recipe, run.source, run.log
    uniform_variants, resolved = _feasible_runs(recipe, ckpt, budgets, targets, uniform)
    out = run.directory
    out.mkdir(parents=True, exist_ok=True)
    settings, stats_dir = _calibrate_once(run, uniform)
    runs, skipped = _plan_runs(recipe, ckpt, stats_dir, uniform_variants, resolved, targets, log)

    points = []
    done: dict[str, Path] = {}  # tensor_formats(plan) -> the run directory that made that checkpoint
    for name, kind, variant, plan, fields in runs:
        same = tensor_formats(plan)
        run_dir = out / RUNS_DIR / name
        report = _run_one(
            name, point_run(run, variant, run_dir), plan, stats_dir, settings, log, same_as=done.get(same)
        )
        done.setdefault(same, run_dir)
        points.append(_point(name, kind, report, run_dir / "report.json", plan=plan, **fields))
    e = recipe.evaluate
    evaluate_settings = {"dataset": e.dataset, "samples": e.samples, "seq_len": e.seq_len, "seed": recipe.seed}
    for path in extra_reports:
        points.append(outside_point(path, ckpt, evaluate_settings))

    # Re-render every run's report so that each one's frontier plot shows all its siblings.
    from moequant.report import write_report

    for name, *_ in runs:
        write_report(json.loads((out / RUNS_DIR / name / "report.json").read_text()), out / RUNS_DIR / name)
    return _write_frontier(recipe, out, runs, points, skipped, evaluate_settings, log)


def _check_targets(targets, budgets, uniform) -> None:
    for target in targets:
        if target not in TARGETS:
            raise UserError(f"target {target!r} is not a target; accepted: {', '.join(TARGETS)}.")
    if not budgets and not uniform:
        raise UserError("pareto needs at least one budget or one uniform format.")


def _feasible_runs(recipe, ckpt, budgets, targets, uniform):
    """What shapes alone decide, before the calibration: a uniform run that cannot be made is an
    error; budgets no target can meet are reported later (as after calibration), and when none of
    the runs can be made nothing is calibrated or written.
    Returns ([(uniform recipe, its format spec)], [(budget entry, bits per routed-expert weight)])."""
    from moequant.pipeline.precheck import check_recipe

    uniform_variants = [_uniform_recipe(recipe, entry) for entry in uniform]
    cache: dict = {}
    resolved = [(entry, resolve_budget(recipe, ckpt, entry, cache)) for entry in budgets]
    for variant, _ in uniform_variants:
        check_recipe(variant, ckpt)
    errors = []
    for entry, bits in resolved:
        for target in targets:
            try:
                check_recipe(_budget_recipe(recipe, target, bits), ckpt)
            except UserError as error:
                errors.append(str(error))
    if not uniform_variants and len(errors) == len(resolved) * len(targets):
        raise UserError("no budget is feasible for any target: " + " ".join(errors))
    return uniform_variants, resolved


def _calibrate_once(run, uniform):
    """The statistics every run reads, in OUTPUT/stats (apply's calibrate_stage): every format any run
    may give a routed expert has its sensitivity measured. Returns (calibration settings, the statistics
    directory)."""
    from moequant.pipeline.apply import calibrate_stage, calibration_settings
    from moequant.plan.recipe import resolve_format

    recipe = run.recipe
    keys: list[str] = []
    for entry in [*recipe.experts.formats, *uniform]:
        spec = resolve_format(recipe, entry)
        if spec.quantized and spec.key not in keys:
            keys.append(spec.key)
    settings = calibration_settings(recipe, run.device, formats=tuple(keys), ckpt=run.source)
    return settings, calibrate_stage(run, settings)


def _plan_runs(recipe, ckpt, stats_dir: Path, uniform_variants, resolved, targets, log):
    """The plans of the uniform runs and of every budget x target; a budget a target cannot meet is
    skipped (said, and listed in pareto.json). Returns ([(name, kind, recipe, plan, extra point
    fields)], skipped)."""
    from moequant.plan.policy import make_plan

    runs = []
    skipped: list[dict] = []
    for variant, spec in uniform_variants:
        plan = make_plan(variant, ckpt, stats_dir)
        runs.append((f"uniform-{spec.key}", "uniform", variant, plan, {"target": variant.target, "format": spec.key}))
    for entry, bits in resolved:
        for target in targets:
            variant = _budget_recipe(recipe, target, bits)
            try:
                plan = make_plan(variant, ckpt, stats_dir)
            except UserError as error:  # e.g. a budget below the target's smallest plan: say so, go on
                skipped.append(
                    {
                        "name": f"{target}-{_label(bits)}bpw",
                        "target": target,
                        "budget": str(entry),
                        "budget_bits": bits,
                        "error": str(error),
                    }
                )
                log(f"{target} at {entry!r}: {error}")
                continue
            runs.append(
                (
                    f"{target}-{_label(bits)}bpw",
                    "plan",
                    variant,
                    plan,
                    {"target": target, "budget": entry, "budget_bits": bits},
                )
            )
    if not runs:
        raise UserError("no budget is feasible for any target: " + " ".join(s["error"] for s in skipped))
    names = [r[0] for r in runs]
    if len(set(names)) != len(names):
        raise UserError(
            f"two budgets name the same run ({', '.join(sorted({n for n in names if names.count(n) > 1}))}); "
            "give each budget once."
        )
    return runs, skipped


def _write_frontier(recipe, out: Path, runs, points, skipped, evaluate_settings: dict, log) -> dict:
    """OUTPUT/pareto.json (returned) and OUTPUT/pareto.png."""
    from moequant.io.checkpoint import atomic_write_text
    from moequant.plan.recipe import recipe_to_dict

    c = recipe.calibration
    result = {
        "schema": SCHEMA,
        "model": recipe.model,
        "recipe": recipe_to_dict(recipe),
        "evaluate": evaluate_settings,
        "calibration": {"dataset": c.dataset, "samples": c.samples, "seq_len": c.seq_len, "seed": recipe.seed},
        "routed_weights": _routed(runs[0][3])[1] if runs else None,
        "ppl_original": next(
            (
                json.loads(Path(p["report"]).read_text())["quality"]["ppl_original"]
                for p in points
                if p["kind"] != "outside"
            ),
            None,
        ),
        "points": points,
        "frontier": frontier(points),
        "skipped": skipped,
    }
    atomic_write_text(out / "pareto.json", json.dumps(result, indent=2) + "\n")
    (out / "pareto.png").write_bytes(plot_frontier(points, title=f"{recipe.model}: KL vs routed-expert bits"))
    log(f"frontier: {out / 'pareto.json'}, {out / 'pareto.png'}")
    return result


def frontier(points: list[dict]) -> list[str]:
    """Names of the non-dominated points, by bits: no other point has at most their bits per routed-expert
    weight and at most their KL with one of the two strictly lower (points without a KL are left out). Points
    with the same bits and KL (e.g. two budgets that led to one plan) are one point of the frontier: the first."""
    measured = [p for p in points if p.get("kl_mean") is not None]
    at = lambda p: (p["bits_per_weight_experts"], p["kl_mean"])  # noqa: E731
    kept: dict[tuple, dict] = {}
    for p in measured:
        if not any(at(q) != at(p) and at(q)[0] <= at(p)[0] and at(q)[1] <= at(p)[1] for q in measured):
            kept.setdefault(at(p), p)
    return [p["name"] for p in sorted(kept.values(), key=at)]


def same_as_frontier(points: list[dict]) -> dict[str, str]:
    """{name: the frontier point's name} of the points left off the frontier only because a frontier point
    has the same bits and KL."""
    on = {(p["bits_per_weight_experts"], p["kl_mean"]): p["name"] for p in points if p["name"] in frontier(points)}
    return {
        p["name"]: on[(p["bits_per_weight_experts"], p["kl_mean"])]
        for p in points
        if p.get("kl_mean") is not None
        and (p["bits_per_weight_experts"], p["kl_mean"]) in on
        and p["name"] != on[(p["bits_per_weight_experts"], p["kl_mean"])]
    }


def find(points: list[dict], name: str) -> dict:
    """The point called `name` (KeyError naming the ones there are)."""
    for p in points:
        if p["name"] == name:
            return p
    raise KeyError(f"no point {name!r}; there are: {', '.join(p['name'] for p in points)}")


def plot_frontier(points: list[dict], title: str = "KL vs bytes") -> bytes:
    """PNG: KL(original ‖ quantized) against bits per routed-expert weight, one series per kind /
    target; the uniform points joined by a dashed line (what mixing them at random gives)."""
    import io

    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend (e.g. a notebook's) alone

    fig = Figure(figsize=(7.5, 4.8))
    ax = fig.subplots()
    series: dict[str, list[dict]] = {}
    for p in points:
        if p.get("kl_mean") is None:
            continue
        label = {"uniform": "uniform", "outside": "outside checkpoints"}.get(
            p["kind"], f"budget plan, target {p['target']}"
        )
        series.setdefault(label, []).append(p)
    style = {"uniform": ("s", "tab:gray", "--")}
    colors = iter(["tab:blue", "tab:red", "tab:green", "tab:purple", "tab:orange"])
    for label, pts in series.items():
        pts = sorted(pts, key=lambda p: p["bits_per_weight_experts"])
        marker, color, line = style.get(label, ("o", next(colors), "-"))
        if label == "outside checkpoints":
            marker, line = "^", ""
        xs, ys = [p["bits_per_weight_experts"] for p in pts], [p["kl_mean"] for p in pts]
        if label == "uniform" and len(pts) > 1:  # the straight line in KL (a curve on the log axis)
            fine = [x0 + (x1 - x0) * i / 50 for x0, x1 in zip(xs, xs[1:]) for i in range(50)] + [xs[-1]]
            ax.plot(
                fine,
                [_interpolate(xs, ys, x) for x in fine],
                color=color,
                linestyle=line,
                lw=1,
                label="uniform, mixed at random (straight line in KL)",
            )
            line = ""
        ax.plot(xs, ys, marker=marker, color=color, linestyle=line or "none", label=label)
        for p in pts:
            text = p["format"] if p["kind"] == "uniform" else (p["name"] if p["kind"] == "outside" else None)
            if text:
                ax.annotate(
                    text,
                    (p["bits_per_weight_experts"], p["kl_mean"]),
                    fontsize=7,
                    xytext=(4, 4),
                    textcoords="offset points",
                )
    if points and all((p.get("kl_mean") or 0) > 0 for p in points if p.get("kl_mean") is not None):
        ax.set_yscale("log")
    ax.set_xlabel("bits per routed-expert weight (scales included)")
    ax.set_ylabel("KL(original ‖ quantized), mean per token")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def _interpolate(xs: list[float], ys: list[float], x: float) -> float:
    for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y0
    return ys[-1]
