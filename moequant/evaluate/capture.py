"""What one batch of one MoE layer yields: forward hooks on each model's routers, MoE blocks and pre-MoE norms
(`Capture`), and each routed expert's output error over the tokens the reference router sends to it
(`expert_output_errors`). The arithmetic is described in moequant.evaluate's docstring."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moequant.errors import UserError


def moe_block(model, adapter, layer: int):
    return adapter.moe_block(model, layer)


def _pre_moe_norm(model, adapter, layer: int):
    return getattr(adapter.decoder(model)[1][layer], "post_attention_layernorm", None)


def block_input_for(model, adapter, layer: int, pre_norm, x_ref):
    """The reference model's MoE-block input as `model` sees it: its own norm applied to the
    reference's pre-norm hidden states (equal to x_ref unless the norm was changed, e.g. by an
    AWQ scale folded into it)."""
    norm = _pre_moe_norm(model, adapter, layer)
    if norm is None or pre_norm is None:
        return x_ref
    return norm(pre_norm.to(next(norm.parameters()).device))


@dataclass
class Capture:
    """Forward hooks on one model's routers and MoE blocks; records one batch at a time."""

    model: object
    adapter: object
    keep_inputs: bool
    active: bool = True
    indices: dict = field(default_factory=dict)  # layer -> [tokens, k] expert ids
    inputs: dict = field(default_factory=dict)  # layer -> MoE block input [tokens, hidden]
    pre_norm: dict = field(default_factory=dict)  # layer -> input of the norm before the MoE block
    outputs: dict = field(default_factory=dict)  # layer -> MoE block output [tokens, hidden]
    # layer -> the block's other call arguments (DeepSeek-V4's hash-routed blocks also take the input ids)
    extra: dict = field(default_factory=dict)
    handles: list = field(default_factory=list)

    def __post_init__(self):
        for L in self.adapter.moe_layers:
            block = moe_block(self.model, self.adapter, L)
            router = self.adapter.router_module(block)
            self.handles.append(router.register_forward_hook(self._on_router(L)))
            self.handles.append(block.register_forward_hook(self._on_block(L), with_kwargs=True))
            norm = _pre_moe_norm(self.model, self.adapter, L)
            if self.keep_inputs and norm is not None:
                self.handles.append(norm.register_forward_hook(self._on_norm(L)))

    def _on_router(self, layer):
        def hook(module, args, output):
            if self.active:
                if not (isinstance(output, tuple) and len(output) == 3):
                    raise UserError(
                        f"the router of layer {layer} ({type(module).__name__}) does not return "
                        "(logits, weights, indices); this model's MoE implementation is not supported."
                    )
                self.indices[layer] = output[2].detach().reshape(-1, self.adapter.top_k)

        return hook

    def _on_block(self, layer):
        def hook(module, args, kwargs, output):
            if self.active:
                x = args[0] if args else kwargs["hidden_states"]
                self.extra[layer] = (args[1:], {k: v for k, v in kwargs.items() if k != "hidden_states"})
                y = output[0] if isinstance(output, tuple) else output  # gpt-oss also returns router scores
                if self.keep_inputs:
                    self.inputs[layer] = x.detach()
                self.outputs[layer] = y.detach().reshape(-1, y.shape[-1])

        return hook

    def _on_norm(self, layer):
        def hook(module, args, output):
            if self.active:
                self.pre_norm[layer] = args[0].detach()

        return hook

    def clear(self):
        self.indices.clear()
        self.inputs.clear()
        self.pre_norm.clear()
        self.outputs.clear()

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _expert_output(adapter, experts, x: torch.Tensor, expert: int) -> torch.Tensor:
    """Output of one routed expert (before its routing weight) for tokens x [n, hidden], float32."""
    w_down = adapter.expert_from_module(experts, expert, "down")
    x = x.to(w_down.dtype)
    h = adapter.expert_hidden(experts, x, expert)
    y = torch.nn.functional.linear(h.to(w_down.dtype), w_down)
    bias = getattr(experts, "down_proj_bias", None)
    if bias is not None:
        y = y + bias[expert]
    return y.float()


def _pair_outputs(experts, x: torch.Tensor, expert_of_pair: torch.Tensor) -> torch.Tensor:
    """Each token-expert pair's expert output (before its routing weight) for rows x [pairs, hidden]:
    [pairs, hidden] float32, from the experts module's own forward (the model's kernels: grouped_mm on a
    GPU, no padding), each row routed to its pair's expert alone at weight 1."""
    ones = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)
    return experts(x, expert_of_pair[:, None], ones).float()


def _errors_grouped(ref_experts, q_experts, x, xq, r_idx, num_experts: int, zero_experts: bool = False):
    """expert_output_errors by one experts forward per model over every token-expert pair (no host sync but
    where the router also picks weightless zero experts, whose pairs are dropped)."""
    k = r_idx.shape[1]
    token = torch.arange(r_idx.shape[0], device=r_idx.device).repeat_interleave(k)
    expert = r_idx.reshape(-1)
    if zero_experts:
        token, expert = token[expert < num_experts], expert[expert < num_experts]
    q_dev = q_experts.down_proj.device
    y_ref = _pair_outputs(ref_experts, x[token], expert)
    y_q = _pair_outputs(q_experts, xq[token.to(xq.device)].to(q_dev), expert.to(q_dev)).to(x.device)
    return _sq_by_expert(y_q - y_ref, expert, num_experts), _sq_by_expert(y_ref, expert, num_experts)


def _sq_by_expert(y: torch.Tensor, expert_of_row: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Sum of squares of the rows of y [rows, hidden] per expert (float64 [num_experts]): per row in
    float32 (a float64 reduction is slow on the CPU; a row is one token's output), across rows in float64."""
    per_row = torch.linalg.vector_norm(y, dim=-1).double() ** 2
    return torch.zeros(num_experts, dtype=torch.float64, device=y.device).index_add_(0, expert_of_row, per_row)


def _errors_per_expert(adapter, ref_experts, q_experts, x, xq, r_idx, num_experts: int):
    """expert_output_errors one expert at a time (its tokens in one slice of the pairs sorted by expert;
    one host sync)."""
    flat = r_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # within an expert, its tokens in ascending order
    token = order // r_idx.shape[1]
    offsets = [0] + torch.cumsum(torch.bincount(flat, minlength=num_experts), 0).tolist()
    q_dev = q_experts.down_proj.device
    err = torch.zeros(num_experts, dtype=torch.float64, device=x.device)
    ref = torch.zeros(num_experts, dtype=torch.float64, device=x.device)
    for e in range(num_experts):
        if offsets[e + 1] > offsets[e]:
            tok = token[offsets[e] : offsets[e + 1]]
            y_ref = _expert_output(adapter, ref_experts, x[tok], e)
            y_q = _expert_output(adapter, q_experts, xq[tok.to(xq.device)].to(q_dev), e).to(x.device)
            err[e] = sq_tensor(y_q - y_ref)
            ref[e] = sq_tensor(y_ref)
    return err, ref


def expert_output_errors(adapter, ref_experts, q_experts, x, xq, r_idx, grouped: bool):
    """Per routed expert, over the tokens the reference router sends to it (r_idx [tokens, k]):
    sum |y_q - y_ref|^2 and sum |y_ref|^2 of the expert's own output (float64 [E] each, on the host).
    x / xq [tokens, hidden]: the reference / quantized experts' inputs. grouped: every token-expert
    pair through each model's experts module at once (its grouped kernel on a GPU), else one expert
    at a time (the CPU's exact arithmetic of one expert's tokens)."""
    if grouped:
        zero_experts = adapter.router_choices > adapter.num_experts  # LongCat-Flash: no output to compare
        err, ref = _errors_grouped(ref_experts, q_experts, x, xq, r_idx, adapter.num_experts, zero_experts)
    else:
        err, ref = _errors_per_expert(adapter, ref_experts, q_experts, x, xq, r_idx, adapter.num_experts)
    return err.cpu(), ref.cpu()


def has_fused_experts(model, adapter, layer) -> bool:
    experts = getattr(moe_block(model, adapter, layer), "experts", None)
    return (
        experts is not None
        and hasattr(experts, "down_proj")
        and (hasattr(experts, "gate_up_proj") or hasattr(experts, "gate_up_proj_blocks"))
    )


def sq_tensor(x: torch.Tensor) -> torch.Tensor:
    """Sum of squares of x as a float64 tensor, accumulated without a float64 copy of x (no host sync)."""
    return torch.linalg.vector_norm(x, dtype=torch.float64) ** 2
