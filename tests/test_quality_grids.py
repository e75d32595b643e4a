"""Searched integer grids (formats.searched_fit, quantize(grid="searched"), GPTQ's searched grid)
and routing-weighted Hessians, against independent float64 computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.plain import plain_settings

from moequant import formats
from moequant.algorithms import gptq
from moequant.errors import UserError
from moequant.measure.calibrate import calibrate
from moequant.measure.stats import load_stats

# ---------------------------------------------------------------------------------------------
# float64 references


def bf16(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.asarray(a, dtype=np.float32)).to(torch.bfloat16).double().numpy()


def dequant(x, s, z, bits):
    """Round-half-even codes on the stored scale, the format's rule, in float64: w = (q - z) * s."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    safe = np.where(s != 0, s, np.inf)  # s < 0: a symmetric group's mirrored grid
    q = np.clip(np.round(x / safe[..., None]) + z[..., None], qmin, qmax)
    return (q - z[..., None]) * s[..., None]


def werr(x, w, s, z, bits):
    return (w * (x - dequant(x, s, z, bits)) ** 2).sum(-1)


def reference_search(x, w, bits, symmetric, steps=21, signed=None):
    """Best weighted error per group over the documented candidates (float64 except the bf16 scale);
    for symmetric group formats (signed) also over the mirrored candidates: those of -x, negated."""
    if signed is None:
        signed = symmetric
    if signed:
        mirrored = reference_candidates(-x, w, bits, symmetric, steps)
        cands = reference_candidates(x, w, bits, symmetric, steps) + [(-s, z) for s, z in mirrored]
    else:
        cands = reference_candidates(x, w, bits, symmetric, steps)
    return np.min([werr(x, w, s, z, bits) for s, z in cands], axis=0)


def reference_candidates(x, w, bits, symmetric, steps):
    """The documented candidates (scale, zero point) of one sign, each stored in bf16."""
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
        n = 2**bits - 1
        # the format's own min/max rule (zero inside the range)
        s = bf16((np.maximum(hi, 0) - np.minimum(lo, 0)) / n)
        cands.append(
            (s, np.where(s > 0, np.clip(qmin + np.round(-np.minimum(lo, 0) / np.where(s > 0, s, 1)), qmin, qmax), 0))
        )
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
    return cands


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


@pytest.mark.parametrize(
    "key", ["int4-g32-sym", "int4-g32-asym", "int4-g64-asym", "int3-g32-asym", "int2-g32-sym", "int4-g128-sym"]
)
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
    assert np.array_equal(
        q.codes.double().numpy().reshape(x.shape) - z[..., None],
        np.round(dequant(x, s, z, spec.bits) / np.where(s != 0, s, 1)[..., None]),
    )
    assert np.allclose(
        q.dequantize(torch.float64).numpy().reshape(x.shape), dequant(x, s, z, spec.bits), rtol=0, atol=0
    )
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
    np.testing.assert_allclose(ours, reference_search(x, wt, 8, True, signed=False), rtol=1e-5, atol=1e-12)
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
        q = np.clip(np.round(w[:, j] / np.where(sj != 0, sj, np.inf)) + zj, -8, 7)  # sj < 0: mirrored grid
        codes[:, j] = q
        err = (w[:, j] - (q - zj) * sj) / u[j, j]
        w[:, j + 1 :] -= np.outer(err, u[j, j + 1 :])
    return codes


@pytest.mark.parametrize("key", ["int4-g32-sym", "int4-g32-asym"])
def test_gptq_on_the_searched_grid_equals_float64_gptq_and_beats_minmax(key):
    from helpers import make_layer, output_error

    w, h, held_out = make_layer(experts=3, out=16, n_in=128, tokens=600, dtype=torch.float64)
    q, report = gptq.gptq(w, h, key, block_size=64, grid="searched")
    assert report.settings["grid"] == "searched"
    spec = formats.parse_key(key)
    # the grid: each group's search on the original weights, weighted by diag(H)
    diag = torch.diagonal(h, dim1=-2, dim2=-1)
    want = formats.quantize(w, spec, grid="searched", importance=diag)
    assert torch.equal(q.scales, want.scales)
    assert (q.zeros is None) == spec.symmetric and (q.zeros is None or torch.equal(q.zeros, want.zeros))
    assert bool((q.scales < 0).any()) == spec.symmetric  # symmetric groups' mirrored grids reach GPTQ
    for e in range(3):
        s = q.scales[e].double().numpy()
        z = np.zeros_like(s) if q.zeros is None else q.zeros[e].double().numpy()
        codes = reference_gptq_fixed(w[e].numpy(), h[e].numpy(), s, z, 32)
        assert int((q.codes[e].double().numpy() != codes).sum()) == 0
    minmax, _ = gptq.gptq(w, h, key, block_size=64)
    assert output_error(w, q.dequantize(torch.float64), held_out) < 0.9 * output_error(
        w, minmax.dequantize(torch.float64), held_out
    )


# ---------------------------------------------------------------------------------------------
# routing-weighted Hessians


@pytest.mark.parametrize("weighting", ["routing"])
def test_routing_weighted_hessians_match_float64(tmp_path, weighting):
    from tiny import build_tiny
    from transformers import AutoModelForCausalLM

    from moequant.arch import adapter_for
    from moequant.io.checkpoint import open_checkpoint
    from moequant.measure.data import Sample

    directory = build_tiny("qwen2_moe", tmp_path / "m", seed=3)
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(0, 96, (24,), generator=g), "prose", "test") for _ in range(6)]
    base = dict(samples=6, seq_len=24, batch_size=3, formats=("int8-channel",), save_hessians=True, probe_samples=0)
    stats = load_stats(
        calibrate(
            str(directory),
            tmp_path / "w",
            plain_settings(**base, hessian_weighting=weighting),
            samples=samples,
            progress=False,
        )
    )
    plain = load_stats(
        calibrate(str(directory), tmp_path / "p", plain_settings(**base), samples=samples, progress=False)
    )
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
        hooks.append(
            mlp.experts.register_forward_pre_hook(
                lambda m, a, L=L: seen[L]["x"].append(a[0].reshape(-1, a[0].shape[-1]).double())
            )
        )
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
            torch.testing.assert_close(
                s.hessian("down", routed=True)[e].double(), he.T @ (he * ce[:, None]) / ce.sum(), rtol=1e-4, atol=1e-6
            )
        # the unweighted statistics and the all-token Hessians are unchanged
        assert torch.equal(s.hessian("gate"), plain.layers[L].hessian("gate"))
        assert not torch.allclose(s.hessian("gate", routed=True), plain.layers[L].hessian("gate", routed=True))
    with pytest.raises(UserError, match="hessian_weighting"):
        calibrate(
            str(directory),
            tmp_path / "bad",
            plain_settings(**base, hessian_weighting="affinity"),
            samples=samples,
            progress=False,
        )
    assert not (tmp_path / "bad").exists()


# ---------------------------------------------------------------------------------------------
# the search's reciprocal codes against its division codes (issue 36)


def _searched_fit_by_division(spec, xg, importance):
    """searched_fit as it was before issue 36 (CPU, torch): every candidate's codes round(x / s)."""
    from moequant.formats import core

    x = xg.to(torch.float32)
    w = torch.ones_like(x) if importance is None else importance.to(torch.float32).expand_as(x)
    qmin, qmax = -(2 ** (spec.bits - 1)), 2 ** (spec.bits - 1) - 1
    best_s, best_z = core._fit(spec, x, None, None)

    def error(s, z):
        zz = None if z is None else z.unsqueeze(-1)
        back = core._decode(spec, core._encode(spec, x, s.unsqueeze(-1), zz, None), s.unsqueeze(-1), zz, None)
        return (w * (x - back).square()).sum(-1)

    best = error(best_s, best_z)

    def consider(s32, z):
        nonlocal best, best_s, best_z
        s = torch.where(torch.isfinite(s32) & (s32 > 0), s32, torch.zeros_like(s32)).to(torch.bfloat16)
        if z is not None:
            z = torch.nan_to_num(z(s.float()), nan=0.0, posinf=qmax, neginf=qmin).clamp(qmin, qmax)
            z = torch.where(s > 0, z, torch.zeros_like(z)).to(torch.int8)
        err = error(s, z)
        better = err < best
        best, best_s = torch.where(better, err, best), torch.where(better, s, best_s)
        if z is not None:
            best_z = torch.where(better, z, best_z)

    if spec.symmetric:
        amax = x.abs().amax(-1)
        for d in torch.linspace(qmax, 1.6 * qmax, 21).tolist() + [qmax + 0.5, -qmin]:
            s32 = amax * (1.0 / torch.tensor(d, dtype=torch.float32))
            consider(s32, None)
            codes = torch.clamp(torch.round(x / torch.where(s32 > 0, s32, 1.0).unsqueeze(-1)), qmin, qmax)
            consider((w * x * codes).sum(-1) / (w * codes.square()).sum(-1), None)
        return best_s, None
    lo, hi = x.amin(-1), x.amax(-1)
    steps = 2**spec.bits - 1
    sw, sx = w.sum(-1), (w * x).sum(-1)
    for delta in torch.linspace(-1.0, 1.0, 21).tolist():
        s0 = (hi - lo) * (1.0 / torch.tensor(steps + delta, dtype=torch.float32))
        consider(s0, lambda s, lo=lo: qmin + torch.round(-lo / s))
        l = torch.clamp(torch.round((x - lo.unsqueeze(-1)) / torch.where(s0 > 0, s0, 1.0).unsqueeze(-1)), 0, steps)
        sl, sll, slx = (w * l).sum(-1), (w * l * l).sum(-1), (w * l * x).sum(-1)
        det = sw * sll - sl * sl
        s_ls, m_ls = (sw * slx - sl * sx) / det, (sll * sx - sl * slx) / det
        consider(s_ls, lambda s, m=m_ls: qmin + torch.round(-m / s))
    return best_s, best_z


def _held_out_layer(seed, experts=4, rows=48, cols=256, tokens=768):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=g) / cols**0.5 + torch.eye(cols)
    channel = torch.exp(0.5 * torch.randn(cols, generator=g))
    channel[::16] *= 6.0  # outlier channels, as real activations have
    x_cal = (torch.randn(experts, tokens, cols, generator=g) @ mix) * channel
    x_held = (torch.randn(experts, tokens, cols, generator=g) @ mix) * channel
    w = torch.distributions.StudentT(4.0).sample((experts, rows, cols)) * 0.02
    return w.to(torch.bfloat16).float(), x_cal, x_held


@pytest.mark.parametrize("key", ["int4-g128-sym", "int4-g32-sym", "int4-g32-asym", "int3-g64-asym"])
def test_search_by_reciprocal_matches_the_division_search_up_to_ties(key, monkeypatch):
    """GPTQ on the searched grid + refit, as the recipe runs it, with today's search and with the
    division search it replaced: the same scales and codes except at ties, whose float64 error
    agrees to a float32 rounding, and held-out output error equal within 0.1% per projection."""
    from moequant.formats import core

    spec = formats.parse_key(key)
    torch.manual_seed(0)
    for proj, seed in (("gate", 1), ("down", 2)):
        w, x_cal, x_held = _held_out_layer(seed)
        h = (x_cal.transpose(1, 2) @ x_cal).float()
        # the grid alone, float64 error where the two searches pick different scales
        imp = h.diagonal(dim1=-2, dim2=-1)[:, None, :].unflatten(-1, (-1, spec.group_size))
        xg = w.unflatten(-1, (-1, spec.group_size))
        new = core._search(spec, xg, imp)  # one sign: the scale sign's choice is shared
        old = _searched_fit_by_division(spec, xg, imp)
        differ = new[0] != old[0] if spec.symmetric else (new[0] != old[0]) | (new[1] != old[1])

        def err64(sz):
            s, z = sz[0].double(), (torch.zeros_like(sz[0]) if sz[1] is None else sz[1]).double()
            q = torch.clamp(
                torch.round(xg.double() / torch.where(s > 0, s, torch.inf)[..., None]) + z[..., None],
                -(2 ** (spec.bits - 1)),
                2 ** (spec.bits - 1) - 1,
            )
            return (imp.double() * (xg.double() - (q - z[..., None]) * s[..., None]) ** 2).sum(-1)

        print(f"{key} {proj}: {differ.double().mean().item():.2e} of the groups' scales differ")
        assert differ.double().mean().item() < 2e-3
        torch.testing.assert_close(err64(new)[differ], err64(old)[differ], rtol=1e-5, atol=0)

        # the whole recipe GPTQ: codes and held-out error
        results = []

        def by_division(spec, xg, imp=None, name=None, signed=False, triton=True):  # triton: inert on the CPU
            s, z = _searched_fit_by_division(spec, xg, imp)
            if not (signed and spec.symmetric):
                return s, z
            x, w = xg.float(), torch.ones_like(xg) if imp is None else imp.float()
            return core._choose_sign(spec, x, w, s, _searched_fit_by_division(spec, -xg, imp)[0]), None

        for fit in (core._search, by_division):
            monkeypatch.setattr(core, "_search", fit)
            (q,), _ = gptq.gptq_pass_shared([w], h, spec, grid="searched", refit=True)
            back = q.dequantize(torch.float64)
            ref = x_held.double() @ w.double().transpose(1, 2)
            results.append(
                (q.codes, float(((x_held.double() @ back.transpose(1, 2) - ref) ** 2).sum() / (ref**2).sum()))
            )
        (codes_new, err_new), (codes_old, err_old) = results
        frac = (codes_new != codes_old).double().mean().item()
        print(f"{key} {proj}: codes differ {frac:.2e}; held-out error {err_new:.6g} vs {err_old:.6g}")
        assert frac < 2e-2  # a flipped scale moves GPTQ's later columns (its recursion spreads any change)
        assert abs(err_new / err_old - 1) < 1e-3


@pytest.mark.parametrize("key", ["int4-g32-sym", "int3-g64-sym", "int2-g32-sym", "int8-channel"])
def test_one_pass_over_both_signs_is_the_search_on_minus_x(key):
    """The signed search searches -x (the mirrored grid of a negative scale) in the same pass as x, on the
    mirrored code range, and keeps per group the better of the two on `_encode`'s codes: bit for bit the
    choice between a search on x and a separate search on -x, negated (CPU torch loop; the Triton
    kernel's own test is in tests/test_formats_cuda.py)."""
    from moequant.formats import core

    spec = formats.parse_key(key)
    w, imp = weights(5)
    k = spec.group_size if spec.granularity == "group" else w.shape[-1]
    xg = w.unflatten(-1, (-1, k))
    impv = imp[:, None, :].unflatten(-1, (-1, k))
    s, z = core._search(spec, xg, impv, signed=True)
    plus, z_plus = core._search(spec, xg, impv)
    minus, _ = core._search(spec, -xg, impv)
    assert z is None and z_plus is None
    better = core._symmetric_error(spec, xg, impv, -minus) < core._symmetric_error(spec, xg, impv, plus)
    assert torch.equal(s, torch.where(better, -minus, plus))
    assert 0.1 < better.float().mean() < 0.9  # each sign wins somewhere: the test can tell them apart


@pytest.mark.parametrize("key", ["int4-g32-sym", "int4-g128-sym", "int3-g64-sym", "int2-g32-sym"])
def test_searched_grid_chooses_the_scale_sign_of_symmetric_groups(key):
    """A negative scale mirrors the grid -2^(B-1)..2^(B-1)-1: the searched grid of a symmetric group format
    takes it where its error is smaller, which is a real gain over positive scales alone (float64), and
    every reader's w = q * s gives the dequantized values; int8 per channel keeps positive scales."""
    spec = formats.parse_key(key)
    w, imp = weights(3)
    q = formats.quantize(w, spec, grid="searched", importance=imp)
    x = groups_of(w, spec.group_size)
    wt = groups_of(imp[:, None, :].expand_as(w), spec.group_size)
    s = q.scales.double().numpy()
    ours = werr(x, wt, s, np.zeros_like(s), spec.bits)
    positive = reference_search(x, wt, spec.bits, True, signed=False)
    assert 0.15 < (s < 0).mean() < 0.85, (s < 0).mean()
    assert ours.sum() < 0.97 * positive.sum(), ours.sum() / positive.sum()
    assert np.all(ours <= positive * (1 + 1e-6) + 1e-12)
    # the all-positive group's extreme is positive: its best grid is the mirrored one
    group = 32 // spec.group_size if spec.group_size <= 32 else 0
    if spec.group_size == 32:
        assert s[1, 2, group] < 0
    # codes and scales as stored give the dequantized weight (w = q * s, float64)
    codes = q.codes.double().numpy().reshape(x.shape)
    assert np.array_equal(q.dequantize(torch.float64).numpy().reshape(x.shape), codes * s[..., None])
    q8 = formats.quantize(w, "int8-channel", grid="searched", importance=imp)
    assert (q8.scales > 0).all()
