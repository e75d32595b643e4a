"""The export written while the quantize pass runs: `moequant apply`'s path for every safetensors layout.

Each chunk of experts is packed in the output's layout as soon as it is quantized — on the GPU when
its codes are there — copied to the host packed (int4: half a byte per weight) and handed to its
layer's shard writer on a writer thread, so the disk write overlaps the next chunk's compute. A
finished layer's shards (work/layer_LLL.shards/, renamed into place once complete, with a
shards.json naming the source tensors they hold) are the pass's resume record. `finish` writes the
tensors outside the decoder layers, links every layer's shards into the checkpoint directory under
their final names and writes the index and config files. No work file of codes, no second read and
no host re-pack: the scratch beyond the output itself is the pass's hidden states.

The bytes are export_checkpoint's own (tests/test_streamed_export.py compares the two tensor by
tensor for every layout). GGUF, one file whose header lists every tensor first, keeps the
work-file path (moequant.io.work_files.save_quantized).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from moequant import timing
from moequant.errors import UserError
from moequant.export.write import (
    check_export_options,
    linear_shape,
    make_writer,
    resolve_keys,
    write_checkpoint_files,
    write_unquantized,
)
from moequant.formats import QuantizedTensor, parse_key
from moequant.io.checkpoint import INDEX_NAME, SINGLE_NAME, atomic_directory
from moequant.io.shards import ShardWriter

WRITE_AHEAD = 64  # packed tensors waiting for the writer thread at most (memory: a few chunks' tensors)
WRITE_THREADS = 4  # threads copying packed tensors to the host and writing them (ShardWriter's `threads`)


def layer_of(name: str, adapter) -> int | None:
    """The decoder layer a tensor belongs to (its shards), as the adapter places it (Kimi-K2.5 names its text
    layers `blocks.N` on disk), or None (embeddings, head, towers, MTP layers)."""
    layer = adapter.classify(name).layer
    return layer if layer is not None and layer < adapter.num_layers else None


def planned_items(plan, ckpt, adapter) -> dict[str, QuantizedTensor]:
    """{on-disk name: QuantizedTensor holding only spec and shape} of every tensor the plan quantizes: what
    the layout's writer checks and describes before any code exists."""
    out = {}
    for t in plan.tensors:
        if not t.quantized:
            continue
        name = adapter.expert_tensor_name(t.layer, t.expert, t.proj) if t.role == "routed_expert" else t.name
        out[name] = QuantizedTensor(parse_key(t.format), linear_shape(adapter, name, ckpt.shape(name)), codes=None)
    return out


def _link(source: Path, destination: Path) -> None:
    """A hard link (the finished layer's shards stay the resume record until the checkpoint is in place),
    a copy where the filesystem has none."""
    try:
        os.link(source, destination)
    except OSError:
        shutil.copyfile(source, destination)


@dataclass
class _OpenLayer:
    """One layer's shards being written: its temporary directory, shard writer, writer thread and queue."""

    tmp: Path
    final: Path
    shards: ShardWriter
    pool: ThreadPoolExecutor
    pending: deque = field(default_factory=deque)
    sources: list = field(default_factory=list)

    def submit(self, fn, *args) -> None:
        while len(self.pending) >= WRITE_AHEAD:
            with timing.stage("write_wait"):  # the pass waits for the disk
                self.pending.popleft().result()
        self.pending.append(self.pool.submit(fn, *args))

    def close(self) -> None:
        """Wait for the layer's writes, close its shards and rename them into place (the layer's resume record).
        Runs on any thread: the next layer may have begun meanwhile."""
        try:
            while self.pending:
                self.pending.popleft().result()
        finally:
            self.pool.shutdown(wait=True)
        files = self.shards.close()
        record = {"files": files, "sources": self.sources, "bytes": self.shards.total_bytes}
        (self.tmp / "shards.json").write_text(json.dumps(record))
        os.rename(self.tmp, self.final)


class StreamedExport:
    """One pass's export: `begin_layer`, `store` per quantized stack of experts, `end_layer`, then `finish`."""

    def __init__(
        self, ckpt, adapter, plan, work, *, layout: str, target: str, int8_activations="none", max_shard_bytes=2**31
    ):
        check_export_options(layout, target, int8_activations)
        if ckpt.config_only:
            raise UserError(f"{ckpt.path} has no safetensors weights to export.")
        self.ckpt, self.adapter, self.work = ckpt, adapter, Path(work)
        self.items = planned_items(plan, ckpt, adapter)
        self.writer = make_writer(ckpt, adapter, self.items, layout, target, int8_activations)  # refuses now
        self.max_shard_bytes = max_shard_bytes
        self.describe = f"{layout} for {target}, int8 activations {int8_activations}, shards {max_shard_bytes}"
        self.layer_names: dict[int | None, list[str]] = {}
        for name in ckpt.keys():
            self.layer_names.setdefault(layer_of(name, adapter), []).append(name)
        self._open: _OpenLayer | None = None

    def layer_dir(self, layer: int, rank: int = 0) -> Path:
        return self.work / (f"layer_{layer:03d}.shards" if rank == 0 else f"layer_{layer:03d}.rank{rank}.shards")

    def _writer(self, directory: Path, names: list[str]) -> ShardWriter:
        """A shard writer whose header room fits `names` (each written as at most four tensors of about its
        name's length): a layer's shards of a small model are not padded with a large model's 2 MiB headers."""
        reserve = 8 * math.ceil((1024 + sum(4 * (len(n) + 128) for n in names)) / 8)
        return ShardWriter(directory, max_shard_bytes=self.max_shard_bytes, reserve=reserve, threads=WRITE_THREADS)

    # ------------------------------------------------------------------------------ one layer

    def begin_layer(self, layer: int, rank: int = 0) -> None:
        final = self.layer_dir(layer, rank)
        tmp = final.with_name(final.name + ".tmp")
        for leftover in (final, tmp):  # a run stopped in this layer, or one that will redo it
            shutil.rmtree(leftover, ignore_errors=True)
        tmp.mkdir(parents=True)
        shards = self._writer(tmp, self.layer_names.get(layer, []))
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moequant-write")
        self._open = _OpenLayer(tmp, final, shards, pool)

    def store(self, layer: int, proj: str, experts: list[int], q: QuantizedTensor) -> dict:
        """A quantized stack of experts ([len(experts), out, in], on the device it was quantized on): packed and
        queued for the layer's shards. Returns what the pass must keep until `end_layer`: nothing, or for
        fused experts (one tensor holds all of a layer's) the codes on the host, keyed (layer, expert, proj)."""
        if self.adapter.fused_experts:
            q = q.to("cpu")
            return {(layer, e, proj): q.expert(i) for i, e in enumerate(experts)}
        for i, e in enumerate(experts):
            self._pack(self.adapter.expert_tensor_name(layer, e, proj), q.expert(i))
        return {}

    def _pack(self, name: str, q: QuantizedTensor) -> None:
        """Packed where the codes are; a GPU tensor goes to the host on a writing thread once `ready` fires."""
        packed = self.writer.pack(name, q)
        ready = None
        if any(v.is_cuda for v in packed.values()):
            # a view would keep its whole stack of experts on the GPU until written: copy out its own bytes
            packed = {k: v.clone() if v._base is not None else v for k, v in packed.items()}
            ready = torch.cuda.Event()
            ready.record()
        self._open.sources.append(name)
        self._open.submit(_add_all, self._open.shards, packed, ready)

    def end_layer(self, layer: int, items: dict, rank: int = 0) -> None:
        """The layer's remaining tensors, then its shards closed and renamed into place (`queue_layer_end`, then
        its closing function at once)."""
        self.queue_layer_end(layer, items, rank)()

    def queue_layer_end(self, layer: int, items: dict, rank: int = 0) -> Callable[[], None]:
        """The layer's remaining tensors queued for its writer; returns the function that waits for its writes
        and renames its shards into place, which may run on another thread while the next layer begins.
        `items`: the pass's tensors not yet stored (non-expert QuantizedTensors by name, fused experts by
        (layer, expert, proj), full-precision replacements as plain tensors by name). Rank 0 also copies the
        layer's other tensors (the routed experts another rank quantized are that rank's)."""
        replacements = {k: v for k, v in items.items() if isinstance(v, torch.Tensor)}
        resolved = resolve_keys(
            {k: v for k, v in items.items() if not isinstance(v, torch.Tensor)}, self.ckpt, self.adapter
        )
        plain = {n: q for n, q in resolved.items() if not q.spec.quantized}
        for name, q in resolved.items():
            if q.spec.quantized:
                self._pack(name, q)
        open_layer = self._open
        if rank == 0:
            packed = set(open_layer.sources)
            for name in self.layer_names.get(layer, []):
                if name not in packed and name not in self.items:
                    open_layer.sources.append(name)
                    open_layer.submit(
                        write_unquantized,
                        open_layer.shards,
                        self.ckpt,
                        self.adapter,
                        self.writer,
                        name,
                        plain,
                        replacements,
                    )
        self._open = None
        return open_layer.close

    # ------------------------------------------------------------------------------ the checkpoint

    def finish(self, out_dir, top: dict, ranks: int = 1) -> Path:
        """OUTPUT/checkpoint: the tensors outside the decoder layers (`top`: the pass's quantized ones, e.g.
        lm_head), every layer's shards under their final names, the index, config and tokenizer files."""
        resolved = resolve_keys(top, self.ckpt, self.adapter)
        out_dir = Path(out_dir)
        with atomic_directory(out_dir) as tmp:
            rest = tmp / ".rest"
            rest.mkdir()
            sources = list(self.layer_names.get(None, []))
            shards = self._writer(rest, sources)
            for name in sources:
                if name in resolved and resolved[name].spec.quantized:
                    _add_all(shards, self.writer.pack(name, resolved[name]))
                else:
                    write_unquantized(shards, self.ckpt, self.adapter, self.writer, name, resolved, {})
            files = [(rest / f, names) for f, names in shards.close()]
            total = shards.total_bytes
            for layer in range(self.adapter.num_layers):
                for rank in range(ranks):
                    d = self.layer_dir(layer, rank)
                    record = json.loads((d / "shards.json").read_text())
                    files += [(d / f, names) for f, names in record["files"]]
                    sources += record["sources"]
                    total += record["bytes"]
            _check_complete(sources, self.ckpt.keys())
            weight_map = {}
            for i, (path, names) in enumerate(files):
                final = SINGLE_NAME if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                _link(path, tmp / final)
                weight_map.update(dict.fromkeys(names, final))
            shutil.rmtree(rest)
            if len(files) > 1:
                index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
                (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
            write_checkpoint_files(tmp, self.ckpt, self.writer)
        return out_dir


def _add_all(shards: ShardWriter, tensors: dict, ready=None) -> None:
    for name, tensor in tensors.items():
        shards.add(name, tensor, ready)


def _check_complete(sources: list[str], names) -> None:
    """Every source tensor written exactly once (a layer shard lost or written twice is a bug, never a
    checkpoint)."""
    seen, names = set(), set(names)
    twice = [n for n in sources if n in seen or seen.add(n)]
    missing = sorted(names - seen)
    if twice or missing or seen - names:
        raise RuntimeError(
            f"the streamed export is inconsistent: written twice {twice[:3]}, missing {missing[:3]}, "
            f"unknown {sorted(seen - names)[:3]}"
        )
