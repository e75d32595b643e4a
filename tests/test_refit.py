"""The scale refit (moequant.algorithms.refit) against an independent float64 least-squares solve."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moequant import formats
from moequant.algorithms.gptq import gptq
from moequant.algorithms.refit import refit_scales
from moequant.errors import UserError


def _problem(experts=3, rows=16, cols=128, tokens=512, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(experts, rows, cols, generator=gen, dtype=torch.float64)
    mix = (
        torch.eye(cols, dtype=torch.float64)
        + 0.4 * torch.randn(cols, cols, generator=gen, dtype=torch.float64) / cols**0.5
    )
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
            feats = torch.stack(
                [x[e][:, g * gs : (g + 1) * gs] @ c[e, r, g * gs : (g + 1) * gs] for g in range(groups)], 1
            )
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("key", ["int4-g32-sym", "int4-g128-sym", "int4-g64-asym", "int3-g32-asym"])
def test_refit_kernel_normal_equations_against_float64(key):
    """refit_triton's A = [c_g^T H c_h] and b = [c_g^T H w] against float64 (poisoned outputs, rows not a
    multiple of the row tile, outlier channels), and the CUDA refit's scales against the CPU's float64 refit:
    the same bf16 scales except in rows where the two candidates' errors tie within float32 rounding."""
    from moequant.algorithms import refit_triton

    spec = formats.parse_key(key)
    if not refit_triton.usable(spec.bits, spec.group_size, 256, torch.device("cuda")):
        pytest.skip("needs Triton")
    gen = torch.Generator().manual_seed(5)
    e, rows, cols = 3, 72, 256
    w = torch.randn(e, rows, cols, generator=gen) * 0.02
    x = torch.randn(e, 1024, cols, generator=gen) * torch.exp(0.5 * torch.randn(cols, generator=gen))
    x[..., ::32] *= 8.0
    h = x.transpose(1, 2) @ x / 1024
    q, _ = gptq(w, h, key, act_order=True, static_groups=True, grid="searched")
    gs = spec.group_size
    c = q.codes if q.zeros is None else q.codes - q.zeros.repeat_interleave(gs, dim=-1)
    a, b = refit_triton.normal_equations(c.cuda(), w.cuda(), h.cuda(), gs)
    c64 = c.double()
    a64 = torch.einsum(
        "erga,egahb,erhb->ergh",
        c64.view(e, rows, -1, gs),
        h.double().view(e, cols // gs, gs, cols // gs, gs),
        c64.view(e, rows, -1, gs),
    )
    b64 = (c64 * (w.double() @ h.double())).view(e, rows, -1, gs).sum(-1)
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    rel = lambda u, v: ((u.cpu().double() - v).norm() / v.norm()).item()  # noqa: E731
    assert rel(a, a64) < 2e-6 and rel(b, b64) < 2e-6
    gpu = refit_scales(q.to("cuda"), w.cuda(), h.cuda()).scales.cpu()
    cpu = refit_scales(q, w, h).scales
    differ = (gpu != cpu).any(-1)
    assert differ.double().mean().item() < 0.02
    err = lambda s: ((x @ (w - dataclasses.replace(q, scales=s).dequantize()).transpose(1, 2)).double() ** 2).sum(1)  # noqa: E731
    torch.testing.assert_close(err(gpu)[differ], err(cpu)[differ], rtol=1e-4, atol=0)
