"""AWQ per expert (down_proj, folded into up_proj) and shared per layer (gate / up).

References are written here independently: the output error of every alpha is measured
directly on the calibration tokens (not through the Hessian the library uses), and the folds
are checked as exact identities of the float64 layer.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moequant import formats
from moequant.algorithms import awq, rtn
from moequant.errors import UserError


def make_experts(experts=4, hidden=128, width=64, tokens=256, seed=0):
    """Float64 experts and per-expert tokens whose channels have very uneven magnitudes."""
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(experts, width, hidden, generator=g, dtype=torch.float64) / hidden**0.5
    up = torch.randn(experts, width, hidden, generator=g, dtype=torch.float64) / hidden**0.5
    down = torch.randn(experts, hidden, width, generator=g, dtype=torch.float64) / width**0.5
    channel = torch.exp(1.2 * torch.randn(hidden, generator=g, dtype=torch.float64))

    def tokens_for(n):
        return [torch.randn(n, hidden, generator=g, dtype=torch.float64) * channel for _ in range(experts)]

    return gate, up, down, tokens_for(tokens), tokens_for(tokens)


def down_inputs(gate, up, xs):
    return [F.silu(x @ gate[e].T) * (x @ up[e].T) for e, x in enumerate(xs)]


def error(w, w_hat, xs):
    """Relative squared output error over all experts' tokens."""
    num = sum(float(((x @ (w_hat[e] - w[e]).T) ** 2).sum()) for e, x in enumerate(xs))
    den = sum(float(((x @ w[e].T) ** 2).sum()) for e, x in enumerate(xs))
    return num / den


@pytest.mark.parametrize("key", ["int4-g32-sym", "mxfp4"])
def test_awq_down_not_worse_than_rtn_on_held_out(key):
    gate, up, down, calib, held = make_experts(seed=1)
    result = awq.awq_down(down, up, key, inputs=down_inputs(gate, up, calib))
    down_hat = result.quantized.dequantize(torch.float64) / result.scales[:, None, :].double()
    err_awq = error(down, down_hat, down_inputs(gate, up, held))
    err_rtn = error(down, rtn.rtn(down, key).dequantize(torch.float64), down_inputs(gate, up, held))
    assert err_awq <= err_rtn, (err_awq, err_rtn)
    assert result.report.method == ["awq"] * 4
    assert all(a > 0 for a in result.report.alpha)  # uneven channels: some scaling pays


@pytest.mark.parametrize("key", ["int4-g32-sym", "mxfp4"])
def test_shared_gate_up_not_worse_than_rtn_on_held_out(key):
    gate, up, _, calib, held = make_experts(seed=2)
    result = awq.awq_gate_up(gate, up, key, inputs=calib)
    s = result.input_scale.double()
    for w, q in ((gate, result.quantized_gate), (up, result.quantized_up)):
        err_awq = error(w, q.dequantize(torch.float64) / s, held)
        err_rtn = error(w, rtn.rtn(w, key).dequantize(torch.float64), held)
        assert err_awq <= err_rtn, (err_awq, err_rtn)
    assert result.input_scale.shape == (128,)
    assert len(set(result.report.alpha)) == 1


def test_folds_leave_the_float_layer_unchanged():
    gate, up, down, calib, _ = make_experts(seed=3)
    norm_weight = torch.rand(128, dtype=torch.float64) + 0.5
    h = [x / norm_weight for x in calib]  # pretend x = norm_weight * h
    down_fold = awq.awq_down(down, up, "int4-g32-sym", inputs=down_inputs(gate, up, calib))
    shared = awq.awq_gate_up(gate, up, "int4-g32-sym", inputs=calib)
    s = shared.input_scale.double()
    for e in range(4):
        want = (F.silu(calib[e] @ gate[e].T) * (calib[e] @ up[e].T)) @ down[e].T
        x_folded = h[e] * (norm_weight / s)  # the caller divides the norm weight by the input scale
        up_both = down_fold.up_folded[e].double() * s  # up gets both folds: rows / s_down, columns * s_in
        act = F.silu(x_folded @ shared.gate_scaled[e].double().T) * (x_folded @ up_both.T)
        got = act @ down_fold.down_scaled[e].double().T
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_alpha_is_the_best_of_the_grid_measured_on_tokens():
    gate, up, down, calib, _ = make_experts(experts=2, seed=4)
    xs = down_inputs(gate, up, calib)
    result = awq.awq_down(down, up, "int4-g32-sym", inputs=xs, grid=10)
    for e in range(2):
        m = xs[e].abs().mean(0)
        errs = []
        for i in range(10):
            s = m.pow(i / 10).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            w_hat = formats.quantize((down[e] * s).float(), "int4-g32-sym").dequantize(torch.float64) / s
            errs.append(float(((xs[e] @ (w_hat - down[e]).T) ** 2).sum()))
        best = min(range(10), key=errs.__getitem__)
        assert abs(errs[best] - errs[int(round(result.report.alpha[e] * 10))]) <= 1e-6 * errs[best]
        assert result.report.error_awq[e] <= result.report.error_rtn[e]


def test_hessian_statistics_give_the_same_scales_as_tokens():
    gate, up, down, calib, _ = make_experts(seed=5)
    xs = down_inputs(gate, up, calib)
    by_tokens = awq.awq_down(down, up, "int4-g32-sym", inputs=xs)
    h, m, counts = awq.input_stats(xs)
    by_stats = awq.awq_down(down, up, "int4-g32-sym", hessian=h, mean_abs=m, tokens=counts)
    torch.testing.assert_close(by_tokens.scales, by_stats.scales)
    one_at_a_time, report = awq.awq_scales([down], "int4-g32-sym", hessian=h, mean_abs=m, chunk_experts=1)
    assert torch.equal(one_at_a_time, by_stats.scales) and report.alpha == by_stats.report.alpha


def test_expert_without_tokens_gets_rtn_and_is_reported():
    gate, up, down, calib, _ = make_experts(seed=6)
    xs = down_inputs(gate, up, calib)
    xs[1] = xs[1][:0]
    result = awq.awq_down(down, up, "int4-g32-sym", inputs=xs)
    assert result.report.method[1] == "rtn" and "no calibration tokens" in result.report.reason[1]
    assert result.report.alpha[1] == 0.0
    want = rtn.rtn(down.float(), "int4-g32-sym").dequantize(torch.float32)[1]
    got = result.quantized.dequantize(torch.float32)[1] / result.scales[1]
    assert torch.isfinite(result.quantized.dequantize(torch.float32)).all()
    # alpha = 0 gives s = 1 (up to the normalisation, which is 1 for a constant vector)
    torch.testing.assert_close(got, want)

    shared = awq.awq_gate_up(gate, up, "int4-g32-sym", inputs=[calib[0], calib[1][:0], calib[2], calib[3]])
    assert shared.report.method == ["awq-shared"] * 4 and "no calibration tokens" in shared.report.reason[1]


def test_bad_arguments_are_user_errors():
    gate, up, down, calib, _ = make_experts(seed=7)
    with pytest.raises(UserError, match="calibration data"):
        awq.awq_down(down, up, "int4-g32-sym")
    with pytest.raises(UserError, match="does not match"):
        awq.awq_down(down, gate[:, :32], "int4-g32-sym", inputs=down_inputs(gate, up, calib))
    h, m, _ = awq.input_stats(calib)
    with pytest.raises(UserError, match="token counts"):
        awq.awq_gate_up(gate, up, "int4-g32-sym", hessian=h, mean_abs=m)
