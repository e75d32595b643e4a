"""The `moequant` command line: parse, validate, call one library function per command.

Bad input raises `UserError`; it is printed as one sentence and the exit code is 2.
"""

from __future__ import annotations

import functools
import json
import sys

import click

from moequant.calibrate import DEFAULT_SENSITIVITY_FORMATS
from moequant.errors import UserError


def user_errors(fn):
    """Turn a UserError into one line on stderr and exit code 2 (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moequant")
def main():
    """Per-expert quantization for Mixture-of-Experts language models."""


@main.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@user_errors
def inspect(model: str, as_json: bool):
    """Memory account of MODEL (a checkpoint directory, a config.json, or zoo:NAME), no weights loaded."""
    from moequant.inspect import inspect_model

    acc = inspect_model(model)
    if as_json:
        click.echo(json.dumps(acc, indent=2))
    else:
        from moequant.memory import format_account

        click.echo(format_account(acc, model))


@main.command()
@click.option("--model", required=True, help="Checkpoint directory or zoo:NAME.")
@click.option("--dataset", default="builtin:mix", show_default=True, help="builtin:NAME, a local file, or a hub dataset.")
@click.option("--samples", default=64, show_default=True, type=int)
@click.option("--seq-len", default=256, show_default=True, type=int)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--batch-size", default=8, show_default=True, type=int)
@click.option("--output", default="stats", show_default=True, type=click.Path())
@click.option("--all-experts/--routed-only", default=True, show_default=True,
              help="Push every token through every expert for the statistics (real routing kept apart).")
@click.option("--no-hessians", is_flag=True, help="Skip XᵀX (saves memory; GPTQ and sensitivities need them).")
@click.option("--formats", default=",".join(DEFAULT_SENSITIVITY_FORMATS),
              show_default=True, help="Format keys to predict sensitivity for.")
@click.option("--allow-fewer", is_flag=True, help="Accept fewer samples than asked when the data set is small.")
@click.option("--device", default="cpu", show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace statistics of another model or other settings in --output.")
@user_errors
def calibrate(model, dataset, samples, seq_len, seed, batch_size, output, all_experts, no_hessians, formats,
              allow_fewer, device, overwrite):
    """Per-expert routing and input statistics of MODEL on a data set, layer by layer."""
    from moequant.calibrate import CalibrationSettings, calibrate as run

    settings = CalibrationSettings(dataset=dataset, samples=samples, seq_len=seq_len, seed=seed, batch_size=batch_size,
                                   all_experts=all_experts, hessians=not no_hessians,
                                   formats=tuple(f.strip() for f in formats.split(",") if f.strip()),
                                   allow_fewer=allow_fewer, device=device)
    out = run(model, output, settings, overwrite=overwrite)
    click.echo(f"statistics written to {out} (summary.json, routing.png)")


if __name__ == "__main__":
    main()
