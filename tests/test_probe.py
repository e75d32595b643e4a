"""Per-layer KL probe: measured KL against the whole transformers model, and its use by the policy."""

from __future__ import annotations

import json
import math
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from support.plain import plain_settings
from tiny import build_tiny

from moequant import formats
from moequant.errors import UserError
from moequant.measure.calibrate import calibrate
from moequant.measure.data import Sample
from moequant.measure.probe import choose_probe_format, probe_algorithm_for, probe_indices
from moequant.measure.stats import LayerStats, Stats, load_stats
from moequant.plan.policy import make_plan
from moequant.plan.recipe import recipe_from_dict
from moequant.plan.summary import format_summary

SEQ, N, BS = 16, 4, 2
FORMATS = ("int8-channel", "int4-g32-sym", "int2-g32-asym")


def make_samples(seed=0, n=N):
    g = torch.Generator().manual_seed(seed)
    return [Sample(torch.randint(0, 96, (SEQ,), generator=g), "prose", "test") for _ in range(n)]


def settings(**kw):
    return plain_settings(
        **{"samples": N, "seq_len": SEQ, "batch_size": BS, "formats": FORMATS, "probe_samples": N, **kw}
    )


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_probe")
    return {mt: build_tiny(mt, root / mt, seed=2) for mt in ("qwen2_moe", "mixtral")}


def logits_of(directory, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=ids).logits.double()


def kl_mean(ref: torch.Tensor, q: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(q, -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def gptq_reference(stats, L, original, spec, min_tokens):
    """Qwen2-MoE on-disk names -> GPTQ-dequantized weights, Hessians chosen from the statistics: an expert's own
    when it has min_tokens routed tokens (gate/up's shrunk toward the all-token one by the default prior of d
    tokens: (n H_own + d H_all) / (n + d)), else the all-token one."""
    from moequant.algorithms.gptq import gptq
    from moequant.measure.settings import HESSIAN_PRIOR

    ls, out = stats.layers[L], {}
    for proj in ("gate", "up", "down"):
        names = [f"model.layers.{L}.mlp.experts.{e}.{proj}_proj.weight" for e in range(ls.num_experts)]
        W = torch.stack([original[n].float() for n in names])
        n = ls.input_tokens(proj, routed=True)
        own = n >= min_tokens
        assert 0 < int(own.sum()) < ls.num_experts  # both Hessian choices are exercised
        mine = ls.hessian(proj, routed=True)
        if proj != "down":
            k = HESSIAN_PRIOR * W.shape[-1]
            w = (n.double() / (n.double() + k))[:, None, None]
            mine = (w * mine.double() + (1 - w) * ls.hessian(proj).double()).float()
        H = torch.where(own[:, None, None], mine, ls.hessian(proj))
        q, _ = gptq(W, H, spec, act_order=True, static_groups=True)
        out.update(zip(names, q.dequantize(torch.float32)))
    return out


@pytest.mark.parametrize(
    "model_type,algorithm,projections",
    [("qwen2_moe", "rtn", False), ("mixtral", "rtn", True), ("qwen2_moe", "gptq", True)],
)
def test_probe_kl_equals_the_whole_model_with_layers_quantized(tiny_dirs, tmp_path, model_type, algorithm, projections):
    """Independent reference: copies of the checkpoint whose routed experts are replaced by their
    RTN- (or GPTQ-) dequantized weights (float32) in one layer (`kl_alone`), in every MoE layer
    (`kl_all`) and in every MoE layer but one (`kl_all_but_this`), and (`projections`) one
    projection of one layer alone, run whole by transformers, KL in float64. The layer's `kl` is the
    mean of its two measured shares of the KL."""
    from moequant.arch import adapter_for
    from moequant.io.checkpoint import open_checkpoint

    d = tiny_dirs[model_type]
    samples = make_samples()
    min_tokens = 20
    out = calibrate(
        str(d),
        tmp_path / "stats",
        settings(probe_algorithm=algorithm, min_tokens=min_tokens, save_hessians=True, probe_projections=projections),
        samples=samples,
        progress=False,
    )
    probe = json.loads((out / "probe.json").read_text())
    if algorithm == "gptq":  # without saved Hessians the probe reads calibration's scratch copy, then it is gone
        lean = calibrate(
            str(d),
            tmp_path / "lean",
            settings(probe_algorithm=algorithm, min_tokens=min_tokens, probe_projections=projections),
            samples=samples,
            progress=False,
        )
        assert json.loads((lean / "probe.json").read_text()) == probe
        assert not list(lean.rglob("hessians_*")) and not (lean / ".work").exists()
    assert probe["algorithm"] == algorithm and probe["held_out"] is False  # caller-given samples: in sample
    assert probe == load_stats(out).probe
    ids = torch.stack([s.input_ids for s in samples])
    ref = logits_of(d, ids)
    original = load_file(str(d / "model.safetensors"))
    layers = sorted(
        {int(m.group(1)) for k in original if (m := re.match(r"model\.layers\.(\d+)\..*experts\.\d+\.", k))}
    )
    assert len(layers) >= 2
    assert sorted(map(int, probe["layers"])) == layers and probe["tokens"] == N * SEQ
    stats = load_stats(out)
    spec = formats.parse_key("int4-g32-sym")
    replaced = {}
    for L in layers:
        assert probe["layers"][str(L)]["format"] == spec.key
        if algorithm == "gptq":
            replaced[L] = gptq_reference(stats, L, original, spec, min_tokens)
        else:
            replaced[L] = {
                name: formats.quantize(w.float(), spec).dequantize(torch.float32)
                for name, w in original.items()
                if re.match(rf"model\.layers\.{L}\.\w+\.experts\.\d+\.\w+\.weight$", name)
            }
        assert len(replaced[L]) == 3 * stats.layers[L].num_experts

    proj_of = adapter_for(open_checkpoint(d).config).classify

    def kl_with(quantized_layers, proj=None) -> float:
        copy = tmp_path / ("q" + "_".join(map(str, quantized_layers)) + (proj or ""))
        shutil.copytree(d, copy)
        tensors = dict(original)
        for L in quantized_layers:
            tensors.update({n: w for n, w in replaced[L].items() if proj in (None, proj_of(n).proj)})
        save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
        return kl_mean(ref, logits_of(copy, ids))

    # the random tiny models' KLs are ~1e-8: float32 logits agree with transformers' to ~1e-6 of that
    close = lambda x: pytest.approx(x, rel=1e-4, abs=0)
    kl_all = kl_with(layers)
    assert probe["kl_all"] == close(kl_all)
    for L in layers:
        entry = probe["layers"][str(L)]
        alone, all_but = kl_with([L]), kl_with([M for M in layers if M != L])
        assert alone > 0
        assert entry["kl_alone"] == close(alone)
        assert entry["kl_all_but_this"] == close(all_but)
        assert entry["restore_gain"] == pytest.approx(kl_all - all_but, rel=1e-3, abs=1e-4 * kl_all)
        assert entry["kl"] == pytest.approx((alone + max(kl_all - all_but, 0.0)) / 2, rel=1e-3)
        # the predicted loss: usage (floored at 5% of uniform) x summed sensitivity, in float64
        ls = stats.layers[L]
        counts = ls.routed_count.double().numpy()
        usage = np.maximum(counts / ls.tokens, 0.05 * ls.top_k / counts.size)
        sens = sum(ls.sensitivity[p][entry["format"]].double().numpy() for p in ("gate", "up", "down"))
        assert entry["predicted_loss"] == pytest.approx(float(usage @ sens), rel=1e-12)
        assert entry["scale"] == pytest.approx(entry["kl"] / entry["predicted_loss"], rel=1e-12)
        if not projections:
            assert "projections" not in entry
            continue
        assert set(entry["projections"]) == {"gate", "up", "down"}
        for p, measured in entry["projections"].items():
            alone_p = kl_with([L], p)
            assert 0 < alone_p < alone
            assert measured["kl_alone"] == close(alone_p)
            own = float(usage @ ls.sensitivity[p][entry["format"]].double().numpy())
            assert measured["predicted_loss"] == pytest.approx(own, rel=1e-12)


def test_probe_samples_setting_is_fingerprinted_and_zero_disables(tiny_dirs, tmp_path):
    d = str(tiny_dirs["qwen2_moe"])
    out = calibrate(d, tmp_path / "s", settings(probe_samples=0), samples=make_samples(), progress=False)
    assert not (out / "probe.json").exists() and load_stats(out).probe is None and load_stats(out).layer_scale == {}
    with pytest.raises(UserError, match="other settings"):  # a changed probe setting is not silently reused
        calibrate(d, tmp_path / "s", settings(probe_samples=2), samples=make_samples(), progress=False)
    calibrate(d, tmp_path / "s", settings(probe_samples=2), samples=make_samples(), progress=False, overwrite=True)
    s = load_stats(out)
    assert s.probe["samples"] == 2 and s.probe["tokens"] == 2 * SEQ
    assert s.layer_scale == {int(L): v["scale"] for L, v in s.probe["layers"].items()}


def test_resume_after_a_kill_during_the_probe(tiny_dirs, tmp_path, monkeypatch):
    from moequant.measure import probe as probe_module

    d = str(tiny_dirs["mixtral"])
    whole = calibrate(d, tmp_path / "whole", settings(), samples=make_samples(), progress=False)
    real = probe_module.run_probe

    def dying(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(probe_module, "run_probe", dying)
    with pytest.raises(KeyboardInterrupt):
        calibrate(d, tmp_path / "resumed", settings(), samples=make_samples(), progress=False)
    assert not (tmp_path / "resumed" / "summary.json").exists()
    monkeypatch.setattr(probe_module, "run_probe", real)
    resumed = calibrate(d, tmp_path / "resumed", settings(), samples=make_samples(), progress=False)
    assert json.loads((resumed / "probe.json").read_text()) == json.loads((whole / "probe.json").read_text())


def test_probe_format_and_sample_choice():
    shapes = [(32, 64), (32, 64), (64, 32)]
    assert (
        choose_probe_format(["int8-channel", "int4-g32-sym", "int3-g32-asym", "int2-g32-asym"], shapes)
        == "int4-g32-sym"
    )
    assert choose_probe_format(["int8-channel", "mxfp4", "int4-g32-sym"], shapes) == "mxfp4"  # 4.25 < 4.5 bits
    assert choose_probe_format(["int3-g32-asym", "int2-g32-asym"], shapes) == "int2-g32-asym"  # none >= 4 bits
    assert choose_probe_format(["int4-g128-sym", "int8-channel"], shapes) == "int8-channel"  # g128 cannot hold 64
    assert probe_indices(10, 4) == [0, 3, 6, 9] and probe_indices(3, 8) == [0, 1, 2] and probe_indices(5, 0) == []
    assert probe_algorithm_for("gptq") == "gptq" and probe_algorithm_for("gptq", hessians=False) == "rtn"
    with pytest.raises(UserError, match="accepted: rtn, gptq"):
        probe_algorithm_for("awq")


# ---------------------------------------------------------------------------------------------
# The policy's use of the scales (hand-built statistics)

H, I, E = 64, 32, 4


def tensors(layers=2):
    out = []
    for L in range(layers):
        for e in range(E):
            for proj in ("gate", "up", "down"):
                shape = (H, I) if proj == "down" else (I, H)
                out.append((f"model.layers.{L}.mlp.experts.{e}.{proj}_proj.weight", "routed_expert", L, e, proj, shape))
    return out


def hand_stats(probe_kl=None, layers=2):
    """Layer 1's predicted losses are 3x layer 0's; the probe (when given) says the opposite."""
    out = {}
    for L in range(layers):
        t = {"routing.count": torch.tensor([400, 300, 200, 100], dtype=torch.int64)}
        for proj in ("gate", "up", "down"):
            base = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64) * (1 + 2 * L)
            t[f"sensitivity.{proj}.int4-g32-sym"] = base
            t[f"sensitivity.{proj}.int8-channel"] = base / 50
        out[L] = LayerStats(L, 2, 500, t)
    probe = None
    if probe_kl is not None:
        probe = {
            "schema": "moequant.calib.probe/1",
            "samples": 2,
            "tokens": 64,
            "usage_floor": 0.05,
            "layers": {
                str(L): {"format": "int4-g32-sym", "kl": kl, "predicted_loss": None, "scale": None}
                for L, kl in probe_kl.items()
            },
        }
    return Stats(None, {}, out, probe=probe)


def recipe(experts, target="vllm"):
    return recipe_from_dict({"target": target, "formats": {"int4": {"group_size": 32}}, "experts": experts}, "t.yaml")


def half_way():
    """A vLLM budget with room for exactly one int8 layer."""
    int4 = make_plan(recipe({"method": "uniform", "format": "int4"}), tensors(), None).summary["routed_bytes"]
    int8 = make_plan(recipe({"method": "uniform", "format": "int8"}), tensors(), None).summary["routed_bytes"]
    numel = 2 * E * 3 * H * I
    return recipe(
        {"method": "budget", "formats": ["int8", "int4"], "budget": {"bits_per_weight": (int4 + int8) // 2 * 8 / numel}}
    )


def layer_formats(plan):
    return {L: keys.pop() for L, keys in plan.layer_formats().items()}


def test_layer_scales_reverse_the_solvers_layer_choice():
    r = half_way()
    plain = make_plan(r, tensors(), hand_stats())
    assert layer_formats(plain) == {0: "int4-g32-sym", 1: "int8-channel"}  # the larger predicted loss
    assert plain.summary["probe"]["used"] is False
    assert "probe not used" in format_summary(plain)
    probed = make_plan(r, tensors(), hand_stats({0: 0.02, 1: 0.005}))
    assert layer_formats(probed) == {0: "int8-channel", 1: "int4-g32-sym"}
    assert probed.summary["probe"]["used"] is True
    assert "per-layer KL probe used" in format_summary(probed)
    # scaled, a one-layer int4 plan's predicted loss is the probe's measured KL of that layer
    for L, kl in ((0, 0.02), (1, 0.005)):
        rules = recipe(
            {"method": "rules", "rules": [{"layers": L, "format": "int4"}, {"format": "bf16"}]}, target="transformers"
        )
        plan = make_plan(rules, tensors(), hand_stats({0: 0.02, 1: 0.005}))
        assert plan.summary["predicted_loss"] == pytest.approx(kl, rel=1e-12)
        # and every tensor's loss is its unscaled loss times the layer's scale
        unscaled = make_plan(rules, tensors(), hand_stats())
        scale = probed.summary["probe"]["layers"][str(L)]["scale"]
        for a, b in zip(plan.tensors, unscaled.tensors):
            if a.predicted_loss is not None:
                assert a.predicted_loss == pytest.approx(scale * b.predicted_loss, rel=1e-12)


def test_an_incomplete_probe_is_not_used():
    plan = make_plan(half_way(), tensors(), hand_stats({0: 0.02}))
    assert plan.summary["probe"] == {"used": False, "why": "the KL probe has no layer 1"}
    assert layer_formats(plan) == {0: "int4-g32-sym", 1: "int8-channel"}


@pytest.mark.parametrize("model_type", ["qwen2_moe", "mixtral"])
def test_tensor_probe_kl_equals_the_whole_model_with_one_tensor_quantized(tiny_dirs, tmp_path, model_type):
    """Independent reference for the per-tensor probe (non_experts.formats): a copy of the checkpoint
    with one non-expert weight replaced by its RTN-dequantized copy, run whole by transformers, KL in
    float64, for every probed tensor (attention, shared experts, lm_head) and format."""
    from moequant.measure.stats import TENSOR_PROBE_FILE

    d = tiny_dirs[model_type]
    samples = make_samples()
    keys = ("int4-g32-sym", "int8-channel")
    out = calibrate(str(d), tmp_path / "stats", settings(tensor_formats=keys), samples=samples, progress=False)
    probe = json.loads((out / TENSOR_PROBE_FILE).read_text())
    assert probe == load_stats(out).tensor_probe and probe["tokens"] == N * SEQ
    ids = torch.stack([s.input_ids for s in samples])
    ref = logits_of(d, ids)
    original = load_file(str(d / "model.safetensors"))
    expected = sorted(
        n for n in original if re.search(r"(self_attn\.\w_proj|shared_expert\.\w+_proj)\.weight$|^lm_head\.weight$", n)
    )
    assert sorted(probe["tensors"]) == expected and any("self_attn" in n for n in expected)
    if model_type == "qwen2_moe":
        assert any("shared_expert." in n for n in expected)
    for name in expected:
        holds = [k for k in keys if original[name].shape[-1] % (32 if k == "int4-g32-sym" else 1) == 0]
        assert sorted(probe["tensors"][name]) == sorted(holds)  # a format that cannot hold it is not offered
        for key in holds:
            copy = tmp_path / "one"
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(d, copy)
            w = formats.quantize(original[name].float(), formats.parse_key(key)).dequantize(torch.float32)
            save_file({**original, name: w}, str(copy / "model.safetensors"), metadata={"format": "pt"})
            # KLs near 1e-12 (near-lossless formats) differ by ~2e-16 between CPUs' BLAS kernels (AVX2 vs AVX-512)
            assert probe["tensors"][name][key] == pytest.approx(kl_mean(ref, logits_of(copy, ids)), rel=1e-4, abs=1e-14)


@pytest.mark.parametrize("probe", ["layers", "tensors"])
def test_probes_show_progress_step_by_step_and_finish_every_step(tiny_dirs, tmp_path, capsys, monkeypatch, probe):
    """Both probes (minutes on a CPU for GGUF's types) advance their bar per stream's forward through a layer and
    per stream's KL of a batch, and end with every step they announced done; in a log (no terminal, where rich
    draws nothing until the end) a plain line says how far they are, at least every PLAIN_EVERY_S seconds."""
    from moequant import progress as progress_module
    from moequant.arch import adapter_for
    from moequant.io.checkpoint import open_checkpoint
    from moequant.measure.probe import run_probe, run_tensor_probe

    bars = []
    real = progress_module.StepProgress

    class Recorded(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(progress_module, "StepProgress", Recorded)
    monkeypatch.setattr(progress_module, "PLAIN_EVERY_S", 0.0)  # every step a line
    d = tiny_dirs["qwen2_moe"]
    ckpt = open_checkpoint(d)
    adapter = adapter_for(ckpt.config)
    ids = torch.stack([s.input_ids for s in make_samples()])
    if probe == "tensors":
        run_tensor_probe(ckpt, adapter, ids, ("int8-channel", "int4-g32-sym"), batch_size=BS, progress=True)
        label = r"probing \d+ tensor formats"
    else:
        stats = calibrate(str(d), tmp_path / "stats", settings(probe_samples=0), samples=make_samples(), progress=False)
        run_probe(ckpt, adapter, ids, stats, ("int4-g32-sym",), batch_size=BS, projections=True, progress=True)
        label = "probing layers"
    (bar,) = bars
    assert bar.done == bar.total > 4 * adapter.num_layers  # finer than one step per layer
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == bar.total and re.fullmatch(rf"{label}: {bar.total}/{bar.total} steps, \d+ s", lines[-1])


def test_probe_kl_equals_float64_log_softmax_kl_with_masked_logits():
    """The probes' KL (from the change of the logits) against KL from two float64 log-softmaxes, for large, small
    and tiny perturbations, with vocabulary entries both sides mask (-inf: probability 0, no term, not NaN)."""
    from moequant.measure.probe import _kl_sums

    class Runner:
        def finish(self, b, h):
            return h

    g = torch.Generator().manual_seed(1)
    W = torch.randn(50, 16, generator=g)

    def head(h):
        z = h @ W.T
        z[..., :3] = float("-inf")
        return z

    def kl64(h, q):
        lp, lq = torch.log_softmax(head(h).double(), -1), torch.log_softmax(head(q).double(), -1)
        return float(torch.where(lp > float("-inf"), lp.exp() * (lp - lq), 0.0).sum())

    ref = [torch.randn(2, 7, 16, generator=g) for _ in range(2)]
    for scale in (3.0, 1e-2, 1e-5):
        streams = [h + scale * torch.randn(h.shape, generator=g) for h in ref]
        got = _kl_sums(Runner(), head, ref, {"s": streams})["s"]
        assert math.isfinite(got) and got == pytest.approx(sum(map(kl64, ref, streams)), rel=1e-6)


def test_probe_kl_reports_progress_within_a_batch_not_only_at_its_end(monkeypatch):
    """The KL of many streams goes block by block of positions (each block for every stream); its progress steps
    (one per stream and batch) are spread over the blocks as they finish, so a batch whose blocks take tens of
    seconds on a CPU shows progress during it, and every step is still taken once."""
    from moequant.measure import probe

    class Runner:
        def finish(self, b, h):
            return h

    g = torch.Generator().manual_seed(0)
    W = torch.randn(32, 8, generator=g)
    calls = []

    def head(h):
        calls.append("head")
        return h @ W.T

    monkeypatch.setattr(probe, "KL_BLOCK_ELEMENTS", 4 * 32)  # 4 positions per block: 10 blocks of 40 positions
    ref = [torch.randn(2, 20, 8, generator=g)]
    streams = {i: [ref[0] + 0.1 * torch.randn(ref[0].shape, generator=g)] for i in range(5)}
    got = probe._kl_sums(Runner(), head, ref, streams, lambda: calls.append("step"))
    assert calls.count("step") == len(streams)  # one per stream and batch
    first, last = calls.index("step"), len(calls) - 1 - calls[::-1].index("head")
    assert first < last / 2  # the first step comes in the first half of the batch's work, not at its end
    assert got.keys() == streams.keys() and all(v > 0 for v in got.values())
