"""One writer per output directory (moequant.io.run_lock) and one run per directory's outputs
(moequant.io.fingerprint): concurrent runs, a SIGKILLed holder, torchrun ranks, a swapped checkpoint.

Real `moequant` processes on the bundled zoo:tiny-qwen2moe with the smallest settings. A run is
held mid-way with SIGSTOP (never by sleeping and hoping), so the refused run provably met a live holder.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from moequant.cli import main
from moequant.errors import UserError
from moequant.io.fingerprint import KEY, check_run_directory, checkpoint_fingerprint, file_fingerprint
from moequant.io.run_lock import LOCK_FILE, output_lock

ROOT = Path(__file__).resolve().parent.parent
MODEL = "zoo:tiny-qwen2moe"
SMALL = [
    "calibration.samples=8",
    "calibration.seq_len=64",
    "calibration.probe_samples=0",
    "calibration.dataset=builtin:stdlib-prose",
    "evaluate.samples=4",
    "evaluate.seq_len=64",
    "evaluate.dataset=builtin:stdlib-prose",
]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
ENV.pop("RANK", None)


def apply_args(recipe: str, out: Path) -> list[str]:
    args = ["apply", "--recipe", str(ROOT / "recipes" / recipe), "--model", MODEL, "--output", str(out)]
    for s in SMALL:
        args += ["--set", s]
    return args


def start(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:  # a file, not a pipe: a stopped or chatty run never blocks on its output
        return subprocess.Popen(
            [sys.executable, "-m", "moequant.cli", *args], cwd=ROOT, env=ENV, stdout=f, stderr=subprocess.STDOUT
        )


def is_held(directory: Path) -> bool:
    """Whether some process holds the directory's lock (a shared probe: never blocks the holder)."""
    try:
        fd = os.open(directory / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def wait_until_held_by(directory: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Until `proc` holds the lock: its pid is in the lock file's text, which the holder writes only
    after its flock succeeded (reading the text takes no lock, so it cannot disturb the taking)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before it was seen holding the lock"
        try:
            if json.loads((directory / LOCK_FILE).read_text() or "{}").get("pid") == proc.pid:
                assert is_held(directory)
                return
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.005)
    raise AssertionError(f"{proc.pid} did not take the lock of {directory} within {timeout} s")


def snapshot(directory: Path) -> dict:
    """Every file (hidden ones too) with its size, mtime and content hash."""
    return {
        str(p.relative_to(directory)): (
            p.stat().st_size,
            p.stat().st_mtime_ns,
            hashlib.sha256(p.read_bytes()).hexdigest(),
        )
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def weight_bits(checkpoint: Path) -> set[int]:
    groups = json.loads((checkpoint / "config.json").read_text())["quantization_config"]["config_groups"]
    return {g["weights"]["num_bits"] for g in groups.values()}


def expert_formats(out: Path) -> set[str]:
    plan = json.loads((out / "plan.json").read_text())
    return {t["format"] for t in plan["tensors"] if t["role"] == "routed_expert"}


def one_error_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in text, text
    return lines[0]


HOLD = (
    "import sys\nfrom moequant.io.run_lock import output_lock\nwith output_lock(sys.argv[1], 'test'):\n"
    "    print('held', flush=True)\n    sys.stdin.read()\n"
)


@pytest.fixture
def holder(tmp_path):
    """A separate process holding the lock of tmp_path/'held' until it is told to stop (or killed)."""
    directory = tmp_path / "held"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory)], env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdout.readline() == b"held\n"
    yield directory, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


# ----------------------------------------------------------------------------- whole runs


@pytest.fixture(scope="module")
def concurrent(tmp_path_factory):
    """uniform-int4 runs into `out`; uniform-int8 is started into the same `out` while int4 holds it."""
    tmp = tmp_path_factory.mktemp("concurrent")
    out = tmp / "out"
    first = start(apply_args("uniform-int4.yaml", out), tmp / "int4.log")
    wait_until_held_by(out, first)
    os.kill(first.pid, signal.SIGSTOP)  # the holder stays mid-run for as long as the second run needs
    try:
        before = snapshot(out)
        t0 = time.perf_counter()
        second = subprocess.run(
            [sys.executable, "-m", "moequant.cli", *apply_args("uniform-int8.yaml", out)],
            cwd=ROOT,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=300,
        )
        refused_in = time.perf_counter() - t0
        after = snapshot(out)
        holder_stopped = first.poll() is None
    finally:
        os.kill(first.pid, signal.SIGCONT)
    rc = first.wait(timeout=600)
    return {
        "out": out,
        "first_rc": rc,
        "first_log": (tmp / "int4.log").read_text(),
        "second": second,
        "refused_in": refused_in,
        "before": before,
        "after": after,
        "holder_stopped": holder_stopped,
        "holder_pid": first.pid,
    }


@pytest.mark.slow  # whole apply runs in subprocesses
def test_second_run_into_a_held_directory_is_refused_at_once_and_the_first_one_owns_everything(concurrent):
    out, second = concurrent["out"], concurrent["second"]
    assert concurrent["holder_stopped"]  # refused while the holder was alive and mid-run, not after it ended
    assert second.returncode == 2, second.stdout + second.stderr
    line = one_error_line(second.stderr)
    assert str(out) in line and f"pid {concurrent['holder_pid']}" in line and "uniform-int4.yaml" in line, line
    assert concurrent["after"] == concurrent["before"]  # nothing touched
    print(f"second run refused in {concurrent['refused_in']:.1f} s (process start included)")

    assert concurrent["first_rc"] == 0, concurrent["first_log"][-3000:]
    fingerprint = check_run_directory(out)  # plan.json, checkpoint/ and report.json agree ...
    assert fingerprint and file_fingerprint(out / "checkpoint.json") == fingerprint
    # ... and they are the int4 run's, in content too
    assert expert_formats(out) == {"int4-g32-sym"}
    assert weight_bits(out / "checkpoint") == {4}
    report = json.loads((out / "report.json").read_text())
    assert report["recipe"]["experts"]["format"] == "int4"
    assert report["memory"]["bits_per_weight_experts"] == pytest.approx(4.5, abs=0.01)
    assert not (out / LOCK_FILE).exists()  # released cleanly


@pytest.mark.slow  # whole apply runs in subprocesses
def test_fingerprint_is_the_run_s_own(concurrent):
    """The stored fingerprint is recomputed from the int4 recipe and its plan (not the int8 one's)."""
    from moequant.io.checkpoint import open_checkpoint
    from moequant.pipeline.apply import calibration_settings, resolve_recipe, run_fingerprint
    from moequant.plan.plan_io import read_plan

    out = concurrent["out"]
    plan = read_plan(out / "plan.json")
    ckpt = open_checkpoint(MODEL)
    fps = {}
    for name in ("uniform-int4.yaml", "uniform-int8.yaml"):
        recipe = resolve_recipe(str(ROOT / "recipes" / name), MODEL, str(out), SMALL)
        fps[name] = run_fingerprint(recipe, ckpt, calibration_settings(recipe), plan)
    assert plan.run_fingerprint == fps["uniform-int4.yaml"] != fps["uniform-int8.yaml"]
    # the output path is not part of it: the same run elsewhere has the same fingerprint
    elsewhere = resolve_recipe(str(ROOT / "recipes/uniform-int4.yaml"), MODEL, "/somewhere/else", SMALL)
    assert run_fingerprint(elsewhere, ckpt, calibration_settings(elsewhere), plan) == plan.run_fingerprint


@pytest.mark.slow  # whole apply runs in subprocesses
def test_sigkilled_holder_never_blocks_the_rerun_which_resumes_and_finishes(concurrent, tmp_path):
    out = tmp_path / "killed"
    proc = start(apply_args("uniform-int4.yaml", out), tmp_path / "killed.log")
    deadline = time.monotonic() + 600
    while not (out / "work" / "hidden.safetensors").exists():  # the quantize pass has finished a layer
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "killed.log").read_text()[-3000:]
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    stale = json.loads((out / LOCK_FILE).read_text())
    assert stale["pid"] == proc.pid and not is_held(out)  # the file is left, the lock died with its process

    t0 = time.perf_counter()
    rerun = subprocess.run(
        [sys.executable, "-m", "moequant.cli", *apply_args("uniform-int4.yaml", out)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    print(f"rerun after SIGKILL finished in {time.perf_counter() - t0:.1f} s")
    # resumed, not started over: the killed run's plan is reused (a uniform recipe calibrates nothing;
    # the quantize pass's own resume per layer is test_crash's)
    assert f"plan: {out / 'plan.json'} (unchanged, reused)" in rerun.stdout
    assert not (out / "work").exists() and not (out / LOCK_FILE).exists()
    assert check_run_directory(out) == file_fingerprint(concurrent["out"] / "plan.json")
    assert digest(out / "checkpoint") == digest(concurrent["out"] / "checkpoint")  # same run, same bytes


@pytest.fixture(scope="module")
def int8_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("int8") / "out"
    result = CliRunner().invoke(main, apply_args("uniform-int8.yaml", out), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.slow  # whole apply runs in subprocesses
def test_swapped_checkpoint_is_named_by_eval_and_report_and_remade_by_a_rerun(concurrent, int8_run, tmp_path):
    """int8's output directory with int4's checkpoint copied in by hand."""
    mixed = tmp_path / "mixed"
    shutil.copytree(int8_run, mixed)
    shutil.rmtree(mixed / "checkpoint")
    shutil.copytree(concurrent["out"] / "checkpoint", mixed / "checkpoint")
    int4_fp, int8_fp = checkpoint_fingerprint(mixed / "checkpoint"), file_fingerprint(mixed / "plan.json")
    assert int4_fp and int8_fp and int4_fp != int8_fp
    untouched = snapshot(mixed)
    runner = CliRunner()

    result = runner.invoke(
        main,
        ["eval", str(mixed / "checkpoint"), "--reference", MODEL, "--samples", "2", "--seq-len", "32"],
        catch_exceptions=False,
    )
    assert result.exit_code == 2
    line = one_error_line(result.output)
    assert str(mixed / "checkpoint") in line and int4_fp in line and int8_fp in line, line

    result = runner.invoke(main, ["report", str(mixed)], catch_exceptions=False)
    assert result.exit_code == 2
    line = one_error_line(result.output)
    assert str(mixed) in line and int4_fp in line and int8_fp in line, line
    assert snapshot(mixed) == untouched

    # the report of that pair, made through the library, refuses too
    from moequant.report import build_report

    with pytest.raises(UserError, match=f"{int4_fp}.*{int8_fp}"):
        build_report(
            model=MODEL,
            checkpoint=mixed / "checkpoint",
            plan=json.loads((mixed / "plan.json").read_text()),
            output_dir=mixed,
        )
    assert snapshot(mixed) == untouched

    # the rerun remakes the foreign checkpoint instead of reusing it beside int8's plan
    result = runner.invoke(main, apply_args("uniform-int8.yaml", mixed), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert f"belongs to another run (run fingerprint {int4_fp}" in result.output
    assert check_run_directory(mixed) == int8_fp and weight_bits(mixed / "checkpoint") == {8}
    result = runner.invoke(main, ["report", str(mixed)], catch_exceptions=False)
    # `report` prints its summary and the files it wrote (issue 57), from the remade run's report.json
    assert result.exit_code == 0 and "report.html" in result.output and "report.json" in result.output, result.output


@pytest.mark.slow  # whole apply runs in subprocesses
def test_eval_output_writes_the_checkpoint_s_run_and_refuses_another_run_s_directory(concurrent, int8_run):
    out = concurrent["out"]
    runner = CliRunner()
    untouched = snapshot(out)
    result = runner.invoke(
        main,
        [
            "eval",
            str(int8_run / "checkpoint"),
            "--reference",
            MODEL,
            "--samples",
            "2",
            "--seq-len",
            "32",
            "--output",
            str(out),
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 2
    line = one_error_line(result.output)
    assert str(out) in line and file_fingerprint(int8_run / "plan.json") in line, line
    assert snapshot(out) == untouched and not (out / "eval.json").exists()

    result = runner.invoke(
        main,
        [
            "eval",
            str(int8_run / "checkpoint"),
            "--reference",
            MODEL,
            "--samples",
            "2",
            "--seq-len",
            "32",
            "--output",
            str(int8_run),
            "--json",
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    written = json.loads((int8_run / "eval.json").read_text())
    assert written[KEY] == file_fingerprint(int8_run / "plan.json") and written["kl_mean"] > 0
    assert json.loads(result.stdout)["kl_mean"] == written["kl_mean"]  # stdout: the JSON alone


# ----------------------------------------------------------------------------- the lock itself


def _commands(directory: Path) -> dict[str, list[str]]:
    recipe = ["--recipe", str(ROOT / "recipes/uniform-int4.yaml"), "--model", MODEL, "--output", str(directory)]
    return {
        "apply": ["apply", *recipe],
        "plan": ["plan", *recipe],
        "pareto": ["pareto", *recipe, "--budgets", "int4", "--targets", "vllm"],
        "calibrate": ["calibrate", "--model", MODEL, "--output", str(directory)],
        "eval --output": ["eval", "zoo:tiny-qwen2moe", "--reference", MODEL, "--output", str(directory)],
    }


@pytest.mark.parametrize("command", ["apply", "plan", "pareto", "calibrate", "eval --output"])
def test_every_writing_command_is_refused_while_another_process_holds_the_directory(holder, command):
    directory, proc = holder
    before = snapshot(directory)
    result = CliRunner().invoke(main, _commands(directory)[command], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    line = one_error_line(result.output)
    assert f"{directory} is being written by another moequant run, pid {proc.pid}" in line, line
    assert snapshot(directory) == before and is_held(directory)


def test_a_directory_inside_a_held_one_is_refused(holder):
    directory, proc = holder
    with pytest.raises(UserError, match=f"{directory / 'stats'} is inside {directory}.*pid {proc.pid}"):
        with output_lock(directory / "stats", "calibrate"):
            pass
    assert not (directory / "stats").exists()


def test_lock_dies_with_its_sigkilled_holder(holder):
    directory, proc = holder
    with pytest.raises(UserError):
        with output_lock(directory, "apply"):
            pass
    proc.kill()
    proc.wait()
    assert (directory / LOCK_FILE).exists()  # a stale file ...
    with output_lock(directory, "apply"):  # ... that blocks nothing
        assert json.loads((directory / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not (directory / LOCK_FILE).exists()


def test_only_rank_zero_takes_the_lock(holder, monkeypatch, tmp_path):
    directory, proc = holder
    monkeypatch.setenv("RANK", "1")  # a non-zero torchrun rank: rank 0 of its job is the writer
    with output_lock(directory, "apply"):
        assert is_held(directory) and json.loads((directory / LOCK_FILE).read_text())["pid"] == proc.pid
    with output_lock(tmp_path / "free", "apply"):
        assert not (tmp_path / "free" / LOCK_FILE).exists()
    for rank in ("0", ""):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(UserError, match=f"pid {proc.pid}"):
            with output_lock(directory, "apply"):
                pass


def test_reentrant_in_one_process_and_a_refused_run_leaves_no_empty_directory(tmp_path):
    out = tmp_path / "a" / "b"
    with output_lock(out, "apply"):
        with output_lock(out, "eval"), output_lock(out / "stats", "calibrate"):  # apply's own calibrate
            assert (out / "stats" / LOCK_FILE).exists()
        assert (out / LOCK_FILE).exists() and not (out / "stats").exists()
    assert not (tmp_path / "a").exists()  # made for the lock only, nothing written: removed again
    result = CliRunner().invoke(main, ["apply", "--model", str(tmp_path / "missing"), "--output", str(out)])
    assert result.exit_code == 2 and not (tmp_path / "a").exists()


def test_calibrate_overwrite_keeps_the_held_lock_file(tmp_path):
    """Replacing statistics of other settings clears the directory but not its (held) lock file."""
    from moequant.io.run_lock import clear_directory

    out = tmp_path / "stats"
    with output_lock(out, "calibrate"):
        (out / "summary.json").write_text("{}")
        (out / "layer_000.safetensors").write_bytes(b"x")
        (out / ".work").mkdir()
        clear_directory(out)
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE] and is_held(out)
