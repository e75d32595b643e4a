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


def test_shared_scale_over_groups_in_different_formats_is_the_best_of_the_grid_on_tokens():
    """awq_shared_scale: one input scale for gate (int4) and up (mxfp4) of all experts, each expert's
    error weighted by its token count; checked against the error measured directly on the tokens."""
    gate, up, _, calib, _ = make_experts(seed=8)
    calib = [x[: 64 * (e + 1)] for e, x in enumerate(calib)]  # unequal token counts
    counts = torch.tensor([x.shape[0] for x in calib], dtype=torch.float64)
    h, _, _ = awq.input_stats(calib)
    all_tokens = torch.cat(calib)
    magnitude = all_tokens.abs().mean(0).float()
    groups = [awq.SharedGroup(gate.float(), "int4-g32-sym", h, counts), awq.SharedGroup(up.float(), "mxfp4", h, counts)]
    result = awq.awq_shared_scale(groups, magnitude, grid=10)

    def measured(alpha):
        s = magnitude.double().clamp(min=1e-8).pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        total = 0.0
        for w, key in ((gate, "int4-g32-sym"), (up, "mxfp4")):
            w_hat = formats.quantize((w * s).float(), key).dequantize(torch.float64) / s
            total += sum(float(((x @ (w_hat[e] - w[e]).T) ** 2).sum()) for e, x in enumerate(calib))
        return total

    errs = [measured(i / 10) for i in range(10)]
    best = min(range(10), key=errs.__getitem__)
    assert abs(errs[int(round(result.alpha * 10))] - errs[best]) <= 1e-5 * errs[best]
    assert result.alpha > 0 and errs[int(round(result.alpha * 10))] < errs[0]  # uneven channels: scaling pays
    assert result.scale.shape == (128,) and min(result.objective) == result.objective[int(round(result.alpha * 10))]
    for rtn_errors, awq_errors in zip(result.error_rtn, result.error_awq):
        assert len(rtn_errors) == len(awq_errors) == 4


def test_shared_scale_on_the_moe_block_output_is_the_best_of_the_grid():
    """awq_shared_scale_moe: the objective is the routing-weighted MoE output error, recomputed here
    token by token in float64 (a token's experts' errors add up before they are squared)."""
    gate, up, down, _, _ = make_experts(experts=4, seed=9)
    g = torch.Generator().manual_seed(9)
    channel = torch.exp(1.2 * torch.randn(128, generator=g, dtype=torch.float64))
    x = torch.randn(96, 128, generator=g, dtype=torch.float64) * channel
    logits = torch.randn(96, 4, generator=g, dtype=torch.float64)
    weights, indices = torch.softmax(logits, -1).topk(2, dim=-1)
    specs = [("int4-g32-sym", "int4-g32-sym"), ("int4-g32-sym", "mxfp4"), None, ("int4-g32-sym", "int4-g32-sym")]
    magnitude = x.abs().mean(0).float()
    result = awq.awq_shared_scale_moe(
        x.float(), indices, weights.float(), gate.float(), up.float(), down.float(), specs, F.silu, magnitude, grid=8
    )

    def measured(alpha):
        s = magnitude.double().clamp(min=1e-8).pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        hat = {}
        for e in range(4):
            hat[e] = (gate[e], up[e])
            if specs[e] is not None:
                hat[e] = tuple(
                    formats.quantize((w[e] * s).float(), key).dequantize(torch.float64) / s
                    for w, key in zip((gate, up), specs[e])
                )
        total = 0.0
        for t in range(x.shape[0]):
            diff = torch.zeros(128, dtype=torch.float64)
            for slot in range(2):
                e = int(indices[t, slot])
                g_hat, u_hat = hat[e]
                y_hat = (F.silu(g_hat @ x[t]) * (u_hat @ x[t])) @ down[e].T
                y = (F.silu(gate[e] @ x[t]) * (up[e] @ x[t])) @ down[e].T
                diff += weights[t, slot] * (y_hat - y)
            total += float(diff @ diff)
        return total

    errs = [measured(i / 8) for i in range(8)]
    chosen = int(round(result.alpha * 8))
    assert errs[chosen] <= min(errs) * (1 + 1e-4)
    energy = sum(
        float(
            (
                sum(
                    weights[t, k]
                    * (
                        (F.silu(gate[int(indices[t, k])] @ x[t]) * (up[int(indices[t, k])] @ x[t]))
                        @ down[int(indices[t, k])].T
                    )
                    for k in range(2)
                )
                ** 2
            ).sum()
        )
        for t in range(x.shape[0])
    )
    for i in range(8):
        assert abs(result.objective[i] - errs[i] / energy) <= 1e-3 * errs[i] / energy


@pytest.mark.parametrize("key", ["int4-g32-sym", "mxfp4", "int8"])
def test_clip_picks_per_group_ranges_that_lower_the_output_error_measured_on_tokens(key):
    """awq_clip: the clipped weight, quantized by round-to-nearest, has an output error (measured
    directly on the tokens) no larger than round-to-nearest's, per expert; r = 1 rows are untouched
    and every clipped group lies within its chosen fraction of the group's range."""
    gate, _, _, calib, held = make_experts(seed=10)
    h, _, _ = awq.input_stats(calib)
    result = awq.awq_clip(gate.float(), key, h)
    spec = formats.get_format(key)
    size = spec.group_size if spec.granularity == "group" else gate.shape[-1]
    w = gate.float()
    for e, x in enumerate(calib):

        def err(v):
            d = formats.quantize(v, key).dequantize(torch.float64) - gate[e]
            return float(((x @ d.T) ** 2).sum()) / x.shape[0]

        before, after = err(w[e]), err(result.weight[e])
        assert after <= before * (1 + 1e-6), (e, before, after)
        assert abs(after - float(result.error_after[e])) <= 1e-3 * after
        assert abs(before - float(result.error_before[e])) <= 1e-3 * before
    groups = w.reshape(*w.shape[:2], -1, size)
    clipped = result.weight.reshape(groups.shape)
    r = result.ratio
    assert ((clipped.abs().amax(-1) <= r * groups.abs().amax(-1) * (1 + 1e-6)) | (r == 1)).all()
    assert torch.equal(clipped[r == 1], groups[r == 1])
    if spec.is_int:
        assert (r < 1).any()  # 4 bits: clipping pays on some groups
    # held out: the clipped experts together are not worse than round-to-nearest
    rtn_err = error(gate, formats.quantize(w, key).dequantize(torch.float64), held)
    clip_err = error(gate, formats.quantize(result.weight, key).dequantize(torch.float64), held)
    assert clip_err <= rtn_err * 1.01, (clip_err, rtn_err)


def test_clip_leaves_block_and_tensor_scaled_formats_alone():
    gate, _, _, calib, _ = make_experts(seed=11)
    h, _, _ = awq.input_stats(calib)
    for key in ("fp8-block128", "fp8-tensor"):
        result = awq.awq_clip(gate.float(), key, h)
        assert torch.equal(result.weight, gate.float()) and (result.ratio == 1).all()


def test_shared_scale_on_the_moe_block_keeps_alpha_only_if_the_held_out_fold_agrees():
    """awq_shared_scale_moe with holdout: alpha is chosen on the fit fold (the first 3/4 of the tokens)
    and kept only if the quantized block's error on the last 1/4 is lower than with s = 1, both
    recomputed here directly (down_hat as given: the quantized block's down_proj)."""
    gate, up, down, _, _ = make_experts(experts=4, seed=12)
    g = torch.Generator().manual_seed(12)
    channel = torch.exp(1.2 * torch.randn(128, generator=g, dtype=torch.float64))
    x = (torch.randn(160, 128, generator=g, dtype=torch.float64) * channel).float()
    weights, indices = torch.softmax(torch.randn(160, 4, generator=g, dtype=torch.float64), -1).topk(2, dim=-1)
    specs = [("int4-g32-sym", "int4-g32-sym")] * 4
    down_hat = formats.quantize(down.float(), "int4-g32-sym").dequantize(torch.float32)
    magnitude = x.abs().mean(0)
    result = awq.awq_shared_scale_moe(
        x,
        indices,
        weights.float(),
        gate.float(),
        up.float(),
        down.float(),
        specs,
        F.silu,
        magnitude,
        grid=8,
        down_hat=down_hat,
        holdout=0.25,
    )
    v = result.validation
    assert v["fit_tokens"] == 120 and v["held_out_tokens"] == 40

    def block_error(alpha, tokens):
        s = awq._scales(magnitude, alpha)
        g_hat, u_hat = (
            formats.quantize(w.float() * s, "int4-g32-sym").dequantize(torch.float32) / s for w in (gate, up)
        )
        total = 0.0
        for t in tokens:
            diff = torch.zeros(128, dtype=torch.float64)
            for k in range(2):
                e = int(indices[t, k])
                y_hat = (F.silu(g_hat[e] @ x[t]) * (u_hat[e] @ x[t])) @ down_hat[e].T
                y = (F.silu(gate[e].float() @ x[t]) * (up[e].float() @ x[t])) @ down[e].float().T
                diff += float(weights[t, k]) * (y_hat - y).double()
            total += float(diff @ diff)
        return total

    fit = [block_error(i / 8, range(120)) for i in range(8)]
    assert v["alpha_fit"] == min(range(8), key=fit.__getitem__) / 8 or fit[int(v["alpha_fit"] * 8)] <= min(fit) * (
        1 + 1e-4
    )
    if v["alpha_fit"] > 0:
        held = {a: block_error(a, range(120, 160)) for a in (0.0, v["alpha_fit"])}
        assert (
            v["kept"] == (held[v["alpha_fit"]] < held[0.0]) or abs(held[v["alpha_fit"]] - held[0.0]) <= 1e-4 * held[0.0]
        )
    assert result.alpha == (v["alpha_fit"] if v["kept"] else 0.0)
    if not v["kept"]:
        assert torch.equal(result.scale, torch.ones(128))
