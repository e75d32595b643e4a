"""Calibration runner: exact routing counts, float64 statistics, coverage modes, resume, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from support.plain import plain_settings
from tiny import TINY_CONFIGS, build_tiny

from moequant.arch import adapter_for
from moequant.cli import main
from moequant.errors import UserError
from moequant.io.checkpoint import open_checkpoint
from moequant.measure.calibrate import calibrate
from moequant.measure.data import Sample
from moequant.measure.stats import load_stats

SEQ, N, BS = 24, 6, 3
FORMATS = ("int8-channel", "fp8-channel")


def make_samples(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Sample(torch.randint(0, 96, (SEQ,), generator=g), "code" if i % 2 else "prose", "test") for i in range(N)]


def settings(**kw):
    base = dict(samples=N, seq_len=SEQ, batch_size=BS, formats=FORMATS)
    base.update(kw)
    return plain_settings(**base)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_cal")
    return {mt: build_tiny(mt, root / mt, seed=1) for mt in TINY_CONFIGS}


def reference_pass(directory, samples):
    """The unmodified transformers model, hooked: routing indices and expert inputs per MoE layer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    adapter = adapter_for(open_checkpoint(directory).config)
    seen = {L: {"indices": [], "x": []} for L in adapter.moe_layers}
    hooks = []
    for L in adapter.moe_layers:
        mlp = model.model.layers[L].mlp
        hooks.append(
            adapter.router_module(mlp).register_forward_hook(
                lambda m, a, out, L=L: seen[L]["indices"].append(out[2].reshape(-1, adapter.top_k))
            )
        )
        hooks.append(
            mlp.experts.register_forward_pre_hook(
                lambda m, a, L=L: seen[L]["x"].append(a[0].reshape(-1, a[0].shape[-1]).double())
            )
        )
    ids = torch.stack([s.input_ids for s in samples])
    model = model.float()
    with torch.no_grad():
        for batch in torch.split(ids, BS):
            model(input_ids=batch)
    for h in hooks:
        h.remove()
    return adapter, model, {L: (torch.cat(v["indices"]), torch.cat(v["x"])) for L, v in seen.items()}


@pytest.mark.parametrize("model_type", list(TINY_CONFIGS))
def test_routing_counts_and_statistics_match_an_independent_hook(tiny_dirs, tmp_path, model_type):
    samples = make_samples()
    out = calibrate(
        str(tiny_dirs[model_type]), tmp_path / "stats", settings(save_hessians=True), samples=samples, progress=False
    )
    stats = load_stats(out)
    # by default the statistics keep only the Hessians' diagonals, equal to the full ones'
    lean = load_stats(
        calibrate(str(tiny_dirs[model_type]), tmp_path / "lean", settings(), samples=samples, progress=False)
    )
    for L, ls in lean.layers.items():
        assert not [k for k in ls.tensors if k.startswith(("hessian.", "hessian_routed."))]
        for group in ("gate_up", "down"):
            for kind in ("hessian", "hessian_routed"):
                full = stats.layers[L].tensors[f"{kind}.{group}"]
                assert torch.equal(ls.tensors[f"{kind}_diag.{group}"], torch.diagonal(full, dim1=-2, dim2=-1))
        for k, v in ls.tensors.items():
            if k.startswith("sensitivity."):
                assert torch.equal(v, stats.layers[L].tensors[k]), k
    adapter, model, ref = reference_pass(tiny_dirs[model_type], samples)
    assert sorted(stats.layers) == adapter.moe_layers
    domains = torch.tensor([s.domain == "code" for s in samples]).repeat_interleave(SEQ)
    for L, (indices, x) in ref.items():
        s = stats.layers[L]
        E = adapter.num_experts
        assert torch.equal(s.routed_count, torch.bincount(indices.reshape(-1), minlength=E))
        assert torch.equal(s.tensors["routing.count.code"], torch.bincount(indices[domains].reshape(-1), minlength=E))
        assert s.tokens == N * SEQ and abs(float(s.share.sum()) - 1) < 1e-12
        assert torch.equal(s.rank_count.sum(1), s.routed_count)
        # all-experts Hessian of gate/up = XᵀX / n over every token (float64 reference)
        H = x.T @ x / x.shape[0]
        torch.testing.assert_close(s.hessian("gate").double(), H.expand(E, -1, -1), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(s.tensors["input.gate_up.sq_mean"][0], torch.diagonal(H), rtol=1e-6, atol=1e-9)
        experts = model.model.layers[L].mlp.experts
        for e in range(E):
            routed = (indices == e).any(1)
            xe = x[routed]
            He = xe.T @ xe / max(xe.shape[0], 1)
            torch.testing.assert_close(s.hessian("up", routed=True)[e].double(), He, rtol=1e-4, atol=1e-6)
            with torch.no_grad():
                h = adapter.expert_hidden(experts, x.float(), e).double()
            torch.testing.assert_close(s.hessian("down")[e].double(), h.T @ h / h.shape[0], rtol=1e-4, atol=1e-6)
            assert int(s.input_tokens("down", routed=True)[e]) == int(routed.sum())
        # sensitivity = tr(ΔW H ΔWᵀ) with the routed Hessian when the expert has enough tokens
        for proj in ("gate", "down"):
            for key, value in s.sensitivity[proj].items():
                assert value.shape == (E,) and torch.isfinite(value).all() and (value >= 0).all()
    assert (out / "routing.png").stat().st_size > 1000


def test_routed_only_mode_differs_only_where_it_should(tiny_dirs, tmp_path):
    d = str(tiny_dirs["qwen2_moe"])
    a = load_stats(
        calibrate(d, tmp_path / "all", settings(save_hessians=True), samples=make_samples(), progress=False)
    ).layers
    r = load_stats(
        calibrate(
            d,
            tmp_path / "routed",
            settings(all_experts=False, save_hessians=True),
            samples=make_samples(),
            progress=False,
        )
    ).layers
    for L in a:
        for k, v in r[L].tensors.items():
            if k.startswith(("routing.", "input_routed.", "hessian_routed.")):
                assert torch.equal(v, a[L].tensors[k]), k
        assert torch.equal(r[L].tensors["hessian.down"], r[L].tensors["hessian_routed.down"])
        assert not torch.equal(a[L].tensors["hessian.down"], a[L].tensors["hessian_routed.down"])
        assert (a[L].tensors["input.down.tokens"] == N * SEQ).all()


def test_resume_after_interruption_gives_identical_statistics(tiny_dirs, tmp_path, monkeypatch):
    d = str(tiny_dirs["deepseek_v3"])
    whole = calibrate(d, tmp_path / "whole", settings(), samples=make_samples(), progress=False)
    from moequant.io import layers

    real_forward = layers.LayerRunner.forward
    calls = {"n": 0}

    def dying_forward(self, module, layer, hidden, before_batch=None):
        if layer == 2:
            raise KeyboardInterrupt  # as if killed while layer 2 runs
        calls["n"] += 1
        return real_forward(self, module, layer, hidden, before_batch)

    monkeypatch.setattr(layers.LayerRunner, "forward", dying_forward)
    with pytest.raises(KeyboardInterrupt):
        calibrate(d, tmp_path / "resumed", settings(), samples=make_samples(), progress=False)
    assert not (tmp_path / "resumed" / "summary.json").exists()
    assert json.loads((tmp_path / "resumed" / ".work" / "progress.json").read_text())["next_layer"] == 2
    monkeypatch.setattr(layers.LayerRunner, "forward", real_forward)
    seen = []
    monkeypatch.setattr(
        layers.LayerRunner,
        "forward",
        lambda self, m, layer, h, before_batch=None: (
            seen.append(layer) or real_forward(self, m, layer, h, before_batch)
        ),
    )
    resumed = calibrate(d, tmp_path / "resumed", settings(), samples=make_samples(), progress=False)
    assert seen == [2]  # only the unfinished layer ran again
    a, b = load_stats(whole).layers, load_stats(resumed).layers
    for L in a:
        assert a[L].tensors.keys() == b[L].tensors.keys()
        for k in a[L].tensors:
            assert torch.equal(a[L].tensors[k], b[L].tensors[k]), k


def test_bad_input(tiny_dirs, tmp_path):
    d = str(tiny_dirs["mixtral"])
    with pytest.raises(UserError, match="max_position_embeddings"):
        calibrate(d, tmp_path / "s", settings(seq_len=10_000), samples=make_samples(), progress=False)
    calibrate(d, tmp_path / "s", settings(), samples=make_samples(), progress=False)
    with pytest.raises(UserError, match="another model.*--overwrite"):
        calibrate(str(tiny_dirs["olmoe"]), tmp_path / "s", settings(), samples=make_samples(), progress=False)
    calibrate(
        str(tiny_dirs["olmoe"]), tmp_path / "s", settings(), samples=make_samples(), progress=False, overwrite=True
    )
    assert load_stats(tmp_path / "s").summary["model_type"] == "olmoe"
    # the CLI: a model without tokenizer files is one sentence, exit 2
    result = CliRunner().invoke(
        main, ["calibrate", "--model", d, "--output", str(tmp_path / "c"), "--samples", "2", "--seq-len", "8"]
    )
    assert result.exit_code == 2 and "tokenizer" in result.output


@pytest.mark.parametrize(
    "zoo_name",
    [
        "tiny-mixtral",
        "tiny-qwen2moe",
        *(pytest.param(n, marks=pytest.mark.slow) for n in ("tiny-qwen3moe", "tiny-deepseek-v3")),
    ],
)
def test_zoo_routing_counts_match_an_independent_hook(tmp_path, zoo_name):
    """Real data through a trained zoo model: exact counts, and experts specialise by domain."""
    from moequant import zoo
    from moequant.io.checkpoint import load_tokenizer
    from moequant.measure.data import load_samples

    directory = zoo.path(zoo_name)
    samples = load_samples("builtin:stdlib-code", load_tokenizer(directory), N, 64, seed=3)
    out = calibrate(f"zoo:{zoo_name}", tmp_path / "s", settings(seq_len=64), samples=samples, progress=False)
    stats = load_stats(out)
    _, _, ref = reference_pass(directory, samples)
    for L, (indices, _) in ref.items():
        E = stats.layers[L].num_experts
        assert torch.equal(stats.layers[L].routed_count, torch.bincount(indices.reshape(-1), minlength=E))


def test_caller_given_samples_are_reused_when_identical_and_refused_when_not(tiny_dirs, tmp_path):
    """The same pre-tokenised samples reuse the statistics (no file rewritten); other samples are
    other settings: refused without overwrite, recomputed with it."""
    d = str(tiny_dirs["mixtral"])
    out = tmp_path / "stats"
    calibrate(d, out, settings(), samples=make_samples(), progress=False)
    files = {p: p.stat().st_mtime_ns for p in out.glob("*") if p.is_file()}
    calibrate(d, out, settings(), samples=make_samples(), progress=False)
    assert {p: p.stat().st_mtime_ns for p in out.glob("*") if p.is_file()} == files
    with pytest.raises(UserError, match="other settings"):
        calibrate(d, out, settings(), samples=make_samples(seed=1), progress=False)
    calibrate(d, out, settings(), samples=make_samples(seed=1), overwrite=True, progress=False)
    assert json.loads((out / "summary.json").read_text())["fingerprint"]["dataset"] != "builtin:mix"
    assert {p: p.stat().st_mtime_ns for p in out.glob("*") if p.is_file()} != files


def test_statistics_of_an_earlier_fingerprint_version_are_made_again_once(tiny_dirs, tmp_path, capsys):
    """Statistics whose fingerprint has no version (moequant before FINGERPRINT_VERSION, which wrote fields
    only away from their first defaults) cannot be compared with this run's settings: a rerun calibrates
    again, says so in one line, and reuses the new statistics after that. Another model's stay refused."""
    from moequant.measure.settings import FINGERPRINT_VERSION

    d = str(tiny_dirs["mixtral"])
    out = tmp_path / "stats"
    calibrate(d, out, settings(), samples=make_samples(), progress=False)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["fingerprint"]["version"] == FINGERPRINT_VERSION
    old = {k: v for k, v in summary["fingerprint"].items() if k not in ("version", "gptq", "gpu_math")}
    (out / "summary.json").write_text(json.dumps({**summary, "fingerprint": old}))
    with pytest.raises(UserError, match="another model.*--overwrite"):
        calibrate(str(tiny_dirs["olmoe"]), out, settings(), samples=make_samples(), progress=False)
    capsys.readouterr()
    calibrate(d, out, settings(), samples=make_samples(), progress=False)
    said = capsys.readouterr().out.splitlines()
    assert (
        len(said) == 1 and "earlier moequant (fingerprint version 1, now" in said[0] and "calibrating again" in said[0]
    )
    assert json.loads((out / "summary.json").read_text()) == summary
    calibrate(d, out, settings(), samples=make_samples(), progress=False)
    assert capsys.readouterr().out == ""  # made once: reused from now on


def test_sensitivity_is_on_the_grid_the_quantize_pass_rounds_onto(tiny_dirs, tmp_path):
    """sensitivity.<proj>.<format> = tr(ΔW H ΔWᵀ) per expert in float64, ΔW on the recipe's GPTQ grid for integer
    group formats (searched: weighted by diag(H), symmetric scale signs chosen) and on the min/max rule for int8
    per channel; as published (min/max grid) every format is on its min/max rule."""
    from moequant import formats
    from moequant.algorithms.registry import GptqOptions
    from moequant.measure.settings import HessianRule
    from moequant.measure.stats import chosen_hessian

    src = str(tiny_dirs["qwen2_moe"])
    keys = ("int4-g32-sym", "int8-channel")
    runs = {
        grid: load_stats(
            calibrate(
                src,
                tmp_path / grid,
                settings(save_hessians=True, formats=keys, gptq=GptqOptions(grid=grid)),
                samples=make_samples(),
                progress=False,
            )
        )
        for grid in ("searched", "minmax")
    }
    ckpt = open_checkpoint(src)
    adapter = adapter_for(ckpt.config)
    for grid, stats in runs.items():
        for L in adapter.moe_layers:
            for proj in adapter.projections:
                w = adapter.read_experts(ckpt, L, proj).double()
                group = "down" if proj == "down" else "gate_up"
                _, h = chosen_hessian(stats.layers[L].tensors, group, torch.arange(w.shape[0]), HessianRule(64))
                h = h.double()
                for key in keys:
                    if key == "int4-g32-sym" and grid == "searched":
                        imp = torch.diagonal(h, dim1=-2, dim2=-1).float()
                        q = formats.quantize(w.float(), key, grid="searched", importance=imp)
                        assert bool((q.scales < 0).any())
                    else:
                        q = formats.quantize(w.float(), key)
                    dw = w - q.dequantize(torch.float64)
                    want = torch.einsum("eoi,eij,eoj->e", dw, h, dw)
                    got = stats.layers[L].sensitivity[proj][key]
                    torch.testing.assert_close(got.double(), want, rtol=1e-9, atol=0)
    for L in adapter.moe_layers:  # the searched grid's predicted error is the smaller
        s, m = runs["searched"].layers[L].sensitivity, runs["minmax"].layers[L].sensitivity
        assert all(float(s[p]["int4-g32-sym"].sum()) < 0.9 * float(m[p]["int4-g32-sym"].sum()) for p in s)
        assert all(torch.equal(s[p]["int8-channel"], m[p]["int8-channel"]) for p in s)


def test_an_expert_s_own_gate_up_hessian_is_shrunk_toward_the_layer_s(tmp_path):
    """stats.chosen_hessian with calibration.hessian_prior: an expert with n >= min_tokens routed tokens gets
    (n H_own + k H_all) / (n + k), k = prior x d (float64 reference); below min_tokens the all-token one, as
    before; prior 0, down's Hessians and a layer without a shared all-token Hessian keep the own one."""
    from moequant.measure.settings import HessianRule
    from moequant.measure.stats import chosen_hessian

    g = torch.Generator().manual_seed(0)
    E, d = 4, 6

    def spd(n):
        a = torch.randn(n, d, 3 * d, generator=g, dtype=torch.float64)
        return a @ a.transpose(1, 2) / (3 * d)

    own_h, all_h = spd(E), spd(1)
    tokens = torch.tensor([3, 10, 100, 1000])
    stats = {
        "hessian_routed.gate_up": own_h.float(),
        "hessian.gate_up": all_h.float(),
        "input_routed.gate_up.tokens": tokens,
        "hessian_routed.down": own_h.float(),
        "hessian.down": spd(E).float(),
        "input_routed.down.tokens": tokens,
    }
    for prior in (0.5, 2.0):
        own, h = chosen_hessian(stats, "gate_up", [0, 1, 2, 3], HessianRule(8, prior))
        assert own.tolist() == [False, True, True, True]
        k = prior * d
        expected = [all_h[0]] + [(n * own_h[e] + k * all_h[0]) / (n + k) for e, n in [(1, 10), (2, 100), (3, 1000)]]
        for e in range(E):
            assert torch.allclose(h[e].double(), expected[e], rtol=1e-6, atol=1e-7), (prior, e)
        assert not torch.allclose(h[1].double(), own_h[1], rtol=1e-3)  # it did move
    _, h0 = chosen_hessian(stats, "gate_up", [1, 3], HessianRule(8, 0))
    assert torch.equal(h0, own_h[[1, 3]].float())
    _, hd = chosen_hessian(stats, "down", [1, 3], HessianRule(8, 2.0))
    assert torch.equal(hd, own_h[[1, 3]].float())
    per_expert = {**stats, "hessian.gate_up": own_h.float()}  # no all-experts coverage: hessian.* is per expert
    _, hp = chosen_hessian(per_expert, "gate_up", [1, 3], HessianRule(8, 2.0))
    assert torch.equal(hp, own_h[[1, 3]].float())
