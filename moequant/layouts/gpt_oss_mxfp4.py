"""The gpt-oss-mxfp4 layout: gpt-oss's experts as `*_blocks` / `*_scales` (gate/up interleaved as on disk), every other tensor kept."""

from __future__ import annotations

from moequant import formats
from moequant.errors import UserError
from moequant.layouts.base import Layout


class GptOssMxfp4(Layout):
    name = "gpt-oss-mxfp4"
    routed_only = True

    @staticmethod
    def refuses(spec, target):
        return None if spec.name == "mxfp4" else "mxfp4 only (gpt-oss's own layout)"

    @classmethod
    def refuses_model(cls, adapter):
        if adapter.model_type != "gpt_oss":
            return f"the gpt-oss-mxfp4 layout is gpt-oss's own; this checkpoint is {adapter.model_type}"
        return None

    def check(self) -> None:
        if self.adapter.model_type != "gpt_oss":
            raise UserError(f"the gpt-oss-mxfp4 layout is gpt-oss's own; this checkpoint is {self.adapter.model_type}.")
        self._refuse_formats()
        for name in self.items:
            if self.roles[name].role != "routed_expert":
                raise UserError(
                    f"the gpt-oss-mxfp4 layout quantizes routed experts only; {name} is {self.roles[name].role}."
                )
        for layer in self.adapter.moe_layers:
            for name in (self.adapter.fused_names(layer)[k] for k in ("gate_up", "down")):
                if name not in self.items:
                    raise UserError(
                        f"the gpt-oss-mxfp4 layout (as transformers and vLLM read it) needs every "
                        f"expert in mxfp4; {name} is planned as bf16."
                    )

    def pack(self, name, q):
        packed = formats.pack_gpt_oss_mxfp4(q)
        return {f"{name}_blocks": packed["blocks"], f"{name}_scales": packed["scales"]}

    def quantization_config(self) -> dict:
        # gpt-oss's own spelling: everything but the experts stays in bf16
        return {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        }
