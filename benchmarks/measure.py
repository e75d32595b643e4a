"""What the benchmarks measure the same way (imported by the scripts beside it)."""

from __future__ import annotations

from pathlib import Path


def peak_rss_bytes() -> int:
    """This process's own peak resident size (VmHWM). Not ru_maxrss: Linux folds the parent's peak into a
    child's at exec, so a child of a large process would report the parent's memory."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(status["VmHWM"].split()[0]) * 1024
