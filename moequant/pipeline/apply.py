"""`moequant apply`: calibrate → plan → quantize → export → evaluate → report, into one output directory.

output/
  stats/          calibration statistics (reused when model, data and settings are unchanged)
  plan.json       the format of every tensor (rewritten only when it changes)
  work/           the resumable state of the quantize pass (removed once the checkpoint exists)
  checkpoint/     the exported checkpoint (written atomically)
  checkpoint.json the plan checkpoint/ was made from and the quantize report (a rerun with that plan reuses it)
  report.json / report.md / report.html

Every stage is resumable or cached, so an interrupted run continues where it stopped and a
rerun with unchanged inputs does no calibration and no planning again.

One run at a time writes a directory (moequant.io.run_lock), and plan.json, the checkpoint and the
report carry one run fingerprint (moequant.io.fingerprint): a checkpoint of another run is remade.

The source checkpoint is opened once, into a Run (moequant.pipeline.run) that every stage is handed;
`pareto` runs the same stage functions for each of its points.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import time
from pathlib import Path

from moequant import memory_budget, parallel, timing
from moequant.errors import UserError
from moequant.io.checkpoint import atomic_write_text, is_disk_full, open_checkpoint
from moequant.io.fingerprint import (
    KEY,
    checkpoint_fingerprint,
    file_fingerprint,
    stamp_checkpoint,
)
from moequant.io.run_lock import output_lock
from moequant.layouts import layout_for
from moequant.measure.calibrate import CalibrationSettings, calibrate, model_fingerprint
from moequant.pipeline.precheck import check_recipe, check_run
from moequant.pipeline.run import Run, hold_lock, open_run
from moequant.plan.measurements import calibration_settings
from moequant.plan.plan_io import plan_to_dict, read_plan, write_plan
from moequant.plan.policy import make_plan
from moequant.plan.recipe import Recipe, load_recipe, recipe_to_dict
from moequant.plan.rules import needs_statistics


def run_fingerprint(recipe, ckpt, settings, plan) -> str:
    """The run fingerprint (moequant.io.fingerprint) of a recipe, model, calibration data and plan."""
    body = {
        "recipe": {k: v for k, v in recipe_to_dict(recipe).items() if k not in ("output", "model", "evaluate")},
        "model": model_fingerprint(ckpt),
        "data": settings.fingerprint_fields(),
        "plan": {k: v for k, v in plan_to_dict(plan).items() if k not in ("recipe", "model", KEY)},
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def export_arguments(recipe: Recipe) -> dict:
    """`export_checkpoint`'s layout, target and activation settings for a recipe (apply and pareto)."""
    return {
        "layout": layout_for(recipe.export.format).name,
        "target": recipe.target,
        "int8_activations": recipe.export.int8_activations,
        "gguf_float": recipe.export.gguf_float,
        "gguf_types": recipe.export.gguf_types,
    }


DEFAULT_RECIPE = "selective"  # what a command without --recipe runs: the bundled default (README's set-up line)


def resolve_recipe(recipe_path, model=None, output=None, overrides=()) -> Recipe:
    """The recipe at `recipe_path` (None: the bundled DEFAULT_RECIPE) with --model / --output / --set applied.
    Every command that runs a recipe starts here, so an old GPU-math environment variable is refused first."""
    from moequant.algorithms.gpu_math import refuse_old_variables

    refuse_old_variables()
    overrides = list(overrides)
    if model:
        overrides.append(f"model={model}")
    if output:
        overrides.append(f"output={output}")
    return load_recipe(DEFAULT_RECIPE if recipe_path is None else recipe_path, overrides)


def _make_run_plan(run: Run, stats_dir: Path | None):
    """The precheck's whole plan of a recipe that reads no statistics, else make_plan from the precheck's shape part."""
    if stats_dir is None and run.plan is not None:
        return run.plan
    return make_plan(run.recipe, run.source, stats_dir, run.plan_shapes)


def plan_stage(run: Run, stats_dir: Path | None, settings: CalibrationSettings):
    """Make the plan; rewrite OUTPUT/plan.json only when its content changes (so a rerun reuses it).
    Returns (the plan, whether plan.json was reused)."""
    plan_path = run.directory / "plan.json"
    plan = _make_run_plan(run, stats_dir)
    plan.run_fingerprint = run_fingerprint(run.recipe, run.source, settings, plan)
    if plan_path.exists():
        try:
            if plan_to_dict(read_plan(plan_path)) == json.loads(json.dumps(plan_to_dict(plan))):
                return read_plan(plan_path), True
        except UserError:
            pass
    write_plan(plan, plan_path)
    return plan, False


def _disk_full_is_a_user_error(fn):
    """A full disk at any stage is one sentence (exit code 2), not a traceback; the finished
    stages stay on disk, so the same command continues once there is space."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as error:
            if not is_disk_full(error):
                raise
            where = getattr(error, "filename", None) or "the output directory"
            raise UserError(
                f"the disk is full (no space left while writing {where}); free space and run the "
                "same command again to continue where it stopped."
            ) from None

    return wrapper


@_disk_full_is_a_user_error
def apply(
    recipe_path=None,
    model=None,
    output=None,
    overrides=(),
    device: str = "cpu",
    progress=True,
    log=print,
    overwrite: bool = False,
) -> Path:
    """Run the whole chain; returns the path of report.html (None on the other ranks of an expert-parallel run:
    under torchrun, moequant.parallel, rank 0 prints, writes and reports). Calibration statistics of other
    settings (or that the recipe does not read) in OUTPUT/stats are refused, as `calibrate` refuses them,
    unless `overwrite`."""
    timing.start()  # report.json's timings: where every second of the run went (moequant.timing)
    if parallel.is_helper_rank():
        progress, log = False, _silent
    recipe = resolve_recipe(recipe_path, model, output, overrides)
    memory_budget.check_device(device)  # a device this machine lacks, before anything is read or written
    # a bad or unreadable checkpoint is refused before anything is written, then an unsupported architecture
    run = open_run(recipe, device, progress, log)
    run.overwrite = overwrite
    check_run(run)  # what the recipe, the shapes and the machine refuse, before anything is written
    run.device = parallel.start(run.adapter.num_experts, device)  # joins the torchrun job when WORLD_SIZE > 1
    memory_budget.bound_allocator(run.device)  # what the allocator reserves, not only what is allocated
    made = not run.directory.exists()
    with hold_lock(run, "apply"):  # the lock before anything is written into the directory
        try:
            return _apply(run)
        except UserError:
            if made and not parallel.is_helper_rank():  # bad input found while reading the weights (NaN scales,
                shutil.rmtree(
                    run.directory, ignore_errors=True
                )  # broken codes, ...): this call made the directory, nobody's earlier work
            raise


def _silent(*_args, **_kwargs) -> None:
    """The log of a rank other than 0 (rank 0 says it once)."""


def _apply(run: Run) -> Path:
    timing.claim("setup")  # every second so far: opening the model, the prechecks, the lock
    out, log = run.directory, run.log
    out.mkdir(parents=True, exist_ok=True)  # the lock made it; not on ranks other than 0
    world = parallel.world()
    ranks = world.size if world is not None else 1
    timings: dict[str, float] = {}
    reads_statistics = needs_statistics(run.recipe)
    settings = calibration_settings(run.recipe, run.device, ckpt=run.source)
    if run.recipe.experts.prune is not None:  # the smaller model is the source from here on (pipeline.prune)
        from moequant.pipeline.prune import prune_stage

        with timing.stage("prune", whole=True):
            run = prune_stage(run, settings)
        settings = calibration_settings(run.recipe, run.device, ckpt=run.source)

    with timing.stage("calibrate", whole=True):
        stats_dir = calibrate_stage(run, settings) if reads_statistics else _no_calibration(run)
    with timing.stage("plan"):
        plan, reused_plan = parallel.shared(lambda: plan_stage(run, stats_dir, settings), "the plan")
    log(f"plan: {out / 'plan.json'}" + (" (unchanged, reused)" if reused_plan else ""))

    _checkpoint_stage(run, plan, settings, world, timings)
    if world is not None and world.rank != 0:
        return None  # rank 0 alone exports, evaluates and reports

    run.output, quality = evaluate_output(run, timings)
    with timing.stage("report"):  # report.json's timings: every second until the report, "other" included
        report = report_stage(run, plan_to_dict(plan), quality, stats_dir, timing.account(), ranks)
    q = report.get("quality") or {}
    log(
        f"KL {q.get('kl_mean', float('nan')):.4g}, top-1 agreement {q.get('top1_agreement', float('nan')):.3f}, "
        f"{report['memory'].get('bits_per_weight_experts', float('nan')):.3f} bits per routed-expert weight"
    )
    return out / "report.html"


def _no_calibration(run: Run) -> None:
    """The calibration stage of a plan that reads no statistics: none, and OUTPUT/stats of an earlier run removed
    when `run.overwrite` (else refused, as `calibrate` refuses statistics of other settings; GPTQ / AWQ collect
    their inputs in the quantize pass; the report's routing shares come from the evaluation)."""
    stats = run.directory / "stats"
    if (stats / "summary.json").exists() and not run.overwrite:
        raise UserError(
            f"{stats} holds calibration statistics of an earlier run, which this recipe does not read (its plan "
            "needs none); pass --overwrite to remove them, or choose another --output."
        )
    if not parallel.is_helper_rank():
        shutil.rmtree(stats, ignore_errors=True)  # never report another run's statistics
    run.log("calibration: not needed by this recipe (its plan reads no statistics)")
    return None


def calibrate_stage(run: Run, settings: CalibrationSettings) -> Path:
    """The calibration statistics of `settings` in OUTPUT/stats, reused when a run of the same model, data and
    settings left them (`apply`'s stage, and `pareto`'s one calibration); statistics of other settings are
    replaced only when `run.overwrite`, else refused in one sentence. Returns the directory."""
    stats_dir = run.directory / "stats"
    summary = stats_dir / "summary.json"
    before = summary.stat().st_mtime_ns if summary.exists() else None
    calibrate(run.source, stats_dir, settings, overwrite=run.overwrite, progress=run.progress)
    reused = before is not None and summary.stat().st_mtime_ns == before  # calibrate leaves equal statistics alone
    run.log(f"calibration statistics: {stats_dir}" + (" (reused)" if reused else ""))
    return stats_dir


def _checkpoint_stage(run: Run, plan, settings: CalibrationSettings, world, timings: dict) -> dict | None:
    """OUTPUT/checkpoint for the plan: reused when checkpoint.json says this plan and run made it, else
    quantized and exported (timings["quantize"], ["export"]). Returns the quantize report, or None on
    the ranks other than 0 of an expert-parallel run (rank 0 alone exports)."""
    out, log = run.directory, run.log
    checkpoint_dir = out / "checkpoint"
    done_marker = out / "checkpoint.json"
    plan_digest = json.dumps(plan_to_dict(plan), sort_keys=True)
    marker = json.loads(done_marker.read_text()) if done_marker.exists() else {}
    found = checkpoint_fingerprint(checkpoint_dir) if checkpoint_dir.exists() else None
    if checkpoint_dir.exists() and found != plan.run_fingerprint:  # e.g. a checkpoint copied in from another run
        log(
            f"checkpoint: {checkpoint_dir} belongs to another run (run fingerprint {found or 'missing'}, this run's "
            f"{plan.run_fingerprint}); quantizing again"
        )
    reuse = marker.get("plan") == plan_digest and marker.get(KEY) == found == plan.run_fingerprint
    if not parallel.shared(lambda: reuse, "the checkpoint's reuse check"):
        return quantize_and_export(run, plan, settings, plan_digest, world, timings)
    parallel.finish()
    if world is not None and world.rank != 0:
        return None
    log(f"checkpoint: {checkpoint_dir} (up to date, reused)")
    quant_report = json.loads(done_marker.read_text())["quantize"]
    timings["quantize"] = timings["export"] = 0.0
    shutil.rmtree(out / "work", ignore_errors=True)  # left when killed right after the marker was written
    return quant_report


def quantize_and_export(
    run: Run, plan, settings: CalibrationSettings, plan_digest: str, world, timings: dict
) -> dict | None:
    """The quantize pass (every rank), then rank 0 exports OUTPUT/checkpoint and writes checkpoint.json
    (`apply`'s stage, and each run of `pareto`). Returns the quantize report, or None on the other ranks."""
    from moequant.export.streamed import StreamedExport
    from moequant.export.write import export_checkpoint
    from moequant.pipeline.quantize import quantize_model

    out = run.directory
    checkpoint_dir = out / "checkpoint"
    t0 = time.perf_counter()
    arguments = export_arguments(run.recipe)
    streamed = None  # GGUF: one file whose header lists every tensor first, written from the work files
    if layout_for(arguments["layout"]).container == "safetensors":  # each layer written as shards when quantized
        streamed = StreamedExport(
            run.source,
            run.adapter,
            plan,
            out / "work",
            **{k: arguments[k] for k in ("layout", "target", "int8_activations")},
        )
    # streamed: `quantized` holds only the tensors outside the decoder layers (the layers are in work/'s shards);
    # GGUF: it also holds the full-precision tensors AWQ folds changed (plain tensors), exported as they are,
    # and lazy: the export reads each tensor's codes from work/ as it writes them (host RAM stays at one layer)
    quantized, quant_report = quantize_model(
        run.source, plan, settings, out / "work", progress=run.progress, lazy=True, export=streamed
    )
    parallel.finish()  # the expert-parallel part ends: rank 0 alone exports, evaluates and reports
    if world is not None and world.rank != 0:
        return None
    timings["quantize"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with timing.stage("export"):  # streamed: the layers' shards linked into place, the rest written
        if streamed is not None:
            streamed.finish(checkpoint_dir, quantized, ranks=world.size if world is not None else 1)
        else:
            export_checkpoint(run.source, quantized, checkpoint_dir, **arguments)
        del quantized
    timings["export"] = time.perf_counter() - t0
    stamp_checkpoint(checkpoint_dir, plan.run_fingerprint)
    quant_report = {str(k): v for k, v in quant_report.items()}
    atomic_write_text(
        out / "checkpoint.json", json.dumps({"plan": plan_digest, KEY: plan.run_fingerprint, "quantize": quant_report})
    )
    shutil.rmtree(out / "work", ignore_errors=True)
    run.log(f"checkpoint: {checkpoint_dir}")
    return quant_report


def evaluate_output(run: Run, timings: dict):
    """OUTPUT/checkpoint against the source (`apply`'s stage, and each run of `pareto`; timings["evaluate"]).
    Returns (the output, opened once for the evaluation and the report — a GGUF export stays its
    directory: llama.cpp and gguf-py read its file — and the evaluation's result)."""
    from moequant.evaluate import evaluate_checkpoints

    recipe, checkpoint_dir = run.recipe, run.directory / "checkpoint"
    e = recipe.evaluate
    settings = dict(dataset=e.dataset, samples=e.samples, seq_len=e.seq_len, seed=recipe.seed, progress=run.progress)
    t0 = time.perf_counter()
    with timing.stage("evaluate", whole=True):  # its reads and forwards inside
        if layout_for(recipe.export.format).container == "gguf":  # llama.cpp runs it (moequant.llamacpp.evaluate)
            from moequant.export.gguf import GGUF_FILE
            from moequant.llamacpp.evaluate import evaluate_gguf

            output = checkpoint_dir
            quality = evaluate_gguf(Path(checkpoint_dir) / GGUF_FILE, run.source.directory, **settings)
        else:
            output = open_checkpoint(checkpoint_dir)
            quality = evaluate_checkpoints(output, run.source, **settings)
    timings["evaluate"] = time.perf_counter() - t0
    return output, quality


def report_stage(run: Run, plan: dict, quality: dict, stats_dir: Path | None, timings: dict, ranks: int = 1) -> dict:
    """report.json / report.md / report.html in OUTPUT for `run.output` against the source (`apply`'s stage,
    and each run of `pareto`). Returns report.json's dict."""
    from moequant.report import build_report

    return build_report(
        model=run.recipe.model,
        checkpoint=run.output,
        original=run.source,
        recipe=recipe_to_dict(run.recipe),
        target=run.recipe.target,
        plan=plan,
        quality=quality,
        stats=stats_dir,
        timings=timings,
        output_dir=run.directory,
        ranks=ranks,
    )


def run_plan(recipe_path=None, model=None, output=None, overrides=(), stats=None, device: str = "cpu"):
    """`moequant plan`: the plan of a recipe (statistics from `stats`, default OUTPUT/stats, when they
    exist) written to OUTPUT/plan.json with its run fingerprint. Returns (plan, path)."""
    recipe = resolve_recipe(recipe_path, model, output, overrides)
    out = Path(recipe.output)
    ckpt = open_checkpoint(recipe.model)
    run = Run(recipe, ckpt, out, device)
    check_recipe(recipe, ckpt, run)  # what shapes alone refuse, before the directory is touched; planned once
    stats_dir = Path(stats) if stats else out / "stats"
    found = (stats_dir / "summary.json").exists()
    if not found and (stats or needs_statistics(recipe)):
        same = " ".join(f"--{k} {v}" for k, v in (("recipe", recipe_path), ("model", model), ("output", output)) if v)
        raise UserError(
            f"no calibration statistics in {stats_dir} (no summary.json there); run `moequant calibrate"
            f"{' ' + same if same else ''}` first (it writes them there), or pass --stats DIR."
        )
    with output_lock(out, "plan"):
        plan = _make_run_plan(run, stats_dir if found else None)
        plan.run_fingerprint = run_fingerprint(recipe, ckpt, calibration_settings(recipe, device, ckpt=ckpt), plan)
        return plan, write_plan(plan, out / "plan.json")


def evaluate_into(checkpoint, reference, output, **settings) -> dict:
    """`moequant eval --output DIR`: evaluate and write DIR/eval.json (with the checkpoint's run
    fingerprint). Refused when DIR/plan.json belongs to another run than the checkpoint."""
    from moequant.evaluate import evaluate_checkpoints

    out = Path(output)
    with output_lock(out, "eval"):
        theirs, ours = file_fingerprint(out / "plan.json"), checkpoint_fingerprint(checkpoint)
        if theirs is not None and ours != theirs:
            made_by = f"run {ours}" if ours else "no moequant run"
            raise UserError(
                f"{out} holds run {theirs} (its plan.json) but {checkpoint} was made by {made_by}; "
                "write this evaluation to another --output."
            )
        result = evaluate_checkpoints(checkpoint, reference, **settings)
        result[KEY] = ours
        atomic_write_text(out / "eval.json", json.dumps(result, indent=2, default=str) + "\n")
        return result
