"""Quality of a quantized MoE model against its original, on the same tokens.

    quality = evaluate(reference_model, quantized_model, samples, batch_size=4)     # two loaded models
    quality = evaluate_streaming("out/checkpoint", "path/to/original", samples)    # the same, layer by layer
    quality = evaluate_checkpoints("out/checkpoint", "path/to/original")   # `moequant eval` (streamed)

Both models see the same token windows (an evaluation split disjoint from calibration, see
data.py). What is measured, and on which positions:

- perplexity: exp(mean next-token NLL) over the positions that have a next token (T-1 per
  window), log-softmax in float64;
- KL(original || quantized) per position over every position of every window (T per window):
  sum_v p(v) (log p(v) - log q(v)) in float64 from the two models' logits; mean, p90, p99
  (linear interpolation between order statistics, numpy's default), max;
- top-1 agreement: share of those positions where both models' argmax is the same token;
- routing agreement per MoE layer: share of tokens whose top-k expert *set* is unchanged,
  each model routing its own hidden states (forward hooks on the router module, whose output
  is (logits, weights, indices)); `routing_agreement` is the mean over MoE layers;
- MoE-block output relative error per layer, sqrt(sum ||y_q - y_ref||^2 / sum ||y_ref||^2)
  over all tokens, in two variants:
  `moe_output_error`: both blocks see the *reference* model's input of that layer (the quantized
  block is run a second time on it, through the quantized model's own pre-MoE norm, which an
  AWQ scale may have changed), so it isolates that block's own quantization error;
  `moe_output_error_accumulated`: each block sees its own model's input, so it includes the
  drift of every earlier layer;
- per routed expert (reference input, reference routing, only the tokens the reference router
  sends to it): relative error of the expert's output and its squared error per routed token
  (the unit of calibration's predicted sensitivity); `error` is None for an expert that got no
  token;
- the reference model's routing share per expert on these tokens (sums to 1 per layer);
- per domain (when samples carry one): perplexities, KL mean / p99, top-1 and routing agreement.

Batches bound memory: logits are turned into float64 statistics a few thousand positions at a
time, and only per-position KL values (one float64 each) are kept across batches.

Streaming (`evaluate_streaming`, what `moequant eval` and `apply`'s report run): neither model
is loaded; both checkpoints run through moequant.io.layers.LayerRunner one decoder layer at a time
(one layer of each in memory, quantized weights dequantized as they are read), each batch's
hidden states carried layer to layer, and the same hooks and per-batch arithmetic (`_Tally`)
as `evaluate`, which stays the reference implementation (tests/test_evaluate.py compares them).
Host memory: two decoder layers + embeddings / heads + both models' hidden states of the
evaluation tokens.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from moequant.errors import UserError
from moequant.metrics import token_statistics

# ----------------------------------------------------------------------------- inputs


def _as_windows(samples) -> list[tuple[torch.Tensor, str | None]]:
    """(input_ids [T] int64, domain or None) for Sample objects, 1-D tensors or a 2-D tensor."""
    if isinstance(samples, torch.Tensor):
        if samples.dim() != 2:
            raise UserError(
                f"evaluation samples as a tensor must be 2-D [samples, tokens], got shape {list(samples.shape)}."
            )
        return [(row, None) for row in samples]
    out = []
    for s in samples:
        ids = s.input_ids if hasattr(s, "input_ids") else s
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        if ids.numel() < 2:
            raise UserError(f"an evaluation sample has {ids.numel()} tokens; perplexity needs at least 2.")
        out.append((ids, getattr(s, "domain", None)))
    if not out:
        raise UserError("no evaluation samples were given; ask for at least one sample.")
    return out


def _batches(windows, batch_size: int):
    """Consecutive windows of equal length, at most batch_size at a time (original order kept)."""
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, (ids, _) in enumerate(windows):
        by_len[ids.numel()].append(i)
    for length in sorted(by_len):
        idx = by_len[length]
        for start in range(0, len(idx), batch_size):
            yield idx[start : start + batch_size]


def _input_device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


def _adapter(model):
    from moequant.arch import adapter_for

    return adapter_for(model.config.to_dict())


def _moe_block(model, adapter, layer: int):
    return adapter.moe_block(model, layer)


def _pre_moe_norm(model, adapter, layer: int):
    return getattr(adapter.decoder(model)[1][layer], "post_attention_layernorm", None)


def _block_input_for(model, adapter, layer: int, pre_norm, x_ref):
    """The reference model's MoE-block input as `model` sees it: its own norm applied to the
    reference's pre-norm hidden states (equal to x_ref unless the norm was changed, e.g. by an
    AWQ scale folded into it)."""
    norm = _pre_moe_norm(model, adapter, layer)
    if norm is None or pre_norm is None:
        return x_ref
    return norm(pre_norm.to(next(norm.parameters()).device))


# ----------------------------------------------------------------------------- hooks


@dataclass
class _Capture:
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
            block = _moe_block(self.model, self.adapter, L)
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


# ----------------------------------------------------------------------------- per-token math


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
            err[e] = _sq_tensor(y_q - y_ref)
            ref[e] = _sq_tensor(y_ref)
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


def _has_fused_experts(model, adapter, layer) -> bool:
    experts = getattr(_moe_block(model, adapter, layer), "experts", None)
    return (
        experts is not None
        and hasattr(experts, "down_proj")
        and (hasattr(experts, "gate_up_proj") or hasattr(experts, "gate_up_proj_blocks"))
    )


# ----------------------------------------------------------------------------- evaluate


def _sq(x: torch.Tensor) -> float:
    """Sum of squares, accumulated in float64 without a float64 copy of x."""
    return float(_sq_tensor(x))


def _sq_tensor(x: torch.Tensor) -> torch.Tensor:
    """_sq as a float64 tensor (no host sync)."""
    return torch.linalg.vector_norm(x, dtype=torch.float64) ** 2


def _quantile(values: np.ndarray, q: float) -> float:
    return float(np.quantile(values, q)) if values.size else float("nan")


def _ppl(nll_sum: float, count: int) -> float:
    return math.exp(nll_sum / count) if count else float("nan")


@dataclass
class _Tally:
    """Everything evaluate() accumulates over batches, and the result dict built from it. The
    whole-model and the streaming evaluation feed it the same per-batch quantities."""

    layers: list
    num_experts: int
    expert_errors: bool
    grouped: bool | None = None  # per-expert errors grouped (expert_errors); None: on an accelerator only
    kl_all: list = field(default_factory=list)
    dom_all: list = field(default_factory=list)
    top1_same: int = 0
    positions: int = 0
    nll: dict = field(default_factory=lambda: {"ref": defaultdict(float), "q": defaultdict(float)})
    nll_count: dict = field(default_factory=lambda: defaultdict(int))
    top1_dom: dict = field(default_factory=lambda: defaultdict(int))
    pos_dom: dict = field(default_factory=lambda: defaultdict(int))
    route_tokens: int = 0
    route_tokens_dom: dict = field(default_factory=lambda: defaultdict(int))

    def __post_init__(self):
        L, E = len(self.layers), self.num_experts
        self.route_same = {layer: 0 for layer in self.layers}
        self.route_same_dom = defaultdict(lambda: {layer: 0 for layer in self.layers})
        self.block_sq = {
            layer: [0.0, 0.0, 0.0] for layer in self.layers
        }  # |Δ|² (ref input), |Δ|² (own input), |y_ref|²
        self.routed = torch.zeros(L, E, dtype=torch.int64)
        self.exp_sq = torch.zeros(L, E, dtype=torch.float64)
        self.exp_ref_sq = torch.zeros(L, E, dtype=torch.float64)

    def add_tokens(self, doms: list, T: int) -> None:
        """Count one batch's positions for routing (once per batch, before its layers)."""
        self.route_tokens += len(doms) * T
        for d in doms:
            if d is not None:
                self.route_tokens_dom[d] += T

    def add_logits(self, ids: torch.Tensor, doms: list, ref_logits: torch.Tensor, q_logits: torch.Tensor) -> None:
        B, T = ids.shape
        if ref_logits.shape != q_logits.shape:
            raise UserError(
                f"the two models' logits differ in shape ({list(ref_logits.shape)} vs "
                f"{list(q_logits.shape)}); they must share one vocabulary."
            )
        targets = torch.full((B, T), -100, dtype=torch.long)
        targets[:, :-1] = ids[:, 1:]
        kl, same, nr, nq = token_statistics(
            ref_logits.reshape(B * T, -1), q_logits.reshape(B * T, -1), targets.reshape(-1)
        )
        self.kl_all.append(kl)
        self.dom_all.extend(d for d in doms for _ in range(T))
        self.top1_same += int(same.sum())
        self.positions += B * T
        for b, d in enumerate(doms):
            sl = slice(b * T, (b + 1) * T)
            has = ~torch.isnan(nr[sl])
            for key in (None, d) if d is not None else (None,):
                self.nll["ref"][key] += float(nr[sl][has].sum())
                self.nll["q"][key] += float(nq[sl][has].sum())
                self.nll_count[key] += int(has.sum())
            if d is not None:
                self.top1_dom[d] += int(same[sl].sum())
                self.pos_dom[d] += T

    def add_moe_layer(self, li: int, L: int, adapter, ref_model, q_model, ref_cap, q_cap, doms: list, T: int) -> None:
        """One batch of MoE layer L: routing agreement, block errors, per-expert errors. `ref_model` /
        `q_model` hold layer L (with weights) and ref_cap / q_cap its captures for this batch."""
        r_idx = ref_cap.indices[L]
        q_idx = q_cap.indices[L].to(r_idx.device)
        equal = (r_idx.sort(-1).values == q_idx.sort(-1).values).all(-1).cpu()
        self.route_same[L] += int(equal.sum())
        for b, d in enumerate(doms):
            if d is not None:
                self.route_same_dom[d][L] += int(equal[b * T : (b + 1) * T].sum())
        self.routed[li] += torch.bincount(r_idx.reshape(-1).cpu(), minlength=self.num_experts)[: self.num_experts]

        y_ref = ref_cap.outputs[L].float()
        y_own = q_cap.outputs[L].to(y_ref.device).float()
        x_ref = ref_cap.inputs[L]
        q_block = _moe_block(q_model, adapter, L)
        x_q = _block_input_for(q_model, adapter, L, ref_cap.pre_norm.get(L), x_ref)
        q_cap.active = False  # the second run on the reference input must not overwrite captures
        args, kwargs = q_cap.extra.get(L, ((), {}))
        try:
            y_q = q_block(x_q.to(next(q_block.parameters()).device), *args, **kwargs)
        finally:
            q_cap.active = True
        y_q = (y_q[0] if isinstance(y_q, tuple) else y_q).reshape(-1, y_ref.shape[-1]).to(y_ref.device).float()
        self.block_sq[L][0] += _sq(y_q - y_ref)
        self.block_sq[L][1] += _sq(y_own - y_ref)
        self.block_sq[L][2] += _sq(y_ref)
        if not self.expert_errors:
            return
        x = x_ref.reshape(-1, x_ref.shape[-1])
        grouped = x.device.type != "cpu" if self.grouped is None else self.grouped
        err, ref = expert_output_errors(
            adapter,
            adapter.experts_module(ref_model, L),
            adapter.experts_module(q_model, L),
            x,
            x_q.reshape(-1, x_q.shape[-1]),
            r_idx,
            grouped,
        )
        self.exp_sq[li] += err
        self.exp_ref_sq[li] += ref

    def result(self, samples: int, seconds: float) -> dict:
        kl_values = torch.cat(self.kl_all).numpy()
        dom_arr = np.array([d if d is not None else "" for d in self.dom_all])
        nll, nll_count = self.nll, self.nll_count
        layer_rows = []
        for L in self.layers:
            d_ref, d_own, ref_sq = self.block_sq[L]
            layer_rows.append(
                {
                    "layer": L,
                    "tokens": self.route_tokens,
                    "routing_agreement": self.route_same[L] / self.route_tokens,
                    "moe_output_error": math.sqrt(d_ref / ref_sq) if ref_sq > 0 else float("nan"),
                    "moe_output_error_accumulated": math.sqrt(d_own / ref_sq) if ref_sq > 0 else float("nan"),
                }
            )
        expert_rows = []
        for li, L in enumerate(self.layers):
            total = max(int(self.routed[li].sum()), 1)
            for e in range(self.num_experts):
                n = int(self.routed[li, e])
                has = self.expert_errors and n > 0 and float(self.exp_ref_sq[li, e]) > 0
                expert_rows.append(
                    {
                        "layer": L,
                        "expert": e,
                        "tokens": n,
                        "share": n / total,
                        "error": math.sqrt(float(self.exp_sq[li, e]) / float(self.exp_ref_sq[li, e])) if has else None,
                        "sq_error_per_token": float(self.exp_sq[li, e]) / n if (self.expert_errors and n > 0) else None,
                    }
                )
        by_domain = {}
        for d in sorted({d for d in self.dom_all if d is not None}):
            sel = kl_values[dom_arr == d]
            by_domain[d] = {
                "tokens": self.pos_dom[d],
                "ppl_original": _ppl(nll["ref"][d], nll_count[d]),
                "ppl_quantized": _ppl(nll["q"][d], nll_count[d]),
                "kl_mean": float(sel.mean()),
                "kl_p99": _quantile(sel, 0.99),
                "top1_agreement": self.top1_dom[d] / self.pos_dom[d],
                "routing_agreement": float(
                    np.mean([self.route_same_dom[d][L] / self.route_tokens_dom[d] for L in self.layers])
                ),
            }
        mean = lambda xs: float(np.mean(xs)) if xs else float("nan")  # noqa: E731
        return {
            "samples": samples,
            "tokens": self.positions,
            "ppl_original": _ppl(nll["ref"][None], nll_count[None]),
            "ppl_quantized": _ppl(nll["q"][None], nll_count[None]),
            "nll_original": nll["ref"][None] / nll_count[None],
            "nll_quantized": nll["q"][None] / nll_count[None],
            "kl_mean": float(kl_values.mean()),
            "kl_p90": _quantile(kl_values, 0.90),
            "kl_p99": _quantile(kl_values, 0.99),
            "kl_max": float(kl_values.max()),
            "top1_agreement": self.top1_same / self.positions,
            "routing_agreement": mean([r["routing_agreement"] for r in layer_rows]),
            "moe_output_error": mean([r["moe_output_error"] for r in layer_rows]),
            "moe_output_error_accumulated": mean([r["moe_output_error_accumulated"] for r in layer_rows]),
            "layers": layer_rows,
            "experts": expert_rows,
            "by_domain": by_domain,
            "seconds": seconds,
        }


def _same_structure(adapter, q_adapter) -> None:
    if (q_adapter.moe_layers, q_adapter.num_experts, q_adapter.top_k) != (
        adapter.moe_layers,
        adapter.num_experts,
        adapter.top_k,
    ):
        raise UserError(
            "the quantized model's MoE structure (layers, experts, top-k) differs from the reference model's; "
            "compare a checkpoint with the model it was made from."
        )


def _check_batch_size(batch_size) -> None:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"batch_size must be a positive integer, got {batch_size!r}.")


def evaluate(
    reference_model,
    quantized_model,
    samples,
    batch_size: int = 4,
    per_expert: bool = True,
    progress: bool = False,
    grouped: bool | None = None,
) -> dict:
    """Compare `quantized_model` with `reference_model` (transformers causal LMs, already loaded,
    eval mode) on `samples` (moequant.measure.data Samples, 1-D token tensors, or a [N, T] tensor).

    Returns a plain dict (JSON-ready); keys are described in the module docstring and below:
    tokens, samples, ppl_original, ppl_quantized, nll_original, nll_quantized, kl_mean, kl_p90,
    kl_p99, kl_max, top1_agreement, routing_agreement, moe_output_error,
    moe_output_error_accumulated, layers [{layer, routing_agreement, moe_output_error,
    moe_output_error_accumulated, tokens}], experts [{layer, expert, tokens, share, error,
    sq_error_per_token}], by_domain {domain: {...}}, seconds.

    This whole-model version is the reference implementation of `evaluate_streaming`, which
    computes the same numbers from checkpoints one decoder layer at a time. `grouped`: the per-expert
    errors by grouped matmuls (True) or one expert at a time (False); None: grouped on an accelerator.
    """
    _check_batch_size(batch_size)
    adapter = _adapter(reference_model)
    _same_structure(adapter, _adapter(quantized_model))
    windows = _as_windows(samples)
    layers = list(adapter.moe_layers)
    expert_errors = per_expert and all(
        _has_fused_experts(m, adapter, L) for m in (reference_model, quantized_model) for L in layers
    )
    tally = _Tally(layers, adapter.num_experts, expert_errors, grouped)
    ref_cap = _Capture(reference_model, adapter, keep_inputs=True)
    q_cap = _Capture(quantized_model, adapter, keep_inputs=False)

    batches = list(_batches(windows, batch_size))
    it = batches
    if progress:
        from rich.progress import track

        it = track(batches, description="evaluating", total=len(batches))
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            for idx in it:
                ids = torch.stack([windows[i][0] for i in idx])
                doms = [windows[i][1] for i in idx]
                ref_cap.clear()
                q_cap.clear()
                ref_logits = reference_model(input_ids=ids.to(_input_device(reference_model)), use_cache=False).logits
                q_logits = quantized_model(input_ids=ids.to(_input_device(quantized_model)), use_cache=False).logits
                tally.add_logits(ids, doms, ref_logits, q_logits)
                del ref_logits, q_logits
                tally.add_tokens(doms, ids.shape[1])
                for li, L in enumerate(layers):
                    tally.add_moe_layer(
                        li, L, adapter, reference_model, quantized_model, ref_cap, q_cap, doms, ids.shape[1]
                    )
                ref_cap.clear()
                q_cap.clear()
    finally:
        ref_cap.remove()
        q_cap.remove()
    return tally.result(len(windows), time.perf_counter() - start)


def _logits(runner, b: int, hidden: torch.Tensor) -> torch.Tensor:
    """The causal LM's head on batch b's last decoder layer output (the decoder's final norm, then lm_head)."""
    head = runner.model.get_output_embeddings()
    # the skeleton keeps its final norm (and a tied head) on the host, an untied head on the device
    # (a decoder's own head, as DeepSeek-V4's and Hunyuan-V4's hyper-connection head, may end in another dtype)
    return head(runner.finish(b, hidden).to(head.weight.device, head.weight.dtype))


def _real_head(runner, adapter) -> None:
    """Make the skeleton's lm_head real (build_skeleton leaves it on the meta device)."""
    from moequant.io.layers import make_head_real

    make_head_real(runner.model, runner.checkpoint, adapter, runner.device, runner.dtype)


def evaluate_streaming(
    reference,
    quantized,
    samples,
    batch_size: int = 4,
    per_expert: bool = True,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
    grouped: bool | None = None,
) -> dict:
    """evaluate()'s numbers from two checkpoints (paths or open Checkpoints), without loading
    either model: both run layer by layer over the evaluation tokens (moequant.io.layers.LayerRunner,
    one decoder layer of each in memory at a time, the quantized one read through its
    dequantizing reader), with the same hooks and the same per-batch arithmetic as evaluate().
    Host memory: two decoder layers, the embedding and head, and both models' hidden states.
    `grouped`: as in evaluate()."""
    from moequant.io.checkpoint import open_checkpoint
    from moequant.io.layers import LayerRunner
    from moequant.io.loader import require_complete

    _check_batch_size(batch_size)
    ref_ckpt = reference if hasattr(reference, "entries") else open_checkpoint(reference)
    q_ckpt = quantized if hasattr(quantized, "entries") else open_checkpoint(quantized)
    adapter, q_adapter = ref_ckpt.adapter, q_ckpt.adapter
    _same_structure(adapter, q_adapter)
    for ckpt, ad in ((ref_ckpt, adapter), (q_ckpt, q_adapter)):
        require_complete(ckpt, ad)
    windows = _as_windows(samples)
    layers = list(adapter.moe_layers)
    by_len: dict[int, list[int]] = defaultdict(list)  # the batches of evaluate(): equal lengths, original order
    for i, (ids, _) in enumerate(windows):
        by_len[ids.numel()].append(i)
    tally = None
    start = time.perf_counter()
    steps = [(length, L) for length in sorted(by_len) for L in range(adapter.num_layers)]
    if progress:
        from rich.progress import Progress

        bar = Progress()
        bar.start()
        task = bar.add_task("evaluating (layer by layer)", total=len(steps))
    try:
        with torch.no_grad():
            for length in sorted(by_len):
                idx = by_len[length]
                ids = torch.stack([windows[i][0] for i in idx])
                doms = [windows[i][1] for i in idx]
                batch_doms = [doms[s : s + batch_size] for s in range(0, len(idx), batch_size)]
                ref_run = LayerRunner(ref_ckpt, adapter, ids, batch_size, device, dtype)
                q_run = LayerRunner(q_ckpt, q_adapter, ids, batch_size, device, dtype)
                if tally is None:
                    expert_errors = per_expert and all(
                        _has_fused_experts(r.model, adapter, L) for r in (ref_run, q_run) for L in layers
                    )
                    tally = _Tally(layers, adapter.num_experts, expert_errors, grouped)
                for d in batch_doms:
                    tally.add_tokens(d, length)
                ref_cap = _Capture(ref_run.model, adapter, keep_inputs=True)
                q_cap = _Capture(q_run.model, q_adapter, keep_inputs=False)
                h_ref, h_q = list(ref_run.embedded), list(q_run.embedded)
                try:
                    for L, (ref_state, q_state) in _layers_read_ahead((ref_run, q_run), adapter):
                        with (
                            ref_run.materialized(L, state=ref_state) as ref_layer,
                            q_run.materialized(L, state=q_state) as q_layer,
                        ):
                            for b in range(len(h_ref)):
                                ref_cap.clear()
                                q_cap.clear()
                                h_ref[b] = ref_run.run(ref_layer, L, b, h_ref[b])
                                h_q[b] = q_run.run(q_layer, L, b, h_q[b])
                                if L in layers:
                                    tally.add_moe_layer(
                                        layers.index(L),
                                        L,
                                        adapter,
                                        ref_run.model,
                                        q_run.model,
                                        ref_cap,
                                        q_cap,
                                        batch_doms[b],
                                        length,
                                    )
                        if progress:
                            bar.advance(task)
                finally:
                    ref_cap.remove()
                    q_cap.remove()
                _real_head(ref_run, adapter)
                _real_head(q_run, q_adapter)
                for b, batch_ids in enumerate(ref_run.batches):
                    tally.add_logits(batch_ids, batch_doms[b], _logits(ref_run, b, h_ref[b]), _logits(q_run, b, h_q[b]))
    finally:
        if progress:
            bar.stop()
    return tally.result(len(windows), time.perf_counter() - start)


def _layers_read_ahead(runs, adapter, ahead: bool | None = None):
    """(L, [each run's layer L state, or None: read when materialized]) for every decoder layer. With `ahead`
    (None: on a GPU with room for a second layer of every run, moequant.memory_budget) the next layer is read and
    decoded while this one computes: the evaluation was bound by reading both models' layers one after the
    other. Its routed experts are read by several threads at once, both models' together (`_read_states`).
    On the host it is not (host memory stays at one layer of each model)."""
    from concurrent.futures import ThreadPoolExecutor

    from moequant import memory_budget as budget

    if ahead is None:
        device = torch.device(runs[0].device)
        one_layer = sum(_layer_bytes(r, adapter) for r in runs)
        ahead = device.type == "cuda" and budget.device_free_bytes(device) >= 3 * one_layer
    if not ahead:
        for L in range(adapter.num_layers):
            yield L, [None] * len(runs)
        return
    with (
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="moequant-eval-read") as reader,
        ThreadPoolExecutor(max_workers=_READ_THREADS, thread_name_prefix="moequant-eval-read-experts") as slices,
    ):

        def read(L):
            return reader.submit(_read_states, runs, adapter, L, slices)

        pending = read(0)
        for L in range(adapter.num_layers):
            states = pending.result()
            if L + 1 < adapter.num_layers:
                pending = read(L + 1)
            yield L, states
            del states


_READ_THREADS = 8  # threads that read and decode one layer's routed experts (both models' at once)


def _read_states(runs, adapter, L: int, pool) -> list:
    """Each run's layer L state (LayerRunner.read_layer). An MoE layer's routed experts, stored one tensor per
    expert, are read first as slices of experts on `pool`'s threads, every run's at once, each slice cast into
    its place in one stack per projection (one thread reading both models expert after expert was the
    evaluation's cost on a GPU), then handed to read_layer, which reads the rest: the same values in the same
    dtype as read_layer reads itself."""
    if L not in adapter.moe_layers or adapter.fused_experts or pool is None:
        return [r.read_layer(L) for r in runs]
    E = adapter.num_experts
    step = max(1, -(-E // _READ_THREADS))

    def fill(r, p, stack, part, device):
        stack[part.start : part.stop] = r.adapter.read_experts(r.checkpoint, L, p, part, device, r.dtype)

    stacks, jobs = [], []
    for r in runs:
        device = r.device if torch.device(r.device).type == "cuda" else None  # as read_layer: decoded there
        mine = {}
        for p in adapter.projections:
            mine[p] = torch.empty((E,) + tuple(adapter.expert_shape(p)), dtype=r.dtype, device=device)
            for lo in range(0, E, step):
                jobs.append(pool.submit(fill, r, p, mine[p], range(lo, min(E, lo + step)), device))
        stacks.append(mine)
    for job in jobs:
        job.result()
    return [r.read_layer(L, experts=mine) for r, mine in zip(runs, stacks)]


def _layer_bytes(run, adapter) -> int:
    """Bytes of the largest decoder layer in the run's compute dtype (its routed experts dominate)."""
    experts = adapter.num_experts * sum(math.prod(adapter.expert_shape(p)) for p in adapter.projections)
    return experts * torch.empty((), dtype=run.dtype).element_size()


# ----------------------------------------------------------------------------- checkpoints


def _is_moequant_checkpoint(directory) -> bool:
    from pathlib import Path

    from moequant.io.checkpoint import EXPORT_INFO

    return (Path(directory) / EXPORT_INFO).exists()


def load_quantized(path, dtype=None, device: str = "cpu"):
    """A quantized checkpoint as a dense transformers model: moequant's loader first (any checkpoint
    moequant wrote, and the compressed-tensors / GPTQ / AWQ / FP8 / MXFP4 layouts it reads), else
    transformers' own loading (e.g. an llm-compressor checkpoint with `Linear` targets, decompressed)."""
    from moequant.io.checkpoint import resolve_model_path

    directory = resolve_model_path(path)  # not opened here: a format moequant cannot read goes to transformers
    directory = directory if directory.is_dir() else directory.parent
    try:
        from moequant.io.loader import load
    except ImportError:  # pragma: no cover - the loader is part of the package
        load = None
    first_error = None
    if load is not None:
        try:
            return load(directory, dtype=dtype, device=device)
        except UserError as e:
            if _is_moequant_checkpoint(directory):
                raise  # moequant wrote it: its loader's word is final
            first_error = e
    from moequant.io.loader import from_pretrained_complete

    try:
        model = from_pretrained_complete(directory, dtype or "auto").to(device)
    except UserError:
        raise
    except Exception as e:
        raise UserError(
            f"cannot load {path} as a quantized model: moequant's loader said "
            f'"{first_error}" and transformers failed with {type(e).__name__}: {e}'
        ) from None
    return model.eval()


def evaluate_checkpoints(
    checkpoint,
    reference,
    dataset: str = "builtin:mix",
    samples: int = 64,
    seq_len: int = 512,
    seed: int = 0,
    batch_size: int = 4,
    device: str | None = None,
    dtype=None,
    lm_eval_tasks: list[str] | None = None,
    progress: bool = True,
) -> dict:
    """`moequant eval CHECKPOINT --reference ORIGINAL`: evaluate on the evaluation split of `dataset`
    (tokenised with the reference's tokenizer). Returns evaluate()'s dict plus `checkpoint`,
    `reference`, `dataset`, `seq_len`, `seed` and, when asked, `lm_eval`.

    Streamed (evaluate_streaming: neither model is loaded whole) whenever moequant reads the
    checkpoint; whole models only for lm-eval tasks, or for a checkpoint only transformers reads.
    A quantized reference (an FP8 / INT4 / MXFP4 source) is its dequantized weights. dtype:
    the compute dtype, by default the reference's config dtype (bf16 for most models)."""
    from moequant.io.checkpoint import model_dtype, open_checkpoint
    from moequant.io.fingerprint import check_checkpoint_in_run
    from moequant.measure.data import load_samples

    check_checkpoint_in_run(checkpoint)  # OUTPUT/checkpoint swapped in from another run: say so, evaluate nothing
    if lm_eval_tasks:
        _require_lm_eval()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    ref_ckpt = open_checkpoint(reference)
    tokenizer = ref_ckpt.tokenizer
    windows = load_samples(dataset, tokenizer, samples, seq_len, split="evaluation", seed=seed)
    q_ckpt = None if lm_eval_tasks else _readable(checkpoint)
    if q_ckpt is not None:
        result = evaluate_streaming(
            ref_ckpt,
            q_ckpt,
            windows,
            batch_size=batch_size,
            device=device,
            dtype=dtype or model_dtype(ref_ckpt.config),
            progress=progress,
        )
    else:
        ref_model = _load_reference(ref_ckpt, dtype, device)
        q_model = load_quantized(checkpoint, dtype=dtype, device=device)
        result = evaluate(ref_model, q_model, windows, batch_size=batch_size, progress=progress)
    result.update(
        {
            "checkpoint": str(checkpoint),
            "reference": str(reference),
            "dataset": dataset,
            "seq_len": seq_len,
            "seed": seed,
        }
    )
    if lm_eval_tasks:
        result["lm_eval"] = {
            "original": run_lm_eval(ref_model, tokenizer, lm_eval_tasks, batch_size),
            "quantized": run_lm_eval(q_model, tokenizer, lm_eval_tasks, batch_size),
        }
    return result


def _readable(checkpoint):
    """The checkpoint opened through moequant's reader, or None when only transformers might read it
    (a format moequant does not read, in a checkpoint moequant did not write)."""
    from moequant.io.checkpoint import open_checkpoint, resolve_model_path
    from moequant.io.loader import gguf_export_file

    if gguf_export_file(checkpoint) is not None:  # a GGUF export: moequant.load reads it whole (gguf-py)
        return None
    try:
        return open_checkpoint(checkpoint)
    except UserError:
        directory = resolve_model_path(checkpoint)
        if _is_moequant_checkpoint(directory if directory.is_dir() else directory.parent):
            raise
        return None


def _load_reference(ref_ckpt, dtype, device):
    from moequant.io.loader import from_pretrained_complete, load

    if ref_ckpt.encodings:  # a quantized source: the reference is its dequantized weights
        return load(ref_ckpt.directory, dtype=dtype, device=device)
    return from_pretrained_complete(ref_ckpt.directory, dtype or "auto").to(device).eval()


def format_quality(q: dict) -> str:
    """Human-readable text of evaluate()'s dict (what `moequant eval` prints)."""
    lines = [
        f"{q['samples']} samples, {q['tokens']} tokens"
        + (f" of {q['dataset']} (evaluation split)" if q.get("dataset") else ""),
        f"perplexity        {q['ppl_original']:.4f} -> {q['ppl_quantized']:.4f}"
        f" ({100 * (q['ppl_quantized'] / q['ppl_original'] - 1):+.2f}%)",
        f"KL per token      mean {q['kl_mean']:.4g}  p90 {q['kl_p90']:.4g}  p99 {q['kl_p99']:.4g}  max {q['kl_max']:.4g}",
        f"top-1 agreement   {q['top1_agreement']:.4f}",
        f"routing agreement {q['routing_agreement']:.4f} (mean over MoE layers; lowest "
        + (f"{min(r['routing_agreement'] for r in q['layers']):.4f}" if q["layers"] else "-")
        + ")",
        f"MoE-block error   {q['moe_output_error']:.4g} on the reference input, "
        f"{q['moe_output_error_accumulated']:.4g} on its own",
    ]
    for d, v in q.get("by_domain", {}).items():
        lines.append(
            f"  {d:<14} ppl {v['ppl_original']:.3f} -> {v['ppl_quantized']:.3f}  KL {v['kl_mean']:.4g}"
            f"  top-1 {v['top1_agreement']:.4f}  routing {v['routing_agreement']:.4f}"
        )
    for name, scores in (q.get("lm_eval") or {}).items():
        lines.append(f"lm-eval {name}: " + ", ".join(f"{t} {s}" for t, s in scores.items()))
    return "\n".join(lines)


def _require_lm_eval():
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(
            "lm-eval tasks were asked for but lm_eval is not installed; install lm-eval "
            "(pip install lm-eval) in the environment that runs moequant, or leave out the tasks."
        ) from None


def run_lm_eval(model, tokenizer, tasks: list[str], batch_size: int = 4) -> dict:
    """Scores of lm-eval `tasks` for an already-loaded model (only when lm_eval is importable)."""
    _require_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    out = simple_evaluate(model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size), tasks=list(tasks))
    return {
        task: {k: v for k, v in scores.items() if isinstance(v, (int, float))}
        for task, scores in out["results"].items()
    }
