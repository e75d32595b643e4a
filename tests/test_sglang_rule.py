"""SGLang's per-layer rule (moequant.targets.sglang cites the code): INT4 / INT8 weight-only groups
may differ per MoE layer under the top-level format pack-quantized; with FP8 / MXFP4 one routed
format for the whole model; per-layer resolution needs experts named gate/up/down_proj.

SGLang itself is not run here: its compressed-tensors package imports sgl_kernel / CUDA-only
modules at import time, so its scheme resolution cannot be imported on this CPU machine."""

import json

import pytest
from test_export_models import quantize_experts
from test_policy import make_stats, model_tensors

from moequant.errors import UserError
from moequant.export.write import export_checkpoint
from moequant.plan.policy import make_plan
from moequant.plan.recipe import recipe_from_dict
from moequant.zoo import path as zoo_path


def plan(formats, bits, tensors, stats):
    r = recipe_from_dict(
        {
            "target": "sglang",
            "formats": {"int4": {"group_size": 32}},
            "experts": {"method": "budget", "budget": {"bits_per_weight": bits}, "formats": formats},
        },
        "t.yaml",
    )
    return make_plan(r, tensors, stats)


def mixtral_names(tensors):
    ren = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    out = []
    for name, role, L, e, proj, shape in tensors:
        if role == "routed_expert":
            leaf = name.rsplit(".", 2)[-2]
            name = name.replace(f".mlp.experts.{e}.{leaf}", f".block_sparse_moe.experts.{e}.{ren[leaf]}")
        out.append((name, role, L, e, proj, shape))
    return out


def test_int_groups_differ_per_layer_fp8_stays_model_wide():
    stats, tensors = make_stats(layers=4, experts=6, seed=3), model_tensors(4, 6)
    mixed = plan(["int8", "int4"], 6.0, tensors, stats)
    per_layer = {L: keys for L, keys in mixed.layer_formats().items()}
    assert all(len(k) == 1 for k in per_layer.values()) and len(set.union(*per_layer.values())) == 2
    # with fp8 offered: either an INT4 / INT8 per-layer plan or one format everywhere, whichever predicts less
    with_fp8 = plan(["int8", "int4", "fp8"], 6.0, tensors, stats)
    keys = set(with_fp8.expert_formats().values())
    assert len(keys) == 1 or keys <= {"int8-channel", "int4-g32-sym"}
    assert with_fp8.summary["predicted_loss"] <= mixed.summary["predicted_loss"] + 1e-12
    # Mixtral's w1/w3/w2 do not resolve per layer in SGLang: one format, and the plan says why
    mx = plan(["int8", "int4"], 6.0, mixtral_names(tensors), stats)
    assert len(set(mx.expert_formats().values())) == 1
    assert any("gate_proj / up_proj / down_proj" in n for n in mx.notes)


def test_export_writes_what_sglang_loads_and_refuses_the_rest(tmp_path):
    qwen2 = zoo_path("tiny-qwen2moe")
    ok = quantize_experts(qwen2, lambda L, e, p: ["int4-g32-sym", "int8-channel"][L % 2])
    out = export_checkpoint(qwen2, ok, tmp_path / "ok", target="sglang")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized"
    # SGLang's resolution: each layer's expert 0 gate/up/down_proj match one group (names or `re:` targets, as
    # compressed-tensors matches them), the layer's format
    from compressed_tensors.utils.match import match_name

    def group_of(module):
        (group,) = [g for g in qc["config_groups"].values() if any(match_name(module, t) for t in g["targets"])]
        return group

    for L in range(4):
        groups = [group_of(f"model.layers.{L}.mlp.experts.0.{p}_proj") for p in ("gate", "up", "down")]
        assert all(g == groups[0] for g in groups) and groups[0]["weights"]["num_bits"] == (4 if L % 2 == 0 else 8)
        assert groups[0]["weights"]["symmetric"] and groups[0]["input_activations"] is None
    bad = quantize_experts(qwen2, lambda L, e, p: ["int4-g32-sym", "fp8-channel"][L % 2])
    with pytest.raises(UserError, match="only as INT4 / INT8 weight-only groups"):
        export_checkpoint(qwen2, bad, tmp_path / "bad", target="sglang")
    assert not (tmp_path / "bad").exists()
    mixtral = zoo_path("tiny-mixtral")
    mixed = quantize_experts(mixtral, lambda L, e, p: ["int4-g32-sym", "int8-channel"][L % 2])
    with pytest.raises(UserError, match="gate_proj / up_proj / down_proj"):
        export_checkpoint(mixtral, mixed, tmp_path / "mx", target="sglang")
    uniform = export_checkpoint(
        qwen2, quantize_experts(qwen2, lambda L, e, p: "fp8-channel"), tmp_path / "fp8", target="sglang"
    )
    assert json.loads((uniform / "config.json").read_text())["quantization_config"]["format"] == "float-quantized"
