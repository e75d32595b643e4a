"""GGUF export of the MoE families beyond tests/test_gguf_archs.py's (GLM-4.5 ... 4.7, MiniMax-M2, ERNIE-4.5,
Hunyuan, dots.llm1, Phi-3.5-MoE, ...): each family's tiny random model (tests/families.py's `build_family`,
weights made decisive below) is exported as F32 and quantized GGUF and run by llama.cpp itself against
transformers' forward of the same weights. Tensor names come from gguf-py's TensorNameMap; each family's
metadata from moequant.layouts.gguf. The families' widths are 128: the quantized file uses ggml's 32-blocks."""

from __future__ import annotations

import itertools
import re

import families
import gguf
import numpy as np
import pytest
import torch
from families import build_family
from support import verify_llamacpp as V
from test_gguf_archs import _entropy, _kl, _logits, _texts
from tiny import GGUF_CONFIGS

from moequant import formats
from moequant.arch import adapter_for
from moequant.export.write import export_checkpoint
from moequant.io.checkpoint import open_checkpoint
from moequant.layouts.gguf_graphs import ARCHS, GRAPHS, REFUSED, gguf_targets
from moequant.layouts.gguf_transforms import ROW_ORDER

# Granite divides by logits_scaling
HEAD_SCALE: dict[str, float] = {"granitemoe": 32 * 6, "granitemoeshared": 32 * 6, "granitemoehybrid": 32 * 6}
# Qwen3-Next's quantized check quantizes the last MoE layer only: with every layer's experts quantized llama.cpp vs our
# dequantization is 3e-3 of KL (measured; its F32 file matches to 3e-7, the last layer alone to 8e-5), with routers
# at 8x or 32x alike; the likely cause, not isolated: llama.cpp's 8-bit activations in each quantized matmul, through
# the recurrent layers
# Gemma-4 likewise (every layer's experts quantized: 2.2e-2 llama.cpp vs ours, measured; the last layer alone 8.9e-5):
# its F32 file is 5.6e-5 from transformers through llama.cpp's F16 key / value cache (Gemma's attention is unscaled,
# over normed keys) and ggml's GELU through an fp16 table, and 4.6e-7 with an F32 cache and transformers' GELU rounded
# through fp16 alike (measured), so the graph computes transformers' forward; top-2 routing then amplifies those roundings
LAST_LAYER_ONLY = ("qwen3_next", "gemma4")
# routers whose random scores keep near ties at 8x, which llama.cpp's 8-bit activations in the quantized layers
# before them flip (measured with every MoE layer quantized, llama.cpp vs ours: Qwen3-VL-MoE 1.3e-3 at 8x, 7.4e-5 at
# 32x; Kimi-K2.5's sigmoid router 1.7e-3 at 8x, 8.1e-4 at 32x; MiMo-V2-Flash's sigmoid router 2.9e-3 at 8x, 5.5e-5 at
# 32x, 1.9e-5 at 8x with its last MoE layer alone quantized, its F32 file 4e-7 at all three; tests/families.py's GGUF_OVERRIDES give GLM-4.7-Flash one MoE layer for it)
ROUTER_SCALE = {"qwen3_vl_moe": 32, "kimi_k25": 32, "mimo_v2_flash": 32}
# tensors scaled up, per family: llama.cpp's KDA l2-normalises q and k with rms_norm_eps (1e-5) as its epsilon where
# transformers (FLA) uses 1e-6, which moves the tiny random model's logits (its q / k sums of squares are ~6e-4: KL 3.5e-4,
# 5.8e-8 with transformers' epsilon at 1e-5, measured) and not a real checkpoint's; its q / k convolutions at 32x
# Granite-4.0-H's attention queries and keys at 32x, so that its attention is far from uniform and rope, which its
# graph must leave off (rope.scaling.finetuned false), moves the logits: F32 file 7.0e-3 from transformers with rope on
# (measured; 2.3e-5 at 8x, 5.8e-9 unscaled), 2e-9 with it off
SCALED = {
    "kimi_linear": (r"self_attn\.[qk]_conv1d\.weight", 32),
    "granitemoehybrid": (r"self_attn\.[qk]_proj\.weight", 32),
}
TYPES = ("q4_0", "q5_1", "q4_1", "q5_0", "q8_0")  # 32-blocks: rows of 128 hold them
# config values the families' defaults leave at a no-op, set here so that llama.cpp must read them: Granite-3.1-MoE's
# multipliers (the defaults are all 1.0) and GraniteMoeShared's shared expert (the default width is 0: none)
GRANITE = {
    "attention_multiplier": 0.0078125,
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
    "logits_scaling": 6.0,
}
# Gemma-4 as its checkpoints differ from the tiny defaults: full layers of their own head width and key / value heads
# (keys as values: attention_k_eq_v), the last two layers reusing layer 0's (sliding) and layer 1's (full) keys and
# values with a twice-as-wide MLP, a window shorter than the test's texts and the final logits' softcap
GEMMA4 = {
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "per_layer_config": {L: {"head_dim": 64, "num_key_value_heads": 1} for L in (1, 3)},
    "attention_k_eq_v": True,
    "num_kv_shared_layers": 2,
    "use_double_wide_mlp": True,
    "sliding_window": 16,
    "final_logit_softcapping": 30.0,
}
# MiMo-V2-Flash's values narrower than its keys (192 / 128 in the checkpoint; the tiny defaults are equal) and a
# sliding window shorter than the texts (64 tokens), so that the window and the sinks count;
CHECKED = {
    "granitemoe": GRANITE,
    "granitemoeshared": {**GRANITE, "shared_intermediate_size": 128},
    # Granite-4.0-H: two Mamba groups, so that the gated norm's grouping counts (its checkpoints have one)
    "granitemoehybrid": {**GRANITE, "shared_intermediate_size": 128, "mamba_n_groups": 2},
    "gemma4": GEMMA4,
    "mimo_v2_flash": {"v_head_dim": 16, "sliding_window": 12},
    # Unlimited-OCR's routed weights scaled, and its reference sliding window shorter than the texts: a prompt attends
    # over all of itself in transformers (the window holds for decoded tokens only), as llama.cpp's graph does (a scale
    # of 2.5 moves llama.cpp vs ours to 8.4e-4 of KL, its 8-bit activations in the quantized experts amplified; 1.5:
    # 7e-5)
    "unlimited_ocr": {"routed_scaling_factor": 1.5, "sliding_window": 12},
}


# the families GGUF writes beyond tests/test_gguf_archs.py's and tests/test_gguf.py's (qwen2_moe, mixtral)
FAMILIES = sorted(set(ARCHS) - set(GGUF_CONFIGS) - {"qwen2_moe", "mixtral"})


@pytest.fixture(scope="module")
def llama():
    return V.ensure_llama_cpp()


def decisive_family(model_type: str, directory, monkeypatch, seed: int = 0):
    """build_family's model with the lm_head (tied: the final norm) at 32x and the routers at 8x (ROUTER_SCALE), uneven norms and biases: logits far from
    uniform and routing far from ties, so a KL between two forwards means something (tests/tiny.py's rule)."""
    from safetensors.torch import load_file, save_file

    monkeypatch.setitem(
        families.OVERRIDES,
        model_type,
        {
            **families.OVERRIDES.get(model_type, {}),
            **families.GGUF_OVERRIDES.get(model_type, ("", {}))[1],
            **CHECKED.get(model_type, {}),
        },
    )
    source = build_family(model_type, directory, seed)
    ad = adapter_for(open_checkpoint(source).config)
    g = torch.Generator().manual_seed(seed)
    files = sorted(source.glob("*.safetensors"))
    tied = not any("lm_head.weight" in load_file(str(f)) for f in files)
    for f in files:
        tensors = load_file(str(f))
        for name, t in tensors.items():
            role = ad.classify(name).role
            x = t.float()
            if model_type in SCALED and re.search(SCALED[model_type][0], name):
                x = x * SCALED[model_type][1]
            elif name == "lm_head.weight":
                x = x * HEAD_SCALE.get(model_type, 32)
            elif role == "router" and t.dim() == 2:
                if not x.any():  # AFMoE's init leaves its router at zero: every token would take the same experts
                    x = torch.randn(t.shape, generator=g) * 0.02
                x = x * ROUTER_SCALE.get(model_type, 8)
            elif name.endswith(("router.scale", "per_expert_scale", "layer_scalar")):  # Gemma-4's, ones at init
                x = x * (0.5 + torch.rand(t.shape, generator=g))
            elif t.dim() == 1 and name.endswith("bias"):
                x = torch.randn(t.shape, generator=g) * 0.1
            elif t.dim() == 1 and "norm" in name:
                x = x + torch.rand(t.shape, generator=g) - 0.5  # uneven around the family's own init (0 or 1)
                if tied and not re.search(r"\.\d+\.", name):  # the final norm scales the logits in the head's place
                    x = x * HEAD_SCALE.get(model_type, 32)
            tensors[name] = x.to(t.dtype)
        save_file(tensors, str(f), metadata={"format": "pt"})
    return source


def _quantized(source, model_type, reordered=False):
    """Routed experts in one 32-block type per (layer, projection), shared experts in q4_0 (and, `reordered`, tensors written in another row order in q8_0), with the dequantized
    weights transformers should run: ({key: QuantizedTensor}, {(layer, proj): [E, out, in]}, {name: [out, in]})."""
    ckpt = open_checkpoint(source)
    ad = adapter_for(ckpt.config)
    types = itertools.cycle(TYPES)
    quantized, experts, others = {}, {}, {}
    layers = ad.moe_layers[-1:] if model_type in LAST_LAYER_ONLY else ad.moe_layers
    for L in layers:
        for p in ad.projections:
            W = ad.read_experts(ckpt, L, p).float()
            q = formats.quantize_ggml(W, next(types))
            for e in range(W.shape[0]):
                quantized[(L, e, p)] = q.expert(e)
            experts[(L, p)] = q.dequantize()
    for name in ckpt.keys():
        targets = gguf_targets(model_type, name)
        role = ad.classify(name)
        if len(ckpt.shape(name)) != 2 or len(targets) != 1 or role.role == "routed_expert":
            continue
        if role.role == "shared_expert" and role.layer in layers and targets[0][1] is None:
            key = "q4_0"
        elif reordered and targets[0][1] in ROW_ORDER:  # llama's q / k, Qwen3.5's value heads tiled: packed rows moved
            key = "q8_0"
        else:
            continue
        q = formats.quantize_ggml(ckpt.get(name).float(), key)
        quantized[name] = q
        others[name] = q.dequantize()
    return quantized, experts, others


def _reference(source, experts: dict, others: dict, tmp):
    """transformers (float32) running `source` with these weights in place of its own, through the auto class its
    config names (a multimodal wrapper's image-text class, else the causal LM; experts kept fused on disk by the
    family's own checkpoints load per expert once registered)."""
    import json
    import shutil

    from safetensors.torch import save_file

    import moequant
    from moequant.arch.generic import model_class

    ckpt = open_checkpoint(source)
    ad = adapter_for(ckpt.config)
    tensors = {n: ckpt.get(n).float() for n in ckpt.keys()}
    tensors.update(others)
    for (L, p), stack in experts.items():
        for e in range(ad.num_experts):
            tensors[ad.expert_tensor_name(L, e, p)] = stack[e]
    tmp.mkdir(parents=True)
    shutil.copy(source / "config.json", tmp / "config.json")
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp / "model.safetensors"))
    moequant.register_for_transformers(tmp)
    config = json.loads((tmp / "config.json").read_text())
    return model_class(config).from_pretrained(str(tmp), dtype=torch.float32).eval()


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILIES)
def test_llama_cpp_runs_the_family(model_type, llama, tmp_path, monkeypatch):
    """The F32 GGUF gives transformers' logits in llama.cpp (KL <= 1e-4); the quantized one holds the planned types
    and llama.cpp runs it as transformers runs moequant's dequantization of the same codes (KL <= 1e-3, while the
    quantization itself is over 10x that)."""
    from tokenizers import Tokenizer

    source = decisive_family(model_type, tmp_path / "src", monkeypatch)
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    ids = [tok.encode(t).ids[:64] for t in _texts()[:3]]
    f32 = export_checkpoint(source, {}, tmp_path / "f32", layout="gguf", target="llama.cpp", gguf_float="f32")
    quantized, experts, others = _quantized(source, model_type)
    qdir = export_checkpoint(source, quantized, tmp_path / "q", layout="gguf", target="llama.cpp", gguf_float="f32")
    got = {t.name: t.tensor_type.name.lower() for t in gguf.GGUFReader(qdir / "model.gguf").tensors}
    for L, p in experts:
        assert got[f"blk.{L}.ffn_{p}_exps.weight"] == quantized[(L, 0, p)].spec.name
    assert all(got[t] == quantized[n].spec.name for n in others for t, _ in gguf_targets(model_type, n))

    base = _logits(_reference(source, {}, {}, tmp_path / "r0"), ids)
    ours = _logits(_reference(source, experts, others, tmp_path / "r1"), ids)
    ll_f32, ll_q = V.logits([f32 / "model.gguf", qdir / "model.gguf"], ids)
    kl_f32, kl_same, kl_quant = _kl(base, ll_f32), _kl(ours, ll_q), _kl(base, ours)
    entropy = float(np.mean([_entropy(b) for b in base]))
    print(
        f"{model_type}: KL f32 {kl_f32:.2e}, llama.cpp vs ours {kl_same:.2e}, quantization {kl_quant:.2e}, "
        f"entropy {entropy:.2f} of {np.log(base[0].shape[-1]):.2f}"
    )
    assert entropy < 0.8 * np.log(base[0].shape[-1])
    assert kl_f32 <= 1e-4
    assert kl_same <= 1e-3
    assert kl_quant > 10 * kl_same


_ARCH_IDS = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
CONVOLVED = (
    sorted(  # families whose llama.cpp graph convolves (Mamba's, the gated delta net's, KDA's, LFM2's short conv)
        mt
        for mt in set(ARCHS) & set(families.taken_families())
        if {"SSM_CONV1D", "SSM_CONV1D_Q", "SHORTCONV_CONV"} & {t.name for t in gguf.MODEL_TENSORS[_ARCH_IDS[ARCHS[mt]]]}
    )
)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", CONVOLVED)
def test_a_bf16_file_holds_in_f32_what_llama_cpp_reads_in_f32(model_type, llama, tmp_path, monkeypatch):
    """GGUF's plain tensors default to bf16, but ggml's convolutions take F32 kernels only (a bf16 ssm_conv1d aborts
    llama.cpp in ssm_conv): the file holds the convolution kernels and every norm in F32, as llama.cpp's converter
    writes them, and llama.cpp runs it with transformers' logits (bf16's rounding of the rest apart)."""
    from tokenizers import Tokenizer

    source = decisive_family(model_type, tmp_path / "src", monkeypatch)
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    ids = [tok.encode(t).ids[:64] for t in _texts()[:3]]
    out = export_checkpoint(source, {}, tmp_path / "bf16", layout="gguf", target="llama.cpp")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out / "model.gguf").tensors}
    kernels = [n for n in types if re.search(r"(ssm_conv1d(_[qkv])?|shortconv\.conv)\.weight$", n)]
    assert kernels and all(types[n] == "F32" for n in kernels), types
    assert all(types[n] == "F32" for n in types if n.endswith("_norm.weight")), types
    assert "BF16" in types.values()
    base = _logits(_reference(source, {}, {}, tmp_path / "r0"), ids)
    (got,) = V.logits([out / "model.gguf"], ids)
    kl = _kl(base, got)
    print(f"{model_type}: bf16 file in llama.cpp vs transformers (F32) {kl:.2e}")
    assert kl <= 1e-3


@pytest.mark.slow
def test_the_gguf_recipe_on_a_multimodal_flagship_runs_in_llama_cpp(llama, tmp_path):
    """`moequant apply --recipe recipes/gguf.yaml` on Qwen3.5-MoE's tiny model (a multimodal checkpoint whose text
    model is a hybrid of gated delta nets and attention), its plain tensors in the default bf16: the plan's bytes
    are the GGUF's tensor bytes exactly (the vision tower, llama.cpp's mmproj file, counted nowhere) and llama.cpp
    runs the file with the report's KL against the original small (this file once aborted llama.cpp: bf16
    convolution kernels)."""
    import json

    from click.testing import CliRunner

    from moequant.cli import main

    source = build_family("qwen3_5_moe", tmp_path / "src")
    out = tmp_path / "run"
    settings = ["calibration.samples=4", "calibration.seq_len=32", "calibration.probe_samples=2"]
    settings += ["evaluate.samples=2", "evaluate.seq_len=32"]
    settings += ["export.gguf_output=q8_0", "export.gguf_token_embd=q8_0"]  # 128-wide rows: no Q5_K
    args = ["apply", "--recipe", "recipes/gguf.yaml", "--model", str(source), "--output", str(out)]
    result = CliRunner().invoke(main, args + [x for s in settings for x in ("--set", s)], catch_exceptions=False)
    assert result.exit_code == 0, result.output[-3000:]
    plan = json.loads((out / "plan.json").read_text())
    tensors = gguf.GGUFReader(out / "checkpoint" / "model.gguf").tensors
    assert plan["summary"]["total_bytes"] == sum(int(t.n_bytes) for t in tensors)
    assert {t.tensor_type.name for t in tensors if t.name.endswith("ssm_conv1d.weight")} == {"F32"}
    quality = json.loads((out / "report.json").read_text())["quality"]
    assert quality["engine"] == "llama.cpp" and 0 < quality["kl_mean"] < 0.01, quality


REORDERED = sorted(mt for mt in FAMILIES if any(fn in ROW_ORDER for _, fn in GRAPHS[mt].transforms))


@pytest.mark.parametrize("model_type", REORDERED)
def test_packed_rows_written_in_another_order_hold_the_same_codes(model_type, tmp_path, monkeypatch):
    """A tensor llama.cpp's graph takes in another row order (llama-style q / k, Qwen3.5's value heads tiled by key
    head) is written from its packed q8_0 rows moved, not requantized: gguf-py's dequantization of the file equals
    the graph's transform of moequant's dequantization, bit for bit. (Through llama.cpp, Qwen3.5's linear attention
    in q8_0 moves the logits by 1.2e-2 of KL on its own, measured, its 8-bit activations in the recurrent layers: the
    check above keeps those tensors in F32.)"""
    from moequant.layouts.gguf_graphs import graph_config

    source = decisive_family(model_type, tmp_path / "src", monkeypatch)
    quantized, _, others = _quantized(source, model_type, reordered=True)
    qdir = export_checkpoint(source, quantized, tmp_path / "q", layout="gguf", target="llama.cpp", gguf_float="f32")
    stored = {t.name: t for t in gguf.GGUFReader(qdir / "model.gguf").tensors}
    ckpt = open_checkpoint(source)
    config = graph_config(adapter_for(ckpt.config), ckpt.config)
    moved = [n for n in others if gguf_targets(model_type, n)[0][1] in ROW_ORDER]
    assert moved
    for name in moved:
        ((target, fn),) = gguf_targets(model_type, name)
        t = stored[target]
        assert t.tensor_type.name == "Q8_0"
        got = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        want = fn(others[name], config)
        assert torch.equal(got.reshape(want.shape), want), name
        assert not torch.equal(want, others[name]), name  # the order did move


# every family moequant takes that GGUF export does not write: the precheck refuses it before any work
NOT_WRITTEN = sorted(
    f for f in families.FAMILIES if f not in families.NOT_SUPPORTED and f not in families.UNBUILT and f not in ARCHS
)
# a config llama.cpp's graph of the family cannot follow (the families' defaults here), with the refusal's words
CONFIG_REFUSED = {
    "dots1": "as many key / value heads as query heads",
    "lfm2_moe": "tie_word_embeddings: false",
    "glm4_moe_lite": "dense layers only before the first MoE layer",
    "exaone_moe": "dense layers only before the first MoE layer",
    "nemotron_h": "has dense MLP layers",
    "glm_moe_dsa": "dense layers only before the first MoE layer",
    "gemma4": "vocab_size_per_layer_input",
    "unlimited_ocr": "2 key / value heads for 4 query heads",
    "afmoe": "layer_types differ",
    "kimi_linear": "linear_num_heads 32 and 4 attention heads",
}


@pytest.mark.parametrize("model_type", NOT_WRITTEN + sorted(CONFIG_REFUSED))
def test_what_gguf_does_not_write_is_refused_by_the_precheck_in_one_sentence(model_type):
    from moequant.formats import get_format
    from moequant.layouts import layout_refusal

    config = families.tiny_family_config(model_type).to_dict()
    config["model_type"] = model_type
    why = layout_refusal("gguf", get_format("q4_k"), "llama.cpp", adapter_for(config))
    assert why and "\n" not in why and ". " not in why, why
    assert model_type in why or CONFIG_REFUSED.get(model_type, "?") in why, why
    assert (model_type in REFUSED) == ("GGUF export does not write" in why), why


@pytest.mark.parametrize("head", [32, 96, 64, 128])
def test_glm5_indexer_heads_llama_cpp_cannot_rotate_are_refused(head):
    """llama.cpp's glm-dsa graph multiplies each indexer head by an orthonormal Hadamard matrix as wide as the largest
    power of two (64 at least) dividing it: GLM-5's config with indexer heads of 32 or 96 is refused in one sentence,
    64 and GLM-5's 128 are written."""
    from moequant.formats import get_format
    from moequant.layouts import layout_refusal

    config = families.tiny_family_config("glm_moe_dsa").to_dict()
    config.update(families.GGUF_OVERRIDES["glm_moe_dsa"][1], index_head_dim=head, model_type="glm_moe_dsa")
    why = layout_refusal("gguf", get_format("q4_k"), "llama.cpp", adapter_for(config))
    if head in (64, 128):
        assert why is None, why
    else:
        assert why and "\n" not in why and ". " not in why and f"index_head_dim is {head}" in why, why


def test_glm5_indexer_layers_are_written_as_transformers_resolves_them(tmp_path, monkeypatch):
    """A GLM-5.x config.json may name the layers that reuse the last full layer's top-k by index_topk_pattern (or
    index_topk_freq / index_skip_topk_offset) instead of indexer_types: the GGUF's attention.indexer.types is
    transformers' resolution of them (what llama.cpp's converter writes: it reads the config through transformers)."""
    import json

    from transformers import AutoConfig

    monkeypatch.setitem(families.OVERRIDES, "glm_moe_dsa", families.GGUF_OVERRIDES["glm_moe_dsa"][1])
    source = build_family("glm_moe_dsa", tmp_path / "src")
    config = json.loads((source / "config.json").read_text())
    del config["indexer_types"]
    config["index_topk_pattern"] = "FFSF"
    (source / "config.json").write_text(json.dumps(config))
    out = export_checkpoint(source, {}, tmp_path / "f32", layout="gguf", target="llama.cpp", gguf_float="f32")
    field = gguf.GGUFReader(out / "model.gguf").fields["glm-dsa.attention.indexer.types"]
    want = [t == "full" for t in AutoConfig.from_pretrained(source).indexer_types]
    assert [bool(x) for x in field.contents()] == want == [True, True, False, True]


@pytest.mark.slow
def test_glm5_indexer_top_k_in_llama_cpp_with_an_f32_cache_is_transformers(llama, tmp_path, monkeypatch):
    """llama.cpp keeps the indexer's keys in the KV cache's type: with an F32 cache GLM-5's F32 file gives
    transformers' logits at every position (KL <= 1e-6: every top-k choice the same, shared layers included), where
    the default F16 cache's rounding flips a near-tied choice (test_llama_cpp_runs_the_family: 3.6e-5, measured). The
    selection acts: transformers without it (index_topk over the texts' length) is far off."""
    import json

    from tokenizers import Tokenizer

    source = decisive_family("glm_moe_dsa", tmp_path / "src", monkeypatch)
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    ids = [tok.encode(t).ids[:64] for t in _texts()[:3]]
    assert json.loads((source / "config.json").read_text())["index_topk"] < max(len(i) for i in ids)
    f32 = export_checkpoint(source, {}, tmp_path / "f32", layout="gguf", target="llama.cpp", gguf_float="f32")
    base = _logits(_reference(source, {}, {}, tmp_path / "r0"), ids)
    (got,) = V.logits([f32 / "model.gguf"], ids, cache="f32")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "index_topk": 4096}))
    unselected = _logits(_reference(source, {}, {}, tmp_path / "r1"), ids)
    kl, kl_unselected = _kl(base, got), _kl(base, unselected)
    print(f"glm_moe_dsa: F32 cache KL {kl:.2e}; transformers without the top-k selection {kl_unselected:.2e}")
    assert kl <= 1e-6
    assert kl_unselected > 1e-2


_PROPORTIONAL = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}
# Gemma-4 configs llama.cpp's gemma4 graph cannot follow (beyond CONFIG_REFUSED's), with the refusal's words
GEMMA4_REFUSED = [
    (  # transformers takes it (both kinds keep a layer of their own), llama.cpp reuses layers 0 and 1 the other way
        {
            "num_kv_shared_layers": 2,
            "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
            "per_layer_config": {},
        },
        "a sliding one, then a full one",
    ),
    (
        {
            "rope_parameters": {
                "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                "full_attention": _PROPORTIONAL,
            }
        },
        "rope_parameters have linear",
    ),
    (
        {
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                "full_attention": {**_PROPORTIONAL, "factor": 8.0},
            }
        },
        "sets a factor",
    ),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention: all"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_activation": "gelu"}, "hidden_activation is gelu"),
]


@pytest.mark.parametrize("change, words", GEMMA4_REFUSED, ids=[w for _, w in GEMMA4_REFUSED])
def test_gemma4_configs_its_llama_cpp_graph_cannot_follow_are_refused_in_one_sentence(change, words, monkeypatch):
    from moequant.formats import get_format
    from moequant.layouts import layout_refusal

    monkeypatch.setitem(families.OVERRIDES, "gemma4", {**families.OVERRIDES["gemma4"], **GEMMA4, **change})
    monkeypatch.setitem(families.OVERRIDES["gemma4"], "vocab_size_per_layer_input", families.VOCAB)
    config = families.tiny_family_config("gemma4").to_dict()
    config["model_type"] = "gemma4"
    why = layout_refusal("gguf", get_format("q4_k"), "llama.cpp", adapter_for(config))
    assert why and "\n" not in why and ". " not in why and words in why, why


_MIMO_ROPE = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.334}
# configs of a family GGUF writes that its llama.cpp graph cannot follow: (family, config.json values, refusal's words)
GRAPH_CANNOT_FOLLOW = [
    ("mimo_v2_flash", {"routed_scaling_factor": 2.5}, "routed_scaling_factor"),
    ("mimo_v2_flash", {"norm_topk_prob": False}, "norm_topk_prob"),
    ("mimo_v2_flash", {"attention_bias": True}, "attention_bias"),
    (
        "mimo_v2_flash",
        {
            "rope_parameters": {
                "full_attention": _MIMO_ROPE,
                "sliding_attention": {**_MIMO_ROPE, "rope_type": "linear", "factor": 2.0},
            }
        },
        "unscaled rope",
    ),
    (
        "mimo_v2_flash",
        {
            "rope_parameters": {
                "full_attention": _MIMO_ROPE,
                "sliding_attention": {**_MIMO_ROPE, "partial_rotary_factor": 0.5},
            }
        },
        "partial_rotary_factor",
    ),
]


_OCR = "unlimited_ocr"
GRAPH_CANNOT_FOLLOW += [
    (_OCR, {"num_key_value_heads": 2}, "2 key / value heads for 4 query heads"),
    (_OCR, {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, "base 10000"),
    (_OCR, {"attention_bias": True}, "attention_bias"),
    (_OCR, {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1}, "group_limited_greedy"),
    (_OCR, {"mlp_layer_types": ["dense", "sparse", "dense", "sparse"]}, "dense layers only before the first MoE"),
]


_GRANITE_H = "granitemoehybrid"
GRAPH_CANNOT_FOLLOW += [
    (_GRANITE_H, {"position_embedding_type": "rope"}, "position_embedding_type"),
    (_GRANITE_H, {"layer_types": ["full_attention"] * 4}, "without Mamba layers"),
    (_GRANITE_H, {"mamba_proj_bias": True}, "mamba_proj_bias"),
]


@pytest.mark.parametrize("model_type, values, words", GRAPH_CANNOT_FOLLOW)
def test_a_config_the_graph_cannot_follow_is_refused_in_one_sentence(model_type, values, words, monkeypatch):
    from moequant.formats import get_format
    from moequant.layouts import layout_refusal

    shipped = {**families.OVERRIDES.get(model_type, {}), **families.GGUF_OVERRIDES.get(model_type, ("", {}))[1]}
    monkeypatch.setitem(families.OVERRIDES, model_type, shipped)
    config = {**families.tiny_family_config(model_type).to_dict(), "model_type": model_type}
    assert layout_refusal("gguf", get_format("q4_k"), "llama.cpp", adapter_for(config)) is None  # as the family ships
    if "text_config" in config:  # a multimodal checkpoint: its text model's config
        changed = {**config, "text_config": {**config["text_config"], **values}}
    else:
        changed = {**config, **values}
    why = layout_refusal("gguf", get_format("q4_k"), "llama.cpp", adapter_for(changed))
    assert why and "\n" not in why and ". " not in why and words in why, why


def test_mimo_v2_flashs_hub_config_is_written_as_transformers_reads_it():
    """MiMo-V2-Flash's config.json on the hub spells its attention as hybrid_layer_pattern, swa_rope_theta and
    sliding_window_size, which transformers reads as its own layer_types, per-layer-type rope and a window one wider
    (sliding_window_size + 1): the graph is written from what transformers runs, not from config.json's spelling."""
    from moequant.layouts.gguf_graphs import graph_config, model_refusal

    pattern = [0 if L == 0 or (L + 1) % 6 == 0 else 1 for L in range(12)]
    hub = {
        **{k: v for k, v in families.tiny_family_config("mimo_v2_flash").to_dict().items() if k != "layer_types"},
        **{"model_type": "mimo_v2_flash", "num_hidden_layers": 12, "mlp_layer_types": None, "rope_parameters": None},
        **{"hybrid_layer_pattern": pattern, "sliding_window": 128, "sliding_window_size": 128},
        **{"rope_theta": 5e6, "swa_rope_theta": 1e4, "partial_rotary_factor": 0.334, "swa_num_key_value_heads": 4},
    }
    ad = adapter_for(hub)
    c = graph_config(ad, hub)
    assert c["sliding_window"] == 129
    assert [int(t == "sliding_attention") for t in c["layer_types"]] == pattern
    assert c["rope_parameters"]["sliding_attention"]["rope_theta"] == 1e4 and model_refusal(ad, hub) is None


# a config the family's GGUF_OVERRIDES layout changed in one more way that its llama.cpp graph cannot follow
VARIANT_REFUSED = [
    ("afmoe", {"mup_enabled": False}, "mup_enabled: false"),
    ("kimi_linear", {"moe_renormalize": False}, "moe_renormalize: false"),
    ("kimi_linear", {"num_expert_group": 2, "topk_group": 1}, "routes without expert groups"),
    ("kimi_linear", {"mlp_layer_types": ["dense", "sparse", "dense", "sparse"]}, "dense layers only before"),
]


@pytest.mark.parametrize(("model_type", "change", "words"), VARIANT_REFUSED)
def test_a_shipped_layout_changed_where_llama_cpp_cannot_follow_is_refused(model_type, change, words, monkeypatch):
    from moequant.formats import get_format
    from moequant.layouts import layout_refusal

    monkeypatch.setitem(families.OVERRIDES, model_type, families.GGUF_OVERRIDES[model_type][1])
    config = families.tiny_family_config(model_type).to_dict()
    config["model_type"] = model_type
    assert layout_refusal("gguf", get_format("q4_k"), "llama.cpp", adapter_for(config)) is None
    config.update(change)
    why = layout_refusal("gguf", get_format("q4_k"), "llama.cpp", adapter_for(config))
    assert why and "\n" not in why and ". " not in why and words in why, why


@pytest.mark.slow
def test_llama_cpp_runs_a_checkpoint_with_a_multi_token_prediction_layer(llama, tmp_path):
    """A DeepSeek-V3 checkpoint as it ships, with its MTP layer (num_nextn_predict_layers: 1; FP8 blocks): the GGUF
    leaves that layer out, as llama.cpp's converter does for deepseek2, and llama.cpp runs the file as transformers
    runs the checkpoint (transformers ignores the layer too); it was refused after the quantization work before."""
    import json

    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    from benchmarks.make_sources import make_deepseek_fp8
    from moequant.io.checkpoint import copy_aux_files

    source = make_deepseek_fp8(tmp_path / "src")
    out = export_checkpoint(source, {}, tmp_path / "f32", layout="gguf", target="llama.cpp", gguf_float="f32")
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    ids = [tok.encode(t).ids[:64] for t in _texts()[:3]]
    (got,) = V.logits([out / "model.gguf"], ids)
    plain = tmp_path / "plain"  # the FP8 blocks dequantized (transformers' FP8 loader needs accelerate)
    ckpt = open_checkpoint(source)
    plain.mkdir()
    save_file({n: ckpt.get(n).float() for n in ckpt.keys()}, str(plain / "model.safetensors"), {"format": "pt"})
    (plain / "config.json").write_text(json.dumps({k: v for k, v in ckpt.config.items() if k != "quantization_config"}))
    copy_aux_files(source, plain)
    kl = _kl(_logits(_reference(plain, {}, {}, tmp_path / "ref"), ids), got)
    print(f"deepseek_v3 with its MTP layer: F32 file KL {kl:.2e}")
    assert kl <= 1e-4


# families whose GGUF graph adds tensors the checkpoint does not hold (Graph.extra: Gemma-4's rope_freqs)
ADDING = sorted(mt for mt in FAMILIES if GRAPHS[mt].extra is not None)


def _planned_and_written(model_type, tmp_path, monkeypatch, settings=()):
    """The plan of recipes/gguf.yaml on the family's tiny model (routed experts q8_0 by round to nearest, the rest
    bf16), its checkpoint, and {name: (ggml type, bytes)} of the GGUF file exported from it, read by gguf-py."""
    from moequant.pipeline.apply import calibration_settings, export_arguments, resolve_recipe
    from moequant.pipeline.quantize import quantize_model
    from moequant.plan.policy import make_plan

    source = decisive_family(model_type, tmp_path / "src", monkeypatch)
    tiny = ["calibration.samples=4", "calibration.seq_len=32", "calibration.probe_samples=0"]
    tiny += [f"algorithms.{name}=rtn" for name in formats.format_names() if name != "bf16"]
    tiny += ["non_experts.formats=[]", "experts.method=uniform", "experts.format=q8_0", "non_experts.format=bf16"]
    tiny += ["export.gguf_token_embd=null", "export.gguf_output=null"]
    recipe = resolve_recipe("recipes/gguf.yaml", str(source), str(tmp_path / "run"), [*tiny, *settings])
    ckpt = open_checkpoint(recipe.model)
    plan = make_plan(recipe, ckpt)
    quantized, _ = quantize_model(
        recipe.model, plan, calibration_settings(recipe), tmp_path / "work", progress=False, lazy=True
    )
    export_checkpoint(ckpt.directory, quantized, tmp_path / "checkpoint", **export_arguments(recipe))
    tensors = gguf.GGUFReader(tmp_path / "checkpoint" / "model.gguf").tensors
    return plan, ckpt, {t.name: (t.tensor_type.name, int(t.n_bytes)) for t in tensors}


@pytest.mark.parametrize("model_type", ADDING)
def test_the_plans_bytes_are_the_gguf_files_tensor_bytes_with_the_tensors_the_graph_adds(
    model_type, tmp_path, monkeypatch
):
    """A GGUF plan counts the tensors llama.cpp's graph reads beyond the checkpoint (Gemma-4's rope_freqs, which the
    export makes from the config): the plan's bytes, row by row and in total, are the bytes gguf-py reads from the
    written file (the plan left rope_freqs out before: its bytes were short of the file's)."""
    plan, ckpt, written = _planned_and_written(model_type, tmp_path, monkeypatch)
    added = {t.name for t in plan.tensors if t.name not in ckpt.keys() and t.role != "lm_head"}
    assert added and added <= set(written)
    assert all(t.bytes == written[t.name][1] for t in plan.tensors if t.name in added)
    assert plan.summary["total_bytes"] == sum(b for _, b in written.values())


def test_gemma4_per_layer_token_embeddings_take_the_token_embeddings_type(tmp_path, monkeypatch):
    """llama.cpp's quantizer puts per_layer_token_embd.weight in token_embd's category (its --token-embedding-type
    and its mixes' token-embedding rule set both), so export.gguf_token_embd types both tensors, the plan counting
    the per-layer table in that type too."""
    plan, ckpt, written = _planned_and_written("gemma4", tmp_path, monkeypatch, ["export.gguf_token_embd=q8_0"])
    assert written["token_embd.weight"][0] == written["per_layer_token_embd.weight"][0] == "Q8_0"
    assert written["output.weight"][0] == "BF16"  # the tiny model's head is its own: export.gguf_output null
    assert plan.summary["total_bytes"] == sum(b for _, b in written.values())
