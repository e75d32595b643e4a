"""What the OS refuses on a path the user gave — the output directory, the statistics directory, the
model — is one sentence on stderr, exit code 2, no traceback, and nothing written there.

Each case is the real OS condition: a file where a directory should be, a path under a character
device, a directory /proc will not create, a read-only and a full file system (tmpfs, mounted as
root), and a directory the user may not write or read (as root the command runs without the
capabilities that override file permissions). The CLI runs in this process (click's runner), except
the permission cases, which need a process of their own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from moequant.cli import main

ROOT = Path(__file__).resolve().parents[1]
APPLY = ["apply", "--recipe", "uniform-int4", "--model", "zoo:tiny-qwen2moe"]


class Done:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def run(args, without_permission_override=False):
    if not without_permission_override:
        result = CliRunner().invoke(main, args)
        return Done(result.exit_code, result.stdout, result.stderr)
    # root reads and writes whatever it likes: drop the capabilities that let it (the user's own rights remain)
    drop = "dac_override,-dac_read_search"
    done = subprocess.run(
        ["setpriv", f"--inh-caps=-{drop}", f"--bounding-set=-{drop}", sys.executable, "-m", "moequant", *args],
        cwd="/",
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return Done(done.returncode, done.stdout, done.stderr)


def assert_one_sentence(done, *words):
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in done.stderr, done.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def listing(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


@pytest.fixture
def tmpfs(tmp_path):
    """A 1 MB tmpfs (root only), unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (the read-only and full-disk cases need their own file system)")
    yield disk
    subprocess.run(["umount", "--lazy", str(disk)], check=True)


def test_output_that_is_a_file(tmp_path):
    (tmp_path / "out").write_text("mine")
    assert_one_sentence(run([*APPLY, "--output", str(tmp_path / "out")]), str(tmp_path / "out"), "not a directory")
    assert (tmp_path / "out").read_text() == "mine" and listing(tmp_path) == ["out"]


def test_output_under_a_file_that_is_not_a_directory():
    assert_one_sentence(run([*APPLY, "--output", "/dev/full/x"]), "/dev/full/x", "not a directory")


def test_output_the_os_will_not_create():
    assert_one_sentence(run([*APPLY, "--output", "/proc/moequant-x"]), "/proc/moequant-x")
    assert not os.path.exists("/proc/moequant-x")


def test_output_on_a_read_only_file_system(tmpfs):
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    assert_one_sentence(run([*APPLY, "--output", str(tmpfs / "run")]), str(tmpfs / "run"), "read-only")
    assert listing(tmpfs) == []


def test_output_on_a_full_disk(tmpfs):
    with open(tmpfs / "filler", "wb") as f:  # fill it to the last block
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    subprocess.run(["dd", "if=/dev/zero", f"of={tmpfs / 'rest'}", "bs=1", "count=100000"], capture_output=True)
    before = listing(tmpfs)
    assert_one_sentence(run([*APPLY, "--output", str(tmpfs / "run")]), str(tmpfs / "run"), "disk is full")
    assert listing(tmpfs) == before


def test_output_without_write_permission(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    done = run([*APPLY, "--output", str(locked / "run")], without_permission_override=True)
    locked.chmod(0o755)
    assert_one_sentence(done, str(locked / "run"), "permission denied")
    assert listing(tmp_path) == ["locked"]


def test_statistics_directory_that_is_a_file(tmp_path):
    (tmp_path / "stats").write_text("mine")
    done = run(
        [
            "calibrate",
            "--recipe",
            "selective",
            "--output",
            str(tmp_path / "run"),
            "--stats",
            str(tmp_path / "stats"),
            "--samples",
            "2",
            "--seq-len",
            "16",
        ]
    )
    assert_one_sentence(done, str(tmp_path / "stats"), "not a directory")
    assert listing(tmp_path) == ["stats"] and (tmp_path / "stats").read_text() == "mine"


def test_statistics_directory_under_a_device():
    done = run(
        [
            "calibrate",
            "--recipe",
            "selective",
            "--output",
            "/tmp/moequant-never",
            "--stats",
            "/dev/full/s",
            "--samples",
            "2",
            "--seq-len",
            "16",
        ]
    )
    assert_one_sentence(done, "/dev/full/s", "not a directory")
    assert not os.path.exists("/tmp/moequant-never")


def test_model_without_read_permission(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(ROOT / "moequant" / "zoo" / "tiny-qwen2moe", model)
    (model / "model.safetensors").chmod(0o000)
    done = run(
        ["apply", "--recipe", "uniform-int4", "--model", str(model), "--output", str(tmp_path / "run")],
        without_permission_override=True,
    )
    assert_one_sentence(done, str(model / "model.safetensors"), "ermission denied")
    assert not (tmp_path / "run").exists()


def test_a_path_refused_later_in_a_command_is_one_sentence_too(monkeypatch, tmp_path):
    """Past the output lock (e.g. plan.json on a file system remounted read-only mid-run) the command line
    still says one sentence naming the file; an OS error that names no path stays a traceback (a bug)."""
    import errno

    from moequant.pipeline import apply as apply_module

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "run" / "plan.json"))

    monkeypatch.setattr(apply_module, "run_plan", read_only)
    line = assert_one_sentence(
        run(["plan", "--recipe", "uniform-int4", "--output", str(tmp_path / "run")]),
        str(tmp_path / "run" / "plan.json"),
        "read-only",
    )
    assert line.endswith("check the path or choose another one.")

    def no_path(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(apply_module, "run_plan", no_path)
    result = CliRunner().invoke(main, ["plan", "--recipe", "uniform-int4", "--output", str(tmp_path / "run")])
    assert isinstance(result.exception, OSError) and result.exit_code == 1
