"""A new serving target is one file: a target defined and registered here, in the test ("an engine that
takes only int8 experts, one format per MoE layer"), is accepted by the recipe, and the planner, the
precheck and the export honour what it loads, with no other change to moequant."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from test_export_models import quantize_experts
from test_policy import make_stats, model_tensors

from moequant.errors import UserError
from moequant.export.write import export_checkpoint
from moequant.io.checkpoint import open_checkpoint
from moequant.pipeline.precheck import check_recipe
from moequant.plan.policy import make_plan
from moequant.plan.recipe import recipe_from_dict
from moequant.targets import TARGETS, Target, register
from moequant.zoo import path as zoo_path

REFUSAL = "the int8 engine's fused MoE takes int8 experts only"


class Int8Layers(Target):
    """An engine whose fused-MoE kernel takes int8 experts only (or a whole layer in bf16), one format per MoE
    layer, reading the compressed-tensors layout."""

    name = "int8-layers"
    granularity = "layer"
    layouts = ("compressed-tensors",)
    routed_formats = "int8, bf16"

    def refuses(self, spec, routed):
        if routed and spec.quantized and not (spec.is_int and spec.bits == 8):
            return REFUSAL
        return super().refuses(spec, routed)


@pytest.fixture
def int8_layers():
    target = register(Int8Layers())
    yield target
    TARGETS.pop(target.name)


def budget_recipe(formats, bits, **extra):
    return recipe_from_dict(
        {
            "target": "int8-layers",
            "experts": {"method": "budget", "budget": {"bits_per_weight": bits}, "formats": formats},
            **extra,
        },
        "t.yaml",
    )


def test_the_recipe_takes_a_registered_target_and_refuses_an_unknown_one(int8_layers):
    assert recipe_from_dict({"target": "int8-layers"}, "t.yaml").target == "int8-layers"
    with pytest.raises(UserError, match="reads the compressed-tensors layout, not gptq"):
        recipe_from_dict({"target": "int8-layers", "export": {"format": "gptq"}}, "t.yaml")
    TARGETS.pop("int8-layers")
    try:
        with pytest.raises(UserError, match="key 'target'.*'int8-layers'.*accepted: 'vllm', 'sglang'"):
            recipe_from_dict({"target": "int8-layers"}, "t.yaml")
    finally:
        register(int8_layers)


def test_the_planner_offers_only_what_the_target_loads_in_its_unit(int8_layers):
    stats, tensors = make_stats(layers=3, experts=4, seed=5), model_tensors(3, 4)
    plan = make_plan(budget_recipe(["int8", "int4", "fp8", "bf16"], 12.0), tensors, stats)
    assert plan.dropped_candidates == {"int4-g128-sym": REFUSAL, "fp8-channel": REFUSAL}
    per_layer = defaultdict(set)
    for (layer, _), key in plan.expert_formats().items():
        per_layer[layer].add(key)
    assert all(len(keys) == 1 for keys in per_layer.values())  # the target's unit: one format per layer
    assert set.union(*per_layer.values()) == {"int8-channel", "bf16"}  # 12 bits: some layers int8, some bf16

    uniform_int4 = recipe_from_dict({"target": "int8-layers", "experts": {"method": "uniform", "format": "int4"}}, "t")
    with pytest.raises(UserError) as info:  # a uniform format it cannot load: refused with its own sentence
        make_plan(uniform_int4, tensors, stats)
    assert str(info.value) == (
        f"experts.format gives routed experts int4-g128-sym, which target int8-layers cannot serve: {REFUSAL}; "
        "accepted: int8, bf16, or target transformers."
    )
    rules = {"method": "rules", "rules": [{"share_at_least": 1.0, "format": "bf16"}, {"format": "int8"}]}
    with pytest.raises(UserError, match="with target int8-layers every routed expert of layer 0 needs one format"):
        make_plan(recipe_from_dict({"target": "int8-layers", "experts": rules}, "t.yaml"), tensors, stats)


def test_the_precheck_refuses_before_any_work(int8_layers):
    recipe = recipe_from_dict(
        {"model": "zoo:tiny-qwen2moe", "target": "int8-layers", "experts": {"method": "uniform", "format": "int4"}},
        "t.yaml",
    )
    with pytest.raises(UserError, match=f"which target int8-layers cannot serve: {REFUSAL}"):
        check_recipe(recipe, open_checkpoint(recipe.model))
    ok = recipe_from_dict(
        {"model": "zoo:tiny-qwen2moe", "target": "int8-layers", "experts": {"method": "uniform", "format": "int8"}},
        "t.yaml",
    )
    check_recipe(ok, open_checkpoint(ok.model))  # what it loads passes


def test_the_export_honours_the_target(tmp_path, int8_layers):
    source = zoo_path("tiny-qwen2moe")
    with pytest.raises(UserError, match=f"target int8-layers cannot serve int4-g32-sym.*{REFUSAL}"):
        export_checkpoint(
            source, quantize_experts(source, lambda L, e, p: "int4-g32-sym"), tmp_path / "a", target="int8-layers"
        )
    with pytest.raises(UserError, match="target int8-layers needs one format for all routed experts of an MoE layer"):
        mixed = quantize_experts(source, lambda L, e, p: "int8-channel" if e % 2 else None)
        export_checkpoint(source, mixed, tmp_path / "b", target="int8-layers")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    experts = quantize_experts(source, lambda L, e, p: "int8-channel")
    out = export_checkpoint(source, experts, tmp_path / "ok", target="int8-layers")
    assert json.loads((out / "moequant_export.json").read_text())["target"] == "int8-layers"
    written = open_checkpoint(out)
    for (L, e, p), q in list(experts.items())[:6]:
        name = written.adapter.expert_tensor_name(L, e, p)
        assert written.encodings[name].spec.key == "int8-channel"


def test_apply_runs_a_registered_target_end_to_end(tmp_path, int8_layers):
    from moequant.pipeline.apply import apply

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "model: zoo:tiny-qwen2moe\n"
        f"output: {tmp_path / 'run'}\n"
        "target: int8-layers\n"
        "keep: [router, shared_expert_gate, shared_experts, attention, embeddings, lm_head]\n"
        "experts: {method: uniform, format: int8}\n"
        "algorithms: {int8: rtn}\n"
        "evaluate: {dataset: builtin:mix, samples: 4, seq_len: 32}\n"
    )
    apply(recipe, progress=False, log=lambda *a: None)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["target"] == "int8-layers" and report["quality"]["kl_mean"] > 0
    assert {e["format"] for e in report["experts"]} == {"int8-channel"}
