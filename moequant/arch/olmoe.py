"""OLMoE: every layer MoE, no shared expert, q/k norms over the full projection width."""

from moequant.arch.base import Adapter, Routing, cfg_get, gqa_attention


class OlmoeAdapter(Adapter):
    model_types = ("olmoe",)

    def setup(self):
        c = self.config
        self.num_experts = int(cfg_get(c, "num_experts", "num_local_experts", default=64))
        self.top_k = int(cfg_get(c, "num_experts_per_tok", default=8))
        self.expert_intermediate = int(c["intermediate_size"])
        self.moe_layers = list(range(self.num_layers))

    @property
    def routing(self):
        return Routing(
            "softmax", self.top_k, normalize_topk=bool(cfg_get(self.config, "norm_topk_prob", default=False))
        )

    def attention_tensors(self, layer):
        return gqa_attention(self.config, self.hidden, bias=bool(cfg_get(self.config, "attention_bias", default=False)))

    def attention_norms(self, layer):
        c = self.config
        heads = int(c["num_attention_heads"])
        kv = int(cfg_get(c, "num_key_value_heads", default=heads))
        hd = self.hidden // heads
        return {"self_attn.q_norm.weight": (heads * hd,), "self_attn.k_norm.weight": (kv * hd,)}
