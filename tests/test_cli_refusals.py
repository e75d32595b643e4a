"""Bad command-line input is one sentence on stderr, exit code 2, before anything is written (issue 57):
a device this machine does not have, a device moequant does not run on, a batch size below one."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from moequant.cli import main


def refused(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


@pytest.mark.parametrize("command", ["apply", "calibrate", "pareto"])
def test_a_gpu_this_machine_lacks_is_refused_before_anything_is_written(command, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "run"
    line = refused(CliRunner().invoke(main, [command, "--output", str(out), "--device", "cuda"]))
    assert "--device cuda asks for a GPU" in line and "--device cpu" in line
    assert not out.exists()


def test_a_gpu_index_past_the_last_gpu_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    out = tmp_path / "run"
    line = refused(CliRunner().invoke(main, ["apply", "--output", str(out), "--device", "cuda:2"]))
    assert "names GPU 2, but this machine has 2 (cuda:0 .. cuda:1)" in line
    assert not out.exists()


@pytest.mark.parametrize("device", ["tpu", "mps", "cuda:x", ""])
@pytest.mark.parametrize("command", ["apply", "calibrate"])
def test_a_device_moequant_does_not_run_on_is_refused(command, device, tmp_path):
    out = tmp_path / "run"
    line = refused(CliRunner().invoke(main, [command, "--output", str(out), "--device", device]))
    assert f"--device {device!r} is not a device moequant runs on; accepted: cpu, cuda or cuda:N." in line
    assert not out.exists()


@pytest.mark.parametrize("size", ["0", "-4"])
def test_calibrate_batch_size_below_one_is_refused(size, tmp_path):
    out = tmp_path / "run"
    line = refused(CliRunner().invoke(main, ["calibrate", "--output", str(out), "--batch-size", size]))
    assert line == f"error: --batch-size {size} is not a number of samples; accepted: 1 or more."
    assert not out.exists()


TINY = [
    "calibration.samples=2",
    "calibration.seq_len=32",
    "calibration.probe_samples=2",
    "calibration.dataset=builtin:stdlib-prose",
    "evaluate.samples=2",
    "evaluate.seq_len=32",
    "evaluate.dataset=builtin:stdlib-prose",
]


def _invoke(*args, settings=TINY):
    return CliRunner().invoke(main, [*args, *(a for s in settings for a in ("--set", s))])


def _digest(directory) -> dict:
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def test_apply_keeps_statistics_of_other_settings_unless_told_to_overwrite(tmp_path):
    """`apply` into a directory whose stats/ another calibration made (other samples, or a recipe that reads
    none) refuses as `calibrate` does, leaving them byte for byte; with --overwrite it replaces them."""
    from tiny import build_tiny_with_tokenizer

    model = build_tiny_with_tokenizer("qwen2_moe", tmp_path / "model")
    out = tmp_path / "run"
    made = _invoke("calibrate", "--recipe", "selective", "--model", str(model), "--output", str(out))
    assert made.exit_code == 0, made.output
    before = _digest(out / "stats")
    other = [*TINY, "calibration.samples=3"]
    line = refused(
        _invoke("apply", "--recipe", "selective", "--model", str(model), "--output", str(out), settings=other)
    )
    assert f"{out / 'stats'} already holds calibration statistics of other settings; pass --overwrite" in line
    line = refused(_invoke("apply", "--recipe", "uniform-int8", "--model", str(model), "--output", str(out)))
    assert "which this recipe does not read" in line and "--overwrite" in line
    assert _digest(out / "stats") == before
    assert [p.name for p in out.iterdir() if not p.name.startswith(".")] == ["stats"]  # nothing else written
    done = _invoke("apply", "--recipe", "uniform-int8", "--model", str(model), "--output", str(out), "--overwrite")
    assert done.exit_code == 0, done.output
    assert not (out / "stats").exists() and (out / "checkpoint").is_dir()


def test_gguf_lowbit_on_tiny_qwen2moe_is_one_note_and_needs_its_attention_s_bytes():
    """The README's account of gguf-lowbit on tiny-qwen2moe: the five K types its 64-wide down projections cannot
    hold are one note; the routed experts' smallest plan is 3.25 bits (q2_k gate / up, q4_0 down), so 3 bits are met
    only with attention moving below q4_0, and without non_experts.formats the budget is refused in one sentence."""
    from moequant.errors import UserError
    from moequant.io.checkpoint import open_checkpoint
    from moequant.pipeline.apply import resolve_recipe
    from moequant.plan.policy import check_plan

    recipe = resolve_recipe("gguf-lowbit", "zoo:tiny-qwen2moe")
    ckpt = open_checkpoint(recipe.model)
    (note,) = check_plan(recipe, ckpt)
    assert note.startswith("q6_k, q5_k, q4_k, q3_k and q2_k are not offered to down_proj of layer(s) 0-3: "), note
    assert "64 input columns" in note
    with pytest.raises(UserError) as info:
        check_plan(resolve_recipe("gguf-lowbit", "zoo:tiny-qwen2moe", None, ["non_experts.formats=[]"]), ckpt)
    assert str(info.value).endswith("accepted: bits_per_weight >= 3.2500.") and "\n" not in str(info.value)


def test_a_negative_hessian_prior_is_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    result = _invoke("apply", "--output", str(out), settings=[*TINY, "calibration.hessian_prior=-1"])
    line = refused(result)
    assert "calibration.hessian_prior" in line and "at least 0" in line, line
    assert not out.exists()
