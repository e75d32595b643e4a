"""apply plans once: a recipe that reads no statistics gets its whole plan in the precheck (the shapes decide
it), and the plan stage takes that plan instead of planning again; a recipe that reads statistics gets the
precheck's shapes-only pass and its plan after calibration."""

from __future__ import annotations

from moequant.pipeline.apply import apply, resolve_recipe, run_plan
from moequant.pipeline.precheck import check_recipe
from moequant.pipeline.run import open_run
from moequant.plan import policy
from moequant.plan.plan_io import plan_to_dict, read_plan


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


def test_apply_makes_the_shape_part_of_a_budget_plan_once(tmp_path, monkeypatch):
    """A budget recipe's precheck checks the plan's shape part (policy.plan_shapes) and the plan stage, after
    calibration, starts from that same part: one plan_shapes per apply, and the plan equals one made from scratch
    from the same statistics (its notes not doubled)."""
    made = []
    real = policy.plan_shapes

    def counted(recipe, tensors):
        made.append(recipe)
        return real(recipe, tensors)

    monkeypatch.setattr(policy, "plan_shapes", counted)
    import moequant.pipeline.precheck  # noqa: F401  (imports plan_shapes from policy when it runs)

    out = tmp_path / "out"
    settings = ["calibration.samples=4", "calibration.seq_len=32", "evaluate.samples=2", "evaluate.seq_len=32"]
    apply("selective", "zoo:tiny-qwen3moe", out, settings, progress=False, log=lambda *a: None)
    assert len(made) == 1
    monkeypatch.setattr(policy, "plan_shapes", real)
    recipe = resolve_recipe("selective", model="zoo:tiny-qwen3moe", output=str(out), overrides=settings)
    run = open_run(recipe, progress=False, log=lambda *a: None)
    fresh = plan_to_dict(policy.make_plan(run.recipe, run.source, out / "stats"))
    written = plan_to_dict(read_plan(out / "plan.json"))
    written.pop("run_fingerprint", None)
    fresh.pop("run_fingerprint", None)
    assert written == fresh
    assert len(written["notes"]) == len(set(written["notes"]))

    made.clear()  # `moequant plan` of the same recipe and statistics: one shape part, the same plan
    monkeypatch.setattr(policy, "plan_shapes", counted)
    plan, _ = run_plan("selective", "zoo:tiny-qwen3moe", str(out), settings)
    assert len(made) == 1
    again = plan_to_dict(plan)
    again.pop("run_fingerprint", None)
    assert again == fresh
