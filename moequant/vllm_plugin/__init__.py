"""vLLM plugin: serve checkpoints whose routed experts mix formats inside one MoE layer.

    pip install 'moequant[vllm]'          # or, into an existing vLLM env: pip install -e . --no-deps
    vllm serve runs/x/checkpoint          # quant_method "moequant" in config.json selects the plugin

vLLM stacks a layer's experts into one fused-MoE buffer of one scheme. The plugin, registered
through vLLM's `vllm.general_plugins` entry point (`register` below), adds the quantization
method `moequant`: a compressed-tensors checkpoint (moequant.layouts.compressed_tensors, target `vllm-moequant`)
whose `quantization_config` also holds `expert_formats`, {MoE layer module: [format key per
expert]}. Everything but the routed experts loads through vLLM's own compressed-tensors code.
Per MoE layer the experts are grouped by format; each group's weights are stacked exactly as
vLLM's own method for that scheme stacks a whole layer (`CompressedTensorsMoEMethod.get_moe_method`
picks it: WNA16 for int4, W8A8-int8 for int8, unquantized for bf16), and the forward routes
once, then runs each group's fused MoE on the tokens' global expert ids mapped to group-local
ids (slots routed to other groups get weight 0), and sums the groups' outputs. No kernel of
our own: each group runs vLLM's kernel for its scheme.

A format that vLLM has no fused-MoE kernel for on the running backend is refused when the
model is built, in one sentence naming the layer and the format.

This module imports nothing from vLLM: `register` imports moequant.vllm_plugin.method, which
needs it. moequant's export uses the checkpoint keys in moequant.vllm_plugin.names without vLLM installed.
"""

from __future__ import annotations

from moequant.vllm_plugin.names import QUANT_METHOD


def register() -> None:
    """The `vllm.general_plugins` entry point: add the `moequant` quantization method to vLLM, and let vLLM's
    Transformers modeling backend build transformers' model of an export whose config.json stops plain transformers
    until the per-expert mapping is registered (compressed_tensors.accept_fused_stop; vLLM loads the per-expert
    tensors itself). vLLM may call it several times per process; registering again replaces the same entries."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    from moequant.layouts.compressed_tensors import accept_fused_stop
    from moequant.vllm_plugin.method import MoequantConfig

    register_quantization_config(QUANT_METHOD)(MoequantConfig)
    accept_fused_stop()
