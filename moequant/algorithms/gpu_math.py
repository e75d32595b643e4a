"""The environment switches that change GPU results: how GPTQ's products and Cholesky are computed, whether the
Triton kernels of the sweep, the refit and the grid search run, and CUDA graphs. A run records the ones set
otherwise than their default in its fingerprint (moequant.measure.settings)."""

from __future__ import annotations

import os

from moequant.errors import UserError

# The environment switches that change GPU results (GPTQ's products and Cholesky, the Triton kernels of the
# sweep, the refit and the grid search, CUDA graphs), each with whether a value reads as its default (unset: it does): a run records the
# ones set otherwise in its fingerprint (moequant.measure.settings), so statistics and checkpoints made under
# other GPU math are never reused for this one.
GPU_MATH_SWITCHES = {
    "MOEQUANT_GPTQ_MATMUL": lambda v: v.lower() == "tf32",
    "MOEQUANT_GPTQ_CHOLESKY_MATMUL": lambda v: v.lower() == "tf32x3",
    "MOEQUANT_CHOLESKY": lambda v: v == "auto",
    "MOEQUANT_TRITON": lambda v: v != "0",
    "MOEQUANT_CUDA_GRAPHS": lambda v: v != "0",
}


def gpu_math_switches() -> dict[str, str]:
    """{variable: value} of the GPU-math switches set to something other than their default."""
    values = {k: os.environ.get(k) for k in GPU_MATH_SWITCHES}
    return {k: v for k, v in values.items() if v is not None and not GPU_MATH_SWITCHES[k](v)}


def update_matmul() -> str:
    """MOEQUANT_GPTQ_MATMUL: "tf32" (default) or "fp32", the fused sweep's lazy-update products."""

    value = os.environ.get("MOEQUANT_GPTQ_MATMUL", "tf32").lower()
    if value not in ("tf32", "fp32"):
        raise UserError(f"MOEQUANT_GPTQ_MATMUL={value!r}: expected 'tf32' or 'fp32'.")
    return value


def cholesky_matmul() -> str:
    """MOEQUANT_GPTQ_CHOLESKY_MATMUL: "tf32x3" (default) or "fp32", the blocked Cholesky's products."""

    value = os.environ.get("MOEQUANT_GPTQ_CHOLESKY_MATMUL", "tf32x3").lower()
    if value not in ("tf32x3", "fp32"):
        raise UserError(f"MOEQUANT_GPTQ_CHOLESKY_MATMUL={value!r}: expected 'tf32x3' or 'fp32'.")
    return value


def cuda_graphs_enabled() -> bool:

    return os.environ.get("MOEQUANT_CUDA_GRAPHS", "1") != "0"
