"""One run of the pipeline, opened once and handed through the stages.

`apply` opens a Run: the recipe's source checkpoint (config.json and every safetensors header read once;
its architecture adapter and its tokenizer built once and kept on the Checkpoint), the device and the
output directory.
It checks the recipe against it, takes the directory's lock (`hold_lock`) and hands the Run to
calibration, the plan, the quantize pass and export, the evaluation and the report; the exported
checkpoint is opened once, after the export, as `Run.output` for the evaluation and the report.
`pareto` hands each of its points the same Run with the point's recipe and directory
(`dataclasses.replace`): the same source, adapter and stage functions as apply.

Stages that are also library functions (calibrate, quantize_model, evaluate_checkpoints, build_report)
keep taking a path or an open Checkpoint: `open_checkpoint` returns an open one as it is.

The memory budget is moequant.memory_budget's caps, set for the process (--max-gpu-memory / --max-host-memory)
before the run opens; every chunk of the run's work asks it for the run's device.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from moequant import parallel
from moequant.io.checkpoint import Checkpoint, open_checkpoint
from moequant.io.run_lock import output_lock

if TYPE_CHECKING:
    from moequant.arch import Adapter
    from moequant.plan.model import Plan
    from moequant.plan.policy import PlanShapes
    from moequant.plan.recipe import Recipe


@dataclass
class Run:
    """What every stage of one run reads instead of reopening it."""

    recipe: Recipe
    source: Checkpoint  # the recipe's model, opened once
    directory: Path  # OUTPUT: stats/, plan.json, checkpoint/, the report
    device: str = "cpu"
    progress: bool = True
    log: Callable[..., None] = print
    output: Checkpoint | Path | None = None  # OUTPUT/checkpoint once exported, opened once (GGUF: its directory)
    overwrite: bool = False  # statistics of other settings in OUTPUT/stats may be replaced (--overwrite)
    plan: Plan | None = None  # the precheck's plan when the recipe reads no statistics (the plan stage's, then)
    plan_shapes: PlanShapes | None = None  # else the shape part of the plan the precheck checked (policy.plan_shapes)

    @property
    def adapter(self) -> Adapter:
        return self.source.adapter


def open_run(recipe: Recipe, device: str = "cpu", progress: bool = True, log=print) -> Run:
    """The run of a recipe: its model opened (a bad or unreadable checkpoint is refused before anything is
    written) and its adapter built (an unsupported architecture is the first thing said)."""
    source = open_checkpoint(recipe.model)
    source.adapter  # noqa: B018  (builds it now, so that an unsupported architecture is refused here)
    return Run(recipe, source, Path(recipe.output), device, progress, log)


@contextlib.contextmanager
def hold_lock(run: Run, command: str) -> Iterator[Run]:
    """The run with its directory's lock held for the `with` block (moequant.io.run_lock), taken before
    anything is written there; in an expert-parallel run rank 0 takes it for every rank."""
    with contextlib.ExitStack() as held:
        parallel.shared(lambda: held.enter_context(output_lock(run.directory, command)), "the run directory's lock")
        yield run
