"""apply plans once: a recipe that reads no statistics gets its whole plan in the precheck (the shapes decide
it), and the plan stage takes that plan instead of planning again; a recipe that reads statistics gets the
precheck's shapes-only pass and its plan after calibration."""

from __future__ import annotations

from moequant.pipeline.apply import apply, resolve_recipe
from moequant.pipeline.precheck import check_recipe
from moequant.pipeline.run import open_run
from moequant.plan import policy
from moequant.plan.plan_io import plan_to_dict


def test_the_precheck_keeps_the_plan_of_a_recipe_without_statistics():
    run = open_run(resolve_recipe("uniform-int8", model="zoo:tiny-qwen2moe"), progress=False, log=lambda *a: None)
    check_recipe(run.recipe, run.source, run)
    assert run.plan is not None
    assert plan_to_dict(run.plan) == plan_to_dict(policy.make_plan(run.recipe, run.source, None))

    budget = open_run(resolve_recipe("selective", model="zoo:tiny-qwen2moe"), progress=False, log=lambda *a: None)
    check_recipe(budget.recipe, budget.source, budget)
    assert budget.plan is None  # its plan reads the statistics calibration has not made yet


def test_apply_plans_a_recipe_without_statistics_once(tmp_path, monkeypatch):
    passes = []
    real = policy._make_plan

    def counted(recipe, tensors, stats, shapes_only):
        passes.append("shapes only" if shapes_only else "whole")
        return real(recipe, tensors, stats, shapes_only)

    monkeypatch.setattr(policy, "_make_plan", counted)
    overrides = ("evaluate.samples=2", "evaluate.seq_len=32")
    apply("uniform-int8", "zoo:tiny-qwen2moe", tmp_path / "out", overrides, progress=False, log=lambda *a: None)
    assert passes == ["whole"] and (tmp_path / "out" / "plan.json").is_file()
