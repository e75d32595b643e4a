"""Runs inside the llama.cpp venv (llama-cpp-python + numpy + gguf only; no moequant, no torch).

    python worker.py JOB.json RESULT.json

JOB: {"ops": [...]}, each op one of
  {"op": "tokenize", "model": gguf, "texts": [str]}                  -> {"tokens": [[int]]}
  {"op": "logits", "model": gguf, "tokens": [[int]], "out": npz, "cache": "f32" | "f16" | absent (llama.cpp's F16)}
                                                                     -> {"shapes": [...]} (npz: seq0, seq1, ...)
  {"op": "quantize", "src": gguf, "dst": gguf, "ftype": "Q4_K_M", "imatrix": gguf | null,
   "overrides": {pattern: "Q6_K"}, "token_embedding_type": "BF16" | null, "output_tensor_type": ... | null}
                                                                     -> {"rc": int, "imatrix_entries": int}
  {"op": "types", "model": gguf}                                     -> {"types": {tensor: "Q4_K"}}
  {"op": "dequantize", "type": "q4_k", "in": npy, "out": npy, "n_per_row": int}   (ggml's dequantize_row_*)
  {"op": "quantize_rows", "type": "q4_k", "in": npy, "imatrix": npy | null, "out": npy}  (ggml_quantize_chunk)
"""

from __future__ import annotations

import ctypes
import json
import sys

import numpy as np


def _llama(path: str, n_ctx: int = 512, cache: str | None = None):
    from llama_cpp import Llama

    types = {} if cache is None else {"type_k": _GGML_TYPES[cache], "type_v": _GGML_TYPES[cache]}  # K and V alike
    return Llama(
        model_path=path,
        n_ctx=n_ctx,
        n_batch=n_ctx,
        logits_all=True,
        n_threads=2,
        verbose=False,
        n_gpu_layers=0,
        **types,
    )


_GGML_TYPES = {"f32": 0, "f16": 1}  # ggml_type ids of the KV cache types a logits op may ask for


def tokenize(op):
    llm = _llama(op["model"])
    return {"tokens": [llm.tokenize(t.encode("utf-8"), add_bos=False, special=True) for t in op["texts"]]}


def logits(op):
    n_ctx = max(len(t) for t in op["tokens"]) + 8
    llm = _llama(op["model"], n_ctx=max(64, n_ctx), cache=op.get("cache"))
    arrays = {}
    for i, toks in enumerate(op["tokens"]):
        llm.reset()
        llm.eval(toks)
        arrays[f"seq{i}"] = np.array(llm.scores[: len(toks)], dtype=np.float32)
    np.savez(op["out"], **arrays)
    return {"shapes": [list(a.shape) for a in arrays.values()]}


def load_imatrix(path: str) -> dict:
    """llama.cpp's imatrix GGUF -> {tensor name: float32 values (in_sum2 / count per matrix)}."""
    import gguf

    reader = gguf.GGUFReader(path)
    tensors = {t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors}
    out = {}
    for name, sums in tensors.items():
        if not name.endswith(".in_sum2"):
            continue
        base = name[: -len(".in_sum2")]
        counts = tensors[base + ".counts"].reshape(-1)
        sums = sums.reshape(len(counts), -1)
        vals = np.where(counts[:, None] > 0, sums / np.maximum(counts[:, None], 1), 1.0)
        out[base] = vals.reshape(-1).astype(np.float32)
    return out


def quantize(op):
    import llama_cpp as lc

    params = lc.llama_model_quantize_default_params()
    params.nthread = 2
    params.ftype = getattr(lc, "LLAMA_FTYPE_MOSTLY_" + op["ftype"])
    keep = []  # ctypes buffers must outlive the call
    for field in ("token_embedding_type", "output_tensor_type"):
        if op.get(field):
            setattr(params, field, getattr(lc, "GGML_TYPE_" + op[field]))
    overrides = op.get("overrides") or {}
    if overrides:
        arr = (lc.llama_model_tensor_override * (len(overrides) + 1))()
        for i, (pattern, t) in enumerate(overrides.items()):
            b = pattern.encode()
            keep.append(b)
            arr[i].pattern, arr[i].type = b, getattr(lc, "GGML_TYPE_" + t)
        arr[len(overrides)].pattern = None
        params.tt_overrides = ctypes.cast(arr, ctypes.POINTER(lc.llama_model_tensor_override))
        keep.append(arr)
    n_entries = 0
    if op.get("imatrix"):
        data = load_imatrix(op["imatrix"])
        arr = (lc.llama_model_imatrix_data * (len(data) + 1))()
        for i, (name, vals) in enumerate(data.items()):
            buf = (ctypes.c_float * len(vals))(*vals.tolist())
            b = name.encode()
            keep += [buf, b]
            arr[i].name, arr[i].data, arr[i].size = b, ctypes.cast(buf, ctypes.POINTER(ctypes.c_float)), len(vals)
        arr[len(data)].name = None
        params.imatrix = ctypes.cast(arr, ctypes.POINTER(lc.llama_model_imatrix_data))
        keep.append(arr)
        n_entries = len(data)
    rc = lc.llama_model_quantize(op["src"].encode(), op["dst"].encode(), ctypes.byref(params))
    return {"rc": int(rc), "imatrix_entries": n_entries}


def types(op):
    import gguf

    reader = gguf.GGUFReader(op["model"])
    return {
        "types": {t.name: t.tensor_type.name for t in reader.tensors},
        "bytes": {t.name: int(t.n_bytes) for t in reader.tensors},
    }


def _ggml_base():
    import os

    import llama_cpp

    return ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))


_GGML_IDS = {
    "q4_0": 2,
    "q4_1": 3,
    "q5_0": 6,
    "q5_1": 7,
    "q8_0": 8,
    "q2_k": 10,
    "q3_k": 11,
    "q4_k": 12,
    "q5_k": 13,
    "q6_k": 14,
    "iq2_xxs": 16,
    "iq2_xs": 17,
    "iq3_xxs": 18,
    "iq3_s": 21,
    "iq2_s": 22,
    "iq4_xs": 23,
}


def dequantize(op):
    """ggml's own dequantize_row_<type> on packed blocks (npy uint8 [rows, row bytes]) -> npy float32."""
    blocks = np.ascontiguousarray(np.load(op["in"]), dtype=np.uint8)
    n = int(op["n_per_row"]) * blocks.shape[0]
    out = np.empty(n, dtype=np.float32)
    name = op["type"][:-1] + op["type"][-1].upper() if op["type"].endswith("_k") else op["type"]
    fn = getattr(_ggml_base(), "dequantize_row_" + name)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn(blocks.ctypes.data, out.ctypes.data, n)
    np.save(op["out"], out.reshape(blocks.shape[0], -1))
    return {"n": n}


def quantize_rows(op):
    """ggml_quantize_chunk (llama.cpp's own quantizer, optional imatrix per column) -> npy uint8 blocks."""
    x = np.ascontiguousarray(np.load(op["in"]), dtype=np.float32)
    imat = None if op.get("imatrix") is None else np.ascontiguousarray(np.load(op["imatrix"]), dtype=np.float32)
    lib = _ggml_base()
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    row = lib.ggml_row_size(_GGML_IDS[op["type"]], x.shape[1])
    dst = np.zeros((x.shape[0], row), dtype=np.uint8)
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
    ]
    lib.ggml_quantize_chunk(
        _GGML_IDS[op["type"]],
        x.ctypes.data,
        dst.ctypes.data,
        0,
        x.shape[0],
        x.shape[1],
        None if imat is None else imat.ctypes.data,
    )
    np.save(op["out"], dst)
    return {"row_bytes": int(row)}


OPS = {
    "tokenize": tokenize,
    "logits": logits,
    "quantize": quantize,
    "types": types,
    "dequantize": dequantize,
    "quantize_rows": quantize_rows,
}


def main(job_path: str, result_path: str) -> None:
    job = json.loads(open(job_path).read())
    results = [OPS[op["op"]](op) for op in job["ops"]]
    with open(result_path, "w") as f:
        json.dump({"results": results}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
