"""The llama.cpp target: one ggml type per (layer, projection), the exact budget optimum (against
brute force over those choices), byte counts from ggml's block sizes, what each target refuses."""

import itertools
import math

import numpy as np
import pytest
import torch

from moequant.errors import UserError
from moequant.measure.stats import LayerStats, Stats
from moequant.plan.policy import make_plan
from moequant.plan.recipe import recipe_from_dict
from moequant.plan.summary import format_summary

H = 512
# bytes per block of 32 / 256 weights, from ggml's block layouts (ggml-common.h)
BLOCK = {
    "q8_0": (32, 34),
    "q5_0": (32, 22),
    "q4_0": (32, 18),
    "q6_k": (256, 210),
    "q4_k": (256, 144),
    "q3_k": (256, 110),
}
SCALE = {"q8_0": 1.0, "q6_k": 3.0, "q5_0": 8.0, "q4_k": 15.0, "q4_0": 25.0, "q3_k": 60.0}


def tensors(layers, experts, inter):
    out = [("model.embed_tokens.weight", "embedding", None, None, None, (100, H))]
    for L in range(layers):
        p = f"model.layers.{L}."
        out += [
            (p + "mlp.gate.weight", "router", L, None, None, (experts, H)),
            (p + "self_attn.q_proj.weight", "attention", L, None, None, (H, H)),
        ]
        for e in range(experts):
            for proj in ("gate", "up", "down"):
                shape = (H, inter) if proj == "down" else (inter, H)
                out.append((p + f"mlp.experts.{e}.{proj}_proj.weight", "routed_expert", L, e, proj, shape))
    return out


def stats(layers, experts, seed=0, tokens=1000, top_k=2):
    rng = np.random.default_rng(seed)
    out = {}
    for L in range(layers):
        counts = rng.multinomial(tokens * top_k, rng.dirichlet(np.full(experts, 0.7)))
        t = {"routing.count": torch.tensor(counts, dtype=torch.int64)}
        for proj in ("gate", "up", "down"):
            for key, s in {**SCALE, "int8-channel": 1.0}.items():
                t[f"sensitivity.{proj}.{key}"] = torch.tensor(rng.uniform(0.2, 1.8, experts) * s, dtype=torch.float64)
        out[L] = LayerStats(L, top_k, tokens, t)
    return Stats(None, {}, out)


def plan_for(target, formats, bits, layers=2, experts=4, inter=256, seed=0, non_experts="bf16"):
    r = recipe_from_dict(
        {
            "target": target,
            "export": {"format": "gguf" if target == "llama.cpp" else "compressed-tensors"},
            "non_experts": {"format": non_experts},
            "experts": {"method": "budget", "budget": {"bits_per_weight": bits}, "formats": formats},
        },
        "t.yaml",
    )
    return make_plan(r, tensors(layers, experts, inter), stats(layers, experts, seed))


def nbytes(key, shape):
    block, size = BLOCK[key]
    return shape[0] * shape[1] // block * size


@pytest.mark.parametrize("seed,bits,inter", [(0, 4.9, 256), (1, 5.5, 256), (2, 4.2, 256), (3, 5.0, 64)])
def test_one_type_per_layer_projection_at_the_exact_optimum(seed, bits, inter):
    formats = list(SCALE)
    plan = plan_for("llama.cpp", formats, bits, inter=inter, seed=seed)
    st = stats(2, 4, seed)
    routed = [t for t in plan.tensors if t.role == "routed_expert"]
    chosen = {}
    for t in routed:
        chosen.setdefault((t.layer, t.proj), set()).add(t.format)
        assert t.bytes == nbytes(t.format, t.shape)
    assert all(len(v) == 1 for v in chosen.values())
    if inter == 64:  # K types cannot hold 64 input columns: down gets 32-blocks, and the plan says why
        assert all(next(iter(chosen[(L, "down")])) in ("q8_0", "q5_0", "q4_0") for L in range(2))
        # one note names every type the down projection cannot hold (q4_k among them)
        refusals = [n for n in plan.notes if " not offered to down_proj" in n]
        named = [n.split(" not offered to down_proj")[0].replace(",", " ").split() for n in refusals]
        assert any("q4_k" in words for words in named), plan.notes
    # brute force over one type per (layer, projection)
    counts = {L: st.layers[L].routed_count.double().numpy() for L in range(2)}
    usage = {L: np.maximum(counts[L] / 1000, 0.05 * 2 / 4) for L in range(2)}
    numel = 2 * 4 * 3 * inter * H
    limit = math.floor(bits * numel / 8)
    groups = [(L, p) for L in range(2) for p in ("gate", "up", "down")]
    shape = {p: ((H, inter) if p == "down" else (inter, H)) for p in ("gate", "up", "down")}
    options = {g: [k for k in formats if shape[g[1]][1] % BLOCK[k][0] == 0] for g in groups}
    best = None
    for combo in itertools.product(*[options[g] for g in groups]):
        b = sum(4 * nbytes(k, shape[g[1]]) for g, k in zip(groups, combo))
        if b > limit:
            continue
        loss = sum(
            float(np.dot(usage[g[0]], st.layers[g[0]].sensitivity[g[1]][k].numpy())) for g, k in zip(groups, combo)
        )
        best = loss if best is None or loss < best else best
    assert plan.summary["predicted_loss"] == pytest.approx(best, rel=1e-9)
    assert plan.summary["routed_bytes"] <= limit


def test_targets_refuse_each_others_formats():
    plan = plan_for("llama.cpp", ["q4_k", "int4", "q8_0"], 6.0)
    assert "int4-g128-sym" in plan.dropped_candidates and "llama.cpp" in plan.dropped_candidates["int4-g128-sym"]
    plan = plan_for("vllm", ["q4_k", "int8"], 8.5)
    assert "q4_k" in plan.dropped_candidates
    with pytest.raises(UserError, match="non_experts.format int4-g128-sym cannot be served by target llama.cpp"):
        plan_for("llama.cpp", ["q4_k"], 6.0, non_experts="int4")
    with pytest.raises(UserError, match="export format gguf and target llama.cpp go together"):
        recipe_from_dict({"target": "llama.cpp"}, "t.yaml")


def test_non_experts_in_a_ggml_type():
    plan = plan_for("llama.cpp", ["q4_k", "q8_0"], 6.0, non_experts="q8_0")
    attn = [t for t in plan.tensors if t.role == "attention"]
    assert attn and all(t.format == "q8_0" and t.bytes == nbytes("q8_0", t.shape) for t in attn)
    assert all(t.format == "bf16" for t in plan.tensors if t.role in ("router", "embedding"))


def test_non_expert_types_chosen_per_tensor_with_the_experts_at_the_exact_optimum():
    """non_experts.formats: each attention tensor's type from its measured KL (the per-tensor probe),
    solved in one budget with the routed experts (non-experts counted at non_experts.format)."""
    formats, ne = ["q8_0", "q5_0", "q4_k"], ["q8_0", "q5_0", "q4_k"]
    kl = {0: {"q8_0": 0.001, "q5_0": 0.002, "q4_k": 0.004}, 1: {"q8_0": 0.5, "q5_0": 20.0, "q4_k": 60.0}}
    st = stats(2, 4, 0)
    st.tensor_probe = {"tensors": {f"model.layers.{L}.self_attn.q_proj.weight": kl[L] for L in range(2)}}
    bits = 5.0
    r = recipe_from_dict(
        {
            "target": "llama.cpp",
            "export": {"format": "gguf"},
            "non_experts": {"format": "q5_0", "formats": ne},
            "experts": {"method": "budget", "budget": {"bits_per_weight": bits}, "formats": formats},
        },
        "t.yaml",
    )
    plan = make_plan(r, tensors(2, 4, 256), st)
    attn = {t.layer: t for t in plan.tensors if t.role == "attention"}
    assert attn[1].format == "q8_0" and attn[0].format != "q8_0"  # the measured KL decides, per tensor
    assert all(
        t.bytes == nbytes(t.format, t.shape) and t.predicted_loss == kl[t.layer][t.format] for t in attn.values()
    )
    # brute force over one type per (layer, projection) and per attention tensor
    counts = {L: st.layers[L].routed_count.double().numpy() for L in range(2)}
    usage = {L: np.maximum(counts[L] / 1000, 0.05 * 2 / 4) for L in range(2)}
    numel = 2 * 4 * 3 * 256 * H
    limit = math.floor(bits * numel / 8) + 2 * nbytes("q5_0", (H, H))
    groups = [(L, p) for L in range(2) for p in ("gate", "up", "down")]
    shape = {p: ((H, 256) if p == "down" else (256, H)) for p in ("gate", "up", "down")}
    best = None
    for combo in itertools.product(*[formats] * len(groups), ne, ne):
        b = sum(4 * nbytes(k, shape[g[1]]) for g, k in zip(groups, combo)) + sum(nbytes(k, (H, H)) for k in combo[-2:])
        if b > limit:
            continue
        loss = sum(
            float(np.dot(usage[g[0]], st.layers[g[0]].sensitivity[g[1]][k].numpy())) for g, k in zip(groups, combo)
        )
        loss += kl[0][combo[-2]] + kl[1][combo[-1]]
        best = loss if best is None or loss < best else best
    got = plan.summary["predicted_loss"] + sum(t.predicted_loss for t in attn.values())
    assert got == pytest.approx(best, rel=1e-9)
    assert plan.summary["routed_bytes"] + sum(t.bytes for t in attn.values()) <= limit
    st.tensor_probe = None  # without the measurement: one sentence, asking for it
    with pytest.raises(UserError, match="no per-tensor KL of model.layers.0.self_attn.q_proj.weight in q5_0"):
        make_plan(r, tensors(2, 4, 256), st)


def test_a_type_refused_by_one_projection_is_noted_for_that_projection_only():
    """Experts 128 wide: down_proj's 128 inputs hold no 256-block type (q4_k), gate / up's 512 do, so the note
    names down_proj and the plan still gives q4_k to gate and up."""
    plan = plan_for("llama.cpp", ["q8_0", "q4_k", "q4_0"], 4.5, inter=128)
    (note,) = [n for n in plan.notes if n.startswith("q4_k is not offered")]
    assert note.startswith("q4_k is not offered to down_proj of layer(s) 0-1: tensor "), note
    used = {(t.proj, t.format) for t in plan.tensors if t.role == "routed_expert"}
    assert ("down", "q4_k") not in used and any(f == "q4_k" for p, f in used if p in ("gate", "up")), used


def test_fused_gate_up_gets_one_type_per_layer():
    """gpt-oss stores gate and up as one tensor (one format on disk): the llama.cpp plan groups them, still
    one type per (layer, projection) otherwise, and MXFP4 (gpt-oss's own, native in GGUF) is on the menu."""
    fused = []
    for name, role, L, e, proj, shape in tensors(2, 4, 256):
        if role == "routed_expert":
            name = f"model.layers.{L}.mlp.experts.{'down_proj' if proj == 'down' else 'gate_up_proj'}"
        fused.append((name, role, L, e, proj, shape))
    formats = ["q8_0", "q4_k", "q3_k", "mxfp4"]
    st = stats(2, 4, 0)
    for L in range(2):
        for proj in ("gate", "up", "down"):
            st.layers[L].tensors[f"sensitivity.{proj}.mxfp4"] = st.layers[L].tensors[f"sensitivity.{proj}.q4_k"] * 1.1
        st.layers[L].tensors["sensitivity.gate.q3_k"] *= 100  # gate wants q4_k or better, up is fine in q3_k
        st.layers[L].tensors["sensitivity.up.q3_k"] /= 100
    r = recipe_from_dict(
        {
            "target": "llama.cpp",
            "export": {"format": "gguf"},
            "non_experts": {"format": "bf16"},
            "experts": {"method": "budget", "budget": {"bits_per_weight": 4.6}, "formats": formats},
        },
        "t.yaml",
    )
    plan = make_plan(r, fused, st)
    chosen = {}
    for t in plan.tensors:
        if t.role == "routed_expert":
            chosen.setdefault((t.layer, t.name), set()).add(t.format)
    assert len(chosen) == 4 and all(len(v) == 1 for v in chosen.values())
    assert "mxfp4" not in plan.dropped_candidates
    # the same statistics with the projections stored apart: gate and up are free to differ (and here do)
    apart = make_plan(r, tensors(2, 4, 256), st)
    per_proj = {(t.layer, t.proj): t.format for t in apart.tensors if t.role == "routed_expert"}
    assert any(per_proj[(L, "gate")] != per_proj[(L, "up")] for L in range(2))


def with_projection_probe(st: Stats, alone: dict, kl: dict) -> Stats:
    """st with a KL probe in q4_k that measured each projection of each layer alone."""
    layers = {
        str(L): {"format": "q4_k", "kl": kl[L], "projections": {p: {"kl_alone": a} for p, a in alone[L].items()}}
        for L in st.layers
    }
    return Stats(None, {}, st.layers, probe={"schema": "moequant.calib.probe/1", "tokens": 64, "layers": layers})


def test_a_per_projection_probe_splits_each_layers_kl_between_its_projections_at_the_exact_optimum():
    """The probe's one-projection KLs split the layer's measured KL between gate, up and down
    (scale_L,p = kl_L * kl_alone_p / sum_q kl_alone_q / predicted_L,p); the budget's optimum over one type per
    (layer, projection) with those scaled losses equals brute force in float64, and here (down measured 8x
    gate's effect, the sensitivities about equal) it gives down more bits than the unsplit scale does."""
    formats, bits, inter = list(SCALE), 4.2, 256
    r = recipe_from_dict(
        {
            "target": "llama.cpp",
            "export": {"format": "gguf"},
            "non_experts": {"format": "bf16"},
            "experts": {"method": "budget", "budget": {"bits_per_weight": bits}, "formats": formats},
        },
        "t.yaml",
    )
    st = stats(2, 4, seed=5)
    alone = {L: {"gate": 0.01, "up": 0.012, "down": 0.08} for L in range(2)}
    kl = {0: 0.05, 1: 0.07}
    split = make_plan(r, tensors(2, 4, inter), with_projection_probe(st, alone, kl))
    unsplit = make_plan(r, tensors(2, 4, inter), with_projection_probe(st, {L: {} for L in range(2)}, kl))
    assert split.summary["probe"]["used"] and unsplit.summary["probe"]["used"]
    assert isinstance(split.summary["probe"]["layers"]["0"]["scale"], dict)
    assert "per layer and projection" in format_summary(split)

    usage = {L: np.maximum(st.layers[L].routed_count.double().numpy() / 1000, 0.05 * 2 / 4) for L in range(2)}
    sens = lambda L, p, k: st.layers[L].sensitivity[p][k].numpy()
    scale = {
        (L, p): kl[L] * alone[L][p] / sum(alone[L].values()) / float(usage[L] @ sens(L, p, "q4_k"))
        for L in range(2)
        for p in ("gate", "up", "down")
    }
    groups = list(scale)
    shape = {p: ((H, inter) if p == "down" else (inter, H)) for p in ("gate", "up", "down")}
    limit = math.floor(bits * 2 * 4 * 3 * inter * H / 8)
    best = None
    for combo in itertools.product(formats, repeat=len(groups)):
        if sum(4 * nbytes(k, shape[g[1]]) for g, k in zip(groups, combo)) > limit:
            continue
        loss = sum(scale[g] * float(usage[g[0]] @ sens(*g, k)) for g, k in zip(groups, combo))
        best = loss if best is None or loss < best else best
    assert split.summary["predicted_loss"] == pytest.approx(best, rel=1e-9)
    # in the probe format each (layer, projection)'s scaled loss is its share of the layer's KL
    for (L, p), s in scale.items():
        assert s * float(usage[L] @ sens(L, p, "q4_k")) == pytest.approx(kl[L] * alone[L][p] / 0.102, rel=1e-12)

    def bytes_of(plan, proj):
        return sum(t.bytes for t in plan.tensors if t.role == "routed_expert" and t.proj == proj)

    assert bytes_of(split, "down") > bytes_of(unsplit, "down")


def test_only_a_per_projection_budget_asks_calibration_to_probe_each_projection():
    from moequant.pipeline.apply import calibration_settings

    def settings_for(target, fmt, method="budget"):
        experts = {"method": method, "formats": [fmt], "budget": {"bits_per_weight": 5.0}}
        if method != "budget":
            experts = {"method": "uniform", "format": fmt}
        r = recipe_from_dict(
            {
                "target": target,
                "export": {"format": "gguf" if target == "llama.cpp" else "compressed-tensors"},
                "calibration": {"probe_samples": 4},
                "experts": experts,
            },
            "t.yaml",
        )
        return calibration_settings(r, formats=("int8-channel",))

    gguf = settings_for("llama.cpp", "q4_k")
    assert gguf.probe_projections and gguf.fingerprint_fields()["probe_projections"] is True
    vllm = settings_for("vllm", "int4")
    assert (
        vllm.probe_samples == 4
        and not vllm.probe_projections
        and vllm.fingerprint_fields()["probe_projections"] is False
    )
    assert not settings_for("llama.cpp", "q4_k", method="uniform").probe_projections  # no budget: no probe at all
