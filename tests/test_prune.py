"""Expert pruning (issue 58): saliency from the calibration pass, the recipe's `experts.prune`, the pruned export."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from support.plain import plain_settings
from tiny import build_tiny

from moequant.measure.calibrate import LayerCollector, calibrate
from moequant.measure.data import Sample
from moequant.measure.stats import load_stats

SEQ, N, BS = 24, 6, 3


def _samples(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Sample(torch.randint(0, 96, (SEQ,), generator=g), "code", "test") for _ in range(N)]


def reap_reference(directory, samples):
    """REAP's criterion in float64 from the unmodified transformers model: per MoE layer, the mean over each
    expert's routed tokens of router weight x ||expert output||, the output computed from the fused weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64, experts_implementation="eager")
    seen, hooks = {}, []
    for L, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        if not hasattr(mlp, "experts"):
            continue
        seen[L] = {"route": [], "x": []}
        hooks.append(mlp.gate.register_forward_hook(lambda m, a, out, L=L: seen[L]["route"].append(out[1:])))
        hooks.append(mlp.experts.register_forward_pre_hook(lambda m, a, L=L: seen[L]["x"].append(a[0])))
    ids = torch.stack([s.input_ids for s in samples])
    with torch.no_grad():
        for batch in torch.split(ids, BS):
            model(input_ids=batch)
    for h in hooks:
        h.remove()
    out = {}
    for L, got in seen.items():
        experts = model.model.layers[L].mlp.experts
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in got["x"]])
        weights = torch.cat([w.reshape(-1, w.shape[-1]) for w, _ in got["route"]]).double()
        indices = torch.cat([i.reshape(-1, i.shape[-1]) for _, i in got["route"]])
        scores = torch.zeros(experts.num_experts, dtype=torch.float64)
        for e in range(experts.num_experts):
            tok, slot = (indices == e).nonzero(as_tuple=True)
            if tok.numel():
                gate, up = (x[tok] @ experts.gate_up_proj[e].T).chunk(2, dim=-1)
                y = (experts.act_fn(gate) * up) @ experts.down_proj[e].T
                scores[e] = (weights[tok, slot] * y.norm(dim=-1)).mean()
        out[L] = scores
    return out


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("grouped", [False, True])
def test_reap_saliency_matches_a_float64_computation(tmp_path, monkeypatch, model_type, grouped):
    directory = build_tiny(model_type, tmp_path / "model", seed=3)
    # grouped: several experts' padded rows at once (the path accelerators take), here on the CPU
    monkeypatch.setattr(LayerCollector, "_grouped", lambda self, dev: grouped)
    samples = _samples()
    settings = plain_settings(samples=N, seq_len=SEQ, batch_size=BS, formats=("int8-channel",), probe_samples=0)
    stats = load_stats(calibrate(str(directory), tmp_path / "stats", settings, samples=samples, progress=False))
    reference = reap_reference(directory, samples)
    assert sorted(stats.layers) == sorted(reference)
    for L, expected in reference.items():
        got = stats.layers[L].tensors["saliency.reap"]
        assert got.dtype == torch.float64 and got.shape == expected.shape
        assert (expected > 0).sum() >= 2  # several experts were routed to: the comparison means something
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-9)


# ---------------------------------------------------------------------------------------------- the pruned model

ZOO_PRUNE = {"tiny-qwen2moe": 4, "tiny-mixtral": 2, "tiny-qwen3moe": 2, "tiny-deepseek-v3": 2}


def _random_drops(adapter, layout, seed=0):
    """Each layer's choice from random saliencies: different experts per layer, groups kept equal."""
    from moequant.plan.prune import choose_drops

    g = torch.Generator().manual_seed(seed)
    fake = {
        L: {"saliency.reap": torch.rand(adapter.num_experts, generator=g, dtype=torch.float64)}
        for L in adapter.moe_layers
    }
    return choose_drops(fake, layout, "reap")


@contextlib.contextmanager
def routers_never_choosing(model, adapter, drops):
    """The original transformers model whose routers never choose the dropped experts: each router's logits of
    those experts are -inf (F.linear's output inside the router's forward), and a selection bias of theirs too."""
    E, hooks, original = adapter.num_experts, [], torch.nn.functional.linear
    for L, dropped in drops.items():
        router = adapter.router_module(adapter.moe_block(model, L))

        def masked(x, w, b=None, dropped=dropped):
            y = original(x, w, b)
            if w.shape[0] == E:
                y = y.clone()
                y[..., dropped] = float("-inf")
            return y

        def on(module, args, masked=masked):
            torch.nn.functional.linear = masked

        def off(module, args, out):
            torch.nn.functional.linear = original

        hooks += [router.register_forward_pre_hook(on), router.register_forward_hook(off)]
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            bias.data[dropped] = float("-inf")
    try:
        yield model
    finally:
        for h in hooks:
            h.remove()
        torch.nn.functional.linear = original


def _kl(ref_logits, logits):
    p = torch.log_softmax(ref_logits.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    return (p.exp() * (p - q)).sum(-1)


@pytest.mark.parametrize("zoo", list(ZOO_PRUNE))
def test_transformers_loads_the_pruned_model_and_matches_the_original_never_routing_to_dropped_experts(tmp_path, zoo):
    from transformers import AutoModelForCausalLM

    from moequant.export.prune import PRUNE_FILE, write_pruned_checkpoint
    from moequant.io.checkpoint import open_checkpoint
    from moequant.plan.prune import prune_layout
    from moequant.plan.recipe import Prune

    ckpt = open_checkpoint(f"zoo:{zoo}")
    adapter = ckpt.adapter
    layout = prune_layout(Prune(experts=ZOO_PRUNE[zoo]), adapter)
    drops = _random_drops(adapter, layout)
    assert len({tuple(d) for d in drops.values()}) > 1  # layers drop different experts
    out = write_pruned_checkpoint(ckpt, drops, layout, tmp_path / "pruned")
    assert json.loads((out / PRUNE_FILE).read_text())["dropped"] == {str(L): d for L, d in drops.items()}

    ids = torch.randint(0, adapter.vocab, (2, 48), generator=torch.Generator().manual_seed(1))
    pruned = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert pruned.config.get_text_config().num_experts_per_tok == adapter.top_k
    experts = {adapter.experts_module(pruned, L).down_proj.shape[0] for L in adapter.moe_layers}
    assert experts == {adapter.num_experts - ZOO_PRUNE[zoo]}
    original = AutoModelForCausalLM.from_pretrained(ckpt.directory, dtype=torch.float32)
    with torch.no_grad():
        full = original(input_ids=ids).logits
        with routers_never_choosing(original, adapter, drops):
            reference = original(input_ids=ids).logits
        got = pruned(input_ids=ids).logits
    assert _kl(reference, got).max() <= 1e-5
    assert _kl(full, reference).mean() > 1e-4  # the dropped experts were used: the comparison is not vacuous


# ---------------------------------------------------------------------------------------------- the recipe


def _refused(result) -> str:
    assert result.exit_code == 2, result.output
    # transformers may log a line of its own while the model's config is read; moequant says one sentence
    lines = [line for line in result.output.strip().splitlines() if not line.startswith("[transformers]")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    return lines[0]


@pytest.mark.parametrize(
    "zoo, setting, says",
    [
        # 8 experts, top-4: dropping 5 leaves 3
        ("tiny-qwen3moe", "experts=5", "leaves 3 of 8 experts per layer, fewer than the router's top-k (4)"),
        ("tiny-qwen3moe", "fraction=0.6", "leaves 3 of 8 experts per layer, fewer than the router's top-k (4)"),
        ("tiny-mixtral", "experts=7", "leaves 1 of 8 experts per layer, fewer than the router's top-k (2)"),
        # 4 groups of 2: one expert is neither the same number from every group nor whole groups
        ("tiny-deepseek-v3", "experts=1", "breaks the router's 4 expert groups of 2 (n_group)"),
        ("tiny-deepseek-v3", "experts=3", "breaks the router's 4 expert groups of 2 (n_group)"),
        ("tiny-qwen2moe", "fraction=0.01", "drops no expert of the 16 per layer"),
    ],
)
def test_a_prune_the_model_cannot_take_is_refused_before_calibration(tmp_path, zoo, setting, says):
    from click.testing import CliRunner

    from moequant.cli import main

    out = tmp_path / "run"
    args = ["apply", "--recipe", "uniform-int4", "--model", f"zoo:{zoo}", "--output", str(out)]
    line = _refused(CliRunner().invoke(main, [*args, "--set", f"experts.prune.{setting}"]))
    assert f"experts.prune.{setting.replace('=', ' ')} {says}" in line and "accepted" in line
    assert not out.exists()


@pytest.mark.parametrize("setting", ["{}", "{experts: 2, fraction: 0.25}", "{experts: 2, saliency: luck}"])
def test_a_malformed_prune_is_one_sentence(tmp_path, setting):
    from click.testing import CliRunner

    from moequant.cli import main

    out = tmp_path / "run"
    line = _refused(CliRunner().invoke(main, ["apply", "--output", str(out), "--set", f"experts.prune={setting}"]))
    assert "experts.prune" in line
    assert not out.exists()


def test_layouts_keep_groups_equal():
    from moequant.io.checkpoint import open_checkpoint
    from moequant.plan.prune import PruneLayout, choose_drops, prune_layout
    from moequant.plan.recipe import Prune

    adapter = open_checkpoint("zoo:tiny-deepseek-v3").adapter  # 8 experts in 4 groups of 2, top-2 of 2 groups
    assert prune_layout(Prune(experts=4), adapter) == PruneLayout(4, 8, 4, "whole_groups", 2)
    assert prune_layout(Prune(fraction=0.25), adapter) == PruneLayout(2, 8, 4, "whole_groups", 2)
    # 16 experts in 4 groups of 4: the same number from every group while each keeps 2
    score = torch.tensor([5, 1, 2, 9, 8, 7, 0, 6, 3, 3, 4, 1, 9, 9, 9, 2], dtype=torch.float64)
    per_group = PruneLayout(8, 16, 4, "per_group", 2)
    assert choose_drops({0: {"routing.count": score}}, per_group, "frequency") == {0: [1, 2, 6, 7, 9, 11, 14, 15]}
    whole = PruneLayout(8, 16, 4, "whole_groups", 2)  # group sums 17, 21, 11, 29: groups 2 and 0 go
    assert choose_drops({0: {"routing.count": score}}, whole, "frequency") == {0: [0, 1, 2, 3, 8, 9, 10, 11]}
    free = PruneLayout(3, 16)  # the lowest three; of the tied 1s at 1 and 11, the later goes first
    assert choose_drops({0: {"routing.count": score}}, free, "frequency") == {0: [1, 6, 11]}


@pytest.mark.parametrize("name", ["selective", "uniform-int4", "per-expert", "frequency-rules"])
def test_a_recipe_without_prune_writes_the_plan_it_always_did(name):
    """No `prune` key reaches plan.json or the run fingerprint unless the recipe sets it: the resolved recipe in
    plan.json holds exactly the keys a recipe had before `experts.prune` existed."""
    from moequant.plan.recipe import Experts, load_recipe, recipe_to_dict

    data = recipe_to_dict(load_recipe(name))
    assert set(data["experts"]) == set(Experts.model_fields) - {"prune"}
    assert "prune" not in json.dumps(data)
    pruned = recipe_to_dict(load_recipe(name, ["experts.prune={experts: 2}"]))
    assert pruned["experts"]["prune"] == {"experts": 2, "fraction": None, "saliency": "reap"}


# ---------------------------------------------------------------------------------------------- apply


@pytest.mark.slow
def test_apply_with_prune_exports_the_smaller_model_as_compressed_tensors(tmp_path):
    """apply drops each layer's lowest-REAP experts, quantizes the smaller model (uniform int4) and exports it as
    compressed-tensors: transformers loads it with its fewer experts (moequant.load's weights), it is the pruned
    model (nearer the original whose routers never choose the dropped experts than the original itself), and
    prune.json's price of pruning is the KL an independent transformers forward measures."""
    from transformers import AutoModelForCausalLM

    from moequant.io.checkpoint import open_checkpoint
    from moequant.io.loader import load
    from moequant.measure.data import load_samples
    from moequant.pipeline.apply import apply

    out = tmp_path / "run"
    settings = [
        "model=zoo:tiny-qwen3moe",
        "experts.prune={experts: 2}",
        "calibration.samples=8",
        "calibration.seq_len=48",
        "evaluate.samples=4",
        "evaluate.seq_len=48",
    ]
    apply("uniform-int4", output=str(out), overrides=settings, progress=False, log=lambda *a: None)
    record = json.loads((out / "prune" / "prune.json").read_text())
    stats = load_stats(out / "prune" / "stats", with_hessians=False)
    for L, layer in stats.layers.items():  # the two lowest REAP scores of each layer went
        reap = layer.tensors["saliency.reap"]
        assert record["layers"][str(L)]["dropped"] == sorted(torch.argsort(reap)[:2].tolist())
    drops = {int(L): v["dropped"] for L, v in record["layers"].items()}

    config = json.loads((out / "checkpoint" / "config.json").read_text())
    assert config["num_local_experts"] == 6 and config["num_experts_per_tok"] == 4
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    source = open_checkpoint("zoo:tiny-qwen3moe")
    adapter = source.adapter
    windows = load_samples("builtin:mix", source.tokenizer, 4, 48, split="evaluation", seed=0)
    ids = torch.stack([w.input_ids for w in windows])
    theirs = AutoModelForCausalLM.from_pretrained(out / "checkpoint", dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32)
    with torch.no_grad():
        got = theirs(input_ids=ids).logits
        # the two readers round differently (tiny-qwen3moe unpruned: mean 3.9e-5, max 8e-4), and a near tie of a
        # router may flip a position: the median, not the mean
        assert _kl(load(out / "checkpoint", torch.float32)(ids).logits, got).median() <= 1e-4
        full = original(input_ids=ids).logits
        with routers_never_choosing(original, adapter, drops):
            pruned = original(input_ids=ids).logits
    assert _kl(pruned, got).mean() < _kl(full, got).mean() / 4
    measured = float(_kl(full, pruned).mean())
    assert record["quality"]["kl_mean"] == pytest.approx(measured, rel=0.05)  # prune.json ran in bf16
    assert record["bytes_saved"] == source.stored_bytes - open_checkpoint(out / "prune" / "model").stored_bytes > 0
    from moequant.report import read_report

    assert read_report(out / "report.json")["prune"] == record  # the report says what was dropped and its price
    md = (out / "report.md").read_text()
    assert "## Experts dropped (2 of 8 per MoE layer, by reap)" in md and "## Price of pruning alone" in md
    for L, v in record["layers"].items():
        assert f"| {L} | {', '.join(map(str, v['dropped']))} | {v['routing_mass']:.1%} |" in md
