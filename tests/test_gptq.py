"""GPTQ batched across experts, against an independent float64 single-matrix GPTQ.

The reference below is the textbook column-by-column GPTQ (no lazy blocks, no batching), with
its inverse Hessian from numpy, written from the paper's equations; the library code is
checked against it code for code, and batched against one-expert-at-a-time.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import make_layer, output_error

from moequant.algorithms import cholesky, gptq, rtn
from moequant.errors import UserError

INT4 = "int4-g32-sym"


# ---------------------------------------------------------------------------------------------
# independent references


def int4_sym_codes(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Symmetric 4-bit codes in [-8, 7]; the value is code * scale."""
    return np.clip(np.round(w / np.where(scale > 0, scale, 1.0)), -8, 7)


def int4_sym_scale(w_group: np.ndarray) -> np.ndarray:
    """Per-row scale of a group, the int4 symmetric format's documented rule: amax / 7.5 in
    float32, stored as bfloat16 (+amax saturates by half a step to code 7, -amax is exact)."""
    amax = np.abs(w_group).max(axis=-1, keepdims=True).astype(np.float32)
    return torch.from_numpy(amax / np.float32(7.5)).to(torch.bfloat16).double().numpy()


def reference_gptq(w, h, group, damp=0.01, static_groups=True, act_order=False):
    """Float64 GPTQ of one [out, in] matrix with symmetric int4 groups -> (codes, scales [out, in/group]).

    q_j = Q(w_j); e_j = (w_j - q_j) / U_jj; w_k -= e_j * U_jk for k > j,
    U = upper Cholesky factor of (H + damp * mean(diag H) * I)^-1.
    """
    w = np.array(w, dtype=np.float64)
    h = np.array(h, dtype=np.float64)
    n = h.shape[0]
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    scales = [int4_sym_scale(w[:, g : g + group]) for g in range(0, n, group)] if static_groups else []
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(n)
    w, h = w[:, order], h[np.ix_(order, order)]
    h = h + damp * np.mean(np.diag(h)) * np.eye(n)
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    codes = np.zeros_like(w)
    for j in range(n):
        if static_groups:
            scale = scales[order[j] // group]
        else:
            if j % group == 0:
                scales.append(int4_sym_scale(w[:, j : j + group]))
            scale = scales[-1]
        codes[:, j : j + 1] = int4_sym_codes(w[:, j : j + 1], scale)
        err = (w[:, j] - codes[:, j] * scale[:, 0]) / u[j, j]
        w[:, j + 1 :] -= np.outer(err, u[j, j + 1 :])
    back = np.empty_like(codes)
    back[:, order] = codes
    return back, np.concatenate(scales, axis=1)


# ---------------------------------------------------------------------------------------------
# data


# ---------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("static_groups,act_order", [(True, False), (False, False), (True, True)])
def test_same_codes_as_float64_reference(static_groups, act_order):
    w, h, _ = make_layer(experts=3, out=16, n_in=128, tokens=400, dtype=torch.float64)
    h[1, 5, :] = 0  # a dead input column in expert 1
    h[1, :, 5] = 0
    q, report = gptq.gptq(w, h, INT4, block_size=64, damp=0.01, static_groups=static_groups, act_order=act_order)
    for e in range(3):
        want_codes, want_scales = reference_gptq(w[e].numpy(), h[e].numpy(), 32, 0.01, static_groups, act_order)
        assert np.array_equal(q.scales[e].double().numpy(), want_scales)
        differ = int((q.codes[e].double().numpy() != want_codes).sum())
        assert differ == 0, f"expert {e}: {differ} of {want_codes.size} codes differ"
    assert report.method == ["gptq"] * 3
    assert report.dead_columns == [0, 1, 0]
    assert torch.all(q.dequantize(torch.float64)[1][:, 5] == 0)


def test_batched_equals_one_by_one():
    w, h, _ = make_layer(experts=5, out=32, n_in=128, tokens=300, seed=1)
    batched, report = gptq.gptq(w, h, INT4, chunk_experts=2, block_size=32)
    for e in range(5):
        alone, _ = gptq.gptq(w[e], h[e], INT4, block_size=32)
        assert torch.equal(batched.dequantize(torch.float32)[e], alone.dequantize(torch.float32))
    assert all(d == 0.01 for d in report.damp)


@pytest.mark.parametrize("key", [INT4, "int4-g32-asym", "mxfp4", "nvfp4", "fp8-block128"])
def test_shared_hessian_rows_equal_separate_calls(key):
    w, h, _ = make_layer(experts=2, out=24, n_in=64, tokens=200, seed=2)
    gate, up = w[:, :8], w[:, 8:]
    (q_gate, q_up), _ = gptq.gptq_shared_hessian([gate, up], h, key, act_order=True)
    assert torch.equal(
        q_gate.dequantize(torch.float32), gptq.gptq(gate, h, key, act_order=True)[0].dequantize(torch.float32)
    )
    assert torch.equal(
        q_up.dequantize(torch.float32), gptq.gptq(up, h, key, act_order=True)[0].dequantize(torch.float32)
    )


@pytest.mark.parametrize("key", [INT4, "mxfp4"])
def test_gptq_beats_rtn_on_held_out_inputs(key):
    w, h, held_out = make_layer(experts=4, out=64, n_in=128, tokens=512, seed=3)
    q_gptq, _ = gptq.gptq(w, h, key)
    q_rtn = rtn.rtn(w, key)
    err_gptq = output_error(w, q_gptq.dequantize(torch.float32), held_out)
    err_rtn = output_error(w, q_rtn.dequantize(torch.float32), held_out)
    assert err_gptq < 0.85 * err_rtn, (err_gptq, err_rtn)


def test_zero_token_experts_fall_back_and_are_reported():
    w, h, _ = make_layer(experts=4, out=16, n_in=64, tokens=200, seed=4)
    h[2] = 0  # no token reached expert 2
    tokens = [200, 3, 0, 200]
    shared = h[[0, 3]].mean(dim=0)

    q, report = gptq.gptq(w, h, INT4, tokens=tokens, min_tokens=16)
    assert report.method == ["gptq", "rtn", "rtn", "gptq"]
    assert "3 calibration tokens" in report.reason[1] and "0 calibration tokens" in report.reason[2]
    assert set(report.fallbacks()) == {1, 2}
    deq = q.dequantize(torch.float32)
    assert torch.isfinite(deq).all()
    want_rtn = rtn.rtn(w, INT4).dequantize(torch.float32)
    assert torch.equal(deq[1], want_rtn[1]) and torch.equal(deq[2], want_rtn[2])

    q2, report2 = gptq.gptq(w, h, INT4, tokens=tokens, min_tokens=16, shared_hessian=shared)
    assert report2.method == ["gptq", "gptq-shared-hessian", "gptq-shared-hessian", "gptq"]
    alone, _ = gptq.gptq(w[2], shared, INT4)
    assert torch.equal(q2.dequantize(torch.float32)[2], alone.dequantize(torch.float32))


def test_all_zero_hessian_without_token_counts_is_caught():
    w, h, _ = make_layer(experts=2, out=16, n_in=64, tokens=100, seed=5)
    h[0] = 0
    q, report = gptq.gptq(w, h, INT4)
    assert report.method == ["rtn", "gptq"] and "all zeros" in report.reason[0]
    assert torch.isfinite(q.dequantize(torch.float32)).all()


def test_singular_hessian_grows_damping():
    w, h, held_out = make_layer(experts=2, out=16, n_in=64, tokens=100, seed=6)
    x = torch.randn(8, 64, dtype=torch.float64)  # 8 tokens: rank 8 of 64
    h[1] = (x.T @ x / 8).float()
    q, report = gptq.gptq(w, h, INT4, damp=0.0)
    assert report.method == ["gptq", "gptq"]
    assert report.damp[1] > 0.0  # exact Cholesky of a rank-8 matrix fails; damping grew
    assert torch.isfinite(q.dequantize(torch.float32)).all()


def test_non_positive_definite_hessian_falls_back_to_rtn():
    w, h, _ = make_layer(experts=2, out=16, n_in=64, tokens=100, seed=7)
    h[0] = -torch.eye(64) * 5  # negative definite: no damping of this size repairs it
    h[0, 0, 0] = 1e3
    q, report = gptq.gptq(w, h, INT4, max_damp_tries=2)
    assert report.method[0] == "rtn" and "Cholesky" in report.reason[0]
    assert torch.equal(q.dequantize(torch.float32)[0], rtn.rtn(w, INT4).dequantize(torch.float32)[0])


def test_bad_arguments_are_user_errors():
    w, h, _ = make_layer(experts=2, out=16, n_in=64, tokens=100, seed=8)
    with pytest.raises(UserError, match="static_groups"):
        gptq.gptq(w, h, INT4, act_order=True, static_groups=False)
    with pytest.raises(UserError, match="Hessian has shape"):
        gptq.gptq(w, h[:, :32, :32], INT4)
    with pytest.raises(UserError, match="tokens has 3 entries"):
        gptq.gptq(w, h, INT4, tokens=[1, 2, 3])


def test_chunk_that_runs_out_of_memory_is_retried_smaller(monkeypatch):
    w, h, _ = make_layer(experts=4, out=16, n_in=64, tokens=200, seed=9)
    want, _ = gptq.gptq(w, h, INT4, chunk_experts=1)
    real = gptq._gptq_chunk

    def fails_on_big_chunks(ws, *args, **kwargs):
        if ws[0].shape[0] > 1:
            raise torch.OutOfMemoryError("simulated")
        return real(ws, *args, **kwargs)

    monkeypatch.setattr(gptq, "_gptq_chunk", fails_on_big_chunks)
    got, report = gptq.gptq(w, h, INT4, chunk_experts=4)
    assert report.settings["chunk_experts"] == 1
    assert torch.equal(got.codes, want.codes) and report.method == ["gptq"] * 4


@pytest.mark.parametrize("key,act_order", [(INT4, False), ("int4-g32-asym", True), ("int8-channel", True)])
def test_reversed_factor_sweep_gives_the_same_codes(monkeypatch, key, act_order):
    """The fused sweep's formulation (GPTQ on V with H = V V^T instead of U = V^-1; see
    gptq_triton), run here through its torch definition in float64, equals the torch sweep and
    therefore the float64 reference. CUDA tests check the Triton kernel against that definition."""
    w, h, _ = make_layer(experts=3, out=16, n_in=128, tokens=400, seed=10, dtype=torch.float64)
    h[1, 5, :] = 0  # a dead input column
    h[1, :, 5] = 0
    want, want_report = gptq.gptq(w, h, key, block_size=64, act_order=act_order)
    assert want_report.settings["sweep"] == "torch"
    monkeypatch.setattr(gptq.gptq_triton, "usable", lambda *args: True)
    monkeypatch.setattr(gptq.gptq_triton, "sweep_block", gptq.gptq_triton.sweep_block_reference)
    monkeypatch.setattr(gptq, "_SUPER_BLOCK", 64)  # both levels of lazy updates: 2 blocks per super-block
    got, report = gptq.gptq(w, h, key, block_size=32, act_order=act_order)
    assert report.settings["sweep"] == "triton" and report.dead_columns == [0, 1, 0]
    assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
    np.testing.assert_allclose(report.proxy_loss, want_report.proxy_loss, rtol=1e-9)


def test_blocked_cholesky_equals_lapack():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 300, 200, generator=g, dtype=torch.float64)
    a = x.mT @ x / 300
    a[2, 150, 150] = -1.0  # not positive definite from column 151 on
    want, want_info = torch.linalg.cholesky_ex(a)
    got, info = cholesky.blocked_cholesky(a.clone(), 64)
    assert info.tolist() == want_info.tolist() == [0, 0, 151]
    torch.testing.assert_close(got[:2], want[:2], rtol=0, atol=1e-12)


def test_non_finite_hessian_entries_fall_back_to_rtn():
    w, h, _ = make_layer(experts=3, out=16, n_in=64, tokens=100, seed=12)
    h[0, 3, 4] = float("nan")
    h[2, 10, 10] = float("inf")
    h[1] *= 3e37  # finite entries whose sum overflows float32: still plain GPTQ
    q, report = gptq.gptq(w, h, INT4)
    assert report.method == ["rtn", "gptq", "rtn"]
    assert report.reason[0] == report.reason[2] == "Hessian has non-finite entries"
    assert torch.isfinite(q.dequantize(torch.float32)).all()


@pytest.mark.parametrize("key", ["int4-g32-sym", "int4-g64-asym", "mxfp4"])
def test_pass_with_gate_and_up_together_equals_one_pass_each(key):
    """The quantize pass's gate/up job (one Hessian, one factorization, one sweep; searched grid and
    refit per weight) gives bit for bit what one gptq_pass per projection gives."""
    w, h, _ = make_layer(experts=3, out=40, n_in=128, tokens=400, seed=5)
    gate, up = w[:, :16], w[:, 16:]
    (q_gate, q_up), _ = gptq.gptq_pass_shared([gate, up], h, key, grid="searched", refit=True)
    for q, weight in ((q_gate, gate), (q_up, up)):
        alone, _ = gptq.gptq_pass(weight, h, key, grid="searched", refit=True)
        assert torch.equal(
            q.codes.view(torch.uint8) if q.codes.dtype.itemsize == 1 else q.codes,
            alone.codes.view(torch.uint8) if alone.codes.dtype.itemsize == 1 else alone.codes,
        )
        assert torch.equal(q.dequantize(torch.float32), alone.dequantize(torch.float32))
