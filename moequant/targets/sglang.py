"""SGLang (target `sglang`): loads compressed-tensors, GPTQ, AWQ and DeepSeek-FP8 checkpoints. Facts read from
its source:

* routed experts: one format per layer when every routed format is an INT4 / INT8 weight-only group (or bf16
  for whole layers), else one format for all routed experts of the model. SGLang's compressed-tensors MoE
  resolves each FusedMoE layer's scheme from the config group matching its expert 0's `.0.gate_proj` /
  `.0.up_proj` / `.0.down_proj` (names hard-coded; sgl-project/sglang PR #29761 passes that per-layer scheme
  to the WNA16 MoE method instead of the `Linear` group's), while `CompressedTensorsWNA16MoE`
  (schemes/compressed_tensors_wNa16_moe.py) accepts only the checkpoint's top-level format `pack-quantized`,
  4 or 8 bits, symmetric. An FP8 / MXFP4 / NVFP4 group beside them makes the top-level format
  `mixed-precision`, which that check refuses, and models whose experts are not named gate/up/down_proj
  (Mixtral's w1/w3/w2) do not resolve per layer: both get one format for the model. A budget solves both
  ways and keeps the better plan.
* q/k/v and gate/up are fused into one module each; integer weights only at 4 or 8 bits; its
  compressed-tensors fused MoE asserts symmetric integer experts.
* MXFP8 checkpoints: not verified by moequant, so not offered.

SGLang itself is not run here: its compressed-tensors package imports CUDA-only modules at import time.
"""

from __future__ import annotations

from moequant.targets.base import Target

EXPERT_NAMES = {"gate_proj", "up_proj", "down_proj"}  # the names SGLang reads a layer's scheme from
UNVERIFIED = ("mxfp8",)  # format families whose SGLang loading moequant has not verified


def per_layer_format(spec) -> bool:
    """Whether routed experts in `spec` may differ from other layers': SGLang's WNA16 MoE takes per-layer schemes
    only in a pack-quantized checkpoint (symmetric int of 4 / 8 bits, or bf16 kept)."""
    return spec.family.ct_format in ("pack-quantized", "dense")


def per_layer_block(names) -> str | None:
    """Why SGLang cannot resolve routed-expert schemes per layer for these on-disk expert tensor names."""
    leaves = {n.rsplit(".", 2)[-2] if n.endswith(".weight") else n.rsplit(".", 1)[-1] for n in names}
    if leaves <= EXPERT_NAMES:
        return None
    return (
        f"SGLang resolves a layer's scheme from its expert 0's gate_proj / up_proj / down_proj, and this "
        f"model's experts are {', '.join(sorted(leaves - EXPERT_NAMES))}"
    )


class Sglang(Target):
    name = "sglang"
    granularity = "model"
    fuses_projections = True
    pack_quantized_top_level = True
    non_expert_choice = False  # the budget's two solves (model-wide, per layer) do not trade non-expert formats
    routed_formats = "fp8, int8, symmetric int4, mxfp4, nvfp4, bf16"

    def refuses(self, spec, routed):
        why = super().refuses(spec, routed)
        if why:
            return why
        if spec.name in UNVERIFIED:
            return "SGLang's loading of MXFP8 compressed-tensors checkpoints is not verified by moequant"
        if spec.is_int and spec.bits not in (4, 8):
            return "SGLang loads integer weights only at 4 or 8 bits (WNA16 kernels)"
        if spec.is_int and routed and not spec.symmetric:
            return "SGLang's compressed-tensors fused MoE loads only symmetric integer experts"
        return None

    def units(self, specs, expert_names, notes=None):
        units = [("model", list(specs))]
        per_layer = [s for s in specs if per_layer_format(s)]
        why = per_layer_block(expert_names)
        if why and notes is not None:
            notes.append(f"{why}: one routed-expert format for the whole model.")
        if per_layer and not why:
            units.append(("layer", per_layer))
        return units

    def refuses_routed_mix(self, routed):
        keys = {s.key for s in routed.values()}
        if len(keys) <= 1:
            return None
        odd = sorted(s.key for s in routed.values() if not (s.is_int and s.symmetric and s.bits in (4, 8)))
        if odd:
            return (
                f"target sglang takes per-layer routed-expert formats only as INT4 / INT8 weight-only groups "
                f"(top-level format pack-quantized); the plan mixes {', '.join(sorted(keys))}, and {odd[0]} "
                f"would make the format mixed-precision, which SGLang's WNA16 MoE refuses"
            )
        why = per_layer_block(routed)
        if why:
            return f"target sglang cannot load per-layer routed-expert formats here: {why}; use one format"
        return None
