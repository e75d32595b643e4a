"""Mixtral: every layer MoE, experts `block_sparse_moe.experts.E.w1/w2/w3` (w1 gate, w3 up, w2 down)."""

from moequant.arch.base import Adapter, Routing, cfg_get, gqa_attention


class MixtralAdapter(Adapter):
    model_types = ("mixtral",)

    def setup(self):
        c = self.config
        self.num_experts = int(cfg_get(c, "num_local_experts", default=8))
        self.top_k = int(cfg_get(c, "num_experts_per_tok", default=2))
        self.expert_intermediate = int(c["intermediate_size"])
        self.moe_layers = list(range(self.num_layers))

    @property
    def routing(self):
        return Routing("softmax", self.top_k, normalize_topk=True)

    def moe_prefix(self, layer):
        return f"model.layers.{layer}.block_sparse_moe."

    def expert_proj_name(self, proj):
        return {"gate": "w1", "up": "w3", "down": "w2"}[proj]

    def attention_tensors(self, layer):
        return gqa_attention(self.config, self.hidden)

    def memory_to_disk(self, layer, key):
        if key.startswith("mlp."):
            key = "block_sparse_moe." + key[4:]
        return f"model.layers.{layer}.{key}"
