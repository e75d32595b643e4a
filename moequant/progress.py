"""Per-layer progress on screen: layer, stage, tokens/s and time left (rich), or nothing."""

from __future__ import annotations

import time


class LayerProgress:
    """`start(L, stage)` / `stage(name)` / `done(L)` around each decoder layer of a pass."""

    def __init__(self, label: str, total: int, tokens: int, enabled: bool = True):
        self.label, self.tokens, self.enabled = label, tokens, enabled
        self.t0, self.finished = time.perf_counter(), 0
        self._bar = None
        if enabled and total > 0:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"),
                TimeRemainingColumn(),
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task(label, total=total, rate="")

    def start(self, layer: int, stage: str = "") -> None:
        if self.enabled and self.finished == 0 and layer > 0 and not hasattr(self, "layer"):
            # a pass's first layer is not 0 only when it continues the work an interrupted run left
            print(f"{self.label}: resuming at layer {layer} (layers 0-{layer - 1} were finished by an earlier run)")
        self.layer = layer
        self.stage(stage)

    def stage(self, name: str) -> None:
        if self._bar is not None:
            what = f"{self.label} layer {self.layer}" + (f" ({name})" if name else "")
            self._bar.update(self._task, description=what)

    def done(self, layer: int) -> None:
        self.finished += 1
        if self._bar is not None:
            rate = self.tokens * self.finished / max(time.perf_counter() - self.t0, 1e-9)
            self._bar.update(self._task, advance=1, rate=f"{rate:,.0f} tokens/s")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


PLAIN_EVERY_S = 10.0  # a log (no terminal) gets a line at most this often while steps finish


class StepProgress:
    """A bar with the time left over `total` equal steps (rich), or nothing: `advance()` after each. Where
    stdout is no terminal (a log, a pipe), where rich draws no bar until the end, a plain line
    "label: done/total steps, N s" once at least PLAIN_EVERY_S seconds have passed since the last one."""

    def __init__(self, label: str, total: int, enabled: bool = True):
        self._bar, self.label, self.total, self.done = None, label, total, 0
        self.t0 = self._said = time.perf_counter()
        self._plain = False
        if enabled and total > 0:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._plain = not Console().is_terminal
            if not self._plain:
                self._bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
                self._bar.start()
                self._task = self._bar.add_task(label, total=total)

    def advance(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.advance(self._task)
        elif self._plain and (time.perf_counter() - self._said >= PLAIN_EVERY_S or self.done == self.total):
            self._said = time.perf_counter()
            print(f"{self.label}: {self.done}/{self.total} steps, {self._said - self.t0:.0f} s", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
