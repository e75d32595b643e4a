"""Quantization algorithms for the routed experts of one MoE layer.

- `registry`: each algorithm as the pipeline sees it (what it reads, how it rounds, its recipe options),
  looked up by the name a plan row gives; calibration, the probe and the quantize pass ask it.
- `rtn.rtn`: round-to-nearest with the format's own per-expert scales.
- `gptq.gptq` / `gptq.gptq_shared_hessian`: GPTQ batched over experts (CPU or CUDA).
- `awq.awq_down` (per expert, folded into up_proj), `awq.awq_gate_up` (one scale per layer,
  folded into the post-attention norm), `awq.awq` / `awq.awq_scales` (the search alone),
  `awq.awq_shared_scale` (one scale for groups in different formats; the quantize pass's gate/up).
"""

from moequant.algorithms import awq, gptq, rtn  # noqa: F401
