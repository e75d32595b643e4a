"""What llama.cpp's graphs read, per architecture: the GGUF layout's `GRAPHS` (one entry per model_type).

Everything llama.cpp's graphs need to know about an architecture is in `GRAPHS` (one entry per
model_type): the llama.cpp architecture, the tensors it writes transformed or split (every name is
gguf-py's: its `TensorNameMap` for the architecture, as llama.cpp's own converter names them), the
metadata it reads (gguf_metadata.py: `hp_moe` from the adapter for the newer graphs, a small function where
a graph reads more) and what it cannot run. A family llama.cpp has no graph for, or one GGUF export does not
write (`REFUSED`, with why), is refused by the precheck. Facts from the llama.cpp that
llama-cpp-python 0.3.36 vendors (src/models/<arch>.cpp, gguf-py constants, its loader's errors):

- routed experts of layer N stacked per projection: `blk.N.ffn_{gate,up,down}_exps.weight`,
  ggml shape {n_embd, n_ff_exp, n_expert} (down {n_ff_exp, n_embd, n_expert}); one ggml type per
  tensor, so every expert of a (layer, projection) must share its format;
- `output.weight` always (a copy of the embeddings when they are tied: the qwen2moe, olmoe and
  openai-moe loaders require it);
- mixtral is llama.cpp's `llama` architecture, whose rope rotates interleaved pairs: q/k rows are
  permuted from the HF (rotate-half) order. deepseek2's rope rotates interleaved pairs too, which is
  the order DeepSeek's weights already have (rope_interleave); the others are NEOX (rotate-half);
- qwen3moe always renormalises the top-k weights, olmoe and qwen2moe never: a config saying
  otherwise is refused; qwen3moe / olmoe q and k norms are `attn_{q,k}_norm` (olmoe's over the whole
  projection);
- deepseek2 (DeepSeek-V2 / V3 / Kimi-K2): `leading_dense_block_count` dense layers (`ffn_{gate,up,
  down}`), MLA with kv_b_proj split per head into `attn_k_b` {qk_nope, kv_lora, n_head} (K part,
  transposed) and `attn_v_b` {kv_lora, v_head, n_head} (a planned ggml type writes both halves in it:
  attn_v_b as the planned codes' own rows, attn_k_b requantized along its qk_nope-wide rows from the
  original weights; `written_shapes` lets the plan check and count them), one KV head, key/value lengths kv_lora+rope /
  kv_lora and the `_mla` ones nope+rope / v_head, `expert_gating_func` (V3 sigmoid, V2 softmax),
  `exp_probs_b.bias` = e_score_correction_bias (selection only), `expert_weights_scale` =
  routed_scaling_factor, `expert_weights_norm`, groups as `expert_group_count` / `_used_count` ranked
  by the sum of each group's two best scores (V3's rule; V2's group_limited_greedy ranks by the best
  one: refused), shared experts `ffn_*_shexp` of width n_ff_exp * n_shared;
- glm-dsa (GLM-5): deepseek2's MLA (kv_b_proj split alike) and MoE keys plus the lightning indexer as gguf-py names
  it (`indexer.attn_q_b`, `indexer.attn_k`, `indexer.k_norm` weight and bias, `indexer.proj`), written as they are on
  disk (its rope, interleaved over the head's first qk_rope dims, is transformers'), `attention.indexer.{head_count,
  key_length,top_k}` and `attention.indexer.types` (a bool a layer, true = full; a shared layer reuses the last full
  layer's top-k, as transformers' indexer_types); the graph rotates the indexer's q / k by an orthonormal Hadamard
  matrix as wide as the largest power of two (64 at least) dividing the head, so only power-of-two heads of 64 or
  more run (GLM-5's: 128); its indexer keys sit in the K cache's type (F16 by default), whose rounding can flip a
  near-tied top-k choice;
- glm4moe (GLM-4.5 ... 4.7, Solar-Open), minimax-m2, ernie4_5-moe, hunyuan-moe, dots1, lfm2moe and
  GLM-4.7-Flash (deepseek2) read their MoE keys from `meta.hp_moe`; ernie4_5-moe also interleave_moe_layer_step;
  dots1 takes as many key / value heads as query heads; lfm2moe computes the logits with the embeddings
  (tied), finds its short-convolution layers by their zero key / value heads and wants the conv kernel
  {kernel, channels}; qwen3next (Qwen3-Next) takes the gated-delta-net layers as llama.cpp's converter
  writes them (ssm_a = -exp(A_log), dt_bias as ssm_dt.bias, the conv kernel {kernel, channels}, every
  norm but the gated one's as 1 + weight), its layers' kinds as recurrent_layers; qwen35moe (Qwen3.5 / 3.6-MoE) too,
  with q/k/v, z, a and b apart, value heads tiled by key head (gguf_transforms.py), interleaved M-RoPE; jamba: Mamba
  layers (ssm_a = -exp(A_log), the conv kernel {kernel, channels}) where a layer has no key / value heads (a list
  per layer); nemotron_h_moe (Nemotron-H): Mamba-2 layers likewise (A and D {1, n_head}, dt_bias as ssm_dt.bias, the
  gated norm {d_inner / n_groups, n_groups}), MoE layers by their per-layer width, no dense MLP layers;
  phimoe routes by a renormalised softmax, not PhiMoE's sparsemixer (refused);
- a multimodal checkpoint's text model (Qwen3-VL-MoE, Qwen3-Omni's thinker, GLM-4.xV, Kimi-K2.5): llama.cpp's
  converters drop `model.language_model.` / `language_model.` from its names and write the vision tower as a
  separate mmproj file (GGUF export does not write that one); qwen3vlmoe is qwen3moe's graph with interleaved M-RoPE,
  whose four `rope.dimension_sections` must fit each head's rotary dimensions (ggml asserts it), and the vision
  tower's deepstack layer count; glm4moe takes GLM-4.xV's sections (plain rope without them); a text token has
  one position in every section, so the rotation is the text model's own;
- granitemoe (GraniteMoE, GraniteMoeShared): llama's interleaved rope (q / k rows permuted), the expert width as
  feed_forward_length, attention / embedding / residual / logit scales = attention_multiplier,
  embedding_multiplier, residual_multiplier, logits_scaling (the logits divided by it), the shared expert's
  input_linear split into ffn_gate_shexp / ffn_up_shexp; granitehybrid (GraniteMoeHybrid, Granite-4.0-H) the same
  over Mamba-2 layers written as nemotron_h_moe's (below) with key / value heads on the attention layers only and
  rope off (rope.scaling.finetuned false, as its converter writes a hybrid); mistral4 is deepseek2's graph under its
  own name;
- gemma4 (Gemma-4's text model): sliding layers of head width head_dim rotated whole at their own theta
  (`rope.freq_base_swa`), full layers of their own width and key / value heads (per_layer_config; keys as values
  without v_proj, attention_k_eq_v) rotated whole with `rope_freqs.weight` {width / 2} = 1 on the proportional
  rope's rotated frequencies and 1e30 on the rest; the last `shared_kv_layers` layers reuse the keys and values of
  layers n-2 (sliding) and n-1 (full) before them; a GELU MLP beside the experts in every layer (feed_forward_length
  per layer, doubled in the shared ones with use_double_wide_mlp), router.scale as `ffn_gate_inp.scale`,
  router.per_expert_scale as `ffn_down_exps.scale`, layer_scalar as `layer_output_scale.weight`, per-layer
  embeddings (`embedding_length_per_layer_input`) looked up by token, the final logits' softcap;
- afmoe (Trinity): NEOX rope on every layer but each fourth one (llama.cpp's fixed n_no_rope_layer_step 4), which
  must be the full-attention layers (transformers ropes only the sliding ones), the sliding window on the others
  (sliding_window_pattern), the embeddings always times sqrt(n_embd) (muP), attention gated by sigmoid(attn_gate)
  before attn_output, q / k norms per head, four plain RMS norms per layer (attn_norm, post_attention_norm,
  ffn_norm, post_ffw_norm), sigmoid routing with expert_bias as exp_probs_b.bias (selection only), the top-k always
  renormalised and times route_scale (expert_weights_scale), num_dense_layers leading dense layers;
- kimi-linear (Kimi-Linear): deepseek2's MLA without rope (the rope part attended unrotated) on the layers with one
  key / value head, KDA on those with none (a per-layer list); KDA's q / k / v projections and their convolutions
  apart (`ssm_conv1d_{q,k,v}`, kept [channels, 1, kernel], F32), ssm_a = -exp(A_log), dt_bias as ssm_dt.bias,
  f_a / f_b, g_a / g_b, b_proj as ssm_beta, o_norm as ssm_norm (gated by a sigmoid), as many KDA heads as attention
  heads, `kda.head_dim`; q and k l2-normalised with rms_norm_eps as the epsilon (transformers: 1e-6); MoE as
  deepseek2's, the top-k always renormalised, no expert groups, dense layers first;
- openai-moe (gpt-oss): gate / up de-interleaved into `ffn_{gate,up}_exps` with their biases
  (`.bias` {n_ff_exp, n_expert}), `post_attention_norm`, `attn_sinks.weight`, router bias
  `ffn_gate_inp.bias`, sliding window on even layers (llama.cpp's fixed pattern), SwiGLU with
  alpha 1.702 / limit 7; MXFP4 experts as ggml MXFP4 blocks (e8m0 byte, then element j in the low
  nibble of byte j and element j+16 in its high nibble);
- mimo2 (MiMo-V2-Flash): per-layer key / value heads, sliding_window_pattern, freq_base_swa, one key length, one value
  length and one rope dimension count for all layers, attn_sinks where a layer has them (the sliding ones),
  attention.value_scale; sigmoid routing, always renormalised, never scaled; dense layers are those without a router.
- deepseek2-ocr (Unlimited-OCR's text model): deepseek2's MoE keys over plain multi-head attention (as many key /
  value heads as query heads, heads hidden / n_head wide, NEOX rope over the whole head at base 10000, which ggml
  asserts), dense layers only first, shared experts always; the reference sliding window (a decoded token sees the
  prompt and the last sliding_window decoded tokens) is not in the graph: a prompt attends over all of itself in both,
  but past sliding_window decoded tokens llama.cpp keeps attending to all of them. On disk the vision parts sit beside
  the text model under `model.` (DeepSeek-OCR's layout), outside the GGUF.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Callable

import torch

from moequant.layouts import gguf_metadata as meta
from moequant.layouts.gguf_transforms import (
    ROW_ORDER,
    SPLITS,
    _conv,
    _conv_tiled,
    _even,
    _first_half,
    _flat,
    _grouped,
    _heads_col,
    _heads_tiled,
    _k_b,
    _neg_exp,
    _neg_exp_col,
    _neg_exp_tiled,
    _odd,
    _out_tiled,
    _permute_k,
    _permute_q,
    _plus_one,
    _qkv_tiled,
    _second_half,
    _v_b,
    _z_tiled,
)

_L = r"model\.layers\.(\d+)\."


@dataclass(frozen=True)
class Graph:
    """How one HF architecture is written for one llama.cpp graph. Tensor names are gguf-py's: its
    `TensorNameMap` for the architecture names every on-disk tensor it knows (as llama.cpp's own converter
    names them); a graph lists only what it writes transformed or split."""

    arch: str  # general.architecture: gguf-py's MODEL_ARCH_NAMES name
    hparams: Callable  # (writer, adapter, config) -> None: the graph's own metadata
    refuses: Callable = meta.no_refusal  # (adapter, config) -> why llama.cpp could not run it, or None
    transforms: tuple = ()  # (HF regex, transform): the tensor gguf-py names, written transformed
    splits: tuple = ()  # (HF regex with the layer as group 1, [(gguf MODEL_TENSOR name, transform or None)], suffix)
    extra: Callable | None = (
        None  # (text config) -> {GGUF name: F32 tensor}: what the graph reads beyond the checkpoint
    )


_LAYER = re.compile(r"\.layers\.(\d+)\.")
# what llama.cpp's loader adds to gguf-py's name of a tensor stored without a suffix (the rest, like Mamba's ssm_a,
# it reads without one)
_SUFFIXES = {"ATTN_SINKS": ".weight", "FFN_EXP_PROBS_B": ".bias", "LAYER_OUT_SCALE": ".weight"}
# as llama.cpp's converters rename them: DeepSeek's correction bias; a multimodal checkpoint's text model (transformers'
# model.language_model., Kimi-K2.5's language_model.) under the causal LM's names
_HF_RENAMES = (
    (r"\.e_score_correction_bias$", ".e_score_correction.bias"),
    (r"^model\.language_model\.", "model."),
    (r"^language_model\.", ""),
    (r"^model\.blocks\.", "model.layers."),  # Kimi-K2.5's text layers, as moequant's adapter names them on disk
    (r"\.block_sparse_moe\.(gate|up|down)_proj\.", r".mlp.\1_proj."),  # Kimi-Linear's dense layers as saved
)


@functools.lru_cache(maxsize=None)
def _name_map(arch: str):
    import gguf

    archs = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}
    return gguf.get_tensor_name_map(archs[arch], 1)  # layer 0 only: names are looked up with the layer as 0


def _tensor_name(tensor: str, layer: int, suffix: str) -> str:
    import gguf

    return gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[tensor]].format(bid=layer) + suffix


def _renamed(hf_name: str) -> str:
    """An on-disk name as llama.cpp's converters see it (_HF_RENAMES): what the graphs' patterns and gguf-py match."""
    for pattern, repl in _HF_RENAMES:
        hf_name = re.sub(pattern, repl, hf_name)
    return hf_name


def mapped_name(arch: str, hf_name: str) -> str | None:
    """gguf-py's name of an on-disk tensor in llama.cpp's `arch` graph (.weight / .bias kept), or None."""
    key = _renamed(hf_name)
    m = _LAYER.search(key)
    if m:
        key = key[: m.start()] + ".layers.0." + key[m.end() :]
    found = _name_map(arch).get_type_and_name(key, try_suffixes=(".weight", ".bias"))
    if found is None:
        return None
    tensor, name = found
    if not name.endswith((".weight", ".bias")):  # stored without a suffix (gpt-oss's sinks, AFMoE's expert_bias)
        name += _SUFFIXES.get(tensor.name, "")
    return f"blk.{m[1]}." + name[len("blk.0.") :] if m and name.startswith("blk.0.") else name


_DEEPSEEK2 = Graph(
    "deepseek2",
    meta.hp_deepseek2,
    meta.refuse_deepseek2,
    splits=((_L + r"self_attn\.kv_b_proj\.weight", [("ATTN_K_B", _k_b), ("ATTN_V_B", _v_b)], ".weight"),),
)
# llama.cpp's llama-style graphs rotate interleaved pairs: q / k rows from HF's rotate-half order
_PERMUTE_QK = ((_L + r"self_attn\.q_proj\.weight", _permute_q), (_L + r"self_attn\.k_proj\.weight", _permute_k))
GRAPHS: dict[str, Graph] = {
    "qwen2_moe": Graph(
        "qwen2moe",
        meta.hp_qwen2moe,
        meta.refuse_qwen2moe,
        transforms=((_L + r"mlp\.shared_expert_gate\.weight", _flat),),
    ),
    "qwen3_moe": Graph("qwen3moe", meta.hp_qwen3moe, meta.refuse_qwen3moe),
    "qwen3_vl_moe": Graph("qwen3vlmoe", meta.hp_qwen3vlmoe, meta.refuse_qwen3vlmoe),
    "qwen3_omni_moe_thinker": Graph(
        "qwen3vlmoe", meta.hp_qwen3vlmoe, meta.refuse_qwen3vlmoe
    ),  # as llama.cpp's converter
    "olmoe": Graph("olmoe", meta.hp_llama, meta.refuse_olmoe),
    "mixtral": Graph("llama", meta.hp_llama, transforms=_PERMUTE_QK),
    "granitemoe": Graph("granitemoe", meta.hp_granite, transforms=_PERMUTE_QK),
    "granitemoeshared": Graph(
        "granitemoe",
        meta.hp_granite,
        transforms=_PERMUTE_QK,
        splits=(
            (
                _L + r"shared_mlp\.input_linear\.weight",
                [("FFN_GATE_SHEXP", _first_half), ("FFN_UP_SHEXP", _second_half)],
                ".weight",
            ),
        ),
    ),
    "granitemoehybrid": Graph(
        "granitehybrid",
        meta.hp_granite_hybrid,
        meta.refuse_granite_hybrid,
        transforms=(
            *_PERMUTE_QK,
            (_L + r"mamba\.A_log", _neg_exp_col),
            (_L + r"mamba\.D", _heads_col),
            (_L + r"mamba\.conv1d\.weight", _conv),
            (_L + r"mamba\.norm\.weight", _grouped),
        ),
        splits=(
            (
                _L + r"shared_mlp\.input_linear\.weight",
                [("FFN_GATE_SHEXP", _first_half), ("FFN_UP_SHEXP", _second_half)],
                ".weight",
            ),
            (_L + r"mamba\.dt_bias", [("SSM_DT", None)], ".bias"),
        ),
    ),
    "gpt_oss": Graph(
        "gpt-oss",
        meta.hp_openai_moe,
        meta.refuse_openai_moe,
        splits=(
            (_L + r"mlp\.experts\.gate_up_proj_bias", [("FFN_GATE_EXP", _even), ("FFN_UP_EXP", _odd)], ".bias"),
            (_L + r"mlp\.experts\.down_proj_bias", [("FFN_DOWN_EXP", None)], ".bias"),
        ),
    ),
    "deepseek_v2": _DEEPSEEK2,
    "deepseek_v3": _DEEPSEEK2,
    "glm4_moe": Graph("glm4moe", meta.hp_moe, meta.refuse_interleaved_dense),
    "minimax_m2": Graph("minimax-m2", meta.hp_moe, meta.refuse_interleaved_dense),
    "ernie4_5_moe": Graph("ernie4_5-moe", meta.hp_ernie, meta.refuse_ernie),
    "hunyuan_v1_moe": Graph("hunyuan-moe", meta.hp_moe, meta.refuse_interleaved_dense),
    "dots1": Graph("dots1", meta.hp_moe, meta.first(meta.refuse_interleaved_dense, meta.refuse_dots1)),
    "lfm2_moe": Graph(
        "lfm2moe",
        meta.hp_lfm2,
        meta.first(meta.refuse_interleaved_dense, meta.refuse_lfm2),
        transforms=((_L + r"conv\.conv\.weight", _conv),),
    ),
    "glm4_moe_lite": _DEEPSEEK2,
    "kimi_k25": _DEEPSEEK2,  # its text model: DeepSeek-V3's
    "mistral4": Graph(
        "mistral4", meta.hp_deepseek2, meta.refuse_deepseek2, splits=_DEEPSEEK2.splits
    ),  # deepseek2's graph
    "glm_moe_dsa": Graph(  # GLM-5: deepseek2's MLA with the lightning indexer
        "glm-dsa",
        meta.hp_glm_dsa,
        meta.first(meta.refuse_deepseek2, meta.refuse_indexer_head),
        splits=_DEEPSEEK2.splits,
    ),
    "solar_open": Graph("glm4moe", meta.hp_moe, meta.refuse_interleaved_dense),
    "glm4v_moe": Graph("glm4moe", meta.hp_glm4v, meta.refuse_interleaved_dense),
    "exaone_moe": Graph("exaone-moe", meta.hp_swa, meta.refuse_interleaved_dense),
    "mimo_v2_flash": Graph("mimo2", meta.hp_mimo2, meta.refuse_mimo2),
    "unlimited_ocr": Graph("deepseek2-ocr", meta.hp_deepseek2ocr, meta.refuse_deepseek2ocr),  # its text model
    "afmoe": Graph("afmoe", meta.hp_afmoe, meta.refuse_afmoe),
    # the KDA convolutions stay [channels, 1, kernel] (llama.cpp's {kernel, 1, channels})
    "kimi_linear": Graph(
        "kimi-linear",
        meta.hp_kimi_linear,
        meta.refuse_kimi_linear,
        transforms=((_L + r"self_attn\.A_log", _neg_exp),),
        splits=(*_DEEPSEEK2.splits, (_L + r"self_attn\.dt_bias", [("SSM_DT", None)], ".bias")),
    ),
    "jamba": Graph(
        "jamba",
        meta.hp_jamba,
        transforms=((_L + r"mamba\.A_log", _neg_exp), (_L + r"mamba\.conv1d\.weight", _conv)),
    ),
    "nemotron_h": Graph(
        "nemotron_h_moe",
        meta.hp_nemotron_h,
        meta.refuse_nemotron_h,
        transforms=(
            (r"backbone\.layers\.\d+\.mixer\.A_log", _neg_exp_col),
            (r"backbone\.layers\.\d+\.mixer\.D", _heads_col),
            (r"backbone\.layers\.\d+\.mixer\.conv1d\.weight", _conv),
            (r"backbone\.layers\.\d+\.mixer\.norm\.weight", _grouped),
        ),
        splits=((r"backbone\.layers\.(\d+)\.mixer\.dt_bias", [("SSM_DT", None)], ".bias"),),
    ),
    "qwen3_next": Graph(
        "qwen3next",
        meta.hp_qwen3next,
        meta.first(meta.refuse_interleaved_dense, meta.refuse_qwen3next),
        transforms=(
            (_L + r"mlp\.shared_expert_gate\.weight", _flat),
            (_L + r"linear_attn\.A_log", _neg_exp),
            (_L + r"linear_attn\.conv1d\.weight", _conv),
            (r".*(?<!linear_attn\.)norm\.weight", _plus_one),
        ),
        splits=((_L + r"linear_attn\.dt_bias", [("SSM_DT", None)], ".bias"),),
    ),
    # Qwen3.5 / 3.6-MoE: Qwen3-Next's graph with q / k / v, z, a and b projected apart and the value heads tiled
    "qwen3_5_moe": Graph(
        "qwen35moe",
        meta.hp_qwen35moe,
        meta.refuse_interleaved_dense,  # any layer_types: the graph reads recurrent_layers
        transforms=(
            (_L + r"mlp\.shared_expert_gate\.weight", _flat),
            (_L + r"linear_attn\.in_proj_qkv\.weight", _qkv_tiled),
            (_L + r"linear_attn\.in_proj_z\.weight", _z_tiled),
            (_L + r"linear_attn\.in_proj_[ab]\.weight", _heads_tiled),
            (_L + r"linear_attn\.A_log", _neg_exp_tiled),
            (_L + r"linear_attn\.conv1d\.weight", _conv_tiled),
            (_L + r"linear_attn\.out_proj\.weight", _out_tiled),
            (r".*(?<!linear_attn\.)norm\.weight", _plus_one),
        ),
        splits=((_L + r"linear_attn\.dt_bias", [("SSM_DT", _heads_tiled)], ".bias"),),
    ),
    "gemma4": Graph(
        "gemma4",
        meta.hp_gemma4,
        meta.refuse_gemma4,
        splits=(  # the router's input scale and its per-expert output scale, as llama.cpp's converter names them
            (_L + r"router\.scale", [("FFN_GATE_INP", None)], ".scale"),
            (_L + r"router\.per_expert_scale", [("FFN_DOWN_EXP", None)], ".scale"),
        ),
        extra=meta.gemma4_rope_freqs,
    ),
}
ARCHS = {mt: g.arch for mt, g in GRAPHS.items()}  # model_type -> llama.cpp architecture


# families llama.cpp has a graph for that GGUF export does not write, each with why (tests/families.py's table)
REFUSED: dict[str, str] = {
    "phimoe": (
        "llama.cpp's phimoe graph weights the top-k experts by a renormalised softmax, not by PhiMoE's sparsemixer "
        "(a softmax over the scores near the best one), so it would not compute this checkpoint's logits"
    ),
    **{
        mt: f"llama.cpp's {arch} graph is newer than gguf-py 0.19, whose tensor names GGUF export writes"
        for mt, arch in (
            ("deepseek_v32", "deepseek32"),
            ("deepseek_v4", "deepseek4"),
            ("hy_v3", "hy_v3"),
            ("laguna", "laguna"),
            ("mellum", "mellum"),
            ("qwen4_exp", "qwen4exp"),
            ("minicpm5_moe", "minicpm5"),
            ("cohere2_moe", "cohere2moe"),
            ("minimax", "minimax-01"),
            ("granitemoe_swa", "granite_swa"),
            ("hy_v4", "hy_v4"),
            ("hy_v4_vl", "hy_v4"),  # its text model's
            ("minimax_m3_vl", "minimax-m3"),
            ("bailing_hybrid", "bailingmoe3"),  # Ling-3.0
        )
    },
}


# families whose config.json transformers reads differently from its spelling: the graph is written from transformers'
# own config, what its forward runs. MiMo-V2-Flash's hub config names hybrid_layer_pattern, swa_rope_theta and
# sliding_window_size, which transformers replaces by its layer_types and per-layer-type rope and widens by one
# (sliding_window 129 for a window size of 128)
_TRANSFORMERS_CONFIG = ("mimo_v2_flash",)


def graph_config(adapter, config: dict) -> dict:
    """The config llama.cpp's graph is written from: a multimodal checkpoint's text config (transformers' own, with
    config.json's values) beside its top-level keys (vision_config) and model_type; transformers' config of a
    _TRANSFORMERS_CONFIG family; a causal LM's config.json."""
    if config.get("model_type") in _TRANSFORMERS_CONFIG:
        from transformers import AutoConfig

        raw = {k: v for k, v in config.items() if k != "model_type"}
        return {**AutoConfig.for_model(config["model_type"], **raw).to_dict(), "model_type": config["model_type"]}
    if "text_config" not in config:
        return config
    return {**config, **adapter.text_config, "model_type": config["model_type"]}


# vision parts that sit beside the text model's under its own prefix: Unlimited-OCR's on disk (DeepSeek-OCR's layout)
_VISION_BESIDE_TEXT = re.compile(r"model\.(sam_model|vision_model|projector|image_newline|view_seperator)\b")


def prediction_layer(config: dict, hf_name: str) -> bool:
    """Whether a tensor belongs to a multi-token-prediction layer (DeepSeek's, GLM's num_nextn_predict_layers: the
    layers past num_hidden_layers). GGUF export leaves them out, as llama.cpp's converter does for deepseek2 and with
    --no-mtp for the graphs that can read them (they only draft tokens; the model's logits do not use them)."""
    m = _LAYER.search(_renamed(hf_name))
    layers = (config.get("text_config") or config).get("num_hidden_layers")
    return bool(m and layers is not None and int(m[1]) >= int(layers))


def outside_text_model(adapter, config: dict, hf_name: str) -> bool:
    """Whether a multimodal checkpoint's tensor lies outside its text model and head (the vision tower, its
    projector): llama.cpp reads those from a separate mmproj file, which GGUF export does not write."""
    if "text_config" not in config:
        return False
    if _VISION_BESIDE_TEXT.match(hf_name):
        return True
    expert = adapter.expert_tensor_name(adapter.moe_layers[0], 0, adapter.projections[0])
    prefix = expert[: re.search(r"\.\w+\.\d+\.", expert).start() + 1]  # the text model's, before its layers
    return not hf_name.startswith(prefix) and adapter.classify(hf_name).role != "lm_head"


def model_refusal(adapter, config: dict) -> str | None:
    """Why a GGUF file of this model could not be run by llama.cpp as transformers runs the checkpoint (one clause),
    or None: a family llama.cpp has no graph for, one GGUF export does not write (REFUSED), a config its graph
    cannot follow."""
    mt = adapter.model_type
    if mt in REFUSED:
        return f"GGUF export does not write {mt}: {REFUSED[mt]}"
    if mt not in GRAPHS:
        return (
            f"llama.cpp (llama-cpp-python 0.3.36) has no graph for {mt}; GGUF export writes {', '.join(sorted(GRAPHS))}"
        )
    why = GRAPHS[mt].refuses(adapter, graph_config(adapter, config))
    return why and why.replace("{arch}", GRAPHS[mt].arch)


def gguf_targets(model_type: str, hf_name: str) -> list[tuple[str, Callable | None]]:
    """The GGUF tensors one on-disk tensor becomes: [(GGUF name, transform or None)] ([] when none)."""
    graph = GRAPHS[model_type]
    key = _renamed(hf_name)
    for pattern, parts, suffix in graph.splits:
        m = re.fullmatch(pattern, key)
        if m:
            return [(_tensor_name(t, int(m[1]), suffix), fn) for t, fn in parts]
    name = mapped_name(graph.arch, hf_name)
    if name is None:
        return []
    return [(name, next((fn for p, fn in graph.transforms if re.fullmatch(p, key)), None))]


def reshaped_reason(model_type: str | None, hf_name: str) -> str | None:
    """Why GGUF writes this tensor unquantized: llama.cpp's graph wants it transformed in a way that
    packed ggml rows cannot take and that GGUF export does not requantize; None otherwise (kv_b_proj's
    halves are quantized as tensors of their own: written_shapes)."""
    if model_type not in GRAPHS:
        return None
    targets = gguf_targets(model_type, hf_name)
    if all(fn in (None, *ROW_ORDER, *SPLITS) for _, fn in targets):
        return None
    return (
        f"llama.cpp's {GRAPHS[model_type].arch} graph reshapes it into "
        f"{', '.join(t for t, _ in targets)}, which GGUF export writes unquantized"
    )


def written_shapes(config: dict, hf_name: str, shape) -> list[tuple[str, tuple[int, int]]]:
    """(GGUF name, [rows, row width]) of each tensor GGUF writes for this one in a ggml type: ggml quantizes
    along the row, so each width must hold the type's blocks (kv_b_proj: attn_k_b's rows are qk_nope wide,
    attn_v_b's kv_lora). [] for a tensor GGUF does not write one to one or split."""
    targets = gguf_targets(config.get("model_type"), hf_name) if config.get("model_type") in GRAPHS else []
    out = []
    for name, fn in targets:
        s = (
            tuple(shape)
            if fn in (None, *ROW_ORDER)
            else tuple(fn(torch.empty(tuple(shape), device="meta"), config).shape)
        )
        out.append((name, (math.prod(s[:-1]), s[-1])))
    return out
