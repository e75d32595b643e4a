"""plan.json and report.json are written and read through their pydantic schemas (plan.plan_io.PlanFile,
report.ReportFile): what apply writes reads back and writes again byte for byte, and a malformed file is
refused with one sentence naming the file and the key (exit code 2 through `moequant report`)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_policy import budget, make_stats, model_tensors

from moequant.cli import main
from moequant.errors import UserError
from moequant.plan.model import Plan, TensorPlan
from moequant.plan.plan_io import PlanFile, TensorEntry, plan_to_dict, read_plan, write_plan
from moequant.plan.policy import make_plan
from moequant.report import ReportFile, read_report, write_report

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["calibration.samples=8", "calibration.seq_len=64", "evaluate.samples=4", "evaluate.seq_len=64"]


def _budget_plan():
    return make_plan(budget("vllm", ["int8", "int4", "int3"], bits_per_weight=5), model_tensors(), make_stats(seed=2))


def test_the_schema_writes_the_plan_as_the_dataclasses_hold_it(tmp_path):
    plan = _budget_plan()
    path = write_plan(plan, tmp_path / "plan.json")
    data = json.loads(path.read_text())
    # the file's keys are the schema's fields in order, and those are the dataclasses' fields
    assert list(data) == ["schema", *(k for k in PlanFile.model_fields if k != "schema_")]
    assert list(data)[1:] == [f.name for f in dataclasses.fields(Plan)]
    assert (
        list(data["tensors"][0]) == list(TensorEntry.model_fields) == [f.name for f in dataclasses.fields(TensorPlan)]
    )
    assert read_plan(path) == plan
    assert path.read_text() == json.dumps(plan_to_dict(read_plan(path)), indent=1) + "\n"


@pytest.mark.parametrize(
    "where, value, key, shown",
    [
        (("tensors", 3, "bytes"), "12", "tensors[3].bytes", "'12'"),
        (("tensors", 0, "shape"), [64, "x"], "tensors[0].shape[1]", "'x'"),
        (("method",), "greedy", "method", "'greedy'"),
        (("summary", "total_bytes"), -0.5, "summary.total_bytes", "-0.5"),
        (("budget", "routed_bytes_limit"), None, "budget.routed_bytes_limit", "None"),
    ],
)
def test_a_malformed_plan_is_one_sentence_naming_the_file_and_key(tmp_path, where, value, key, shown):
    data = plan_to_dict(_budget_plan())
    node = data
    for part in where[:-1]:
        node = node[part]
    node[where[-1]] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError) as info:
        read_plan(path)
    sentence = str(info.value)
    assert sentence.startswith(f"plan {path} is malformed: key '{key}' has value {shown}: ")
    assert sentence.endswith("; accepted: a plan.json written by `moequant plan`.") and "\n" not in sentence


def test_a_plan_without_a_required_key_names_it(tmp_path):
    data = plan_to_dict(_budget_plan())
    del data["tensors"][1]["format"]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"^plan .* is malformed: key 'tensors\[1\]\.format' is missing; accepted"):
        read_plan(path)


@pytest.fixture(scope="module")
def applied(tmp_path_factory):
    out = tmp_path_factory.mktemp("apply") / "run"
    args = ["apply", "--recipe", str(ROOT / "recipes" / "uniform-int4.yaml"), "--output", str(out)]
    for s in SMALL:
        args += ["--set", s]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.slow
def test_files_written_by_apply_round_trip_through_their_schemas(applied, tmp_path):
    plan_text = (applied / "plan.json").read_text()
    assert json.dumps(plan_to_dict(read_plan(applied / "plan.json")), indent=1) + "\n" == plan_text
    report = read_report(applied / "report.json")
    assert ReportFile.model_validate(report).model_dump(by_alias=True) == report
    write_report(report, tmp_path)
    assert (tmp_path / "report.json").read_text() == (applied / "report.json").read_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    "where, value, key",
    [
        (("memory", "bytes_quantized"), "many", "memory.bytes_quantized"),
        (("experts", 2, "layer"), 1.5, "experts[2].layer"),
        (("timings",), [], "timings"),
    ],
)
def test_moequant_report_refuses_a_malformed_report_with_exit_2(applied, tmp_path, where, value, key):
    out = tmp_path / "run"
    shutil.copytree(applied, out)  # its plan, checkpoint and report of one run, as `moequant report` checks
    data = json.loads((out / "report.json").read_text())
    node = data
    for part in where[:-1]:
        node = node[part]
    node[where[-1]] = value
    (out / "report.json").write_text(json.dumps(data))
    result = CliRunner().invoke(main, ["report", str(out)])
    assert result.exit_code == 2, result.output
    assert f"report {out / 'report.json'} is malformed: key '{key}' has value {value!r}: " in result.output
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_moequant_report_reads_a_report_from_an_older_or_newer_version(applied, tmp_path):
    """report.json's keys may be added, none removed or renamed: a report written before a key existed (here
    memory.routed_expert_matrices, added 2026-12-02) or by a version with a key this one lacks still renders."""
    out = tmp_path / "run"
    shutil.copytree(applied, out)
    data = json.loads((out / "report.json").read_text())
    del data["memory"]["routed_expert_matrices"]
    data["a_later_section"] = {"anything": 1}
    (out / "report.json").write_text(json.dumps(data))
    result = CliRunner().invoke(main, ["report", str(out)])
    assert result.exit_code == 0, result.output
    assert read_report(out / "report.json") == data
