"""`moequant report OUTPUT` and `moequant eval OUTPUT/checkpoint` refuse, in one sentence with exit code 2,
a run directory whose checkpoint or apply's record of it (checkpoint.json) is missing or from another run;
the untouched directory passes both (the control)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny import build_tiny_with_tokenizer

from moequant.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "calibration.samples=2",
    "calibration.seq_len=32",
    "calibration.dataset=builtin:stdlib-prose",
    "evaluate.samples=2",
    "evaluate.seq_len=32",
    "evaluate.dataset=builtin:stdlib-prose",
]

pytestmark = pytest.mark.slow  # one whole apply


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("records")
    model = build_tiny_with_tokenizer("qwen2_moe", base / "model")
    out = base / "run"
    args = ["apply", "--recipe", str(ROOT / "recipes/uniform-int4.yaml"), "--model", str(model), "--output", str(out)]
    result = CliRunner().invoke(main, [*args, *(a for s in TINY for a in ("--set", s))], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return model, out


def damaged(run, tmp_path, damage) -> Path:
    model, out = run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    damage(copy)
    return copy


def report(directory):
    return CliRunner().invoke(main, ["report", str(directory)])


def evaluate(model, directory):
    return CliRunner().invoke(
        main,
        [
            "eval",
            str(directory / "checkpoint"),
            "--reference",
            str(model),
            "--samples",
            "2",
            "--seq-len",
            "32",
            "--dataset",
            "builtin:stdlib-prose",
        ],
    )


def refused(result, *words) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and result.stdout == "", result.output
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def other_run(path: Path) -> None:
    record = json.loads(path.read_text())
    (record["moequant"] if path.name == "config.json" else record)["run_fingerprint"] = "0123456789abcdef"
    path.write_text(json.dumps(record))


def test_an_intact_run_is_reported_and_evaluated(run, tmp_path):
    """`moequant report` writes report.md and report.html again (here after they were deleted: the same markdown
    apply wrote) and says so in two lines: the report's summary and the files, not the markdown itself."""
    model, out = run
    copy = damaged(run, tmp_path, lambda d: [(d / name).unlink() for name in ("report.md", "report.html")])
    result = report(copy)
    assert result.exit_code == 0, result.output
    summary, written = result.stdout.strip().splitlines()
    assert "bits/weight overall" in summary and "KL mean" in summary
    assert written == f"report written: {copy / 'report.md'}, {copy / 'report.html'} (from {copy / 'report.json'})"
    assert (copy / "report.md").read_text() == (out / "report.md").read_text()
    assert 'id="plot-memory-by-role"' in (copy / "report.html").read_text()
    result = evaluate(model, copy)
    assert result.exit_code == 0 and "KL per token" in result.stdout, result.output


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda d: shutil.rmtree(d / "checkpoint"), ["no checkpoint/"]),
        (lambda d: (d / "checkpoint.json").unlink(), ["no checkpoint.json"]),
        (lambda d: other_run(d / "checkpoint.json"), ["different runs", "0123456789abcdef"]),
    ],
    ids=["checkpoint removed", "record removed", "record of another run"],
)
def test_report_refuses(run, tmp_path, damage, words):
    refused(report(damaged(run, tmp_path, damage)), *words)


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda d: shutil.rmtree(d / "checkpoint"), ["does not exist"]),
        (lambda d: (d / "checkpoint.json").unlink(), ["checkpoint.json is missing"]),
        (lambda d: other_run(d / "checkpoint.json"), ["no record", "0123456789abcdef"]),
        (lambda d: other_run(d / "checkpoint" / "config.json"), ["does not belong", "0123456789abcdef"]),
    ],
    ids=["checkpoint removed", "record removed", "record of another run", "checkpoint of another run"],
)
def test_eval_refuses(run, tmp_path, damage, words):
    model, _ = run
    refused(evaluate(model, damaged(run, tmp_path, damage)), *words)
