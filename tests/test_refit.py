"""The scale refit (moequant.algorithms.refit) against an independent float64 least-squares solve."""

from __future__ import annotations

import pytest
import torch

from moequant import formats
from moequant.algorithms.gptq import gptq
from moequant.algorithms.refit import refit_scales
from moequant.errors import UserError


def _problem(experts=3, rows=16, cols=128, tokens=512, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(experts, rows, cols, generator=gen, dtype=torch.float64)
    mix = torch.eye(cols, dtype=torch.float64) + 0.4 * torch.randn(cols, cols, generator=gen, dtype=torch.float64) / cols**0.5
    x = torch.randn(experts, tokens, cols, generator=gen, dtype=torch.float64) @ mix + 0.3  # inputs with a mean
    return w, x


def _output_error(q, w, x):
    """sum over experts, tokens and rows of the squared output error, from the inputs themselves."""
    return float(((x @ (w - q.dequantize(torch.float64)).transpose(1, 2)) ** 2).sum())


@pytest.mark.parametrize("key", ["int4-g32-sym", "int4-g32-asym", "int3-g64-asym"])
def test_refit_scales_are_the_least_squares_scales_of_the_codes(key):
    w, x = _problem()
    h = x.transpose(1, 2) @ x
    q, _ = gptq(w.float(), h.float(), key, act_order=True, static_groups=True, grid="searched")
    refit = refit_scales(q, w.float(), h.float())
    assert torch.equal(refit.codes, q.codes) and (q.zeros is None or torch.equal(refit.zeros, q.zeros))
    assert refit.scales.dtype == torch.bfloat16 and refit.scales.shape == q.scales.shape
    # independent reference: per row, lstsq of the row's outputs X w on the group features X c_g
    spec = formats.parse_key(key)
    gs = spec.group_size
    c = q.codes.to(torch.float64)
    if q.zeros is not None:
        c = c - q.zeros.to(torch.float64).repeat_interleave(gs, dim=-1)
    groups = w.shape[-1] // gs
    agree = changed = 0
    for e in range(w.shape[0]):
        for r in range(w.shape[1]):
            feats = torch.stack([x[e][:, g * gs:(g + 1) * gs] @ c[e, r, g * gs:(g + 1) * gs] for g in range(groups)], 1)
            best = torch.linalg.lstsq(feats, x[e] @ w[e, r]).solution
            if not torch.equal(refit.scales[e, r], q.scales[e, r]):
                changed += 1
                agree += bool(torch.equal(refit.scales[e, r], best.to(torch.bfloat16)))
    assert changed > 0.8 * w.shape[0] * w.shape[1]
    assert agree == changed  # every changed row holds the bf16 of the exact least-squares scales
    assert _output_error(refit, w, x) < _output_error(q, w, x)


def test_refit_never_worsens_a_row_and_keeps_dead_groups():
    w, x = _problem(experts=1, rows=8, cols=64)
    w[0, :, :32] = 0.0  # a dead group: all codes zero
    h = x.transpose(1, 2) @ x
    q = formats.quantize(w[0].float(), "int4-g32-sym")  # RTN codes, a single [out, in] matrix
    refit = refit_scales(q, w[0].float(), h[0].float())
    assert torch.equal(refit.scales[:, 0], q.scales[:, 0])
    for r in range(8):
        one = lambda t: ((x[0] @ (w[0, r] - t.dequantize(torch.float64)[r])) ** 2).sum()  # noqa: E731
        assert one(refit) <= one(q)


def test_refit_refuses_non_integer_formats():
    w, x = _problem(experts=1, rows=4, cols=64)
    with pytest.raises(UserError, match="integer group formats, not mxfp4"):
        refit_scales(formats.quantize(w[0].float(), "mxfp4"), w[0].float(), (x[0].T @ x[0]).float())


def test_refit_in_expert_chunks_equals_the_whole_batch():
    """The refit's chunks (sized from the memory budget) split experts only: one expert at a time gives
    exactly the scales of all experts in one batch."""
    w, x = _problem(experts=4, rows=12, cols=128)
    h = x.transpose(1, 2) @ x
    q, _ = gptq(w.float(), h.float(), "int4-g32-sym", act_order=True, static_groups=True, grid="searched")
    whole = refit_scales(q, w.float(), h.float())
    one_by_one = refit_scales(q, w.float(), h.float(), budget_bytes=1)
    assert torch.equal(whole.scales, one_by_one.scales)
    assert not torch.equal(whole.scales, q.scales)
