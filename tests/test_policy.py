"""Policy engine: exact budget solving (against brute force), serving constraints, keep, plan.json.

The model is a synthetic tensor list (no checkpoint) and the statistics are real `Stats`
objects filled with seeded random routing counts and sensitivities. Bytes are checked against
byte counts derived by hand from the storage layout, losses against float64 recomputation.
"""

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from moequant.errors import UserError
from moequant.measure.stats import LayerStats, Stats
from moequant.plan.context import tensors_from_checkpoint
from moequant.plan.model import SCHEMA
from moequant.plan.plan_io import read_plan, write_plan
from moequant.plan.policy import make_plan
from moequant.plan.recipe import recipe_from_dict
from moequant.plan.solver import solve_choices
from moequant.plan.summary import format_summary

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
H, I = 64, 32  # gate/up [I, H], down [H, I]: every projection holds 2048 weights
EXPERT_NUMEL = 3 * H * I
# Bytes of one expert (gate + up + down), derived from the storage layout by hand:
# int8: 1 byte per weight + fp16 scale per row (32 + 32 + 64 rows);
# intB-g32-sym: B bits per weight packed in int32 words per row + fp16 scale per 32 inputs.
EXPERT_BYTES = {
    "bf16": 2 * EXPERT_NUMEL,
    "int8-channel": EXPERT_NUMEL + 2 * (I + I + H),
    "int4-g32-sym": EXPERT_NUMEL // 2 + 2 * (I * 2 + I * 2 + H * 1),
    "int3-g32-sym": 4 * (I * 6 + I * 6 + H * 3) + 2 * (I * 2 + I * 2 + H * 1),
    "int2-g32-sym": 4 * (I * 4 + I * 4 + H * 2) + 2 * (I * 2 + I * 2 + H * 1),
}
SENS_SCALE = {
    "int8-channel": 1.0,
    "int4-g32-sym": 20.0,
    "int3-g32-sym": 80.0,
    "int2-g32-sym": 400.0,
    "int4-g32-asym": 15.0,
    "mxfp4": 25.0,
    "fp8-channel": 2.0,
}
KEYS_OF = {
    "int8": "int8-channel",
    "int4": "int4-g32-sym",
    "int3": "int3-g32-sym",
    "int2": "int2-g32-sym",
    "bf16": "bf16",
}
FORMAT_PARAMS = {"int4": {"group_size": 32}, "int3": {"group_size": 32}, "int2": {"group_size": 32}}


def model_tensors(layers=3, experts=4, shared=True):
    """(name, role, layer, expert, proj, shape) for a small Qwen2-MoE-like model."""
    out = [
        ("model.embed_tokens.weight", "embedding", None, None, None, (100, H)),
        ("model.norm.weight", "norm", None, None, None, (H,)),
        ("lm_head.weight", "lm_head", None, None, None, (100, H)),
    ]
    for L in range(layers):
        p = f"model.layers.{L}."
        out += [
            (p + "input_layernorm.weight", "norm", L, None, None, (H,)),
            (p + "self_attn.q_proj.weight", "attention", L, None, None, (H, H)),
            (p + "self_attn.q_proj.bias", "attention", L, None, None, (H,)),
            (p + "mlp.gate.weight", "router", L, None, None, (experts, H)),
        ]
        if shared:
            out += [
                (p + "mlp.shared_expert_gate.weight", "shared_expert_gate", L, None, None, (1, H)),
                (p + "mlp.shared_expert.down_proj.weight", "shared_expert", L, None, "down", (H, I)),
            ]
        for e in range(experts):
            for proj in ("gate", "up", "down"):
                shape = (H, I) if proj == "down" else (I, H)
                out.append((p + f"mlp.experts.{e}.{proj}_proj.weight", "routed_expert", L, e, proj, shape))
    return out


def make_stats(layers=3, experts=4, seed=0, tokens=1000, top_k=2, dead=()):
    """Real Stats objects with seeded routing and sensitivities; `dead` experts never routed."""
    rng = np.random.default_rng(seed)
    out = {}
    for L in range(layers):
        probs = rng.dirichlet(np.full(experts, 0.7))
        for L_dead, e_dead in dead:
            if L_dead == L:
                probs[e_dead] = 0
        probs /= probs.sum()
        counts = rng.multinomial(tokens * top_k, probs)
        tensors = {"routing.count": torch.tensor(counts, dtype=torch.int64)}
        for proj in ("gate", "up", "down"):
            for key, scale in SENS_SCALE.items():
                tensors[f"sensitivity.{proj}.{key}"] = torch.tensor(
                    rng.uniform(0.2, 1.8, experts) * scale, dtype=torch.float64
                )
        out[L] = LayerStats(L, top_k, tokens, tensors)
    return Stats(None, {}, out)


def recipe(target="vllm", experts=None, **extra):
    data = {
        "target": target,
        "formats": FORMAT_PARAMS,
        "experts": experts or {"method": "uniform", "format": "int4"},
        **extra,
    }
    return recipe_from_dict(data, "test.yaml")


def budget(target, formats, **budget):
    return recipe(target, {"method": "budget", "budget": budget, "formats": formats})


def usage(stats, L, floor=0.05):
    ls = stats.layers[L]
    counts = ls.routed_count.double().numpy()
    E = counts.size
    return np.maximum(counts / ls.tokens, floor * ls.top_k / E)


def expert_loss(stats, L, e, key, floor=0.05):
    if key == "bf16":
        return 0.0
    sens = sum(float(stats.layers[L].sensitivity[p][key][e]) for p in ("gate", "up", "down"))
    return float(usage(stats, L, floor)[e]) * sens


def routed_entries(plan):
    return [t for t in plan.tensors if t.role == "routed_expert" and t.expert is not None]


# ---------------------------------------------------------------------------------------------
# The solver against brute force


def brute_force(option_bytes, option_loss, limit):
    best = None
    for combo in itertools.product(*[range(len(b)) for b in option_bytes]):
        total = sum(option_bytes[g][i] for g, i in enumerate(combo))
        if total <= limit:
            loss = sum(option_loss[g][i] for g, i in enumerate(combo))
            if best is None or loss < best:
                best = loss
    return best


@pytest.mark.parametrize("seed", range(120))
def test_solver_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    groups = int(rng.integers(1, 7))
    scale = int(rng.choice([1, 1000, 10**7]))  # small and realistic byte counts
    option_bytes = [[int(b) * scale for b in rng.integers(1, 50, int(rng.integers(1, 5)))] for _ in range(groups)]
    option_loss = [list(rng.exponential(1.0, len(b)) * rng.choice([1e-6, 1.0, 1e4])) for b in option_bytes]
    low = sum(min(b) for b in option_bytes)
    high = sum(max(b) for b in option_bytes)
    for limit in {low - 1, low, int(rng.integers(low, high + 1)), (low + high) // 2, high}:
        choice = solve_choices(option_bytes, option_loss, limit)
        expected = brute_force(option_bytes, option_loss, limit)
        if expected is None:
            assert choice is None
            continue
        assert sum(option_bytes[g][i] for g, i in enumerate(choice)) <= limit
        got = sum(option_loss[g][i] for g, i in enumerate(choice))
        assert got == pytest.approx(expected, rel=1e-9, abs=1e-12 * max(map(max, option_loss)))


@pytest.mark.parametrize("seed", range(30))
def test_solver_with_ties_matches_brute_force(seed):
    """Identical groups and repeated byte / loss values: the worst case for the core DP."""
    rng = np.random.default_rng(1000 + seed)
    template_bytes = [int(b) for b in rng.choice([2688, 3456, 6400, 12288], int(rng.integers(2, 5)), replace=False)]
    template_loss = [float(x) for x in rng.integers(0, 4, len(template_bytes))]
    groups = int(rng.integers(2, 8))
    option_bytes = [template_bytes] * groups
    option_loss = [template_loss] * groups
    limit = int(rng.integers(min(template_bytes) * groups, max(template_bytes) * groups + 1))
    choice = solve_choices(option_bytes, option_loss, limit)
    assert sum(option_bytes[g][i] for g, i in enumerate(choice)) <= limit
    assert sum(option_loss[g][i] for g, i in enumerate(choice)) == brute_force(option_bytes, option_loss, limit)


@pytest.mark.parametrize("seed", range(20))
def test_milp_fallback_matches_brute_force(seed, monkeypatch):
    import moequant.plan.solver as solver

    monkeypatch.setattr(solver, "MAX_DP_STATES", 0)  # every core goes to HiGHS
    rng = np.random.default_rng(2000 + seed)
    option_bytes = [[int(b) * 4096 for b in rng.integers(1, 40, 3)] for _ in range(int(rng.integers(2, 7)))]
    option_loss = [list(rng.exponential(1.0, 3)) for _ in option_bytes]
    limit = (sum(min(b) for b in option_bytes) + sum(max(b) for b in option_bytes)) // 2
    choice = solve_choices(option_bytes, option_loss, limit)
    assert sum(option_bytes[g][i] for g, i in enumerate(choice)) <= limit
    assert sum(option_loss[g][i] for g, i in enumerate(choice)) == pytest.approx(
        brute_force(option_bytes, option_loss, limit), rel=1e-9
    )


def test_solver_agrees_with_highs_on_medium_instances():
    """Too large for brute force: HiGHS' proven optimum is the reference."""
    from moequant.plan.solver import _milp_choice, _pareto_front

    for seed in range(3):
        rng = np.random.default_rng(seed)
        option_bytes = [[int(b) * 1000 for b in rng.integers(1, 200, 4)] for _ in range(150)]
        option_loss = [list(rng.exponential(1.0, 4)) for _ in range(150)]
        limit = int(sum(np.mean(b) for b in option_bytes))
        choice = solve_choices(option_bytes, option_loss, limit)
        fronts = [_pareto_front(b, l) for b, l in zip(option_bytes, option_loss)]
        notes = []
        reference = _milp_choice(fronts, option_bytes, option_loss, limit, notes)
        assert notes == []  # HiGHS proved its optimum
        assert sum(option_bytes[g][i] for g, i in enumerate(choice)) <= limit
        assert sum(option_loss[g][i] for g, i in enumerate(choice)) == pytest.approx(
            sum(option_loss[g][i] for g, i in enumerate(reference)), rel=1e-9
        )


def test_solver_large_instance_is_feasible_and_no_worse_than_greedy():
    rng = np.random.default_rng(1)
    option_bytes = [[4608, 6400, 12288]] * 600
    option_loss = [sorted(rng.exponential(1.0, 3), reverse=True) for _ in range(600)]
    limit = 600 * 5500
    choice = solve_choices(option_bytes, option_loss, limit)
    total = sum(option_bytes[g][i] for g, i in enumerate(choice))
    assert total <= limit
    # a greedy fill by loss saved per byte (a feasible solution) cannot beat the optimum
    greedy = [0] * 600
    spare = limit - 600 * 4608
    order = sorted(range(600), key=lambda g: -(option_loss[g][0] - option_loss[g][1]) / (6400 - 4608))
    for g in order:
        if spare >= 6400 - 4608:
            greedy[g], spare = 1, spare - (6400 - 4608)
    loss = sum(option_loss[g][i] for g, i in enumerate(choice))
    assert loss <= sum(option_loss[g][i] for g, i in enumerate(greedy)) + 1e-9


# ---------------------------------------------------------------------------------------------
# Budget plans


def brute_force_plan(stats, layers, experts, keys, per_expert, limit_bytes):
    """Best predicted loss over every assignment (per layer or per expert) within the byte limit."""
    units = (
        [[(L, e) for e in range(experts)] for L in range(layers)]
        if not per_expert
        else [[(L, e)] for L in range(layers) for e in range(experts)]
    )
    unit_bytes = [[EXPERT_BYTES[key] * len(unit) for key in keys] for unit in units]
    unit_loss = [[sum(expert_loss(stats, L, e, key) for L, e in unit) for key in keys] for unit in units]
    best = None
    for combo in itertools.product(range(len(keys)), repeat=len(units)):
        if sum(b[k] for b, k in zip(unit_bytes, combo)) <= limit_bytes:
            loss = sum(l[k] for l, k in zip(unit_loss, combo))
            best = loss if best is None else min(best, loss)
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("target", ["vllm", "transformers"])
def test_budget_plan_is_the_brute_force_optimum(seed, target):
    layers, experts = (3, 4) if target == "vllm" else (2, 4)
    stats = make_stats(layers, experts, seed=seed)
    names = ["int8", "int4", "bf16"] if target == "vllm" else ["int8", "int4", "int3"]
    keys = [KEYS_OF[n] for n in names]
    bpw = [4.9, 5.6, 6.5][seed % 3]
    plan = make_plan(budget(target, names, bits_per_weight=bpw), model_tensors(layers, experts), stats)
    limit = math.floor(bpw * layers * experts * EXPERT_NUMEL / 8)
    best = brute_force_plan(stats, layers, experts, keys, target == "transformers", limit)
    assert plan.summary["predicted_loss"] == pytest.approx(best, rel=1e-9)
    assert plan.summary["routed_bytes"] <= limit
    # the plan's own accounting: bytes by hand, loss recomputed in float64
    formats = plan.expert_formats()
    assert plan.summary["routed_bytes"] == sum(EXPERT_BYTES[k] for k in formats.values())
    assert plan.summary["predicted_loss"] == pytest.approx(
        sum(expert_loss(stats, L, e, k) for (L, e), k in formats.items()), rel=1e-12
    )


def test_budget_at_the_exact_minimum_is_feasible_and_below_it_fails():
    stats = make_stats()
    # int4-g32-sym is exactly 4.5 bits per weight: the smallest feasible budget with int8 / int4
    assert EXPERT_BYTES["int4-g32-sym"] * 8 == 4.5 * EXPERT_NUMEL
    plan = make_plan(budget("vllm", ["int8", "int4"], bits_per_weight=4.5), model_tensors(), stats)
    assert set(plan.expert_formats().values()) == {"int4-g32-sym"}
    assert plan.summary["bits_per_weight"]["routed_experts"] == 4.5
    with pytest.raises(UserError) as info:
        make_plan(budget("vllm", ["int8", "int4"], bits_per_weight=4.49), model_tensors(), stats)
    assert str(info.value) == (
        "experts.budget.bits_per_weight 4.49 is below the smallest feasible plan for target vllm with candidates "
        "int8-channel, int4-g32-sym: 4.5000 bits per routed-expert weight; accepted: bits_per_weight >= 4.5000."
    )


def test_gigabyte_budget_counts_the_whole_model():
    stats = make_stats()
    tensors = model_tensors()
    plan = make_plan(budget("vllm", ["int8", "int4"], gigabytes=1.0), tensors, stats)
    assert set(plan.expert_formats().values()) == {"int8-channel"}  # everything fits: best quality
    # the non-routed tensors of this model, kept bf16 (2 bytes each), plus 12 int4 experts
    other = sum(2 * math.prod(t[5]) for t in tensors if t[1] != "routed_expert")
    minimum = other + 12 * EXPERT_BYTES["int4-g32-sym"]
    assert plan.summary["total_bytes"] == other + 12 * EXPERT_BYTES["int8-channel"]
    exact = make_plan(budget("vllm", ["int8", "int4"], gigabytes=minimum / 1e9), tensors, stats)
    assert exact.summary["total_bytes"] == minimum
    below = (minimum - 1) / 1e9
    with pytest.raises(UserError) as info:
        make_plan(budget("vllm", ["int8", "int4"], gigabytes=below), tensors, stats)
    shown = math.ceil(minimum / 1000) / 1e6
    assert str(info.value) == (
        f"experts.budget.gigabytes {below} is below the smallest feasible plan for target vllm with candidates "
        f"int8-channel, int4-g32-sym: {minimum} bytes for the whole model; accepted: gigabytes >= {shown:.6f}."
    )


def test_budget_plan_beats_every_uniform_plan_at_equal_bytes():
    stats = make_stats(seed=3)
    names = ["int8", "int4", "int3", "int2", "bf16"]
    for target in ("vllm", "transformers"):
        allowed = [n for n in names if target == "transformers" or n not in ("int3", "int2")]
        for name in allowed:
            uniform = make_plan(recipe(target, {"method": "uniform", "format": name}), model_tensors(), stats)
            bpw = uniform.summary["bits_per_weight"]["routed_experts"]
            solved = make_plan(budget(target, allowed, bits_per_weight=bpw), model_tensors(), stats)
            assert solved.summary["routed_bytes"] <= uniform.summary["routed_bytes"]
            assert solved.summary["predicted_loss"] <= uniform.summary["predicted_loss"] + 1e-12


# ---------------------------------------------------------------------------------------------
# Serving constraints


def test_vllm_and_sglang_share_one_format_per_layer_and_model():
    stats = make_stats(layers=4, experts=6, seed=5)
    tensors = model_tensors(4, 6)
    names = ["int8", "int4", "bf16"]
    for bpw in (4.6, 5.5, 7.0, 9.0):
        vllm = make_plan(budget("vllm", names, bits_per_weight=bpw), tensors, stats)
        assert all(len(keys) == 1 for keys in vllm.layer_formats().values())
        # every projection tensor of a layer too
        for L in range(4):
            assert len({t.format for t in routed_entries(vllm) if t.layer == L}) == 1
        sglang = make_plan(budget("sglang", names, bits_per_weight=bpw), tensors, stats)
        # INT4 / INT8 weight-only groups (and bf16 layers) may differ per layer in SGLang: the vLLM plan
        assert sglang.expert_formats() == vllm.expert_formats()
        with_fp8 = make_plan(budget("sglang", names + ["fp8"], bits_per_weight=bpw), tensors, stats)
        keys = set(with_fp8.expert_formats().values())
        assert keys <= {"int8-channel", "int4-g32-sym", "bf16"} or len(keys) == 1  # FP8 only for the whole model
        per_expert = make_plan(budget("transformers", names, bits_per_weight=bpw), tensors, stats)
        # looser constraints can only help, and the summary's alternative is exactly that plan
        assert per_expert.summary["predicted_loss"] <= vllm.summary["predicted_loss"] + 1e-12
        assert vllm.summary["per_expert_alternative"]["predicted_loss"] == pytest.approx(
            per_expert.summary["predicted_loss"], rel=1e-9
        )
        assert vllm.summary["predicted_loss"] <= sglang.summary["predicted_loss"] + 1e-12


def test_vllm_drops_formats_its_fused_moe_cannot_load():
    stats = make_stats()
    r = recipe_from_dict(
        {
            "target": "vllm",
            "formats": {**FORMAT_PARAMS, "int4": {"group_size": 32, "symmetric": False}},
            "experts": {
                "method": "budget",
                "budget": {"bits_per_weight": 8.5},
                "formats": ["int8", "int4", "int3", "int2-g32-sym"],
            },
        }
    )
    plan = make_plan(r, model_tensors(), stats)
    assert plan.candidates == ["int8-channel"]
    assert plan.dropped_candidates == {
        "int4-g32-asym": "vLLM 0.32 loads integer experts with zero points only in its CUDA kernels (Marlin, "
        "Triton; target vllm-cuda), not in its CPU build, where moequant checks its vllm exports",
        "int3-g32-sym": "vLLM loads integer weights only at 4 or 8 bits (WNA16 kernels)",
        "int2-g32-sym": "vLLM loads integer weights only at 4 or 8 bits (WNA16 kernels)",
    }
    assert "dropped for target vllm: int3-g32-sym" in format_summary(plan)
    same = recipe_from_dict({**r.model_dump(), "target": "transformers"})
    assert make_plan(same, model_tensors(), stats).dropped_candidates == {}
    sglang = recipe_from_dict({**r.model_dump(), "target": "sglang"})
    assert make_plan(sglang, model_tensors(), stats).dropped_candidates["int4-g32-asym"] == (
        "SGLang's compressed-tensors fused MoE loads only symmetric integer experts"
    )


def test_vllm_cuda_takes_asymmetric_int4_one_format_per_layer():
    """vLLM's CUDA kernels take zero points: target vllm-cuda keeps the asymmetric int4 candidates that
    target vllm drops, still one format per MoE layer, and a budget can only gain from them."""
    stats = make_stats()
    menu = ["int8", "int4-g32-sym", "int4-g32-asym", "int4-g64-asym", "int3"]
    r = recipe_from_dict(
        {
            "target": "vllm-cuda",
            "formats": FORMAT_PARAMS,
            "experts": {"method": "budget", "budget": {"bits_per_weight": 4.5}, "formats": menu},
        }
    )
    plan = make_plan(r, model_tensors(), stats)
    assert plan.candidates == ["int8-channel", "int4-g32-sym", "int4-g32-asym", "int4-g64-asym"]
    assert list(plan.dropped_candidates) == ["int3-g32-sym"]
    assert all(len(keys) == 1 for keys in plan.layer_formats().values())
    vllm = make_plan(recipe_from_dict({**r.model_dump(), "target": "vllm"}), model_tensors(), stats)
    assert set(vllm.dropped_candidates) == {"int4-g32-asym", "int4-g64-asym", "int3-g32-sym"}
    assert plan.summary["predicted_loss"] <= vllm.summary["predicted_loss"] + 1e-12
    assert plan.summary["bits_per_weight"]["routed_experts"] <= 4.5 + 1e-9


def test_bundled_vllm_cuda_recipe_menu_fills_a_layer_budget_at_least_as_well():
    """recipes/selective-vllm-cuda.yaml: target vllm-cuda, every int4 group size symmetric and asymmetric
    offered (none dropped), one format per MoE layer within the budget, and its plan predicts no more loss
    than the coarser menu it replaced (int8, g32 sym, g32 / g64 asym) on the same statistics."""
    from moequant.plan.recipe import load_recipe

    rng = np.random.default_rng(7)
    r = load_recipe(RECIPES / "selective-vllm-cuda.yaml")
    layers = {}
    for L in range(3):
        tensors = {"routing.count": torch.tensor(rng.multinomial(2000, rng.dirichlet(np.ones(4))))}
        for proj in ("gate", "up", "down"):
            for key, scale in {"int8-channel": 1.0, "int4-g32-asym": 12.0, "int4-g64-asym": 16.0,
                               "int4-g128-asym": 21.0, "int4-g32-sym": 15.0, "int4-g64-sym": 19.0,
                               "int4-g128-sym": 25.0}.items():  # fmt: skip
                tensors[f"sensitivity.{proj}.{key}"] = torch.tensor(rng.uniform(0.5, 1.5, 4) * scale)
        layers[L] = LayerStats(L, 2, 1000, tensors)
    stats = Stats(None, {}, layers)
    wide = [(n, role, L, e, p, (256, 256)) for n, role, L, e, p, _ in model_tensors() if role == "routed_expert"]
    plan = make_plan(r, wide, stats)
    assert r.target == "vllm-cuda" and not plan.dropped_candidates
    assert {"int4-g32-asym", "int4-g64-asym", "int4-g128-asym", "int4-g64-sym", "int4-g128-sym"} <= set(plan.candidates)
    assert all(len(keys) == 1 for keys in plan.layer_formats().values())
    assert plan.summary["bits_per_weight"]["routed_experts"] <= 4.5 + 1e-9
    coarse = {"formats": ["int8", "int4-g32-sym", "int4-g32-asym", "int4-g64-asym"]}
    before = make_plan(
        recipe_from_dict({**r.model_dump(), "experts": {**r.experts.model_dump(), **coarse}}), wide, stats
    )
    assert plan.summary["predicted_loss"] <= before.summary["predicted_loss"] + 1e-12


def test_uniform_and_rules_refuse_unservable_formats():
    with pytest.raises(UserError) as info:
        make_plan(recipe("vllm", {"method": "uniform", "format": "int3"}), model_tensors(), None)
    assert str(info.value) == (
        "experts.format gives routed experts int3-g32-sym, which target vllm cannot serve: vLLM loads integer "
        "weights only at 4 or 8 bits (WNA16 kernels); accepted: fp8, int8, symmetric int4, mxfp4, nvfp4, bf16, "
        "or target transformers."
    )
    plan = make_plan(recipe("transformers", {"method": "uniform", "format": "int3"}), model_tensors(), None)
    assert set(plan.expert_formats().values()) == {"int3-g32-sym"}
    assert plan.summary["predicted_loss"] is None  # no statistics, no prediction


def test_rules_per_expert_and_the_vllm_layer_constraint():
    stats = make_stats(seed=2)
    rules = {
        "method": "rules",
        "rules": [
            {"share_at_least": 1.5, "format": "int8"},
            {"share_below": 0.5, "format": "int3"},
            {"layers": "0", "format": "bf16"},
            {"format": "int4"},
        ],
    }
    plan = make_plan(recipe("transformers", rules), model_tensors(), stats)
    for (L, e), key in plan.expert_formats().items():
        rel = float(stats.layers[L].share[e]) * 4
        expected = (
            "int8-channel" if rel >= 1.5 else "int3-g32-sym" if rel < 0.5 else "bf16" if L == 0 else "int4-g32-sym"
        )
        assert key == expected, (L, e, rel)
    assert len(set(plan.expert_formats().values())) > 1
    with pytest.raises(UserError) as info:
        make_plan(
            recipe(
                "vllm", {"method": "rules", "rules": [{"share_at_least": 1.0, "format": "int8"}, {"format": "int4"}]}
            ),
            model_tensors(),
            stats,
        )
    assert str(info.value).startswith(
        "with target vllm every routed expert of layer 0 needs one format, but experts.rules give layer 0 "
    )
    assert str(info.value).endswith("; accepted: rules by layers only, or target transformers.")
    by_layer = make_plan(
        recipe("vllm", {"method": "rules", "rules": [{"layers": "1-2", "format": "int8"}, {"format": "int4"}]}),
        model_tensors(),
        None,
    )
    assert by_layer.layer_formats() == {0: {"int4-g32-sym"}, 1: {"int8-channel"}, 2: {"int8-channel"}}


def test_rules_without_a_match_or_without_stats():
    stats = make_stats()
    with pytest.raises(UserError) as info:
        make_plan(
            recipe("transformers", {"method": "rules", "rules": [{"layers": "0", "format": "int8"}]}),
            model_tensors(),
            stats,
        )
    assert str(info.value) == (
        "no rule in experts.rules matches layer 1 expert 0; accepted: end the rules with "
        "one without conditions, such as {format: int4}."
    )
    with pytest.raises(UserError) as info:
        make_plan(
            recipe(
                "transformers", {"method": "rules", "rules": [{"share_below": 1, "format": "int3"}, {"format": "int4"}]}
            ),
            model_tensors(),
            None,
        )
    assert str(info.value).startswith(
        "experts.rules use share_at_least / share_below, which need calibration statistics"
    )


# ---------------------------------------------------------------------------------------------
# keep and non-expert tensors


def test_router_and_shared_expert_gate_stay_bf16_whatever_keep_says():
    r = recipe("vllm", keep=[], non_experts={"format": "int8"})
    plan = make_plan(r, model_tensors(), None)
    by_role = {}
    for t in plan.tensors:
        by_role.setdefault(t.role, set()).add(t.format)
    assert by_role["router"] == {"bf16"} and by_role["shared_expert_gate"] == {"bf16"}
    assert by_role["norm"] == {"bf16"} and by_role["embedding"] == {"bf16"}
    # not kept: attention weights, shared experts and lm_head take non_experts.format; biases do not
    assert by_role["shared_expert"] == {"int8-channel"} and by_role["lm_head"] == {"int8-channel"}
    assert {t.format for t in plan.tensors if t.name.endswith("q_proj.weight")} == {"int8-channel"}
    assert {t.format for t in plan.tensors if t.name.endswith("q_proj.bias")} == {"bf16"}
    kept = make_plan(
        recipe("vllm", keep=["attention", "lm_head"], non_experts={"format": "int8"}), model_tensors(), None
    )
    assert {t.format for t in kept.tensors if t.role in ("attention", "lm_head")} == {"bf16"}
    assert {t.format for t in kept.tensors if t.role == "shared_expert"} == {"int8-channel"}
    assert all(t.kept for t in kept.tensors if t.format == "bf16")


def test_keep_patterns_for_routed_experts():
    stats = make_stats()
    pattern = ["model.layers.1.mlp.experts.*"]
    plan = make_plan(
        budget("vllm", ["int8", "int4"], bits_per_weight=9.0).model_copy(update={"keep": pattern}),
        model_tensors(),
        stats,
    )
    assert plan.layer_formats()[1] == {"bf16"}
    assert all(t.kept == "keep: model.layers.1.mlp.experts.*" for t in routed_entries(plan) if t.layer == 1)
    # layer 1 in bf16 takes 16/3 of the 9 bits; one more int8 layer would need 16/3 + 8.33/3 + 4.5/3 > 9
    assert plan.layer_formats()[0] == plan.layer_formats()[2] == {"int4-g32-sym"}
    with pytest.raises(UserError) as info:
        make_plan(recipe("vllm").model_copy(update={"keep": ["model.layers.1.mlp.experts.2.*"]}), model_tensors(), None)
    assert str(info.value) == (
        "keep holds only some routed experts of layer 1 in bf16, which target vllm cannot serve (one format per "
        "layer); accepted: keep whole layers (e.g. model.layers.3.mlp.experts.*), routed_experts, or target "
        "transformers."
    )
    one = make_plan(
        recipe("transformers").model_copy(update={"keep": ["model.layers.1.mlp.experts.2.*"]}), model_tensors(), None
    )
    assert one.expert_formats()[(1, 2)] == "bf16" and one.expert_formats()[(1, 3)] == "int4-g32-sym"


def test_non_expert_format_must_be_servable():
    with pytest.raises(UserError) as info:
        make_plan(recipe("vllm", non_experts={"format": "int2"}, keep=[]), model_tensors(), None)
    assert str(info.value).startswith("non_experts.format int2-g32-sym cannot be served by target vllm:")


# ---------------------------------------------------------------------------------------------
# Usage weights, shapes, statistics


def test_unrouted_experts_cost_the_usage_floor():
    stats = make_stats(dead=[(0, 1)])
    assert int(stats.layers[0].routed_count[1]) == 0
    plan = make_plan(recipe("transformers"), model_tensors(), stats)
    entry = next(t for t in routed_entries(plan) if (t.layer, t.expert) == (0, 1))
    assert entry.usage == pytest.approx(0.05 * 2 / 4)
    assert entry.predicted_loss > 0


def test_candidates_that_cannot_hold_a_shape_are_not_offered():
    stats = make_stats()
    # int4 with group 64 cannot hold down [H, I=32]: only int8 remains
    r = recipe_from_dict(
        {
            "target": "vllm",
            "experts": {"method": "budget", "budget": {"bits_per_weight": 9}, "formats": ["int8", "int4-g64-sym"]},
        }
    )
    plan = make_plan(r, model_tensors(), stats)
    assert set(plan.expert_formats().values()) == {"int8-channel"}
    for target in ("vllm", "transformers"):  # one note per format, whatever the decision unit
        notes = make_plan(r.model_copy(update={"target": target}), model_tensors(), stats).notes
        mentions = [n for n in notes if "int4-g64-sym" in n]
        assert len(mentions) == 1
        assert mentions[0].startswith(
            "int4-g64-sym is not offered to layer(s) 0-2: tensor "
            "'model.layers.0.mlp.experts.0.down_proj.weight' has 32 input columns"
        )
    with pytest.raises(UserError) as info:
        make_plan(recipe_from_dict({"experts": {"method": "uniform", "format": "int4-g64-sym"}}), model_tensors(), None)
    assert str(info.value).startswith("format int4-g64-sym cannot hold layer 0 expert 0:")


def test_missing_sensitivity_names_the_format():
    stats = make_stats()
    with pytest.raises(UserError) as info:
        make_plan(budget("vllm", ["int8", "nvfp4"], bits_per_weight=6), model_tensors(), stats)
    assert str(info.value).startswith("the calibration statistics have no sensitivity for format nvfp4 in layer 0")
    with pytest.raises(UserError) as info:
        make_plan(budget("vllm", ["int8", "int4"], bits_per_weight=6), model_tensors(), None)
    assert str(info.value).startswith("experts.method budget needs calibration statistics")


# ---------------------------------------------------------------------------------------------
# plan.json and the summary


def test_plan_json_round_trip_and_schema(tmp_path):
    stats = make_stats()
    plan = make_plan(budget("vllm", ["int8", "int4"], bits_per_weight=5.5), model_tensors(), stats)
    path = write_plan(plan, tmp_path / "out" / "plan.json")
    assert sorted(p.name for p in path.parent.iterdir()) == ["plan.json"]  # no temp file left
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA
    names = {t[0] for t in model_tensors()}
    assert {t["name"] for t in data["tensors"]} == names
    for t in data["tensors"]:
        assert {"format", "params", "algorithm", "bytes", "shape", "role"} <= set(t)
        if t["format"] == "int4-g32-sym":
            assert t["algorithm"] == "gptq" and t["params"]["group_size"] == 32
    again = read_plan(path)
    assert again == plan
    (tmp_path / "bad.json").write_text(json.dumps({"schema": "other"}))
    with pytest.raises(UserError) as info:
        read_plan(tmp_path / "bad.json")
    assert str(info.value) == (
        f"plan {tmp_path / 'bad.json'} has schema 'other'; accepted: 'moequant.plan/1' (write it with `moequant plan`)."
    )


def test_summary_accounts_for_every_byte():
    stats = make_stats(layers=2, experts=4)
    plan = make_plan(budget("transformers", ["int8", "int4", "int3"], bits_per_weight=5), model_tensors(2, 4), stats)
    s = plan.summary
    assert s["total_bytes"] == sum(s["bytes_by_role"].values()) == sum(t.bytes for t in plan.tensors)
    assert s["bits_per_weight"]["routed_experts"] == 8 * s["routed_bytes"] / (8 * EXPERT_NUMEL)
    for L in ("0", "1"):
        assert len(s["layers"][L]["map"]) == 4
        assert sum(s["layers"][L]["counts"].values()) == 4
    text = format_summary(plan)
    assert "plan for zoo:tiny-qwen2moe: target transformers, method budget" in text
    assert "budget: 5.0 bits per routed-expert weight" in text
    assert "predicted loss" in text and "uniform int4-g32-sym" in text


def test_fused_experts_are_planned_per_expert():
    from moequant.arch import adapter_for

    config = {
        "model_type": "gpt_oss",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "vocab_size": 100,
        "intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    }
    adapter = adapter_for(config)

    class FakeCheckpoint:
        def __init__(self):
            self.config = config
            self.expected = adapter.expected_tensors()
            self.encodings = {}

        def kept_itemsize(self, name):
            return 2  # bf16

        def keys(self):
            return list(self.expected)

        def shape(self, name):
            return self.expected[name][0]

    infos = tensors_from_checkpoint(FakeCheckpoint(), adapter)
    experts = [t for t in infos if t.is_routed_weight]
    assert len(experts) == 2 * 4 * 3
    assert {t.shape for t in experts if t.proj == "down"} == {(64, 32)}
    assert {t.shape for t in experts if t.proj in ("gate", "up")} == {(32, 64)}
    assert {t.name for t in experts if t.proj in ("gate", "up") and t.layer == 0} == {
        "model.layers.0.mlp.experts.gate_up_proj"
    }
    plan = make_plan(
        recipe("transformers").model_copy(update={"keep": ["model.layers.1.mlp.experts.gate_up_proj"]}), infos, None
    )
    # keeping the fused gate_up keeps whole experts (one format covers gate, up and down)
    assert {k for (L, _), k in plan.expert_formats().items() if L == 1} == {"bf16"}
    assert {k for (L, _), k in plan.expert_formats().items() if L == 0} == {"int4-g32-sym"}
    assert any("matches only some projections" in n for n in plan.notes)
    biases = [t for t in plan.tensors if t.name.endswith("_bias")]
    assert biases and all(t.format == "bf16" for t in biases)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "gpt_oss", "deepseek_v3"])
def test_plan_from_a_real_checkpoint_covers_every_tensor(tmp_path, model_type):
    from tiny import build_tiny

    from moequant.arch import adapter_for
    from moequant.io.checkpoint import open_checkpoint

    ckpt = open_checkpoint(build_tiny(model_type, tmp_path / model_type))
    adapter = adapter_for(ckpt.config)
    r = recipe("vllm", {"method": "uniform", "format": "int8"}, keep=["lm_head"], non_experts={"format": "int8"})
    plan = make_plan(r, ckpt, None)
    assert {t.name for t in plan.tensors} == set(ckpt.keys())
    experts = plan.expert_formats()
    assert set(experts) == {(L, e) for L in adapter.moe_layers for e in range(adapter.num_experts)}
    assert set(experts.values()) == {"int8-channel"}
    for t in plan.tensors:
        if t.role in ("router", "shared_expert_gate", "norm", "embedding", "lm_head"):
            assert t.format == "bf16", t.name
        if t.role in ("attention", "shared_expert", "dense_mlp") and len(t.shape) == 2 and not t.name.endswith("bias"):
            assert t.format == "int8-channel", t.name
    # bytes: routed experts by hand (int8: one byte per weight + fp16 scale per row), the rest bf16
    routed = [t for t in plan.tensors if t.role == "routed_expert" and t.expert is not None]
    assert sum(t.bytes for t in routed) == sum(math.prod(t.shape) + 2 * t.shape[0] for t in routed)
    assert len(routed) == 3 * len(experts)


def test_budget_frontier_is_monotone_and_below_uniform_points():
    from moequant.plan.frontier import budget_frontier

    stats = make_stats(seed=4)
    r = budget("vllm", ["int8", "int4", "int3", "bf16"], bits_per_weight=5)
    frontier = budget_frontier(r, model_tensors(), stats, [3.5, 4.5, 6.0, 8.0, 10.0])
    # int3-g32 (3.5 bits) is dropped for vllm, whose smallest plan is then int4 (4.5 bits)
    assert frontier["serving"][0]["error"].startswith("experts.budget.bits_per_weight 3.5 is below")
    assert frontier["per_expert"][0]["counts"] == {"int3-g32-sym": 12}
    serving = [p for p in frontier["serving"] if "error" not in p]
    per_expert = [p for p in frontier["per_expert"] if "error" not in p]
    for points in (serving, per_expert):
        losses = [p["predicted_loss"] for p in points]
        assert losses == sorted(losses, reverse=True)  # more bytes never predict more loss
        assert all(p["routed_bits_per_weight"] <= p["bits_per_weight"] for p in points)
    for s_point, e_point in zip(frontier["serving"], frontier["per_expert"]):
        if "error" not in s_point:
            assert e_point["predicted_loss"] <= s_point["predicted_loss"] + 1e-12
    uniform = {u["format"]: u for u in frontier["uniform"]}
    assert set(uniform) == {"int8-channel", "int4-g32-sym", "int3-g32-sym", "bf16"}
    for u in uniform.values():  # at a uniform plan's own bytes, the per-expert optimum is no worse
        at = budget_frontier(r, model_tensors(), stats, [u["routed_bits_per_weight"]])["per_expert"][0]
        assert at["predicted_loss"] <= u["predicted_loss"] + 1e-12


def test_rules_and_uniform_plans_show_the_budget_plan_at_their_bytes():
    stats = make_stats(seed=6)
    rules = {
        "method": "rules",
        "rules": [{"share_at_least": 1.2, "format": "int8"}, {"format": "int4"}],
        "formats": ["int8", "int4", "int3"],
    }
    plan = make_plan(recipe("transformers", rules), model_tensors(), stats)
    alt = plan.summary["budget_alternative"]
    assert alt["routed_bytes"] <= plan.summary["routed_bytes"]
    assert alt["predicted_loss"] <= plan.summary["predicted_loss"] + 1e-12
    assert "budget plan (target transformers) at the same bytes" in format_summary(plan)
    solved = make_plan(
        budget(
            "transformers", ["int8", "int4", "int3"], bits_per_weight=plan.summary["bits_per_weight"]["routed_experts"]
        ),
        model_tensors(),
        stats,
    )
    assert alt["predicted_loss"] == pytest.approx(solved.summary["predicted_loss"], rel=1e-9)
    assert solved.summary["budget_alternative"] is None


def test_vllm_moequant_serves_per_expert_mixes_of_the_plugins_formats():
    """Target vllm-moequant (moequant's vLLM plugin) decides per expert, like transformers, but only
    among the formats vLLM's CPU backend has fused-MoE kernels for."""
    stats = make_stats(layers=4, experts=6, seed=5)
    tensors = model_tensors(4, 6)
    names = ["int8", "int4", "bf16"]
    for bpw in (4.6, 5.5, 7.0):
        plugin = make_plan(budget("vllm-moequant", names, bits_per_weight=bpw), tensors, stats)
        per_expert = make_plan(budget("transformers", names, bits_per_weight=bpw), tensors, stats)
        assert plugin.expert_formats() == per_expert.expert_formats()  # the same candidates: the same optimum
        vllm = make_plan(budget("vllm", names, bits_per_weight=bpw), tensors, stats)
        assert plugin.summary["predicted_loss"] <= vllm.summary["predicted_loss"] + 1e-12
    mixed = make_plan(budget("vllm-moequant", names, bits_per_weight=5.5), tensors, stats)
    assert any(len(keys) > 1 for keys in mixed.layer_formats().values())  # formats differ inside a layer
    dropped = make_plan(
        budget("vllm-moequant", ["int8", "int4", "fp8", "mxfp4", "int3"], bits_per_weight=6.0), tensors, stats
    )
    assert dropped.candidates == ["int8-channel", "int4-g32-sym"]
    assert set(dropped.dropped_candidates) == {"fp8-channel", "mxfp4", "int3-g32-sym"}
    assert dropped.dropped_candidates["mxfp4"] == (
        "moequant's vLLM plugin serves routed experts in bf16, per-channel int8 (W8A8) and symmetric int4 on "
        "vLLM's CPU backend, not mxfp4"
    )
    with pytest.raises(UserError) as info:
        make_plan(recipe("vllm-moequant", {"method": "uniform", "format": "fp8"}), tensors, None)
    assert str(info.value).endswith("accepted: int8 (per channel), symmetric int4, bf16, or target transformers.")
    rules = {"method": "rules", "rules": [{"share_at_least": 1.0, "format": "int8"}, {"format": "int4"}]}
    by_expert = make_plan(recipe("vllm-moequant", rules), tensors, stats)  # per-expert rules: allowed
    assert any(len(keys) > 1 for keys in by_expert.layer_formats().values())
