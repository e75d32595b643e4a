"""gpt-oss: experts fused on disk and in memory, `gate_up_proj [E, H, 2I]` with gate / up
interleaved on the last axis (gate = even columns, up = odd), `down_proj [E, I, H]`, all with
biases. Each expert's weights are transposed relative to nn.Linear; the adapter slices and
transposes so callers always see `[out, in]`.
"""

import torch

from moequant.arch.base import Adapter, Routing, TensorRole, cfg_get, gqa_attention


def _half(proj: str) -> slice:
    """gate is every even column of the fused gate_up axis, up every odd one."""
    return slice(0, None, 2) if proj == "gate" else slice(1, None, 2)


class GptOssAdapter(Adapter):
    model_types = ("gpt_oss",)
    fused_experts = True

    def setup(self):
        c = self.config
        self.num_experts = int(cfg_get(c, "num_local_experts", default=128))
        self.top_k = int(cfg_get(c, "num_experts_per_tok", "experts_per_token", default=4))
        self.expert_intermediate = int(c["intermediate_size"])
        self.moe_layers = list(range(self.num_layers))

    @property
    def routing(self):
        return Routing("softmax_over_topk", self.top_k, normalize_topk=True, router_bias=True)

    def attention_tensors(self, layer):
        t = gqa_attention(self.config, self.hidden, bias=True, o_bias=True)
        t["self_attn.sinks"] = (int(self.config["num_attention_heads"]),)
        return t

    def router_tensors(self, layer):
        p = self.moe_prefix(layer)
        return {p + "router.weight": (self.num_experts, self.hidden), p + "router.bias": (self.num_experts,)}

    def fused_names(self, layer):
        p = self.moe_prefix(layer) + "experts."
        return {
            "gate_up": p + "gate_up_proj",
            "down": p + "down_proj",
            "gate_up_bias": p + "gate_up_proj_bias",
            "down_bias": p + "down_proj_bias",
        }

    def expert_tensor_name(self, layer, expert, proj):
        n = self.fused_names(layer)
        return n["down"] if proj == "down" else n["gate_up"]

    def routed_expert_tensors(self, layer):
        n, E, h, i = self.fused_names(layer), self.num_experts, self.hidden, self.expert_intermediate
        return {
            n["gate_up"]: ((E, h, 2 * i), TensorRole("routed_expert", layer, None, "gate_up")),
            n["gate_up_bias"]: ((E, 2 * i), TensorRole("routed_expert", layer, None, "gate_up_bias")),
            n["down"]: ((E, i, h), TensorRole("routed_expert", layer, None, "down")),
            n["down_bias"]: ((E, h), TensorRole("routed_expert", layer, None, "down_bias")),
        }

    def read_expert(self, checkpoint, layer, expert, proj):
        self._check_expert(layer, expert, proj)
        n = self.fused_names(layer)
        if proj == "down":
            return checkpoint.get_slice(n["down"])[expert].t().contiguous()
        fused = checkpoint.get_slice(n["gate_up"])[expert]  # [H, 2I]
        return fused[:, _half(proj)].t().contiguous()

    def read_experts(self, checkpoint, layer, proj, experts=None, device=None, dtype=None):
        n = self.fused_names(layer)
        fused = checkpoint.get(n["down"] if proj == "down" else n["gate_up"], device)
        if experts is not None:
            fused = fused[experts.start : experts.stop]
        part = fused if proj == "down" else fused[:, :, _half(proj)]
        return part.transpose(1, 2).to(dtype or part.dtype).contiguous()

    def write_expert(self, tensors, layer, expert, proj, weight):
        self._check_expert(layer, expert, proj)
        if tuple(weight.shape) != self.expert_shape(proj):
            raise ValueError(f"expert weight shape {tuple(weight.shape)} != {self.expert_shape(proj)}")
        n = self.fused_names(layer)
        name = n["down"] if proj == "down" else n["gate_up"]
        if name not in tensors:
            raise KeyError(f"{name} must be in the tensor dict before one expert of it is written")
        fused = tensors[name]
        if proj == "down":
            fused[expert] = weight.t().to(fused.dtype)
        else:
            fused[expert][:, _half(proj)] = weight.t().to(fused.dtype)

    def expert_from_module(self, experts, expert, proj):
        if proj == "down":
            return experts.down_proj[expert].t()
        return experts.gate_up_proj[expert][:, _half(proj)].t()

    def router_module(self, mlp):
        return mlp.router

    def expert_hidden(self, experts, x, expert):
        gate_up = x @ experts.gate_up_proj[expert] + experts.gate_up_proj_bias[expert]
        return experts._apply_gate(gate_up)

    def experts_hidden(self, experts, x, ids):
        gate_up = torch.matmul(x, experts.gate_up_proj[ids]) + experts.gate_up_proj_bias[ids][:, None, :]
        return experts._apply_gate(gate_up)

    def fuse_experts(self, checkpoint, layer, key, experts):
        if key.endswith("down_proj"):
            d = experts.get("down")
            d = self.read_experts(checkpoint, layer, "down") if d is None else d
            return d.transpose(1, 2)
        g = experts.get("gate")
        u = experts.get("up")
        g = self.read_experts(checkpoint, layer, "gate") if g is None else g
        u = self.read_experts(checkpoint, layer, "up") if u is None else u
        E, i, h = g.shape
        fused = torch.empty(E, h, 2 * i, dtype=g.dtype, device=g.device)
        fused[:, :, 0::2] = g.transpose(1, 2)
        fused[:, :, 1::2] = u.transpose(1, 2)
        return fused
