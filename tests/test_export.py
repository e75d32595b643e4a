"""Exports checked with readers we did not write: compressed-tensors' own decompression,
transformers' FP8 / MXFP4 loaders, compressed-tensors' AutoAWQ converter, and the GPTQ v1 bit
layout unpacked here from its definition. vLLM is in tests/test_vllm.py."""

from __future__ import annotations

import glob
import json
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_export_models import build_model, quantize_experts, quantize_named

from moequant import formats
from moequant.arch import adapter_for
from moequant.errors import UserError
from moequant.export.write import export_checkpoint
from moequant.io.checkpoint import open_checkpoint
from moequant.io.loader import dequantized_state_dict, load
from moequant.layouts.compressed_tensors import TRANSFORMERS_GUARD, transformers_guard_group

# every format moequant has, cycled over the experts of one model: a per-expert mix
ALL_KEYS = [
    "int4-g128-sym",
    "int4-g32-asym",
    "int3-g64-sym",
    "int2-g32-asym",
    "int8-channel",
    "fp8-channel",
    "fp8-block128",
    "fp8-tensor",
    "mxfp4",
    "nvfp4",
    "int4-g64-sym",
    "int3-g128-asym",
]


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return build_model("mixtral", tmp_path_factory.mktemp("src") / "mixtral")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return build_model("qwen2_moe", tmp_path_factory.mktemp("src") / "qwen2_moe")


def _per_expert_mix(layer, expert, proj):
    return ALL_KEYS[(layer * 12 + expert * 3 + ("gate", "up", "down").index(proj)) % len(ALL_KEYS)]


def _all_tensors(path) -> dict:
    out = {}
    for f in sorted(glob.glob(str(Path(path) / "*.safetensors"))):
        out.update(load_file(f))
    return out


def _ct_decompress(path) -> dict:
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    # validate() = decompress + refuse leftover quantization parameters (an untargeted module)
    return CompressedTensorsDequantizer(str(path), dtype=torch.float32).validate(_all_tensors(path))


def _ct_native(path) -> dict:
    """compressed-tensors' decompression at the precision it computes in (the scale's dtype)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_quantizable_tensors

    config = QuantizationConfig.model_validate(
        json.loads((Path(path) / "config.json").read_text())["quantization_config"]
    )
    tensors = _all_tensors(path)
    out = {}
    for scheme in config.config_groups.values():
        assert scheme.format == infer_module_format(torch.nn.Linear, scheme)  # our per-group format is theirs
        compressor = BaseCompressor.get_value_from_registry(scheme.format)
        names = compressor.compression_param_names(scheme)
        for module, _ in match_quantizable_tensors(
            tensors, ignore=config.ignore, targets=scheme.targets, param_targets=[names[0]]
        ):
            state = {p: tensors[f"{module}.{p}"] for p in names if f"{module}.{p}" in tensors}
            out[f"{module}.weight"] = compressor.decompress(state, scheme)["weight"]
    return out


# ---- compressed-tensors -----------------------------------------------------------------------


@pytest.mark.parametrize("int8_activations", ["none", "dynamic"])
def test_compressed_tensors_decompression_equals_ours_for_a_per_expert_mix_of_every_format(
    mixtral, tmp_path, int8_activations
):
    experts = quantize_experts(mixtral, _per_expert_mix)
    attention = quantize_named(
        mixtral,
        lambda n, role: (
            {"q_proj": "int8-channel", "k_proj": "int4-g64-asym", "v_proj": "fp8-block128", "o_proj": "nvfp4"}.get(
                n.split(".")[-2]
            )
            if role == "attention"
            else None
        ),
    )
    out = export_checkpoint(
        mixtral, {**experts, **attention}, tmp_path / "ct", target="transformers", int8_activations=int8_activations
    )
    assert {q.spec.key for q in experts.values()} == set(ALL_KEYS)

    native = _ct_native(out)
    ours_by_dtype = {}
    ad = adapter_for(open_checkpoint(mixtral).config)
    names = {ad.expert_tensor_name(*k): q for k, q in experts.items()} | attention
    assert set(native) == set(names)
    for name, theirs in native.items():
        dt = theirs.dtype
        if dt not in ours_by_dtype:
            ours_by_dtype[dt] = dequantized_state_dict(out, dt)
        assert torch.equal(ours_by_dtype[dt][name], theirs), (name, names[name].spec.key, dt)
        # the file holds exactly what was quantized in memory
        exact = dequantized_state_dict(out, torch.float32)[name] if dt == torch.float32 else None
        if exact is not None:
            assert torch.equal(exact, names[name].dequantize(torch.float32)), name

    # their whole-checkpoint reader: every module consumed, untouched tensors passed through
    theirs = _ct_decompress(out)
    source = _all_tensors(mixtral)
    for name, t in source.items():
        if name not in names:
            assert torch.equal(theirs[name], t), name


def test_export_round_trips_every_quantized_tensor_exactly(mixtral, tmp_path):
    experts = quantize_experts(mixtral, _per_expert_mix)
    out = export_checkpoint(mixtral, experts, tmp_path / "ct", target="transformers")
    ours = dequantized_state_dict(out, torch.float32)
    ad = adapter_for(open_checkpoint(mixtral).config)
    for key, q in experts.items():
        assert torch.equal(ours[ad.expert_tensor_name(*key)], q.dequantize(torch.float32)), (key, q.spec.key)


def test_config_for_vllm_and_sglang(qwen2, tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    experts = quantize_experts(qwen2, lambda L, e, p: ["int4-g128-sym", "int8-channel"][L])
    shared = quantize_named(qwen2, lambda n, role: "int8-channel" if role == "shared_expert" else None)
    for target, int8, expect_global in [
        ("vllm", "none", "pack-quantized"),
        ("vllm", "dynamic", "mixed-precision"),
        ("sglang", "dynamic", "pack-quantized"),
    ]:
        out = export_checkpoint(
            qwen2, {**experts, **shared}, tmp_path / f"{target}-{int8}", target=target, int8_activations=int8
        )
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        QuantizationConfig.model_validate(qc)
        assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
        assert qc["format"] == expect_global
        guard = qc["config_groups"].pop(TRANSFORMERS_GUARD)  # two routed-expert formats: plain transformers refuses
        assert list(qc["config_groups"]) == [f"group_{i}" for i in range(len(qc["config_groups"]))]
        assert guard == transformers_guard_group()
        # disjoint: every quantized module of the checkpoint is targeted by exactly one group, every other by
        # none; each layer's routed experts by one `re:` target (transformers 5 matches it to its fused experts
        # module, so compressed-tensors warns for no expert), the shared experts by their names
        from compressed_tensors.utils.match import match_name  # compressed-tensors' own reading of a target

        modules = {n.rsplit(".", 1)[0] for n in _all_tensors(out)}
        ad = adapter_for(open_checkpoint(qwen2).config)
        quantized = {ad.expert_tensor_name(*k).rsplit(".", 1)[0] for k in experts} | {
            n.rsplit(".", 1)[0] for n in shared
        }
        for module in modules:
            hits = [t for g in qc["config_groups"].values() for t in g["targets"] if match_name(module, t)]
            assert len(hits) == (module in quantized), (module, hits)
        for L in (0, 1):
            fused = f"model.layers.{L}.mlp.experts"  # transformers 5's one module for a layer's experts
            (hit,) = [t for g in qc["config_groups"].values() for t in g["targets"] if match_name(fused, t)]
            assert hit.startswith("re:")
        names = [t for g in qc["config_groups"].values() for t in g["targets"] if not t.startswith("re:")]
        assert sorted(names) == sorted(n.rsplit(".", 1)[0] for n in shared)
        group_formats = {g["format"] for g in qc["config_groups"].values()}
        assert group_formats == ({"pack-quantized"} if int8 == "none" else {"pack-quantized", "int-quantized"})
        for L in (0, 1):
            assert f"model.layers.{L}.mlp.gate" in qc["ignore"]
            assert f"model.layers.{L}.mlp.shared_expert_gate" in qc["ignore"]
            assert f"model.layers.{L}.self_attn.q_proj" in qc["ignore"]
        assert "lm_head" in qc["ignore"] and "model.embed_tokens" not in qc["ignore"]
        tensors = _all_tensors(out)
        w = "model.layers.1.mlp.experts.0.up_proj"  # int8 layer
        if int8 == "none":
            assert tensors[w + ".weight_packed"].dtype == torch.int32 and w + ".weight" not in tensors
        else:
            assert tensors[w + ".weight"].dtype == torch.int8 and tensors[w + ".weight_scale"].dtype == torch.float32
        assert not any(".experts.gate_up_proj" in n for n in tensors)  # on-disk names, never fused


def test_bytes_on_disk_match_the_format_accounting(qwen2, tmp_path):
    experts = quantize_experts(qwen2, lambda L, e, p: ["int4-g128-sym", "int4-g32-asym"][e % 2])
    out = export_checkpoint(qwen2, experts, tmp_path / "ct", target="transformers", max_shard_bytes=200_000)
    ckpt = open_checkpoint(qwen2)
    ad = adapter_for(ckpt.config)
    planned = sum(q.nbytes for q in experts.values())
    planned += sum(ckpt.entries[n].nbytes for n in ckpt.keys() if ad.classify(n).role != "routed_expert")
    shape_metadata = 16 * len(experts)  # weight_shape: two int64 per module, not a weight byte
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").exists()
    headers = sum(8 + struct.unpack("<Q", p.read_bytes()[:8])[0] for p in shards)
    assert sum(p.stat().st_size for p in shards) == planned + shape_metadata + headers


def test_shards_index_and_aux_files(mixtral, tmp_path):
    experts = quantize_experts(mixtral, lambda L, e, p: "int4-g128-sym")
    one = export_checkpoint(mixtral, experts, tmp_path / "one")
    many = export_checkpoint(mixtral, experts, tmp_path / "many", max_shard_bytes=100_000)
    index = json.loads((many / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(_all_tensors(one))
    for shard in set(index["weight_map"].values()):
        tensors = load_file(many / shard)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= 100_000 or len(tensors) == 1
    a, b = dequantized_state_dict(one), dequantized_state_dict(many)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for aux in ("tokenizer.json", "generation_config.json"):
        assert (many / aux).read_bytes() == (Path(mixtral) / aux).read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_a_crash_leaves_the_old_output_untouched(mixtral, tmp_path, monkeypatch):
    experts = quantize_experts(mixtral, lambda L, e, p: "int4-g128-sym")
    out = export_checkpoint(mixtral, experts, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls = []

    def failing(q):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return formats.pack_compressed_tensors(q)

    monkeypatch.setattr("moequant.export.write.formats.pack_compressed_tensors", failing)
    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(mixtral, quantize_experts(mixtral, lambda L, e, p: "int8-channel"), out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_moequant_load_gives_a_transformers_model_with_our_weights(mixtral, tmp_path):
    experts = quantize_experts(mixtral, _per_expert_mix)
    out = export_checkpoint(mixtral, experts, tmp_path / "ct", target="transformers")
    model = load(out, dtype=torch.float32)
    ad = adapter_for(open_checkpoint(mixtral).config)
    for (layer, expert, proj), q in experts.items():
        got = ad.expert_from_module(ad.experts_module(model, layer), expert, proj)
        assert torch.equal(got, q.dequantize(torch.float32)), (layer, expert, proj, q.spec.key)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.isfinite(model(ids).logits).all()


# ---- refusals: one sentence, before any work, nothing written ------------------------------------------

REFUSALS = [
    (
        "vllm per-expert mix",
        "compressed-tensors",
        "vllm",
        lambda L, e, p: ["int4-g128-sym", "int8-channel"][e % 2],
        "one format for all routed experts of an MoE layer",
    ),
    ("vllm int3", "compressed-tensors", "vllm", lambda L, e, p: "int3-g128-sym", "only at 4 or 8 bits"),
    ("gptq asym", "gptq", "vllm", lambda L, e, p: "int4-g128-asym", "symmetric int4 / int8"),
    ("awq mxfp4", "awq", "transformers", lambda L, e, p: "mxfp4", "int4 with groups only"),
    ("fp8 int4", "deepseek-fp8", "transformers", lambda L, e, p: "int4-g128-sym", "fp8-block128 only"),
    ("gpt-oss layout on mixtral", "gpt-oss-mxfp4", "transformers", lambda L, e, p: "mxfp4", "gpt-oss's own"),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_a_plan_the_layout_cannot_hold_is_refused_before_any_work(mixtral, tmp_path, monkeypatch, case):
    _, layout, target, format_of, message = case
    experts = quantize_experts(mixtral, format_of)
    monkeypatch.setattr("moequant.export.write.ShardWriter", None)  # any write attempt would crash differently
    with pytest.raises(UserError, match=re.escape(message)) as err:
        export_checkpoint(mixtral, experts, tmp_path / "out", layout=layout, target=target)
    assert str(err.value).count(". ") == 0 and str(err.value).endswith(".")  # one sentence
    assert not any(tmp_path.iterdir())


def test_fused_projections_need_one_format_for_vllm(mixtral, tmp_path):
    attention = quantize_named(
        mixtral,
        lambda n, role: (
            ("int8-channel" if n.endswith("q_proj.weight") else "int4-g128-sym") if role == "attention" else None
        ),
    )
    with pytest.raises(UserError, match="fuses the projections of model.layers.0.self_attn"):
        export_checkpoint(mixtral, attention, tmp_path / "out", target="vllm")
    export_checkpoint(mixtral, attention, tmp_path / "out", target="transformers")  # fine there


def test_bad_inputs_name_what_is_wrong(mixtral, tmp_path):
    q = formats.quantize(torch.randn(128, 256), "int4-g128-sym")
    with pytest.raises(UserError, match="not a tensor of"):
        export_checkpoint(mixtral, {"model.layers.0.nope.weight": q}, tmp_path / "o")
    with pytest.raises(UserError, match=r"has shape \[128, 256\], but the checkpoint's weight is \[256, 128\]"):
        export_checkpoint(mixtral, {"model.layers.0.block_sparse_moe.experts.0.w2.weight": q}, tmp_path / "o")
    with pytest.raises(UserError, match="layout 'safetensors-int4' is not supported"):
        export_checkpoint(mixtral, {}, tmp_path / "o", layout="safetensors-int4")
    assert not any(tmp_path.iterdir())


# ---- GPTQ v1 -------------------------------------------------------------------------------------


def _gptq_v1_reference(qweight, qzeros, scales, g_idx, bits):
    """GPTQ v1 from its definition: codes packed along the input axis, 32/bits per int32, lowest
    bits first; zeros packed along the output axis holding zero - 1."""
    per = 32 // bits
    mask = (1 << bits) - 1
    q = torch.stack([(qweight >> (bits * k)) & mask for k in range(per)], dim=1).reshape(-1, qweight.shape[1])
    z = torch.stack([(qzeros >> (bits * k)) & mask for k in range(per)], dim=2).reshape(qzeros.shape[0], -1) + 1
    return ((q - z[g_idx.long()]).double() * scales[g_idx.long()].double()).t()  # [out, in]


def test_gptq_v1_export_unpacks_by_definition_with_per_layer_overrides(mixtral, tmp_path):
    experts = quantize_experts(mixtral, lambda L, e, p: ["int4-g128-sym", "int8-channel"][L])
    attention = quantize_named(
        mixtral, lambda n, role: "int4-g128-sym" if role == "attention" and "o_proj" not in n else None
    )
    out = export_checkpoint(mixtral, {**experts, **attention}, tmp_path / "gptq", layout="gptq")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert json.loads((out / "quantize_config.json").read_text()) == qc
    assert (qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"], qc["checkpoint_format"]) == (
        4,
        128,
        True,
        False,
        "gptq",
    )
    dyn = qc["dynamic"]

    def rule(module):  # the first matching rule, as vLLM and GPTQModel apply them (re.match)
        for pattern, override in dyn.items():
            if re.match(pattern[2:], module):
                return pattern[:2], override
        return None

    assert rule("model.layers.1.block_sparse_moe.experts") == ("+:", {"bits": 8, "group_size": -1})  # vLLM's name
    assert rule("model.layers.1.block_sparse_moe.experts.3.w2") == ("+:", {"bits": 8, "group_size": -1})
    assert rule("model.layers.0.block_sparse_moe.experts.3.w2") is None
    assert rule("model.layers.0.self_attn.o_proj")[0] == "-:" and rule("model.layers.0.self_attn.qkv_proj") is None
    assert rule("model.layers.0.self_attn.q_proj") is None
    tensors = _all_tensors(out)
    ad = adapter_for(open_checkpoint(mixtral).config)
    names = {ad.expert_tensor_name(*k): q for k, q in experts.items()} | attention
    for name, q in names.items():
        m = name[: -len(".weight")]
        bits = q.spec.bits
        ref = _gptq_v1_reference(
            tensors[m + ".qweight"], tensors[m + ".qzeros"], tensors[m + ".scales"], tensors[m + ".g_idx"], bits
        )
        assert tensors[m + ".scales"].dtype == torch.float16
        assert torch.equal(ref.float(), q.dequantize(torch.float32)), name
        zero_word = sum(((1 << (bits - 1)) - 1) << (bits * k) for k in range(32 // bits))  # sym: 2^(B-1) - 1
        assert (tensors[m + ".qzeros"].view(torch.int32).to(torch.int64) & 0xFFFFFFFF == zero_word).all()
    ours = dequantized_state_dict(out, torch.float32)
    for name, q in names.items():
        assert torch.equal(ours[name], q.dequantize(torch.float32))


# ---- AWQ -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["int4-g128-asym", "int4-g64-sym"])
def test_awq_export_read_by_compressed_tensors_autoawq_converter(mixtral, tmp_path, key):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    experts = quantize_experts(mixtral, lambda L, e, p: key)
    out = export_checkpoint(mixtral, experts, tmp_path / "awq", layout="awq", target="transformers")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["zero_point"] == key.endswith("asym") and qc["version"] == "gemm"
    converter = AutoAWQConverter.from_autoawq_config(qc, targets=["re:.*experts.*"])
    converted = converter.process(_all_tensors(out))
    scheme = converter._build_quant_config().config_groups["config_group_0"]
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    ad = adapter_for(open_checkpoint(mixtral).config)
    ours = dequantized_state_dict(out, torch.float16)
    for k, q in experts.items():
        m = ad.expert_tensor_name(*k)[: -len(".weight")]
        state = {p: converted[f"{m}.{p}"] for p in compressor.compression_param_names(scheme)}
        theirs = compressor.decompress(state, scheme)["weight"]
        assert theirs.dtype == torch.float16
        assert torch.equal(theirs, ours[m + ".weight"]), k
        assert torch.equal(ours[m + ".weight"], q.dequantize(torch.float16))


# ---- transformers: DeepSeek FP8 and gpt-oss MXFP4 -------------------------------------------------------


def test_transformers_loads_the_deepseek_fp8_export_with_our_weights(tmp_path, monkeypatch):
    import transformers.quantizers.quantizer_finegrained_fp8 as fp8_quantizer
    from transformers import AutoModelForCausalLM

    # transformers asks for `accelerate` before it looks at the (CPU) dequantizing path, which
    # does not use it; the reader below is transformers' own FP8 loading code.
    monkeypatch.setattr(fp8_quantizer, "is_accelerate_available", lambda: True)
    src = build_model("deepseek_v3", tmp_path / "ds3")
    q = quantize_named(
        src,
        lambda n, role: (
            "fp8-block128" if role in ("routed_expert", "shared_expert", "dense_mlp", "attention") else None
        ),
    )
    out = export_checkpoint(src, q, tmp_path / "fp8", layout="deepseek-fp8", target="transformers")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["weight_block_size"] == [128, 128] and "model.layers.1.mlp.gate" in qc["modules_to_not_convert"]
    tensors = _all_tensors(out)
    assert tensors["model.layers.1.mlp.experts.2.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv" in tensors
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    ad = adapter_for(open_checkpoint(src).config)
    params = dict(model.named_parameters())
    for name, qt in q.items():
        role = ad.classify(name)
        if role.role == "routed_expert":
            got = ad.expert_from_module(ad.experts_module(model, role.layer), role.expert, role.proj)
        else:
            got = params[name]
        assert torch.equal(got, qt.dequantize(torch.bfloat16)), name
    ours = load(out)
    mine = dict(ours.named_parameters())
    assert all(torch.equal(mine[n], p) for n, p in params.items())


def test_transformers_loads_the_gpt_oss_mxfp4_export_with_our_weights(tmp_path):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    src = build_model("gpt_oss", tmp_path / "gptoss")
    experts = quantize_experts(src, lambda L, e, p: "mxfp4")
    out = export_checkpoint(src, experts, tmp_path / "mxfp4", layout="gpt-oss-mxfp4", target="transformers")
    tensors = _all_tensors(out)
    assert tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (4, 256, 8, 16)
    assert tensors["model.layers.0.mlp.experts.down_proj_scales"].shape == (4, 256, 4)
    source = _all_tensors(src)
    assert torch.equal(
        tensors["model.layers.0.mlp.experts.gate_up_proj_bias"], source["model.layers.0.mlp.experts.gate_up_proj_bias"]
    )
    model = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.bfloat16, quantization_config=Mxfp4Config(dequantize=True)
    )
    ad = adapter_for(open_checkpoint(src).config)
    for (layer, expert, proj), q in experts.items():
        got = ad.expert_from_module(ad.experts_module(model, layer), expert, proj)
        assert torch.equal(got, q.dequantize(torch.bfloat16)), (layer, expert, proj)
    mine = dict(load(out).named_parameters())
    assert all(torch.equal(mine[n], p) for n, p in model.named_parameters())


def test_gpt_oss_needs_its_own_layout(tmp_path):
    src = build_model("gpt_oss", tmp_path / "gptoss")
    experts = quantize_experts(src, lambda L, e, p: "int4-g128-sym")
    with pytest.raises(UserError, match="stores its experts fused"):
        export_checkpoint(src, experts, tmp_path / "ct", target="transformers")
    part = {k: q for k, q in quantize_experts(src, lambda L, e, p: "mxfp4").items() if k[0] == 0}
    with pytest.raises(UserError, match="needs every expert in mxfp4"):
        export_checkpoint(src, part, tmp_path / "mx", layout="gpt-oss-mxfp4", target="transformers")


def test_gptq_per_expert_mix_overrides_exactly_the_listed_experts(mixtral, tmp_path):
    experts = quantize_experts(mixtral, lambda L, e, p: "int8-channel" if (L + e) % 3 == 0 else "int4-g128-sym")
    with pytest.raises(UserError, match="one format for all routed experts"):
        export_checkpoint(mixtral, experts, tmp_path / "v", layout="gptq", target="vllm")
    out = export_checkpoint(mixtral, experts, tmp_path / "g", layout="gptq", target="transformers")
    dyn = json.loads((out / "quantize_config.json").read_text())["dynamic"]
    ad = adapter_for(open_checkpoint(mixtral).config)
    ours = dequantized_state_dict(out, torch.float32)
    for key, q in experts.items():
        name = ad.expert_tensor_name(*key)
        hits = [p for p in dyn if re.match(p[2:], name[: -len(".weight")])]
        assert hits == (["+:" + re.escape(name[: -len(".weight")]) + "$"] if q.spec.bits == 8 else []), key
        assert torch.equal(ours[name], q.dequantize(torch.float32))


def test_kept_tensors_and_bf16_plans_are_written_as_given(mixtral, tmp_path):
    norm = torch.full((256,), 2.0, dtype=torch.bfloat16)
    router = torch.randn(4, 256).to(torch.bfloat16)
    attn = formats.quantize(torch.randn(256, 256), "bf16")
    q = {"model.layers.0.self_attn.o_proj.weight": attn}
    out = export_checkpoint(
        mixtral,
        q,
        tmp_path / "o",
        target="transformers",
        kept={"model.norm.weight": norm, "model.layers.1.block_sparse_moe.gate.weight": router},
    )
    got = _all_tensors(out)
    assert torch.equal(got["model.norm.weight"], norm)
    assert torch.equal(got["model.layers.1.block_sparse_moe.gate.weight"], router)
    assert torch.equal(got["model.layers.0.self_attn.o_proj.weight"], attn.codes)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())  # nothing quantized: plain
    with pytest.raises(UserError, match="given both quantized and kept"):
        export_checkpoint(mixtral, q, tmp_path / "p", kept={"model.layers.0.self_attn.o_proj.weight": attn.codes})
    with pytest.raises(UserError, match=r"kept tensor 'model.norm.weight' has shape \[4, 256\]"):
        export_checkpoint(mixtral, {}, tmp_path / "p", kept={"model.norm.weight": router})


def test_vllm_moequant_target_writes_the_per_expert_format_map(qwen2, tmp_path):
    """Target vllm-moequant: quant_method moequant, expert_formats per MoE layer module in expert order,
    the compressed-tensors groups otherwise as for vllm, and moequant.load reads it as compressed-tensors."""
    fmt = lambda L, e, p: "int4-g32-sym" if (L + e) % 2 == 0 else "int8-channel"
    q = quantize_experts(qwen2, fmt)
    out = export_checkpoint(qwen2, q, tmp_path / "plugin", target="vllm-moequant", int8_activations="dynamic")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    adapter = adapter_for(open_checkpoint(qwen2).config)
    assert qc["quant_method"] == "moequant"
    assert qc["expert_formats"] == {
        f"model.layers.{L}.mlp.experts": [fmt(L, e, "gate") for e in range(adapter.num_experts)]
        for L in adapter.moe_layers
    }
    assert {g["format"] for g in qc["config_groups"].values()} == {"pack-quantized", "int-quantized"}
    ours = dequantized_state_dict(out, torch.float32)
    for (L, e, p), qt in q.items():
        assert torch.equal(ours[adapter.expert_tensor_name(L, e, p)], formats.dequantize(qt).float())
    with pytest.raises(UserError) as info:  # the plugin stacks an expert's gate, up and down in one group
        split = quantize_experts(qwen2, lambda L, e, p: "int8-channel" if p == "down" else "int4-g32-sym")
        export_checkpoint(qwen2, split, tmp_path / "split", target="vllm-moequant")
    assert str(info.value).startswith("target vllm-moequant serves each routed expert in one format")
    with pytest.raises(UserError) as info:
        export_checkpoint(qwen2, q, tmp_path / "gptq", target="vllm-moequant", layout="gptq")
    assert str(info.value) == (
        "target vllm-moequant (moequant's vLLM plugin) reads the compressed-tensors layout, "
        "not gptq; set export.format compressed-tensors."
    )
    assert not (tmp_path / "split").exists() and not (tmp_path / "gptq").exists()
