"""vLLM (target `vllm`): loads compressed-tensors, GPTQ, AWQ and DeepSeek-FP8 checkpoints through its own
fused-MoE and linear kernels. Facts read from vLLM 0.32's source:

* one format for all routed experts of a layer: vLLM stacks a layer's experts into one fused-MoE buffer and
  resolves the quantization scheme from expert 0's gate / up / down only (compressed-tensors
  `get_moe_method`); a layer whose experts are all in `ignore` is loaded unquantized, so bf16 is a
  whole-layer choice, never one for single experts;
* q/k/v and gate/up are fused into one module each: one format per such group;
* integer weights only at 4 or 8 bits (WNA16 kernels);
* integer experts with zero points only in its CUDA kernels (fused_moe/oracle/int_wna16.py and the experts'
  `_supports_quant_scheme`: Marlin and Triton WNA16 take them); its CPU backend takes symmetric int4 only
  and zentorch's refuses zero points. moequant checks its `vllm` exports on that CPU build
  (tests/test_vllm.py also proves it refuses them), so this target keeps routed integer experts symmetric;
  `vllm-cuda` is the one for those GPU kernels.
"""

from __future__ import annotations

from moequant.targets.base import Target


class Vllm(Target):
    name = "vllm"
    engine = "vLLM"  # how refusals name the engine
    granularity = "layer"
    fuses_projections = True
    zero_points = False  # routed integer experts with zero points
    routed_formats = "fp8, int8, symmetric int4, mxfp4, nvfp4, bf16"

    def refuses(self, spec, routed):
        why = super().refuses(spec, routed)
        if why or not spec.is_int:
            return why
        if spec.bits not in (4, 8):
            return f"{self.engine} loads integer weights only at 4 or 8 bits (WNA16 kernels)"
        if routed and not spec.symmetric and not self.zero_points:
            return self.zero_point_refusal
        return None

    zero_point_refusal = (
        "vLLM 0.32 loads integer experts with zero points only in its CUDA kernels (Marlin, "
        "Triton; target vllm-cuda), not in its CPU build, where moequant checks its vllm exports"
    )
