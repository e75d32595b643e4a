"""Drop as a precision in the budget (issue 58): the measured KL of dropping each expert, and the solver that spends
one byte limit over drop / formats with the same count dropped from every MoE layer."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_policy import EXPERT_BYTES, FORMAT_PARAMS, expert_loss, make_stats, model_tensors, recipe
from test_prune import _refused, routers_never_choosing
from tiny import build_tiny

from moequant.errors import UserError
from moequant.plan.drop import drop_budget
from moequant.plan.policy import make_plan
from moequant.plan.prune import prune_layout
from moequant.plan.recipe import Prune

# ---------------------------------------------------------------------------------------------- the drop probe


def _kl64(ref_logits, logits):
    p = torch.log_softmax(ref_logits.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    return (p.exp() * (p - q)).sum(-1)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_drop_probe_matches_transformers_float64_with_the_expert_never_routed(tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    from moequant.io.checkpoint import open_checkpoint
    from moequant.measure.drop_probe import run_drop_probe, run_drop_sets

    directory = build_tiny(model_type, tmp_path / "model", seed=5, dtype=torch.float32)
    ckpt = open_checkpoint(directory)
    adapter = ckpt.adapter
    ids = torch.randint(0, adapter.vocab, (4, 24), generator=torch.Generator().manual_seed(2))
    got = run_drop_probe(ckpt, adapter, ids, batch_size=2)
    # the reference: transformers' own forward in float64, the router of one layer never choosing one expert
    # (tests/test_prune.py checks that this equals the pruned export's logits)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64, experts_implementation="eager")
    with torch.no_grad():
        full = model(input_ids=ids).logits
    checked = 0
    for L in adapter.moe_layers:
        for e in range(adapter.num_experts):
            with torch.no_grad(), _restored_bias(model, adapter, L), routers_never_choosing(model, adapter, {L: [e]}):
                expected = float(_kl64(full, model(input_ids=ids).logits).mean())
            assert got["layers"][str(L)][e] == pytest.approx(expected, rel=2e-3, abs=1e-11)
            checked += expected > 1e-7
        assert max(got["layers"][str(L)]) > 1.2 * min(got["layers"][str(L)])  # the experts' costs differ
    # dropping changed the output (random tiny weights: KL ~1e-6, 1e4 above the tolerance) but where the random
    # tokens never chose the expert
    assert checked >= 0.75 * len(adapter.moe_layers) * adapter.num_experts
    # several experts of every layer at once (what a count the budget weighs drops): one stream per set
    layers = adapter.moe_layers
    sets = {1: {L: [L % adapter.num_experts] for L in layers}, 2: {L: [0, 1] if L % 2 else [2, 3] for L in layers}}
    joint = run_drop_sets(ckpt, adapter, ids, sets, batch_size=2)
    for key, drops in sets.items():
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for L in layers:
                stack.enter_context(_restored_bias(model, adapter, L))
            stack.enter_context(routers_never_choosing(model, adapter, drops))
            expected = float(_kl64(full, model(input_ids=ids).logits).mean())
        assert joint[key] == pytest.approx(expected, rel=2e-3, abs=1e-11) and expected > 1e-7
    single = sum(got["layers"][str(L)][L % adapter.num_experts] for L in layers)
    assert joint[1] != pytest.approx(single, rel=1e-3)  # the layers' drops do not simply add


@contextlib.contextmanager
def _restored_bias(model, adapter, layer):
    """routers_never_choosing writes -inf into a selection bias: put it back for the next expert."""
    bias = getattr(adapter.router_module(adapter.moe_block(model, layer)), "e_score_correction_bias", None)
    saved = None if bias is None else bias.detach().clone()
    try:
        yield
    finally:
        if saved is not None:
            bias.data.copy_(saved)


# ---------------------------------------------------------------------------------------------- the solver

LAYERS, E, TOP_K = 3, 4, 2


def _adapter(experts=E, top_k=TOP_K, groups=1, topk_groups=1):
    return SimpleNamespace(
        num_experts=experts, top_k=top_k, routing=SimpleNamespace(groups=groups, topk_groups=topk_groups)
    )


def _layouts(adapter):
    out = [None]
    for d in range(1, adapter.num_experts - adapter.top_k + 1):
        with contextlib.suppress(UserError):
            out.append(prune_layout(Prune(experts=d), adapter))
    return out


def _probed(stats, key="int4-g32-sym", scale=1e-3):
    """The statistics with a per-layer KL probe (the budget's losses in KL units): each layer's int4 share is its
    predicted loss times `scale`."""
    layers = {}
    for L in stats.layers:
        predicted = sum(expert_loss(stats, L, e, key) for e in range(stats.layers[L].routed_count.numel()))
        layers[str(L)] = {"format": key, "kl": predicted * scale}
    stats.probe = {"layers": layers}
    return stats


def _budget_recipe(bits, formats=("int8", "int4", "int3"), target="transformers"):
    experts = {"method": "budget", "budget": {"bits_per_weight": bits}, "formats": list(formats)}
    return recipe(target, {**experts, "prune": {"by": "budget"}})


INT4_BITS = EXPERT_BYTES["int4-g32-sym"] * 8 / (3 * 64 * 32)


def _loss_of(plan_or_assignment, stats, scale=1e-3):
    """float64 predicted KL of routed experts in their formats (bf16 costs 0), the probe's scale applied."""
    return sum(scale * expert_loss(stats, L, e, key) for (L, e), key in plan_or_assignment.items())


def _assignment(plan):
    out = {}
    for t in plan.tensors:
        if t.role == "routed_expert":
            out[(t.layer, t.expert)] = t.format
    return out


@pytest.mark.parametrize("cheap", [True, False])
def test_budget_drops_where_dropping_is_measurably_cheaper_than_lowering_bits(cheap):
    stats = _probed(make_stats(LAYERS, E, seed=4, top_k=TOP_K))
    tensors = model_tensors(LAYERS, E)
    no_drop = make_plan(
        recipe(
            "transformers",
            {"method": "budget", "budget": {"bits_per_weight": 0.8 * INT4_BITS}, "formats": ["int8", "int4", "int3"]},
        ),
        tensors,
        stats,
    )
    no_drop_loss = _loss_of(_assignment(no_drop), stats)
    assert no_drop_loss > 0
    # one expert per layer whose drop costs a tiny fraction of what lowering bits costs; or one that costs more
    # than the whole no-drop plan
    drop_kl = {}
    for L in range(LAYERS):
        kl = np.full(E, 10 * no_drop_loss)
        kl[(L + 1) % E] = no_drop_loss * (1e-3 if cheap else 2.0)
        drop_kl[L] = kl
    choice = drop_budget(_budget_recipe(0.8 * INT4_BITS), tensors, stats, drop_kl, _layouts(_adapter()))
    # the drops measured all at once cost more than the whole no-drop plan: the budget keeps every expert
    asked = []
    measured = drop_budget(
        _budget_recipe(0.8 * INT4_BITS),
        tensors,
        stats,
        drop_kl,
        _layouts(_adapter()),
        measure=lambda sets: asked.append(sets) or {c: 2 * no_drop_loss for c in sets},
    )
    assert measured.layout is None and measured.quant_loss == pytest.approx(no_drop_loss, rel=1e-9)
    assert list(asked[0]) == [1, 2] and asked[0][1] == {L: [(L + 1) % E] for L in range(LAYERS)}
    if not cheap:
        assert choice.layout is None and choice.drop_loss == 0
        assert choice.quant_loss == pytest.approx(no_drop_loss, rel=1e-9)
        return
    assert choice.layout is not None and choice.layout.count == 1
    assert choice.drops == {L: [(L + 1) % E] for L in range(LAYERS)}  # each layer its own cheap expert
    assert choice.drop_loss == pytest.approx(sum(drop_kl[L][(L + 1) % E] for L in range(LAYERS)), rel=1e-12)
    total = choice.drop_loss + choice.quant_loss
    assert total < 0.9 * no_drop_loss  # measurably cheaper than the formats alone at the same bytes
    limit = int(0.8 * INT4_BITS * LAYERS * E * 3 * 64 * 32 / 8)
    assert choice.routed_bytes <= limit
    row = next(c for c in choice.counts if c["count"] == 1)
    assert row["quant_loss"] == pytest.approx(choice.quant_loss) and row["routed_bytes"] <= limit


def test_every_layer_drops_the_same_count_whatever_its_own_costs():
    stats = _probed(make_stats(LAYERS, E, seed=1, top_k=TOP_K))
    tensors = model_tensors(LAYERS, E)
    # layer 0 could drop two experts for free, the others none
    drop_kl = {L: np.full(E, 1.0) for L in range(LAYERS)}
    drop_kl[0][:2] = 0.0
    choice = drop_budget(_budget_recipe(0.8 * INT4_BITS), tensors, stats, drop_kl, _layouts(_adapter()))
    counts = {len(d) for d in choice.drops.values()}
    assert len(counts) == 1, choice.drops


def test_grouped_routing_drops_whole_groups_or_the_same_number_per_group():
    experts, groups = 8, 4  # groups of 2: only whole groups can go (each keeps at least 2 otherwise)
    stats = _probed(make_stats(2, experts, seed=2, top_k=2))
    tensors = model_tensors(2, experts)
    layouts = _layouts(_adapter(experts, 2, groups, topk_groups=2))
    assert [lay.count for lay in layouts if lay] == [2, 4, 6] and {lay.mode for lay in layouts if lay} == {
        "whole_groups"
    }
    drop_kl = {L: np.linspace(1e-9, 1e-8, experts)[::-1].copy() for L in range(2)}  # dropping is nearly free
    choice = drop_budget(_budget_recipe(0.5 * INT4_BITS), tensors, stats, drop_kl, layouts)
    assert choice.layout is not None and choice.layout.mode == "whole_groups"
    for dropped in choice.drops.values():
        assert len(dropped) == choice.layout.count
        assert all((e ^ 1) in dropped for e in dropped)  # whole groups: both experts of a group


def test_a_budget_no_count_can_meet_is_one_sentence():
    stats = _probed(make_stats(LAYERS, E, seed=0, top_k=TOP_K))
    tensors = model_tensors(LAYERS, E)
    drop_kl = {L: np.ones(E) for L in range(LAYERS)}
    # the smallest plan: 2 of 4 experts dropped (top-2 left), the rest int3 (3.5 bits): 1.75 bits per weight
    with pytest.raises(UserError) as error:
        drop_budget(_budget_recipe(1.0), tensors, stats, drop_kl, _layouts(_adapter()))
    message = str(error.value)
    assert message.count(". ") == 0 and "accepted: bits_per_weight >= 1.7" in message, message
    with pytest.raises(UserError):  # the same refusal from shapes alone, before any calibration
        drop_budget(_budget_recipe(1.0), tensors, None, None, _layouts(_adapter()), shapes_only=True)
    assert drop_budget(_budget_recipe(1.8), tensors, None, None, _layouts(_adapter()), shapes_only=True) is None


def test_apply_refuses_a_budget_no_count_can_meet_before_calibration(tmp_path):
    from click.testing import CliRunner

    from moequant.cli import main

    out = tmp_path / "run"
    args = ["apply", "--recipe", "selective", "--model", "zoo:tiny-qwen3moe", "--output", str(out)]
    sets = ["experts.prune={by: budget}", "experts.budget={bits_per_weight: 2}", "experts.formats=[int8, int4]"]
    line = _refused(CliRunner().invoke(main, [*args, *[a for s_ in sets for a in ("--set", s_)]]))
    # 4 of tiny-qwen3moe's 8 experts may go (top-4 left), the rest int4 at 4.5 bits: 2.25 bits per routed weight
    assert "experts.budget.bits_per_weight 2.0 is below the smallest feasible plan" in line, line
    assert "accepted: bits_per_weight >= 2.2500" in line and not out.exists()


def test_a_budget_that_may_drop_needs_the_kl_probe():
    stats = make_stats(LAYERS, E, seed=0, top_k=TOP_K)  # no probe: quantization losses are not KL
    with pytest.raises(UserError, match="per-layer KL probe"):
        drop_budget(
            _budget_recipe(3.6), model_tensors(LAYERS, E), stats, {L: np.ones(E) for L in range(LAYERS)}, [None]
        )


def test_prune_by_budget_recipe_refusals():
    with pytest.raises(UserError, match="by: budget needs experts.method budget"):
        recipe("vllm", {"method": "uniform", "format": "int4", "prune": {"by": "budget"}})
    with pytest.raises(UserError, match="saliency kl"):
        recipe(
            "vllm",
            {"method": "budget", "budget": {"bits_per_weight": 4}, "prune": {"by": "budget", "saliency": "reap"}},
        )
    assert FORMAT_PARAMS  # the recipe helper's formats: int4 / int3 at group size 32


# ---------------------------------------------------------------------------------------------- apply


@pytest.mark.slow
def test_apply_with_the_budget_choosing_drop_exports_a_model_transformers_reloads(tmp_path):
    """At 0.8x uniform int4's bytes with int8 / int4 per layer (vLLM), formats alone cannot fit: the budget drops
    the same number of experts from every layer, each layer those of least measured drop KL, and the export of the
    smaller model loads in transformers with that many experts and moequant.load's logits."""
    import json
    import math

    from transformers import AutoModelForCausalLM

    from moequant.io.checkpoint import open_checkpoint
    from moequant.io.loader import load
    from moequant.measure.data import load_samples
    from moequant.pipeline.apply import apply

    out = tmp_path / "run"
    bits = 0.8 * 4.5  # int4 g32 symmetric: 4 bits and a 16-bit scale per 32 weights
    settings = [
        "model=zoo:tiny-qwen3moe",
        "experts.prune={by: budget}",
        f"experts.budget={{bits_per_weight: {bits}}}",
        "experts.formats=[int8, int4]",
        "calibration.samples=8",
        "calibration.seq_len=48",
        "calibration.probe_samples=4",
        "evaluate.samples=4",
        "evaluate.seq_len=48",
    ]
    apply("selective", output=str(out), overrides=settings, progress=False, log=lambda *a: None)
    chosen = json.loads((out / "prune" / "budget.json").read_text())
    record = json.loads((out / "prune" / "prune.json").read_text())
    probe = json.loads((out / "prune" / "drop_probe.json").read_text())
    count = chosen["count"]
    assert count >= 2  # 1 of 8 leaves 7 / 8 x 4.5 = 3.94 bits > 3.6: formats alone cannot meet it
    assert [c["count"] for c in chosen["counts"] if c["fits"]][0] == 2
    for L, layer in record["layers"].items():
        kl = probe["layers"][L]
        assert len(layer["dropped"]) == count
        assert sorted(layer["dropped"]) == sorted(sorted(range(8), key=lambda e: (kl[e], -e))[:count])
    assert record["budget"] == chosen and record["by"] == "budget" and record["saliency"] == "kl"
    md = (out / "report.md").read_text()
    assert f"## Experts dropped ({count} of 8 per MoE layer, by kl)" in md
    fits = next(c for c in chosen["counts"] if c["count"] == count)
    total = fits["drop_loss"] + fits["quant_loss"]
    assert f"| {count} | {fits['drop_loss']:.4g} | {fits['quant_loss']:.4g} | {total:.4g} |" in md
    assert "| 1 |  |  | over the budget |" in md
    plan = json.loads((out / "plan.json").read_text())
    source = open_checkpoint("zoo:tiny-qwen3moe")
    routed_numel = sum(
        math.prod(source.shape(n)) for n in source.keys() if source.adapter.classify(n).role == "routed_expert"
    )
    assert plan["summary"]["routed_bytes"] <= bits * routed_numel / 8  # the budget read against all 8 experts

    config = json.loads((out / "checkpoint" / "config.json").read_text())
    assert config["num_local_experts"] == 8 - count and config["num_experts_per_tok"] == 4
    windows = load_samples("builtin:mix", source.tokenizer, 4, 48, split="evaluation", seed=0)
    ids = torch.stack([w.input_ids for w in windows])
    theirs = AutoModelForCausalLM.from_pretrained(out / "checkpoint", dtype=torch.float32)
    with torch.no_grad():
        got = theirs(input_ids=ids).logits
        assert _kl64(load(out / "checkpoint", torch.float32)(ids).logits, got).median() <= 1e-4
