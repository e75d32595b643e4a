"""GPTQ on CUDA: the fused Triton sweep (moequant.algorithms.gptq_triton) against its torch
definition and against the torch sweep.

Skipped (with the reason shown by `pytest -ra`) without a CUDA device or without Triton; run on
the GPU machine with `python -m pytest -ra tests/test_gptq_cuda.py`.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_layer, output_error

from moequant.algorithms import cholesky, gptq, gptq_triton, rtn
from moequant.algorithms.gpu_math import GpuMath

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(gptq_triton.triton is None, reason="needs Triton (the fused sweep is optional)"),
]


def _block_inputs(c, rows, n, groups, asym, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(c, rows, n, generator=g)
    v = torch.triu(torch.randn(c, n, n, generator=g)) * 0.05 + torch.eye(n) * (1 + torch.rand(c, 1, n, generator=g))
    vd = v.diagonal(dim1=-2, dim2=-1).clone()
    vn = (v / vd[:, None, :]).contiguous()
    scales = (torch.rand(c, rows, groups, generator=g) * 0.4 + 0.05).to(torch.bfloat16).float()
    if not asym:  # symmetric groups' mirrored grids (formats.core.signed_scales): negative scales too
        scales *= torch.where(torch.rand(c, rows, groups, generator=g) < 0.5, -1.0, 1.0)
    scales[0, 0, 0] = 0.0  # an all-zero group: codes are the zero point
    zeros = torch.randint(-3, 3, (c, rows, groups), generator=g).float() if asym else None
    group_idx = torch.randint(0, groups, (c, n), generator=g, dtype=torch.int32)  # act-order-like scatter
    return [t.cuda() if t is not None else None for t in (x, x.clone(), vn, vd, scales, zeros, group_idx)]


@pytest.mark.parametrize("asym,bits", [(False, 4), (True, 4), (False, 8), (True, 3)])
@pytest.mark.parametrize("i1,i2", [(0, 128), (128, 224)])  # a full block and a ragged last block
def test_kernel_equals_its_torch_definition_bit_for_bit(asym, bits, i1, i2):
    c, rows, n = 3, 72, 224  # rows not a multiple of the row tile
    inputs = _block_inputs(c, rows, n, 4, asym, seed=bits + i1)
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    results = []
    for fn in (gptq_triton.sweep_block_reference, gptq_triton.sweep_block):
        x, w0d, vn, vd, scales, zeros, group_idx = [t.clone() if t is not None else None for t in inputs]
        codes = torch.full((c, rows, n), 99, dtype=torch.int8, device="cuda")
        loss = torch.zeros(c, dtype=torch.float64, device="cuda")
        fn(x, w0d, vn, vd, scales, zeros, group_idx, codes, loss, i1, i2, qmin, qmax)
        results.append((codes.cpu(), w0d.cpu(), loss.cpu()))
    (ref_codes, ref_d, ref_loss), (codes, d, loss) = results
    assert torch.equal(codes, ref_codes)  # columns outside i1..i2 untouched (99) in both
    assert torch.equal(d, ref_d)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert (codes[..., i1:i2] >= qmin).all() and (codes[..., i1:i2] <= qmax).all()


def _solve(fused, *args, matmul="fp32", **kwargs):
    q, report = gptq.gptq(*args, gpu_math=GpuMath(triton=fused, update_matmul=matmul), **kwargs)
    assert report.settings["sweep"] == ("triton" if fused else "torch")
    assert report.settings["update_matmul"] == (matmul if fused else "fp32")
    return q, report


@pytest.mark.parametrize("grid", ["minmax", "searched"])
@pytest.mark.parametrize("key,act_order", [("int4-g128-sym", True), ("int4-g64-asym", False), ("int8-channel", True)])
def test_fused_matches_torch_sweep_on_cuda(key, act_order, grid):
    """Same algorithm, different float32 rounding order (V instead of U = V^-1): a few codes may
    flip; held-out error must be as good, and both must be close to a float64 CPU solve.
    (The fused sweep in float32 throughout, gpu_math.update_matmul=fp32; TF32 is tested below.)"""
    w, h, held_out = make_layer(experts=6, out=96, n_in=1024, tokens=3000, seed=11)
    wc, hc = w.cuda(), h.cuda()
    fused, rep_f = _solve(True, wc, hc, key, act_order=act_order, grid=grid)
    torch_sweep, rep_t = _solve(False, wc, hc, key, act_order=act_order, grid=grid)
    exact, _ = gptq.gptq(w.double(), h.double(), key, act_order=act_order, grid=grid)
    if grid == "searched" and key.endswith("-sym"):  # mirrored grids in the fused sweep
        assert bool((fused.scales < 0).any())
    differ_torch = (fused.codes != torch_sweep.codes).float().mean().item()
    differ_exact = (fused.codes.cpu() != exact.codes).float().mean().item()
    differ_torch_exact = (torch_sweep.codes.cpu() != exact.codes).float().mean().item()
    err = {
        name: output_error(w, q.dequantize(torch.float32).cpu(), held_out)
        for name, q in (("fused", fused), ("torch", torch_sweep), ("float64", exact))
    }
    print(
        f"{key} act_order={act_order}: codes differing fused/torch {differ_torch:.2e}, fused/float64 "
        f"{differ_exact:.2e}, torch/float64 {differ_torch_exact:.2e}; held-out error {err}"
    )
    assert differ_exact < 5e-3 and differ_torch < 5e-3
    assert err["fused"] <= err["float64"] * 1.01 and err["fused"] <= err["torch"] * 1.01
    assert torch.equal(fused.scales, torch_sweep.scales)
    for a, b in zip(rep_f.proxy_loss, rep_t.proxy_loss):
        assert abs(a - b) <= 1e-3 * b


@pytest.mark.parametrize(
    "key,act_order",
    [("int4-g128-sym", True), ("int4-g64-asym", False), ("int8-channel", True), ("int3-g128-sym", True)],
)
def test_tf32_updates_as_accurate_as_float32(key, act_order):
    """The default fused sweep (TF32 lazy updates, split-TF32 Cholesky products) against the same
    sweep in float32: held-out error within 0.1%, proxy loss within 0.1%. Codes: a changed rounding
    moves a weight across a rounding boundary now and then, and each flip changes the errors fed to
    all later columns, so flips spread. Measured on an H200: 0.4-0.7% of the codes here (n=1024),
    13% of gate/up codes at the DeepSeek-V3 shape (n=7168; benchmarks/bench_gptq.py), at equal
    held-out error; there float32 itself differs from a float64-factor solve in 7.4% of the codes.
    So codes are held to 98% agreement here, the error to 0.1%."""
    w, h, held_out = make_layer(experts=6, out=96, n_in=1024, tokens=3000, seed=11)
    wc, hc = w.cuda(), h.cuda()
    tf32, rep_t = _solve(True, wc, hc, key, act_order=act_order, matmul="tf32")
    fp32, rep_f = _solve(True, wc, hc, key, act_order=act_order, matmul="fp32")
    assert rep_t.settings["cholesky_matmul"] == "tf32x3" and rep_f.settings["cholesky_matmul"] == "fp32"
    differ = (tf32.codes != fp32.codes).float().mean().item()
    err_t = output_error(w, tf32.dequantize(torch.float32).cpu(), held_out)
    err_f = output_error(w, fp32.dequantize(torch.float32).cpu(), held_out)
    print(
        f"{key} act_order={act_order}: codes differing tf32/fp32 {differ:.2e}; held-out error tf32 {err_t:.6g} "
        f"fp32 {err_f:.6g} ({err_t / err_f - 1:+.3%})"
    )
    assert err_t <= err_f * 1.001
    assert differ < 2e-2
    assert torch.equal(tf32.scales, fp32.scales)
    for a, b in zip(rep_t.proxy_loss, rep_f.proxy_loss):
        assert abs(a - b) <= 1e-3 * b


def test_tf32_setting_restored_and_fp32_forced():
    """The TF32 switch is scoped to GPTQ's products; gpu_math.update_matmul=fp32 gives the float32 path
    (the one _solve asserts the report names), its products made with TF32 off."""
    w, h, _ = make_layer(experts=2, out=32, n_in=1024, tokens=1500, seed=14)
    before = torch.backends.cuda.matmul.fp32_precision
    q, report = _solve(True, w.cuda(), h.cuda(), "int4-g128-sym", act_order=True, matmul="tf32")
    assert torch.backends.cuda.matmul.fp32_precision == before
    _solve(True, w.cuda(), h.cuda(), "int4-g128-sym", act_order=True, matmul="fp32")
    assert torch.backends.cuda.matmul.fp32_precision == before


def test_fused_shared_hessian_and_fallbacks():
    """gate + up through one fused sweep; a zero-token expert gets exactly round-to-nearest."""
    w, h, _ = make_layer(experts=4, out=64, n_in=256, tokens=800, seed=12)
    h[2] = 0
    gate, up = w[:, :24].cuda(), w[:, 24:].cuda()
    (q_gate, q_up), report = gptq.gptq_shared_hessian([gate, up], h.cuda(), "int4-g128-sym", act_order=True)
    assert report.settings["sweep"] == "triton" and report.method == ["gptq", "gptq", "rtn", "gptq"]
    alone, _ = gptq.gptq(gate, h.cuda(), "int4-g128-sym", act_order=True)
    frac = (alone.codes != q_gate.codes).float().mean().item()
    assert frac < 5e-3, frac  # rows are independent; only matmul tiling can round differently
    want = rtn.rtn(w.cuda(), "int4-g128-sym")
    assert torch.equal(q_gate.codes[2], want.codes[2, :24]) and torch.equal(q_up.codes[2], want.codes[2, 24:])


def test_blocked_cholesky_matches_cusolver():
    g = torch.Generator().manual_seed(13)
    x = torch.randn(4, 1500, 1300, generator=g, dtype=torch.float64)
    a = (x.mT @ x / 1500).cuda()
    a[3, 700, 700] = -1.0  # not positive definite from column 701 on
    want, want_info = torch.linalg.cholesky_ex(a)
    got, info = cholesky.blocked_cholesky(a.clone(), 512)
    assert torch.equal(info.cpu(), want_info.cpu().to(info.dtype))
    torch.testing.assert_close(got[:3], want[:3], rtol=0, atol=1e-10)


def test_blocked_cholesky_split_tf32_is_float32_accurate():
    """The split-TF32 products (hi hi^T + hi lo^T + lo hi^T) keep the factor near float32's
    accuracy (plain TF32 is ~1000x worse and made damped Hessians fail), and failures are found."""
    g = torch.Generator().manual_seed(15)
    x = torch.randn(4, 2000, 1300, generator=g, dtype=torch.float64) * torch.exp(torch.randn(1300, generator=g))
    a = x.mT @ x / 2000
    a.diagonal(dim1=-2, dim2=-1).add_(0.01 * a.diagonal(dim1=-2, dim2=-1).mean(-1, keepdim=True))
    a[3, 700, 700] = -1.0
    exact, exact_info = torch.linalg.cholesky_ex(a)
    a32 = a.float().cuda()
    got, info = cholesky.blocked_cholesky(a32.clone(), 512, split=True)
    plain, _ = cholesky.blocked_cholesky(a32.clone(), 512)
    assert info.tolist() == exact_info.tolist() == [0, 0, 0, 701]
    scale = exact[:3].abs().amax()
    err_split = ((got[:3].double().cpu() - exact[:3]).abs().amax() / scale).item()
    err_plain = ((plain[:3].double().cpu() - exact[:3]).abs().amax() / scale).item()
    print(f"blocked Cholesky max error / max |L|: split TF32 {err_split:.2e}, float32 {err_plain:.2e}")
    assert err_split <= max(30 * err_plain, 1e-6)
