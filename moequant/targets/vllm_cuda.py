"""vLLM on NVIDIA GPUs (target `vllm-cuda`): vLLM's rules (moequant.targets.vllm), and its Marlin / Triton
WNA16 MoE kernels take zero points, so asymmetric int4 experts are offered too. No engine check here:
vLLM's CPU build, on which moequant checks its vllm exports, refuses them."""

from __future__ import annotations

from moequant.targets.vllm import Vllm


class VllmCuda(Vllm):
    name = "vllm-cuda"
    zero_points = True
    routed_formats = "fp8, int8, int4 (symmetric or with zero points), mxfp4, nvfp4, bf16"
