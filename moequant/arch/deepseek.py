"""DeepSeek-V2 / V3: multi-head latent attention, dense first layers, shared experts, grouped top-k.

V3 scores with a sigmoid and selects with `e_score_correction_bias` added (the bias steers
selection only; the weights use the raw scores); V2 scores with a softmax. Both may restrict
each token to `topk_group` of `n_group` expert groups.
"""

from moequant.arch.base import Adapter, Routing, TensorRole, cfg_get


class DeepseekV3Adapter(Adapter):
    model_types = ("deepseek_v3",)
    correction_bias = True

    def setup(self):
        c = self.config
        self.num_experts = int(cfg_get(c, "n_routed_experts", "num_local_experts", "num_experts", default=256))
        self.top_k = int(cfg_get(c, "num_experts_per_tok", default=8))
        self.expert_intermediate = int(cfg_get(c, "moe_intermediate_size", default=2048))
        self.n_shared = int(cfg_get(c, "n_shared_experts", default=1) or 0)
        first_dense = int(cfg_get(c, "first_k_dense_replace", default=3))
        freq = int(cfg_get(c, "moe_layer_freq", default=1))
        self.moe_layers = [L for L in range(self.num_layers) if L >= first_dense and L % freq == 0]

    @property
    def routing(self):
        c = self.config
        return Routing(
            "sigmoid" if self.correction_bias else "softmax",
            self.top_k,
            normalize_topk=bool(cfg_get(c, "norm_topk_prob", default=self.correction_bias)),
            groups=int(cfg_get(c, "n_group", default=1) or 1),
            topk_groups=int(cfg_get(c, "topk_group", default=1) or 1),
            scaling=float(cfg_get(c, "routed_scaling_factor", default=1.0)),
            correction_bias=self.correction_bias,
        )

    @property
    def num_shared_experts(self):
        return self.n_shared

    def attention_tensors(self, layer):
        c, h = self.config, self.hidden
        heads = int(c["num_attention_heads"])
        q_lora = cfg_get(c, "q_lora_rank")
        kv_lora = int(cfg_get(c, "kv_lora_rank", default=512))
        nope = int(cfg_get(c, "qk_nope_head_dim", default=128))
        rope = int(cfg_get(c, "qk_rope_head_dim", default=64))
        v = int(cfg_get(c, "v_head_dim", default=128))
        t = {}
        if q_lora:
            t["self_attn.q_a_proj.weight"] = (int(q_lora), h)
            t["self_attn.q_b_proj.weight"] = (heads * (nope + rope), int(q_lora))
        else:
            t["self_attn.q_proj.weight"] = (heads * (nope + rope), h)
        t["self_attn.kv_a_proj_with_mqa.weight"] = (kv_lora + rope, h)
        t["self_attn.kv_b_proj.weight"] = (heads * (nope + v), kv_lora)
        t["self_attn.o_proj.weight"] = (h, heads * v)
        return t

    def attention_norms(self, layer):
        c = self.config
        t = {"self_attn.kv_a_layernorm.weight": (int(cfg_get(c, "kv_lora_rank", default=512)),)}
        if cfg_get(c, "q_lora_rank"):
            t["self_attn.q_a_layernorm.weight"] = (int(c["q_lora_rank"]),)
        return t

    def router_tensors(self, layer):
        t = {self.moe_prefix(layer) + "gate.weight": (self.num_experts, self.hidden)}
        if self.correction_bias:
            t[self.moe_prefix(layer) + "gate.e_score_correction_bias"] = (self.num_experts,)
        return t

    def shared_expert_tensors(self, layer):
        if not self.n_shared:
            return {}
        p, h, i = self.moe_prefix(layer), self.hidden, self.expert_intermediate * self.n_shared
        out = {}
        for proj in ("gate", "up", "down"):
            shape = (h, i) if proj == "down" else (i, h)
            out[f"{p}shared_experts.{proj}_proj.weight"] = (shape, TensorRole("shared_expert", layer, None, proj))
        return out


class DeepseekV2Adapter(DeepseekV3Adapter):
    model_types = ("deepseek_v2",)
    correction_bias = False

    @property
    def routing(self):
        r = super().routing
        c = self.config
        grouped = cfg_get(c, "topk_method", default="greedy") == "group_limited_greedy"
        return Routing(
            "softmax",
            self.top_k,
            normalize_topk=bool(cfg_get(c, "norm_topk_prob", default=False)),
            groups=r.groups if grouped else 1,
            topk_groups=r.topk_groups if grouped else 1,
            scaling=r.scaling,
        )
