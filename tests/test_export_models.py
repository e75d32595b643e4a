"""Tiny checkpoints and quantized-tensor mappings shared by the export and vLLM tests.

The models are random but well conditioned for engine comparisons: decisive routers (router
logits far apart, so bf16 rounding never flips a top-k choice), experts large enough to matter
for the output, and a peaked next-token distribution. Shapes fit every format: input widths
are multiples of 128 (int groups, fp8 blocks), head_dim 64 (vLLM's CPU attention).
"""

from __future__ import annotations

from pathlib import Path

import torch

from moequant import formats
from moequant.arch import adapter_for
from moequant.io.checkpoint import open_checkpoint

VOCAB = 512
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.02,
    tie_word_embeddings=False,
)
ARCH = {
    "mixtral": dict(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        intermediate_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
    ),
    "qwen3_moe": dict(
        moe_intermediate_size=128, intermediate_size=256, head_dim=64, num_experts=4, num_experts_per_tok=2
    ),
    "deepseek_v3": dict(
        intermediate_size=256,
        moe_intermediate_size=128,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_rope_head_dim=32,
        qk_nope_head_dim=32,
        v_head_dim=64,
        n_group=1,
        topk_group=1,
    ),
    "gpt_oss": dict(
        intermediate_size=128,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=64,
    ),
}


def build_model(model_type: str, directory: Path, seed: int = 0) -> Path:
    """Save a tiny bf16 `model_type` checkpoint (plus a word-level tokenizer) in `directory`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**COMMON, **ARCH[model_type]})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "router.weight")):
                p.normal_(0, 0.5)
            elif "experts" in name:
                p.normal_(0, 0.08)
            elif name == "lm_head.weight":
                p.normal_(0, 0.25)
            elif name == "model.embed_tokens.weight":
                p.normal_(0, 1.0)
            elif "bias" in name or "sinks" in name:
                p.normal_(0, 0.02)
    directory = Path(directory)
    model.to(torch.bfloat16).save_pretrained(directory)
    save_word_tokenizer(directory)
    return directory


def save_word_tokenizer(directory: Path) -> None:
    """A word-level tokenizer "t0 t1 ..." over the whole vocabulary: export must copy it, and
    GPTQModel refuses a checkpoint without one (the engines are fed token ids directly)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1").save_pretrained(directory)


def quantize_experts(source, format_of, grid: str = "minmax") -> dict:
    """{(layer, expert, proj): QuantizedTensor} with format_of(layer, expert, proj) -> key (None: keep), round to
    nearest on `grid` (searched: symmetric group formats choose their scales' signs, formats.core.signed_scales)."""
    ckpt = open_checkpoint(source)
    adapter = adapter_for(ckpt.config)
    out = {}
    for layer in adapter.moe_layers:
        for expert in range(adapter.num_experts):
            for proj in adapter.projections:
                key = format_of(layer, expert, proj)
                if key is not None:
                    w = adapter.read_expert(ckpt, layer, expert, proj)
                    out[(layer, expert, proj)] = formats.quantize(w, key, grid=grid)
    return out


def quantize_named(source, format_of) -> dict:
    """{on-disk name: QuantizedTensor} for 2-D weights with format_of(name, role) -> key (None: keep)."""
    ckpt = open_checkpoint(source)
    adapter = adapter_for(ckpt.config)
    out = {}
    for name in ckpt.keys():
        if not name.endswith(".weight") or len(ckpt.shape(name)) != 2:
            continue
        key = format_of(name, adapter.classify(name).role)
        if key is not None:
            out[name] = formats.quantize(ckpt.get(name), key)
    return out


def test_builder_gives_decisive_routing(tmp_path):
    """The property the engine comparisons rely on: top-k router margins far above bf16 noise."""
    src = build_model("mixtral", tmp_path / "m")
    ckpt = open_checkpoint(src)
    router = ckpt.get("model.layers.0.block_sparse_moe.gate.weight").float()
    x = torch.nn.functional.normalize(torch.randn(256, 256), dim=-1) * 16  # RMS-normalised inputs
    logits = (x @ router.t()).sort(dim=-1, descending=True).values
    margin = logits[:, 1] - logits[:, 2]  # between the 2nd chosen and the 1st rejected expert
    assert float(margin.median()) > 1.0
