"""llama.cpp (llama-cpp-python) built once and run in its own venv: the reference implementation of the
ggml block types, whose own quantizer moequant uses for the i-quants (formats/ggml_iq.py), whose
dequantizer checks ours, and which runs a GGUF export for its evaluation (moequant.llamacpp.evaluate).

PyPI has only llama-cpp-python's source: `ensure_llama_cpp()` builds its wheel once into
~/.cache/moequant/wheels (about 16 minutes on 2 cores; CMAKE_ARGS as below), then installs it
with numpy and gguf into its own venv ~/.cache/moequant/llama-cpp ($MOEQUANT_LLAMA_VENV).
llama.cpp runs in a worker process (worker.py beside this file) that gets paths and writes
results to files: a ggml abort fails the call, not the caller. A failed build or install raises.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

VERSION = "0.3.36"
CACHE = Path("~/.cache/moequant").expanduser()
WHEEL_DIR = CACHE / "wheels"
DEFAULT_VENV = CACHE / "llama-cpp"
READY_MARKER = ".moequant-llamacpp-ready"
PACKAGES = ("numpy", "gguf==0.19.0")
# portable CPU build, library only (no server / examples / tests / curl)
CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF "
    "-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF"
)
WORKER = Path(__file__).resolve().with_name("worker.py")  # a file it runs, not an import


def _wheel() -> Path | None:
    found = sorted(WHEEL_DIR.glob(f"llama_cpp_python-{VERSION}-*.whl"))
    return found[-1] if found else None


def build_wheel(log=print) -> Path:
    wheel = _wheel()
    if wheel is not None:
        return wheel
    WHEEL_DIR.mkdir(parents=True, exist_ok=True)
    log(f"building llama-cpp-python {VERSION} from source into {WHEEL_DIR} (~16 min on 2 cores, once)")
    started = time.time()
    env = {**os.environ, "CMAKE_ARGS": CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
    with tempfile.TemporaryDirectory(dir=WHEEL_DIR) as tmp:  # a half-built wheel never lands in WHEEL_DIR
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", f"llama-cpp-python=={VERSION}", "-w", tmp],
            check=True,
            env=env,
        )
        for w in Path(tmp).glob("*.whl"):
            os.replace(w, WHEEL_DIR / w.name)
    log(f"built in {time.time() - started:.0f} s")
    wheel = _wheel()
    if wheel is None:
        raise RuntimeError("pip wheel finished but left no llama_cpp_python wheel")
    return wheel


def venv_path() -> Path:
    return Path(os.environ.get("MOEQUANT_LLAMA_VENV", DEFAULT_VENV)).expanduser()


_CHECKED: set[Path] = set()  # venvs whose import check passed in this process (calibration calls often)


def ensure_llama_cpp(log=print) -> Path:
    """The python of a venv with llama_cpp (built if missing); the marker is written last."""
    venv = venv_path()
    python = venv / "bin" / "python"
    marker = venv / READY_MARKER
    want = {"version": VERSION, "packages": list(PACKAGES)}
    if venv in _CHECKED and marker.exists():
        return python
    try:
        if (
            json.loads(marker.read_text()) == want
            and subprocess.run([str(python), "-c", "import llama_cpp, gguf"], capture_output=True).returncode == 0
        ):
            _CHECKED.add(venv)
            return python
    except (OSError, ValueError):
        pass
    wheel = build_wheel(log)
    if venv.exists():
        shutil.rmtree(venv)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", str(wheel), *PACKAGES], check=True)
    subprocess.run([str(python), "-c", "import llama_cpp, gguf"], check=True)
    marker.write_text(json.dumps(want))
    return python


def run_ops(ops: list[dict], timeout: int = 1800) -> list:
    """Run worker ops (see worker.py) in the llama.cpp venv; raises with its log on failure."""
    python = ensure_llama_cpp()
    with tempfile.TemporaryDirectory() as tmp:
        job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(json.dumps({"ops": ops}))
        proc = subprocess.run(
            [str(python), "-P", str(WORKER), str(job), str(result)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PYTHONPATH": ""},
        )  # -P: not the worker's own folder first on sys.path
        if proc.returncode != 0 or not result.exists():
            raise RuntimeError(f"llama.cpp worker failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(result.read_text())["results"]


def ggml_dequantize(items: list[tuple[str, np.ndarray, int]]) -> list[np.ndarray]:
    """llama.cpp's (ggml's) own dequantization of packed blocks: [(type, uint8 [rows, row bytes], n_per_row)]."""
    with tempfile.TemporaryDirectory() as tmp:
        ops = []
        for i, (name, blocks, n) in enumerate(items):
            np.save(f"{tmp}/in{i}.npy", blocks)
            ops.append(
                {"op": "dequantize", "type": name, "in": f"{tmp}/in{i}.npy", "out": f"{tmp}/out{i}.npy", "n_per_row": n}
            )
        run_ops(ops)
        return [np.load(f"{tmp}/out{i}.npy") for i in range(len(items))]


def ggml_quantize(items: list[tuple[str, np.ndarray, np.ndarray | None]]) -> list[np.ndarray]:
    """llama.cpp's own quantizer (ggml_quantize_chunk) of float32 rows, with an optional imatrix per column."""
    with tempfile.TemporaryDirectory() as tmp:
        ops = []
        for i, (name, x, imat) in enumerate(items):
            np.save(f"{tmp}/x{i}.npy", x.astype(np.float32))
            if imat is not None:
                np.save(f"{tmp}/m{i}.npy", imat.astype(np.float32))
            ops.append(
                {
                    "op": "quantize_rows",
                    "type": name,
                    "in": f"{tmp}/x{i}.npy",
                    "imatrix": None if imat is None else f"{tmp}/m{i}.npy",
                    "out": f"{tmp}/q{i}.npy",
                }
            )
        run_ops(ops)
        return [np.load(f"{tmp}/q{i}.npy") for i in range(len(items))]


def logits(models: list, tokens: list[list[int]], cache: str | None = None) -> list[list[np.ndarray]]:
    """llama.cpp's logits [len, vocab] of each token sequence, for each GGUF in `models` (one process); `cache`: the
    KV cache's type ("f32", "f16"; default llama.cpp's own, F16)."""
    with tempfile.TemporaryDirectory() as tmp:
        ops = [
            {"op": "logits", "model": str(m), "tokens": tokens, "out": f"{tmp}/l{i}.npz", "cache": cache}
            for i, m in enumerate(models)
        ]
        run_ops(ops)
        out = []
        for i in range(len(models)):
            with np.load(f"{tmp}/l{i}.npz") as z:
                out.append([z[f"seq{j}"] for j in range(len(tokens))])
        return out
