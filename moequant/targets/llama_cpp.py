"""llama.cpp (target `llama.cpp`): reads one GGUF file. GGUF stacks a layer's experts per projection
(`blk.N.ffn_{gate,up,down}_exps`) into one tensor of one type, so gate, up and down of a layer may differ,
experts may not. It stores ggml block types (q8_0 ... q2_k, the i-quants) or bf16, and routed experts in
MXFP4 as ggml's MXFP4 blocks (gpt-oss's own); a type whose block does not divide a projection's input
dimension is not offered to it (moequant.plan.options)."""

from __future__ import annotations

from moequant.targets.base import Target

ROUTED_NATIVE = ("mxfp4",)  # non-ggml format families GGUF stores as they are, for routed experts


class LlamaCpp(Target):
    name = "llama.cpp"
    granularity = "layer_proj"
    container = "gguf"
    routed_formats = "ggml block types (q8_0 ... q2_k, iq4_xs ... iq2_xxs), mxfp4, bf16"

    def refuses(self, spec, routed):
        if spec.is_ggml or not spec.quantized or (routed and spec.name in ROUTED_NATIVE):
            return None
        return "llama.cpp (GGUF) stores ggml block types (q8_0, q6_k, q5_k, q4_k, q4_0, ...) or bf16, not " + spec.name

    def refuses_layout(self, layout):
        if layout.container != self.container:
            return (
                "export format gguf and target llama.cpp go together (llama.cpp loads GGUF; the other "
                "targets load safetensors layouts); set both or neither"
            )
        return None
