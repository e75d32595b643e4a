"""How much each routed expert matters to the calibration workload: the signal for dropping experts (issue 58).

Four per-expert scores, higher = keep, read from one layer's statistics (stats.py):
- `frequency`: the expert's real top-k hits (`routing.count`);
- `weight`: the sum of the router weights it received (`routing.weight_sum`);
- `reap`: REAP's criterion (arXiv 2510.13999), the mean over the tokens routed to the expert of its router
  weight times the L2 norm of its output, g_e(x) * ||f_e(x)||, kept as `saliency.reap`. An expert no token
  chose scores 0;
- `kl`: the measured KL of dropping the expert alone on held-out calibration windows (moequant.measure.drop_probe),
  which `apply`'s prune stage adds as `saliency.drop_kl`: the loss the budget solver weighs drop by.

The calibration collector computes the output norms where it already has each expert's down-projection
input for its routed tokens (`accumulate_reap`), so the extra work is one matmul per routed token and expert.
"""

from __future__ import annotations

import torch

CRITERIA = ("reap", "frequency", "weight", "kl")
REAP_SUM = "saliency.reap_sum"  # the collector's running sum of g * ||f||, per local expert
REAP = "saliency.reap"
DROP_KL = "saliency.drop_kl"  # not in the statistics files: the prune stage adds it from drop_probe.json


def accumulate_reap(sums: torch.Tensor, adapter, experts, hidden: torch.Tensor, ids, gates, local, mask=None) -> None:
    """Add g * ||f_e(x)|| of routed rows into `sums` [E_local] (float64 on the CPU).

    `hidden` is the experts' down-projection input: [n, I] rows of the one expert `ids[0]`, or [c, m, I] rows of
    experts `ids` padded to m, with `mask` [c, m] marking the real ones. `gates` are the router weights of the
    real rows and `local` their local expert numbers, both in row order (a padded batch's real rows, row-major)."""
    if gates is None or gates.numel() == 0:
        return
    down = torch.stack([adapter.expert_from_module(experts, e, "down") for e in ids])  # [c, H, I]
    out = hidden.to(down.dtype) @ (down[0].T if hidden.dim() == 2 else down.transpose(1, 2))
    norms = torch.linalg.vector_norm(out.float(), dim=-1)
    if mask is not None:
        norms = norms[mask.bool()]
    acc = torch.float64 if sums.device.type == "cpu" else torch.float32
    sums.index_add_(0, local, (gates.to(acc) * norms.to(acc)).to(sums.dtype))


def reap_scores(sums: torch.Tensor, routed_tokens: torch.Tensor) -> torch.Tensor:
    """REAP's mean from the collector's sums and each expert's routed token count (0 where none)."""
    return sums.double() / routed_tokens.clamp_min(1).double()


def saliency(tensors: dict[str, torch.Tensor], criterion: str) -> torch.Tensor:
    """[E] float64 scores of one layer's statistics by `criterion` (CRITERIA), higher = more needed."""
    if criterion == "frequency":
        return tensors["routing.count"].double()
    if criterion == "weight":
        return tensors["routing.weight_sum"].double()
    if criterion == "reap":
        return tensors[REAP].double()
    if criterion == "kl":
        return tensors[DROP_KL].double()
    raise ValueError(f"saliency criterion {criterion!r} is not one of {', '.join(CRITERIA)}")
