"""moequant's vLLM plugin (target `vllm-moequant`, moequant.vllm_plugin): every routed expert on its own, one
vLLM fused-MoE method per format group of a layer, in the formats vLLM's CPU backend has fused-MoE kernels
for: vLLM 0.32 there has them for symmetric int4 groups (W4A16), int8 per channel with dynamic per-token int8
activations (W8A8; export.int8_activations: dynamic) and bf16; FP8 / MXFP4 / NVFP4 MoE need a GPU. The
plugin reads the compressed-tensors layout with `quant_method: moequant` and a per-expert format map; an
expert's gate, up and down share one format (vLLM stacks them together)."""

from __future__ import annotations

from moequant.targets.vllm import Vllm


class VllmMoequant(Vllm):
    name = "vllm-moequant"
    granularity = "expert"
    layouts = ("compressed-tensors",)
    expert_format_map = True
    routed_formats = "int8 (per channel), symmetric int4, bf16"

    def refuses(self, spec, routed):
        plugin = (
            "moequant's vLLM plugin serves routed experts in bf16, per-channel int8 (W8A8) and symmetric "
            "int4 on vLLM's CPU backend, not %s" % spec.key
        )
        if routed and spec.quantized and not spec.is_ggml and not (spec.is_int and spec.bits in (4, 8)):
            return plugin
        return super().refuses(spec, routed)

    def refuses_layout(self, layout):
        if layout.name not in self.layouts:
            return (
                f"target vllm-moequant (moequant's vLLM plugin) reads the compressed-tensors layout, not "
                f"{layout.recipe_name or layout.name}; set export.format compressed-tensors"
            )
        return None
