"""Searched integer grids (formats.searched_fit, quantize(grid="searched"), GPTQ's searched grid)
and routing-weighted Hessians, against independent float64 computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moequant import formats
from moequant.algorithms import gptq
from moequant.calib.calibrate import CalibrationSettings, calibrate
from moequant.calib.stats import load_stats
from moequant.errors import UserError

# ---------------------------------------------------------------------------------------------
# float64 references


def bf16(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.asarray(a, dtype=np.float32)).to(torch.bfloat16).double().numpy()


def dequant(x, s, z, bits):
    """Round-half-even codes on the stored scale, the format's rule, in float64: w = (q - z) * s."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    safe = np.where(s > 0, s, np.inf)
    q = np.clip(np.round(x / safe[..., None]) + z[..., None], qmin, qmax)
    return (q - z[..., None]) * s[..., None]


def werr(x, w, s, z, bits):
    return (w * (x - dequant(x, s, z, bits)) ** 2).sum(-1)


def reference_search(x, w, bits, symmetric, steps=21):
    """Best weighted error per group over the documented candidates (float64 except the bf16 scale)."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    x = x.astype(np.float64)
    zero = np.zeros(x.shape[:-1])
    cands = []
    if symmetric:
        amax = np.abs(x).max(-1)
        for d in list(np.linspace(qmax, 1.6 * qmax, steps)) + [qmax + 0.5, -qmin]:
            s = amax / d
            cands.append((s, zero))
            q = np.clip(np.round(x / np.where(s > 0, s, 1)[..., None]), qmin, qmax)
            with np.errstate(invalid="ignore", divide="ignore"):
                cands.append(((w * x * q).sum(-1) / (w * q * q).sum(-1), zero))
        cands = [(bf16(np.where(np.isfinite(s) & (s > 0), s, 0)), z) for s, z in cands]
    else:
        lo, hi = x.min(-1), x.max(-1)
        n = 2 ** bits - 1
        # the format's own min/max rule (zero inside the range)
        s = bf16((np.maximum(hi, 0) - np.minimum(lo, 0)) / n)
        cands.append((s, np.where(s > 0, np.clip(qmin + np.round(-np.minimum(lo, 0) / np.where(s > 0, s, 1)), qmin, qmax), 0)))
        for delta in np.linspace(-1, 1, steps):
            s0 = (hi - lo) / (n + delta)
            l = np.clip(np.round((x - lo[..., None]) / np.where(s0 > 0, s0, 1)[..., None]), 0, n)
            sw, sx = w.sum(-1), (w * x).sum(-1)
            sl, sll, slx = (w * l).sum(-1), (w * l * l).sum(-1), (w * l * x).sum(-1)
            with np.errstate(invalid="ignore", divide="ignore"):
                det = sw * sll - sl * sl
                # x ~ s * l + m by weighted least squares on the candidate's codes l
                pairs = [(s0, lo), ((sw * slx - sl * sx) / det, (sll * sx - sl * slx) / det)]
            for s, low in pairs:  # w = (q - z) * s with the low end `low` at code qmin
                s = bf16(np.where(np.isfinite(s) & (s > 0), s, 0))
                with np.errstate(invalid="ignore", divide="ignore"):
                    z = np.nan_to_num(qmin + np.round(-low / s), nan=0, posinf=qmax, neginf=qmin)
                z = np.where(s > 0, np.clip(z, qmin, qmax), 0)
                cands.append((s, z))
    return np.min([werr(x, w, s, z, bits) for s, z in cands], axis=0)


def minmax_error(x, w, spec):
    """The format's own min/max scale rule (module doc of formats.core), float64 error."""
    bits, qmin, qmax = spec.bits, -(2 ** (spec.bits - 1)), 2 ** (spec.bits - 1) - 1
    if spec.symmetric:
        s = bf16(np.abs(x).max(-1) / (qmax + 0.5))
        return werr(x, w, s, np.zeros_like(s), bits)
    lo, hi = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    s = bf16((hi - lo) / (2**bits - 1))
    z = np.where(s > 0, np.clip(qmin + np.round(-lo / np.where(s > 0, s, 1)), qmin, qmax), 0)
    return werr(x, w, s, z, bits)


def groups_of(t: torch.Tensor, g: int) -> np.ndarray:
    return t.double().numpy().reshape(*t.shape[:-1], t.shape[-1] // g, g)


def weights(seed=0, shape=(3, 24, 128)):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.exp(0.5 * torch.randn(shape[-1], generator=g))
    w[0, 0, :32] = 0.0  # an all-zero group
    w[1, 2, 32:64] = torch.rand(32, generator=g) + 0.5  # an all-positive group
    imp = torch.exp(torch.randn(shape[0], shape[-1], generator=g))
    return w, imp


# ---------------------------------------------------------------------------------------------
# searched grid


@pytest.mark.parametrize("key", ["int4-g32-sym", "int4-g32-asym", "int4-g64-asym", "int3-g32-asym", "int2-g32-sym",
                                 "int4-g128-sym"])
@pytest.mark.parametrize("weighted", [False, True])
def test_searched_grid_is_the_best_candidate_and_beats_minmax(key, weighted):
    spec = formats.parse_key(key)
    w, imp = weights()
    q = formats.quantize(w, spec, grid="searched", importance=imp if weighted else None)
    g = spec.group_size
    x = groups_of(w, g)
    wt = groups_of(imp[:, None, :].expand_as(w), g) if weighted else np.ones_like(x)
    s = q.scales.double().numpy()
    z = np.zeros_like(s) if q.zeros is None else q.zeros.double().numpy()
    # the stored codes are the format's rounding on the stored scale / zero point, and dequantize to it
    assert np.array_equal(q.codes.double().numpy().reshape(x.shape) - z[..., None],
                          np.round(dequant(x, s, z, spec.bits) / np.where(s > 0, s, 1)[..., None]))
    assert np.allclose(q.dequantize(torch.float64).numpy().reshape(x.shape), dequant(x, s, z, spec.bits), rtol=0, atol=0)
    ours = werr(x, wt, s, z, spec.bits)
    best = reference_search(x, wt, spec.bits, spec.symmetric)
    base = minmax_error(x, wt, spec)
    assert np.all(ours <= base * (1 + 1e-6) + 1e-12)  # never worse than the min/max rule
    np.testing.assert_allclose(ours, best, rtol=1e-5, atol=1e-10)  # the best candidate, as in float64
    assert ours.sum() < 0.97 * base.sum()  # and a real gain on these weights
    assert q.dequantize()[0, 0, :32].abs().max() == 0  # all-zero group exact


def test_searched_grid_int8_channel_and_chunked_stacks(monkeypatch):
    w, imp = weights(1, (4, 16, 64))
    q = formats.quantize(w, "int8-channel", grid="searched", importance=imp)
    x, wt = w.double().numpy(), imp[:, None, :].expand_as(w).double().numpy()
    ours = werr(x, wt, q.scales.double().numpy()[..., 0], np.zeros(x.shape[:-1]), 8)
    np.testing.assert_allclose(ours, reference_search(x, wt, 8, True), rtol=1e-5, atol=1e-12)
    # stacks quantized a few experts at a time give the same result
    spec = formats.parse_key("int4-g32-asym")
    whole = formats.quantize(w, spec, grid="searched", importance=imp)
    monkeypatch.setattr(formats.core, "CHUNK_ELEMENTS", w[0].numel())
    chunked = formats.quantize(w, spec, grid="searched", importance=imp)
    assert torch.equal(whole.codes, chunked.codes) and torch.equal(whole.scales, chunked.scales)
    shared = formats.quantize(w, spec, grid="searched", importance=imp[0])
    assert torch.equal(shared.scales[1], formats.quantize(w[1], spec, grid="searched", importance=imp[0]).scales)


def test_searched_grid_bad_input():
    w, imp = weights()
    with pytest.raises(UserError, match="unknown grid"):
        formats.quantize(w, "int4-g32-sym", grid="mse")
    with pytest.raises(UserError, match="integer formats"):
        formats.quantize(w, "fp8-channel", grid="searched")
    with pytest.raises(UserError, match="importance"):
        formats.quantize(w, "int4-g32-sym", grid="searched", importance=imp[:, :10])
    with pytest.raises(UserError, match="non-negative"):
        formats.quantize(w, "int4-g32-sym", grid="searched", importance=-imp)
    with pytest.raises(UserError, match="searched grid only"):
        formats.quantize(w, "int4-g32-sym", importance=imp)
    h = torch.eye(128).expand(3, -1, -1)
    with pytest.raises(UserError, match="static_groups"):
        gptq.gptq(w, h, "int4-g32-sym", grid="searched", static_groups=False)


# ---------------------------------------------------------------------------------------------
# GPTQ onto the searched grid


def reference_gptq_fixed(w, h, s, z, group, damp=0.01):
    """Float64 textbook GPTQ (natural column order) onto fixed per-group scales / zero points."""
    w, h = np.array(w, dtype=np.float64), np.array(h, dtype=np.float64)
    n = h.shape[0]
    u = np.linalg.cholesky(np.linalg.inv(h + damp * np.mean(np.diag(h)) * np.eye(n))).T
    codes = np.zeros_like(w)
    for j in range(n):
        sj, zj = s[:, j // group], z[:, j // group]
        q = np.clip(np.round(w[:, j] / np.where(sj > 0, sj, np.inf)) + zj, -8, 7)
        codes[:, j] = q
        err = (w[:, j] - (q - zj) * sj) / u[j, j]
        w[:, j + 1:] -= np.outer(err, u[j, j + 1:])
    return codes


@pytest.mark.parametrize("key", ["int4-g32-sym", "int4-g32-asym"])
def test_gptq_on_the_searched_grid_equals_float64_gptq_and_beats_minmax(key):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_gptq import make_layer, output_error

    w, h, held_out = make_layer(experts=3, out=16, n_in=128, tokens=600, dtype=torch.float64)
    q, report = gptq.gptq(w, h, key, block_size=64, grid="searched")
    assert report.settings["grid"] == "searched"
    spec = formats.parse_key(key)
    # the grid: each group's search on the original weights, weighted by diag(H)
    diag = torch.diagonal(h, dim1=-2, dim2=-1)
    want = formats.quantize(w, spec, grid="searched", importance=diag)
    assert torch.equal(q.scales, want.scales)
    assert (q.zeros is None) == spec.symmetric and (q.zeros is None or torch.equal(q.zeros, want.zeros))
    for e in range(3):
        s = q.scales[e].double().numpy()
        z = np.zeros_like(s) if q.zeros is None else q.zeros[e].double().numpy()
        codes = reference_gptq_fixed(w[e].numpy(), h[e].numpy(), s, z, 32)
        assert int((q.codes[e].double().numpy() != codes).sum()) == 0
    minmax, _ = gptq.gptq(w, h, key, block_size=64)
    assert output_error(w, q.dequantize(torch.float64), held_out) < 0.9 * output_error(
        w, minmax.dequantize(torch.float64), held_out)


# ---------------------------------------------------------------------------------------------
# routing-weighted Hessians


@pytest.mark.parametrize("weighting", ["routing"])
def test_routing_weighted_hessians_match_float64(tmp_path, weighting):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny import build_tiny
    from transformers import AutoModelForCausalLM

    from moequant.arch import adapter_for
    from moequant.calib.data import Sample
    from moequant.io.checkpoint import open_checkpoint

    directory = build_tiny("qwen2_moe", tmp_path / "m", seed=3)
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(0, 96, (24,), generator=g), "prose", "test") for _ in range(6)]
    base = dict(samples=6, seq_len=24, batch_size=3, formats=("int8-channel",), save_hessians=True, probe_samples=0)
    stats = load_stats(calibrate(str(directory), tmp_path / "w", CalibrationSettings(**base, hessian_weighting=weighting),
                                 samples=samples, progress=False))
    plain = load_stats(calibrate(str(directory), tmp_path / "p", CalibrationSettings(**base), samples=samples,
                                 progress=False))
    # the reference: the unmodified model, hooked for router weights / indices and the experts' input
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    adapter = adapter_for(open_checkpoint(directory).config)
    seen = {L: {"r": [], "i": [], "x": []} for L in adapter.moe_layers}
    hooks = []
    for L in adapter.moe_layers:
        mlp = model.model.layers[L].mlp
        def on_router(m, a, out, L=L):  # returns None: the router's output stays as it is
            seen[L]["r"].append(out[1].reshape(-1, adapter.top_k).double())
            seen[L]["i"].append(out[2].reshape(-1, adapter.top_k))

        hooks.append(adapter.router_module(mlp).register_forward_hook(on_router))
        hooks.append(mlp.experts.register_forward_pre_hook(
            lambda m, a, L=L: seen[L]["x"].append(a[0].reshape(-1, a[0].shape[-1]).double())))
    with torch.no_grad():
        for batch in torch.split(torch.stack([s.input_ids for s in samples]), 3):
            model(input_ids=batch)
    for hk in hooks:
        hk.remove()
    power = 1
    for L in adapter.moe_layers:
        r, idx, x = (torch.cat(seen[L][k]) for k in ("r", "i", "x"))
        experts = model.model.layers[L].mlp.experts
        s = stats.layers[L]
        for e in range(adapter.num_experts):
            c = ((idx == e) * r).sum(1) ** power  # the token's routing weight for e (0 when not routed)
            routed = (idx == e).any(1)
            if not routed.any():
                continue
            xe, ce = x[routed], c[routed]
            want = xe.T @ (xe * ce[:, None]) / ce.sum()
            torch.testing.assert_close(s.hessian("gate", routed=True)[e].double(), want, rtol=1e-4, atol=1e-6)
            with torch.no_grad():
                he = adapter.expert_hidden(experts, xe.float(), e).double()
            torch.testing.assert_close(s.hessian("down", routed=True)[e].double(), he.T @ (he * ce[:, None]) / ce.sum(),
                                       rtol=1e-4, atol=1e-6)
        # the unweighted statistics and the all-token Hessians are unchanged
        assert torch.equal(s.hessian("gate"), plain.layers[L].hessian("gate"))
        assert not torch.allclose(s.hessian("gate", routed=True), plain.layers[L].hessian("gate", routed=True))
    with pytest.raises(UserError, match="hessian_weighting"):
        calibrate(str(directory), tmp_path / "bad", CalibrationSettings(**base, hessian_weighting="affinity"),
                  samples=samples, progress=False)
    assert not (tmp_path / "bad").exists()
