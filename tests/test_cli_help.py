"""Every option of every command says what it does in `--help`, with its real default."""

from __future__ import annotations

import click
from click.testing import CliRunner

from moequant.cli import main


def test_every_option_has_help_text():
    missing = [
        f"{name} {opt.opts[0]}"
        for name, command in main.commands.items()
        for opt in command.params
        if isinstance(opt, click.Option) and not (opt.help or "").strip()
    ]
    assert missing == []


def test_help_shows_what_recipe_takes_and_the_real_defaults():
    shown = CliRunner().invoke(main, ["pareto", "--help"], terminal_width=200).output
    assert "--recipe NAME|PATH" in shown
    assert "[default: int8,int4,int3]" in shown and "module's list" not in shown
    assert "--targets TEXT" in shown and "Comma-separated targets" in shown


def test_ctrl_c_in_a_command_that_writes_nothing_says_so(monkeypatch):
    from moequant.plan import memory as inspect_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(inspect_module, "inspect_model", interrupted)
    result = CliRunner().invoke(main, ["inspect", "zoo:tiny-qwen2moe"])
    assert result.exit_code == 130 and result.stderr.strip() == "interrupted: nothing was written.", result.output
