"""Tiny random-weight checkpoints of every supported architecture, built offline at test time.

Each is made from a transformers config and saved with `save_pretrained`, so the on-disk layout
is exactly what transformers writes (per-expert 2-D tensors, or fused for gpt-oss).
"""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)

TINY_CONFIGS: dict[str, dict] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=24,
        norm_topk_prob=False,
    ),
    "qwen3_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8, norm_topk_prob=True),
    "deepseek_v3": dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        routed_scaling_factor=2.5,
        num_key_value_heads=4,
    ),
    "deepseek_v2": dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        topk_method="group_limited_greedy",
        num_key_value_heads=4,
    ),
    "olmoe": dict(num_experts=6, num_experts_per_tok=2, eos_token_id=1, pad_token_id=0),
    "gpt_oss": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=8,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
}


def tiny_config(model_type: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**COMMON, **TINY_CONFIGS[model_type]})


def build_tiny(model_type: str, directory: Path, seed: int = 0, dtype=torch.bfloat16) -> Path:
    """Save a tiny random model of `model_type` in on-disk layout; returns the directory."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "sinks" in name:
                p.normal_(0, 0.02)  # transformers zero-inits some biases: make them visible
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.02)
    model = model.to(dtype)
    directory = Path(directory)
    model.save_pretrained(directory)
    return directory


def build_tiny_with_tokenizer(model_type: str, directory: Path, seed: int = 0, vocab_size: int = 320) -> Path:
    """A tiny model plus a byte-level BPE tokenizer trained here on standard-library source,
    so the whole pipeline (data → calibrate → … → evaluate) can run on it offline."""
    import argparse  # noqa: E401  (their source is the training text)
    import inspect
    import json
    import json as _json
    import textwrap

    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    text = [inspect.getsource(m) for m in (argparse, textwrap, json)]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        text,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    directory = Path(directory)
    config = tiny_config(model_type)
    config.vocab_size = tok.get_vocab_size()
    config.eos_token_id = tok.token_to_id("<|endoftext|>")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    _json.loads((directory / "config.json").read_text())
    return directory


def route_only_to_experts_0_and_1(directory: Path, layer: int = 1) -> None:
    """Rewrite a saved tiny model so that `layer`'s router can only pick experts 0 and 1: channel 0
    of the residual stream is a large positive constant for every token (so it stays positive
    after the positive-weight norm) and the router reads only that channel, with logit +100·x0
    for experts 0 and 1 and −100·x0 for the others. The other experts then see no token."""
    from safetensors.torch import load_file, save_file

    path = Path(directory) / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.embed_tokens.weight"][:, 0] = 4.0
    name = f"model.layers.{layer}.mlp.gate.weight"
    router = torch.zeros_like(tensors[name])
    router[:2, 0], router[2:, 0] = 100.0, -100.0
    tensors[name] = router
    save_file(tensors, str(path), metadata={"format": "pt"})


# Scaled-down configs of the real models llama.cpp users run, with the widths its K types need
# (hidden size and expert width multiples of 256), for the GGUF tests; vocabulary and tokenizer are
# the bundled tiny-qwen2moe's (a byte-level BPE with GPT-2's pre-tokenizer).
GGUF_COMMON = dict(
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
)
GGUF_CONFIGS: dict[str, dict] = {
    # Qwen3-30B-A3B's shape: q/k norms per head, renormalised top-k, head_dim independent of hidden
    "qwen3_moe": dict(
        num_hidden_layers=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        intermediate_size=512,
        head_dim=64,
        norm_topk_prob=True,
    ),
    # OLMoE-1B-7B: q/k norms over the whole projection, no renormalisation, MHA
    "olmoe": dict(
        num_hidden_layers=2,
        num_experts=8,
        num_experts_per_tok=2,
        intermediate_size=256,
        num_key_value_heads=4,
        norm_topk_prob=False,
    ),
    # DeepSeek-V3 / R1 / Kimi-K2: MLA with q LoRA, a leading dense layer, a shared expert, sigmoid scores with a
    # correction bias, 4 groups of which 2 are kept, renormalised and scaled top-k
    "deepseek_v3": dict(
        num_hidden_layers=2,
        first_k_dense_replace=1,
        intermediate_size=512,
        moe_intermediate_size=256,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        num_key_value_heads=4,
    ),
    # DeepSeek-V2-Lite: MLA without q LoRA, softmax scores, greedy top-k without renormalisation
    "deepseek_v2": dict(
        num_hidden_layers=2,
        first_k_dense_replace=1,
        intermediate_size=512,
        moe_intermediate_size=256,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        topk_method="greedy",
        norm_topk_prob=False,
        routed_scaling_factor=2.0,
        q_lora_rank=None,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        num_key_value_heads=4,
    ),
    # gpt-oss-20b: fused interleaved gate/up with biases, attention sinks, sliding window on even layers, yarn rope
    # (transformers' default rope_parameters for gpt-oss)
    "gpt_oss": dict(
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=256,
        head_dim=64,
        sliding_window=16,
        max_position_embeddings=131072,
    ),
}


def build_gguf_tiny(
    model_type: str,
    directory: Path,
    seed: int = 0,
    scale: float = 1.0,
    head_scale: float = 8.0,
    router_scale: float = 8.0,
) -> Path:
    """A random model of GGUF_CONFIGS[model_type] with the bundled tiny-qwen2moe tokenizer, saved in bf16
    with `save_pretrained`. Weights are `scale` x transformers' init, lm_head `head_scale` x (the logits are
    far from uniform: a KL between two forwards means something) and the routers `router_scale` x (decisive
    routing, as trained routers are: a random router's near ties flip under any rounding)."""
    import json
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from moequant.zoo import path as zoo_path

    tok_dir = zoo_path("tiny-qwen2moe")
    vocab = json.loads((tok_dir / "config.json").read_text())["vocab_size"]
    config = AutoConfig.for_model(
        model_type,
        **{**GGUF_COMMON, **GGUF_CONFIGS[model_type]},
        vocab_size=vocab,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                router = name.endswith(("mlp.gate.weight", "router.weight"))
                p.mul_(head_scale if name == "lm_head.weight" else router_scale if router else scale)
            elif "bias" in name or "sinks" in name:
                p.normal_(0, 0.1)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)  # uneven norms: a misplaced one shows
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.1)
    directory = Path(directory)
    model.to(torch.bfloat16).save_pretrained(directory)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, directory / f)
    return directory
