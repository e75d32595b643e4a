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
import os
import sys
import tempfile

import numpy as np

from moequant.formats.llamacpp import (  # noqa: F401  (the runner lives with the formats that use ggml's quantizer)
    CACHE,
    CMAKE_ARGS,
    DEFAULT_VENV,
    PACKAGES,
    READY_MARKER,
    VERSION,
    WHEEL_DIR,
    WORKER,
    build_wheel,
    ensure_llama_cpp,
    ggml_dequantize,
    ggml_quantize,
    run_ops,
    venv_path,
)


def tokenize(model: str | os.PathLike, texts: list[str]) -> list[list[int]]:
    return run_ops([{"op": "tokenize", "model": str(model), "texts": texts}])[0]["tokens"]


def logits(models: list, tokens: list[list[int]]) -> list[list[np.ndarray]]:
    """llama.cpp's logits [len, vocab] of each token sequence, for each GGUF in `models` (one process)."""
    with tempfile.TemporaryDirectory() as tmp:
        ops = [
            {"op": "logits", "model": str(m), "tokens": tokens, "out": f"{tmp}/l{i}.npz"} for i, m in enumerate(models)
        ]
        run_ops(ops)
        out = []
        for i in range(len(models)):
            with np.load(f"{tmp}/l{i}.npz") as z:
                out.append([z[f"seq{j}"] for j in range(len(tokens))])
        return out


def quantize(
    src, dst, ftype: str = "Q4_K_M", imatrix=None, overrides=None, token_embedding_type=None, output_tensor_type=None
) -> dict:
    return run_ops(
        [
            {
                "op": "quantize",
                "src": str(src),
                "dst": str(dst),
                "ftype": ftype,
                "imatrix": None if imatrix is None else str(imatrix),
                "overrides": overrides or {},
                "token_embedding_type": token_embedding_type,
                "output_tensor_type": output_tensor_type,
            }
        ]
    )[0]


def tensor_types(model) -> dict:
    return run_ops([{"op": "types", "model": str(model)}])[0]


def evaluate_gguf(
    gguf_path,
    reference,
    dataset: str = "builtin:mix",
    samples: int = 32,
    seq_len: int = 256,
    seed: int = 0,
    progress: bool = False,
) -> dict:
    """KL / top-1 / perplexity of llama.cpp running `gguf_path` against transformers running the
    reference (float32), on the evaluation split of `dataset` (evaluate()'s keys, engine llama.cpp).
    progress: a bar with the time left over the reference's windows, then a line for llama.cpp's run."""
    import torch

    from moequant.calib.data import load_samples
    from moequant.io.checkpoint import load_tokenizer, open_checkpoint
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
    return {
        "engine": "llama.cpp",
        "samples": len(ids),
        "tokens": int(kl.size),
        "ppl_original": float(np.exp(n_ref)),
        "ppl_quantized": float(np.exp(n_q)),
        "nll_original": float(n_ref),
        "nll_quantized": float(n_q),
        "kl_mean": float(kl.mean()),
        "kl_p90": float(np.quantile(kl, 0.9)),
        "kl_p99": float(np.quantile(kl, 0.99)),
        "kl_max": float(kl.max()),
        "top1_agreement": float(top1.mean()),
        "checkpoint": str(gguf_path),
        "reference": str(reference),
        "dataset": dataset,
        "seq_len": seq_len,
        "seed": seed,
    }


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
