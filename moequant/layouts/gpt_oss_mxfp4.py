"""The gpt-oss-mxfp4 layout: gpt-oss's experts as `*_blocks` / `*_scales` (gate/up interleaved as on disk), every
other tensor kept.

What it writes: gpt-oss experts as `*_blocks` / `*_scales` (gate/up interleaved as on disk),
biases and every other tensor kept.
"""

from __future__ import annotations

import torch

from moequant import formats
from moequant.errors import UserError
from moequant.formats import QuantizedTensor, get_format, pack_e2m1, unpack_e2m1
from moequant.layouts.base import Layout
from moequant.layouts.reading import Encoding, dims, need


def holds(spec) -> bool:
    """The one format the layout holds (its packer and its rules ask here)."""
    return spec.name == "mxfp4"


def pack_gpt_oss_mxfp4(q: QuantizedTensor) -> dict:
    """gpt-oss layout for a [E, out, in] stack: blocks uint8 [E, out, in/32, 16], scales uint8 [E, out, in/32].

    (gpt-oss names them e.g. mlp.experts.gate_up_proj_blocks / _scales; the dequantized
    parameter is the transpose, [E, in, out].)
    """
    if not holds(q.spec):
        raise UserError("the gpt-oss MXFP4 layout holds mxfp4, not %s" % q.spec.key)
    packed = pack_e2m1(q.codes)
    return {"blocks": packed.unflatten(-1, (packed.shape[-1] // 16, 16)).contiguous(), "scales": q.scales}


def unpack_gpt_oss_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedTensor:
    codes = unpack_e2m1(blocks.flatten(-2))
    return QuantizedTensor(get_format("mxfp4"), tuple(codes.shape), codes, scales)


def read_gpt_oss_mxfp4(qc, stored, where, read):
    spec = formats.get_format("mxfp4")
    out = {}
    for stem in sorted(n[: -len("_blocks")] for n in stored if n.endswith("_blocks")):
        blocks, scales = f"{stem}_blocks", f"{stem}_scales"
        need(stored, where, blocks, ("U8",))
        E, rows, groups, sixteen = dims(stored, where, blocks, 4)
        if sixteen != 16:
            raise UserError(
                f"{where}: tensor {blocks!r} has shape {list(stored[blocks].shape)}; MXFP4 blocks are "
                "[experts, out, in/32, 16]."
            )
        need(stored, where, scales, ("U8",), (E, rows, groups), " (the e8m0 scales of its blocks)")
        out[stem] = Encoding(
            stem, (E, groups * 32, rows), spec, "gpt-oss-mxfp4", {"blocks": blocks, "blocks_scales": scales}
        )
    return out


def unpack_gpt_oss_mxfp4_encoding(enc: Encoding, t: dict) -> QuantizedTensor:
    return unpack_gpt_oss_mxfp4(t["blocks"], t["blocks_scales"])


def quantization_config() -> dict:
    """gpt-oss's own spelling (as OpenAI's checkpoints and transformers write it): everything but the experts
    stays in bf16."""
    return {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }


class GptOssMxfp4(Layout):
    name = "gpt-oss-mxfp4"
    quant_methods = ("mxfp4",)  # the quantization_config.quant_method values it reads back
    read_encodings = staticmethod(read_gpt_oss_mxfp4)
    unpack = staticmethod(unpack_gpt_oss_mxfp4_encoding)
    stored_transposed = True  # the parameter is [E, in, out]; its codes are [E, out, in]
    routed_only = True

    @staticmethod
    def refuses(spec):
        return None if holds(spec) else "mxfp4 only (gpt-oss's own layout)"

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
        packed = pack_gpt_oss_mxfp4(q)
        return {f"{name}_blocks": packed["blocks"], f"{name}_scales": packed["scales"]}

    def quantization_config(self) -> dict:
        return quantization_config()
