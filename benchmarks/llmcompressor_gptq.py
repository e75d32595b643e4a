"""llm-compressor's GPTQ W4A16 of a zoo model on the same calibration tokens as moequant, for
`moequant eval` to compare on the same evaluation tokens.

Two steps, two environments (llm-compressor pins transformers <= 5.17, so it lives in its own venv):

    # 1. here (moequant's venv): the calibration tokens moequant's recipe uses
    python benchmarks/llmcompressor_gptq.py tokens --model zoo:tiny-qwen2moe --out /tmp/llmc/tokens.safetensors
    # 2. in llm-compressor's venv (python -m venv V && V/bin/pip install torch==2.13.0 llmcompressor)
    V/bin/python benchmarks/llmcompressor_gptq.py quantize --model moequant/zoo/tiny-qwen2moe \
        --tokens /tmp/llmc/tokens.safetensors --out /tmp/llmc/checkpoint --group-size 32
    # 3. here: the same evaluation as every moequant report
    moequant eval /tmp/llmc/checkpoint --reference zoo:tiny-qwen2moe --samples 32 --seq-len 256

Routed experts only (router, shared experts, attention, embeddings and lm_head stay bf16), int4
symmetric, group 32 (the bundled models' expert widths, 64 and 160, take no larger group), as
moequant's uniform-int4 recipe.
"""

from __future__ import annotations

import argparse
import time


def tokens(model: str, out: str, samples: int, seq_len: int, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    from moequant.io.checkpoint import load_tokenizer, open_checkpoint
    from moequant.measure.data import load_samples

    ckpt = open_checkpoint(model)
    s = load_samples("builtin:mix", load_tokenizer(ckpt.directory), samples, seq_len, split="calibration", seed=seed)
    save_file({"input_ids": torch.stack([x.input_ids for x in s])}, out)
    print(f"{len(s)} x {seq_len} calibration tokens -> {out}")


def quantize(model_dir: str, tokens_path: str, out: str, group_size: int) -> None:
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ids = load_file(tokens_path)["input_ids"]
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    scheme = QuantizationScheme(
        targets=[r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
        weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size),
    )
    recipe = GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])
    t0 = time.perf_counter()
    oneshot(
        model=model,
        dataset=data,
        recipe=recipe,
        num_calibration_samples=ids.shape[0],
        max_seq_length=ids.shape[1],
        output_dir=out,
        save_compressed=True,
    )
    print(f"llm-compressor GPTQ done in {time.perf_counter() - t0:.1f} s -> {out}")


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="step", required=True)
    t = sub.add_parser("tokens")
    t.add_argument("--model", default="zoo:tiny-qwen2moe")
    t.add_argument("--out", required=True)
    t.add_argument("--samples", type=int, default=64)
    t.add_argument("--seq-len", type=int, default=256)
    t.add_argument("--seed", type=int, default=0)
    q = sub.add_parser("quantize")
    q.add_argument("--model", required=True, help="the model directory (not zoo:, this venv has no moequant)")
    q.add_argument("--tokens", required=True)
    q.add_argument("--out", required=True)
    q.add_argument("--group-size", type=int, default=32)
    a = p.parse_args()
    if a.step == "tokens":
        tokens(a.model, a.out, a.samples, a.seq_len, a.seed)
    else:
        quantize(a.model, a.tokens, a.out, a.group_size)


if __name__ == "__main__":
    main()
