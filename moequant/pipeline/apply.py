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
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import shutil
import time
from pathlib import Path

from moequant import parallel
from moequant.arch import adapter_for
from moequant.calib.calibrate import CalibrationSettings, calibrate, load_tokenizer, model_fingerprint
from moequant.errors import UserError
from moequant.export.layouts import layout_for
from moequant.formats import parse_key
from moequant.io.checkpoint import atomic_write_text, is_disk_full, open_checkpoint
from moequant.io.fingerprint import (
    KEY,
    checkpoint_fingerprint,
    file_fingerprint,
    stamp_checkpoint,
)
from moequant.io.run_lock import output_lock
from moequant.pipeline.precheck import check_memory, check_recipe
from moequant.plan.plan_io import plan_to_dict, read_plan, write_plan
from moequant.plan.policy import GRANULARITY, make_plan, needs_statistics
from moequant.plan.recipe import Recipe, load_recipe, recipe_to_dict, resolve_format


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


def sensitivity_formats(recipe: Recipe) -> tuple[str, ...]:
    """Every format key the plan may give a routed expert, so calibration measures each."""
    entries = list(recipe.experts.formats)
    if recipe.experts.format:
        entries.append(recipe.experts.format)
    for rule in recipe.experts.rules or []:
        entries.append(rule.format)
    keys = []
    for entry in entries:
        spec = resolve_format(recipe, entry)
        if spec.quantized and spec.key not in keys:
            keys.append(spec.key)
    return tuple(keys)


def calibration_settings(
    recipe: Recipe, device: str = "cpu", formats: tuple[str, ...] | None = None, ckpt=None
) -> CalibrationSettings:
    c = recipe.calibration
    formats = formats or sensitivity_formats(recipe)
    # the probe scales a budget's predicted losses; plans without a budget never read it. Its cost
    # grows with layers² (one stream per probed layer), so past PROBE_MAX_EXPERT_PARAMS routed-expert
    # parameters it runs only when the recipe asks for it by name
    probe_samples = c.probe_samples if recipe.experts.method == "budget" else 0
    if (
        probe_samples
        and "probe_samples" not in c.model_fields_set
        and _routed_params(recipe, ckpt) > PROBE_MAX_EXPERT_PARAMS
    ):
        probe_samples = 0
    return CalibrationSettings(
        dataset=c.dataset,
        samples=c.samples,
        seq_len=c.seq_len,
        seed=recipe.seed,
        all_experts=c.all_experts,
        formats=formats,
        device=device,
        probe_samples=probe_samples,
        probe_algorithm=probe_algorithm(recipe, formats, ckpt) if probe_samples else "rtn",
        compute_dtype=c.compute_dtype,
        tensor_formats=tensor_formats(recipe),
        hessian_weighting=c.hessian_weighting,
        gptq=recipe.gptq,
        probe_projections=bool(probe_samples) and GRANULARITY[recipe.target] == "layer_proj",
    )


def tensor_formats(recipe: Recipe) -> tuple[str, ...]:
    """The format keys the budget may give non-expert tensors (calibration's per-tensor probe measures each)."""
    if recipe.experts.method != "budget":
        return ()
    keys = []
    for entry in recipe.non_experts.formats:
        spec = resolve_format(recipe, entry)
        if spec.quantized and spec.key not in keys:
            keys.append(spec.key)
    return tuple(keys)


PROBE_MAX_EXPERT_PARAMS = 2 * 10**9  # the default probe's limit (routed-expert parameters)


def _routed_params(recipe: Recipe, ckpt=None) -> int:
    ckpt = open_checkpoint(ckpt or recipe.model)
    adapter = adapter_for(ckpt.config)
    shape = [adapter.expert_shape(p) for p in adapter.projections]
    return len(adapter.moe_layers) * adapter.num_experts * sum(o * i for o, i in shape)


def probe_algorithm(recipe: Recipe, format_keys, ckpt=None) -> str:
    """The recipe's probe algorithm; `auto` is the registered algorithm the quantize pass will give the
    probe's format, as the probe measures it (gptq where the recipe says gptq, else rtn: the probe runs no AWQ)."""
    chosen = recipe.calibration.probe_algorithm
    if chosen != "auto":
        return chosen
    from moequant.arch import adapter_for
    from moequant.calib.probe import auto_probe_algorithm

    adapter = adapter_for(open_checkpoint(ckpt or recipe.model).config)
    shapes = [tuple(adapter.expert_shape(p)) for p in adapter.projections]
    return auto_probe_algorithm(format_keys, shapes, recipe.algorithm_for)


def resolve_recipe(recipe_path, model=None, output=None, overrides=()) -> Recipe:
    overrides = list(overrides)
    if model:
        overrides.append(f"model={model}")
    if output:
        overrides.append(f"output={output}")
    return load_recipe(recipe_path, overrides)


def plan_stage(recipe: Recipe, stats_dir: Path, plan_path: Path, settings: CalibrationSettings, ckpt=None):
    """Make the plan; rewrite plan.json only when its content changes (so a rerun reuses it)."""
    ckpt = open_checkpoint(ckpt or recipe.model)
    plan = make_plan(recipe, ckpt, stats_dir)
    plan.run_fingerprint = run_fingerprint(recipe, ckpt, settings, plan)
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
    recipe_path=None, model=None, output=None, overrides=(), device: str = "cpu", progress=True, log=print
) -> Path:
    """Run the whole chain; returns the path of report.html (None on the other ranks of an expert-parallel run:
    under torchrun, moequant.parallel, rank 0 prints, writes and reports)."""
    if parallel.is_helper_rank():
        progress, log = False, _silent
    recipe = resolve_recipe(recipe_path, model, output, overrides)
    out = Path(recipe.output)
    ckpt = open_checkpoint(recipe.model)  # a bad or unreadable checkpoint is refused before anything is written
    adapter = adapter_for(ckpt.config)  # an unsupported architecture is the first thing to say, before its tokenizer
    for note in check_recipe(recipe, ckpt):  # what shapes alone refuse, before anything is written
        log(f"note: {note}")
    check_memory(recipe, adapter, device)  # a layer that cannot fit the GPU budget, before any weight is read
    load_tokenizer(ckpt.directory)  # a checkpoint without tokenizer files, too
    if parallel.world_size() > 1 and "awq" in {
        recipe.algorithm_for(parse_key(k).name) for k in sensitivity_formats(recipe)
    }:
        raise UserError(
            "algorithm awq runs in one process only (its shared gate/up scale is searched over all of a "
            "layer's experts together); run it without torchrun, or use gptq or rtn."
        )
    device = parallel.start(adapter.num_experts, device)  # joins the torchrun job when WORLD_SIZE > 1
    made = not out.exists()
    with contextlib.ExitStack() as held:  # the lock before anything is written into the directory (rank 0 takes it)
        parallel.shared(lambda: held.enter_context(output_lock(recipe.output, "apply")), "the run directory's lock")
        try:
            return _apply(recipe, out, ckpt, device, progress, log)
        except UserError:
            if made and not parallel.is_helper_rank():  # bad input found while reading the weights (NaN scales,
                shutil.rmtree(
                    out, ignore_errors=True
                )  # broken codes, ...): this call made `out`, nobody's earlier work
            raise


def _silent(*_args, **_kwargs) -> None:
    """The log of a rank other than 0 (rank 0 says it once)."""


def _apply(recipe: Recipe, out: Path, ckpt, device: str, progress, log) -> Path:
    out.mkdir(parents=True, exist_ok=True)  # the lock made it; not on ranks other than 0
    world = parallel.world()
    ranks = world.size if world is not None else 1
    timings: dict[str, float] = {}
    tokenizer = load_tokenizer(ckpt.directory)
    settings = calibration_settings(recipe, device, ckpt=ckpt)

    t0 = time.perf_counter()
    stats_dir = _calibration_stage(recipe, ckpt, out / "stats", settings, tokenizer, progress, log)
    timings["calibrate"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    plan, reused_plan = parallel.shared(
        lambda: plan_stage(recipe, stats_dir, out / "plan.json", settings, ckpt), "the plan"
    )
    timings["plan"] = time.perf_counter() - t0
    log(f"plan: {out / 'plan.json'}" + (" (unchanged, reused)" if reused_plan else ""))

    checkpoint_dir = out / "checkpoint"
    _checkpoint_stage(recipe, ckpt, plan, settings, out, world, timings, progress, log)
    if world is not None and world.rank != 0:
        return None  # rank 0 alone exports, evaluates and reports

    output, quality = evaluate_output(recipe, ckpt, checkpoint_dir, timings, progress)

    from moequant.report import build_report

    report = build_report(
        model=recipe.model,
        checkpoint=output,
        original=ckpt,
        recipe=recipe_to_dict(recipe),
        target=recipe.target,
        plan=plan_to_dict(plan),
        quality=quality,
        stats=stats_dir,
        timings=timings,
        output_dir=out,
        ranks=ranks,
    )
    q = report.get("quality") or {}
    log(
        f"KL {q.get('kl_mean', float('nan')):.4g}, top-1 agreement {q.get('top1_agreement', float('nan')):.3f}, "
        f"{report['memory'].get('bits_per_weight_experts', float('nan')):.3f} bits per routed-expert weight"
    )
    return out / "report.html"


def _calibration_stage(
    recipe: Recipe, ckpt, stats_dir: Path, settings: CalibrationSettings, tokenizer, progress, log
) -> Path | None:
    """The calibration statistics in `stats_dir` (reused when unchanged), or None when the plan reads none."""
    if needs_statistics(recipe):
        before = (stats_dir / "summary.json").stat().st_mtime_ns if (stats_dir / "summary.json").exists() else None
        calibrate(ckpt, stats_dir, settings, overwrite=True, tokenizer=tokenizer, progress=progress)
        reused_stats = before is not None and (stats_dir / "summary.json").stat().st_mtime_ns == before
        log(f"calibration statistics: {stats_dir}" + (" (reused)" if reused_stats else ""))
        return stats_dir
    # the plan reads no statistics; GPTQ / AWQ collect their inputs in the quantize pass and the
    # report's routing shares come from the evaluation tokens
    if not parallel.is_helper_rank():
        shutil.rmtree(stats_dir, ignore_errors=True)  # never report another run's statistics
    log("calibration: not needed by this recipe (its plan reads no statistics)")
    return None


def _checkpoint_stage(
    recipe: Recipe, ckpt, plan, settings: CalibrationSettings, out: Path, world, timings: dict, progress, log
) -> dict | None:
    """OUTPUT/checkpoint for the plan: reused when checkpoint.json says this plan and run made it, else
    quantized and exported (timings["quantize"], ["export"]). Returns the quantize report, or None on
    the ranks other than 0 of an expert-parallel run (rank 0 alone exports)."""
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
        return quantize_and_export(recipe, ckpt, plan, settings, out, plan_digest, world, timings, progress, log)
    parallel.finish()
    if world is not None and world.rank != 0:
        return None
    log(f"checkpoint: {checkpoint_dir} (up to date, reused)")
    quant_report = json.loads(done_marker.read_text())["quantize"]
    timings["quantize"] = timings["export"] = 0.0
    shutil.rmtree(out / "work", ignore_errors=True)  # left when killed right after the marker was written
    return quant_report


def quantize_and_export(
    recipe: Recipe,
    ckpt,
    plan,
    settings: CalibrationSettings,
    out: Path,
    plan_digest: str,
    world,
    timings: dict,
    progress,
    log,
) -> dict | None:
    """The quantize pass (every rank), then rank 0 exports OUTPUT/checkpoint and writes checkpoint.json
    (`apply`'s stage, and each run of `pareto`). Returns the quantize report, or None on the other ranks."""
    from moequant.export.layouts import export_checkpoint
    from moequant.export.streamed import StreamedExport
    from moequant.pipeline.quantize import quantize_model

    checkpoint_dir = out / "checkpoint"
    t0 = time.perf_counter()
    arguments = export_arguments(recipe)
    streamed = None  # GGUF: one file whose header lists every tensor first, written from the work files
    if arguments["layout"] != "gguf":  # every layer is written as the output's shards as it is quantized
        streamed = StreamedExport(
            ckpt,
            adapter_for(ckpt.config),
            plan,
            out / "work",
            **{k: arguments[k] for k in ("layout", "target", "int8_activations")},
        )
    # streamed: `quantized` holds only the tensors outside the decoder layers (the layers are in work/'s shards);
    # GGUF: it also holds the full-precision tensors AWQ folds changed (plain tensors), exported as they are,
    # and lazy: the export reads each tensor's codes from work/ as it writes them (host RAM stays at one layer)
    quantized, quant_report = quantize_model(
        ckpt, plan, settings, out / "work", progress=progress, lazy=True, export=streamed
    )
    parallel.finish()  # the expert-parallel part ends: rank 0 alone exports, evaluates and reports
    if world is not None and world.rank != 0:
        return None
    timings["quantize"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if streamed is not None:
        streamed.finish(checkpoint_dir, quantized, ranks=world.size if world is not None else 1)
    else:
        export_checkpoint(ckpt, quantized, checkpoint_dir, **arguments)
    del quantized
    timings["export"] = time.perf_counter() - t0
    stamp_checkpoint(checkpoint_dir, plan.run_fingerprint)
    quant_report = {str(k): v for k, v in quant_report.items()}
    atomic_write_text(
        out / "checkpoint.json", json.dumps({"plan": plan_digest, KEY: plan.run_fingerprint, "quantize": quant_report})
    )
    shutil.rmtree(out / "work", ignore_errors=True)
    log(f"checkpoint: {checkpoint_dir}")
    return quant_report


def evaluate_output(recipe: Recipe, ckpt, checkpoint_dir: Path, timings: dict, progress=True):
    """The exported output against the source (`apply`'s stage, and each run of `pareto`; timings["evaluate"]).
    Returns (the output, opened once for the evaluation and the report — a GGUF export stays its
    directory: llama.cpp and gguf-py read its file — and the evaluation's result)."""
    from moequant.evaluate import evaluate_checkpoints

    e = recipe.evaluate
    settings = dict(dataset=e.dataset, samples=e.samples, seq_len=e.seq_len, seed=recipe.seed, progress=progress)
    t0 = time.perf_counter()
    if recipe.export.format == "gguf":  # llama.cpp itself runs the GGUF (moequant.export.verify_llamacpp)
        from moequant.export.gguf import GGUF_FILE
        from moequant.export.verify_llamacpp import evaluate_gguf

        output = checkpoint_dir
        quality = evaluate_gguf(Path(checkpoint_dir) / GGUF_FILE, ckpt.directory, **settings)
    else:
        output = open_checkpoint(checkpoint_dir)
        quality = evaluate_checkpoints(output, ckpt, **settings)
    timings["evaluate"] = time.perf_counter() - t0
    return output, quality


def run_plan(recipe_path=None, model=None, output=None, overrides=(), stats=None, device: str = "cpu"):
    """`moequant plan`: the plan of a recipe (statistics from `stats`, default OUTPUT/stats, when they
    exist) written to OUTPUT/plan.json with its run fingerprint. Returns (plan, path)."""
    recipe = resolve_recipe(recipe_path, model, output, overrides)
    out = Path(recipe.output)
    ckpt = open_checkpoint(recipe.model)
    check_recipe(recipe, ckpt)  # what shapes alone refuse, before the directory is touched
    stats_dir = Path(stats) if stats else out / "stats"
    found = (stats_dir / "summary.json").exists()
    if not found and (stats or needs_statistics(recipe)):
        same = " ".join(f"--{k} {v}" for k, v in (("recipe", recipe_path), ("model", model), ("output", output)) if v)
        raise UserError(
            f"no calibration statistics in {stats_dir} (no summary.json there); run `moequant calibrate"
            f"{' ' + same if same else ''}` first (it writes them there), or pass --stats DIR."
        )
    with output_lock(out, "plan"):
        plan = make_plan(recipe, ckpt, stats_dir if found else None)
        plan.run_fingerprint = run_fingerprint(recipe, ckpt, calibration_settings(recipe, device), plan)
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
