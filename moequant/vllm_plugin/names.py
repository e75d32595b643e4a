"""The checkpoint keys a per-expert checkpoint carries and the plugin reads (no vLLM import here)."""

QUANT_METHOD = "moequant"  # quantization_config.quant_method of a per-expert checkpoint
EXPERT_FORMATS = "expert_formats"  # quantization_config key: {MoE layer module: [format key per expert]}
