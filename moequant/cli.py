"""The `moequant` command line: parse, validate, call one library function per command.

Bad input raises `UserError`; it is printed as one sentence and the exit code is 2.
"""

from __future__ import annotations

import functools
import json
import sys

import click

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


if __name__ == "__main__":
    main()
