"""What each serving target lets the planner do with routed experts: the decision unit (GRANULARITY,
routed_groups), the formats it serves (servable_routed), SGLang's per-layer rule (sglang_per_layer,
solve_sglang) and the check that a rules / uniform plan gives each unit one format (check_uniform_groups).
The target-specific planning code lives here and nowhere else in moequant.plan.

Routed experts are decided per expert (one format for an expert's gate, up and down), and the
decision unit depends on the serving target:

* `transformers`: every expert on its own (any per-expert mix; loaded by `moequant.load`).
* `vllm` / `vllm-cuda`: one format for all routed experts of a layer. vLLM stacks a layer's experts into one
  fused-MoE buffer and resolves the quantization scheme from expert 0's gate / up / down only
  (compressed-tensors `get_moe_method`); a layer whose experts are all in `ignore` is loaded
  unquantized. So bf16 is offered as a whole-layer choice, never for single experts.
* `sglang`: one format per layer when every routed format is an INT4 / INT8 weight-only group
  (or bf16 for whole layers), else one format for all routed experts of the model. SGLang's
  compressed-tensors MoE resolves each FusedMoE layer's scheme from the config group matching
  its expert 0's `.0.gate_proj` / `.0.up_proj` / `.0.down_proj` (names hard-coded; sgl-project/sglang
  PR #29761 passes that per-layer scheme to the WNA16 MoE method instead of the `Linear`
  group's), while `CompressedTensorsWNA16MoE` (schemes/compressed_tensors_wNa16_moe.py) accepts
  only the checkpoint's top-level format `pack-quantized`, 4 or 8 bits, symmetric. An FP8 / MXFP4
  / NVFP4 group beside them makes the top-level format `mixed-precision`, which that check
  refuses, and models whose experts are not named gate/up/down_proj (Mixtral's w1/w3/w2) do not
  resolve per layer: both get one format for the model. A budget solves both ways and keeps the
  better plan.
* `vllm-moequant`: every expert on its own, served by moequant's vLLM plugin (moequant.vllm_plugin:
  one vLLM fused-MoE method per format group of a layer) in the formats vLLM's CPU backend has
  fused-MoE kernels for (bf16, int8 per channel as W8A8, symmetric int4: each format's `refuses`).
* `llama.cpp`: one ggml block type per (layer, projection): GGUF stacks a layer's experts per
  projection (`blk.N.ffn_{gate,up,down}_exps`) into one tensor of one type, so gate, up and down
  of a layer may differ, experts may not. Candidates are ggml types (q8_0 ... q2_k) or bf16; a
  type whose block does not divide a projection's input dimension is not offered to it.

Both engines load fused-MoE integer weights only at 4 or 8 bits (WNA16 kernels) and, as moequant
checks them (vLLM's CPU build, SGLang), only symmetric ones, so for `vllm` / `sglang` the candidates
int3 / int2 and asymmetric int4 are dropped from a budget (`dropped_candidates` in the plan says why)
and refused in `uniform` / `rules` plans. `vllm-cuda` is vLLM on NVIDIA GPUs, whose Marlin / Triton
WNA16 MoE kernels take zero points: there asymmetric int4 experts are candidates too (one format per
layer as for `vllm`; no engine check here, vLLM's CPU build refuses them). Non-expert tensors for
those targets may be int4 asymmetric, not int3 / int2.
"""

from __future__ import annotations

from collections import defaultdict

from moequant.errors import UserError
from moequant.layouts.compressed_tensors import sglang_per_layer_block
from moequant.plan.context import PlanContext, predicted_loss
from moequant.plan.model import PROJECTIONS
from moequant.plan.options import solve_groups

# The decision unit for routed experts per target (see the module docstring).
GRANULARITY = {
    "transformers": "expert",
    "vllm": "layer",
    "sglang": "model",
    "llama.cpp": "layer_proj",
    "vllm-moequant": "expert",
    "vllm-cuda": "layer",
}


# Routed-expert formats moequant's vLLM plugin serves on vLLM's CPU backend (vLLM 0.32 there has
# fused-MoE kernels for symmetric int4 groups (W4A16), int8 per channel with dynamic per-token int8
# activations (W8A8; export.int8_activations: dynamic) and bf16; FP8 / MXFP4 / NVFP4 MoE need a GPU).
def servable_routed(target: str) -> str:
    if target == "vllm-moequant":
        return "int8 (per channel), symmetric int4, bf16"
    return "fp8, int8, symmetric int4, mxfp4, nvfp4, bf16"


def routed_groups(ctx: PlanContext, target: str, free: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    unit = GRANULARITY[target]
    if unit == "expert":
        return [[e] for e in free]
    if unit == "layer_proj":  # one group per (layer, projection), of (layer, expert, proj) items; per on-disk
        # tensor where one holds several projections (gpt-oss's fused gate_up: one format on disk)
        by_proj: dict[tuple, list] = defaultdict(list)
        items = [(L, e, t) for L, e in free for t in ctx.experts[(L, e)]]
        holds = defaultdict(set)
        for _, _, t in items:
            holds[t.name].add(t.proj)
        for L, e, t in items:
            key = (L, t.name) if len(holds[t.name]) > 1 else (L, PROJECTIONS.index(t.proj))
            by_proj[key].append((L, e, t.proj))
        return [by_proj[k] for k in sorted(by_proj, key=lambda k: (k[0], str(k[1])))]
    if unit == "layer":
        by_layer: dict[int, list] = defaultdict(list)
        for e in free:
            by_layer[e[0]].append(e)
        return [by_layer[L] for L in sorted(by_layer)]
    return [list(free)] if free else []


def solve_for_target(
    ctx: PlanContext, target: str, free, specs, limit: int, notes, extra=None
) -> tuple[dict, int] | None:
    """Budget solve for one target, over its decision groups (solve_groups)."""
    return solve_groups(ctx, routed_groups(ctx, target, free), specs, limit, notes, extra)


def sglang_per_layer(spec) -> bool:
    """SGLang's WNA16 MoE takes per-layer schemes only in a pack-quantized checkpoint (int, or bf16 kept)."""
    return spec.family.ct_format in ("pack-quantized", "dense")


def solve_sglang(ctx: PlanContext, free, specs, limit: int, notes):
    """SGLang: the better of one format for the model and one INT4 / INT8 (/ bf16) format per layer."""
    best = solve_for_target(ctx, "sglang", free, specs, limit, notes)
    per_layer_specs = [s for s in specs if sglang_per_layer(s)]
    why = sglang_per_layer_block({t.name for ts in ctx.experts.values() for t in ts})
    if why:
        if notes is not None:
            notes.append(f"{why}: one routed-expert format for the whole model.")
        return best
    if not per_layer_specs:
        return best
    per_layer = solve_for_target(ctx, "vllm", free, per_layer_specs, limit, None)  # vllm's unit: one format per layer
    if per_layer is not None and (best is None or predicted_loss(ctx, per_layer[0]) <= predicted_loss(ctx, best[0])):
        return per_layer
    return best


def check_uniform_groups(ctx: PlanContext, target: str, assignment: dict) -> None:
    unit = GRANULARITY[target]
    if (
        target == "sglang"
        and all(sglang_per_layer(s) for s in assignment.values())
        and sglang_per_layer_block({t.name for ts in ctx.experts.values() for t in ts}) is None
    ):
        unit = "layer"  # INT4 / INT8 weight-only groups may differ per layer (see the module docstring)
    if unit == "expert":
        return
    keys = defaultdict(lambda: defaultdict(list))
    for (layer, expert), spec in sorted(assignment.items()):
        keys[layer if unit in ("layer", "layer_proj") else "all"][spec.key].append(expert)
    for scope, by_key in keys.items():
        if len(by_key) > 1:
            where = f"layer {scope}" if unit in ("layer", "layer_proj") else "the model"
            parts = "; ".join(f"{k} (experts {_short_list(v)})" for k, v in by_key.items())
            raise UserError(
                f"with target {target} every routed expert of {where} needs one format, but "
                f"experts.rules give {where} {parts}; accepted: rules by layers only, or target transformers."
            )


def _short_list(values: list[int]) -> str:
    return ", ".join(map(str, values[:6])) + (", ..." if len(values) > 6 else "")
