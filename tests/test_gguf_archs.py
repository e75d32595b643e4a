"""GGUF export of the MoEs llama.cpp users run — Qwen3-MoE, OLMoE, DeepSeek-V3 / V2 (llama.cpp's
deepseek2: MLA, dense leading layers, shared experts, grouped sigmoid routing), gpt-oss (MXFP4
experts, biases, sinks, sliding window) — checked by llama.cpp itself against transformers' forward.

Models: scaled-down random models of each real config (tests/tiny.py GGUF_CONFIGS: widths of 256,
the bundled tiny-qwen2moe tokenizer), weights at 4x transformers' init so that the logits are far from
uniform. llama.cpp is llama-cpp-python built once into ~/.cache/moequant (this file fails loudly when
it cannot be built; it never skips)."""

from __future__ import annotations

import itertools

import gguf
import numpy as np
import pytest
import torch
from support import verify_llamacpp as V
from tiny import GGUF_CONFIGS, build_gguf_tiny

from moequant import formats
from moequant.arch import adapter_for
from moequant.errors import UserError
from moequant.export.gguf import gguf_targets
from moequant.export.write import export_checkpoint
from moequant.io.checkpoint import open_checkpoint

ARCHS = tuple(GGUF_CONFIGS)
BLOCK_TYPES = ["q4_k", "iq3_s", "q6_k", "iq2_xs", "q3_k", "iq4_xs", "q5_k", "iq2_xxs", "q2_k", "iq3_xxs", "iq2_s"]
# quantized beside the routed experts. Not attention: llama.cpp's 8-bit activations in quantized attention
# matmuls move these random models' logits by several 1e-3 of KL on their own (qwen3_moe, measured: 3.5e-3 with
# attention in q4, 2e-4 without). Not DeepSeek's dense layer either, and its tiny configs have one MoE layer: a
# random grouped sigmoid router has near ties that any rounding before it flips (measured with two MoE layers:
# per-token KL median 7e-4, max 1.3, mean 7.5e-3 from a few flipped tokens)
OTHER_ROLES = ("shared_expert",)


@pytest.fixture(scope="module")
def llama():
    return V.ensure_llama_cpp()


def _texts():
    """Text of the kind the bundled tokenizer was trained on (builtin:mix: stdlib code and docstrings)."""
    from moequant.measure.data import _stdlib_code, _stdlib_prose

    docs = [d.read() for d in _stdlib_code()[:3]] + [d.read() for d in _stdlib_prose()[:3]]
    return [d[:1200] for d in docs if d.strip()]


def _quantized(source):
    """One ggml type per (layer, projection) of routed experts, cycling through the K and IQ types (gpt-oss: MXFP4 in
    layer 0, its own native format), q4_k / q4_0 for every other 2-D tensor that GGUF stores one to one; with the
    dequantized weights transformers should run: ({key: QuantizedTensor}, {(layer, proj): [E, out, in]},
    {name: [out, in]})."""
    ckpt = open_checkpoint(source)
    ad = adapter_for(ckpt.config)
    k_types = itertools.cycle(BLOCK_TYPES)
    for _ in range(6 * ARCHS.index(ad.model_type)):  # each architecture starts elsewhere: all eleven types run
        next(k_types)
    quantized, experts, others = {}, {}, {}
    for L in ad.moe_layers:
        for p in ad.projections:
            if p != "up" or not ad.fused_experts:  # gpt-oss's gate / up are one tensor on disk, of one format
                name = "mxfp4" if ad.fused_experts and L == ad.moe_layers[0] else next(k_types)
            W = ad.read_experts(ckpt, L, p).float()
            imp = torch.rand(W.shape[-1], generator=torch.Generator().manual_seed(L)) + 0.5
            q = formats.quantize(W, name) if name == "mxfp4" else formats.quantize_ggml(W, name, importance=imp)
            for e in range(W.shape[0]):
                quantized[(L, e, p)] = q.expert(e)
            experts[(L, p)] = q.dequantize()
    expert_names = {
        ad.expert_tensor_name(L, e, p) for L in ad.moe_layers for e in range(ad.num_experts) for p in ad.projections
    }
    for name in ckpt.keys():
        role = ad.classify(name).role
        targets = gguf_targets(ad.model_type, name)
        if (
            name in expert_names
            or len(ckpt.shape(name)) != 2
            or role not in OTHER_ROLES
            or len(targets) != 1
            or targets[0][1] is not None
        ):
            continue
        q = formats.quantize_ggml(ckpt.get(name).float(), "q4_k" if ckpt.shape(name)[1] % 256 == 0 else "q4_0")
        quantized[name] = q
        others[name] = q.dequantize()
    return quantized, experts, others


def _reference(source, experts: dict, others: dict, tmp):
    """transformers (float32) running `source` with these weights in place of its own."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    ckpt = open_checkpoint(source)
    ad = adapter_for(ckpt.config)
    tensors = {n: ckpt.get(n).float() for n in ckpt.keys()}
    tensors.update(others)
    for L in {L for L, _ in experts}:
        if ad.fused_experts:
            for p in ("gate", "down"):
                name = ad.expert_tensor_name(L, 0, p)
                tensors[name] = ad.fuse_experts(ckpt, L, name, {q: experts[(L, q)] for q in ad.projections}).float()
        else:
            for p in ad.projections:
                for e in range(ad.num_experts):
                    tensors[ad.expert_tensor_name(L, e, p)] = experts[(L, p)][e]
    tmp.mkdir(parents=True)
    shutil.copy(source / "config.json", tmp / "config.json")
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp / "model.safetensors"))
    return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()


def _logits(model, ids):
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0].numpy() for s in ids]


def _entropy(logits):
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    lp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return float(-(np.exp(lp) * lp).sum(-1).mean())


def _kl(ref, got):
    return float(np.concatenate([V.kl_per_token(r, g) for r, g in zip(ref, got)]).mean())


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ARCHS)
def test_llama_cpp_runs_every_architecture(model_type, llama, tmp_path):
    """The F32 GGUF loads in llama.cpp, tokenizes as transformers does and gives transformers' logits
    (KL <= 1e-4); a quantized GGUF (K types / MXFP4 experts, Q4 elsewhere) holds the planned types and
    llama.cpp runs it as transformers runs moequant's dequantization of the same codes (KL <= 1e-3,
    while the quantization itself is over 10x that)."""
    from tokenizers import Tokenizer

    source = build_gguf_tiny(model_type, tmp_path / "src")
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    texts = _texts()
    ids = [tok.encode(t).ids for t in texts]
    f32 = export_checkpoint(source, {}, tmp_path / "f32", layout="gguf", target="llama.cpp", gguf_float="f32")
    assert V.tokenize(f32 / "model.gguf", texts) == ids

    quantized, experts, others = _quantized(source)
    qdir = export_checkpoint(source, quantized, tmp_path / "q", layout="gguf", target="llama.cpp", gguf_float="f32")
    got = {t.name: t.tensor_type.name.lower() for t in gguf.GGUFReader(qdir / "model.gguf").tensors}
    ad = adapter_for(open_checkpoint(source).config)
    for L in ad.moe_layers:
        for p in ad.projections:
            assert got[f"blk.{L}.ffn_{p}_exps.weight"] == quantized[(L, 0, p)].spec.name
    assert all(got[t] == quantized[n].spec.name for n in others for t, _ in gguf_targets(ad.model_type, n))
    assert bool(others) == bool(ad.num_shared_experts)

    short = [s[:96] for s in ids]
    base = _logits(_reference(source, {}, {}, tmp_path / "r0"), short)
    ours = _logits(_reference(source, experts, others, tmp_path / "r1"), short)
    ll_f32, ll_q = V.logits([f32 / "model.gguf", qdir / "model.gguf"], short)
    kl_f32, kl_same, kl_quant = _kl(base, ll_f32), _kl(ours, ll_q), _kl(base, ours)
    entropy = float(np.mean([_entropy(b) for b in base]))
    print(
        f"{model_type}: KL f32 {kl_f32:.2e}, llama.cpp vs ours {kl_same:.2e}, quantization {kl_quant:.2e}, "
        f"entropy {entropy:.2f} of {np.log(base[0].shape[-1]):.2f}"
    )
    assert entropy < 0.8 * np.log(base[0].shape[-1])  # far from uniform: the KLs below mean something
    assert kl_f32 <= 1e-4
    assert kl_same <= 1e-3
    assert kl_quant > 10 * kl_same


@pytest.mark.parametrize(
    "model_type, override, match",
    [
        ("qwen3_moe", {"norm_topk_prob": False}, "always renormalises"),
        ("olmoe", {"norm_topk_prob": True}, "does not renormalise"),
        ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1}, "group_limited_greedy"),
        ("deepseek_v3", {"rope_interleave": False}, "rope_interleave"),
        ("gpt_oss", {"layer_types": ["full_attention", "sliding_attention"]}, "even layers"),
    ],
)
def test_what_llama_cpp_cannot_run_is_refused_before_writing(model_type, override, match, tmp_path):
    import json

    source = build_gguf_tiny(model_type, tmp_path / "src")
    cfg = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**cfg, **override}))
    with pytest.raises(UserError, match=match):
        export_checkpoint(source, {}, tmp_path / "out", layout="gguf", target="llama.cpp")
    assert not (tmp_path / "out").exists()


def test_kv_b_proj_is_written_as_llama_cpp_splits_it_in_its_planned_type(tmp_path):
    """llama.cpp's deepseek2 graph wants MLA's kv_b_proj split per head into attn_k_b (the K part transposed: rows
    qk_nope wide) and attn_v_b (rows kv_lora wide). A kv_b_proj planned in a ggml type is written as both halves in
    that type, read back by gguf-py: attn_v_b holds the planned codes' own rows bit for bit; attn_k_b the original
    weights quantized along its rows, as close to them as the type's own quantization of that transpose."""
    source = build_gguf_tiny("deepseek_v3", tmp_path / "src")
    ckpt = open_checkpoint(source)
    c = ckpt.config
    heads, nope, v, lora = (
        int(c[k]) for k in ("num_attention_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank")
    )
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    w = ckpt.get(name).double()
    for key in ("q8_0", "q4_0"):
        q = formats.quantize_ggml(w.float(), key)
        out = export_checkpoint(source, {name: q}, tmp_path / key, layout="gguf", target="llama.cpp")
        tensors = {t.name: t for t in gguf.GGUFReader(out / "model.gguf").tensors}
        k_b, v_b = (tensors[f"blk.1.attn_{h}_b.weight"] for h in "kv")
        assert k_b.tensor_type.name.lower() == v_b.tensor_type.name.lower() == key
        got_v = gguf.quants.dequantize(v_b.data, v_b.tensor_type)
        assert np.array_equal(got_v, q.dequantize().reshape(heads, nope + v, lora)[:, nope:].numpy())
        got_k = torch.from_numpy(gguf.quants.dequantize(k_b.data, k_b.tensor_type)).double()
        want_k = w.reshape(heads, nope + v, lora)[:, :nope].transpose(1, 2)  # [heads, kv_lora, nope]
        assert got_k.shape == want_k.shape
        own = formats.quantize_ggml(want_k.float(), key).dequantize().double()  # the type's error on these rows
        err = ((got_k - want_k).norm() / want_k.norm()).item()
        assert err <= 1.001 * ((own - want_k).norm() / want_k.norm()).item() and err < (0.01 if key == "q8_0" else 0.1)
        # the K part's rows were quantized along nope, not copied from q's rows along kv_lora
        assert not torch.equal(got_k, q.dequantize().double().reshape(heads, nope + v, lora)[:, :nope].transpose(1, 2))


@pytest.mark.slow
def test_llama_cpp_runs_kv_b_proj_split_and_quantized(llama, tmp_path):
    """MLA's kv_b_proj in q8_0 / q4_0 in every layer (the rest F32): llama.cpp runs the split halves as transformers
    runs kv_b_proj reassembled from gguf-py's dequantization of them (KL <= 1e-3, the quantization itself over 10x
    that in q4_0). DeepSeek-V2's softmax router: V3's random grouped sigmoid router flips tokens on any rounding
    before it (measured: 3e-3 in q8_0 from a few flipped tokens), which says nothing about MLA."""
    from tokenizers import Tokenizer

    source = build_gguf_tiny("deepseek_v2", tmp_path / "src")
    ckpt = open_checkpoint(source)
    c = ckpt.config
    heads, nope, v, lora = (
        int(c[k]) for k in ("num_attention_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank")
    )
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    ids = [tok.encode(t).ids[:96] for t in _texts()]
    base = _logits(_reference(source, {}, {}, tmp_path / "r0"), ids)
    names = [f"model.layers.{L}.self_attn.kv_b_proj.weight" for L in range(int(c["num_hidden_layers"]))]
    for key in ("q8_0", "q4_0"):
        items = {n: formats.quantize_ggml(ckpt.get(n).float(), key) for n in names}
        out = export_checkpoint(source, items, tmp_path / key, layout="gguf", target="llama.cpp", gguf_float="f32")
        tensors = {t.name: t for t in gguf.GGUFReader(out / "model.gguf").tensors}
        read = lambda t: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))  # noqa: E731
        others = {
            n: torch.cat(
                [read(tensors[f"blk.{L}.attn_k_b.weight"]).transpose(1, 2), read(tensors[f"blk.{L}.attn_v_b.weight"])],
                1,
            ).reshape(heads * (nope + v), lora)
            for L, n in enumerate(names)
        }
        ours = _logits(_reference(source, {}, others, tmp_path / f"r-{key}"), ids)
        (got,) = V.logits([out / "model.gguf"], ids)
        kl_same, kl_quant = _kl(ours, got), _kl(base, ours)
        print(f"kv_b_proj {key}: llama.cpp vs ours {kl_same:.2e}, quantization {kl_quant:.2e}")
        assert kl_same <= 1e-3
        if key == "q4_0":
            assert kl_quant > 10 * kl_same


def test_a_type_that_kv_b_projs_split_rows_cannot_hold_is_refused_before_calibration(tmp_path):
    """At DeepSeek-V3's own shapes kv_b_proj's rows (kv_lora 512) hold Q4_K's 256-blocks, but attn_k_b's rows
    (qk_nope 128) do not: the plan refuses it in one sentence naming attn_k_b; a 32-block type is counted as the
    two halves GGUF writes."""
    from helpers import header_only_checkpoint
    from transformers import DeepseekV3Config

    from moequant.pipeline.apply import resolve_recipe
    from moequant.plan.policy import check_plan, make_plan

    model = tmp_path / "deepseek-v3-shape"
    header_only_checkpoint(
        model, DeepseekV3Config(num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=16, vocab_size=4096)
    )
    ckpt = open_checkpoint(model)
    recipe = resolve_recipe(
        "recipes/gguf.yaml",
        str(model),
        str(tmp_path / "run"),
        ["non_experts.format=q4_k", "non_experts.formats=[]", "experts.method=uniform", "experts.format=q4_k"],
    )
    with pytest.raises(
        UserError,
        match=r"cannot hold tensor model\.layers\.0\.self_attn\.kv_b_proj\.weight: tensor "
        r"'blk\.0\.attn_k_b\.weight \(of .*\)' has 128 input columns",
    ):
        check_plan(recipe, ckpt)
    recipe = resolve_recipe(
        "recipes/gguf.yaml",
        str(model),
        str(tmp_path / "run"),
        ["non_experts.format=q5_0", "non_experts.formats=[]", "experts.method=uniform", "experts.format=q4_k"],
    )
    plan = {t.name: t for t in make_plan(recipe, ckpt, None).tensors}
    kv_b = plan["model.layers.0.self_attn.kv_b_proj.weight"]
    assert kv_b.format == "q5_0" and kv_b.kept is None
    # attn_k_b: 128 heads x 512 rows of 128 (4 blocks of 22 bytes), attn_v_b: 128 x 128 rows of 512 (16 blocks)
    assert kv_b.bytes == 128 * 512 * 4 * 22 + 128 * 128 * 16 * 22


QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)  # Qwen2 / Qwen3's tokenizer.json split pattern


@pytest.mark.slow
def test_qwen_pre_tokenizer_round_trips_in_llama_cpp(llama, tmp_path):
    """A Qwen2 / Qwen3-style tokenizer (NFC, Split on Qwen's regex, ByteLevel without its own regex), trained here:
    written as tokenizer.ggml.pre qwen2, llama.cpp tokenizes like transformers (contractions, digits one by one,
    newlines, non-ASCII letters), where GPT-2's pre-tokenizer would not."""
    import json

    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    source = build_gguf_tiny("qwen3_moe", tmp_path / "src")
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        _texts() * 4,
        trainers.BpeTrainer(
            vocab_size=vocab - 8, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok.add_special_tokens([f"<|extra_{i}|>" for i in range(vocab - tok.get_vocab_size())])
    assert tok.get_vocab_size() == vocab
    tok.save(str(source / "tokenizer.json"))
    out = export_checkpoint(source, {}, tmp_path / "out", layout="gguf", target="llama.cpp")
    fields = gguf.GGUFReader(out / "model.gguf").fields
    pre = fields["tokenizer.ggml.pre"]
    assert bytes(pre.parts[pre.data[0]]).decode() == "qwen2"
    texts = _texts() + ["I'LL say it's 12345 apples\n\n\tand naïve café déjà-vu — ok?  ", "x=1;y=22\r\nz = 333"]
    ids = [tok.encode(t).ids for t in texts]
    assert V.tokenize(out / "model.gguf", texts) == ids
    gpt2 = Tokenizer.from_file(str(source / "tokenizer.json"))
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert [gpt2.encode(t).ids for t in texts] != ids  # the pre-tokenizer matters on these texts


@pytest.mark.slow
def test_gpt_oss_mxfp4_source_keeps_its_own_codes(llama, tmp_path):
    """gpt-oss as it ships (experts MXFP4 `*_blocks` / `*_scales`): the GGUF holds those codes as ggml MXFP4
    blocks (gguf-py decodes them to the source's dequantized experts exactly, gate / up de-interleaved) and
    llama.cpp runs them as transformers runs the dequantized source."""
    import json

    from safetensors.torch import save_file

    from benchmarks.make_sources import make_gpt_oss_mxfp4
    from moequant.io.checkpoint import copy_aux_files

    source = make_gpt_oss_mxfp4(tmp_path / "src")
    out = export_checkpoint(source, {}, tmp_path / "out", layout="gguf", target="llama.cpp", gguf_float="f32")
    ckpt = open_checkpoint(source)
    ad = adapter_for(ckpt.config)
    tensors = {t.name: t for t in gguf.GGUFReader(out / "model.gguf").tensors}
    for L in ad.moe_layers:
        for p in ad.projections:
            t = tensors[f"blk.{L}.ffn_{p}_exps.weight"]
            assert t.tensor_type == gguf.GGMLQuantizationType.MXFP4
            values = np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32)
            assert np.array_equal(
                values.reshape(ad.num_experts, *ad.expert_shape(p)), ad.read_experts(ckpt, L, p).numpy()
            )

    ref_dir = tmp_path / "f32"  # the dequantized source as plain float32, for transformers
    ref_dir.mkdir()
    save_file({n: ckpt.get(n).float().contiguous() for n in ckpt.keys()}, str(ref_dir / "model.safetensors"))
    (ref_dir / "config.json").write_text(
        json.dumps({k: v for k, v in ckpt.config.items() if k != "quantization_config"})
    )
    copy_aux_files(source, ref_dir)
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    ids = [Tokenizer.from_file(str(source / "tokenizer.json")).encode(t).ids[:96] for t in _texts()]
    assert V.tokenize(out / "model.gguf", _texts()) == [
        Tokenizer.from_file(str(source / "tokenizer.json")).encode(t).ids for t in _texts()
    ]
    ref = _logits(AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval(), ids)
    kl = _kl(ref, V.logits([out / "model.gguf"], ids)[0])
    print(f"gpt-oss MXFP4 source: KL llama.cpp vs transformers {kl:.2e}")
    assert kl <= 1e-3
