"""Where a run's seconds go: a plain dict of seconds per stage (report.json's timings, bench_e2e's split).

`start()` begins an account on the calling thread; `stage(name)` adds the seconds of its block to `name`.
Stages nest exclusively: the seconds of a stage entered inside another are taken out of the outer one,
so the stages of one run add up to at most its wall time and `account(total)`'s "other" is the rest. A
stage opened with `whole=True` (the evaluation, the calibration) is not split by the stages inside it.

Only the thread that called `start` is counted: the next layer's read-ahead and the export's writer run
beside it, and the seconds it waits for them land in the stage that waits ("read_wait", "pack_write").
On a GPU a stage synchronizes the device when it ends, so the kernels it queued count in it and not in
the next stage that happens to wait for them. Without `start` (a library call, pareto) every stage is a
no-op. Parts (`part`), a finer split inside a stage, are counted only after `count_parts(True)` (bench_e2e):
each part synchronizes the device, which inside the evaluation's per-batch loop would cost an apply time.
"""

from __future__ import annotations

import contextlib
import threading
import time

_clock = time.perf_counter  # one place to read the time (tests count with a fake clock)
_state: dict = {"owner": None, "seconds": {}, "stack": [], "t0": 0.0, "parts": {}}
_count_parts = {"on": False}  # outlives `start`: the benchmark asks before apply starts its account


def count_parts(on: bool) -> None:
    """Whether `part` counts (and synchronizes the device) from now on; off by default (see the module doc)."""
    _count_parts["on"] = on


def start() -> None:
    """A new account on this thread (the previous one, if any, is dropped)."""
    _state.update(owner=threading.get_ident(), seconds={}, stack=[], t0=_clock(), parts={})


def stop() -> None:
    _state["owner"] = None


def active() -> bool:
    return _state["owner"] == threading.get_ident()


@contextlib.contextmanager
def stage(name: str, whole: bool = False, sync: bool = True):
    """Add the block's seconds, less those of the stages inside it, to `name` (see the module doc)."""
    stack = _state["stack"]
    if not active() or (stack and stack[-1]["whole"]):
        yield
        return
    frame = {"inner": 0.0, "whole": whole}
    stack.append(frame)
    t0 = _clock()
    try:
        yield
    finally:
        if sync:
            _synchronize()
        elapsed = _clock() - t0
        stack.pop()
        seconds = _state["seconds"]
        seconds[name] = seconds.get(name, 0.0) + elapsed - frame["inner"]
        if stack:
            stack[-1]["inner"] += elapsed


@contextlib.contextmanager
def part(name: str):
    """Add the block's seconds to `name` among the parts: where the seconds inside one stage go (the
    evaluation's reads, layers, tallies), kept apart from the stages, which add up to the run. A no-op unless
    `count_parts(True)`."""
    if not (active() and _count_parts["on"]):
        yield
        return
    t0 = _clock()
    try:
        yield
    finally:
        _synchronize()
        parts = _state["parts"]
        parts[name] = parts.get(name, 0.0) + _clock() - t0


def parts() -> dict[str, float]:
    """The parts' seconds so far (a copy)."""
    return dict(_state["parts"])


def claim(name: str) -> None:
    """Give `name` every second since `start` that no stage holds yet (e.g. a run's set-up before its first
    stage), so that code with many exits need not be wrapped in one block."""
    if active() and not _state["stack"]:
        rest = account()["other"]
        _state["seconds"][name] = _state["seconds"].get(name, 0.0) + rest


def seconds() -> dict[str, float]:
    """The stages' seconds so far (a copy), in the order they were first seen."""
    return dict(_state["seconds"])


def account() -> dict[str, float]:
    """The stages' seconds so far and "other": the seconds since `start` that no stage holds (they add up to
    the run's wall time so far)."""
    out = seconds()
    out["other"] = max(0.0, _clock() - _state["t0"] - sum(out.values()))
    return out


def _synchronize() -> None:
    import sys

    torch = sys.modules.get("torch")  # never imported here: a CPU-only stage costs nothing
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()
