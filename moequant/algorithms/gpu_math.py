"""How GPTQ computes on a GPU: the recipe's `gptq.gpu_math:` section. Each switch changes GPU results (GPTQ's
products and Cholesky, whether the Triton kernels of the sweep, the refit and the grid search run, CUDA
graphs), so the run fingerprint records the ones set away from their defaults (moequant.measure.settings) and
statistics and checkpoints made under other GPU math are never reused. On the CPU only `cholesky` changes
which routine runs; the others are inert there."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict

from moequant.errors import UserError


class GpuMath(BaseModel):
    """The recipe's `gptq.gpu_math:` section (moequant.algorithms.gptq's module doc says what each one does)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # the fused sweep's lazy-update products: TF32, or float32 throughout
    update_matmul: Literal["tf32", "fp32"] = "tf32"
    # the blocked Cholesky's products (with update_matmul tf32): split TF32 (tf32x3), or float32
    cholesky_matmul: Literal["tf32x3", "fp32"] = "tf32x3"
    # the factorization: auto = the blocked one on CUDA for batches of matrices of order >= 1024, else torch's
    # batched cholesky_ex; looped = torch's, one matrix at a time (cholesky.cholesky_ex)
    cholesky: Literal["auto", "torch", "looped", "blocked"] = "auto"
    triton: bool = True  # the Triton kernels (GPTQ's fused sweep, the refit, the searched grid) where they apply
    cuda_graphs: bool = True  # the torch sweep's blocks captured once as a CUDA graph (the codes are the same)

    def changed(self) -> dict:
        """{switch: value} of the switches set away from their defaults (what the fingerprint records)."""
        return {k: v for k, v in self.model_dump().items() if v != GpuMath.model_fields[k].default}


# The environment variables that chose these before the recipe did, with the key that replaces each.
OLD_VARIABLES = {
    "MOEQUANT_GPTQ_MATMUL": "update_matmul",
    "MOEQUANT_GPTQ_CHOLESKY_MATMUL": "cholesky_matmul",
    "MOEQUANT_CHOLESKY": "cholesky",
    "MOEQUANT_TRITON": "triton",
    "MOEQUANT_CUDA_GRAPHS": "cuda_graphs",
}


def refuse_old_variables() -> None:
    """A run refuses an old GPU-math variable instead of ignoring it, so no setting silently stops applying."""
    for name, key in OLD_VARIABLES.items():
        if name in os.environ:
            raise UserError(
                f"the environment variable {name} is no longer read: unset it and set the recipe key "
                f"gptq.gpu_math.{key} instead (e.g. --set gptq.gpu_math.{key}=...)."
            )
