"""llama.cpp (llama-cpp-python) as an independent reader of our GGUF exports.

    python -m moequant.export.verify_llamacpp --install-only     # build / install once (CI does it ahead)

PyPI has only llama-cpp-python's source: `ensure_llama_cpp()` builds its wheel once into
~/.cache/moequant/wheels (about 16 minutes on 2 cores; CMAKE_ARGS as below), then installs it
with numpy and gguf into its own venv ~/.cache/moequant/llama-cpp ($MOEQUANT_LLAMA_VENV).
llama.cpp runs in a worker process (moequant/export/llamacpp_worker.py) that gets token ids and paths
and writes logits / results to files: a ggml abort on a bad file fails the call, not pytest.
A failed build or install raises: tests that need llama.cpp fail loudly, they never skip.
"""

from __future__ import annotations

import argparse
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
CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF "
              "-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF")
WORKER = Path(__file__).with_name("llamacpp_worker.py")


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
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", f"llama-cpp-python=={VERSION}", "-w", tmp],
                       check=True, env=env)
        for w in Path(tmp).glob("*.whl"):
            os.replace(w, WHEEL_DIR / w.name)
    log(f"built in {time.time() - started:.0f} s")
    wheel = _wheel()
    if wheel is None:
        raise RuntimeError("pip wheel finished but left no llama_cpp_python wheel")
    return wheel


def venv_path() -> Path:
    return Path(os.environ.get("MOEQUANT_LLAMA_VENV", DEFAULT_VENV)).expanduser()


def ensure_llama_cpp(log=print) -> Path:
    """The python of a venv with llama_cpp (built if missing); the marker is written last."""
    venv = venv_path()
    python = venv / "bin" / "python"
    marker = venv / READY_MARKER
    want = {"version": VERSION, "packages": list(PACKAGES)}
    try:
        if json.loads(marker.read_text()) == want and subprocess.run(
                [str(python), "-c", "import llama_cpp, gguf"], capture_output=True).returncode == 0:
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
    """Run worker ops (see llamacpp_worker.py) in the llama.cpp venv; raises with its log on failure."""
    python = ensure_llama_cpp()
    with tempfile.TemporaryDirectory() as tmp:
        job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(json.dumps({"ops": ops}))
        proc = subprocess.run([str(python), "-P", str(WORKER), str(job), str(result)], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "PYTHONPATH": ""})  # -P: not moequant/ first on sys.path (inspect.py)
        if proc.returncode != 0 or not result.exists():
            raise RuntimeError(f"llama.cpp worker failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(result.read_text())["results"]


def tokenize(model: str | os.PathLike, texts: list[str]) -> list[list[int]]:
    return run_ops([{"op": "tokenize", "model": str(model), "texts": texts}])[0]["tokens"]


def logits(models: list, tokens: list[list[int]]) -> list[list[np.ndarray]]:
    """llama.cpp's logits [len, vocab] of each token sequence, for each GGUF in `models` (one process)."""
    with tempfile.TemporaryDirectory() as tmp:
        ops = [{"op": "logits", "model": str(m), "tokens": tokens, "out": f"{tmp}/l{i}.npz"} for i, m in enumerate(models)]
        run_ops(ops)
        out = []
        for i in range(len(models)):
            with np.load(f"{tmp}/l{i}.npz") as z:
                out.append([z[f"seq{j}"] for j in range(len(tokens))])
        return out


def quantize(src, dst, ftype: str = "Q4_K_M", imatrix=None, overrides=None, token_embedding_type=None,
             output_tensor_type=None) -> dict:
    return run_ops([{"op": "quantize", "src": str(src), "dst": str(dst), "ftype": ftype,
                     "imatrix": None if imatrix is None else str(imatrix), "overrides": overrides or {},
                     "token_embedding_type": token_embedding_type, "output_tensor_type": output_tensor_type}])[0]


def tensor_types(model) -> dict:
    return run_ops([{"op": "types", "model": str(model)}])[0]


def ggml_dequantize(items: list[tuple[str, np.ndarray, int]]) -> list[np.ndarray]:
    """llama.cpp's (ggml's) own dequantization of packed blocks: [(type, uint8 [rows, row bytes], n_per_row)]."""
    with tempfile.TemporaryDirectory() as tmp:
        ops = []
        for i, (name, blocks, n) in enumerate(items):
            np.save(f"{tmp}/in{i}.npy", blocks)
            ops.append({"op": "dequantize", "type": name, "in": f"{tmp}/in{i}.npy", "out": f"{tmp}/out{i}.npy",
                        "n_per_row": n})
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
            ops.append({"op": "quantize_rows", "type": name, "in": f"{tmp}/x{i}.npy",
                        "imatrix": None if imat is None else f"{tmp}/m{i}.npy", "out": f"{tmp}/q{i}.npy"})
        run_ops(ops)
        return [np.load(f"{tmp}/q{i}.npy") for i in range(len(items))]


def evaluate_gguf(gguf_path, reference, dataset: str = "builtin:mix", samples: int = 32, seq_len: int = 256,
                  seed: int = 0, progress: bool = False) -> dict:
    """KL / top-1 / perplexity of llama.cpp running `gguf_path` against transformers running the
    reference (float32), on the evaluation split of `dataset` (evaluate()'s keys, engine llama.cpp).
    progress: a bar with the time left over the reference's windows, then a line for llama.cpp's run."""
    import torch

    from moequant.calib.calibrate import load_tokenizer
    from moequant.calib.data import load_samples
    from moequant.io.checkpoint import open_checkpoint
    from moequant.io.loader import from_pretrained_complete
    from moequant.progress import StepProgress

    ref_dir = open_checkpoint(reference).directory
    windows = load_samples(dataset, load_tokenizer(ref_dir), samples, seq_len, split="evaluation", seed=seed)
    ids = [w.input_ids.tolist() for w in windows]
    model = from_pretrained_complete(ref_dir, torch.float32).eval()
    bar = StepProgress("evaluating: the original (transformers)", len(ids), progress)
    ref = []
    with torch.no_grad():
        for s in ids:
            ref.append(model(torch.tensor([s])).logits[0].numpy())
            bar.advance()
    bar.close()
    if progress:
        print(f"evaluating: the GGUF in llama.cpp ({len(ids)} windows, in a worker process)")
    got = logits([gguf_path], ids)[0]
    kl = np.concatenate([kl_per_token(r, g) for r, g in zip(ref, got)])

    def nll(all_logits):
        total = 0.0
        for lg, s in zip(all_logits, ids):
            x = lg[:-1].astype(np.float64)
            x = x - x.max(-1, keepdims=True)
            lp = x - np.log(np.exp(x).sum(-1, keepdims=True))
            total -= lp[np.arange(len(s) - 1), s[1:]].sum()
        return total / sum(len(s) - 1 for s in ids)

    top1 = np.concatenate([r.argmax(-1) == g.argmax(-1) for r, g in zip(ref, got)])
    n_ref, n_q = nll(ref), nll(got)
    return {"engine": "llama.cpp", "samples": len(ids), "tokens": int(kl.size),
            "ppl_original": float(np.exp(n_ref)), "ppl_quantized": float(np.exp(n_q)),
            "nll_original": float(n_ref), "nll_quantized": float(n_q), "kl_mean": float(kl.mean()),
            "kl_p90": float(np.quantile(kl, 0.9)), "kl_p99": float(np.quantile(kl, 0.99)), "kl_max": float(kl.max()),
            "top1_agreement": float(top1.mean()), "checkpoint": str(gguf_path), "reference": str(reference),
            "dataset": dataset, "seq_len": seq_len, "seed": seed}


def kl_per_token(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(ref || other) per position, log-softmax in float64."""
    def logsm(x):
        x = x.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    lp, lq = logsm(ref_logits), logsm(logits)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moequant.export.verify_llamacpp")
    parser.add_argument("--install-only", action="store_true", help="build / install llama-cpp-python and exit")
    parser.parse_args(argv)
    print(ensure_llama_cpp())  # the venv's python; building it is all this command does
    return 0


if __name__ == "__main__":
    sys.exit(main())
