"""GGUF export for llama.cpp / Ollama / LM Studio: `export: {format: gguf}` -> checkpoint/model.gguf.

    export_gguf(ckpt, adapter, items, out_dir, float_type="bf16")

`items` maps on-disk tensor names to QuantizedTensors (as `export_checkpoint` resolves them);
ggml-typed ones (and MXFP4 routed experts) are written as their packed blocks, bf16 ones and
everything else as `plain_type` says: in `float_type` (bf16 | f16 | f32), but 1-D tensors (norms,
biases), expert biases and the routers in F32, as llama.cpp's own converter writes them (ggml adds
expert biases in F32 only), and token_embd / output in the ggml type `types` gives them. The plan's
byte account asks the same `plain_nbytes` (through the gguf layout), so it counts what this file
holds (gpt-oss's 2-D expert biases aside: the account counts them in `float_type`).

Everything llama.cpp's graphs need to know about an architecture is in `GRAPHS` (one entry per
model_type): the llama.cpp architecture, the tensor names (HF regex -> GGUF name, with the
transform some need), the metadata it reads and what it cannot run. Facts from the llama.cpp that
llama-cpp-python 0.3.36 vendors (src/models/<arch>.cpp, gguf-py constants):

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
- openai-moe (gpt-oss): gate / up de-interleaved into `ffn_{gate,up}_exps` with their biases
  (`.bias` {n_ff_exp, n_expert}), `post_attention_norm`, `attn_sinks.weight`, router bias
  `ffn_gate_inp.bias`, sliding window on even layers (llama.cpp's fixed pattern), SwiGLU with
  alpha 1.702 / limit 7; MXFP4 experts as ggml MXFP4 blocks (e8m0 byte, then element j in the low
  nibble of byte j and element j+16 in its high nibble).

gpt-oss's experts as the source stores them (MXFP4 `*_blocks` / `*_scales`, nothing replacing them)
are written as their own codes. The tokenizer (a byte-level BPE with GPT-2's pre-tokenizer, as the
bundled models have, or Qwen2 / Qwen3's: `tokenizer_pre`) goes in as `tokenizer.ggml.*`: tokens by
id, merges, token types (added special tokens are control tokens), bos / eos / padding ids and
add_bos = whether the HF post-processor adds one. Not written yet: DeepSeek-V3's and gpt-oss's own
pre-tokenizers (refused, one sentence), Kimi-K2 (model_type kimi_k2 has no adapter).
Anything llama.cpp could not run as planned is a UserError before anything is written. The file
is written in a temporary sibling directory and renamed; tensors are read and packed layer by
layer as gguf-py writes them (only the one being written is in memory).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from moequant.errors import UserError
from moequant.formats import check_shape, get_format, quantize_ggml
from moequant.io.checkpoint import EXPORT_INFO, atomic_directory

GGUF_FILE = "model.gguf"
FLOAT_TYPES = ("bf16", "f16", "f32")
RAW_TYPES = {"mxfp4": "MXFP4"}  # non-ggml formats that GGUF stores natively (routed experts), by ggml name
_ELEMENT_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
_F32_ROLES = ("router", "shared_expert_gate")  # ffn_gate_inp(_shexp): F32, never quantized
_TYPED_ROLES = {"embedding": "token_embd.weight", "lm_head": "output.weight"}  # the tensors `types` may set, by role
_L = r"model\.layers\.(\d+)\."


# ---- transforms of one HF tensor into one GGUF tensor (torch in, torch out) -----------------------


def _rope_permute(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF rotate-half row order -> llama.cpp's interleaved pairs, per head (rows of any width)."""
    r = rows.shape[0]
    return rows.reshape(n_head, 2, r // n_head // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def _permute_q(t, c):
    return _rope_permute(t, int(c["num_attention_heads"]))


def _permute_k(t, c):
    return _rope_permute(t, int(c.get("num_key_value_heads") or c["num_attention_heads"]))


ROW_ORDER = (_permute_q, _permute_k)  # transforms that only reorder rows: valid on packed ggml rows too


def _kv_b(t, c):
    """kv_b_proj [n_head * (nope + v), kv_lora] -> [n_head, nope + v, kv_lora]."""
    return t.reshape(int(c["num_attention_heads"]), int(c["qk_nope_head_dim"]) + int(c["v_head_dim"]), -1)


def _k_b(t, c):  # attn_k_b: ggml {nope, kv_lora, n_head} = torch [n_head, kv_lora, nope]
    return _kv_b(t, c)[:, : int(c["qk_nope_head_dim"])].transpose(1, 2).contiguous()


def _v_b(t, c):  # attn_v_b: ggml {kv_lora, v_head, n_head} = torch [n_head, v_head, kv_lora]
    return _kv_b(t, c)[:, int(c["qk_nope_head_dim"]) :].contiguous()


SPLITS = (_k_b, _v_b)  # transforms whose parts GGUF quantizes as tensors of their own (export_gguf's _split)


def _even(t, c):  # gpt-oss gate_up bias [E, 2I]: gate = even columns
    return t[..., 0::2].contiguous()


def _odd(t, c):
    return t[..., 1::2].contiguous()


def _flat(t, c):  # qwen2moe's shared-expert gate [1, n_embd] -> llama.cpp's {n_embd}
    return t.reshape(-1)


# ---- the architectures -----------------------------------------------------------------------------

_COMMON = [
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (_L + r"input_layernorm\.weight", r"blk.\1.attn_norm.weight"),
    (_L + r"post_attention_layernorm\.weight", r"blk.\1.ffn_norm.weight"),
    (_L + r"self_attn\.([qkv])_proj\.(weight|bias)", r"blk.\1.attn_\2.\3"),
    (_L + r"self_attn\.o_proj\.(weight|bias)", r"blk.\1.attn_output.\2"),
    (_L + r"self_attn\.([qk])_norm\.weight", r"blk.\1.attn_\2_norm.weight"),
    (_L + r"mlp\.gate\.weight", r"blk.\1.ffn_gate_inp.weight"),
]


def _add_common(w, adapter, c: dict) -> None:
    """Keys every graph reads; head / expert widths are each graph's own."""
    w.add_name(str(c.get("_name_or_path") or adapter.model_type))
    w.add_context_length(int(c.get("max_position_embeddings", 4096)))
    w.add_embedding_length(adapter.hidden)
    w.add_block_count(adapter.num_layers)
    w.add_head_count(int(c["num_attention_heads"]))
    w.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", 1e-6)))
    w.add_expert_count(adapter.num_experts)
    w.add_expert_used_count(adapter.top_k)
    w.add_vocab_size(int(c["vocab_size"]))
    rope = _rope(c)
    w.add_rope_freq_base(float(rope.get("rope_theta", c.get("rope_theta", 10000.0))))
    if rope.get("rope_type") == "yarn":
        import gguf

        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        for key, add in (
            ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
            ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
        ):
            if rope.get(key) is not None:
                add(float(rope[key]))
    elif rope.get("rope_type") == "linear":
        import gguf

        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))


def _rope(c: dict) -> dict:
    return c.get("rope_parameters") or c.get("rope_scaling") or {}


def _gqa_heads(w, adapter, c: dict) -> None:
    n_head = int(c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or adapter.hidden // n_head)
    w.add_head_count_kv(int(c.get("num_key_value_heads") or n_head))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)


def _hp_llama(w, adapter, c):
    _gqa_heads(w, adapter, c)
    w.add_feed_forward_length(int(c.get("intermediate_size", adapter.expert_intermediate)))


def _hp_qwen2moe(w, adapter, c):
    _hp_llama(w, adapter, c)
    w.add_expert_feed_forward_length(adapter.expert_intermediate)
    w.add_expert_shared_feed_forward_length(adapter.shared_intermediate)


def _hp_qwen3moe(w, adapter, c):
    _hp_llama(w, adapter, c)
    w.add_expert_feed_forward_length(adapter.expert_intermediate)


def _hp_deepseek2(w, adapter, c):
    import gguf

    kv_lora, rope, nope = int(c["kv_lora_rank"]), int(c["qk_rope_head_dim"]), int(c["qk_nope_head_dim"])
    w.add_head_count_kv(1)  # MLA runs as MQA over the compressed KV
    w.add_feed_forward_length(int(c.get("intermediate_size", adapter.expert_intermediate)))
    w.add_leading_dense_block_count(adapter.moe_layers[0] if adapter.moe_layers else adapter.num_layers)
    w.add_q_lora_rank(int(c.get("q_lora_rank") or 0))
    w.add_kv_lora_rank(kv_lora)
    w.add_key_length(kv_lora + rope)
    w.add_value_length(kv_lora)
    w.add_key_length_mla(nope + rope)
    w.add_value_length_mla(int(c["v_head_dim"]))
    w.add_rope_dimension_count(rope)
    w.add_expert_feed_forward_length(adapter.expert_intermediate)
    w.add_expert_shared_count(adapter.num_shared_experts)
    r = adapter.routing
    w.add_expert_weights_scale(float(r.scaling))
    w.add_expert_weights_norm(bool(r.normalize_topk))
    w.add_expert_gating_func(
        gguf.ExpertGatingFuncType.SIGMOID if r.scoring == "sigmoid" else gguf.ExpertGatingFuncType.SOFTMAX
    )
    if r.groups > 1 and r.topk_groups < r.groups:  # all groups kept = no group limit (llama.cpp wants used < count)
        w.add_expert_group_count(r.groups)
        w.add_expert_group_used_count(r.topk_groups)
    mscale_all = _rope(c).get("mscale_all_dim")
    if _rope(c).get("rope_type") == "yarn" and mscale_all:
        w.add_rope_scaling_yarn_log_mul(0.1 * float(mscale_all))  # llama.cpp divides it by 0.1 again


def _hp_openai_moe(w, adapter, c):
    _gqa_heads(w, adapter, c)
    w.add_feed_forward_length(adapter.expert_intermediate)
    w.add_expert_feed_forward_length(adapter.expert_intermediate)
    w.add_sliding_window(int(c["sliding_window"]))


def _no_refusal(adapter, c):
    return None


def _refuse_qwen2moe(adapter, c):
    if c.get("norm_topk_prob"):
        return (
            "llama.cpp's qwen2moe graph does not renormalise the top-k routing weights, but this checkpoint's "
            "config.json sets norm_topk_prob: true"
        )
    return _refuse_dense_layers(adapter, c)


def _refuse_dense_layers(adapter, c):
    if adapter.dense_layers:
        return (
            f"llama.cpp's {GRAPHS[adapter.model_type].arch} graph needs every layer to be an MoE layer; this "
            f"checkpoint has dense layers (mlp_only_layers / decoder_sparse_step)"
        )
    return None


def _refuse_qwen3moe(adapter, c):
    if not adapter.routing.normalize_topk:
        return (
            "llama.cpp's qwen3moe graph always renormalises the top-k routing weights, but this checkpoint's "
            "config.json sets norm_topk_prob: false"
        )
    return _refuse_dense_layers(adapter, c)


def _refuse_olmoe(adapter, c):
    if adapter.routing.normalize_topk:
        return (
            "llama.cpp's olmoe graph does not renormalise the top-k routing weights, but this checkpoint's "
            "config.json sets norm_topk_prob: true"
        )
    if c.get("clip_qkv"):
        return "llama.cpp's olmoe graph does not clip q / k / v, but this checkpoint's config.json sets clip_qkv"
    return None


def _refuse_deepseek2(adapter, c):
    moe = adapter.moe_layers
    if moe != list(range(moe[0] if moe else adapter.num_layers, adapter.num_layers)):
        return (
            "llama.cpp's deepseek2 graph has dense layers only before the first MoE layer "
            "(leading_dense_block_count); this checkpoint's moe_layer_freq interleaves them"
        )
    if c.get("rope_interleave") is False:
        return (
            "llama.cpp's deepseek2 graph rotates interleaved rope pairs (DeepSeek's own weight order), but this "
            "checkpoint's config.json sets rope_interleave: false"
        )
    r = adapter.routing
    if adapter.model_type == "deepseek_v2":
        if r.groups > 1 and r.topk_groups < r.groups:
            return (
                "llama.cpp's deepseek2 graph ranks expert groups by the sum of their two best scores (DeepSeek-V3's "
                "rule), but this DeepSeek-V2 checkpoint routes with group_limited_greedy (the best score)"
            )
        if r.normalize_topk:
            return (
                "transformers' DeepSeek-V2 does not renormalise the top-k weights, but this checkpoint's "
                "config.json sets norm_topk_prob: true; the GGUF could not match it"
            )
    return None


def _refuse_openai_moe(adapter, c):
    if float(c.get("swiglu_limit", 7.0)) != 7.0 or float(c.get("swiglu_alpha", 1.702)) != 1.702:
        return "llama.cpp's openai-moe graph fixes SwiGLU's alpha 1.702 and limit 7.0; this config.json differs"
    types = c.get("layer_types") or []
    want = ["sliding_attention" if L % 2 == 0 else "full_attention" for L in range(adapter.num_layers)]
    if types and list(types) != want:
        return (
            "llama.cpp's openai-moe graph puts sliding-window attention on even layers and full attention on odd "
            "ones; this config.json's layer_types differ"
        )
    return None


@dataclass(frozen=True)
class Graph:
    """How one HF architecture is written for one llama.cpp graph."""

    arch: str  # general.architecture
    names: list  # (HF regex, [(GGUF name template, transform or None)]): the first pattern that matches wins
    hparams: Callable  # (writer, adapter, config) -> None: the graph's own metadata
    refuses: Callable = _no_refusal  # (adapter, config) -> why llama.cpp could not run it, or None


def _one(pattern, repl, fn=None):
    return (pattern, [(repl, fn)])


GRAPHS: dict[str, Graph] = {
    "qwen2_moe": Graph(
        "qwen2moe",
        [
            _one(_L + r"mlp\.shared_expert\.(gate|up|down)_proj\.weight", r"blk.\1.ffn_\2_shexp.weight"),
            _one(_L + r"mlp\.shared_expert_gate\.weight", r"blk.\1.ffn_gate_inp_shexp.weight", _flat),
            *[_one(p, r) for p, r in _COMMON],
        ],
        _hp_qwen2moe,
        _refuse_qwen2moe,
    ),
    "qwen3_moe": Graph("qwen3moe", [_one(p, r) for p, r in _COMMON], _hp_qwen3moe, _refuse_qwen3moe),
    "olmoe": Graph("olmoe", [_one(p, r) for p, r in _COMMON], _hp_llama, _refuse_olmoe),
    "mixtral": Graph(
        "llama",
        [
            _one(_L + r"self_attn\.q_proj\.weight", r"blk.\1.attn_q.weight", _permute_q),
            _one(_L + r"self_attn\.k_proj\.weight", r"blk.\1.attn_k.weight", _permute_k),
            _one(_L + r"block_sparse_moe\.gate\.weight", r"blk.\1.ffn_gate_inp.weight"),
            *[_one(p, r) for p, r in _COMMON],
        ],
        _hp_llama,
    ),
    "gpt_oss": Graph(
        "gpt-oss",
        [
            _one(_L + r"post_attention_layernorm\.weight", r"blk.\1.post_attention_norm.weight"),
            _one(_L + r"self_attn\.sinks", r"blk.\1.attn_sinks.weight"),
            _one(_L + r"mlp\.router\.(weight|bias)", r"blk.\1.ffn_gate_inp.\2"),
            (
                _L + r"mlp\.experts\.gate_up_proj_bias",
                [(r"blk.\1.ffn_gate_exps.bias", _even), (r"blk.\1.ffn_up_exps.bias", _odd)],
            ),
            _one(_L + r"mlp\.experts\.down_proj_bias", r"blk.\1.ffn_down_exps.bias"),
            *[_one(p, r) for p, r in _COMMON],
        ],
        _hp_openai_moe,
        _refuse_openai_moe,
    ),
}
_DEEPSEEK2 = Graph(
    "deepseek2",
    [
        _one(_L + r"self_attn\.q_a_proj\.weight", r"blk.\1.attn_q_a.weight"),
        _one(_L + r"self_attn\.q_b_proj\.weight", r"blk.\1.attn_q_b.weight"),
        _one(_L + r"self_attn\.(q_a|kv_a)_layernorm\.weight", r"blk.\1.attn_\2_norm.weight"),
        _one(_L + r"self_attn\.kv_a_proj_with_mqa\.weight", r"blk.\1.attn_kv_a_mqa.weight"),
        (_L + r"self_attn\.kv_b_proj\.weight", [(r"blk.\1.attn_k_b.weight", _k_b), (r"blk.\1.attn_v_b.weight", _v_b)]),
        _one(_L + r"mlp\.gate\.e_score_correction_bias", r"blk.\1.exp_probs_b.bias"),
        _one(_L + r"mlp\.shared_experts\.(gate|up|down)_proj\.weight", r"blk.\1.ffn_\2_shexp.weight"),
        _one(_L + r"mlp\.(gate|up|down)_proj\.weight", r"blk.\1.ffn_\2.weight"),
        *[_one(p, r) for p, r in _COMMON],
    ],
    _hp_deepseek2,
    _refuse_deepseek2,
)
GRAPHS["deepseek_v2"] = GRAPHS["deepseek_v3"] = _DEEPSEEK2
ARCHS = {mt: g.arch for mt, g in GRAPHS.items()}  # model_type -> llama.cpp architecture


def gguf_targets(model_type: str, hf_name: str) -> list[tuple[str, Callable | None]]:
    """The GGUF tensors one on-disk tensor becomes: [(GGUF name, transform or None)] ([] when none)."""
    for pattern, targets in GRAPHS[model_type].names:
        m = re.fullmatch(pattern, hf_name)
        if m:
            return [(m.expand(repl), fn) for repl, fn in targets]
    return []


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


def gguf_name(model_type: str, hf_name: str) -> str | None:
    targets = gguf_targets(model_type, hf_name)
    return targets[0][0] if len(targets) == 1 else None


def _ggml_type(spec):
    import gguf

    return gguf.GGMLQuantizationType[RAW_TYPES.get(spec.name, spec.name.upper())]


def stores_natively(spec) -> bool:
    """Whether GGUF holds this format's codes as they are: ggml block types, MXFP4."""
    return spec.is_ggml or spec.name in RAW_TYPES


def tied_output(names) -> str | None:
    """The checkpoint tensor written again as output.weight: the embeddings when `names` hold no
    lm_head.weight (tied; several llama.cpp loaders require output.weight), else None."""
    return None if "lm_head.weight" in names else "model.embed_tokens.weight"


def plain_type(role: str, ndim: int, float_type: str, types) -> str:
    """How a tensor written unquantized (the plan keeps it, or plans bf16) is stored: f32 | f16 | bf16 or
    the ggml type `types` ({GGUF name: type}) gives token_embd / output. `role`: the adapter's, lm_head
    for output.weight (also the tied copy); `ndim` of the tensor as written."""
    typed = types.get(_TYPED_ROLES.get(role)) if types else None
    if typed:
        return typed
    return "f32" if role in _F32_ROLES or ndim == 1 else float_type


def plain_nbytes(role: str, shape, float_type: str, types) -> int:
    """Bytes of a tensor written unquantized (plain_type), as the file holds them."""
    key = plain_type(role, len(shape), float_type, types)
    if key in _ELEMENT_BYTES:
        return _ELEMENT_BYTES[key] * math.prod(int(s) for s in shape)
    from moequant.formats import nbytes

    return nbytes(key, shape)


def _plain(t: torch.Tensor, key: str, name: str):
    """(numpy array, raw ggml type or None) of a tensor stored as plain_type `key`."""
    import gguf

    if key == "f32":
        return t.to(torch.float32).contiguous().numpy(), None
    if key == "f16":
        return t.to(torch.float16).contiguous().numpy(), None
    if key in FLOAT_TYPES:  # bf16: numpy has no bfloat16, so its raw bytes as ggml's BF16
        raw = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint8)  # last axis: 2 bytes each
        return raw, gguf.GGMLQuantizationType.BF16
    q = quantize_ggml(t.float(), key, name=name)
    return q.codes.numpy(), _ggml_type(q.spec)


def _mxfp4_blocks(codes: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """e2m1 codes [..., n] and e8m0 scales [..., n/32] -> ggml MXFP4 blocks uint8 [..., n/32 * 17]."""
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 32)
    packed = c[..., :16] | (c[..., 16:] << 4)
    blocks = torch.cat([scales.to(torch.uint8).unsqueeze(-1), packed], dim=-1)
    return blocks.reshape(*codes.shape[:-1], -1).numpy()


def _packed(q, rows=slice(None)):
    """(numpy blocks, raw ggml type) of a QuantizedTensor GGUF stores natively, rows [..., rows, :] only."""
    if q.spec.is_ggml:
        return q.codes[..., rows, :].cpu().contiguous().numpy(), _ggml_type(q.spec)
    return _mxfp4_blocks(q.codes[..., rows, :].cpu(), q.scales[..., rows, :].cpu()), _ggml_type(q.spec)


def _rows(q, order: torch.Tensor):
    """QuantizedTensor q with its rows (output channels) in `order` (packed ggml rows are independent)."""
    from moequant.formats import QuantizedTensor

    return QuantizedTensor(q.spec, q.shape, q.codes[order], None if q.scales is None else q.scales[order])


def check_gguf(ckpt, adapter, items: dict) -> None:
    """Refuse, before any work, what llama.cpp could not run as planned."""
    mt = adapter.model_type
    if mt not in GRAPHS:
        raise UserError(
            f"GGUF export supports {', '.join(sorted(GRAPHS))} (llama.cpp's "
            f"{', '.join(sorted(set(ARCHS.values())))} graphs); this checkpoint is {mt}."
        )
    c = ckpt.config
    graph = GRAPHS[mt]
    why = graph.refuses(adapter, c)
    if why:
        raise UserError(f"{why}; it cannot be exported to GGUF as is.")
    if c.get("sliding_window") and c.get("use_sliding_window"):
        raise UserError("GGUF export does not write sliding-window attention; config.json enables use_sliding_window.")
    tokenizer_pre(ckpt.directory)
    expert_names = _expert_names(adapter)
    for name, q in items.items():
        role = adapter.classify(name)
        if q.spec.quantized and not (q.spec.is_ggml or (stores_natively(q.spec) and name in expert_names)):
            raise UserError(
                f"the gguf layout holds ggml block types (q8_0 ... q2_k), MXFP4 routed experts or bf16; "
                f"tensor {name} is planned as {q.spec.key} (use target llama.cpp)."
            )
        if q.spec.quantized and (role.role in ("router", "shared_expert_gate", "norm") or len(q.shape) < 2):
            raise UserError(f"tensor {name} ({role.role}) stays unquantized in GGUF; it is planned as {q.spec.key}.")
        if q.spec.quantized and name not in expert_names:
            if reshaped_reason(mt, name):
                raise UserError(f"{reshaped_reason(mt, name)}; tensor {name} is planned as {q.spec.key} (keep it).")
            for out, shape in written_shapes(c, name, q.shape):
                check_shape(q.spec, shape, f"{out} (of {name})")
    for layer in adapter.moe_layers:
        for proj in adapter.projections:
            if adapter.fused_experts:
                q = items.get(adapter.expert_tensor_name(layer, 0, proj))
                keys = {q.spec.key if q is not None else "bf16"}
            else:
                keys = {
                    items[n].spec.key if n in items else "bf16"
                    for n in (adapter.expert_tensor_name(layer, e, proj) for e in range(adapter.num_experts))
                }
            if len(keys) > 1:
                raise UserError(
                    f"GGUF stacks the experts of a layer per projection into one tensor of one ggml type, but "
                    f"layer {layer} {proj} has {', '.join(sorted(keys))}; plan with target llama.cpp."
                )


def _expert_names(adapter) -> set:
    return {
        adapter.expert_tensor_name(L, e, p)
        for L in adapter.moe_layers
        for e in range(adapter.num_experts)
        for p in adapter.projections
    }


def _tokenizer_json(directory) -> dict:
    path = Path(directory) / "tokenizer.json"
    if not path.exists():
        raise UserError(f"GGUF export needs the tokenizer: {path} is missing.")
    return json.loads(path.read_text())


# Pre-tokenizers llama.cpp knows (src/llama-vocab.cpp), by the split regex of tokenizer.json's
# Sequence[Split(Isolated), ByteLevel(use_regex false)]: Qwen2 / Qwen2.5 / Qwen3 (and their MoEs).
_SPLIT_PRES = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
}
_NORMALIZERS_IGNORED = ({"type": "NFC"},)  # Qwen's; llama.cpp does not normalise (as its own converter writes it)


def tokenizer_pre(directory) -> str:
    """llama.cpp's tokenizer.ggml.pre for this tokenizer.json (a byte-level BPE), or a UserError."""
    tok = _tokenizer_json(directory)
    model = tok.get("model", {})
    pre = tok.get("pre_tokenizer") or {}
    norm = tok.get("normalizer")
    name = None
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space") and not norm:
        name = "gpt-2"
    parts = pre.get("pretokenizers") or []
    if (
        pre.get("type") == "Sequence"
        and len(parts) == 2
        and parts[0].get("type") == "Split"
        and parts[0].get("behavior") == "Isolated"
        and not parts[0].get("invert")
        and parts[1].get("type") == "ByteLevel"
        and not parts[1].get("use_regex", True)
        and not parts[1].get("add_prefix_space")
        and (norm is None or norm in _NORMALIZERS_IGNORED)
    ):
        name = _SPLIT_PRES.get((parts[0].get("pattern") or {}).get("Regex"))
    if model.get("type") != "BPE" or name is None:
        raise UserError(
            f"GGUF export writes byte-level BPE tokenizers with GPT-2's or Qwen2's pre-tokenizer; "
            f"{directory}/tokenizer.json has model {model.get('type')!r} with pre-tokenizer "
            f"{pre.get('type')!r}{' and a normalizer' if norm else ''}."
        )
    return name


def add_tokenizer(writer, directory) -> None:
    import gguf

    tok = _tokenizer_json(directory)
    vocab = tok["model"]["vocab"]
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    n = max(max(vocab.values()), max(added, default=-1)) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [gguf.TokenType.UNUSED] * n
    for text, i in vocab.items():
        tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for i, a in added.items():
        tokens[i] = a["content"]
        types[i] = gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer_pre(directory))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    cfg_path = Path(directory) / "tokenizer_config.json"
    tcfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    ids = {a["content"]: i for i, a in added.items()}
    ids.update({t: i for t, i in vocab.items() if t not in ids})

    def token_id(key):
        t = tcfg.get(key)
        t = t.get("content") if isinstance(t, dict) else t
        return ids.get(t)

    for key, add in (
        ("bos_token", writer.add_bos_token_id),
        ("eos_token", writer.add_eos_token_id),
        ("pad_token", writer.add_pad_token_id),
    ):
        if token_id(key) is not None:
            add(token_id(key))
    single = (tok.get("post_processor") or {}).get("single") or []  # a template that starts with a special token
    writer.add_add_bos_token(bool(single) and "SpecialToken" in single[0])
    writer.add_add_eos_token(False)


_FTYPES = {
    "q4_0": 2,
    "q4_1": 3,
    "q8_0": 7,
    "q5_0": 8,
    "q5_1": 9,
    "q2_k": 10,
    "q3_k": 12,
    "q4_k": 15,
    "q5_k": 17,
    "q6_k": 18,
    "iq2_xxs": 19,
    "iq2_xs": 20,
    "iq3_xxs": 23,
    "iq3_s": 26,
    "iq2_s": 28,
    "iq4_xs": 30,
    "mxfp4": 38,
}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*


def _file_type(items: dict, float_type: str) -> int:
    """general.file_type: the most common stored type among the weights (llama.cpp's LLAMA_FTYPE)."""
    from collections import Counter

    counts = Counter()
    for q in items.values():
        if q.spec.quantized:
            counts[q.spec.name] += int(np.prod(q.shape))
    if counts:
        return _FTYPES[counts.most_common(1)[0][0]]
    return {"f32": 0, "f16": 1, "bf16": 32}[float_type]


class _Lazy:
    """A tensor gguf-py writes when its turn comes: shape / dtype / nbytes known ahead, data made in tofile()."""

    def __init__(self, shape, dtype, nbytes: int, make: Callable):
        self.shape, self.dtype, self.nbytes, self._make = tuple(shape), np.dtype(dtype), int(nbytes), make

    def tofile(self, fp) -> None:
        arr = np.ascontiguousarray(self._make())
        if arr.nbytes != self.nbytes or arr.dtype != self.dtype:
            raise RuntimeError(
                f"GGUF tensor data ({arr.dtype}, {arr.nbytes} bytes) differs from its header "
                f"({self.dtype}, {self.nbytes} bytes)"
            )
        arr.tofile(fp)


def _plain_meta(shape, key: str):
    """(numpy shape, numpy dtype, raw ggml type or None) of a tensor of `shape` stored as plain_type `key`."""
    import gguf

    shape = tuple(int(s) for s in shape)
    if key == "f32":
        return shape, np.float32, None
    if key == "f16":
        return shape, np.float16, None
    if key in FLOAT_TYPES:
        return (*shape[:-1], 2 * shape[-1]), np.uint8, gguf.GGMLQuantizationType.BF16
    from moequant.formats import nbytes

    spec = get_format(key)
    return (*shape[:-1], nbytes(key, (1, shape[-1]))), np.uint8, _ggml_type(spec)


def export_gguf(
    ckpt,
    adapter,
    items: dict,
    out_dir,
    *,
    kept: dict | None = None,
    float_type: str = "bf16",
    info: dict | None = None,
    max_shard_bytes: int = 0,
    types: dict | None = None,
) -> Path:
    """Write out_dir/model.gguf (split as llama.cpp names splits when max_shard_bytes > 0 and exceeded)."""
    import gguf

    if float_type not in FLOAT_TYPES:
        raise UserError(f"gguf float type {float_type!r} is not supported; accepted: {', '.join(FLOAT_TYPES)}.")
    check_gguf(ckpt, adapter, items)
    types = {k: v for k, v in (types or {}).items() if v}  # GGUF name -> ggml type, e.g. output.weight: q6_k
    unknown = sorted(set(types) - {"token_embd.weight", "output.weight"})
    if unknown:
        raise UserError(f"gguf types can be set for token_embd.weight and output.weight, not {unknown[0]}.")
    for t in types.values():
        get_format(t)
    kept = kept or {}
    read = lambda n: kept[n] if n in kept else ckpt.get(n)  # noqa: E731
    mt = adapter.model_type
    graph = GRAPHS[mt]
    c = ckpt.config
    expert_names = _expert_names(adapter)
    plan_of = {}  # GGUF name -> (HF name, transform)
    for name in ckpt.keys():
        if name in expert_names:
            continue
        targets = gguf_targets(mt, name)
        if not targets:
            raise UserError(f"tensor {name} of {ckpt.path} has no GGUF counterpart in llama.cpp's {graph.arch} graph.")
        for target, fn in targets:
            plan_of[target] = (name, fn)
    copied = tied_output(ckpt.keys())
    if copied:
        plan_of["output.weight"] = (copied, None)

    def plain_key(hf_name, out_name, ndim):
        if out_name.endswith(".bias"):  # gpt-oss's expert biases are 2-D; ggml adds biases in F32 only
            return "f32"
        role = "lm_head" if out_name == "output.weight" else adapter.classify(hf_name).role
        return plain_type(role, ndim, float_type, types)

    def tensor_for(out_name: str) -> _Lazy:
        hf_name, fn = plan_of[out_name]
        q = items.get(hf_name) if out_name != "output.weight" or hf_name == "lm_head.weight" else None
        if q is not None and q.spec.quantized and fn in SPLITS:
            return _split(q, fn, lambda: read(hf_name), out_name)
        if q is not None and q.spec.quantized:  # packed blocks, one-to-one or rows reordered (check_gguf)
            arr, raw = _packed(q if fn is None else _rows(q, fn(torch.arange(q.shape[0]), c)))
            return _Lazy(arr.shape, arr.dtype, arr.nbytes, lambda: arr), raw
        source = (lambda: q.codes) if q is not None else (lambda: read(hf_name))
        shape = tuple(ckpt.shape(hf_name)) if q is None else tuple(q.shape)
        if fn is not None:
            shape = tuple(fn(torch.empty(shape, device="meta"), c).shape)
        key = plain_key(hf_name, out_name, len(shape))
        np_shape, dtype, raw = _plain_meta(shape, key)

        def make():
            t = source()
            t = fn(t, c) if fn is not None else t
            return _plain(t, key, out_name)[0]

        return _Lazy(np_shape, dtype, np.dtype(dtype).itemsize * math.prod(np_shape), make), raw

    def _split(q, fn, original, out_name):
        """One part of a tensor llama.cpp's graph splits (kv_b_proj -> attn_k_b / attn_v_b) in q's type: rows
        the part keeps along the same axis are q's own packed rows (its codes, GPTQ's where it ran); a
        transposed part (attn_k_b) is quantized here from the original weights along its new rows (no
        statistics of its input, q_nope, exist: the type's own scale search)."""
        rows = fn(torch.arange(q.shape[0]).unsqueeze(-1), c)
        if rows.shape[-1] == 1:  # rows of q, reordered: [..., rows, 1] of row indices
            order = rows[..., 0]
            arr = q.codes[order.reshape(-1)].cpu().reshape(*order.shape, q.codes.shape[-1]).contiguous().numpy()
            return _Lazy(arr.shape, arr.dtype, arr.nbytes, lambda: arr), _ggml_type(q.spec)
        shape = tuple(fn(torch.empty(tuple(q.shape), device="meta"), c).shape)
        np_shape, dtype, raw = _plain_meta(shape, q.spec.key)
        return _Lazy(
            np_shape,
            dtype,
            np.dtype(dtype).itemsize * math.prod(np_shape),
            lambda: _plain(fn(original(), c), q.spec.key, out_name)[0],
        ), raw

    class _Source:  # the checkpoint as adapters read it, kept tensors first
        def get(self, n, device=None):  # read_experts passes a device; GGUF is written from the host
            return read(n)

        def get_slice(self, n):
            return read(n)

    def stored(hf_name):
        """The source's own codes of a tensor nobody replaces, when GGUF stores its format as it is (gpt-oss's
        MXFP4 experts): written as they are, never dequantized and requantized."""
        enc = ckpt.encodings.get(hf_name)
        if enc is None or hf_name in kept or hf_name in items or not stores_natively(enc.spec):
            return None
        from moequant.io import dequant

        dequant.decode(enc, ckpt.read_stored)  # its scales checked and its values finite, or one sentence
        return dequant._quantized(enc, {role: ckpt.read_stored(n) for role, n in enc.parts.items()})

    def experts_for(layer: int, proj: str) -> tuple[_Lazy, object]:
        name = f"blk.{layer}.ffn_{proj}_exps.weight"
        if adapter.fused_experts:  # gpt-oss: gate / up interleaved rows of one [E, 2I, H] tensor
            fused = adapter.expert_tensor_name(layer, 0, proj)
            q = items.get(fused) or stored(fused)
            rows = slice(None) if proj == "down" else slice(0 if proj == "gate" else 1, None, 2)
            if q is not None and q.spec.quantized:
                arr, raw = _packed(q, rows)
                return _Lazy(arr.shape, arr.dtype, arr.nbytes, lambda: arr), raw
            make_stacked = (
                (lambda: q.codes[:, rows]) if q is not None else (lambda: adapter.read_experts(_Source(), layer, proj))
            )
        else:
            names = [adapter.expert_tensor_name(layer, e, proj) for e in range(adapter.num_experts)]
            if names[0] in items and items[names[0]].spec.quantized:
                stacked = torch.stack([items[n].codes.cpu() for n in names]) if items[names[0]].spec.is_ggml else None
                if stacked is not None:
                    arr = stacked.numpy()
                else:
                    from moequant.formats import stack_experts

                    arr, _ = _packed(stack_experts([items[n] for n in names]))
                return _Lazy(arr.shape, arr.dtype, arr.nbytes, lambda: arr), _ggml_type(items[names[0]].spec)
            make_stacked = lambda: torch.stack([items[n].codes if n in items else read(n) for n in names])  # noqa: E731
        shape = (adapter.num_experts, *adapter.expert_shape(proj))
        key = plain_type("routed_expert", 3, float_type, types)
        np_shape, dtype, raw = _plain_meta(shape, key)
        return _Lazy(
            np_shape,
            dtype,
            np.dtype(dtype).itemsize * math.prod(np_shape),
            lambda: _plain(make_stacked(), key, name)[0],
        ), raw

    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        writer = gguf.GGUFWriter(str(tmp / GGUF_FILE), graph.arch, split_max_size=max_shard_bytes)
        _add_common(writer, adapter, c)
        graph.hparams(writer, adapter, c)
        writer.add_file_type(_file_type(items, float_type))
        writer.add_quantization_version(2)
        add_tokenizer(writer, ckpt.directory)
        order = ["token_embd.weight", "output_norm.weight", "output.weight"]
        for L in range(adapter.num_layers):
            order += sorted(t for t in plan_of if t.startswith(f"blk.{L}."))
            if L in adapter.moe_layers:
                order += [f"blk.{L}.ffn_{p}_exps.weight" for p in adapter.projections]
        for target in order:
            m = re.fullmatch(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight", target)
            lazy, raw = experts_for(int(m[1]), m[2]) if m and target not in plan_of else tensor_for(target)
            writer.add_tensor_info(target, lazy.shape, lazy.dtype, lazy.nbytes, raw_dtype=raw)
            writer.tensors[-1][target].tensor = lazy  # written (made) in order by write_tensors_to_file
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        (tmp / EXPORT_INFO).write_text(json.dumps(info or {"layout": "gguf"}, indent=2) + "\n")
    return out_dir


_ROLES = [
    (r"token_embd\.", "embedding"),
    (r"output\.", "lm_head"),
    (r".*norm\.", "norm"),
    (r".*ffn_gate_inp_shexp\.", "shared_expert_gate"),
    (r".*(ffn_gate_inp|exp_probs_b)\.", "router"),
    (r".*ffn_(gate|up|down)\.", "dense_mlp"),
    (r".*_shexp\.", "shared_expert"),
    (r".*_exps\.", "routed_expert"),
    (r".*attn_", "attention"),
]


def gguf_bytes(path) -> dict:
    """The byte account of a GGUF file as `plan.memory.checkpoint_bytes` gives it for safetensors:
    bytes by role, per (layer, expert) (a stacked tensor's bytes split evenly: one type per tensor)."""
    from collections import defaultdict

    import gguf

    reader = gguf.GGUFReader(str(path))
    n_expert = next((int(f.parts[-1][0]) for k, f in reader.fields.items() if k.endswith(".expert_count")), 1)
    by_role, weights, experts = defaultdict(int), defaultdict(int), defaultdict(int)
    for t in reader.tensors:
        role = next(r for p, r in _ROLES + [(r"", "other")] if re.match(p, t.name))
        by_role[role] += int(t.n_bytes)
        weights[role] += int(t.n_elements)
        if role == "routed_expert":
            layer = int(t.name.split(".")[1])
            for e in range(n_expert):
                experts[(layer, e)] += int(t.n_bytes) // n_expert
    return {
        "by_role": dict(by_role),
        "weights_by_role": dict(weights),
        "experts": dict(experts),
        "fused_experts": {},
        "total": sum(by_role.values()),
    }


def write_imatrix(stats_dir, out_path) -> Path:
    """llama.cpp's imatrix GGUF from our calibration statistics, for llama-quantize / llama_model_quantize.

    Per routed-expert tensor `blk.N.ffn_{gate,up,down}_exps.weight`: `<name>.in_sum2` {n_in, n_expert}
    = Σ x² over the expert's statistic tokens and `<name>.counts` {1, n_expert} = those tokens (with
    all-experts coverage every token, so every expert has data; llama-imatrix sees only the routed
    ones). qwen2moe's shared-expert gate / up take the same input: written from the all-token
    statistics when calibration ran with all-experts coverage.
    """
    import gguf

    from moequant.calib.stats import load_stats

    stats = load_stats(stats_dir, with_hessians=False)
    out_path = Path(out_path)
    if out_path.suffix != ".gguf":
        raise UserError(f"the imatrix file {out_path} must end in .gguf (llama.cpp's GGUF imatrix format).")
    entries = {}
    for L, ls in sorted(stats.layers.items()):
        for group, projs in (("gate_up", ("gate", "up")), ("down", ("down",))):
            sq, n = ls.tensors.get(f"input.{group}.sq_mean"), ls.tensors.get(f"input.{group}.tokens")
            if sq is None or n is None:
                raise UserError(
                    f"the statistics in {stats_dir} hold no input.{group}.sq_mean for layer {L}; "
                    f"calibrate again with this version."
                )
            sums = (sq.double() * n.double()[:, None]).float()
            for p in projs:
                entries[f"blk.{L}.ffn_{p}_exps.weight"] = (sums, n.float())
        if stats.summary.get("all_experts") and stats.summary.get("model_type") == "qwen2_moe":
            sums, n = entries[f"blk.{L}.ffn_gate_exps.weight"]
            for p in ("gate", "up"):
                entries[f"blk.{L}.ffn_{p}_shexp.weight"] = (sums[:1], n[:1])
    dataset = stats.summary.get("fingerprint", {}).get("dataset", "moequant")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    writer = gguf.GGUFWriter(str(tmp), "imatrix")
    writer.add_type("imatrix")
    writer.add_array("imatrix.datasets", [str(dataset)])
    tokens = max(int(ls.tokens) for ls in stats.layers.values())
    writer.add_uint32("imatrix.chunk_count", 1)
    writer.add_uint32("imatrix.chunk_size", tokens)
    for name, (sums, n) in entries.items():
        writer.add_tensor(name + ".in_sum2", sums.numpy())  # numpy [E, n_in] = ggml {n_in, E}
        writer.add_tensor(name + ".counts", n.reshape(-1, 1).numpy())  # ggml {1, E}
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out_path)
    return out_path
