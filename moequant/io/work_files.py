"""The quantize pass's work files: one safetensors file of a layer's QuantizedTensors (codes, scales, zeros,
global scale, with a JSON index), written by `save_quantized` and read back by `load_quantized`, at once or
lazily (StoredQuantizedTensor) while the export streams a model's codes tensor by tensor.

Integer codes of at most 4 bits travel two to a byte (`"nibbles": true`): half the scratch. A plain tensor
value (a full-precision replacement, e.g. an AWQ-folded norm) is stored as it is.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file

from moequant import formats
from moequant.io.checkpoint import save_atomic


def _key_text(key) -> str:
    return f"expert:{key[0]}:{key[1]}:{key[2]}" if isinstance(key, tuple) else f"tensor:{key}"


def _key_from_text(text: str):
    kind, rest = text.split(":", 1)
    if kind == "expert":
        layer, expert, proj = rest.split(":")
        return (int(layer), int(expert), proj)
    return rest


def _nibbles(q) -> bool:
    """Integer codes of at most 4 bits travel through the work file two to a byte (half the scratch)."""
    return q.spec.is_int and q.spec.bits <= 4 and q.codes.dtype == torch.int8 and q.shape[-1] % 2 == 0


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    u = (codes & 0xF).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    pairs = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).to(torch.int16)
    return ((pairs ^ 8) - 8).to(torch.int8)  # 4-bit two's complement; 3- and 2-bit codes lie inside it


def save_quantized(items: dict, path: Path) -> None:
    """QuantizedTensors → one safetensors file (codes / scales / zeros / global scale + JSON index;
    integer codes of <= 4 bits packed two to a byte, `"nibbles": true`).

    A plain tensor value (a full-precision replacement, e.g. an AWQ-folded norm) is stored as is."""
    tensors, index = {}, {}
    for i, (key, q) in enumerate(items.items()):
        if isinstance(q, torch.Tensor):
            tensors[f"{i}.tensor"] = q.contiguous().clone()
            index[str(i)] = {"key": _key_text(key), "plain": True}
            continue
        entry = {"key": _key_text(key), "spec": q.spec.key, "shape": list(q.shape), "parts": []}
        if _nibbles(q):
            entry["nibbles"] = True
        for part in ("codes", "scales", "zeros", "global_scale"):
            t = getattr(q, part)
            if t is not None:
                t = _pack_nibbles(t) if part == "codes" and entry.get("nibbles") else t.contiguous().clone()
                tensors[f"{i}.{part}"] = t
                entry["parts"].append(part)
        index[str(i)] = entry
    save_atomic(tensors, path, {"index": json.dumps(index)})


class StoredQuantizedTensor(formats.QuantizedTensor):
    """A QuantizedTensor whose codes and scales stay in its layer's work file until read: the export
    streams a model's codes tensor by tensor instead of holding them all (host RAM would grow with the model)."""

    def __init__(self, spec, shape, path: Path, prefix: str, parts: tuple[str, ...], nibbles: bool = False):
        for name, value in (
            ("spec", spec),
            ("shape", shape),
            ("_path", path),
            ("_prefix", prefix),
            ("_parts", parts),
            ("_nibbles", nibbles),
        ):
            object.__setattr__(self, name, value)

    def _part(self, part: str):
        if part not in self._parts:
            return None
        st = os.stat(self._path)  # a rerun replaces the file: a handle is kept per file version
        handle, lock = _open_work_file(self._path, st.st_ino, st.st_mtime_ns)
        with lock:  # the export's packing threads share the file's handle
            t = handle.get_tensor(f"{self._prefix}.{part}")
        return _unpack_nibbles(t) if part == "codes" and self._nibbles else t

    codes = property(lambda self: self._part("codes"))
    scales = property(lambda self: self._part("scales"))
    zeros = property(lambda self: self._part("zeros"))
    global_scale = property(lambda self: self._part("global_scale"))


@functools.lru_cache(maxsize=4)
def _open_work_file(path: Path, inode: int, mtime_ns: int):
    """(a safetensors handle, its lock) of one work file, opened once for all its tensors (parsing a layer's
    header for each of its ~1,500 parts cost a third of the export); the export reads layer by layer,
    so a few handles suffice."""
    from safetensors import safe_open

    return safe_open(str(path), "pt"), threading.Lock()


def load_quantized(path: Path, lazy: bool = False) -> dict:
    """A layer's work file → {key: QuantizedTensor} (plain tensors as they are); `lazy`: codes and scales
    are read from the file when used (StoredQuantizedTensor), so the file must outlive them."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        index = json.loads(f.metadata()["index"])
        plain = {i: f.get_tensor(f"{i}.tensor") for i, entry in index.items() if entry.get("plain")}
    tensors = {} if lazy else load_file(str(path))
    out = {}
    for i, entry in index.items():
        key = _key_from_text(entry["key"])
        if entry.get("plain"):
            out[key] = plain[i]
        elif lazy:
            out[key] = StoredQuantizedTensor(
                formats.parse_key(entry["spec"]),
                tuple(entry["shape"]),
                Path(path),
                i,
                tuple(entry["parts"]),
                bool(entry.get("nibbles")),
            )
        else:
            parts = {p: tensors[f"{i}.{p}"] for p in entry["parts"]}
            if entry.get("nibbles"):
                parts["codes"] = _unpack_nibbles(parts["codes"])
            out[key] = formats.QuantizedTensor(
                spec=formats.parse_key(entry["spec"]), shape=tuple(entry["shape"]), **parts
            )
    return out
