"""llama.cpp (llama-cpp-python) as an independent reader of our GGUF exports, for the tests and benchmarks.

    python tests/support/verify_llamacpp.py --install-only     # build / install once (CI does it ahead)

The venv and the worker are the library's (moequant.llamacpp.runner: built once when missing, a ggml abort
fails the call, not pytest); this file adds what only the checks ask of llama.cpp: its tokenizer, its own
quantizer of whole files (llama-quantize) and the types it reads. A failed build or install raises: tests
that need llama.cpp fail loudly, they never skip.
"""

from __future__ import annotations

import argparse
import os
import sys

from moequant.llamacpp.evaluate import evaluate_gguf, kl_per_token  # noqa: F401  (the tests' and benchmarks' names)
from moequant.llamacpp.runner import ensure_llama_cpp, ggml_dequantize, ggml_quantize, logits, run_ops  # noqa: F401


def tokenize(model: str | os.PathLike, texts: list[str]) -> list[list[int]]:
    return run_ops([{"op": "tokenize", "model": str(model), "texts": texts}])[0]["tokens"]


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tests/support/verify_llamacpp.py")
    parser.add_argument("--install-only", action="store_true", help="build / install llama-cpp-python and exit")
    parser.parse_args(argv)
    print(ensure_llama_cpp())  # the venv's python; building it is all this command does
    return 0


if __name__ == "__main__":
    sys.exit(main())
