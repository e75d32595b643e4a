"""The README's set-up line, then its Quick start, run verbatim and in order on one fresh copy of the repository.

The lines are parsed out of README.md (the ```bash block under "## Set up and run" and the one under
"## Quick start"), so the README and this test cannot drift apart. Of the set-up line this runs its
`moequant` command: the steps before it make the virtual environment and install the package, which
is what this test already runs in (its interpreter's bin/ leads PATH), so the command finds what a
reader's would, the default job's output already there before the Quick start begins. The copy is what a clone holds (git's tracked and untracked,
not ignored files of this tree), made a git repository of its own so that `git status` shows
whether any line left a file git would pick up. The lines run under umask 027, so the modes of
what they write show that the umask is followed (not a hard-coded 0644). Each line prints to
stdout/stderr as a user would see it; what it printed is kept for the checks below.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UMASK = 0o027


pytestmark = pytest.mark.slow


def bash_block(readme: str, heading: str) -> str:
    section = readme.split(f"\n## {heading}", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def quickstart_lines(readme: str) -> list[str]:
    return [line for line in bash_block(readme, "Quick start\n").splitlines() if line.strip()]


def setup_commands(readme: str) -> list[str]:
    """The `moequant` steps of the set-up line (its venv / pip steps are this test's own environment)."""
    (line,) = [line for line in bash_block(readme, "Set up and run").splitlines() if line.strip()]
    steps = [step.strip() for step in line.split("&&")]
    assert steps[0].startswith("python3 -m venv") and any(s.startswith("pip install -e") for s in steps), steps
    return [step for step in steps if step.startswith("moequant ")]


def clone(destination: Path) -> Path:
    """The files a fresh clone of this tree has, committed in a new repository."""
    files = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, files):
        src = ROOT / name
        if src.is_symlink():  # recipes/, calibration/: links into the package, as git stores them
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(src), destination / name)
        elif src.is_file():  # a file deleted in the work tree but still in the index is not in a clone
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, destination / name)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(git + ["init", "-q"], cwd=destination, check=True)
    subprocess.run(git + ["add", "-A"], cwd=destination, check=True)
    subprocess.run(git + ["commit", "-qm", "clone"], cwd=destination, check=True)
    return destination


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    repo = clone(tmp_path_factory.mktemp("clone"))
    readme = (repo / "README.md").read_text()
    setup, lines = setup_commands(readme), quickstart_lines(readme)
    assert setup == ["moequant apply --recipe recipes/selective.yaml"], setup
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(repo),
    }  # the clone's own package, not this tree's
    runs = []
    for line in setup + lines:
        t0 = time.perf_counter()
        done = subprocess.run(
            ["bash", "-c", line],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
            preexec_fn=lambda: os.umask(UMASK),
            timeout=900,
        )
        runs.append(
            {
                "line": line,
                "rc": done.returncode,
                "out": done.stdout,
                "err": done.stderr,
                "seconds": time.perf_counter() - t0,
            }
        )
        print(f"$ {line}\n{done.stdout}{done.stderr}[{time.perf_counter() - t0:.0f} s, exit {done.returncode}]")
    return {"repo": repo, "setup": runs[: len(setup)], "runs": runs[len(setup) :]}


def run_of(quickstart, command: str) -> dict:
    """The one Quick start line that runs `moequant COMMAND` (with these words)."""
    found = [r for r in quickstart["runs"] if r["line"].startswith(f"moequant {command}")]
    assert len(found) == 1, (command, [r["line"] for r in quickstart["runs"]])
    return found[0]


def test_setup_line_then_quickstart_run_verbatim_in_order(quickstart):
    (setup,) = quickstart["setup"]
    assert setup["rc"] == 0, f"{setup['line']}\n{setup['out']}{setup['err']}"
    assert "report: runs/selective/report.html" in setup["out"]
    runs = quickstart["runs"]
    assert [r["line"].split()[:2] for r in runs] == [
        ["moequant", c] for c in ("inspect", "inspect", "calibrate", "plan", "apply", "eval", "report")
    ]
    for r in runs:
        assert r["rc"] == 0, f"{r['line']}\n{r['out']}{r['err']}"
        assert "Traceback" not in r["err"]
        # only our own progress bars: transformers' tqdm ("Loading weights: ... it/s") is silenced
        assert "it/s]" not in r["err"] and "Loading weights" not in r["err"], r["line"]

    first, second = runs[0], runs[1]
    assert "zoo:tiny-qwen2moe" in first["out"] and "routed" in first["out"]
    account = json.loads(second["out"])  # --json: stdout is one JSON object
    assert isinstance(account, dict) and account

    cal = run_of(quickstart, "calibrate")
    assert "statistics of int8-channel, int4-g32-sym written to runs/quickstart/stats" in cal["out"]
    plan = run_of(quickstart, "plan")
    assert "plan written to runs/quickstart/plan.json" in plan["out"]
    applied = run_of(quickstart, "apply")
    assert "calibration statistics: runs/quickstart/stats (reused)" in applied["out"]  # calibrate's, not redone
    assert "report: runs/quickstart/report.html" in applied["out"]
    assert "KL per token" in run_of(quickstart, "eval")["out"]
    assert (
        "report written: runs/quickstart/report.md, runs/quickstart/report.html" in run_of(quickstart, "report")["out"]
    )


def test_quickstart_writes_only_under_ignored_runs(quickstart):
    repo = quickstart["repo"]
    status = subprocess.run(
        ["git", "status", "--porcelain", "--ignored", "--untracked-files=all"],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    untracked = [s for s in status if s.startswith("??")]
    assert untracked == []  # every new file is ignored by git
    ignored = {s[3:] for s in status if s.startswith("!!")}
    assert ignored and all(p.startswith("runs/") or "__pycache__" in p for p in ignored), sorted(ignored)
    assert not (repo / "stats").exists()


def test_output_modes_follow_the_umask(quickstart):
    for out in (quickstart["repo"] / "runs" / "selective", quickstart["repo"] / "runs" / "quickstart"):
        entries = [out, *out.rglob("*")]
        assert {"checkpoint", "stats", "plan.json", "report.md", "checkpoint.json"} <= {p.name for p in entries}
        modes_follow_the_umask(out, entries)


def modes_follow_the_umask(out, entries):
    for p in entries:
        mode = stat.S_IMODE(p.stat().st_mode)
        expected = (0o777 if p.is_dir() else 0o666) & ~UMASK  # 0750 / 0640: readable by the group
        assert mode == expected, f"{p.relative_to(out)}: {oct(mode)}, expected {oct(expected)}"


def parse_layer_table(report_md: str) -> dict[int, dict[str, int]]:
    section = report_md.split("## Formats per MoE layer (routed experts)\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert rows[0] == "| layer | formats | experts per format |"
    table = {}
    for row in rows[2:]:
        layer, keys, counts = [c.strip() for c in row.strip("|").split("|")]
        parsed = {}
        for part in counts.split(", "):
            key, n = part.rsplit(" ×", 1)
            parsed[key] = int(n)
        assert keys.split(", ") == list(parsed)
        table[int(layer)] = parsed
    return table


def test_report_md_layer_table_is_the_plan(quickstart):
    out = quickstart["repo"] / "runs" / "quickstart"
    plan = json.loads((out / "plan.json").read_text())
    expert_format = {}
    for t in plan["tensors"]:
        if t["role"] == "routed_expert" and t["expert"] is not None:
            expert_format.setdefault((t["layer"], t["expert"]), set()).add(t["format"])
    assert all(len(keys) == 1 for keys in expert_format.values())  # one format per expert (gate, up, down)
    expected: dict[int, Counter] = {}
    for (layer, _), keys in expert_format.items():
        expected.setdefault(layer, Counter())[next(iter(keys))] += 1
    table = parse_layer_table((out / "report.md").read_text())
    assert table == {L: dict(c) for L, c in expected.items()}
    assert set(table) == {int(L) for L in plan["summary"]["layers"]}
    for L, info in plan["summary"]["layers"].items():
        assert table[int(L)] == info["counts"]


def test_one_byte_account_everywhere(quickstart):
    """The bits per routed-expert weight of the plan, `moequant plan`, `apply`, report.json and
    report.md are one number: the plan's bytes equal the checkpoint's routed-expert bytes."""
    out = quickstart["repo"] / "runs" / "quickstart"
    plan = json.loads((out / "plan.json").read_text())
    report = json.loads((out / "report.json").read_text())
    memory = report["memory"]
    assert memory["by_role"]["routed_expert"]["bytes_quantized"] == plan["summary"]["routed_bytes"]
    bits = plan["summary"]["bits_per_weight"]["routed_experts"]
    assert memory["bits_per_weight_experts"] == bits
    assert memory["bits_per_weight"] == plan["summary"]["bits_per_weight"]["overall"]
    assert (
        memory["layout_metadata_bytes"]
        == memory["bytes_quantized"] - sum(v["bytes_quantized"] for v in memory["by_role"].values())
        > 0
    )  # compressed-tensors' weight_shape
    shown = f"{bits:.3f}"
    assert math.isclose(float(shown), bits, abs_tol=5e-4)
    assert f"bits per weight: {shown} routed experts" in run_of(quickstart, "plan")["out"]
    assert f"{shown} bits per routed-expert weight" in run_of(quickstart, "apply")["out"]
    md = (out / "report.md").read_text()
    assert f"{shown} in routed experts" in md  # the headline
    assert f"| bits per weight, routed experts | 16.000 | {shown} |" in md
    assert re.search(rf"\| this plan \(budget\) \| [^|]+ \| {re.escape(shown)} \|", md)
    # the alternatives' bits are filled in, from the same account
    alternatives = [line for line in md.splitlines() if line.startswith(("| uniform ", "| per-expert plan"))]
    assert alternatives and all(re.search(r"\| \d+\.\d{3} \|", line) for line in alternatives), alternatives
    for u in plan["summary"]["uniform_alternatives"]:
        assert f"| uniform {u['format']} |" in md and f"{u['routed_bits_per_weight']:.3f}" in md


def test_report_md_says_what_each_error_column_means(quickstart):
    md = (quickstart["repo"] / "runs" / "quickstart" / "report.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| layer | expert | share"))
    for column in ("predicted sq. error/token", "measured sq. error/token", "measured relative error"):
        assert f"| {column} |" in header or header.endswith(f"| {column} |")
        assert re.search(rf"^- {re.escape(column)}: .*(units|no unit)", md, re.M), column


def test_the_setup_run_is_kept_and_plain_transformers_refuses_its_checkpoint(quickstart):
    """The Quick start wrote its own directory: the set-up line's 128-sample run is still whole (one run,
    as `moequant report` checks it). Its checkpoint mixes int8 and int4 layers, which plain transformers
    refuses in a sentence naming moequant.load and vLLM (tests/test_transformers_load.py has both cases)."""
    repo = quickstart["repo"]
    out = repo / "runs" / "selective"
    summary = json.loads((out / "stats" / "summary.json").read_text())
    assert summary["samples"] == 128, summary["samples"]
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(repo),
    }
    assert (
        subprocess.run(
            ["moequant", "report", "runs/selective"], cwd=repo, env=env, capture_output=True, text=True, timeout=300
        ).returncode
        == 0
    )
    plan = json.loads((out / "plan.json").read_text())
    assert len({t["format"] for t in plan["tensors"] if t["role"] == "routed_expert"}) > 1  # a per-layer mix
    probe = (
        "import torch, transformers\n"
        "transformers.AutoModelForCausalLM.from_pretrained('runs/selective/checkpoint', dtype=torch.float32)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    from moequant.layouts.compressed_tensors import TRANSFORMERS_REFUSAL

    assert TRANSFORMERS_REFUSAL in done.stderr + done.stdout
