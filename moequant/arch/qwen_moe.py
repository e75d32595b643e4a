"""Qwen2-MoE (shared expert + sigmoid shared-expert gate) and Qwen3-MoE (no shared expert, q/k norms)."""

from moequant.arch.base import Adapter, Routing, TensorRole, cfg_get, gqa_attention


def _sparse_layers(c: dict, num_layers: int) -> list[int]:
    step = int(cfg_get(c, "decoder_sparse_step", default=1))
    dense_only = set(cfg_get(c, "mlp_only_layers", default=[]) or [])
    experts = int(cfg_get(c, "num_experts", "num_local_experts", default=0))
    return [L for L in range(num_layers) if L not in dense_only and experts > 0 and (L + 1) % step == 0]


class Qwen2MoeAdapter(Adapter):
    model_types = ("qwen2_moe",)

    def setup(self):
        c = self.config
        self.num_experts = int(cfg_get(c, "num_experts", "num_local_experts", default=60))
        self.top_k = int(cfg_get(c, "num_experts_per_tok", default=4))
        self.expert_intermediate = int(cfg_get(c, "moe_intermediate_size", default=1408))
        self.shared_intermediate = int(cfg_get(c, "shared_expert_intermediate_size", default=5632))
        self.moe_layers = _sparse_layers(c, self.num_layers)

    @property
    def routing(self):
        return Routing(
            "softmax", self.top_k, normalize_topk=bool(cfg_get(self.config, "norm_topk_prob", default=False))
        )

    @property
    def num_shared_experts(self):
        return 1 if self.shared_intermediate else 0

    def attention_tensors(self, layer):
        return gqa_attention(self.config, self.hidden, bias=bool(cfg_get(self.config, "qkv_bias", default=True)))

    def shared_expert_tensors(self, layer):
        p, h, i = self.moe_prefix(layer), self.hidden, self.shared_intermediate
        out = {}
        for proj in ("gate", "up", "down"):
            shape = (h, i) if proj == "down" else (i, h)
            out[f"{p}shared_expert.{proj}_proj.weight"] = (shape, TensorRole("shared_expert", layer, None, proj))
        out[f"{p}shared_expert_gate.weight"] = ((1, h), TensorRole("shared_expert_gate", layer))
        return out


class Qwen3MoeAdapter(Adapter):
    model_types = ("qwen3_moe",)

    def setup(self):
        c = self.config
        self.num_experts = int(cfg_get(c, "num_experts", "num_local_experts", default=128))
        self.top_k = int(cfg_get(c, "num_experts_per_tok", default=8))
        self.expert_intermediate = int(cfg_get(c, "moe_intermediate_size", default=768))
        self.moe_layers = _sparse_layers(c, self.num_layers)

    @property
    def routing(self):
        return Routing("softmax", self.top_k, normalize_topk=bool(cfg_get(self.config, "norm_topk_prob", default=True)))

    def attention_tensors(self, layer):
        return gqa_attention(self.config, self.hidden, bias=bool(cfg_get(self.config, "attention_bias", default=False)))

    def attention_norms(self, layer):
        c = self.config
        hd = int(cfg_get(c, "head_dim", default=self.hidden // int(c["num_attention_heads"])))
        return {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
