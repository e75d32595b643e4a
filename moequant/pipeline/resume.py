"""The quantize pass's work directory: each finished layer's tensors (a work file per rank, or the streamed
export's shards) and report, the progress record a rerun resumes from (the hidden states entering the next
layer, or past the last layer that reads activations, its number alone), and the collection at the end.

A rerun with the same plan, settings and data (`plan_fingerprint`) continues at the next layer; anything else
starts afresh. A layer's progress is written only after its tensors are in place.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import time
from pathlib import Path

from moequant import timing
from moequant.algorithms.registry import ALGORITHMS
from moequant.io.checkpoint import atomic_write_text
from moequant.io.work_files import load_quantized, save_quantized
from moequant.measure.calibrate import CalibrationSettings, load_carried, save_carried
from moequant.pipeline.experts import _merge_chunk_report, _quantize_other
from moequant.plan.model import Plan


def plan_fingerprint(plan: Plan, settings: CalibrationSettings, extra: str) -> str:
    body = json.dumps(
        {
            "tensors": [(t.name, t.layer, t.expert, t.proj, t.format, t.algorithm) for t in plan.tensors],
            "settings": settings.fingerprint_fields(),
            "extra": extra,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(body.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- one layer


def layer_file(work: Path, layer: int, rank: int) -> Path:
    """A layer's quantized tensors in work/; in an expert-parallel run each rank's experts in its own file."""
    return work / (f"layer_{layer:03d}.safetensors" if rank == 0 else f"layer_{layer:03d}.rank{rank}.safetensors")


def _mark_finished(work: Path, fingerprint: str, next_layer: int) -> None:
    """Progress of the part of the pass that needs no activations (after the last GPTQ / AWQ layer)."""
    atomic_write_text(work / "weights_only.json", json.dumps({"fingerprint": fingerprint, "next_layer": next_layer}))


def _finished_layers(work: Path, fingerprint: str) -> int:
    path = work / "weights_only.json"
    if path.exists():
        record = json.loads(path.read_text())
        if record.get("fingerprint") == fingerprint:
            return int(record["next_layer"])
    return 0


def save_layer(run, L: int, quantized: dict, report: dict, routed_tokens, t0: float, hidden) -> None:
    """The layer's quantized tensors (this rank's work/ file), its report (rank 0, every rank's parts
    merged) and the pass's progress: the hidden states the next layer reads, or past the last layer
    that reads activations, just the next layer's number. `t0`: when the layer started (its report's seconds)."""
    world = run.world
    if world is None and run.saver is not None:  # one process: the layer's writes finish beside the next layer
        with timing.stage("pack_write"):
            close = (
                run.export.queue_layer_end(L, quantized, run.rank)
                if run.export is not None
                else functools.partial(save_quantized, quantized, layer_file(run.work, L, run.rank))
            )
        if routed_tokens is not None:
            report["routed_tokens"] = routed_tokens
        report["seconds"] = time.perf_counter() - t0
        run.wait_saved()  # at most one layer's writes in flight; in order, so the resume record stays one
        run.saving = run.saver.submit(_finish_layer_save, run, L, close, report, hidden)
        return
    with timing.stage("pack_write"):
        if run.export is None:
            save_quantized(quantized, layer_file(run.work, L, run.rank))
        else:
            if world is not None and run.adapter.fused_experts:  # one tensor holds every rank's experts: rank 0's
                parts = world.gather_objects(quantized, f"layer {L}'s quantized experts")
                quantized = {k: v for part in parts for k, v in part.items()} if world.rank == 0 else {}
            run.export.end_layer(L, quantized, run.rank)
    if world is not None:  # written by every rank before rank 0 records the layer as finished
        parts = world.gather_objects(report, f"layer {L}'s quantize report")
        if world.rank != 0:
            return
        report = {}
        for part in parts:  # rank order = expert order, as one process's chunks
            _merge_chunk_report(report, part)
    if routed_tokens is not None:
        report["routed_tokens"] = routed_tokens
    report["seconds"] = time.perf_counter() - t0
    with timing.stage("carry_write"):  # the resume record: the layer's report and the hidden states it hands on
        _write_progress(run, L, report, hidden)


def _write_progress(run, L: int, report: dict, hidden) -> None:
    """The layer's report, then the pass's progress: the hidden states entering layer L + 1 (or past the last
    layer that reads activations, just its number). Written after the layer's tensors are in place."""
    atomic_write_text(run.work / f"layer_{L:03d}.json", json.dumps(report, indent=2))
    if L < run.last_data_layer:
        save_carried(run.work, run.fingerprint, L + 1, hidden)
    else:
        _mark_finished(run.work, run.fingerprint, L + 1)


def _finish_layer_save(run, L: int, close, report: dict, hidden) -> None:
    """On the saver thread: the layer's shards (or work file) closed and in place, then its progress, in that
    order (a run stopped meanwhile resumes at a layer whose tensors are all written)."""
    close()
    _write_progress(run, L, report, hidden)


def resume_point(work: Path, fingerprint: str, runner, last_data_layer: int, world):
    """(first layer to quantize, the hidden states entering it) from work/; a fresh start clears work/."""
    if runner is not None:
        start, hidden = load_carried(work, fingerprint, len(runner.batches))
        finished = _finished_layers(work, fingerprint)
        if finished > max(start, last_data_layer):  # past the last layer that reads data
            start, hidden = finished, []
    else:
        start, hidden = _finished_layers(work, fingerprint), []
    if hidden is None:
        hidden = runner.embedded
    if start == 0 and (world is None or world.rank == 0):
        prepared = [n for n, a in ALGORITHMS.items() if a.prepare_layer is not None]  # their diagnostics
        for p in [*work.glob("layer_*"), *(f for n in prepared for f in work.glob(f"{n}_*"))]:
            shutil.rmtree(p) if p.is_dir() else p.unlink()  # directories: a streamed export's layer shards
    if world is not None:  # no rank writes into work/ before rank 0 has cleared it
        world.barrier("the start of the quantize pass")
    return start, hidden


def collect_layer_files(
    ckpt, adapter, work: Path, top_rows: list, world, lazy: bool, work_files: bool = True
) -> tuple[dict, dict]:
    """Every layer's quantized tensors (every rank's work/ file, when the pass wrote `work_files`) and
    reports, plus the tensors outside the decoder layers (lm_head when the plan quantizes it)."""
    q_top, _ = _quantize_other(ckpt, top_rows)
    quantized_all, reports = dict(q_top), {}
    files_per_layer = (world.size if world is not None else 1) if work_files else 0
    for L in range(adapter.num_layers):
        for rank in range(files_per_layer):
            quantized_all.update(load_quantized(layer_file(work, L, rank), lazy=lazy))
        reports[L] = json.loads((work / f"layer_{L:03d}.json").read_text())
    return quantized_all, reports
