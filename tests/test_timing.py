"""moequant.timing: report.json's account of every second of a run (stages nest exclusively; "other" is
the rest). Counted with a fake clock here, and on a real apply checked for its arithmetic, not its speed."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from tiny import build_tiny_with_tokenizer

from moequant import timing

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(timing, "_clock", lambda: now[0])
    return now


def test_nested_stages_are_exclusive_and_other_is_the_rest(clock):
    timing.start()  # t = 0
    clock[0] = 1
    with timing.stage("forward"):
        clock[0] = 2
        with timing.stage("read"):
            clock[0] = 5
        clock[0] = 7
    clock[0] = 8
    with timing.stage("evaluate", whole=True):  # not split by the stages inside it
        clock[0] = 9
        with timing.stage("read"):
            clock[0] = 10
        clock[0] = 12
    with timing.stage("forward"):  # a stage's seconds add up over its blocks
        clock[0] = 13
    clock[0] = 15
    assert timing.seconds() == {"read": 3, "forward": (7 - 1 - 3) + 1, "evaluate": 4}
    assert timing.account() == {"read": 3, "forward": 4, "evaluate": 4, "other": 15 - 11}
    assert sum(timing.account().values()) == 15


def test_parts_split_a_whole_stage_without_changing_the_stages(clock):
    timing.count_parts(True)
    timing.start()
    with timing.stage("evaluate", whole=True):
        clock[0] = 1
        with timing.part("evaluate: read"):
            clock[0] = 3
        with timing.part("evaluate: layers"):
            clock[0] = 4
        with timing.part("evaluate: read"):  # parts add up over their blocks
            clock[0] = 7
        clock[0] = 8
    assert timing.parts() == {"evaluate: read": 5, "evaluate: layers": 1}
    assert timing.account() == {"evaluate": 8, "other": 0}  # the stages still add up to the run
    timing.stop()
    with timing.part("evaluate: read"):  # no account: nothing counted
        clock[0] = 20
    timing.start()
    assert timing.parts() == {}
    timing.count_parts(False)  # the default: an apply's evaluation does not synchronize per part
    with timing.stage("evaluate", whole=True):
        with timing.part("evaluate: read"):
            clock[0] = 22
    assert timing.parts() == {}
    assert timing.seconds() == {"evaluate": 2}


def test_claim_gives_a_name_the_unstaged_seconds_so_far(clock):
    timing.start()
    clock[0] = 2
    with timing.stage("data"):
        clock[0] = 3
    clock[0] = 4
    timing.claim("setup")  # 0-2 and 3-4
    clock[0] = 6
    assert timing.account() == {"data": 1, "setup": 3, "other": 2}


def test_only_the_thread_that_started_the_account_is_counted(clock):
    timing.start()

    def other_thread():
        with timing.stage("read"):  # the read-ahead: overlaps the main thread, counted where it is waited for
            clock[0] = 4

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert timing.seconds() == {}
    timing.stop()
    with timing.stage("read"):  # no account running: a no-op
        clock[0] = 5
    assert timing.seconds() == {}


def test_an_apply_s_timings_add_up_to_its_run_seconds(tmp_path):
    """report.json's timings split the run into its stages up to the report, "other" the seconds none holds;
    the quantize pass's GPTQ layers show their read, decode, forward, statistics, GPTQ and pack + write."""
    import time

    from moequant.pipeline.apply import apply

    model = build_tiny_with_tokenizer("qwen2_moe", tmp_path / "tiny")
    t0 = time.perf_counter()
    apply(
        str(ROOT / "recipes/uniform-int4.yaml"),
        model=str(model),
        output=str(tmp_path / "run"),
        overrides=["calibration.samples=8", "calibration.seq_len=64", "evaluate.samples=4", "evaluate.seq_len=64"],
        progress=False,
        log=lambda *a: None,
    )
    whole = timing.account()  # the same account, now with the report
    wall = time.perf_counter() - t0
    timings = json.loads((tmp_path / "run" / "report.json").read_text())["timings"]
    for stage in (
        "setup",
        "data",
        "read",
        "decode",
        "materialize",
        "forward",
        "statistics",
        "gptq",
        "gptq_grid",
        "gptq_refit",
        "pack_write",
        "export",
        "evaluate",
        "other",
    ):
        assert stage in timings, (stage, timings)
    assert all(v >= 0 for v in timings.values())
    assert "report" not in timings and "report" in whole
    assert sum(timings.values()) <= sum(whole.values()) <= wall
    for stage, seconds in timings.items():
        if stage != "other":
            assert whole[stage] == seconds  # the report's own seconds come after it was written
