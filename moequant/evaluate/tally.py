"""The evaluation's inputs (token windows in batches of equal length) and its accounting (`Tally`): the sums
both evaluations (whole models, streamed) feed batch by batch, and the result dict made from them."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from moequant.errors import UserError
from moequant.evaluate.capture import block_input_for, expert_output_errors, moe_block, sq_tensor
from moequant.metrics import token_statistics


def as_windows(samples) -> list[tuple[torch.Tensor, str | None]]:
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


def equal_length_batches(windows, batch_size: int):
    """Consecutive windows of equal length, at most batch_size at a time (original order kept)."""
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, (ids, _) in enumerate(windows):
        by_len[ids.numel()].append(i)
    for length in sorted(by_len):
        idx = by_len[length]
        for start in range(0, len(idx), batch_size):
            yield idx[start : start + batch_size]


def same_structure(adapter, q_adapter) -> None:
    if (q_adapter.moe_layers, q_adapter.num_experts, q_adapter.top_k) != (
        adapter.moe_layers,
        adapter.num_experts,
        adapter.top_k,
    ):
        raise UserError(
            "the quantized model's MoE structure (layers, experts, top-k) differs from the reference model's; "
            "compare a checkpoint with the model it was made from."
        )


def check_batch_size(batch_size) -> None:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"batch_size must be a positive integer, got {batch_size!r}.")


def _sq(x: torch.Tensor) -> float:
    """Sum of squares, accumulated in float64 without a float64 copy of x."""
    return float(sq_tensor(x))


def _quantile(values: np.ndarray, q: float) -> float:
    return float(np.quantile(values, q)) if values.size else float("nan")


def _ppl(nll_sum: float, count: int) -> float:
    return math.exp(nll_sum / count) if count else float("nan")


@dataclass
class Tally:
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
        q_block = moe_block(q_model, adapter, L)
        x_q = block_input_for(q_model, adapter, L, ref_cap.pre_norm.get(L), x_ref)
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
