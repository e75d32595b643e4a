"""The per-layer statistics collector: hooks on a MoE layer's router and experts that sum, per expert, the routing
(real top-k hits, weights, ranks, per domain), the inputs' statistics and Hessians of gate/up and down (over
every token with all-experts coverage, and over the routed tokens apart) and REAP's saliency; `finish` turns the
sums into the per-expert statistics measure.stats documents. Calibration and the quantize pass both use it."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from moequant.errors import UserError
from moequant.measure.saliency import REAP, REAP_SUM, accumulate_reap, reap_scores
from moequant.measure.settings import HESSIAN_WEIGHTINGS


@dataclass
class LayerCollector:
    """Accumulates one MoE layer's statistics from its router and experts hooks.

    Everything is computed and accumulated on the device the layer runs on (no host copies
    inside a layer; `finish` hands back device tensors). The experts' own inputs are taken from
    the experts module's pre-hook, so the statistics do not depend on which experts
    implementation (eager loop, batched_mm, grouped_mm) runs the layer's forward. Sums are
    float64 on the CPU (exact tests) and float32 on accelerators (one batch adds at most a few
    thousand terms per entry); products of bf16 activations run in TF32, which is exact for
    bf16-valued inputs (8 mantissa bits fit TF32's 10)."""

    adapter: object
    experts_module: object
    num_experts: int
    top_k: int
    domains: list[str]
    all_experts: bool
    hessians: bool
    token_domains: torch.Tensor | None = None  # domain index per token of the current batch
    tokens: int = 0
    t: dict = field(default_factory=dict)
    _routing: tuple | None = None
    # the experts' statistics cover experts [first_expert, first_expert + chunk_experts) only (all by
    # default): per-expert tensors are indexed from first_expert, so a layer's Hessians can be
    # built, used and freed one chunk of experts at a time (bounded device memory)
    first_expert: int = 0
    chunk_experts: int | None = None
    hessian_weighting: str = "tokens"  # HESSIAN_WEIGHTINGS
    # each expert's routed statistics from its own tokens: one Python step per expert (the CPU: exact,
    # today's float64 sums), or, where per-expert launches cost more than the math (a GPU: 128-256
    # experts x ~25 launches per batch), several experts at once by batched matmuls over their tokens
    # padded to the group's largest count (padding rows are zero and masked, adding nothing). None: by device
    grouped: bool | None = None
    # the experts (bool per local expert) whose all-tokens down statistics are computed when `all_experts`; None:
    # every expert. The quantize pass reads an expert's all-tokens Hessian only when it has fewer than
    # min_tokens routed tokens (stats.chosen_hessian), and pushing every token through every expert is most
    # of a layer's statistics: it asks for those experts alone. The others' all-tokens down rows stay zero.
    all_tokens_experts: list[bool] | None = None
    reap: bool = False  # REAP's saliency of each expert (measure.saliency), from its routed tokens' outputs
    _gates: torch.Tensor | None = None  # the current batch's router weight per sorted token-expert pair

    @property
    def local_experts(self) -> int:
        return self.chunk_experts if self.chunk_experts is not None else self.num_experts - self.first_expert

    def add_batch(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """The experts' statistics of one recorded batch (MoE-block input x, router's top-k indices
        and, for routing-weighted Hessians, its top-k weights)."""
        if weights is None and self.hessians and self.hessian_weighting != "tokens":
            raise ValueError(f"hessian_weighting={self.hessian_weighting!r} needs the batch's routing weights")
        self._routing = (indices.reshape(-1, self.top_k), None if weights is None else weights.reshape(-1, self.top_k))
        self.on_experts(None, (x,), {})

    def _zeros(self, key, shape, dtype, device):
        if key not in self.t:
            self.t[key] = torch.zeros(shape, dtype=dtype, device=device)
        return self.t[key]

    def on_router(self, module, args, output):
        _, weights, indices = output
        indices = indices.reshape(-1, self.top_k)
        weights = weights.reshape(-1, self.top_k).detach()
        E, dev = self.num_experts, indices.device
        acc = torch.float64 if dev.type == "cpu" else torch.float32
        self.tokens += indices.shape[0]
        flat = indices.reshape(-1)
        # a choice of a weightless zero expert (index >= E, LongCat-Flash) counts nowhere: bincount's tail is
        # cut off, and its weight is added as 0 to the last expert
        real = flat < E
        self._zeros("routing.count", E, torch.int64, dev).add_(torch.bincount(flat, minlength=E)[:E])
        self._zeros("routing.weight_sum", E, torch.float64, dev).index_add_(
            0, flat.clamp(max=E - 1), (weights.reshape(-1) * real).to(acc).to(torch.float64)
        )
        # rank = position of the choice when the token's weights are sorted high to low
        order = torch.argsort(weights.float(), dim=1, descending=True, stable=True)
        ranked = torch.gather(indices, 1, order)
        rank_count = self._zeros("routing.rank_count", (E, self.top_k), torch.int64, dev)
        for r in range(self.top_k):
            rank_count[:, r] += torch.bincount(ranked[:, r], minlength=E)[:E]
        for d in self.domains:
            self._zeros(f"routing.count.{d}", E, torch.int64, dev)
        if self.domains:
            token_domains = self.token_domains.to(dev)
            for di, d in enumerate(self.domains):
                sel = indices[token_domains == di]
                self.t[f"routing.count.{d}"] += torch.bincount(sel.reshape(-1), minlength=E)[:E]
        self._routing = (indices, weights)

    def _acc(self, key: str, value: torch.Tensor) -> None:
        if key in self.t:
            self.t[key] += value
        else:
            self.t[key] = value.clone()

    def _acc_max(self, key: str, value: torch.Tensor) -> None:
        self.t[key] = torch.maximum(self.t[key], value) if key in self.t else value.clone()

    def on_experts(self, module, args, kwargs):
        """Accumulate the experts' input statistics for one batch, all experts at once.

        Token-expert pairs are sorted by expert once per batch (one host sync for the counts);
        each expert's routed statistics then come from its contiguous slice."""
        x = (args[0] if args else kwargs["hidden_states"]).detach()
        x = x.reshape(-1, x.shape[-1])
        indices, routing_weights = self._routing
        E, n, d, dev = self.local_experts, x.shape[0], x.shape[1], x.device
        acc = torch.float64 if dev.type == "cpu" else torch.float32
        flat = indices.reshape(-1)
        pair = torch.arange(flat.numel(), device=dev)
        # this chunk's experts only, numbered from first_expert (and never a router's zero experts)
        if E < self.num_experts or self.adapter.router_choices > self.num_experts:
            keep = (flat >= self.first_expert) & (flat < self.first_expert + E)
            flat, pair = flat[keep] - self.first_expert, pair[keep]
        order = torch.argsort(flat, stable=True)
        token_of_pair = pair[order] // self.top_k
        expert_of_pair = flat[order]
        coef = self._hessian_coefficients(routing_weights, pair[order])  # per sorted pair, or None
        if self.reap:
            self._zeros(REAP_SUM, E, torch.float64, dev)
            self._gates = None if routing_weights is None else routing_weights.reshape(-1)[pair[order]]
        counts = torch.bincount(flat, minlength=E)
        offsets = [0] + torch.cumsum(counts, 0).tolist()  # the one host sync of the batch
        xf = x.float()
        with _tf32_for(x):
            x_sorted = xf[token_of_pair]
            # gate/up input: the layer's normalised hidden state, identical for every expert
            if self.all_experts:
                self._acc("input.gate_up.tokens_all", torch.tensor(n, dtype=torch.int64, device=dev))
                self._acc("input.gate_up.sqsum_all", (xf.to(acc) ** 2).sum(0).double())
                self._acc("input.gate_up.abssum_all", xf.abs().to(acc).sum(0).double())  # AWQ's channel magnitude
                self._acc_max("input.gate_up.absmax_all", xf.abs().amax(0))
                if self.hessians:
                    self._acc("hessian_sum.gate_up_all", xf.T @ xf)
            self._acc("input_routed.gate_up.tokens", counts)
            self._acc("input_routed.down.tokens", counts)
            xs = x_sorted.to(acc)
            self._zeros("input_routed.gate_up.sqsum", (E, d), torch.float64, dev).add_(
                torch.zeros(E, d, dtype=acc, device=dev).index_add_(0, expert_of_pair, xs**2).double()
            )
            self._zeros("input_routed.gate_up.abssum", (E, d), torch.float64, dev).add_(
                torch.zeros(E, d, dtype=acc, device=dev).index_add_(0, expert_of_pair, xs.abs()).double()
            )
            absmax = self._zeros("input_routed.gate_up.absmax", (E, d), torch.float32, dev)
            absmax.scatter_reduce_(0, expert_of_pair[:, None].expand(-1, d), x_sorted.abs(), "amax")
            del xs
            if self.hessians:
                # Σ over each expert's own routed tokens of x xᵀ: [E, d, d]
                h_routed = self._zeros("hessian_sum_routed.gate_up", (E, d, d), torch.float32, dev)
                if self._grouped(dev):
                    for lo, hi, pad, _, pad_coef in _padded_groups(x_sorted, expert_of_pair, offsets, d, coef):
                        h_routed[lo:hi] += pad.transpose(1, 2) @ (
                            pad if pad_coef is None else pad * pad_coef[..., None]
                        )
                        del pad
                else:
                    for e in range(E):
                        if offsets[e + 1] > offsets[e]:
                            seg = x_sorted[offsets[e] : offsets[e + 1]]
                            h_routed[e] += seg.T @ (
                                seg if coef is None else seg * coef[offsets[e] : offsets[e + 1], None]
                            )
                if coef is not None:
                    self._zeros("hessian_coef_sum", E, torch.float64, dev).index_add_(
                        0, expert_of_pair, coef.to(torch.float64)
                    )
            del x_sorted
            if self.all_experts:
                self._acc("input.down.tokens", torch.full((E,), n, dtype=torch.int64, device=dev))
            self._down_statistics(x, token_of_pair, offsets, acc, coef, expert_of_pair)

    def _grouped(self, dev) -> bool:
        return torch.device(dev).type != "cpu" if self.grouped is None else self.grouped

    def _hessian_coefficients(self, routing_weights, pair_sorted):
        """Each sorted token-expert pair's weight c in its expert's routed Hessian (None: all 1)."""
        if not self.hessians or self.hessian_weighting == "tokens":
            return None
        if self.hessian_weighting not in HESSIAN_WEIGHTINGS:
            raise UserError(
                f"hessian_weighting {self.hessian_weighting!r} is not one of {', '.join(HESSIAN_WEIGHTINGS)}."
            )
        if routing_weights is None:
            raise ValueError(f"hessian_weighting={self.hessian_weighting!r} needs the router's weights")
        r = routing_weights.reshape(-1)[pair_sorted].float()
        return r

    def _down_statistics(self, x, token_of_pair, offsets, acc, coef=None, expert_of_pair=None):
        """down_proj's input is each expert's own intermediate activation act(x Wg) * (x Wu):
        over every token (all-experts coverage) in chunks of experts by one batched matmul,
        and over each expert's routed tokens (its slice of the sorted pairs; grouped: several
        experts' padded slices by one batched matmul)."""
        E, n, first = self.local_experts, x.shape[0], self.first_expert
        inter = self.adapter.expert_intermediate
        budget = 2**27 if x.device.type != "cpu" else 2**24  # elements of the [c, n, I] activation chunk
        chunk = max(1, budget // max(n * inter, 1))
        dev = x.device
        with torch.no_grad():
            for lo in range(0, E, chunk):
                ids = list(range(lo, min(E, lo + chunk)))
                full = ids if self.all_tokens_experts is None else [e for e in ids if self.all_tokens_experts[e]]
                if self.all_experts and full:
                    # rows of this chunk's experts: a slice when all of them (every expert: as always), else a list
                    at = slice(lo, lo + len(ids)) if len(full) == len(ids) else full
                    h_all = self.adapter.experts_hidden(
                        self.experts_module, x, [first + e for e in full]
                    ).float()  # [c, n, I]
                    hd = h_all.to(acc)
                    self._zeros("input.down.sqsum", (E, inter), torch.float64, dev)[at] += (hd**2).sum(1).double()
                    self._zeros("input.down.abssum", (E, inter), torch.float64, dev)[at] += hd.abs().sum(1).double()
                    del hd
                    mx = self._zeros("input.down.absmax", (E, inter), torch.float32, dev)
                    mx[at] = torch.maximum(mx[at], h_all.abs().amax(1))
                    if self.hessians:
                        self._zeros("hessian_sum.down", (E, inter, inter), torch.float32, dev)[at] += (
                            h_all.transpose(1, 2) @ h_all
                        )
                elif self.all_experts:  # no expert of the chunk reads them: their rows exist, as zeros
                    self._zeros("input.down.sqsum", (E, inter), torch.float64, dev)
                    self._zeros("input.down.abssum", (E, inter), torch.float64, dev)
                    self._zeros("input.down.absmax", (E, inter), torch.float32, dev)
                    if self.hessians:
                        self._zeros("hessian_sum.down", (E, inter, inter), torch.float32, dev)
                if self._grouped(dev):
                    self._down_routed_grouped(x, token_of_pair, expert_of_pair, offsets, acc, coef, ids)
                    continue
                for j, e in enumerate(ids):
                    rows = token_of_pair[offsets[e] : offsets[e + 1]]
                    # computed from the routed rows alone in both coverage modes, so the routed
                    # statistics do not depend on the mode (bit for bit)
                    he = self.adapter.expert_hidden(self.experts_module, x[rows], first + e).float()
                    if self.reap and self._gates is not None:
                        at = slice(offsets[e], offsets[e + 1])
                        accumulate_reap(
                            self.t[REAP_SUM], self.adapter, self.experts_module, he, [first + e],
                            self._gates[at], expert_of_pair[at],
                        )  # fmt: skip
                    ha = he.to(acc)
                    self._zeros("input_routed.down.sqsum", (E, inter), torch.float64, dev)[e] += (ha**2).sum(0).double()
                    self._zeros("input_routed.down.abssum", (E, inter), torch.float64, dev)[e] += (
                        ha.abs().sum(0).double()
                    )
                    mx = self._zeros("input_routed.down.absmax", (E, inter), torch.float32, dev)
                    if he.shape[0]:
                        mx[e] = torch.maximum(mx[e], he.abs().amax(0))
                    if self.hessians:
                        hw = he if coef is None else he * coef[offsets[e] : offsets[e + 1], None]
                        self._zeros("hessian_sum_routed.down", (E, inter, inter), torch.float32, dev)[e] += he.T @ hw

    def _down_routed_grouped(self, x, token_of_pair, expert_of_pair, offsets, acc, coef, ids) -> None:
        """The routed down statistics of experts `ids` (local numbers, consecutive), a group of
        experts at a time: their tokens padded to [c, m, d], one batched act(x Wg) * (x Wu), padding
        rows masked to zero (an expert bias would make them nonzero)."""
        E, first, dev = self.local_experts, self.first_expert, x.device
        inter = self.adapter.expert_intermediate
        lo_ids, hi_ids = ids[0], ids[-1] + 1
        sel = slice(offsets[lo_ids], offsets[hi_ids])
        local = [o - offsets[lo_ids] for o in offsets[lo_ids : hi_ids + 1]]
        groups = _padded_groups(
            x[token_of_pair[sel]],
            expert_of_pair[sel] - lo_ids,
            local,
            max(x.shape[1], 2 * inter),
            None if coef is None else coef[sel],
        )
        sqsum = self._zeros("input_routed.down.sqsum", (E, inter), torch.float64, dev)
        abssum = self._zeros("input_routed.down.abssum", (E, inter), torch.float64, dev)
        absmax = self._zeros("input_routed.down.absmax", (E, inter), torch.float32, dev)
        hessian = (
            self._zeros("hessian_sum_routed.down", (E, inter, inter), torch.float32, dev) if self.hessians else None
        )
        for lo, hi, pad, mask, pad_coef in groups:
            he = self.adapter.experts_hidden(self.experts_module, pad, [first + lo_ids + e for e in range(lo, hi)])
            he = he.float() * mask[..., None]  # [c, m, I]
            del pad
            if self.reap and self._gates is not None:
                at = slice(offsets[lo_ids + lo], offsets[lo_ids + hi])
                ids_here = [first + lo_ids + e for e in range(lo, hi)]
                accumulate_reap(
                    self.t[REAP_SUM], self.adapter, self.experts_module, he, ids_here,
                    self._gates[at], expert_of_pair[at], mask,
                )  # fmt: skip
            at = slice(lo_ids + lo, lo_ids + hi)
            ha = he.to(acc)
            sqsum[at] += (ha**2).sum(1).double()
            abssum[at] += ha.abs().sum(1).double()
            del ha
            absmax[at] = torch.maximum(absmax[at], he.abs().amax(1))
            if hessian is not None:
                hessian[at] += he.transpose(1, 2) @ (he if pad_coef is None else he * pad_coef[..., None])
            del he, mask

    def finish(self) -> dict[str, torch.Tensor]:
        """Turn sums into the documented per-expert statistics (means, normalised Hessians)."""
        t, E = self.t, self.local_experts
        out = {k: v for k, v in t.items() if k.startswith("routing.")}
        if REAP_SUM in t:
            out[REAP] = reap_scores(t[REAP_SUM], t["input_routed.down.tokens"])
        for group in ("gate_up", "down"):
            n_r = t[f"input_routed.{group}.tokens"]
            out[f"input_routed.{group}.tokens"] = n_r
            out[f"input_routed.{group}.sq_mean"] = t[f"input_routed.{group}.sqsum"] / n_r.clamp_min(1)[:, None]
            out[f"input_routed.{group}.abs_mean"] = t[f"input_routed.{group}.abssum"] / n_r.clamp_min(1)[:, None]
            out[f"input_routed.{group}.absmax"] = t[f"input_routed.{group}.absmax"]
            if self.hessians:
                # a weighted mean of x x^T (the same scale as the unweighted one) when tokens are weighted
                norm = t.get("hessian_coef_sum", n_r)
                norm = torch.where(norm > 0, norm, torch.ones_like(norm)).to(torch.float32)
                out[f"hessian_routed.{group}"] = t[f"hessian_sum_routed.{group}"] / norm[:, None, None]
        if self.all_experts:
            n_all = t["input.gate_up.tokens_all"]
            out["input.gate_up.tokens"] = n_all.repeat(E)
            out["input.gate_up.sq_mean"] = (t["input.gate_up.sqsum_all"] / max(int(n_all), 1)).repeat(E, 1)
            out["input.gate_up.absmax"] = t["input.gate_up.absmax_all"].repeat(E, 1)
            out["input.gate_up.abs_mean"] = (t["input.gate_up.abssum_all"] / max(int(n_all), 1)).repeat(E, 1)
            out["input.down.tokens"] = t["input.down.tokens"]
            out["input.down.sq_mean"] = t["input.down.sqsum"] / t["input.down.tokens"].clamp_min(1)[:, None]
            out["input.down.absmax"] = t["input.down.absmax"]
            out["input.down.abs_mean"] = t["input.down.abssum"] / t["input.down.tokens"].clamp_min(1)[:, None]
            if self.hessians:
                # identical for every expert: stored once, [1, d, d], broadcast by readers
                out["hessian.gate_up"] = (t["hessian_sum.gate_up_all"] / max(int(n_all), 1))[None]
                out["hessian.down"] = t["hessian_sum.down"] / t["input.down.tokens"].clamp_min(1)[:, None, None]
        else:
            for group in ("gate_up", "down"):
                for suffix in ("tokens", "sq_mean", "absmax", "abs_mean"):
                    out[f"input.{group}.{suffix}"] = out[f"input_routed.{group}.{suffix}"].clone()
                if self.hessians:
                    out[f"hessian.{group}"] = out[f"hessian_routed.{group}"].clone()
        return out


@contextmanager
def _tf32_for(x: torch.Tensor):
    """TF32 float32 products while computing statistics of bf16 activations (exact: bf16 values
    fit TF32's mantissa, and the sums stay float32); float32 activations keep full float32."""
    if x.device.type != "cuda" or x.dtype != torch.bfloat16:
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


GROUPED_ELEMENTS = {"cpu": 2**24, "accelerator": 2**27}  # elements of one padded group of experts' rows


def _padded_groups(rows, expert_of_row, offsets: list[int], row_elements: int, coef=None):
    """Consecutive groups of experts [lo, hi) with their rows padded: yields (lo, hi, [hi - lo, m, d]
    rows, [hi - lo, m] mask of real rows, [hi - lo, m] coefficients or None). `rows` are sorted by
    expert, expert e's are rows[offsets[e] : offsets[e + 1]] (`expert_of_row` says whose each is);
    m is the group's largest count; a group holds as many experts as keep c x m x `row_elements`
    within GROUPED_ELEMENTS (one expert at least). Groups without rows are skipped."""
    counts = [offsets[e + 1] - offsets[e] for e in range(len(offsets) - 1)]
    limit = GROUPED_ELEMENTS["cpu" if rows.device.type == "cpu" else "accelerator"]
    starts = torch.tensor(offsets[:-1], device=rows.device)
    lo = 0
    while lo < len(counts):
        hi, m = lo + 1, max(counts[lo], 1)
        while hi < len(counts) and (hi + 1 - lo) * max(m, counts[hi]) * row_elements <= limit:
            m, hi = max(m, counts[hi]), hi + 1
        if offsets[hi] > offsets[lo]:
            sel = slice(offsets[lo], offsets[hi])
            e = expert_of_row[sel]
            at = (e - lo, torch.arange(offsets[lo], offsets[hi], device=rows.device) - starts[e])
            pad = rows.new_zeros(hi - lo, m, rows.shape[1])
            pad[at] = rows[sel]
            mask = rows.new_zeros(hi - lo, m, dtype=torch.float32)
            mask[at] = 1.0
            pad_coef = None
            if coef is not None:
                pad_coef = coef.new_zeros(hi - lo, m)
                pad_coef[at] = coef[sel]
            yield lo, hi, pad, mask, pad_coef
        lo = hi


# ----------------------------------------------------------------------------- the runner
