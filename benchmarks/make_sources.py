"""Random-weight checkpoints stored the way the largest MoEs ship, written from their specifications.

- `make_deepseek_fp8`: DeepSeek-V3 layout from tests/data/configs/deepseek-v3.json (with
  overrides: few layers, small vocab, small widths): every `*_proj` Linear weight as
  float8_e4m3fn `weight` + fp32 `weight_scale_inv` per 128x128 block (ragged edges),
  `quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}`; embeddings, norms,
  the router and its correction bias in bf16 / fp32 as DeepSeek stores them; the MTP layer
  (`num_nextn_predict_layers`) under `model.layers.{num_hidden_layers}.` as DeepSeek ships it.
- `make_qwen_int4`: a Qwen3-MoE (or Qwen2-MoE) whose routed experts are compressed-tensors
  `pack-quantized` int4, group 32, symmetric (Kimi-K2-Thinking's scheme: `targets: [Linear]`
  with every other Linear in `ignore`), the rest bf16.
- `make_gpt_oss_mxfp4`: gpt-oss with its fused experts as MXFP4 `*_blocks` / `*_scales`.

Weights are written one tensor at a time (never the whole model in memory), so the FP8 maker also
writes real-width layers for benchmarks. Quantization and packing are moequant.formats' own
(checked elsewhere against torch float8, compressed-tensors and transformers' MXFP4 reader).
Each checkpoint gets a small byte-level BPE tokenizer trained here on standard-library source,
so `moequant apply` runs on it offline.

    python benchmarks/make_sources.py deepseek-fp8 OUT                      # tiny, for tests
    python benchmarks/make_sources.py deepseek-fp8 OUT --real --set num_hidden_layers=5   # real widths: 2 MoE layers
    python benchmarks/make_sources.py qwen-int4 OUT
    python benchmarks/make_sources.py gpt-oss-mxfp4 OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from moequant import formats
from moequant.arch import adapter_for
from moequant.errors import UserError
from moequant.io.checkpoint import atomic_directory
from moequant.io.shards import ShardWriter
from moequant.layouts.deepseek_fp8 import pack_deepseek_fp8
from moequant.layouts.gpt_oss_mxfp4 import pack_gpt_oss_mxfp4
from moequant.layouts.gpt_oss_mxfp4 import quantization_config as gpt_oss_quantization_config

ROOT = Path(__file__).resolve().parent.parent
DEEPSEEK_V3 = ROOT / "tests" / "data" / "configs" / "deepseek-v3.json"

# small enough for CPU tests; 2 groups of 128 plus a ragged edge in the 160-wide tensors
DEEPSEEK_TINY = dict(
    num_hidden_layers=3,
    first_k_dense_replace=1,
    hidden_size=160,
    intermediate_size=128,
    moe_intermediate_size=64,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=512,
)
QWEN_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    norm_topk_prob=True,
)
GPT_OSS_TINY = dict(
    hidden_size=64,
    intermediate_size=64,
    num_local_experts=4,
    num_experts_per_tok=2,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=16,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    max_position_embeddings=131072,
    tie_word_embeddings=False,
)  # YaRN factor 32 over 4096, as gpt-oss


def make_tokenizer(directory: Path, vocab_size: int = 320) -> int:
    """A byte-level BPE tokenizer trained on standard-library source, saved into `directory`;
    returns its vocabulary size."""
    import inspect
    import json as json_module
    import textwrap

    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [inspect.getsource(m) for m in (argparse, textwrap, json_module)]
    tok.train_from_iterator(
        text,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(str(directory))
    return tok.get_vocab_size()


def _random(name: str, shape, generator: torch.Generator) -> torch.Tensor:
    """transformers-like initial values: weights N(0, 0.02), norms 1 + N(0, 0.02), biases N(0, 0.02)
    (on the generator's device)."""
    t = torch.randn(tuple(shape), generator=generator, device=generator.device) * 0.02
    if "norm" in name and len(shape) == 1:
        t += 1.0
    return t


def _full_config(model_type: str, config: dict) -> dict:
    from transformers import AutoConfig

    full = AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"}).to_dict()
    full.pop("transformers_version", None)
    return {**full, **config, "model_type": model_type}


def _write(directory: Path, make, shard_bytes: int) -> Path:
    """Atomically: the tokenizer, then `make(vocab_size)` -> (config, stream of (name, tensor))."""
    with atomic_directory(directory) as tmp:
        config, tensors = make(make_tokenizer(tmp))
        writer = ShardWriter(tmp, max_shard_bytes=shard_bytes)
        for name, tensor in tensors:
            writer.add(name, tensor)
        writer.finish()
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return Path(directory)


def _vocab(config: dict, tokenizer_vocab: int) -> dict:
    """vocab_size: the tokenizer's, or a larger one the caller asked for (unused rows are harmless)."""
    return {
        **config,
        "vocab_size": max(int(config.get("vocab_size") or 0), tokenizer_vocab),
        "eos_token_id": 0,
        "bos_token_id": 0,
        "pad_token_id": None,
    }


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3 FP8-block


def _mtp_names(adapter, config) -> dict[str, tuple]:
    """DeepSeek's next-token-prediction layers: a full MoE decoder layer under index
    num_hidden_layers + i, plus its embedding / projection / head (as in DeepSeek-V3's release)."""
    n = int(config.get("num_nextn_predict_layers") or 0)
    if not n or not adapter.moe_layers:
        return {}
    h, v = adapter.hidden, adapter.vocab
    template = adapter.moe_layers[0]
    out = {}
    for i in range(n):
        L = adapter.num_layers + i
        for name, (shape, _) in adapter.expected_tensors().items():
            prefix = f"model.layers.{template}."
            if name.startswith(prefix):
                out[f"model.layers.{L}." + name[len(prefix) :]] = shape
        p = f"model.layers.{L}."
        out.update(
            {
                p + "enorm.weight": (h,),
                p + "hnorm.weight": (h,),
                p + "eh_proj.weight": (h, 2 * h),
                p + "embed_tokens.weight": (v, h),
                p + "shared_head.norm.weight": (h,),
                p + "shared_head.head.weight": (v, h),
            }
        )
    return out


def make_deepseek_fp8(
    directory,
    overrides: dict | None = None,
    seed: int = 0,
    config_path=DEEPSEEK_V3,
    shard_bytes: int = 2 * 1024**3,
    device: str = "cpu",
) -> Path:
    """Write a random DeepSeek-V3-shaped FP8-block checkpoint: the real config with `overrides`
    (DEEPSEEK_TINY when None; the vocabulary shrinks to the tokenizer's unless a vocab_size is given).
    `device`: where the random weights are drawn and quantized (a GPU builds a real-size layer in seconds)."""
    base = json.loads(Path(config_path).read_text())
    base.update(DEEPSEEK_TINY if overrides is None else overrides)
    if "vocab_size" not in (overrides or {}):
        base["vocab_size"] = 0
    spec = formats.get_format("fp8", granularity="block")

    def make(vocab):
        config = _full_config("deepseek_v3", _vocab(base, vocab))
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
        adapter = adapter_for(config)
        shapes = {n: s for n, (s, _) in adapter.expected_tensors().items()}
        shapes.update(_mtp_names(adapter, config))
        g = torch.Generator(device=device).manual_seed(seed)

        def tensors():
            for name, shape in shapes.items():
                t = _random(name, shape, g)
                if name.endswith("_proj.weight") and len(shape) == 2:  # every Linear but the router and the heads
                    packed = pack_deepseek_fp8(formats.quantize(t, spec, name=name))
                    yield name, packed["weight"].cpu()
                    yield name[: -len("weight")] + "weight_scale_inv", packed["weight_scale_inv"].cpu()
                elif name.endswith("e_score_correction_bias"):
                    yield name, t.float().cpu()  # DeepSeek stores it in fp32
                else:
                    yield name, t.to(torch.bfloat16).cpu()

        return config, tensors()

    return _write(Path(directory), make, shard_bytes)


# ---------------------------------------------------------------------------------------------
# Qwen-MoE INT4 compressed-tensors


def ct_int4_scheme(group_size: int = 32) -> dict:
    """compressed-tensors' W4A16 group scheme, spelled as compressed-tensors writes it."""
    return {
        "targets": ["Linear"],
        "format": "pack-quantized",
        "input_activations": None,
        "output_activations": None,
        "weights": {
            "num_bits": 4,
            "type": "int",
            "symmetric": True,
            "strategy": "group",
            "group_size": group_size,
            "dynamic": False,
            "actorder": None,
            "block_structure": None,
            "observer": "minmax",
            "observer_kwargs": {},
        },
    }


def make_qwen_int4(
    directory,
    model_type: str = "qwen3_moe",
    overrides: dict | None = None,
    seed: int = 0,
    group_size: int = 32,
    shard_bytes: int = 2 * 1024**3,
) -> Path:
    """Write a random Qwen-MoE whose routed experts are compressed-tensors int4 pack-quantized."""
    base = {
        "architectures": [{"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[model_type]],
        "torch_dtype": "bfloat16",
        **QWEN_TINY,
        **(overrides or {}),
    }
    if model_type == "qwen2_moe":
        base.setdefault("shared_expert_intermediate_size", 48)
    spec = formats.get_format("int4", group_size=group_size, symmetric=True)

    def make(vocab):
        config = _full_config(model_type, _vocab(base, vocab))
        expected = adapter_for(config).expected_tensors()
        kept = sorted(
            n[: -len(".weight")]
            for n, (s, r) in expected.items()
            if n.endswith(".weight") and len(s) == 2 and r.role not in ("routed_expert", "norm", "embedding")
        )
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": ct_int4_scheme(group_size)},
            "ignore": kept,
            "kv_cache_scheme": None,
            "global_compression_ratio": None,
        }
        g = torch.Generator().manual_seed(seed)

        def tensors():
            for name, (shape, role) in expected.items():
                t = _random(name, shape, g)
                if role.role == "routed_expert":
                    module = name[: -len(".weight")]
                    for k, v in formats.pack_compressed_tensors(formats.quantize(t, spec, name=name)).items():
                        yield f"{module}.{k}", v
                else:
                    yield name, t.to(torch.bfloat16)

        return config, tensors()

    return _write(Path(directory), make, shard_bytes)


# ---------------------------------------------------------------------------------------------
# gpt-oss MXFP4


def make_gpt_oss_mxfp4(directory, overrides: dict | None = None, seed: int = 0, shard_bytes: int = 2 * 1024**3) -> Path:
    """Write a random gpt-oss whose fused experts are MXFP4 (`*_blocks` / `*_scales`), the rest bf16."""
    base = {"architectures": ["GptOssForCausalLM"], "torch_dtype": "bfloat16", **GPT_OSS_TINY, **(overrides or {})}
    spec = formats.get_format("mxfp4")

    def make(vocab):
        config = _full_config("gpt_oss", _vocab(base, vocab))
        config["quantization_config"] = gpt_oss_quantization_config()
        g = torch.Generator().manual_seed(seed)

        def tensors():
            for name, (shape, role) in adapter_for(config).expected_tensors().items():
                t = _random(name, shape, g)
                if role.role == "routed_expert" and role.proj in ("gate_up", "down"):
                    # stored [E, in, out]; MXFP4 groups run along the input axis of the [E, out, in] weight
                    packed = pack_gpt_oss_mxfp4(formats.quantize(t.transpose(1, 2), spec, name=name))
                    yield f"{name}_blocks", packed["blocks"]
                    yield f"{name}_scales", packed["scales"]
                else:
                    yield name, t.to(torch.bfloat16)

        return config, tensors()

    return _write(Path(directory), make, shard_bytes)


MAKERS = {"deepseek-fp8": make_deepseek_fp8, "qwen-int4": make_qwen_int4, "gpt-oss-mxfp4": make_gpt_oss_mxfp4}


def main(argv=None) -> None:
    import yaml

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kind", choices=sorted(MAKERS))
    ap.add_argument("output")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override (YAML value), e.g. num_hidden_layers=4",
    )
    ap.add_argument(
        "--real",
        action="store_true",
        help="deepseek-fp8: start from the real widths of deepseek-v3.json (else the tiny test shape)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)
    try:
        if args.kind == "deepseek-fp8":
            path = make_deepseek_fp8(
                args.output, overrides if args.real else {**DEEPSEEK_TINY, **overrides}, seed=args.seed
            )
        else:
            path = MAKERS[args.kind](args.output, overrides=overrides, seed=args.seed)
    except UserError as e:  # a config the overrides made impossible
        raise SystemExit(f"error: {e}") from None
    total = sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))
    print(f"{path}: {total / 1e6:.1f} MB of safetensors")


if __name__ == "__main__":
    main()
