"""The `moequant` command line: parse, validate, call one library function per command.

Bad input raises `UserError`; it is printed as one sentence and the exit code is 2.
"""

from __future__ import annotations

import functools
import json
import os
import sys

# Before torch loads OpenMP: its idle worker threads sleep instead of spinning. On a CPU shared with other work
# a spinning thread holds the core the thread it waits for needs: on this 2-core machine at load 10 a layer
# forward took 13x and a ggml quantization 200x as long as with one thread (benchmarks/RESULTS.md, bench_gguf).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import click

from moequant.errors import RankLost, UserError
from moequant.pipeline.pareto import DEFAULT_UNIFORM  # light: its heavy imports are inside its functions

INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped with Ctrl-C
WRITERS = (
    "calibrate",
    "plan",
    "apply",
    "pareto",
    "report",
)  # commands that write an output directory (eval: with --output)
DEVICE_HELP = "Where the model runs: cpu, cuda or cuda:N."


def user_errors(fn):
    """Turn a UserError into one line on stderr and exit code 2 (no traceback); a lost rank of an
    expert-parallel run (RankLost) into one line and exit code 1; Ctrl-C into one line and exit code 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            writes = fn.__name__ in WRITERS or (fn.__name__ == "eval_command" and kwargs.get("output"))
            click.echo(
                "\ninterrupted: "
                + (
                    "the finished stages and layers are kept in the output directory (a "
                    "half-written file never is); run the same command again to resume."
                    if writes
                    else "nothing was written."
                ),
                err=True,
            )
            sys.exit(INTERRUPTED)
        except UserError as e:
            from moequant.parallel import says_errors

            if says_errors() and not getattr(e, "said_by_rank0", False):  # a torchrun job says a refusal once
                click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except RankLost as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except OSError as e:  # the OS refused a path the user gave (stages check most paths themselves)
            from moequant.errors import PATH_ERRNOS, path_refusal

            if e.errno not in PATH_ERRNOS or not e.filename:
                raise
            click.echo(
                f"error: cannot use {e.filename}: {path_refusal(e, e.filename)}; check the path or choose another one.",
                err=True,
            )
            sys.exit(2)
        except Exception as e:  # a CUDA OOM the budget did not foresee: one sentence, the run stays resumable
            if type(e).__name__ != "OutOfMemoryError":
                raise
            click.echo(
                f"error: the GPU ran out of memory ({str(e).splitlines()[0][:160]}); finished layers are kept "
                "and a rerun resumes there: rerun with a smaller --max-gpu-memory, or with fewer calibration "
                "samples per batch.",
                err=True,
            )
            sys.exit(2)

    return wrapper


EXPERT_PARALLEL = ("apply", "calibrate")  # commands that split experts across torchrun's ranks (moequant.parallel)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moequant")
@click.pass_context
def main(ctx):
    """Per-expert quantization for Mixture-of-Experts language models."""
    from moequant.parallel import is_helper_rank

    if is_helper_rank() and ctx.invoked_subcommand not in EXPERT_PARALLEL:
        ctx.exit(0)  # under torchrun the other commands run on rank 0 alone


def memory_options(fn):
    """--max-gpu-memory / --max-host-memory: the run's one memory budget (moequant.memory_budget)."""

    def configure(ctx, param, value):  # every invocation sets both caps (None: what is free)
        from moequant import memory_budget

        try:
            memory_budget.parse_bytes(value, f"--{param.name.replace('_', '-')}-memory") if value is not None else None
        except UserError as e:
            raise click.BadParameter(str(e)) from None
        ctx.meta[param.name] = value
        if "max_gpu" in ctx.meta and "max_host" in ctx.meta:
            memory_budget.configure(ctx.meta["max_gpu"], ctx.meta["max_host"])
        return value

    fn = click.option(
        "--max-host-memory",
        "max_host",
        default=None,
        expose_value=False,
        callback=configure,
        metavar="SIZE",
        help="Host memory the run may use, e.g. 64GiB [default: what is free].",
    )(fn)
    fn = click.option(
        "--max-gpu-memory",
        "max_gpu",
        default=None,
        expose_value=False,
        callback=configure,
        metavar="SIZE",
        help="GPU memory the run may use, e.g. 60GiB [default: what is free, at most 70% of the card, less "
        "2 GiB; the allocator reserves at most 75%]; chunks are sized from it and a layer that cannot fit is "
        "refused before any weight is read.",
    )(fn)
    return fn


@main.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@user_errors
def inspect(model: str, as_json: bool):
    """Memory account of MODEL (a checkpoint directory, a config.json, or zoo:NAME), no weights loaded."""
    from moequant.plan.memory import inspect_model

    acc = inspect_model(model)
    if as_json:
        click.echo(json.dumps(acc, indent=2))
    else:
        from moequant.plan.memory import format_account

        click.echo(format_account(acc, model))


def recipe_options(fn):
    """--recipe / --model / --output / --set, shared by the commands that take a recipe."""
    fn = click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help="Override a recipe key, e.g. --set experts.budget.bits_per_weight=4.5",
    )(fn)
    fn = click.option("--output", default=None, help="Output directory (recipe key `output`).")(fn)
    fn = click.option("--model", default=None, help="Checkpoint directory or zoo:NAME (recipe key `model`).")(fn)
    fn = click.option(
        "--recipe",
        "recipe_path",
        default=None,
        metavar="NAME|PATH",
        help="Recipe YAML, or a bundled recipe by name (selective, uniform-int4, ...) [default: selective].",
    )(fn)
    return fn


def calibration_options(fn):
    """--dataset / --samples / --seq-len / --seed: the recipe's calibration keys (and seed), for calibrate and apply."""
    fn = click.option("--seed", default=None, type=int, help="Recipe key seed.")(fn)
    fn = click.option("--seq-len", default=None, type=int, help="Tokens per sample (recipe key calibration.seq_len).")(
        fn
    )
    fn = click.option(
        "--samples", default=None, type=int, help="Calibration samples (recipe key calibration.samples)."
    )(fn)
    fn = click.option(
        "--dataset", default=None, help="builtin:NAME, a local file, or a hub dataset (recipe key calibration.dataset)."
    )(fn)
    return fn


def with_calibration_flags(overrides, dataset=None, samples=None, seq_len=None, seed=None, all_experts=None) -> list:
    """The --set overrides, then the calibration options given, as the recipe keys they stand for."""
    flags = {
        "calibration.dataset": dataset,
        "calibration.samples": samples,
        "calibration.seq_len": seq_len,
        "seed": seed,
        "calibration.all_experts": all_experts,
    }
    return [*overrides, *(f"{k}={json.dumps(v)}" for k, v in flags.items() if v is not None)]


@main.command()
@recipe_options
@click.option("--stats", default=None, type=click.Path(), help="Statistics directory [default: OUTPUT/stats].")
@calibration_options
@click.option(
    "--batch-size",
    default=8,
    show_default=True,
    type=int,
    help="Calibration samples pushed through a layer at once (more: faster, more memory).",
)
@click.option(
    "--all-experts/--routed-only",
    default=None,
    help="Push every token through every expert for the statistics (real routing kept apart) "
    "(recipe key calibration.all_experts).",
)
@click.option("--no-hessians", is_flag=True, help="Skip XᵀX (saves memory; GPTQ and sensitivities need them).")
@click.option(
    "--save-hessians",
    is_flag=True,
    help="Also write the full [E, d, d] Hessians into the statistics (large; by default only their diagonals).",
)
@click.option(
    "--formats",
    default=None,
    help="Comma-separated format keys to measure [default: every format the recipe may give a routed expert].",
)
@click.option("--allow-fewer", is_flag=True, help="Accept fewer samples than asked when the data set is small.")
@click.option("--device", default="cpu", show_default=True, help=DEVICE_HELP)
@memory_options
@click.option("--overwrite", is_flag=True, help="Replace statistics of another model or other settings.")
@click.option(
    "--imatrix",
    default=None,
    type=click.Path(),
    help="Also write llama.cpp's imatrix GGUF (for llama-quantize) from the statistics, e.g. out.gguf.",
)
@user_errors
def calibrate(
    recipe_path,
    model,
    output,
    overrides,
    stats,
    dataset,
    samples,
    seq_len,
    seed,
    batch_size,
    all_experts,
    no_hessians,
    save_hessians,
    formats,
    allow_fewer,
    device,
    overwrite,
    imatrix,
):
    """Per-expert routing and input statistics, layer by layer, for the formats the recipe will ask for.

    Writes OUTPUT/stats (where `plan` and `apply` of the same recipe and output look for them);
    the options below override the recipe's calibration keys."""
    from pathlib import Path

    from moequant.io.checkpoint import open_checkpoint
    from moequant.measure.calibrate import calibrate as run
    from moequant.memory_budget import check_device
    from moequant.pipeline.apply import calibration_settings, resolve_recipe
    from moequant.pipeline.precheck import check_memory, check_recipe, unfit_notes
    from moequant.plan.measurements import sensitivity_formats

    check_device(device)  # before anything is read or written
    if batch_size < 1:
        raise UserError(f"--batch-size {batch_size} is not a number of samples; accepted: 1 or more.")
    overrides = with_calibration_flags(overrides, dataset, samples, seq_len, seed, all_experts)
    recipe = resolve_recipe(recipe_path, model, output, overrides)
    source = open_checkpoint(recipe.model)  # once: every check below and the calibration read this one
    if recipe_path:  # a recipe whose plan shapes alone refuse is refused before the calibration it would waste
        check_recipe(recipe, source)
    keys = tuple(f.strip() for f in formats.split(",") if f.strip()) if formats else sensitivity_formats(recipe)
    notes = unfit_notes(source, keys)
    settings = calibration_settings(recipe, device, formats=keys, ckpt=source).model_copy(
        update=dict(
            batch_size=batch_size, hessians=not no_hessians, save_hessians=save_hessians, allow_fewer=allow_fewer
        )
    )
    if imatrix and not str(imatrix).endswith(".gguf"):  # refused before the calibration work
        raise UserError(f"--imatrix {imatrix} must end in .gguf (llama.cpp's GGUF imatrix format).")
    import contextlib

    from moequant import parallel
    from moequant.io.run_lock import output_lock

    helper = parallel.is_helper_rank()  # under torchrun rank 0 alone prints
    adapter = source.adapter
    num_experts = adapter.num_experts
    check_memory(recipe, adapter, device)  # a layer that cannot fit the GPU budget, before any weight is read
    settings = settings.model_copy(update={"device": parallel.start(num_experts, device)})  # joins torchrun's job
    with contextlib.ExitStack() as held:  # the run directory, as apply / plan hold it
        parallel.shared(lambda: held.enter_context(output_lock(recipe.output, "calibrate")), "the run directory's lock")
        for note in notes if not helper else ():  # once the directory is ours (a refused run says only why)
            click.echo(f"note: {note}")
        out = run(
            source,
            Path(stats) if stats else Path(recipe.output) / "stats",
            settings,
            overwrite=overwrite,
            progress=not helper,
        )
    parallel.finish()
    if helper:
        return
    click.echo(f"statistics of {', '.join(keys)} written to {out} (summary.json, routing.png)")
    if imatrix:
        from moequant.export.gguf import write_imatrix

        click.echo(f"imatrix written to {write_imatrix(out, imatrix)}")


@main.command()
@recipe_options
@click.option("--stats", default=None, type=click.Path(), help="Statistics directory [default: OUTPUT/stats].")
@user_errors
def plan(recipe_path, model, output, overrides, stats):
    """Decide a format for every tensor: writes OUTPUT/plan.json and prints a summary."""
    from moequant.pipeline.apply import run_plan
    from moequant.plan.summary import format_summary

    result, path = run_plan(recipe_path, model, output, overrides, stats)
    click.echo(format_summary(result))
    click.echo(f"plan written to {path}")


OVERWRITE_HELP = "Replace calibration statistics of another model or other settings in OUTPUT/stats."


@main.command()
@recipe_options
@calibration_options
@click.option("--device", default="cpu", show_default=True, help=DEVICE_HELP)
@memory_options
@click.option("--overwrite", is_flag=True, help=OVERWRITE_HELP)
@user_errors
def apply(recipe_path, model, output, overrides, dataset, samples, seq_len, seed, device, overwrite):
    """Calibrate, plan, quantize, export, evaluate and report — the whole job.

    --dataset / --samples / --seq-len / --seed set the recipe's calibration keys as `calibrate`'s do, so both
    commands given the same options share OUTPUT/stats."""
    import time

    from moequant.pipeline.apply import apply as run

    t0 = time.perf_counter()
    overrides = with_calibration_flags(overrides, dataset, samples, seq_len, seed)
    report = run(recipe_path, model, output, overrides, device=device, log=click.echo, overwrite=overwrite)
    if report is not None:  # None: a rank other than 0 of an expert-parallel run
        click.echo(f"done in {time.perf_counter() - t0:.0f} s; report: {report}")


@main.command()
@recipe_options
@click.option(
    "--budgets",
    default="int3,int4,int4..int8",
    show_default=True,
    help="Comma-separated budgets: bits per routed-expert weight (e.g. 3.5), a format's bytes (int4), "
    "or half-way between two formats (int4..int8).",
)
@click.option(
    "--targets",
    default="vllm,transformers",
    show_default=True,
    help="Comma-separated targets each budget is planned for (vllm, sglang, transformers, ...).",
)
@click.option(
    "--uniform",
    default=",".join(DEFAULT_UNIFORM),
    show_default=True,
    help="Comma-separated uniform baselines, each a format entry of the recipe's (e.g. int8,int4).",
)
@click.option(
    "--add",
    "extra",
    multiple=True,
    type=click.Path(),
    help="An outside checkpoint to evaluate and place "
    "on the frontier (e.g. one made by another tool), or the JSON of `moequant eval --json`.",
)
@click.option("--device", default="cpu", show_default=True, help=DEVICE_HELP)
@memory_options
@click.option("--overwrite", is_flag=True, help=OVERWRITE_HELP)
@user_errors
def pareto(recipe_path, model, output, overrides, budgets, targets, uniform, extra, device, overwrite):
    """KL vs bytes for several budgets and targets against one calibration: OUTPUT/pareto.json + .png."""
    from moequant.pipeline.pareto import pareto as run

    split = lambda text: [x.strip() for x in text.split(",") if x.strip()]  # noqa: E731
    result = run(
        recipe_path,
        budgets=split(budgets),
        model=model,
        output=output,
        overrides=overrides,
        targets=split(targets),
        uniform=split(uniform),
        extra_reports=list(extra),
        device=device,
        log=click.echo,
        overwrite=overwrite,
    )
    from moequant.pipeline.pareto import same_as_frontier

    on = result["frontier"]
    twins = "".join(f"; {a} has the bits and KL of {b}" for a, b in same_as_frontier(result["points"]).items())
    click.echo(
        f"{len(result['points'])} points, {len(on)} on the frontier (no other point has fewer bits and "
        f"less KL): {', '.join(on)}{twins}"
    )


@main.command(name="eval")
@click.argument("checkpoint")
@click.option("--reference", required=True, help="The original (unquantized) checkpoint or zoo:NAME.")
@click.option(
    "--dataset",
    default="builtin:mix",
    show_default=True,
    help="Evaluation data: builtin:NAME, a local .txt / .jsonl / .json / .parquet file, or hf:DATASET[:CONFIG].",
)
@click.option(
    "--samples", default=32, show_default=True, type=int, help="Evaluation windows (held out from calibration)."
)
@click.option("--seq-len", default=256, show_default=True, type=int, help="Tokens per evaluation window.")
@click.option(
    "--seed", default=0, show_default=True, type=int, help="Seed of the windows' draw (same seed, same tokens)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the full result as JSON.")
@click.option("--output", default=None, type=click.Path(), help="Also write the result to OUTPUT/eval.json.")
@user_errors
def eval_command(checkpoint, reference, dataset, samples, seq_len, seed, as_json, output):
    """Quality of CHECKPOINT against the original: perplexity, KL, top-1 and routing agreement.

    Works on any compressed-tensors checkpoint, including one made by another tool."""
    from moequant.evaluate import evaluate_checkpoints, format_quality
    from moequant.io.fingerprint import check_checkpoint_recorded
    from moequant.pipeline.apply import evaluate_into

    check_checkpoint_recorded(checkpoint)  # OUTPUT/checkpoint: of OUTPUT's run, with apply's record of it
    settings = dict(
        dataset=dataset, samples=samples, seq_len=seq_len, seed=seed, progress=not as_json
    )  # --json: stdout holds the JSON alone
    result = (
        evaluate_into(checkpoint, reference, output, **settings)
        if output
        else evaluate_checkpoints(checkpoint, reference, **settings)
    )
    click.echo(json.dumps(result, indent=2, default=str) if as_json else format_quality(result))


@main.command()
@click.argument("output", type=click.Path())
@user_errors
def report(output):
    """Write report.md and report.html of an output directory again from its report.json (the HTML's plot of
    this model's runs next to it as they are now), once its plan, checkpoint and report are checked to come
    from one run; print the report's summary line and the files."""
    from pathlib import Path

    from moequant.io.fingerprint import check_report_directory
    from moequant.io.run_lock import output_lock
    from moequant.report import headline, read_report, write_views

    path = Path(output) / "report.json"
    if not path.is_file():
        raise UserError(f"{output} has no report.json; write it with `moequant apply`.")
    check_report_directory(output)
    data = read_report(path)
    with output_lock(output, "report"):
        written = write_views(data, output)
    click.echo(headline(data))
    click.echo(f"report written: {written['md']}, {written['html']} (from {path})")


if __name__ == "__main__":
    main()
