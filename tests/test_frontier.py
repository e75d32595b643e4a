"""pareto's frontier is the non-dominated points only (moequant.pipeline.pareto.frontier), and the CLI
says how many of the points are on it. The points are the shape the issue reported: a vLLM plan at
6.31 bits with twice the KL of a transformers plan at the same bits, which must not count."""

from __future__ import annotations

from click.testing import CliRunner

from moequant.pipeline import pareto as pareto_module
from moequant.pipeline.pareto import frontier, same_as_frontier

POINTS = [
    {"name": "uniform-int8", "bits_per_weight_experts": 8.25, "kl_mean": 0.001},
    {"name": "uniform-int4", "bits_per_weight_experts": 4.5, "kl_mean": 0.03},
    {"name": "transformers-6.31bpw", "bits_per_weight_experts": 6.31, "kl_mean": 0.004},
    {"name": "vllm-6.31bpw", "bits_per_weight_experts": 6.31, "kl_mean": 0.008},  # same bits, twice the KL
    {"name": "vllm-7bpw", "bits_per_weight_experts": 7.0, "kl_mean": 0.005},  # more bits and more KL
    {"name": "uniform-int3", "bits_per_weight_experts": 3.5, "kl_mean": 0.2},
    {"name": "outside", "bits_per_weight_experts": 5.0, "kl_mean": None},  # not measured: not placed
]


def test_dominated_points_are_not_on_the_frontier():
    assert frontier(POINTS) == ["uniform-int3", "uniform-int4", "transformers-6.31bpw", "uniform-int8"]


def test_equal_points_are_one_frontier_point_and_a_lone_point_is_its_own_frontier():
    """Three budgets that led to one 4.5-bit plan (issue 57: "6 points, 5 on the frontier") are one point."""
    twins = [
        {"name": "a", "bits_per_weight_experts": 5.0, "kl_mean": 0.01},
        {"name": "b", "bits_per_weight_experts": 5.0, "kl_mean": 0.01},
        {"name": "c", "bits_per_weight_experts": 5.0, "kl_mean": 0.01},
        {"name": "d", "bits_per_weight_experts": 5.0, "kl_mean": 0.02},
        {"name": "e", "bits_per_weight_experts": 8.0, "kl_mean": 0.001},
    ]
    assert frontier(twins) == ["a", "e"]
    assert frontier(twins[1:]) == ["b", "e"]
    assert frontier(twins[:1]) == ["a"]
    assert same_as_frontier(twins) == {"b": "a", "c": "a"}


def test_the_command_counts_the_frontier_not_every_point(monkeypatch):
    from moequant.cli import main

    points = [*POINTS, {"name": "vllm-4.5bpw", "bits_per_weight_experts": 4.5, "kl_mean": 0.03}]  # = uniform-int4

    def fake(*args, **kwargs):
        return {"points": points, "frontier": frontier(points)}

    monkeypatch.setattr(pareto_module, "pareto", fake)
    result = CliRunner().invoke(main, ["pareto", "--recipe", "per-expert"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == (
        "8 points, 4 on the frontier (no other point has fewer bits and less KL): uniform-int3, uniform-int4, "
        "transformers-6.31bpw, uniform-int8; vllm-4.5bpw has the bits and KL of uniform-int4"
    )


def test_the_report_s_runs_plot_compares_only_runs_of_its_own_model(tmp_path):
    """report.html's "runs in this directory" plot: runs of another model under the same parent are left out (their
    KL is against another reference), so a directory with one run of each model has no such plot at all."""
    import json

    from moequant.report import sibling_runs
    from moequant.report.views import plot_pareto

    def run(name, model, size, kl):
        (tmp_path / name).mkdir()
        report = {"model": model, "memory": {"bytes_quantized": size}, "quality": {"kl_mean": kl, "top1_agreement": 1}}
        (tmp_path / name / "report.json").write_text(json.dumps(report))

    run("a", "zoo:tiny-qwen2moe", 10, 0.01)
    run("b", "zoo:tiny-mixtral", 20, 0.001)
    run("c", "zoo:tiny-qwen2moe", 30, 0.005)
    assert [r["name"] for r in sibling_runs(tmp_path / "a")] == ["a", "b", "c"]  # no model given: every run
    assert [r["name"] for r in sibling_runs(tmp_path / "a", "zoo:tiny-qwen2moe")] == ["a", "c"]
    assert [r["name"] for r in sibling_runs(tmp_path / "b", "zoo:tiny-mixtral")] == ["b"]
    assert plot_pareto(sibling_runs(tmp_path / "b", "zoo:tiny-mixtral")) is None
    assert plot_pareto(sibling_runs(tmp_path / "a", "zoo:tiny-qwen2moe")) is not None
