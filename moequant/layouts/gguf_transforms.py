"""The transforms of one HF tensor into what llama.cpp's graph reads (torch in, torch out; `c` is the text
config): q / k rows in llama's interleaved rope order, Qwen3.5's gated-delta-net value heads tiled by key head,
DeepSeek's kv_b_proj split per head, convolution kernels and per-head vectors reshaped, Mamba's -exp(A_log),
norms of 1 + weight. `ROW_ORDER`, `SPLITS` and `RESHAPES` say which of them packed ggml rows can take as they are
(moequant.layouts.gguf_graphs names which tensor of which architecture each applies to)."""

from __future__ import annotations

import torch


def _rope_permute(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF rotate-half row order -> llama.cpp's interleaved pairs, per head (rows of any width)."""
    r = rows.shape[0]
    return rows.reshape(n_head, 2, r // n_head // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def _permute_q(t, c):
    return _rope_permute(t, int(c["num_attention_heads"]))


def _permute_k(t, c):
    return _rope_permute(t, int(c.get("num_key_value_heads") or c["num_attention_heads"]))


def _v_heads_tiled(t, c, head_dim: int, start: int = 0):
    """Qwen3.5's gated-delta-net rows [start:] from grouped by key head (HF: each key head's value heads together)
    to tiled (llama.cpp's qwen35 / qwen35moe graphs broadcast key heads over value heads by ggml's tiled repeat):
    [K, V/K, head_dim] -> [V/K, K, head_dim]. A row order, so it holds for packed ggml rows too."""
    k_heads, v_heads = int(c["linear_num_key_heads"]), int(c["linear_num_value_heads"])
    v = t[start:]
    v = v.reshape(k_heads, v_heads // k_heads, head_dim, *v.shape[1:]).transpose(0, 1).reshape(v.shape)
    return torch.cat([t[:start], v]) if start else v.contiguous()


def _qkv_tiled(t, c):  # in_proj_qkv [q | k | v]: the value rows tiled
    return _v_heads_tiled(
        t, c, int(c["linear_value_head_dim"]), 2 * int(c["linear_num_key_heads"]) * int(c["linear_key_head_dim"])
    )


def _z_tiled(t, c):  # in_proj_z [V * head_v_dim]
    return _v_heads_tiled(t, c, int(c["linear_value_head_dim"]))


def _heads_tiled(t, c):  # in_proj_a / in_proj_b [V, hidden], dt_bias [V]: one row per value head
    return _v_heads_tiled(t, c, 1)


def _neg_exp_tiled(t, c):  # A_log [V] -> ssm_a
    return _neg_exp(_heads_tiled(t, c), c)


def _conv_tiled(t, c):  # conv1d over [q | k | v] channels: the value channels tiled, then _conv's shape
    qk = 2 * int(c["linear_num_key_heads"]) * int(c["linear_key_head_dim"])
    return _conv(_v_heads_tiled(t, c, int(c["linear_value_head_dim"]), qk), c)


def _out_tiled(t, c):  # out_proj [hidden, V * head_v_dim]: its input columns tiled (not a row order)
    return _v_heads_tiled(t.T, c, int(c["linear_value_head_dim"])).T.contiguous()


# transforms that only reorder rows: valid on packed ggml rows too
ROW_ORDER = (_permute_q, _permute_k, _qkv_tiled, _z_tiled, _heads_tiled)


def _kv_b(t, c):
    """kv_b_proj [n_head * (nope + v), kv_lora] -> [n_head, nope + v, kv_lora]."""
    return t.reshape(int(c["num_attention_heads"]), int(c["qk_nope_head_dim"]) + int(c["v_head_dim"]), -1)


def _k_b(t, c):  # attn_k_b: ggml {nope, kv_lora, n_head} = torch [n_head, kv_lora, nope]
    return _kv_b(t, c)[:, : int(c["qk_nope_head_dim"])].transpose(1, 2).contiguous()


def _v_b(t, c):  # attn_v_b: ggml {kv_lora, v_head, n_head} = torch [n_head, v_head, kv_lora]
    return _kv_b(t, c)[:, int(c["qk_nope_head_dim"]) :].contiguous()


def _first_half(t, c):  # GraniteMoeShared's shared_mlp.input_linear [2S, H]: gate rows, then up rows
    return t[: t.shape[0] // 2]


def _second_half(t, c):
    return t[t.shape[0] // 2 :]


SPLITS = (
    _k_b,
    _v_b,
    _first_half,
    _second_half,
)  # transforms whose parts GGUF quantizes as tensors of their own (export_gguf's _split)


def _even(t, c):  # gpt-oss gate_up bias [E, 2I]: gate = even columns
    return t[..., 0::2].contiguous()


def _odd(t, c):
    return t[..., 1::2].contiguous()


def _flat(t, c):  # qwen2moe's shared-expert gate [1, n_embd] -> llama.cpp's {n_embd}
    return t.reshape(-1)


def _conv(t, c):  # a depthwise conv1d [channels, 1, kernel] -> llama.cpp's {kernel, channels}
    return t.reshape(t.shape[0], t.shape[-1])


def _neg_exp(t, c):  # Mamba-style A_log -> llama.cpp's ssm_a = -exp(A_log)
    return -torch.exp(t.float())


def _plus_one(t, c):  # a norm that scales by 1 + weight (Qwen3-Next's) -> llama.cpp's plain weight
    return t.float() + 1


def _heads_col(t, c):  # Mamba-2's per-head A / D [n_head] -> llama.cpp's {1, n_head}
    return t.reshape(-1, 1)


def _neg_exp_col(t, c):
    return _heads_col(_neg_exp(t, c), c)


def _grouped(t, c):  # Mamba-2's gated norm [d_inner] -> llama.cpp's {d_inner / n_groups, n_groups}
    return t.reshape(int(c.get("n_groups") or c.get("mamba_n_groups") or 1), -1)  # Granite's key: mamba_n_groups


RESHAPES = (
    _flat,
    _conv,
    _heads_col,
    _grouped,
)  # transforms that only reshape: valid on packed rows, undone by a reshape
