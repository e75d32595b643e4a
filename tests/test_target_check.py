"""One question decides what an engine serves: `Target.check`. A target registered here answers it in one
method (int8 routed experts only, compressed-tensors only) and nothing else of it is overridden; the recipe
validator, the planner, the precheck and the export all honour its answer, each by asking it."""

from __future__ import annotations

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

REFUSAL = "the one-rule engine's fused MoE takes int8 experts only"
LAYOUT_REFUSAL = "the one-rule engine reads compressed-tensors checkpoints only"


class OneRule(Target):
    name = "one-rule"
    granularity = "layer"
    routed_formats = "int8, bf16"
    asked: list = []

    def check(self, spec=None, *, routed=True, layout=None, routed_mix=None):
        self.asked.append("layout" if layout is not None else "mix" if routed_mix is not None else "spec")
        if layout is not None and layout.name != "compressed-tensors":
            return LAYOUT_REFUSAL
        if spec is not None and routed and spec.quantized and not (spec.is_int and spec.bits == 8):
            return REFUSAL
        return super().check(spec, routed=routed, layout=layout, routed_mix=routed_mix)


@pytest.fixture
def one_rule():
    target = register(OneRule())
    target.asked.clear()
    yield target
    TARGETS.pop(target.name)


def uniform(fmt: str, **extra):
    return recipe_from_dict(
        {"model": "zoo:tiny-qwen2moe", "target": "one-rule", "experts": {"method": "uniform", "format": fmt}, **extra},
        "t.yaml",
    )


def test_the_recipe_validator_asks_check(one_rule):
    with pytest.raises(UserError, match=LAYOUT_REFUSAL):
        uniform("int8", export={"format": "gptq"})
    assert one_rule.asked == ["layout"]


def test_the_planner_asks_check(one_rule):
    stats, tensors = make_stats(layers=3, experts=4, seed=5), model_tensors(3, 4)
    budget = {"method": "budget", "budget": {"bits_per_weight": 12.0}, "formats": ["int8", "int4", "bf16"]}
    plan = make_plan(recipe_from_dict({"target": "one-rule", "experts": budget}, "t.yaml"), tensors, stats)
    assert plan.dropped_candidates == {"int4-g128-sym": REFUSAL} and "spec" in one_rule.asked
    assert {key for key in plan.expert_formats().values()} <= {"int8-channel", "bf16"}


def test_the_precheck_asks_check(one_rule):
    recipe = uniform("int4")
    one_rule.asked.clear()
    with pytest.raises(UserError, match=f"which target one-rule cannot serve: {REFUSAL}"):
        check_recipe(recipe, open_checkpoint(recipe.model))
    assert "spec" in one_rule.asked and "layout" in one_rule.asked  # the export layout it will write, too
    check_recipe(uniform("int8"), open_checkpoint(recipe.model))  # what it serves passes


def test_the_export_asks_check(tmp_path, one_rule):
    source = zoo_path("tiny-qwen2moe")
    with pytest.raises(UserError, match=LAYOUT_REFUSAL):
        export_checkpoint(source, {}, tmp_path / "a", layout="gptq", target="one-rule")
    with pytest.raises(UserError, match=f"target one-rule cannot serve int4-g32-sym.*{REFUSAL}"):
        export_checkpoint(
            source, quantize_experts(source, lambda L, e, p: "int4-g32-sym"), tmp_path / "b", target="one-rule"
        )
    one_rule.asked.clear()
    export_checkpoint(
        source, quantize_experts(source, lambda L, e, p: "int8-channel"), tmp_path / "ok", target="one-rule"
    )
    assert {"layout", "spec", "mix"} <= set(one_rule.asked)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and (tmp_path / "ok").is_dir()
