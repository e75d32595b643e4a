"""The smaller points of issue 57's newcomer's path: `plan` draws one character per expert as the README says,
`apply` takes the calibration options `calibrate` takes, and a bare `moequant apply` runs the bundled default
recipe, which is feasible on the default model."""

from __future__ import annotations

import json

from click.testing import CliRunner

from moequant.cli import main


def test_plan_prints_one_character_per_expert_for_every_layer(tmp_path):
    result = CliRunner().invoke(main, ["plan", "--recipe", "uniform-int4", "--output", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("routed experts per layer"))
    assert lines[header] == "routed experts per layer, one character per expert (4=int4-g32-sym), and their counts:"
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    experts: dict[int, set] = {}
    for t in plan["tensors"]:
        if t["role"] == "routed_expert":
            experts.setdefault(t["layer"], set()).add(t["expert"])
    rows = lines[header + 1 : header + 1 + len(experts)]
    assert rows == [f"  L{layer:>3}  {'4' * len(experts[layer])}  int4-g32-sym x16" for layer in sorted(experts)]


def test_apply_takes_calibrate_s_calibration_options(monkeypatch):
    from moequant.pipeline import apply as apply_module

    shown = CliRunner().invoke(main, ["apply", "--help"], terminal_width=200).output
    for option in ("--dataset TEXT", "--samples INTEGER", "--seq-len INTEGER", "--seed INTEGER"):
        assert option in shown, option
    seen = {}
    monkeypatch.setattr(apply_module, "apply", lambda *args, **kwargs: seen.update(args=args) or None)
    flags = ["--samples", "16", "--dataset", "builtin:stdlib-prose", "--seq-len", "64", "--seed", "3"]
    result = CliRunner().invoke(main, ["apply", "--recipe", "selective", "--set", "evaluate.samples=8", *flags])
    assert result.exit_code == 0, result.output
    recipe = apply_module.resolve_recipe(*seen["args"])
    c = recipe.calibration
    assert (c.samples, c.dataset, c.seq_len, recipe.seed, recipe.evaluate.samples) == (
        16,
        "builtin:stdlib-prose",
        64,
        3,
        8,
    )


def test_a_bare_command_runs_the_bundled_default_recipe_which_is_feasible_on_the_default_model(tmp_path):
    from moequant.io.checkpoint import open_checkpoint
    from moequant.pipeline.apply import resolve_recipe
    from moequant.pipeline.precheck import check_recipe

    bare = resolve_recipe(None)
    assert bare == resolve_recipe("selective")
    check_recipe(bare, open_checkpoint(bare.model))  # refused before as "5.5 below smallest feasible 8.125"
    result = CliRunner().invoke(main, ["plan", "--output", str(tmp_path / "run")])  # gets as far as the statistics
    assert result.exit_code == 2 and "no calibration statistics in " in result.output, result.output


def test_calibrate_says_once_which_formats_a_projection_cannot_hold():
    """gguf.yaml's menu on tiny-qwen2moe: four K types cannot hold the 64-wide down projection, one note (was
    four); a format of another group size is its own note; formats that fit get none."""
    from moequant.pipeline.precheck import unfit_notes

    notes = unfit_notes("zoo:tiny-qwen2moe", ["q8_0", "q6_k", "q5_k", "q5_0", "q4_k", "q3_k", "int4-g128-sym"])
    assert notes == [
        "q6_k, q5_k, q4_k and q3_k cannot hold the routed experts' down projection ([256, 64]: 64 input columns are "
        "not a multiple of their group size 256); no sensitivity is measured for them there and no plan offers them "
        "there.",
        "int4-g128-sym cannot hold the routed experts' down projection ([256, 64]: 64 input columns are not a "
        "multiple of its group size 128); no sensitivity is measured for it there and no plan offers it there.",
    ]
