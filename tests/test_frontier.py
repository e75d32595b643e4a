"""pareto's frontier is the non-dominated points only (moequant.pipeline.pareto.frontier), and the CLI
says how many of the points are on it. The points are the shape the issue reported: a vLLM plan at
6.31 bits with twice the KL of a transformers plan at the same bits, which must not count."""

from __future__ import annotations

from click.testing import CliRunner

from moequant.pipeline import pareto as pareto_module
from moequant.pipeline.pareto import frontier

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


def test_equal_points_both_stay_and_a_lone_point_is_its_own_frontier():
    twins = [
        {"name": "a", "bits_per_weight_experts": 5.0, "kl_mean": 0.01},
        {"name": "b", "bits_per_weight_experts": 5.0, "kl_mean": 0.01},
    ]
    assert frontier(twins) == ["a", "b"]
    assert frontier(twins[:1]) == ["a"]


def test_the_command_counts_the_frontier_not_every_point(monkeypatch):
    from moequant.cli import main

    def fake(*args, **kwargs):
        return {"points": POINTS, "frontier": frontier(POINTS)}

    monkeypatch.setattr(pareto_module, "pareto", fake)
    result = CliRunner().invoke(main, ["pareto", "--recipe", "per-expert"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == (
        "7 points, 4 on the frontier (no other point has fewer bits and less KL): uniform-int3, uniform-int4, "
        "transformers-6.31bpw, uniform-int8"
    )
