"""Calibration memory and throughput.

1. Peak RSS of `moequant calibrate` on a synthetic Qwen3-MoE checkpoint of 8+ MoE layers whose
   weights are ≥ 8× one layer, next to: the fixed overhead (imports + skeleton, measured by a
   run on a 1-layer model), one layer's weights as materialised (fp32), and the carried
   activations. Calibration keeps one layer in memory, so peak ≈ overhead + layer + activations
   + statistics, independent of the number of layers.
2. Throughput in tokens/s on a bundled zoo model (CPU here; pass --device cuda on a GPU).

    python benchmarks/bench_calibrate.py [--layers 12] [--device cpu] [--zoo tiny-qwen2moe]

Each measurement runs in a fresh subprocess so peak RSS (VmHWM) is its own.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from measure import peak_rss_bytes  # benchmarks/measure.py (the script's own directory)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/support: the plain calibration settings

SHAPE = dict(
    hidden_size=512,
    moe_intermediate_size=384,
    num_experts=32,
    num_experts_per_tok=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=512,
    intermediate_size=1024,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


def build(directory: Path, layers: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_moe", num_hidden_layers=layers, **SHAPE)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(directory)


def child(model: str, out: str, samples: int, seq_len: int, device: str, hessians: bool) -> None:
    """Runs in the subprocess: calibrate, print peak RSS and time as JSON."""

    import torch

    from moequant.io.checkpoint import open_checkpoint
    from moequant.measure.calibrate import calibrate
    from moequant.measure.data import Sample
    from tests.support.plain import plain_settings

    ckpt = open_checkpoint(model)
    vocab = int(ckpt.config["vocab_size"])
    g = torch.Generator().manual_seed(0)
    if model.startswith("zoo:"):
        samples_arg = None
    else:
        samples_arg = [
            Sample(torch.randint(0, vocab, (seq_len,), generator=g), "synthetic", "bench") for _ in range(samples)
        ]
    settings = plain_settings(
        samples=samples,
        seq_len=seq_len,
        batch_size=8,
        device=device,
        hessians=hessians,
        formats=("int4-g128-sym", "int8-channel"),
    )
    t0 = time.perf_counter()
    calibrate(model, out, settings, samples=samples_arg, progress=False, overwrite=True)
    seconds = time.perf_counter() - t0
    peak_kib = peak_rss_bytes() / 1024
    print(json.dumps({"seconds": seconds, "peak_rss_mb": peak_kib / 1024, "tokens": samples * seq_len}))


def run_child(*args) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *map(str, args)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--zoo", default="tiny-qwen2moe")
    p.add_argument("--child", nargs=6)
    a = p.parse_args()
    if a.child:
        model, out, samples, seq_len, device, hessians = a.child
        child(model, out, int(samples), int(seq_len), device, hessians == "1")
        return

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        build(tmp / "one", 1)
        build(tmp / "many", a.layers)
        from moequant.arch import adapter_for
        from moequant.io.checkpoint import open_checkpoint

        ck = open_checkpoint(tmp / "many")
        ad = adapter_for(ck.config)
        layer_params = sum(ck.entries[n].numel for n in ad.layer_tensor_names(1))
        total_bytes = sum(e.nbytes for e in ck.entries.values())
        layer_fp32_mb = layer_params * 4 / 2**20
        act_mb = a.samples * a.seq_len * SHAPE["hidden_size"] * 4 / 2**20
        E, H, I = SHAPE["num_experts"], SHAPE["hidden_size"], SHAPE["moe_intermediate_size"]
        hess_mb = (H * H + 2 * E * I * I + E * H * H) * 4 / 2**20
        one = run_child(tmp / "one", tmp / "s1", a.samples, a.seq_len, a.device, 1)
        many = run_child(tmp / "many", tmp / "s2", a.samples, a.seq_len, a.device, 1)
        print(
            f"synthetic qwen3_moe: {a.layers} MoE layers, checkpoint {total_bytes / 2**20:.0f} MiB bf16 "
            f"= {total_bytes / (layer_params * 2):.1f}x one layer"
        )
        print(f"  one layer materialised (fp32): {layer_fp32_mb:8.1f} MiB")
        print(f"  carried activations (fp32):    {act_mb:8.1f} MiB ({a.samples} x {a.seq_len} tokens)")
        print(f"  one layer's Hessians (fp32):   {hess_mb:8.1f} MiB")
        print(f"  peak RSS, 1-layer model:       {one['peak_rss_mb']:8.1f} MiB  (fixed overhead + one layer)")
        print(
            f"  peak RSS, {a.layers}-layer model:      {many['peak_rss_mb']:8.1f} MiB  "
            f"(+{many['peak_rss_mb'] - one['peak_rss_mb']:.1f} MiB for {a.layers - 1} more layers "
            f"of {total_bytes / a.layers / 2**20:.0f} MiB each on disk)"
        )
        print(
            f"  throughput: {many['tokens'] * a.layers / many['seconds']:.0f} token-layers/s "
            f"({many['tokens'] / many['seconds']:.0f} tokens/s through all {a.layers} layers)"
        )
    zoo = run_child(f"zoo:{a.zoo}", tempfile.mkdtemp(), 64, 256, a.device, 1)
    print(
        f"zoo:{a.zoo}: {zoo['tokens']} tokens in {zoo['seconds']:.1f} s = {zoo['tokens'] / zoo['seconds']:.0f} tokens/s "
        f"on {a.device}, peak RSS {zoo['peak_rss_mb']:.0f} MiB"
    )


if __name__ == "__main__":
    main()
