"""`moequant apply`: calibrate → plan → quantize → export → evaluate → report, into one output directory.

output/
  stats/          calibration statistics (reused when model, data and settings are unchanged)
  plan.json       the format of every tensor (rewritten only when it changes)
  work/           the resumable state of the quantize pass (removed once the checkpoint exists)
  checkpoint/     the exported checkpoint (written atomically)
  report.json / report.md / report.html

Every stage is resumable or cached, so an interrupted run continues where it stopped and a
rerun with unchanged inputs does no calibration and no planning again.
"""

from __future__ import annotations

import functools
import json
import shutil
import time
from pathlib import Path

from moequant.arch import adapter_for
from moequant.calibrate import CalibrationSettings, calibrate, load_tokenizer
from moequant.checkpoint import atomic_write_text, is_disk_full, open_checkpoint
from moequant.errors import UserError
from moequant.policy import make_plan, plan_to_dict, read_plan, resolve_format, write_plan
from moequant.recipe import Recipe, load_recipe


# recipe name of an export format → export layout name
EXPORT_LAYOUTS = {"fp8-block": "deepseek-fp8"}


def sensitivity_formats(recipe: Recipe) -> tuple[str, ...]:
    """Every format key the plan may give a routed expert, so calibration measures each."""
    entries = list(recipe.experts.formats)
    if recipe.experts.format:
        entries.append(recipe.experts.format)
    for rule in recipe.experts.rules or []:
        entries.append(rule.format)
    keys = []
    for entry in entries:
        key = resolve_format(recipe, entry).key
        if key != "bf16" and key not in keys:
            keys.append(key)
    return tuple(keys)


def calibration_settings(recipe: Recipe, device: str = "cpu", formats: tuple[str, ...] | None = None) -> CalibrationSettings:
    c = recipe.calibration
    formats = formats or sensitivity_formats(recipe)
    return CalibrationSettings(dataset=c.dataset, samples=c.samples, seq_len=c.seq_len, seed=recipe.seed,
                               all_experts=c.all_experts, formats=formats, device=device,
                               probe_samples=c.probe_samples, probe_algorithm=probe_algorithm(recipe, formats))


def probe_algorithm(recipe: Recipe, format_keys) -> str:
    """The recipe's probe algorithm; `auto` is the algorithm the quantize pass will give the probe's
    format (gptq where the recipe says gptq, else rtn: the probe runs no AWQ)."""
    chosen = recipe.calibration.probe_algorithm
    if chosen != "auto":
        return chosen
    from moequant import formats
    from moequant.arch import adapter_for
    from moequant.probe import choose_probe_format

    adapter = adapter_for(open_checkpoint(recipe.model).config)
    key = choose_probe_format(format_keys, [tuple(adapter.expert_shape(p)) for p in adapter.projections])
    if key is None:
        return "rtn"
    return "gptq" if recipe.algorithm_for(formats.parse_key(key).name) == "gptq" else "rtn"


def resolve_recipe(recipe_path, model=None, output=None, overrides=()) -> Recipe:
    overrides = list(overrides)
    if model:
        overrides.append(f"model={model}")
    if output:
        overrides.append(f"output={output}")
    return load_recipe(recipe_path, overrides)


def plan_stage(recipe: Recipe, stats_dir: Path, plan_path: Path):
    """Make the plan; rewrite plan.json only when its content changes (so a rerun reuses it)."""
    plan = make_plan(recipe, open_checkpoint(recipe.model), stats_dir)
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
            raise UserError(f"the disk is full (no space left while writing {where}); free space and run the "
                            "same command again to continue where it stopped.") from None

    return wrapper


@_disk_full_is_a_user_error
def apply(recipe_path=None, model=None, output=None, overrides=(), device: str = "cpu", progress=True,
          log=print) -> Path:
    """Run the whole chain; returns the path of report.html."""
    from moequant.export import export_checkpoint
    from moequant.quantize import quantize_model

    recipe = resolve_recipe(recipe_path, model, output, overrides)
    out = Path(recipe.output)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    ckpt = open_checkpoint(recipe.model)
    adapter = adapter_for(ckpt.config)  # an unsupported architecture is the first thing to say, before its tokenizer
    if adapter.fused_experts and any(a == "awq" for a in recipe.algorithms.values()):  # refused before any work
        raise UserError(f"algorithms: awq is not supported for {adapter.model_type} (fused experts whose activation "
                        "clamps up_proj, so the down_proj scale cannot be folded exactly); accepted there: gptq or rtn.")
    tokenizer = load_tokenizer(ckpt.directory)
    settings = calibration_settings(recipe, device)

    t0 = time.perf_counter()
    stats_dir = out / "stats"
    before = (stats_dir / "summary.json").stat().st_mtime_ns if (stats_dir / "summary.json").exists() else None
    calibrate(recipe.model, stats_dir, settings, overwrite=True, tokenizer=tokenizer, progress=progress)
    reused_stats = before is not None and (stats_dir / "summary.json").stat().st_mtime_ns == before
    timings["calibrate"] = time.perf_counter() - t0
    log(f"calibration statistics: {stats_dir}" + (" (reused)" if reused_stats else ""))

    t0 = time.perf_counter()
    plan, reused_plan = plan_stage(recipe, stats_dir, out / "plan.json")
    timings["plan"] = time.perf_counter() - t0
    log(f"plan: {out / 'plan.json'}" + (" (unchanged, reused)" if reused_plan else ""))

    checkpoint_dir = out / "checkpoint"
    done_marker = out / "checkpoint.json"
    plan_digest = json.dumps(plan_to_dict(plan), sort_keys=True)
    if done_marker.exists() and checkpoint_dir.exists() and json.loads(done_marker.read_text()).get("plan") == plan_digest:
        log(f"checkpoint: {checkpoint_dir} (up to date, reused)")
        quant_report = json.loads(done_marker.read_text())["quantize"]
        timings["quantize"] = timings["export"] = 0.0
        shutil.rmtree(out / "work", ignore_errors=True)  # left when killed right after the marker was written
    else:
        t0 = time.perf_counter()
        # `quantized` also holds the full-precision tensors AWQ folds changed (plain tensors), exported as they are
        quantized, quant_report = quantize_model(recipe.model, plan, settings, out / "work", progress=progress)
        timings["quantize"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        export_checkpoint(ckpt.directory, quantized, checkpoint_dir, layout=EXPORT_LAYOUTS.get(recipe.export.format,
                          recipe.export.format), target=recipe.target,
                          int8_activations=recipe.export.int8_activations, gguf_float=recipe.export.gguf_float,
                          gguf_types={"token_embd.weight": recipe.export.gguf_token_embd,
                                      "output.weight": recipe.export.gguf_output})
        timings["export"] = time.perf_counter() - t0
        quant_report = {str(k): v for k, v in quant_report.items()}
        atomic_write_text(done_marker, json.dumps({"plan": plan_digest, "quantize": quant_report}))
        shutil.rmtree(out / "work", ignore_errors=True)
        log(f"checkpoint: {checkpoint_dir}")

    t0 = time.perf_counter()
    quality = evaluate_stage(recipe, ckpt, checkpoint_dir, progress)
    timings["evaluate"] = time.perf_counter() - t0

    from moequant.recipe import recipe_to_dict
    from moequant.report import build_report

    report = build_report(model=recipe.model, checkpoint=checkpoint_dir, original=ckpt.directory,
                          recipe=recipe_to_dict(recipe), target=recipe.target, plan=plan_to_dict(plan),
                          quality=quality, stats=stats_dir, timings=timings, output_dir=out)
    q = report.get("quality") or {}
    log(f"KL {q.get('kl_mean', float('nan')):.4g}, top-1 agreement {q.get('top1_agreement', float('nan')):.3f}, "
        f"{report['memory'].get('bits_per_weight_experts', float('nan')):.2f} bits per routed-expert weight")
    return out / "report.html"


def evaluate_stage(recipe: Recipe, ckpt, checkpoint_dir: Path, progress=True) -> dict:
    from moequant.evaluate import evaluate_checkpoints

    e = recipe.evaluate
    if recipe.export.format == "gguf":  # llama.cpp itself runs the GGUF (moequant.verify_llamacpp)
        from moequant.export_gguf import GGUF_FILE
        from moequant.verify_llamacpp import evaluate_gguf

        return evaluate_gguf(checkpoint_dir / GGUF_FILE, ckpt.directory, dataset=e.dataset, samples=e.samples,
                             seq_len=e.seq_len, seed=recipe.seed)
    return evaluate_checkpoints(checkpoint_dir, ckpt.directory, dataset=e.dataset, samples=e.samples,
                                seq_len=e.seq_len, seed=recipe.seed, progress=progress)
