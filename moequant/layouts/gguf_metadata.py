"""The metadata llama.cpp's graphs read and the configs they cannot follow, per architecture: the `hparams` and
`refuses` functions of gguf_graphs.py's `Graph`s (one `hp_*` / `refuse_*` per graph that reads more than its
neighbours; `hp_moe` is the newer graphs' common MoE keys). Facts from the llama.cpp that llama-cpp-python 0.3.36
vendors: gguf_graphs.py's docstring. A refusal names llama.cpp's graph as `{arch}`, which gguf_graphs fills in."""

from __future__ import annotations


def add_common_metadata(w, adapter, c: dict) -> None:
    """Keys every graph reads; head / expert widths are each graph's own."""
    w.add_name(str(c.get("_name_or_path") or adapter.model_type))
    w.add_context_length(int(c.get("max_position_embeddings", 4096)))
    w.add_embedding_length(adapter.hidden)
    w.add_block_count(adapter.num_layers)
    w.add_head_count(int(c["num_attention_heads"]))
    w.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", c.get("norm_eps", c.get("layer_norm_epsilon", 1e-6)))))
    w.add_expert_count(adapter.num_experts)
    w.add_expert_used_count(adapter.top_k)
    w.add_vocab_size(int(c["vocab_size"]))
    rope = rope_parameters(c)
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


def rope_parameters(c: dict, layer_type: str = "full_attention") -> dict:
    """The rope of one kind of layer: transformers nests it by layer type where the kinds differ (MiMo-V2-Flash,
    Gemma-4: its full layers' rope is the one llama.cpp's converter reads)."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    return rope[layer_type] if isinstance(rope.get(layer_type), dict) else rope


def gqa_heads(w, adapter, c: dict, rotary: float = 1.0, kv_heads=None) -> None:
    n_head = int(c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or adapter.hidden // n_head)
    w.add_head_count_kv(kv_heads if kv_heads is not None else int(c.get("num_key_value_heads") or n_head))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(int(head_dim * rotary))


def hp_llama(w, adapter, c):
    gqa_heads(w, adapter, c)
    w.add_feed_forward_length(int(c.get("intermediate_size", adapter.expert_intermediate)))


def hp_qwen2moe(w, adapter, c):
    hp_llama(w, adapter, c)
    w.add_expert_feed_forward_length(adapter.expert_intermediate)
    w.add_expert_shared_feed_forward_length(adapter.shared_intermediate)


def hp_qwen3moe(w, adapter, c):
    hp_llama(w, adapter, c)
    w.add_expert_feed_forward_length(adapter.expert_intermediate)


def hp_qwen3vlmoe(w, adapter, c):
    """Qwen3-VL-MoE's text model: qwen3moe's keys, M-RoPE's sections (four, zero-padded; a text token has one
    position in each) and the vision tower's deepstack layer count (llama.cpp's input embedding is that many times
    wider)."""
    hp_qwen3moe(w, adapter, c)
    w.add_rope_dimension_sections(([int(s) for s in rope_parameters(c)["mrope_section"]] + [0, 0, 0, 0])[:4])
    w.add_num_deepstack_layers(len((c.get("vision_config") or {}).get("deepstack_visual_indexes") or []))


def hp_granite(w, adapter, c, kv_heads=None):
    """GraniteMoe(Shared): llama's keys with the expert width as the feed-forward length (the graph's n_ff), head
    width hidden / heads (llama.cpp's converter ignores head_dim), the four multipliers as llama.cpp's scales and the
    shared expert's width."""
    gqa_heads(w, adapter, {k: v for k, v in c.items() if k != "head_dim"}, kv_heads=kv_heads)
    w.add_feed_forward_length(adapter.expert_intermediate)
    w.add_attention_scale(float(c["attention_multiplier"]))
    w.add_embedding_scale(float(c["embedding_multiplier"]))
    w.add_residual_scale(float(c["residual_multiplier"]))
    w.add_logit_scale(float(c["logits_scaling"]))
    if c.get("shared_intermediate_size"):  # GraniteMoeShared's shared_mlp (a width of 0: none)
        w.add_expert_shared_feed_forward_length(int(c["shared_intermediate_size"]))


def granite_hybrid_attention(c) -> list[bool]:
    """GraniteMoeHybrid's layers: True where attention, False where Mamba-2 (layer_types; the hub's own config.json
    spells them "attention" / "mamba", transformers 5.x "full_attention" / "linear_attention")."""
    return [kind in ("attention", "full_attention") for kind in c["layer_types"]]


def hp_granite_hybrid(w, adapter, c):
    """GraniteMoeHybrid (Granite-4.0-H): Granite's scales and shared expert, key / value heads on the attention layers
    only, Mamba-2's sizes under its `mamba_` keys (time-step rank = heads, as llama.cpp's converter writes it), and
    rope switched off as transformers runs it (llama.cpp's graph ropes unless rope.scaling.finetuned is false)."""
    n_kv = int(c.get("num_key_value_heads") or c["num_attention_heads"])
    hp_granite(w, adapter, c, kv_heads=[n_kv if attention else 0 for attention in granite_hybrid_attention(c)])
    w.add_rope_scaling_finetuned(c.get("position_embedding_type") == "rope")
    w.add_ssm_conv_kernel(int(c["mamba_d_conv"]))
    w.add_ssm_state_size(int(c["mamba_d_state"]))
    w.add_ssm_group_count(int(c.get("mamba_n_groups") or 1))
    w.add_ssm_inner_size(int(c["mamba_expand"]) * adapter.hidden)
    w.add_ssm_time_step_rank(int(c["mamba_n_heads"]))


def hp_deepseek2(w, adapter, c, kv_heads=1):
    import gguf

    kv_lora, rope, nope = int(c["kv_lora_rank"]), int(c["qk_rope_head_dim"]), int(c["qk_nope_head_dim"])
    w.add_head_count_kv(kv_heads)  # MLA runs as MQA over the compressed KV
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
    mscale_all = rope_parameters(c).get("mscale_all_dim")
    if rope_parameters(c).get("rope_type") == "yarn" and mscale_all:
        w.add_rope_scaling_yarn_log_mul(0.1 * float(mscale_all))  # llama.cpp divides it by 0.1 again


def hp_glm_dsa(w, adapter, c):
    """GLM-5 (glm-dsa): deepseek2's MLA and MoE keys, the lightning indexer's sizes and top-k, and which layers run
    their own indexer (`indexer.types`, true = full; a shared layer reuses the last full layer's top-k)."""
    hp_deepseek2(w, adapter, c)
    d = {**adapter.config, **c}  # transformers' defaults too: indexer_types from index_topk_freq / _pattern if unset
    w.add_indexer_head_count(int(d["index_n_heads"]))
    w.add_indexer_key_length(int(d["index_head_dim"]))
    w.add_indexer_top_k(int(d["index_topk"]))
    types = d.get("indexer_types") or ["full"] * adapter.num_layers
    w.add_array(f"{w.arch}.attention.indexer.types", [t == "full" for t in types])  # gguf-py 0.19 has no helper


def refuse_indexer_head(adapter, c):
    """llama.cpp rotates the indexer's queries and keys by an orthonormal Hadamard matrix as wide as the largest power
    of two (64 at least) dividing the head, multiplied with the whole head: only a power-of-two head of 64 or more
    fits (GLM-5's is 128); the rotation leaves the indexer's scores as transformers computes them."""
    head = int({**adapter.config, **c}.get("index_head_dim") or 0)
    if head < 64 or head & (head - 1):
        return (
            "llama.cpp's {arch} graph rotates the indexer's heads by a Hadamard matrix whose width must be a power of "
            f"two of at least 64 (GLM-5's index_head_dim is 128), but this checkpoint's index_head_dim is {head}"
        )
    return None


def hp_kimi_linear(w, adapter, c):
    """Kimi-Linear: deepseek2's MLA and MoE keys (its MLA has no rope: the rope part is attended unrotated), one
    key / value head on the full-attention layers and none on the KDA ones (llama.cpp's recurrent layers), the KDA
    head width and its short convolution's kernel."""
    hp_deepseek2(w, adapter, c, [1 if t == "full_attention" else 0 for t in c["layer_types"]])
    w.add_ssm_conv_kernel(int(c["linear_conv_kernel_dim"]))
    w.add_kda_head_dim(int(c["linear_head_dim"]))


def refuse_kimi_linear(adapter, c):
    heads, linear = int(c["num_attention_heads"]), int(c["linear_num_heads"])
    if linear != heads:
        return (
            f"llama.cpp's kimi-linear graph gives the KDA layers as many heads as the attention layers (Kimi-Linear's "
            f"own layout), but this checkpoint's config.json has linear_num_heads {linear} and {heads} attention heads"
        )
    # config.json's own names (transformers' aliases norm_topk_prob / n_group / topk_group)
    if not c.get("moe_renormalize", c.get("norm_topk_prob", True)):
        return (
            "llama.cpp's kimi-linear graph always renormalises the top-k routing weights, but this checkpoint's "
            "config.json sets moe_renormalize: false"
        )
    groups = int(c.get("num_expert_group", c.get("n_group")) or 1)
    if groups > 1 and int(c.get("topk_group") or groups) < groups:
        return "llama.cpp's kimi-linear graph routes without expert groups, but this checkpoint's config.json uses them"
    return refuse_interleaved_dense(adapter, c)


def hp_openai_moe(w, adapter, c):
    gqa_heads(w, adapter, c)
    w.add_feed_forward_length(adapter.expert_intermediate)
    w.add_expert_feed_forward_length(adapter.expert_intermediate)
    w.add_sliding_window(int(c["sliding_window"]))


def hp_moe(w, adapter, c, kv_heads=None, routing=None):
    """The MoE keys llama.cpp's newer graphs (glm4moe, dots1, ernie4_5-moe, ...) read, from the adapter: each graph
    reads the ones it needs and ignores the rest. Rope over the first partial_rotary_factor of each head."""
    rotary = float(rope_parameters(c).get("partial_rotary_factor", c.get("partial_rotary_factor")) or 1.0)
    gqa_heads(w, adapter, c, rotary, kv_heads)
    dense = c.get("intermediate_size") or c.get("ffn_hidden_size") or adapter.expert_intermediate
    w.add_feed_forward_length(int(dense))
    w.add_expert_feed_forward_length(adapter.expert_intermediate)
    if adapter.num_shared_experts:
        w.add_expert_shared_count(adapter.num_shared_experts)
        w.add_expert_shared_feed_forward_length(adapter.shared_intermediate)
    w.add_leading_dense_block_count(adapter.moe_layers[0] if adapter.moe_layers else adapter.num_layers)
    r = routing or adapter.routing
    w.add_expert_weights_scale(float(r.scaling))
    w.add_expert_weights_norm(bool(r.normalize_topk))
    gating(w, r)


def hp_glm4v(w, adapter, c):
    """GLM-4.xV's text model: glm4moe's keys and M-RoPE's sections (four, zero-padded), as llama.cpp's converter writes
    them when the config names them (a text token has one position in each)."""
    hp_moe(w, adapter, c)
    if rope_parameters(c).get("mrope_section"):
        w.add_rope_dimension_sections(([int(s) for s in rope_parameters(c)["mrope_section"]] + [0, 0, 0, 0])[:4])


def hp_ernie(w, adapter, c):
    """ERNIE-4.5: MoE layers from moe_layer_start_index on, every moe_layer_interval-th (llama.cpp's
    interleave_moe_layer_step)."""
    hp_moe(w, adapter, c)
    w.add_interleave_moe_layer_step(int(c.get("moe_layer_interval") or 1))


def hp_lfm2(w, adapter, c):
    """LFM2-MoE: short-convolution layers are those with no key / value heads (a per-layer list), the kernel
    length as shortconv.l_cache; sigmoid routing (its expert_bias selects only)."""
    import dataclasses

    n_kv = int(c.get("num_key_value_heads") or c["num_attention_heads"])
    kv_heads = [n_kv if t != "conv" else 0 for t in c["layer_types"]]
    hp_moe(w, adapter, c, kv_heads, dataclasses.replace(adapter.routing, scoring="sigmoid"))
    w.add_shortconv_l_cache(int(c["conv_L_cache"]))


def hp_swa(w, adapter, c):
    """hp_moe with sliding-window attention on the layers config.json's layer_types say (llama.cpp's per-layer
    sliding_window_pattern)."""
    hp_moe(w, adapter, c)
    w.add_sliding_window(int(c["sliding_window"]))
    w.add_sliding_window_pattern([t == "sliding_attention" for t in c["layer_types"]])


def hp_mimo2(w, adapter, c):
    """MiMo-V2-Flash: sliding-window layers (layer_types) with twice the full layers' key / value heads (transformers'
    rule; a per-layer list) and their own rope base, values narrower than keys (v_head_dim), rope over
    partial_rotary_factor of each head, the value scale as attention.value_scale (llama.cpp scales the attention's
    output by it: the same, it is linear); dense layers are those without a router."""
    kinds, n_kv, head_dim = c["layer_types"], int(c["num_key_value_heads"]), int(c["head_dim"])
    w.add_head_count_kv([2 * n_kv if t == "sliding_attention" else n_kv for t in kinds])
    w.add_key_length(head_dim)
    w.add_value_length(int(c["v_head_dim"]))
    w.add_rope_dimension_count(int(head_dim * float(rope_parameters(c).get("partial_rotary_factor", 1.0))))
    w.add_rope_freq_base_swa(float(rope_parameters(c, "sliding_attention")["rope_theta"]))
    w.add_feed_forward_length(int(c["intermediate_size"]))
    w.add_expert_feed_forward_length(adapter.expert_intermediate)
    w.add_sliding_window(int(c["sliding_window"]))
    w.add_sliding_window_pattern([t == "sliding_attention" for t in kinds])
    gating(w, adapter.routing)
    if c.get("attention_value_scale") is not None:  # gguf-py 0.19 has no helper for it
        w.add_float32(f"{w.arch}.attention.value_scale", float(c["attention_value_scale"]))


def refuse_mimo2(adapter, c):
    full, swa = rope_parameters(c), rope_parameters(c, "sliding_attention")
    r = adapter.routing
    if {full.get("rope_type", "default"), swa.get("rope_type", "default")} != {"default"} or full.get(
        "partial_rotary_factor"
    ) != swa.get("partial_rotary_factor"):
        return (
            "llama.cpp's {arch} graph rotates every layer by one unscaled rope over the same share of each head, but "
            "this checkpoint's rope_parameters scale it or differ in partial_rotary_factor between layer types"
        )
    if c.get("attention_bias"):
        return (
            "llama.cpp's {arch} graph adds no q / k / v biases, but this checkpoint's config.json sets attention_bias"
        )
    if not r.normalize_topk or float(r.scaling) != 1.0:
        return (
            "llama.cpp's {arch} graph renormalises the top-k routing weights and does not scale them, but this "
            "checkpoint's config.json sets norm_topk_prob: false or a routed_scaling_factor other than 1"
        )
    return None


def hp_deepseek2ocr(w, adapter, c):
    """Unlimited-OCR's text model: DeepSeek-V2's MoE keys (softmax routing, scaled by routed_scaling_factor, never
    renormalised: transformers' DeepSeek-V2 router, whose config has no norm_topk_prob) over plain multi-head
    attention (llama.cpp's graph rotates whole heads, NEOX, at base 10000)."""
    import dataclasses

    hp_moe(w, adapter, c, routing=dataclasses.replace(adapter.routing, normalize_topk=False))


def refuse_deepseek2ocr(adapter, c):
    n_head, n_kv = int(c["num_attention_heads"]), int(c.get("num_key_value_heads") or c["num_attention_heads"])
    rope = rope_parameters(c)
    if n_kv != n_head or int(c.get("head_dim") or adapter.hidden // n_head) * n_head != adapter.hidden:
        return (
            "llama.cpp's {arch} graph runs multi-head attention over heads of hidden_size / num_attention_heads, but "
            f"this checkpoint has {n_kv} key / value heads for {n_head} query heads or heads of another width"
        )
    if float(rope.get("rope_theta", c.get("rope_theta", 10000.0))) != 10000.0 or rope.get("rope_type", "default") != (
        "default"
    ):
        return "llama.cpp's {arch} graph rotates by an unscaled rope of base 10000, but this checkpoint's rope differs"
    if c.get("attention_bias"):
        return (
            "llama.cpp's {arch} graph adds no q / k / v biases, but this checkpoint's config.json sets attention_bias"
        )
    if c.get("topk_method") == "group_limited_greedy" and adapter.routing.topk_groups < adapter.routing.groups:
        return (
            "llama.cpp's {arch} graph ranks expert groups by the sum of their two best scores, but this checkpoint "
            "routes with group_limited_greedy (the best score)"
        )
    return refuse_interleaved_dense(adapter, c)


def hp_afmoe(w, adapter, c):
    """AFMoE (Trinity): hp_moe's keys with its own routing (sigmoid scores, the top-k always renormalised, then times
    route_scale; expert_bias selects only) and the sliding window on the layers layer_types say."""
    import dataclasses

    routing = dataclasses.replace(
        adapter.routing, scoring="sigmoid", normalize_topk=True, scaling=float(c.get("route_scale") or 1.0)
    )
    hp_moe(w, adapter, c, routing=routing)
    if c.get("sliding_window"):
        w.add_sliding_window(int(c["sliding_window"]))
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c["layer_types"]])


def refuse_afmoe(adapter, c):
    want = ["full_attention" if (L + 1) % 4 == 0 else "sliding_attention" for L in range(adapter.num_layers)]
    if list(c.get("layer_types") or want) != want:
        return (
            "llama.cpp's afmoe graph skips rope on every fourth layer and ropes the others (Trinity's three sliding "
            "layers to one full one), but this checkpoint's layer_types differ"
        )
    if not c.get("mup_enabled"):
        return (
            "llama.cpp's afmoe graph always scales the embeddings by sqrt(hidden_size) (muP, as Trinity ships), but "
            "this checkpoint's config.json sets mup_enabled: false"
        )
    return refuse_interleaved_dense(adapter, c)


def hp_qwen3next(w, adapter, c):
    """Qwen3-Next: qwen2moe's keys, rope over partial_rotary_factor of each head, the gated-delta-net sizes as
    llama.cpp's ssm keys and a full-attention layer every full_attention_interval layers."""
    hp_moe(w, adapter, c)
    w.add_ssm_conv_kernel(int(c["linear_conv_kernel_dim"]))
    w.add_ssm_state_size(int(c["linear_key_head_dim"]))
    w.add_ssm_group_count(int(c["linear_num_key_heads"]))
    w.add_ssm_time_step_rank(int(c["linear_num_value_heads"]))
    w.add_ssm_inner_size(int(c["linear_value_head_dim"]) * int(c["linear_num_value_heads"]))
    w.add_full_attention_interval(full_attention_interval(c))
    if c.get("layer_types"):  # which layers are linear attention, read before the interval (gguf-py 0.19 has no helper)
        w.add_array(f"{w.arch}.attention.recurrent_layers", [t == "linear_attention" for t in c["layer_types"]])


def full_attention_interval(c) -> int:
    types = c.get("layer_types") or []
    return types.index("full_attention") + 1 if "full_attention" in types else int(c.get("full_attention_interval", 4))


def refuse_qwen3next(adapter, c):
    n = full_attention_interval(c)
    want = ["full_attention" if (L + 1) % n == 0 else "linear_attention" for L in range(adapter.num_layers)]
    if list(c.get("layer_types") or want) != want:
        return (
            "llama.cpp's {arch} graph puts full attention on every "
            "full_attention_interval-th layer, but this checkpoint's layer_types differ"
        )
    return None


def hp_qwen35moe(w, adapter, c):
    """Qwen3.5 / 3.6-MoE's text model: Qwen3-Next's keys and interleaved M-RoPE's four sections (the config's,
    zero-padded, else [11, 11, 10, 0] as llama.cpp's converter writes when a checkpoint omits them; a text token has
    one position in each, so they do not change its logits)."""
    hp_qwen3next(w, adapter, c)
    sections = rope_parameters(c).get("mrope_section") or [11, 11, 10]
    w.add_rope_dimension_sections(([int(s) for s in sections] + [0, 0, 0, 0])[:4])


def hp_jamba(w, adapter, c):
    """Jamba: attention layers are those with key / value heads (a per-layer list, every attn_layer_period-th from
    attn_layer_offset), the others Mamba layers sized by the ssm keys; MoE layers are the ones holding a router."""
    n_kv = int(c.get("num_key_value_heads") or c["num_attention_heads"])
    period, offset = int(c["attn_layer_period"]), int(c["attn_layer_offset"])
    kv_heads = [n_kv if L % period == offset else 0 for L in range(adapter.num_layers)]
    gqa_heads(w, adapter, c, kv_heads=kv_heads)
    w.add_feed_forward_length(int(c["intermediate_size"]))
    w.add_ssm_conv_kernel(int(c["mamba_d_conv"]))
    w.add_ssm_inner_size(int(c["mamba_expand"]) * adapter.hidden)
    w.add_ssm_state_size(int(c["mamba_d_state"]))
    w.add_ssm_time_step_rank(int(c["mamba_dt_rank"]))


def hp_nemotron_h(w, adapter, c):
    """Nemotron-H: each layer is Mamba-2, attention, an MLP or an MoE (layers_block_type); attention layers are told
    by their key / value heads and MLP layers by their width (per-layer lists), the Mamba-2 sizes as the ssm keys."""
    kinds = c["layers_block_type"]
    n_kv = int(c.get("num_key_value_heads") or c["num_attention_heads"])
    ff = {"mlp": int(c["intermediate_size"]), "moe": adapter.expert_intermediate}
    hp_moe(w, adapter, c, kv_heads=[n_kv if k in ("attention", "full_attention") else 0 for k in kinds])
    w.add_feed_forward_length([ff.get(k, 0) for k in kinds])
    w.add_ssm_conv_kernel(int(c["conv_kernel"]))
    w.add_ssm_inner_size(int(c["mamba_num_heads"]) * int(c["mamba_head_dim"]))
    w.add_ssm_state_size(int(c["ssm_state_size"]))
    w.add_ssm_time_step_rank(int(c["mamba_num_heads"]))
    w.add_ssm_group_count(int(c.get("n_groups") or 1))
    w.add_layer_norm_eps(float(c.get("layer_norm_epsilon", 1e-5)))


def gating(w, r):
    import gguf

    w.add_expert_gating_func(
        gguf.ExpertGatingFuncType.SIGMOID if r.scoring == "sigmoid" else gguf.ExpertGatingFuncType.SOFTMAX
    )
    if r.groups > 1 and r.topk_groups < r.groups:  # all groups kept = no group limit (llama.cpp wants used < count)
        w.add_expert_group_count(r.groups)
        w.add_expert_group_used_count(r.topk_groups)


def no_refusal(adapter, c):
    return None


def refuse_qwen2moe(adapter, c):
    if c.get("norm_topk_prob"):
        return (
            "llama.cpp's qwen2moe graph does not renormalise the top-k routing weights, but this checkpoint's "
            "config.json sets norm_topk_prob: true"
        )
    return refuse_dense_layers(adapter, c)


def refuse_dense_layers(adapter, c):
    if adapter.dense_layers:
        return (
            "llama.cpp's {arch} graph needs every layer to be an MoE layer; this "
            "checkpoint has dense layers (mlp_only_layers / decoder_sparse_step)"
        )
    return None


def refuse_qwen3moe(adapter, c):
    if not adapter.routing.normalize_topk:
        return (
            "llama.cpp's qwen3moe graph always renormalises the top-k routing weights, but this checkpoint's "
            "config.json sets norm_topk_prob: false"
        )
    return refuse_dense_layers(adapter, c)


def refuse_qwen3vlmoe(adapter, c):
    sections = rope_parameters(c).get("mrope_section") or []
    half = int(c.get("head_dim") or adapter.hidden // int(c["num_attention_heads"])) // 2
    if sum(int(s) for s in sections) != half:
        return (
            "llama.cpp's qwen3vlmoe graph rotates by M-RoPE sections that together fill each head's rotary half "
            f"({half} frequencies), but this checkpoint's text config has mrope_section {sections or 'unset'}"
        )
    return refuse_qwen3moe(adapter, c)


def refuse_olmoe(adapter, c):
    if adapter.routing.normalize_topk:
        return (
            "llama.cpp's olmoe graph does not renormalise the top-k routing weights, but this checkpoint's "
            "config.json sets norm_topk_prob: true"
        )
    if c.get("clip_qkv"):
        return "llama.cpp's olmoe graph does not clip q / k / v, but this checkpoint's config.json sets clip_qkv"
    return None


def refuse_deepseek2(adapter, c):
    moe = adapter.moe_layers
    if moe != list(range(moe[0] if moe else adapter.num_layers, adapter.num_layers)):
        return (
            "llama.cpp's {arch} graph has dense layers only before the first MoE layer "
            f"(leading_dense_block_count), but this checkpoint's MoE layers are {moe}"
        )
    if c.get("rope_interleave") is False:
        return (
            "llama.cpp's {arch} graph rotates interleaved rope pairs (DeepSeek's own weight order), but this "
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


def refuse_openai_moe(adapter, c):
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


def refuse_interleaved_dense(adapter, c):
    moe = adapter.moe_layers
    if moe != list(range(moe[0] if moe else adapter.num_layers, adapter.num_layers)):
        return (
            f"llama.cpp's {{arch}} graph has dense layers only before the first MoE layer "
            f"(leading_dense_block_count), but this checkpoint's MoE layers are {moe}"
        )
    return None


def first(*checks):
    def refuses(adapter, c):
        return next((why for why in (check(adapter, c) for check in checks) if why), None)

    return refuses


def refuse_dots1(adapter, c):
    n_head, n_kv = int(c["num_attention_heads"]), int(c.get("num_key_value_heads") or c["num_attention_heads"])
    if n_kv != n_head:
        return (
            f"llama.cpp's dots1 graph takes as many key / value heads as query heads (dots.llm1's own attention), but "
            f"this checkpoint's config.json has {n_kv} key / value heads for {n_head} query heads"
        )
    return None


def refuse_ernie(adapter, c):
    end = c.get("moe_layer_end_index")
    if end is not None and 0 <= int(end) < adapter.num_layers - 1:
        return (
            "llama.cpp's ernie4_5-moe graph has MoE layers up to the last one, but this checkpoint's config.json "
            f"ends them at moe_layer_end_index {end}"
        )
    return None


def refuse_lfm2(adapter, c):
    if not c.get("tie_word_embeddings", True):
        return (
            "llama.cpp's lfm2moe graph computes the logits with the token embeddings (tied, as LFM2 ships), but this "
            "checkpoint's config.json sets tie_word_embeddings: false"
        )
    return None


def refuse_granite_hybrid(adapter, c):
    attention = granite_hybrid_attention(c)
    if all(attention):
        return (
            "llama.cpp's converter writes a GraniteMoeHybrid checkpoint without Mamba layers as its granitemoe graph, "
            "which GGUF export does not write for this family"
        )
    if c.get("position_embedding_type") == "rope":
        return (
            "llama.cpp's converter turns rope off for a GraniteMoeHybrid checkpoint with Mamba layers, but this "
            "checkpoint's config.json asks for rope (position_embedding_type)"
        )
    if int(c["mamba_expand"]) * adapter.hidden != int(c["mamba_n_heads"]) * int(c["mamba_d_head"]):
        return "llama.cpp's granitehybrid graph takes Mamba heads that fill mamba_expand x hidden_size"
    if c.get("mamba_proj_bias"):
        return "llama.cpp's granitehybrid graph has no bias for the Mamba layers' projections (mamba_proj_bias)"
    if (c.get("hidden_act") or "silu") != "silu":
        return f"llama.cpp's granitehybrid graph takes silu MLPs, not {c.get('hidden_act')}"
    return None


def refuse_nemotron_h(adapter, c):
    if "mlp" in c.get("layers_block_type", []):
        return (
            "llama.cpp's nemotron_h_moe graph takes Mamba-2, attention and MoE layers, but this checkpoint's "
            "layers_block_type has dense MLP layers"
        )
    return None


def gemma4_layers(c: dict) -> list[tuple[bool, int, int]]:
    """Gemma-4's layers as (sliding, head width, key / value heads): the sliding ones the config's own, the full ones
    as per_layer_config overrides them (global_head_dim, num_global_key_value_heads as transformers derives them)."""
    overrides = {int(k): v for k, v in (c.get("per_layer_config") or {}).items()}
    layers = []
    for L, kind in enumerate(c["layer_types"]):
        own = overrides.get(L, {})
        layers.append(
            (
                kind == "sliding_attention",
                int(own.get("head_dim", c["head_dim"])),
                int(own.get("num_key_value_heads", c["num_key_value_heads"])),
            )
        )
    return layers


def hp_gemma4(w, adapter, c):
    """Gemma-4: sliding layers of head width head_dim (rope over all of it at their own theta), full layers of their
    own width (rope over all of it, rope_freqs leaving the proportional rope's unrotated part still), key / value heads
    per layer, the last num_kv_shared_layers layers reusing the last sliding and full layers' keys and values, the
    per-layer embeddings' width (0: none), a dense MLP beside the experts in every layer (twice as wide in the shared
    layers with use_double_wide_mlp) and the final logits' softcap."""
    layers = gemma4_layers(c)
    full = next(h for swa, h, _ in layers if not swa)
    swa = int(c["head_dim"])
    w.add_head_count_kv([n for _, _, n in layers])
    w.add_key_length(full)
    w.add_value_length(full)
    w.add_key_length_swa(swa)
    w.add_value_length_swa(swa)
    w.add_rope_dimension_count(full)
    w.add_rope_dimension_count_swa(swa)
    w.add_rope_freq_base_swa(float(c["rope_parameters"]["sliding_attention"]["rope_theta"]))
    w.add_sliding_window(int(c["sliding_window"]))
    w.add_sliding_window_pattern([s for s, _, _ in layers])
    shared = int(c.get("num_kv_shared_layers") or 0)
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(int(c.get("hidden_size_per_layer_input") or 0))
    ff, wide = int(c["intermediate_size"]), 2 if c.get("use_double_wide_mlp") else 1
    w.add_feed_forward_length([ff * wide if L >= len(layers) - shared else ff for L in range(len(layers))])
    w.add_expert_feed_forward_length(adapter.expert_intermediate)
    if c.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(float(c["final_logit_softcapping"]))


def refuse_gemma4(adapter, c):
    layers = gemma4_layers(c)  # one head width per kind of layer: transformers' own rope requires it
    rope = c.get("rope_parameters") or {}
    full, sliding = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    if sliding.get("rope_type") != "default" or full.get("rope_type") not in ("default", "proportional"):
        return (
            "llama.cpp's gemma4 graph rotates the sliding layers by default rope and the full ones by default or "
            f"proportional rope, but this checkpoint's rope_parameters have {sliding.get('rope_type')} and "
            f"{full.get('rope_type')}"
        )
    if float(full.get("factor", 1.0)) != 1.0:
        return "llama.cpp's gemma4 graph does not scale the full layers' rope, but this checkpoint's sets a factor"
    shared = int(c.get("num_kv_shared_layers") or 0)
    first = len(layers) - shared
    if shared and (first < 2 or c["layer_types"][first - 2 : first] != ["sliding_attention", "full_attention"]):
        return (
            "llama.cpp's gemma4 graph gives the layers sharing keys and values those of the two layers before them "
            "(a sliding one, then a full one), but this checkpoint's layer_types differ there"
        )
    if c.get("use_bidirectional_attention") == "all":
        return (
            "llama.cpp's gemma4 graph attends causally to text, but this checkpoint's config.json sets "
            "use_bidirectional_attention: all"
        )
    if c.get("attention_bias"):
        return "llama.cpp's gemma4 graph has no attention biases, but this checkpoint's config.json sets attention_bias"
    if c.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        return (
            "llama.cpp's gemma4 graph activates by GELU's tanh approximation, but this checkpoint's hidden_activation "
            f"is {c.get('hidden_activation')}"
        )
    if c.get("hidden_size_per_layer_input") and int(c.get("vocab_size_per_layer_input") or 0) != int(c["vocab_size"]):
        return (
            "llama.cpp's gemma4 graph looks the per-layer embeddings up over the token vocabulary, but this "
            f"checkpoint's vocab_size_per_layer_input {c.get('vocab_size_per_layer_input')} is not its vocab_size "
            f"{c['vocab_size']}"
        )
    return None


def gemma4_rope_freqs(c: dict):
    """rope_freqs {full head width / 2}: 1 for the rotated frequencies, 1e30 (no rotation) for the rest of a
    proportional rope (transformers' zero inverse frequencies), so that llama.cpp's rope over the whole head keeps
    the unrotated dimensions where transformers has them."""
    import torch

    full = next(h for swa, h, _ in gemma4_layers(c) if not swa)
    rope = c["rope_parameters"]["full_attention"]
    rotated = (
        int(float(rope.get("partial_rotary_factor", 1.0)) * full // 2)
        if rope["rope_type"] == "proportional"
        else full // 2
    )
    return {"rope_freqs.weight": torch.tensor([1.0] * rotated + [1e30] * (full // 2 - rotated), dtype=torch.float32)}
