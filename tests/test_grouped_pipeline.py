"""The batched expert math the calibration and quantize passes use, against transformers' own.

- `experts_hidden` (one batched matmul for a chunk of experts) equals transformers' eager
  per-expert math, and the MoE block rebuilt from it equals transformers' block, on every adapter;
- the statistics collected from the experts module's own inputs do not depend on the experts
  implementation the layer runs (eager loop or grouped_mm): every expert gets its statistics and
  its routed token count equals the router's (a grouped kernel bypasses per-Linear hooks: ModelOpt
  had exactly that bug);
- on CUDA (skipped elsewhere, with that reason): the bf16 grouped_mm collector agrees with the
  float32 CPU one.
"""

from __future__ import annotations

import pytest
import torch
from tiny import TINY_CONFIGS, build_tiny

from moequant.arch import adapter_for
from moequant.io.checkpoint import open_checkpoint
from moequant.io.layers import LayerRunner
from moequant.measure.calibrate import LayerCollector, collect_moe_stats

SEQ, N, BS = 16, 4, 2


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_grouped")
    return {mt: build_tiny(mt, root / mt, seed=3) for mt in TINY_CONFIGS}


def _ids(vocab=96):
    return torch.randint(0, vocab, (N, SEQ), generator=torch.Generator().manual_seed(5))


def _collect(directory, layer, implementation, device="cpu", dtype=torch.float32, **collector):
    ckpt = open_checkpoint(directory)
    adapter = adapter_for(ckpt.config)
    runner = LayerRunner(
        ckpt, adapter, _ids(), batch_size=BS, device=device, dtype=dtype, experts_implementation=implementation
    )
    hidden = runner.embedded
    for L in range(layer):  # carry the real inputs of `layer`
        with runner.materialized(L) as module:
            hidden = runner.forward(module, L, hidden)
    routed = []
    with runner.materialized(layer) as module:
        col = LayerCollector(
            adapter, module.mlp.experts, adapter.num_experts, adapter.top_k, [], True, True, **collector
        )
        hook = adapter.router_module(module.mlp).register_forward_hook(
            lambda m, a, out: routed.append(out[2].reshape(-1, adapter.top_k).cpu())
        )
        try:
            out = collect_moe_stats(runner, module, layer, col, hidden)
        finally:
            hook.remove()
        stats = {k: v.cpu() for k, v in col.finish().items()}
    return adapter, stats, torch.cat(routed), [o.cpu() for o in out]


@pytest.mark.parametrize("model_type", list(TINY_CONFIGS))
def test_experts_hidden_and_block_equal_transformers(tiny_dirs, model_type):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_dirs[model_type], dtype=torch.float32, experts_implementation="eager"
    )
    adapter = adapter_for(open_checkpoint(tiny_dirs[model_type]).config)
    L = adapter.moe_layers[0]
    mlp = model.model.layers[L].mlp
    x = torch.randn(40, adapter.hidden, generator=torch.Generator().manual_seed(1))
    ids = list(range(adapter.num_experts))
    with torch.no_grad():
        batched = adapter.experts_hidden(mlp.experts, x, ids)
        one_by_one = torch.stack([adapter.expert_hidden(mlp.experts, x, e) for e in ids])
        torch.testing.assert_close(batched, one_by_one, rtol=1e-5, atol=1e-6)
        # the block rebuilt from experts_hidden: route, run each token's experts, weight, sum
        captured = {}
        h = adapter.router_module(mlp).register_forward_hook(lambda m, a, out: captured.update(r=out))
        pre = mlp.experts.register_forward_pre_hook(
            lambda m, a, k: captured.update(x=(a[0] if a else k["hidden_states"])), with_kwargs=True
        )
        reference = mlp.experts(*_experts_args(adapter, mlp, x, captured))
        h.remove(), pre.remove()
        _, weights, indices = captured["r"]
        xin = captured["x"].reshape(-1, adapter.hidden)
        hid = adapter.experts_hidden(mlp.experts, xin, ids)  # [E, n, I]
        ours = torch.zeros_like(reference)
        for e in ids:
            tok, slot = (indices.reshape(-1, adapter.top_k) == e).nonzero(as_tuple=True)
            down = adapter.expert_from_module(mlp.experts, e, "down")  # [H, I]
            y = hid[e, tok] @ down.T
            if getattr(mlp.experts, "down_proj_bias", None) is not None:
                y = y + mlp.experts.down_proj_bias[e]
            ours.index_add_(0, tok, y * weights.reshape(-1, adapter.top_k)[tok, slot, None])
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-6)


def _experts_args(adapter, mlp, x, captured):
    """Run the router on x, then return the experts module's arguments (hidden, indices, weights)."""
    router = adapter.router_module(mlp)
    logits, weights, indices = router(x)
    return x, indices, weights


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_statistics_do_not_depend_on_the_experts_implementation(tiny_dirs, model_type):
    d = tiny_dirs[model_type]
    L = adapter_for(open_checkpoint(d).config).moe_layers[-1]
    adapter, eager, routed, out_eager = _collect(d, L, "eager")
    _, grouped, routed_g, out_grouped = _collect(d, L, "grouped_mm")
    E = adapter.num_experts
    assert torch.equal(routed, routed_g)
    counts = torch.bincount(routed.reshape(-1), minlength=E)
    for stats in (eager, grouped):
        assert torch.equal(stats["routing.count"], counts)  # every expert, counted as the router chose
        assert torch.equal(stats["input_routed.down.tokens"], counts)
        assert torch.equal(stats["input_routed.gate_up.tokens"], counts)
        assert (stats["input.down.tokens"] == N * SEQ).all()
        for key in ("hessian.down", "hessian_routed.down", "hessian_routed.gate_up"):
            # experts with tokens have a non-zero Hessian; with all-experts coverage, all of them
            nonzero = stats[key].flatten(1).abs().sum(1) > 0
            expected = counts > 0 if "routed" in key else torch.ones(E, dtype=torch.bool)
            assert torch.equal(nonzero, expected), key
    assert eager.keys() == grouped.keys()
    for k in eager:
        torch.testing.assert_close(grouped[k].double(), eager[k].double(), rtol=1e-4, atol=1e-6, msg=k)
    for a, b in zip(out_eager, out_grouped):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_type", list(TINY_CONFIGS))
@pytest.mark.parametrize("weighting", ["tokens", "routing"])
def test_experts_grouped_by_padded_batches_equal_one_expert_at_a_time(tiny_dirs, model_type, weighting, monkeypatch):
    """The routed statistics computed a group of experts at a time (tokens padded to the group's
    largest count, one batched matmul; what a GPU runs) equal the per-expert loop's (the CPU's),
    every key, biases (gpt-oss) and routing-weighted Hessians included; groups forced small so that
    one batch spans several, some of one expert."""
    import moequant.measure.collector as cal

    monkeypatch.setitem(cal.GROUPED_ELEMENTS, "cpu", 2**13)  # groups of 1 to 8 experts here
    d = tiny_dirs[model_type]
    L = adapter_for(open_checkpoint(d).config).moe_layers[-1]
    _, loop, routed, _ = _collect(d, L, "eager", grouped=False, hessian_weighting=weighting)
    _, grouped, routed_g, _ = _collect(d, L, "eager", grouped=True, hessian_weighting=weighting)
    assert torch.equal(routed, routed_g) and loop.keys() == grouped.keys()
    assert (torch.bincount(routed.reshape(-1)) > 0).sum() >= 2
    for k in loop:
        torch.testing.assert_close(grouped[k], loop[k], rtol=1e-5, atol=1e-7, msg=k)
    # a mutation check of the comparison itself: the routed Hessians are not all zero
    assert loop["hessian_routed.down"].abs().sum() > 0 and loop["hessian_routed.gate_up"].abs().sum() > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only: bf16 grouped_mm on the GPU")
@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_cuda_bf16_grouped_statistics_agree_with_float32_cpu(tiny_dirs, model_type):
    d = tiny_dirs[model_type]
    L = adapter_for(open_checkpoint(d).config).moe_layers[-1]
    _, ref, routed, _ = _collect(d, L, "eager")
    _, gpu, routed_gpu, _ = _collect(d, L, None, device="cuda", dtype=torch.bfloat16)
    agree = (routed.sort(-1).values == routed_gpu.sort(-1).values).all(-1).double().mean()
    assert agree > 0.9  # bf16 activations may flip a near-tie in routing
    for k in ("hessian.gate_up", "hessian.down", "input.down.sq_mean"):
        rel = (gpu[k].double() - ref[k].double()).norm() / ref[k].double().norm()
        assert rel < 0.05, (k, float(rel))


def test_quantize_pass_in_expert_chunks_equals_the_whole_layer(tiny_dirs, tmp_path, monkeypatch):
    """Bounded device memory: a layer's Hessians built, used and freed a chunk of experts at a time
    give the same GPTQ codes, report and carried activations as the whole layer at once."""
    from pathlib import Path

    from support.plain import plain_settings

    from moequant.measure.data import Sample
    from moequant.pipeline import quantize
    from moequant.plan.policy import make_plan
    from moequant.plan.recipe import load_recipe

    d = tiny_dirs["qwen3_moe"]
    recipe = load_recipe(
        Path(__file__).resolve().parents[1] / "recipes" / "uniform-int4.yaml",
        [f"model={d}", "formats.int4.group_size=32"],
    )
    plan = make_plan(recipe, open_checkpoint(d), None)
    samples = [Sample(row, "test", "test") for row in _ids()]
    settings = plain_settings(samples=N, seq_len=SEQ, batch_size=BS)
    whole, whole_report = quantize.quantize_model(
        str(d), plan, settings, tmp_path / "whole", samples=samples, progress=False
    )
    monkeypatch.setattr(quantize, "_experts_per_chunk", lambda adapter, device: 4)  # 6 experts: chunks of 4 and 2
    chunked, chunked_report = quantize.quantize_model(
        str(d), plan, settings, tmp_path / "chunked", samples=samples, progress=False
    )
    assert whole.keys() == chunked.keys()
    for key, q in whole.items():
        assert torch.equal(q.codes, chunked[key].codes) and torch.equal(q.scales, chunked[key].scales), key
    for L, rep in whole_report.items():
        rep, other = dict(rep), dict(chunked_report[L])
        rep.pop("seconds"), other.pop("seconds")
        assert rep == other, L


def test_all_tokens_statistics_only_for_experts_that_fall_back_give_the_same_pass(tiny_dirs, tmp_path, monkeypatch):
    """The pass pushes every token through an expert only where it has fewer than min_tokens routed tokens (the
    others never read their all-tokens Hessian): codes, scales and report equal those of every expert's
    all-tokens statistics, on a threshold that sends some experts to their own Hessian and some to the fallback."""
    from pathlib import Path

    from support.plain import plain_settings

    from moequant.measure.data import Sample
    from moequant.pipeline import quantize
    from moequant.plan.policy import make_plan
    from moequant.plan.recipe import load_recipe

    d = tiny_dirs["qwen3_moe"]
    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "uniform-int4.yaml", [f"model={d}"])
    plan = make_plan(recipe, open_checkpoint(d), None)
    samples = [Sample(row, "test", "test") for row in _ids()]
    settings = plain_settings(samples=N, seq_len=SEQ, batch_size=BS)
    _, first = quantize.quantize_model(str(d), plan, settings, tmp_path / "counts", samples=samples, progress=False)
    counts = sorted(n for rep in first.values() for n in rep.get("routed_tokens", []))
    settings = settings.model_copy(update={"min_tokens": counts[len(counts) // 2]})  # the median: both kinds
    asked = []
    real = quantize.LayerCollector

    def spy(*args, **kwargs):
        asked.append(kwargs.get("all_tokens_experts"))
        return real(*args, **kwargs)

    monkeypatch.setattr(quantize, "LayerCollector", spy)
    some, some_report = quantize.quantize_model(
        str(d), plan, settings, tmp_path / "some", samples=samples, progress=False
    )
    assert any(m is not None and any(m) and not all(m) for m in asked), asked
    monkeypatch.setattr(quantize, "LayerCollector", lambda *a, **k: real(*a, **{**k, "all_tokens_experts": None}))
    every, every_report = quantize.quantize_model(
        str(d), plan, settings, tmp_path / "every", samples=samples, progress=False
    )
    assert some.keys() == every.keys()
    for key, q in every.items():
        assert torch.equal(q.codes, some[key].codes) and torch.equal(q.scales, some[key].scales), key
    fell_back = 0
    for L, rep in every_report.items():
        rep, other = dict(rep), dict(some_report[L])
        rep.pop("seconds"), other.pop("seconds")
        assert rep == other, L
        fell_back += sum(len(e.get("gptq", {}).get("fallbacks", {})) for e in rep.values() if isinstance(e, dict))
    assert fell_back > 0


@pytest.mark.parametrize("later_gptq", [False, True], ids=["model-free", "before-a-gptq-layer"])
def test_round_to_nearest_streamed_a_chunk_of_experts_at_a_time_equals_the_whole_layer(
    tiny_dirs, tmp_path, monkeypatch, later_gptq
):
    """Round-to-nearest layers on a GPU are read, quantized and sent to the host a chunk of experts at a
    time (`quantize._rtn_experts_streamed`, never a layer in float32 on the device). Forced here on the CPU
    with chunks of 4 experts (6 per layer): the same codes and scales as the whole-layer path, and where a
    later layer runs GPTQ, the same GPTQ codes there too (its input comes from the streamed layers'
    dequantized experts)."""
    import dataclasses
    from pathlib import Path

    from support.plain import plain_settings

    from moequant.measure.data import Sample
    from moequant.pipeline import quantize
    from moequant.pipeline.read_ahead import expert_bytes
    from moequant.plan.policy import make_plan
    from moequant.plan.recipe import load_recipe

    d = tiny_dirs["qwen3_moe"]
    recipe = load_recipe(
        Path(__file__).resolve().parents[1] / "recipes" / "uniform-int4.yaml",
        [f"model={d}", "formats.int4.group_size=32", "algorithms.int4=rtn"],
    )
    plan = make_plan(recipe, open_checkpoint(d), None)
    last = max(t.layer for t in plan.tensors if t.role == "routed_expert")
    if later_gptq:  # the last layer's experts by GPTQ: the layers before it run their quantized forward
        plan.tensors = [
            dataclasses.replace(t, algorithm="gptq") if t.role == "routed_expert" and t.layer == last else t
            for t in plan.tensors
        ]
    samples = [Sample(row, "test", "test") for row in _ids()]
    settings = plain_settings(samples=N, seq_len=SEQ, batch_size=BS)
    whole, _ = quantize.quantize_model(str(d), plan, settings, tmp_path / "whole", samples=samples, progress=False)
    calls = []
    real = quantize._rtn_experts_streamed

    def streamed(run, L, mine):
        calls.append(L)
        return real(run, L, mine)

    monkeypatch.setattr(quantize, "_rtn_experts_streamed", streamed)
    monkeypatch.setattr(quantize, "_rtn_streamed", lambda run, rows: any(t.algorithm == "rtn" for t in rows))
    adapter = adapter_for(open_checkpoint(d).config)
    monkeypatch.setattr(quantize, "RTN_CHUNK_BYTES", 4 * expert_bytes(adapter, 1, torch.float32))
    chunked, _ = quantize.quantize_model(str(d), plan, settings, tmp_path / "streamed", samples=samples, progress=False)
    rtn_layers = sorted({t.layer for t in plan.tensors if t.role == "routed_expert" and t.algorithm == "rtn"})
    assert calls == rtn_layers and rtn_layers and adapter.num_experts == 6
    assert whole.keys() == chunked.keys()
    for key, q in whole.items():
        assert torch.equal(q.codes, chunked[key].codes) and torch.equal(q.scales, chunked[key].scales), key
