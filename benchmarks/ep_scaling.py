"""Expert-parallel quantize time on paper: Qwen3-235B-A22B and DeepSeek-V3 on 2 and 8 H200s.

Not a measurement: a model built from the one-H200 numbers in bench_e2e.py and bench_gptq.py
(benchmarks/RESULTS.md, measured 2026-12-01), for uniform int4-g128 GPTQ of the routed experts with no
calibration pass (recipes/uniform-int4.yaml, what MoE-Quant does), 65,536 calibration tokens
(bench_e2e's 128 x 512). The measured run on 2 GPUs is its own issue.

Per MoE layer on one H200:
  solve     GPTQ solve of every routed expert (token count does not matter): bench_gptq measured 0.12 s
            at the Qwen3-30B-A3B shape and 2.70 s at DeepSeek-V3's; Qwen3-235B-A22B is interpolated
            between the two on a log-log line in E * sum over projections of out * in^2 (the solve's work).
  hessians  the experts' routed-token Hessians: bench_gptq measured 0.19 s (Qwen3-30B-A3B) and 1.84 s
            (DeepSeek-V3); Qwen3-235B-A22B interpolated the same way in top_k * (hidden^2 + width^2)
            (the Hessians' work per token).
  rest      everything else of the quantize pass (the layer forwards, reading the experts, dequantized
            copies, work/ files): bench_e2e's marginal quantize stage at Qwen3-30B-A3B, 2.6 s/layer,
            minus that shape's solve + hessians (0.31 s), scaled by the layer's expert bytes (bf16).
  serial    what rank 0 does alone after the pass, the export (the report is small; evaluation is left
            out): bench_e2e's export stage at 2 layers of Qwen3-30B-A3B, 1.3 s, per layer (an upper bound:
            it includes the stage's fixed cost), scaled the same way. (bench_e2e's seconds per layer without
            evaluation, 5.07, minus its quantize stage, 2.6, would say 2.47 s: that difference of two
            whole-run marginals also holds start-up noise, and its fp8 row exports a layer in < 0.75 s.)
With N ranks (moequant.parallel) solve, hessians and rest are divided by N — ideal: the layer forward,
which every rank runs whole, is counted as divided too (it is top-k sparse and small next to the rest) —
and each layer adds the all-gather of the dequantized experts: every rank receives (N - 1) / N of the
layer's bf16 expert bytes over NVLink 4 at 450 GB/s per direction per H200 (the nominal figure; NCCL's
achieved all-gather bandwidth is lower). The quantized codes stay in each rank's work/ files (no
communication); the reports gathered to rank 0 are a few kB. Dense layers (DeepSeek-V3's first 3) run
no GPTQ and are counted as free.

MoE-Quant (IST-DASLab) publishes about 2 hours for DeepSeek-V3/R1 GPTQ on 8 x H100 (not H200) with 512 calibration
sequences of 4,096 tokens (2,097,152 tokens, 32x the 65,536 here). The last column redoes the total with
the Hessians (the token-proportional part measured) at that token count: the rest's forwards grow with
the tokens as well, so it is a lower bound there.

    python benchmarks/ep_scaling.py

Printed 2026-12-01 (a model, nothing measured; 1 GPU for reference):

  model             GPUs s/layer 1 GPU  pass min comm s/layer rank-0 min total min at 2.1M tokens min
  Qwen3-235B-A22B      1          10.4      16.3        0.000        4.1      20.4               53.7
  Qwen3-235B-A22B      2          10.4       8.2        0.005        4.1      12.2               28.9
  Qwen3-235B-A22B      8          10.4       2.1        0.009        4.1       6.1               10.3
  DeepSeek-V3          1          47.3      45.7        0.000       11.7      57.4              112.6
  DeepSeek-V3          2          47.3      22.9        0.025       11.7      34.6               62.2
  DeepSeek-V3          8          47.3       5.8        0.044       11.7      17.5               24.4
  MoE-Quant, DeepSeek-V3 GPTQ on 8 x H100 (2,097,152 tokens): about 120 min (published)
  Qwen3-235B-A22B: one H200 per MoE layer: solve 0.57 s, Hessians 0.69 s, rest 9.2 s, rank-0 serial 2.6 s; 4.8 GB of bf16 experts per layer
  DeepSeek-V3: one H200 per MoE layer: solve 2.70 s, Hessians 1.84 s, rest 42.7 s, rank-0 serial 12.1 s; 22.5 GB of bf16 experts per layer

Reading: with 8 H200s the pass itself shrinks to minutes and rank 0's export becomes the largest part
(per-rank checkpoint shards under one index would divide it too); at MoE-Quant's token count the
Hessians add ~7 min on 8 GPUs. The all-gather is < 0.1 s per layer. The 'rest' term is the least
certain one: it is one shape's measurement scaled by bytes (DeepSeek-V3 is stored in FP8, half of
the bf16 bytes counted here, and reading is only part of it); the 2-GPU measurement will replace it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

NVLINK_BYTES_PER_S = 450e9  # H200 NVLink 4: 900 GB/s bidirectional per GPU, 450 GB/s per direction
CALIBRATION_TOKENS = 65_536  # bench_e2e / bench_gptq: 128 x 512
MOE_QUANT_TOKENS = 512 * 4096  # MoE-Quant's published DeepSeek-V3 run
MOE_QUANT_HOURS_8_H100 = 2.0


@dataclass
class Shape:
    name: str
    moe_layers: int
    experts: int
    top_k: int
    hidden: int
    width: int  # routed expert intermediate size

    @property
    def expert_bytes(self) -> float:
        """bf16 bytes of one layer's routed experts (gate, up, down)."""
        return self.experts * 3 * self.hidden * self.width * 2

    @property
    def solve_work(self) -> float:
        """GPTQ's solve: per expert and projection out * in^2 (gate/up read hidden, down reads width)."""
        return self.experts * (2 * self.width * self.hidden**2 + self.hidden * self.width**2)

    @property
    def hessian_work(self) -> float:
        """Hessian products per calibration token: top_k experts, each hidden^2 (gate/up) + width^2 (down)."""
        return self.top_k * (self.hidden**2 + self.width**2)


QWEN3_30B = Shape("Qwen3-30B-A3B", 48, 128, 8, 2048, 768)  # the measured shape
DEEPSEEK_V3 = Shape("DeepSeek-V3", 58, 256, 8, 7168, 2048)  # + 3 dense layers (no GPTQ)
QWEN3_235B = Shape("Qwen3-235B-A22B", 94, 128, 8, 4096, 1536)

# one H200, seconds per MoE layer at 65,536 calibration tokens (bench_gptq.py, 2026-12-01, TF32 fused solve)
MEASURED = {QWEN3_30B.name: {"solve": 0.12, "hessians": 0.19}, DEEPSEEK_V3.name: {"solve": 2.70, "hessians": 1.84}}
E2E_QUANTIZE_S_PER_LAYER = 2.6  # bench_e2e.py: marginal quantize stage, Qwen3-30B-A3B shape
E2E_EXPORT_S_PER_LAYER = 1.3 / 2  # bench_e2e.py: the export stage at 2 layers, Qwen3-30B-A3B shape


def _log_log(x: float, x0: float, y0: float, x1: float, y1: float) -> float:
    """y at x on the straight line through (x0, y0) and (x1, y1) in log-log coordinates."""
    slope = math.log(y1 / y0) / math.log(x1 / x0)
    return y0 * (x / x0) ** slope


def one_gpu_parts(shape: Shape) -> dict[str, float]:
    """Seconds per MoE layer on one H200: solve, hessians, rest (divided by the ranks) and serial (rank 0)."""
    if shape.name in MEASURED:
        solve, hessians = MEASURED[shape.name]["solve"], MEASURED[shape.name]["hessians"]
    else:
        a, b = MEASURED[QWEN3_30B.name], MEASURED[DEEPSEEK_V3.name]
        solve = _log_log(shape.solve_work, QWEN3_30B.solve_work, a["solve"], DEEPSEEK_V3.solve_work, b["solve"])
        hessians = _log_log(
            shape.hessian_work, QWEN3_30B.hessian_work, a["hessians"], DEEPSEEK_V3.hessian_work, b["hessians"]
        )
    by_bytes = shape.expert_bytes / QWEN3_30B.expert_bytes
    measured = MEASURED[QWEN3_30B.name]
    rest = (E2E_QUANTIZE_S_PER_LAYER - measured["solve"] - measured["hessians"]) * by_bytes
    serial = E2E_EXPORT_S_PER_LAYER * by_bytes
    return {"solve": solve, "hessians": hessians, "rest": rest, "serial": serial}


def estimate(shape: Shape, ranks: int, tokens: int = CALIBRATION_TOKENS) -> dict[str, float]:
    parts = one_gpu_parts(shape)
    hessians = parts["hessians"] * tokens / CALIBRATION_TOKENS
    per_layer = parts["solve"] + hessians + parts["rest"]
    comm = shape.expert_bytes * (ranks - 1) / ranks / NVLINK_BYTES_PER_S
    pass_s = shape.moe_layers * (per_layer / ranks + comm)
    serial_s = shape.moe_layers * parts["serial"]
    return {
        "one_gpu_s_per_layer": per_layer,
        "pass_min": pass_s / 60,
        "comm_s_per_layer": comm,
        "serial_min": serial_s / 60,
        "total_min": (pass_s + serial_s) / 60,
    }


def main() -> None:
    print(
        f"{'model':17s} {'GPUs':>4s} {'s/layer 1 GPU':>13s} {'pass min':>9s} {'comm s/layer':>12s} "
        f"{'rank-0 min':>10s} {'total min':>9s} {'at 2.1M tokens min':>18s}"
    )
    for shape in (QWEN3_235B, DEEPSEEK_V3):
        for ranks in (1, 2, 8):
            e, big = estimate(shape, ranks), estimate(shape, ranks, MOE_QUANT_TOKENS)
            print(
                f"{shape.name:17s} {ranks:4d} {e['one_gpu_s_per_layer']:13.1f} {e['pass_min']:9.1f} "
                f"{e['comm_s_per_layer']:12.3f} {e['serial_min']:10.1f} {e['total_min']:9.1f} "
                f"{big['total_min']:18.1f}"
            )
    print(
        f"MoE-Quant, DeepSeek-V3 GPTQ on 8 x H100 ({MOE_QUANT_TOKENS:,} tokens): "
        f"about {MOE_QUANT_HOURS_8_H100 * 60:.0f} min (published)"
    )
    for shape in (QWEN3_235B, DEEPSEEK_V3):
        parts = one_gpu_parts(shape)
        print(
            f"{shape.name}: one H200 per MoE layer: solve {parts['solve']:.2f} s, Hessians {parts['hessians']:.2f} s, "
            f"rest {parts['rest']:.1f} s, rank-0 serial {parts['serial']:.1f} s; "
            f"{shape.expert_bytes / 1e9:.1f} GB of bf16 experts per layer"
        )


if __name__ == "__main__":
    main()
