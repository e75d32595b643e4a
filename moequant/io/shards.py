"""Sharded safetensors writing: `ShardWriter` puts tensors into size-limited shards as they come, memory at a
few tensors, never a shard; with `threads`, the bytes of several tensors are copied (from the GPU, when they are
there) and written at once, while the shards' layout stays the order the tensors were added in."""

from __future__ import annotations

import concurrent.futures
import json
import os
import struct
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from moequant.io.checkpoint import INDEX_NAME, SAFETENSORS_DTYPES, SINGLE_NAME, current_umask

IN_FLIGHT_BYTES = 2**28  # bytes handed to the writing threads and not yet written, at most (a few dozen experts)


def header_reserve(max_shard_bytes: int) -> int:
    """Room for a shard's JSON header: 1/1024 of the shard (2 MiB of a 2 GiB shard, ~14,000 entries), at
    least 64 KiB; a shard closes early when its entries fill it."""
    return max(64 * 1024, max_shard_bytes // 1024 // 8 * 8)


class ShardWriter:
    """Write tensors into size-limited safetensors shards plus an index, inside an (already temporary)
    directory, each tensor's bytes written to disk as it is added: memory stays at a few tensors, never a shard.

    A shard is opened with `header_reserve` bytes of room for its JSON header; the header is written there
    when the shard closes, padded with spaces (the safetensors format allows trailing whitespace, and
    safetensors' own writer pads the same way), so no tensor is held back until its shard is complete.

    Every tensor's place (shard and offset) is decided by `add`, in the order of the calls, so the files are
    the same whatever `threads` is. With `threads` > 0 the bytes are written by that many threads at their
    offsets (a GPU tensor copied to the host there, after `ready`, the event its producer recorded), and a full
    shard is closed (header, fsync) on another thread: one thread copying and writing was the streamed
    export's limit on a GPU. Without, `add` writes on the calling thread.
    """

    def __init__(
        self,
        directory: Path,
        max_shard_bytes: int = 2 * 1024**3,
        metadata: dict | None = None,
        reserve: int | None = None,
        threads: int = 0,
    ):
        self.directory = Path(directory)
        self.max_shard_bytes = max_shard_bytes
        self.metadata = {"format": "pt", **(metadata or {})}
        # `reserve`: the header room, when the caller knows its tensors (too little only closes shards early)
        self.reserve = min(reserve, header_reserve(max_shard_bytes)) if reserve else header_reserve(max_shard_bytes)
        self._fd: int | None = None
        self._header: dict = {}
        self._header_bytes = 0
        self._offset = 0
        self._shards: list[tuple[str, list[str]]] = []
        self._total_bytes = 0
        self._seen: set[str] = set()
        self._pool = ThreadPoolExecutor(threads, "moequant-shard-write") if threads else None
        self._closer = ThreadPoolExecutor(1, "moequant-shard-close") if threads else None
        self._shard_writes: list = []  # the open shard's writes in flight
        self._in_flight: deque = deque()  # (future, bytes) of every write in flight
        self._in_flight_bytes = 0
        self._closing: list = []  # shards being closed on `_closer`

    def add(self, name: str, tensor: torch.Tensor, ready=None) -> None:
        if name in self._seen:
            raise ValueError(f"tensor {name} written twice")
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name} has dtype {tensor.dtype}, which safetensors cannot store")
        self._seen.add(name)
        size = tensor.numel() * tensor.element_size()
        entry = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [self._offset, self._offset + size],
        }
        entry_bytes = len(json.dumps({name: entry})) + 1
        if self._header and (
            self._offset + size > self.max_shard_bytes or self._header_bytes + entry_bytes > self.reserve
        ):
            self._close_shard()
            entry["data_offsets"] = [0, size]
            entry_bytes = len(json.dumps({name: entry})) + 1
        if self._fd is None:
            self._open_shard()
        position = 8 + self.reserve + self._offset
        if self._pool is None:
            _write_at(self._fd, position, tensor, ready)
        else:
            job = self._pool.submit(_write_at, self._fd, position, tensor, ready)
            self._shard_writes.append(job)
            self._in_flight.append((job, size))
            self._in_flight_bytes += size
            while self._in_flight_bytes > IN_FLIGHT_BYTES:
                done, n = self._in_flight.popleft()
                done.result()
                self._in_flight_bytes -= n
        self._header[name] = entry
        self._header_bytes += entry_bytes
        self._offset += size
        self._total_bytes += size

    def _open_shard(self) -> None:
        path = self.directory / f"shard-{len(self._shards):05d}.safetensors.part"
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        self._header, self._offset = {}, 0
        self._header_bytes = len(json.dumps({"__metadata__": self.metadata}))

    def _close_shard(self) -> None:
        if self._fd is None:
            return
        header = json.dumps({"__metadata__": self.metadata, **self._header}, separators=(",", ":")).encode()
        if len(header) > self.reserve:  # cannot happen: add() closes a shard before its header overflows
            raise AssertionError(f"safetensors header of {len(header)} bytes exceeds its reserved room")
        name = f"shard-{len(self._shards):05d}.safetensors.part"
        head = struct.pack("<Q", self.reserve) + header + b" " * (self.reserve - len(header))
        close = (self._fd, head, self.directory / name, self._shard_writes)
        if self._closer is None:
            _finish_shard(*close)
        else:
            self._closing.append(self._closer.submit(_finish_shard, *close))
        self._shards.append((name, list(self._header)))
        self._fd, self._shard_writes = None, []

    def _wait(self) -> None:
        """Every shard closed and written (a writing thread's error is raised here), the threads ended."""
        try:
            for job in self._closing:
                job.result()
            for job, _ in self._in_flight:
                job.result()
        finally:
            self._closing, self._in_flight, self._in_flight_bytes = [], deque(), 0
            for pool in (self._pool, self._closer):
                if pool is not None:
                    pool.shutdown(wait=True)

    @property
    def total_bytes(self) -> int:
        """Tensor bytes added so far (the index's `total_size`)."""
        return self._total_bytes

    def close(self) -> list[tuple[str, list[str]]]:
        """Close the last shard and leave every shard under its working name: [(file name, its tensors)]
        (the streamed export names a layer's shards only once every layer is written)."""
        self._close_shard()
        self._wait()
        return list(self._shards)

    def finish(self) -> list[str]:
        """Close the last shard, give shards their final names, write the index when there is more than one."""
        self._close_shard()
        self._wait()
        n = len(self._shards)
        names = []
        if n == 1:
            os.rename(self.directory / self._shards[0][0], self.directory / SINGLE_NAME)
            names.append(SINGLE_NAME)
            return names
        weight_map = {}
        for i, (tmp_name, tensors) in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(self.directory / tmp_name, self.directory / final)
            names.append(final)
            for t in tensors:
                weight_map[t] = final
        index = {"metadata": {"total_size": self._total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return names


_side = threading.local()  # each writing thread's own CUDA stream: its copies wait for no one else's kernels


def _write_at(fd: int, position: int, tensor: torch.Tensor, ready=None) -> None:
    """`tensor`'s bytes at `position` of the file (a GPU tensor copied to the host first, once `ready` has
    fired on the stream that made it)."""
    if tensor.is_cuda and ready is not None:  # else copied on the default stream, in the order of its kernels
        stream = getattr(_side, "stream", None)
        if stream is None or stream.device != tensor.device:
            stream = _side.stream = torch.cuda.Stream(tensor.device)
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            tensor = tensor.to("cpu")  # returns once copied: the GPU memory may then be reused
    data = memoryview(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
    while data:
        written = os.pwrite(fd, data, position)  # one call writes at most ~2 GiB
        data, position = data[written:], position + written


def _finish_shard(fd: int, head: bytes, path: Path, writes: list) -> None:
    """A shard's header written once its tensors are, then flushed to the disk and given the file mode
    open() would give."""
    try:
        concurrent.futures.wait(writes)  # all of them, failed or not, before the descriptor is closed
        for job in writes:
            job.result()
        os.pwrite(fd, head, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(path, 0o666 & ~current_umask())
