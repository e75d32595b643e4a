"""Checkpoint access: lazy per-tensor reads from sharded safetensors, and atomic sharded writes.

A checkpoint is an HF-style directory: `config.json` plus either `model.safetensors` or
`model.safetensors.index.json` with its shards. Nothing else is ever read as weights: a
directory with only pickle files (`pytorch_model.bin`) is refused, never unpickled.

Headers are parsed here (not only by the safetensors library) so a hostile or truncated file
gives one clear sentence instead of a crash or a huge allocation, and so shapes can be listed
without touching the data.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moequant import timing
from moequant.errors import UserError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
EXPORT_INFO = "moequant_export.json"  # what an export wrote (layout, target, every tensor's format), for moequant.load and reports
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit for the JSON header

DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "F4": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: its shard file, dtype name (safetensors spelling) and shape."""

    shard: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0  # absolute byte offset of the data in the shard file

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the data as stored (F4 holds two elements per byte along the last axis)."""
        if self.dtype == "F4":
            return self.numel // 2
        return self.numel * DTYPE_SIZES[self.dtype]


# Page-locked reads up to this size (an expert's or an attention projection's bytes); a larger tensor (an embedding)
# is read into pageable memory, so the host allocator does not cache a block of its size for the rest of the run.
_PINNED_MAX_BYTES = 256 * 1024 * 1024

TORCH_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Parse and validate a safetensors header without reading tensor data."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise UserError(f"{path} is not a safetensors file: it is shorter than its 8-byte header length.")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > MAX_HEADER_BYTES or header_len + 8 > size:
                raise UserError(
                    f"{path} has a corrupt safetensors header: it claims {header_len} header bytes "
                    f"in a file of {size} bytes."
                )
            header_bytes = f.read(header_len)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}.") from None
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"{path} has a corrupt safetensors header: it is not valid JSON.") from None
    if not isinstance(header, dict):
        raise UserError(f"{path} has a corrupt safetensors header: it is not a JSON object.")
    data_size = size - 8 - header_len
    entries: dict[str, TensorEntry] = {}
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError):
            raise UserError(
                f"{path} has a corrupt safetensors header: tensor {name!r} lacks dtype/shape/offsets."
            ) from None
        # exact JSON types (no int("12") or int(1.5) coercion): what the safetensors library accepts
        if not (isinstance(dtype, str) and _int_list(shape) and _int_list(offsets) and len(offsets) == 2):
            raise UserError(
                f"{path} has a corrupt safetensors header: tensor {name!r} needs a dtype string, "
                "a shape list of integers and two integer data offsets."
            )
        shape = tuple(shape)
        start, end = offsets
        if dtype not in DTYPE_SIZES:
            raise UserError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}.")
        if any(d < 0 for d in shape):
            raise UserError(f"{path}: tensor {name!r} has a negative dimension in {shape}.")
        entry = TensorEntry(path, dtype, shape, 8 + header_len + start)
        if dtype == "F4" and (not shape or shape[-1] % 2):  # two per byte along the last axis
            raise UserError(f"{path}: tensor {name!r} is F4 with shape {list(shape)}; F4 needs an even last dimension.")
        if not (0 <= start <= end <= data_size) or end - start != entry.nbytes:
            raise UserError(
                f"{path}: tensor {name!r} has data offsets {start}..{end} that do not match its "
                f"{dtype} shape {list(shape)} within a data section of {data_size} bytes."
            )
        spans.append((start, end, name))
        entries[name] = entry
    spans.sort()
    for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise UserError(f"{path}: tensors {n0!r} and {n1!r} overlap in the file.")
    # like the safetensors library (what serving engines read with): the tensors tile the data
    # section exactly, with no gap and nothing after the last one
    covered = 0
    for start, end, name in spans:
        if start != covered:
            raise UserError(
                f"{path}: tensor {name!r} starts at data byte {start}, leaving bytes {covered}..{start} "
                "that no tensor covers."
            )
        covered = end
    if covered != data_size:
        raise UserError(f"{path} has {data_size - covered} bytes after its last tensor that no tensor covers.")
    return entries


def _int_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)


def _inside(root: Path, candidate: Path) -> bool:
    try:
        candidate.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def _confined(directory: Path, name: str, what: str) -> Path:
    """`directory / name` if it is a regular file that stays inside `directory` once symlinks are
    followed (a hub cache snapshot may also point into its repository's `blobs/`); else UserError.

    A downloaded checkpoint must not make us read (or copy into the output) files elsewhere on the
    machine, nor block on a FIFO or device node."""
    path = directory / name
    roots = [directory]
    if directory.resolve().parent.name == "snapshots":  # huggingface_hub cache layout
        roots.append(directory.resolve().parent.parent / "blobs")
    if os.path.isabs(name) or not any(_inside(root, path) for root in roots):
        raise UserError(f"{what} {name!r} points outside {directory}; refusing to read it.")
    if path.exists() and not path.is_file():
        raise UserError(f"{what} {name!r} in {directory} is not a regular file.")
    return path


def resolve_model_path(spec: str | os.PathLike) -> Path:
    """A checkpoint directory, a bare config.json, or `zoo:NAME` → a filesystem path."""
    s = str(spec)
    if s.startswith("zoo:"):
        from moequant import zoo

        return Path(zoo.path(s[4:]))
    p = Path(s).expanduser()
    if not p.exists():
        raise UserError(f"model path {s} does not exist (give a checkpoint directory, a config.json, or zoo:NAME).")
    return p


class Checkpoint:
    """Read-only view of one checkpoint; tensors are read one at a time on request.

    The view is the *logical* model: a weight stored quantized (see moequant.io.dequant) is listed
    under its own name with its dense shape and dtype F32, and `get` returns it dequantized to
    float32; its codes and scales are not listed. `stored` holds the tensors as the files hold
    them (what `entries` is for an unquantized checkpoint, and for `open_checkpoint(..., decode=False)`),
    `encodings` the logical weights that are decoded on read.
    """

    def __init__(
        self, path: Path, config: dict, entries: dict[str, TensorEntry], config_only: bool, decode: bool = True
    ):
        from moequant.io import dequant

        self.path = path
        self.config = config
        self.stored = entries
        self.config_only = config_only
        self.decode = decode
        self._handles: dict[Path, object] = {}
        self._last: tuple[str, torch.Tensor] | None = None  # the last decoded tensor, for get_slice
        # before the encodings: reading them reads stored tensors (compressed-tensors' weight_shape), which asks it
        self.slices: dict[str, tuple[str, int, int, int, bool]] = {}  # see present_fused_experts
        self.encodings = dequant.encodings(config, entries, path, self.read_stored) if decode and entries else {}
        self.entries = _logical_entries(entries, self.encodings)

    # An opened checkpoint stands wherever its path is accepted (os.PathLike, str): the stages of one run
    # are handed it, and open_checkpoint returns it as it is instead of reading every header again.
    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def keys(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype(self, name: str) -> str:
        return self._entry(name).dtype

    def _entry(self, name: str) -> TensorEntry:
        if name not in self.entries:
            where = "it has no weights (config only)" if self.config_only else "no shard holds it"
            raise UserError(f"checkpoint {self.path} has no tensor {name!r}: {where}.")
        return self.entries[name]

    def get(self, name: str, device=None) -> torch.Tensor:
        """Read one tensor (a quantized weight: dequantized to float32, from its codes and scales). With
        `device`, the stored bytes are sent there and a quantized weight is decoded there (the host never
        holds its float32 copy)."""
        enc = self.encodings.get(name)
        pinned = device is not None and torch.device(device).type == "cuda"
        if enc is not None:
            from moequant.io.dequant import decode

            return decode(enc, lambda n: self.read_stored(n, pinned), device)
        self._entry(name)
        t = self.read_stored(name, pinned)
        return t if device is None else t.to(device)  # a blocking copy: no reader holds more than this in pinned memory

    def read_stored(self, name: str, pinned: bool = False) -> torch.Tensor:
        """One stored tensor as the file holds it, with a plain positioned read (not mmap), so
        memory holds only what was asked for: reading every layer of a 600 GB checkpoint in turn
        never maps it all. `pinned`: read into page-locked memory (a tensor on its way to a GPU),
        from which the copy is one asynchronous transfer, not a second pass through a staging buffer."""
        with timing.stage("read", sync=False):  # disk -> host (moequant.timing)
            return self._read_stored(name, pinned)

    def _read_stored(self, name: str, pinned: bool = False) -> torch.Tensor:
        if name in self.slices:  # one expert of a fused tensor: only its bytes are read
            fused, expert, start, end, transposed = self.slices[name]
            part = self._handle(self.stored[fused].shard).get_slice(fused)
            return part[expert, :, start:end].t().contiguous() if transposed else part[expert, start:end, :]
        entry = self.stored[name]
        dtype = TORCH_DTYPES.get(entry.dtype)
        if dtype is None:  # exotic dtypes (F4 …): let the safetensors library decode them
            return self._handle(entry.shard).get_tensor(name)
        if not entry.nbytes:
            return torch.empty(entry.shape, dtype=dtype)
        if pinned and entry.nbytes <= _PINNED_MAX_BYTES:
            # torch's caching host allocator keeps the block for the next read of its size once the copy is done
            pinned_bytes = torch.empty(entry.nbytes, dtype=torch.uint8, pin_memory=True)
            buf = pinned_bytes.numpy()
        else:
            pinned_bytes, buf = None, bytearray(entry.nbytes)
        with open(entry.shard, "rb") as f:
            f.seek(entry.offset)
            if f.readinto(buf) != entry.nbytes:
                raise UserError(f"{entry.shard} ends inside tensor {name!r}; the file is truncated.")
        if pinned_bytes is not None:
            return pinned_bytes.view(dtype).reshape(entry.shape)
        return torch.frombuffer(buf, dtype=dtype).reshape(entry.shape)

    def _handle(self, shard: Path):
        handle = self._handles.get(shard)
        if handle is None:
            handle = safe_open(str(shard), framework="pt")
            self._handles[shard] = handle
        return handle

    def get_slice(self, name: str):
        """Indexable view of one tensor (`[expert]` reads only that part of a stored tensor; an
        encoded one is decoded whole once and kept until another is sliced)."""
        if name in self.encodings:
            if self._last is None or self._last[0] != name:
                self._last = (name, self.get(name))
            return self._last[1]
        return self._handle(self._entry(name).shard).get_slice(name)

    def present_fused_experts(self, experts: dict[str, tuple]) -> None:
        """List each expert of experts fused on disk as a tensor of its own, under the name `experts` gives it
        ({name: (fused tensor, expert, first row, end row, the fused tensor's shape in memory)}), in place of the
        fused tensor; `get` reads just that expert's rows. A fused tensor stored with its last two axes swapped
        is read transposed, as transformers reads it (by the stored shape). The rest of moequant then sees one
        tensor per expert, as most families store them and as the export writes them."""
        experts = {n: x for n, x in experts.items() if x[0] in self.stored}  # moequant's exports store them apart
        fused = {f for f, *_ in experts.values()}
        quantized = sorted(fused & set(self.encodings))
        if quantized:
            raise UserError(
                f"{quantized[0]} holds experts fused and quantized; moequant reads fused experts unquantized only."
            )
        slices, entries = {}, {n: e for n, e in self.entries.items() if n not in fused}
        for name, (f, expert, start, end, (E, rows, cols)) in experts.items():
            stored = self.stored[f]
            if tuple(stored.shape) not in ((E, rows, cols), (E, cols, rows)):
                raise UserError(
                    f"tensor {f} in {self.path} has shape {list(stored.shape)}, but config.json implies {[E, rows, cols]}."
                )
            transposed = tuple(stored.shape) != (E, rows, cols)
            slices[name] = (f, expert, start, end, transposed)
            entries[name] = TensorEntry(stored.shard, stored.dtype, (end - start, cols))
        self.entries, self.slices = entries, slices

    def close(self) -> None:
        self._handles.clear()
        self._last = None

    @functools.cached_property
    def adapter(self):
        """The architecture adapter of this checkpoint's config (moequant.arch), built on first use and kept:
        every stage handed this checkpoint asks it here instead of building its own (UserError for an
        unsupported architecture)."""
        from moequant.arch import adapter_for

        return adapter_for(self.config)

    @functools.cached_property
    def tokenizer(self):
        """The checkpoint's tokenizer, loaded on first use and kept (calibration, the quantize pass and the
        evaluation of one run read it here; UserError when the checkpoint has no tokenizer files)."""
        return load_tokenizer(self.directory)

    def kept_itemsize(self, name: str) -> int:
        """Bytes per element of a kept (unquantized) copy of `name` as the export writes it: its stored
        dtype, or the model's dense dtype where the source stores it quantized (layouts._write_shards)."""
        if name in self.encodings:
            return model_dtype(self.config).itemsize
        return DTYPE_SIZES.get(self.dtype(name), 2)

    @property
    def directory(self) -> Path:
        return self.path if self.path.is_dir() else self.path.parent

    @property
    def stored_bytes(self) -> int:
        """Bytes of the tensors as stored (codes and scales of quantized weights)."""
        return sum(e.nbytes for e in self.stored.values())


def _logical_entries(stored: dict[str, TensorEntry], encodings: dict) -> dict[str, TensorEntry]:
    """The stored entries with each encoded weight's parts replaced by one F32 entry of its
    logical shape, listed where its codes are."""
    if not encodings:
        return stored
    first = {next(iter(e.parts.values())): e for e in encodings.values()}
    parts = {p for e in encodings.values() for p in e.parts.values()}
    out: dict[str, TensorEntry] = {}
    for name, entry in stored.items():
        if name in first:
            e = first[name]
            out[e.name] = TensorEntry(entry.shard, "F32", tuple(e.shape), entry.offset)
        elif name not in parts:
            out[name] = entry
    return out


def open_checkpoint(spec: str | os.PathLike, decode: bool = True) -> Checkpoint:
    """Open a checkpoint directory, a bare config.json, or `zoo:NAME`; validate what is there.
    An already opened Checkpoint is returned as it is (one run reads config.json and the headers once),
    or opened again when it was opened with the other `decode`.

    decode=True (the default) presents the logical model, quantized weights dequantized on read
    (see Checkpoint); decode=False lists and reads the stored tensors as they are."""
    if isinstance(spec, Checkpoint) and spec.decode == decode:
        return spec
    path = resolve_model_path(spec)
    if path.is_file():
        if path.suffix != ".json":
            raise UserError(f"{path} is a file but not a config.json; give the checkpoint directory instead.")
        return Checkpoint(path, _read_config(path), {}, config_only=True, decode=decode)
    config_path = path / "config.json"
    if not config_path.exists():
        raise UserError(f"{path} has no config.json; a checkpoint directory needs config.json next to its safetensors.")
    config_path = _confined(path, "config.json", "config file")
    config = _read_config(config_path)
    entries = _read_entries(path)
    ckpt = Checkpoint(path, config, entries, config_only=not entries, decode=decode)
    if decode and any(len(e.shape) == 3 for e in entries.values()):  # experts fused on disk, maybe
        try:
            slices = getattr(ckpt.adapter, "experts_fused_on_disk", None)
        except UserError:  # an architecture moequant does not take: said where the adapter is asked for
            slices = None
        if slices:
            ckpt.present_fused_experts(slices)
    return ckpt


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON (line {e.lineno}: {e.msg}).") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}.") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} must hold a JSON object.")
    from moequant.layouts.compressed_tensors import without_transformers_stop

    return without_transformers_stop(config)


def _read_entries(directory: Path) -> dict[str, TensorEntry]:
    index_path = directory / INDEX_NAME
    single_path = directory / SINGLE_NAME
    if index_path.exists():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            raise UserError(
                f"{index_path} is malformed: it needs a JSON object with a 'weight_map' of tensor → shard."
            ) from None
        shards: dict[str, list[str]] = {}
        for tensor, shard in weight_map.items():
            if not isinstance(shard, str):
                raise UserError(f"{index_path}: tensor {tensor!r} maps to {shard!r}, not a shard file name.")
            shards.setdefault(shard, []).append(tensor)
        entries: dict[str, TensorEntry] = {}
        for shard, tensors in shards.items():
            if os.path.isabs(shard) or not shard.endswith(".safetensors"):
                raise UserError(
                    f"{index_path} names shard {shard!r}, which is not a .safetensors file inside {directory}."
                )
            shard_path = _confined(directory, shard, f"{index_path} shard")
            if not shard_path.exists():
                raise UserError(f"{index_path} names shard {shard}, which is missing from {directory}.")
            header = read_safetensors_header(shard_path)
            for t in tensors:
                if t not in header:
                    raise UserError(f"{index_path} says {t!r} is in {shard}, but that shard does not hold it.")
                entries[t] = header[t]
        return entries
    if single_path.exists():
        return read_safetensors_header(_confined(directory, SINGLE_NAME, "weights file"))
    loose = sorted(directory.glob("*.safetensors"))
    if loose:
        entries = {}
        for shard_path in loose:
            entries.update(read_safetensors_header(_confined(directory, shard_path.name, "weights file")))
        return entries
    pickles = [p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl")]
    if pickles:
        raise UserError(
            f"{directory} holds only pickle weights ({', '.join(sorted(pickles)[:3])}); moequant reads safetensors only, "
            "because loading pickles can run arbitrary code — convert the checkpoint to safetensors first."
        )
    return {}


# ---------------------------------------------------------------------------------------------
# Writing


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike) -> Iterator[Path]:
    """Build a directory in a temporary sibling and rename it into place only on success.

    A crash or Ctrl-C leaves either the previous complete output or nothing at `final`.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))
    os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes 0700; the result must be readable as mkdir would make it
    try:
        yield tmp
        _fsync_dir_tree(tmp)
        if final.exists():
            old = final.parent / f".{final.name}.old-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
    except BaseException as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(error):
            raise UserError(
                f"the disk holding {final.parent} is full (no space left while writing {final.name}); "
                f"{final} was left as it was — free space and run again."
            ) from None
        raise


def _remove_leftovers(final: Path) -> None:
    """Temporary siblings of `final` (`.NAME.tmp-PID-…`, `.NAME.old-PID`) whose process is gone:
    what a killed run leaves (a whole checkpoint's worth of disk). Live runs' are kept."""
    prefix = f".{final.name}."
    for p in final.parent.iterdir():
        kind, _, rest = p.name[len(prefix) :].partition("-") if p.name.startswith(prefix) else ("", "", "")
        pid = rest.split("-")[0]
        if kind in ("tmp", "old") and pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def is_disk_full(error: BaseException) -> bool:
    """ENOSPC / EDQUOT, also when the safetensors library reports it (its error carries only text)."""
    import errno

    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    return type(error).__name__ == "SafetensorError" and ("os error 28" in str(error) or "os error 122" in str(error))


def _fsync_dir_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (os.umask can only set it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write a small text file via a temp file + rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes 0600; give what open() would
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def save_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict | None = None) -> None:
    """safetensors' save_file, with the mode open() would give (safetensors 0.8 creates files 0600)."""
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~current_umask())


def save_atomic(tensors: dict, path: Path, metadata: dict) -> None:
    """`tensors` as one safetensors file, written under a temporary name and renamed: a crash leaves the
    old file or none."""
    tmp = path.with_name(f".{path.name}.tmp")
    save_safetensors({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
    tmp.replace(path)


SAFETENSORS_DTYPES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.float32: "F32",
    torch.int64: "I64",
    torch.uint64: "U64",
    torch.float64: "F64",
}


AUX_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


def copy_aux_files(source: Path, destination: Path) -> None:
    """Copy tokenizer and generation files (never weights, never code) next to written weights."""
    for name in AUX_FILES:
        src = Path(source) / name
        if src.is_file():
            shutil.copyfile(_confined(Path(source), name, "file"), Path(destination) / name)


def load_tokenizer(directory: Path):
    """The tokenizer in `directory` (transformers' AutoTokenizer, no remote code); UserError without one."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)
    except Exception as e:  # no tokenizer files, or unreadable ones
        raise UserError(
            f"cannot load a tokenizer from {directory} ({type(e).__name__}); the checkpoint needs tokenizer files."
        ) from None


def model_dtype(config: dict) -> torch.dtype:
    """The model's dense dtype from config.json (`dtype` / `torch_dtype`), bfloat16 when unsaid."""
    name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16").replace("torch.", "")
    return {"float16": torch.float16, "float32": torch.float32}.get(name, torch.bfloat16)
