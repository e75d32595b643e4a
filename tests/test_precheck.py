"""What the recipe and the model's shapes decide is refused before any calibration, fast, with
nothing written; and every output file gets the mode the umask gives."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import moequant.arch
import moequant.export.write  # noqa: F401
import moequant.formats  # noqa: F401
import moequant.io.checkpoint

# Imported here, with what the check imports lazily, so the timed commands measure the check and
# not Python importing torch / transformers (about 2 s of a cold `moequant` process on this machine).
import moequant.pipeline.apply  # noqa: F401
import moequant.pipeline.pareto
import moequant.pipeline.precheck  # noqa: F401
import moequant.plan.policy  # noqa: F401
from moequant.cli import main
from moequant.errors import UserError
from moequant.io.checkpoint import atomic_directory, atomic_write_text, save_safetensors

ROOT = Path(__file__).resolve().parents[1]
# transformers imports a model type's config module on first use (adapter_for): import it here too
moequant.arch.adapter_for(moequant.io.checkpoint.open_checkpoint("zoo:tiny-qwen2moe").config)
SELECTIVE = str(ROOT / "recipes" / "selective.yaml")
UNIFORM = str(ROOT / "recipes" / "uniform-int4.yaml")


def tree(path: Path) -> dict:
    """Every entry under path with its mode, size, mtime and bytes: to show nothing changed."""
    if not path.exists():
        return {}
    out = {}
    for p in sorted(path.rglob("*")):
        st = p.stat()
        out[str(p.relative_to(path))] = (
            st.st_mode,
            st.st_size,
            st.st_mtime_ns,
            p.read_bytes() if p.is_file() else None,
        )
    return out


def refused(args, output: Path, seconds: float = 1.0) -> str:
    """Run a CLI command that must be refused: exit 2, one sentence, fast, `output` untouched."""
    before = tree(output)
    existed = output.exists()
    t0 = time.perf_counter()
    result = CliRunner().invoke(main, args)
    elapsed = time.perf_counter() - t0
    assert result.exit_code == 2, result.output
    message = result.output.strip()
    assert message.startswith("error: ") and "\n" not in message and "Traceback" not in message, message
    assert elapsed < seconds, f"refused after {elapsed:.2f} s: {message}"
    assert output.exists() == existed and tree(output) == before
    return message


@pytest.mark.parametrize("command", ["apply", "plan", "calibrate"])
def test_impossible_budget_refused_before_calibration(tmp_path, command):
    out = tmp_path / "out"
    message = refused(
        [command, "--recipe", SELECTIVE, "--output", str(out), "--set", "experts.budget.bits_per_weight=1.0"], out
    )
    # the smallest plan of int8-channel / int4-g32-sym on this model is every layer int4: 4.5 bits
    assert "bits_per_weight 1.0" in message and "bits_per_weight >= 4.5000" in message
    assert not out.exists()


def test_refusal_leaves_an_existing_output_as_it_was(tmp_path):
    out = tmp_path / "out"
    (out / "stats").mkdir(parents=True)
    (out / "notes.txt").write_text("mine\n")
    refused(["apply", "--recipe", SELECTIVE, "--output", str(out), "--set", "experts.budget.bits_per_weight=1.0"], out)
    assert (out / "notes.txt").read_text() == "mine\n"


def test_a_layout_that_cannot_carry_a_candidate_is_refused_before_calibration(tmp_path):
    out = tmp_path / "out"
    message = refused(["apply", "--recipe", SELECTIVE, "--output", str(out), "--set", "export.format=awq"], out)
    assert "awq layout" in message and "int8-channel" in message


def test_a_format_that_cannot_hold_a_dimension_is_refused_before_calibration(tmp_path):
    out = tmp_path / "out"
    message = refused(["apply", "--recipe", UNIFORM, "--output", str(out), "--set", "formats.int4.group_size=128"], out)
    # the bundled model's down projections have 64 input columns
    assert "int4-g128-sym" in message and "64 input columns" in message


def test_unservable_rule_format_refused_before_calibration(tmp_path):
    out = tmp_path / "out"
    rules = "experts={method: rules, rules: [{share_below: 0.5, format: int3}, {format: int4}]}"
    message = refused(["apply", "--recipe", UNIFORM, "--output", str(out), "--set", rules], out)
    assert "int3" in message and "vllm" in message.lower()


def test_pareto_with_no_feasible_run_calibrates_nothing(tmp_path):
    out = tmp_path / "out"
    t0 = time.perf_counter()
    with pytest.raises(UserError, match="no budget is feasible"):
        moequant.pipeline.pareto.pareto(
            SELECTIVE, budgets=[1.0, 2.0], output=str(out), uniform=[], progress=False, log=lambda *_: None
        )
    assert time.perf_counter() - t0 < 1.0
    assert not out.exists()


def test_plan_says_where_it_looked_for_statistics(tmp_path):
    out = tmp_path / "out"
    message = refused(["plan", "--recipe", SELECTIVE, "--output", str(out)], out)
    assert str(out / "stats") in message and "moequant calibrate --recipe" in message and "--stats" in message


def test_calibrate_names_a_candidate_that_cannot_hold_a_projection(tmp_path):
    """The note comes before any work; the run here then stops at a bad seq_len (nothing written)."""
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main,
        [
            "calibrate",
            "--recipe",
            SELECTIVE,
            "--output",
            str(out),
            "--formats",
            "int8-channel,int4-g128-sym",
            "--seq-len",
            "100000",
        ],
    )
    assert result.exit_code == 2
    assert (
        "note: int4-g128-sym cannot hold the routed experts' down projection ([256, 64]: 64 input columns are "
        "not a multiple of its group size 128)"
    ) in result.output
    assert "int8-channel cannot" not in result.output
    assert "max_position_embeddings" in result.output
    assert not out.exists()


# ---------------------------------------------------------------- file modes


@pytest.fixture(params=[0o022, 0o027, 0o002])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def test_atomic_writers_give_the_umask_modes(tmp_path, umask):
    from moequant.plan.model import Plan
    from moequant.plan.plan_io import write_plan

    with atomic_directory(tmp_path / "ckpt") as tmp:
        save_safetensors({"w": torch.zeros(2)}, tmp / "model.safetensors")
        (tmp / "sub").mkdir()
    atomic_write_text(tmp_path / "report.md", "x\n")
    write_plan(
        Plan(
            model="m",
            target="vllm",
            method="uniform",
            budget=None,
            candidates=[],
            dropped_candidates={},
            usage_floor=0.05,
            formats={},
            tensors=[],
        ),
        tmp_path / "plan.json",
    )
    for p in [tmp_path / "ckpt", tmp_path / "ckpt" / "sub"]:
        assert stat.S_IMODE(p.stat().st_mode) == 0o777 & ~umask, p
    for p in [tmp_path / "ckpt" / "model.safetensors", tmp_path / "report.md", tmp_path / "plan.json"]:
        assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask, p
