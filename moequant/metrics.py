"""Per-token statistics of two models' logits: the KL, top-1 agreement and NLL that evaluation and
the calibration probes both measure (float64, chunked over positions)."""

from __future__ import annotations

import torch

LOGIT_CHUNK_ELEMENTS = 1 << 24  # float64 logits handled at once (128 MiB per temporary)


def token_statistics(ref_logits: torch.Tensor, q_logits: torch.Tensor, targets: torch.Tensor | None = None):
    """Per-position float64 statistics of two logit tensors [N, V] (targets [N], -100 = none).

    Returns (kl [N], top1_equal [N] bool, nll_ref [N], nll_q [N]); NLL is NaN where there is no
    target. Works in chunks so a large vocabulary never needs N x V float64 at once.
    """
    n, v = ref_logits.shape
    chunk = max(1, LOGIT_CHUNK_ELEMENTS // v)
    kl, same, nll_r, nll_q = [], [], [], []
    for s in range(0, n, chunk):
        lp = torch.log_softmax(ref_logits[s : s + chunk].double(), dim=-1)
        lq = torch.log_softmax(q_logits[s : s + chunk].to(lp.device).double(), dim=-1)
        p = lp.exp()
        # tokens the original gives probability 0 (masked logits, -inf) add nothing, not NaN
        kl.append(torch.where(p > 0, p * (lp - lq), 0.0).sum(-1).clamp_min(0).cpu())
        same.append((ref_logits[s : s + chunk].argmax(-1).cpu() == q_logits[s : s + chunk].argmax(-1).cpu()))
        if targets is not None:
            t = targets[s : s + chunk].to(lp.device)
            has = t >= 0
            tt = t.clamp_min(0)[:, None]
            nll_r.append(torch.where(has, -lp.gather(1, tt)[:, 0], torch.nan).cpu())
            nll_q.append(torch.where(has, -lq.gather(1, tt)[:, 0], torch.nan).cpu())
    cat = torch.cat
    if targets is None:
        empty = torch.full((n,), torch.nan, dtype=torch.float64)
        return cat(kl), cat(same), empty, empty.clone()
    return cat(kl), cat(same), cat(nll_r), cat(nll_q)
