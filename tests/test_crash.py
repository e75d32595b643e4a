"""Faults: `apply` killed at random points, interrupted between two of its writes, a full disk,
numerical damage in the checkpoint, unused experts, a budget at the feasibility edge — and
determinism: the same recipe, data and seed give byte-identical checkpoints and report numbers.

Everything runs on a tiny Qwen2-MoE with its own tokenizer and the smallest settings.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from tiny import build_tiny_with_tokenizer, route_only_to_experts_0_and_1

from moequant.cli import main
from moequant.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "calibration.samples=2",
    "calibration.seq_len=32",
    "calibration.dataset=builtin:stdlib-prose",
    "evaluate.samples=2",
    "evaluate.seq_len=32",
    "evaluate.dataset=builtin:stdlib-prose",
]


pytestmark = pytest.mark.slow


def apply_args(model_dir, out, *extra):
    args = ["apply", "--recipe", str(ROOT / "recipes/selective.yaml"), "--model", str(model_dir), "--output", str(out)]
    for s in TINY + list(extra):
        args += ["--set", s]
    return args


def run_apply(model_dir, out, *extra, expect=0):
    result = CliRunner().invoke(main, apply_args(model_dir, out, *extra), catch_exceptions=False)
    assert result.exit_code == expect, result.output
    return result.output


def digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def same_safetensors(a: Path, b: Path) -> bool:
    """Same tensors (bit for bit) and metadata. Not bytes: the safetensors library writes a
    metadata map of more than one key in a per-process hash order."""
    from safetensors import safe_open

    ta, tb = load_file(str(a)), load_file(str(b))
    with safe_open(str(a), "pt") as fa, safe_open(str(b), "pt") as fb:
        same_meta = fa.metadata() == fb.metadata()
    return (
        same_meta
        and ta.keys() == tb.keys()
        and all(
            ta[k].dtype == tb[k].dtype
            and torch.equal(ta[k].reshape(-1).view(torch.uint8), tb[k].reshape(-1).view(torch.uint8))
            for k in ta
        )
    )


def report_numbers(out: Path) -> dict:
    """report.json without timings, with the output directory's path replaced (it differs per run)."""
    text = (out / "report.json").read_text().replace(str(out), "OUT")
    report = json.loads(text)
    report.pop("timings", None)
    for key in list(report.get("quality") or {}):
        if "seconds" in key or "time" in key:
            report["quality"].pop(key)
    return report


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_with_tokenizer("qwen2_moe", tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    t0 = time.perf_counter()
    run_apply(model_dir, out)
    return out, time.perf_counter() - t0


# ----------------------------------------------------------------------------- determinism


def test_same_recipe_data_and_seed_give_identical_checkpoint_and_report(model_dir, reference, tmp_path):
    ref, _ = reference
    again = tmp_path / "again"
    run_apply(model_dir, again)
    assert digest(again / "checkpoint") == digest(ref / "checkpoint")
    # plan.json records the recipe, whose `output` is the run's own directory
    assert (again / "plan.json").read_text().replace(str(again), "OUT") == (ref / "plan.json").read_text().replace(
        str(ref), "OUT"
    )
    layer_stats = sorted(p.name for p in (ref / "stats").glob("layer_*.safetensors"))
    assert layer_stats and all(same_safetensors(again / "stats" / n, ref / "stats" / n) for n in layer_stats)
    assert report_numbers(again) == report_numbers(ref)
    # the report is not trivially equal: it holds measured quality numbers
    assert report_numbers(ref)["quality"]["kl_mean"] > 0


# ----------------------------------------------------------------------------- crash safety


def _check_consistent(out: Path, ref: Path) -> str:
    """After a kill: checkpoint/ is absent or byte-identical to the uninterrupted run's; files that
    say a stage is complete are readable. Returns which stage the run had reached."""
    if (out / "checkpoint").exists():
        assert digest(out / "checkpoint") == digest(ref / "checkpoint")
        stage = "exported"
    elif (out / "work").exists():
        stage = "quantizing"
    elif (out / "stats" / "summary.json").exists():
        stage = "calibrated"
    else:
        stage = "calibrating"
    for name in ("report.json", "checkpoint.json", "plan.json", "stats/summary.json"):
        if (out / name).exists():
            json.loads((out / name).read_text())
    if (out / "report.json").exists():
        stage = "reported"
    return stage


STAGES = {  # what is on disk once a stage has begun
    "calibrating": lambda out: (out / "stats" / ".work").exists(),
    "quantizing": lambda out: (out / "work" / "hidden.safetensors").exists(),
    "exporting": lambda out: any(out.glob(".checkpoint.tmp-*")),
    "evaluating": lambda out: (out / "checkpoint.json").exists(),
}


def test_sigkill_at_random_points_leaves_no_half_checkpoint_and_resumes_identically(model_dir, reference, tmp_path):
    """SIGKILL `moequant apply` (a real process) at a random moment after each stage has begun,
    resuming in the same output directory each time, then let it finish."""
    ref, _ = reference
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "moequant.cli", *apply_args(model_dir, out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rng = random.Random(20261129)
    kills = []
    for target in STAGES:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while proc.poll() is None and not STAGES[target](out):
            time.sleep(0.002)
        delay = rng.uniform(0.0, 0.5)
        time.sleep(delay)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert proc.returncode in (0, -signal.SIGKILL)
        kills.append((target, round(delay, 3), proc.returncode, _check_consistent(out, ref)))
    final = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert final.returncode == 0, final.stderr[-2000:]
    print("kills (stage begun, extra delay s, return code, stage reached):", kills)
    assert sum(k[2] == -signal.SIGKILL for k in kills) >= 3, kills  # the kills did land mid-run
    assert digest(out / "checkpoint") == digest(ref / "checkpoint")
    assert report_numbers(out) == report_numbers(ref)
    assert not (out / "work").exists()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # killed runs' temporaries removed


def test_interrupt_between_hidden_states_and_progress_marker_resumes_identically(
    model_dir, reference, tmp_path, monkeypatch
):
    """The narrowest windows of the resumable stages: killed after a layer's carried hidden states
    were written but before the progress marker saying so (calibration, then the quantize pass)."""
    from moequant.io import checkpoint
    from moequant.measure import calibrate

    ref, _ = reference
    out = tmp_path / "windows"
    real_write = checkpoint.atomic_write_text

    def dying_at(where: str, layer: int):
        def write(path, text):
            path = Path(path)
            if (
                path.name == "progress.json"
                and path.parent.name == where
                and json.loads(text)["next_layer"] == layer + 1
            ):
                raise KeyboardInterrupt  # the process dies here: hidden states of `layer` are on disk
            return real_write(path, text)

        return write

    monkeypatch.setattr(calibrate, "atomic_write_text", dying_at(".work", 1))
    assert "interrupted: the finished stages and layers are kept" in run_apply(model_dir, out, expect=130)
    monkeypatch.setattr(calibrate, "atomic_write_text", real_write)
    assert json.loads((out / "stats/.work/progress.json").read_text())["next_layer"] == 1
    # the quantize pass writes its progress marker through the same calibrate.save_carried
    monkeypatch.setattr(calibrate, "atomic_write_text", dying_at("work", 1))
    said = run_apply(model_dir, out, expect=130)
    # killed after layer 1's hidden states were written: they say to go on at layer 2 (progress.json lags)
    assert "calibrating: resuming at layer 2 " in said
    assert "interrupted: the finished stages and layers are kept" in said
    monkeypatch.setattr(calibrate, "atomic_write_text", real_write)
    assert json.loads((out / "work/progress.json").read_text())["next_layer"] == 1
    assert "quantizing: resuming at layer 2 " in run_apply(model_dir, out)
    for name in sorted(p.name for p in (ref / "stats").glob("layer_*.safetensors")):
        assert same_safetensors(out / "stats" / name, ref / "stats" / name), name
    assert digest(out / "checkpoint") == digest(ref / "checkpoint")


def test_ctrl_c_exits_130_in_one_line_and_the_rerun_says_where_it_resumes(model_dir, reference, tmp_path):
    """A real SIGINT (what Ctrl-C sends) to `moequant apply` once the quantize pass has finished a layer."""
    ref, _ = reference
    out = tmp_path / "interrupted"
    cmd = [sys.executable, "-m", "moequant", *apply_args(model_dir, out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # SIGINT as a terminal delivers it: a shell's background job (`.ci/run &`) starts its children with SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler, so the signal would be dropped
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    while proc.poll() is None and not (out / "work" / "progress.json").exists():
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before its quantize pass finished a layer"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        "interrupted: the finished stages and layers are kept in the output "
        "directory (a half-written file never is); run the same command again "
        "to resume."
    ), err[-2000:]
    assert "Traceback" not in err and "Aborted" not in err
    left = json.loads((out / "work" / "progress.json").read_text())["next_layer"]
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "(reused)" in again.stdout  # the statistics were kept
    if left > 0:
        assert f"quantizing: resuming at layer {left} " in again.stdout, again.stdout
    assert digest(out / "checkpoint") == digest(ref / "checkpoint")


def test_temporaries_of_killed_writers_are_removed_and_live_ones_kept(tmp_path):
    from moequant.io.checkpoint import atomic_directory

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f".checkpoint.tmp-{dead.pid}-x1y2").mkdir()
    (tmp_path / f".checkpoint.old-{dead.pid}").mkdir()
    live = tmp_path / f".checkpoint.tmp-{os.getpid()}-a1b2"  # another writer of this process, still running
    live.mkdir()
    (tmp_path / ".other.tmp-1-zz").mkdir()
    with atomic_directory(tmp_path / "checkpoint") as tmp:
        (tmp / "f").write_text("x")
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, ".other.tmp-1-zz", "checkpoint"]


# ----------------------------------------------------------------------------- full disk


def _small_filesystem(directory: Path, size: str):
    """A size-limited tmpfs at `directory` (needs root); None when it cannot be mounted."""
    directory.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], capture_output=True)
    return directory if done.returncode == 0 else None


def _quantized_experts(model_dir):
    from moequant import formats
    from moequant.arch import adapter_for
    from moequant.io.checkpoint import open_checkpoint

    ckpt = open_checkpoint(model_dir)
    ad = adapter_for(ckpt.config)
    return {
        (L, e, p): formats.quantize(ad.read_expert(ckpt, L, e, p).float(), "int8")
        for L in ad.moe_layers
        for e in range(ad.num_experts)
        for p in ad.projections
    }


def test_full_disk_during_export_fails_in_one_sentence_and_leaves_no_checkpoint(model_dir, tmp_path, monkeypatch):
    from moequant.export.write import export_checkpoint
    from moequant.io import checkpoint

    quantized = _quantized_experts(model_dir)
    disk = _small_filesystem(tmp_path / "disk", "64k")  # the checkpoint needs ~130 kB
    try:
        if disk is None:  # not root: simulate the full disk at the shard write instead
            print("tmpfs not mountable here: ENOSPC simulated in the shard writer")
            disk = tmp_path / "disk"

            def no_space(*args, **kwargs):
                raise OSError(errno.ENOSPC, "No space left on device")

            monkeypatch.setattr(checkpoint, "save_file", no_space)
        with pytest.raises(UserError) as error:
            export_checkpoint(model_dir, quantized, disk / "checkpoint")
        message = str(error.value)
        assert "full" in message and str(disk / "checkpoint") in message and message.count(". ") == 0
        assert list(disk.iterdir()) == []  # no checkpoint, no temporary sibling left behind
    finally:
        if disk is not None and os.path.ismount(disk):
            subprocess.run(["umount", "--lazy", str(disk)], check=True)  # lazy: the test process may hold a file


def test_full_disk_during_apply_is_one_line_and_the_run_continues_once_there_is_space(
    model_dir, reference, tmp_path, monkeypatch
):
    from moequant.pipeline import quantize

    ref, _ = reference
    disk = _small_filesystem(tmp_path / "disk", "8m")
    if disk is None:
        pytest.skip("mounting a size-limited tmpfs needs root; the export-level test simulates ENOSPC instead")
    real_pass = quantize.quantize_model

    def pass_on_a_full_disk(*args, **kwargs):
        # the statistics and the plan are written; now the disk fills up (4 kB left)
        used = shutil.disk_usage(disk).used
        subprocess.run(["mount", "-o", f"remount,size={used // 1024 + 64}k", str(disk)], check=True)
        return real_pass(*args, **kwargs)

    monkeypatch.setattr(quantize, "quantize_model", pass_on_a_full_disk)
    try:
        result = CliRunner().invoke(main, apply_args(model_dir, disk / "run"))
        monkeypatch.setattr(quantize, "quantize_model", real_pass)
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        # one sentence from the stage that hit it (the quantize pass or the checkpoint writer)
        assert lines[-1].startswith("error: the disk") and " is full " in lines[-1], result.output
        assert lines[-1].count(". ") == 0, result.output
        assert not (disk / "run" / "checkpoint").exists()
        assert (disk / "run" / "stats" / "summary.json").exists()
        subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True)
        assert "(reused)" in run_apply(model_dir, disk / "run")  # the statistics were kept
        assert digest(disk / "run" / "checkpoint") == digest(ref / "checkpoint")
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)  # lazy: the test process may hold a file


# ----------------------------------------------------------------------------- numerical faults


def _damaged_copy(model_dir: Path, directory: Path, name: str, index, value) -> Path:
    shutil.copytree(model_dir, directory)
    tensors = load_file(str(directory / "model.safetensors"))
    t = tensors[name].clone()
    t[index] = value
    tensors[name] = t
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def _calibrate(model, out, **kw):
    from support.plain import plain_settings

    from moequant.measure.calibrate import calibrate

    settings = plain_settings(dataset="builtin:stdlib-prose", samples=2, seq_len=32, formats=("int4-g32-sym",), **kw)
    return calibrate(str(model), out, settings, progress=False)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_expert_weight_is_named_with_layer_and_expert(model_dir, tmp_path, value):
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    bad = _damaged_copy(model_dir, tmp_path / "bad", name, (0, 0), value)
    with pytest.raises(UserError) as error:
        _calibrate(bad, tmp_path / "stats")
    message = str(error.value)
    assert name in message and "layer 1" in message and "expert 3" in message, message
    assert ("1 NaN" in message) if value != value else ("1 infinite" in message), message


def test_non_finite_attention_weight_and_overflowing_activations_are_named(model_dir, tmp_path):
    name = "model.layers.2.self_attn.q_proj.weight"
    bad = _damaged_copy(model_dir, tmp_path / "attn", name, (1, 2), float("nan"))
    with pytest.raises(UserError, match=rf"{name} \(layer 2, attention\) holds 1 NaN"):
        _calibrate(bad, tmp_path / "s1")
    # finite weights whose activations overflow float32: the layer and batch are named
    huge = _damaged_copy(
        model_dir, tmp_path / "huge", "model.layers.0.input_layernorm.weight", slice(None), 3e38
    )  # near the largest bf16: finite, but attention scores overflow
    with pytest.raises(UserError, match=r"layer 0 produced NaN or Inf activations on calibration batch 0"):
        _calibrate(huge, tmp_path / "s2")


def test_quantizing_a_non_finite_weight_names_the_tensor():
    from moequant import formats

    w = torch.randn(8, 32)
    w[3, 5] = float("nan")
    with pytest.raises(UserError, match="layer 4 expert 2 up.*1 NaN"):
        formats.quantize(w, "int4", group_size=32, name="layer 4 expert 2 up")


def test_experts_no_token_reaches_are_counted_as_unused_and_still_quantized(model_dir, tmp_path):
    """In layer 1 the router can only ever pick experts 0 and 1 (top-2 of 6): experts 2..5 see no
    calibration token. The statistics must count 0 routed tokens for them, the quantize pass must
    say which Hessian it used instead of their own (empty) one, and write finite weights."""
    from moequant.io.loader import dequantized_state_dict

    directory = tmp_path / "unused"
    shutil.copytree(model_dir, directory)
    route_only_to_experts_0_and_1(directory)

    out = tmp_path / "run"
    run_apply(
        directory,
        out,
        "calibration.all_experts=false",
        "experts.method=uniform",
        "experts.format=int4",
        "algorithms.int4=gptq",
    )
    assert not (out / "stats").exists()  # a uniform recipe calibrates nothing: the quantize pass counts
    report = json.loads((out / "checkpoint.json").read_text())["quantize"]["1"]
    assert report["routed_tokens"] == [64, 64, 0, 0, 0, 0]  # 2 samples x 32 tokens, each to experts 0 and 1
    weights = dequantized_state_dict(out / "checkpoint", torch.float32)
    for proj in ("gate", "up", "down"):
        fallbacks = report[f"{proj}:int4-g32-sym"]["gptq"]["fallbacks"]
        assert all("0 routed tokens" in fallbacks[str(e)] or "all zeros" in fallbacks[str(e)] for e in range(2, 6))
        for e in range(6):
            assert torch.isfinite(weights[f"model.layers.1.mlp.experts.{e}.{proj}_proj.weight"]).all()


def test_singular_hessians_fall_back_and_stay_finite():
    """GPTQ on an all-zero Hessian (an expert no token reached) gives exactly round-to-nearest and
    says so; on a rank-1 Hessian (one token) and one with a dead input column it still gives finite
    weights that are no worse than RTN on that Hessian's own objective."""
    from moequant import formats
    from moequant.algorithms.gptq import gptq

    torch.manual_seed(0)
    spec = formats.get_format("int4", group_size=32, symmetric=True)
    W = torch.randn(3, 16, 64)
    x = torch.randn(64)
    rank_one = torch.outer(x, x)
    dead = torch.randn(200, 64)
    dead[:, 5] = 0.0
    H = torch.stack([torch.zeros(64, 64), rank_one, dead.T @ dead / 200])
    q, rep = gptq(W, H, spec)
    out = q.dequantize(torch.float32)
    rtn = formats.quantize(W, spec).dequantize(torch.float32)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0], rtn[0]) and "all zeros" in rep.fallbacks()[0]

    def loss(w_hat, h):
        d = (W - w_hat).double()
        return torch.einsum("eoi,eij,eoj->e", d, h.double(), d)

    assert (loss(out, H)[1:] <= loss(rtn, H)[1:] * (1 + 1e-6)).all(), (loss(out, H), loss(rtn, H))
    assert rep.dead_columns[2] == 1


def test_budget_exactly_at_the_feasibility_edge(model_dir, reference):
    """The smallest plan puts every routed expert in int4 (group 32): B bytes by formats.nbytes over
    the on-disk expert shapes. A bits-per-weight budget worth B bytes is feasible, one worth B - 1
    is not and its refusal states a minimum that is itself accepted. Same with whole-model bytes."""
    from fractions import Fraction

    from moequant import formats
    from moequant.arch import adapter_for
    from moequant.io.checkpoint import open_checkpoint
    from moequant.plan.policy import make_plan
    from moequant.plan.recipe import load_recipe

    ref, _ = reference
    ckpt = open_checkpoint(model_dir)
    ad = adapter_for(ckpt.config)
    spec = formats.get_format("int4", group_size=32, symmetric=True)
    shapes = [ckpt.shape(n) for L in ad.moe_layers for n in ad.expert_tensor_names(L)]
    numel = sum(a * b for a, b in shapes)
    smallest = sum(formats.nbytes(spec, s) for s in shapes)

    def decimal_at_least(x: Fraction) -> str:  # the smallest 12-digit decimal >= x, exact in YAML
        return str(Fraction(-(-x.numerator * 10**12 // x.denominator), 10**12).__float__())

    def plan(budget: str):
        recipe = load_recipe(ROOT / "recipes/selective.yaml", [f"model={model_dir}", f"experts.budget={budget}"])
        return make_plan(recipe, ckpt, ref / "stats")

    def all_int4(p) -> bool:
        return {t.format for t in p.tensors if t.role == "routed_expert"} == {spec.key}

    at_edge = plan(f"{{bits_per_weight: {decimal_at_least(Fraction(8 * smallest, numel))}}}")
    assert all_int4(at_edge) and at_edge.summary["routed_bytes"] == smallest
    with pytest.raises(UserError) as error:
        plan(f"{{bits_per_weight: {decimal_at_least(Fraction(8 * (smallest - 1), numel))}}}")
    shown = str(error.value).split(">= ")[-1].rstrip(".")
    assert all_int4(plan(f"{{bits_per_weight: {shown}}}"))
    # the whole model in bytes: exactly the smallest plan's total is feasible, one byte less is not
    total = at_edge.summary["total_bytes"]
    assert all_int4(plan(f"{{gigabytes: {total // 10**9}.{total % 10**9:09d}}}"))
    with pytest.raises(UserError, match="gigabytes"):
        plan(f"{{gigabytes: {(total - 1) // 10**9}.{(total - 1) % 10**9:09d}}}")


@pytest.mark.parametrize(
    "key", ["int4-g32-sym", "int4-g64-asym", "int3-g32-asym", "int2-g32-sym", "int8-channel", "fp8-block128"]
)
def test_work_files_hold_low_bit_codes_two_to_a_byte_and_give_them_back(key, tmp_path):
    """The quantize pass's resume record: integer codes of <= 4 bits are stored as nibbles (half the
    scratch of int8 codes) and read back exactly, eagerly and lazily; other formats as they are."""
    from moequant import formats
    from moequant.io.work_files import load_quantized, save_quantized

    w = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(0))
    q = formats.quantize(w, key)
    path = tmp_path / "layer.safetensors"
    save_quantized({(0, 1, "gate"): q}, path)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        stored = f.get_tensor("0.codes")
    low_bit = q.spec.is_int and q.spec.bits <= 4
    assert stored.numel() == (q.codes.numel() // 2 if low_bit else q.codes.numel())
    for lazy in (False, True):
        back = load_quantized(path, lazy=lazy)[(0, 1, "gate")]
        for part in ("codes", "scales", "zeros"):
            a, b = getattr(q, part), getattr(back, part)
            assert (a is None and b is None) or torch.equal(
                a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(torch.uint8) if b.dtype.itemsize == 1 else b
            )
