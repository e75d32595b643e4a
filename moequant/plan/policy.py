"""The policy engine: recipe + calibration statistics -> one format per tensor (plan.json).

This module builds plans (make_plan, check_plan, budget_frontier: the rules, the budget, the predicted
loss and the plan's summary dict). Beside it in moequant.plan: the plan's data classes, SCHEMA and
spec_params (model), plan.json to / from disk (plan_io), the summary as text (summary) and the budget's
knapsack solver (solver).

Which tensors are decided
-------------------------
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

Everything else follows the recipe: the router and the shared-expert gate always stay bf16;
norms, embeddings, biases and unknown tensors are never quantized; attention, shared experts,
dense MLPs and lm_head take `non_experts.format` unless `keep` names them.

Predicted loss and usage weight
-------------------------------
Calibration measures, for every expert e of layer L, projection p and candidate format f, the
output error of that projection quantized to f: `sensitivity[p][f][e]` (measured with every
token sent through every expert, so it exists even for experts the router never picks). In the
real model an expert's error only reaches a token when the router sends the token to it, so
the expected damage per token is the error times how often the expert is used:

    loss(L, e, f) = usage(L, e) * sum_p sensitivity_L[p][f][e]
    usage(L, e)   = max(routed_count_L[e] / tokens_L,  usage_floor * top_k / E)

`routed_count / tokens` is the expected number of times per token that expert e runs (the
layer's usages sum to top_k). The floor, a fraction (`experts.usage_floor`, default 0.05) of a
uniformly used expert's usage, keeps experts the calibration data never reached from costing
nothing: other data may route to them, and without a floor the solver would give them any
format at all. bf16 has loss 0. The plan's predicted loss is the sum over routed experts; it
adds errors of different layers as if they were independent (a first-order estimate that ranks
plans).

Cross-layer sensitivity: a layer-output error does not reach the model's output equally from
every layer (on the bundled models the loss above grows ~3x with depth relative to the real
effect on the final KL). When the statistics hold the per-layer KL probe (moequant.calib.probe: layer
L's measured share of the KL with its routed experts in one format, the mean of the KL of
quantizing L alone and of the KL saved by restoring L when every MoE layer is quantized),
every loss of layer L (all its experts and formats) is multiplied by

    scale_L = probe KL_L / sum_e usage(L, e) * sum_p sensitivity_L[p][probe format][e]

so layer L in the probe format predicts exactly its measured share, and the solver's objective
approximates the end-to-end KL. Without a complete probe the losses stay unscaled;
`summary.probe` says which happened and why.

Budget
------
`experts.budget.bits_per_weight` counts only routed-expert weight matrices: their bytes (codes,
scales, zero points, from `formats.nbytes`) * 8 / their element count, so it reads like the
usual "4.25 bits" of an int4 model and does not depend on how much of the model is attention.
`experts.budget.gigabytes` counts the whole model (10^9 bytes): every tensor of the plan, kept
ones included as the export layout writes them (bf16; GGUF: F32 norms, biases and routers, the
rest in export.gguf_float, and the output.weight copy of tied embeddings; see `_layout_for`);
the routed experts get what the others leave. The solver minimises the
predicted loss subject to the byte limit exactly (bytes in Python integers, the decimal budget
read exactly): a multiple-choice knapsack, solved by LP relaxation, reduced-cost fixing and a
dynamic program over the few groups left open (see `solve_choices`; a DeepSeek-V3-sized
per-expert problem, 14848 experts x 5 formats, takes seconds, where HiGHS' MILP had not closed
its gap after 120 s). A budget below the smallest feasible plan fails with a sentence giving
that minimum; a budget exactly at it is feasible.

plan.json (schema "moequant.plan/1")
------------------------------------
The fields of plan.model.Plan / TensorPlan, written and read by plan.plan_io:

{
  "schema": "moequant.plan/1",
  "model": str, "target": "vllm" | "vllm-cuda" | "sglang" | "transformers" | "vllm-moequant" | "llama.cpp",
  "method": "budget" | "rules" | "uniform",
  "budget": null | {"bits_per_weight": float | null, "gigabytes": float | null,
                    "routed_bytes_limit": int},      # bytes the routed experts may use
  "candidates": [format key, ...],                   # offered to the routed experts
  "dropped_candidates": {format key: reason},        # refused for the target
  "usage_floor": float,
  "formats": {format key: {"name": str, "params": {...}, "algorithm": str}},
  "tensors": [                                       # every tensor; fused on-disk tensors
    {"name": str,                                    #   (gpt-oss) appear once per expert and
     "role": str, "layer": int|null,                 #   projection, with the same name
     "expert": int|null, "proj": "gate"|"up"|"down"|null,
     "shape": [out, in] (routed experts) or the on-disk shape,
     "format": format key, "params": {...}, "algorithm": "rtn"|"gptq"|"awq"|"none",
     "bytes": int, "kept": str|null,                 # bytes as the export writes it; why it stays bf16
     "usage": float|null, "predicted_loss": float|null}],   # routed experts with stats
  "summary": {
     "layers": {"L": {"map": str, "counts": {format key: experts}}},   # one char per expert
     "legend": {char: format key},
     "bytes_by_role": {role: int}, "weights_by_role": {role: int}, "total_bytes": int,
     "bits_per_weight": {"overall": float, "routed_experts": float},
     "routed_bytes": int, "predicted_loss": float|null,
     "per_expert_alternative": null | {"predicted_loss": float, "routed_bytes": int,  # target
                                       "routed_bits_per_weight": float,              # transformers
                                       "candidates": [...], "counts": {format key: experts}},
     "budget_alternative": null | {same keys},       # rules / uniform plans: the solver at their bytes
     "uniform_alternatives": [{"format": key, "routed_bytes": int, "routed_bits_per_weight": float,
                               "predicted_loss": float|null}],
     "probe": null (no statistics) | {"used": false, "why": str}
              | {"used": true, "format": key, "samples": int, "tokens": int, "algorithm": "rtn"|"gptq",
                 "held_out": bool, "layers": {"L": {"kl": float, "scale": float}}}},
  "notes": [str, ...],
  "recipe": {...}                                    # the resolved recipe
}
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections import Counter, defaultdict
from fractions import Fraction
from typing import Iterable, Sequence

import numpy as np

from moequant.errors import UserError
from moequant.layouts import layout_for
from moequant.layouts.compressed_tensors import sglang_per_layer_block
from moequant.plan.memory import bits_per_weight
from moequant.plan.model import PROJECTIONS, Plan, TensorInfo, TensorPlan, _formats, spec_params
from moequant.plan.recipe import Recipe, recipe_to_dict, resolve_format
from moequant.plan.solver import solve_choices

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
ALWAYS_BF16_ROLES = {
    "router": "the router always stays bf16",
    "shared_expert_gate": "the shared-expert gate always stays bf16",
    "norm": "norms are not quantized",
    "embedding": "embeddings are not quantized",
    "other": "tensors of unknown role are not quantized",
}
NON_EXPERT_ROLES = ("attention", "shared_expert", "dense_mlp", "lm_head")
KEEP_GROUP_ROLES = {
    "router": "router",
    "shared_expert_gate": "shared_expert_gate",
    "shared_experts": "shared_expert",
    "attention": "attention",
    "dense_mlp": "dense_mlp",
    "embeddings": "embedding",
    "lm_head": "lm_head",
    "routed_experts": "routed_expert",
}


def _layout_for(export_format: str):
    """The export layout of a recipe's export.format (moequant.layouts' registry), which the plan's
    byte account asks, so the plan's bytes are the bytes the export writes (tests/test_byte_account.py):
    the zero points it stores (`symmetric_zeros`), how it stores the tensors it leaves unquantized
    (`plain_nbytes`: GGUF writes norms, biases and routers F32, the rest in export.gguf_float, token_embd /
    output in export.gguf_token_embd / gguf_output) and the tensors it adds (`copied_tensors`: GGUF's
    output.weight copy of tied embeddings)."""
    return layout_for(export_format)


# ---------------------------------------------------------------------------------------------
# Serving constraints


def _servable_routed(target: str) -> str:
    if target == "vllm-moequant":
        return "int8 (per channel), symmetric int4, bf16"
    return "fp8, int8, symmetric int4, mxfp4, nvfp4, bf16"


# ---------------------------------------------------------------------------------------------
# Tensor lists


def as_tensor_infos(items: Iterable) -> list[TensorInfo]:
    """Accept TensorInfo or (name, role, layer, expert, proj, shape) tuples."""
    out = []
    for item in items:
        if not isinstance(item, TensorInfo):
            name, role, layer, expert, proj, shape = item
            item = TensorInfo(name, role, layer, expert, proj, tuple(int(s) for s in shape))
        out.append(item)
    return out


def tensors_from_checkpoint(ckpt, adapter=None) -> list[TensorInfo]:
    """Every tensor of a checkpoint, classified by its adapter; fused expert tensors are split
    into one entry per (expert, proj) with the adapter's [out, in] shape."""
    if adapter is None:
        from moequant.arch import adapter_for

        adapter = adapter_for(ckpt.config)
    out = []
    for name in ckpt.keys():
        role = adapter.classify(name)
        shape = tuple(int(s) for s in ckpt.shape(name))
        if role.role == "routed_expert" and role.expert is None and role.proj in ("gate_up", "down", *PROJECTIONS):
            projs = ("gate", "up") if role.proj == "gate_up" else (role.proj,)
            for expert in range(adapter.num_experts):
                for proj in projs:
                    out.append(
                        TensorInfo(name, "routed_expert", role.layer, expert, proj, tuple(adapter.expert_shape(proj)))
                    )
        else:
            out.append(
                TensorInfo(name, role.role, role.layer, role.expert, role.proj, shape, _kept_element_size(ckpt, name))
            )
    return out


def _kept_element_size(ckpt, name: str) -> int:
    """Bytes per element the export writes a kept copy of `name` in: its stored dtype, or the model's
    dense dtype where the source stores it quantized (layouts._write_shards)."""
    if name in ckpt.encodings:
        from moequant.export.layouts import model_dtype

        return model_dtype(ckpt.config).itemsize
    from moequant.io.checkpoint import DTYPE_SIZES

    return DTYPE_SIZES.get(ckpt.dtype(name), 2)


# ---------------------------------------------------------------------------------------------
# Statistics


def _load_stats(stats):
    if stats is None or hasattr(stats, "layers"):
        return stats
    from moequant.calib.stats import load_stats

    return load_stats(stats, with_hessians=False)


def usage_weights(stats, layer: int, num_experts: int, usage_floor: float) -> np.ndarray:
    """Expected runs per token of each expert, floored (see the module docstring)."""
    if layer not in stats.layers:
        raise UserError(
            f"the calibration statistics have no MoE layer {layer}; rerun `moequant calibrate` on this model."
        )
    ls = stats.layers[layer]
    counts = np.asarray(ls.routed_count, dtype=np.float64)
    if counts.shape != (num_experts,):
        raise UserError(
            f"the calibration statistics have {counts.shape[0]} experts in layer {layer}, "
            f"but the model has {num_experts}; rerun `moequant calibrate` on this model."
        )
    tokens = int(ls.tokens)
    if tokens <= 0:
        raise UserError(
            f"the calibration statistics saw no tokens in layer {layer}; rerun `moequant calibrate` with more samples."
        )
    top_k = getattr(ls, "top_k", None) or counts.sum() / tokens
    floor = usage_floor * top_k / num_experts
    return np.maximum(counts / tokens, floor)


def relative_shares(stats, layer: int, num_experts: int) -> np.ndarray:
    if layer not in stats.layers:
        raise UserError(
            f"the calibration statistics have no MoE layer {layer}; rerun `moequant calibrate` on this model."
        )
    return np.asarray(stats.layers[layer].share, dtype=np.float64) * num_experts


def sensitivity(table: dict, layer: int, proj: str, key: str) -> np.ndarray:
    """One layer's sensitivity[proj][key] as float64 [E] (not defined for bf16, which is exact)."""
    if proj not in table or key not in table[proj]:
        have = sorted(table.get(proj, {})) if hasattr(table, "get") else []
        raise UserError(
            f"the calibration statistics have no sensitivity for format {key} in layer {layer} "
            f"({proj}); they have: {', '.join(have) or 'none'}; rerun `moequant calibrate --recipe` "
            f"with this recipe (it measures every format the recipe may choose), or drop it from the recipe."
        )
    return np.asarray(table[proj][key], dtype=np.float64)


# ---------------------------------------------------------------------------------------------
# Plan building


class _Context:
    """What make_plan computes once: routed experts, usage, byte and loss lookups."""

    def __init__(self, recipe: Recipe, tensors: list[TensorInfo], stats, config: dict | None = None):
        self.recipe, self.tensors, self.stats = recipe, tensors, stats
        self.config = config or {}  # the checkpoint's config.json ({} for a list of tensors)
        self.model_type = self.config.get("model_type")
        self.formats = _formats()
        self.layout = _layout_for(recipe.export.format)
        self.experts: dict[tuple[int, int], list[TensorInfo]] = defaultdict(list)
        for t in tensors:
            if t.is_routed_weight:
                self.experts[(t.layer, t.expert)].append(t)
        self.layers = sorted({layer for layer, _ in self.experts})
        self.num_experts = {layer: 1 + max(e for L, e in self.experts if L == layer) for layer in self.layers}
        self._usage: dict[int, np.ndarray] = {}
        self._nbytes: dict[tuple, int] = {}
        self._loss: dict[tuple, float | None] = {}
        self._sensitivity: dict[tuple, np.ndarray] = {}
        # format key -> (layers it cannot hold, the projections there when groups are per projection, why)
        self.unfit: dict[str, tuple[set[int], set[str], str]] = {}
        # (layer, proj) -> loss scale, from the per-layer KL probe, when usable
        self.layer_scale: dict[tuple[int, str], float] | None = None
        self.probe_info: dict | None = None
        if stats is not None:
            self.layer_scale, self.probe_info = _probe_scales(self)

    def nbytes(self, spec, t) -> int:
        """Bytes of tensor `t` (a TensorInfo / TensorPlan) in `spec`, as the export layout writes them."""
        shape = tuple(t.shape)
        if not spec.quantized:  # a layout stores plain tensors by role and, copying them, in their stored dtype
            element_size = getattr(t, "element_size", 2)
            key = (spec.key, shape, t.role, element_size)
            if key not in self._nbytes:
                self._nbytes[key] = self.layout.plain_nbytes(t.role, shape, self.recipe.export, element_size)
            return self._nbytes[key]
        # what the layout writes for it: itself, or its parts (GGUF splits deepseek2's kv_b_proj)
        written = (
            self.layout.written_shapes(self.config, t.name, shape) if t.role in NON_EXPERT_ROLES else [(t.name, shape)]
        )
        key = (spec.key, tuple(s for _, s in written))
        if key not in self._nbytes:
            total = 0
            for name, s in written:
                try:
                    total += self.formats.nbytes(spec, s, symmetric_zeros=self.layout.symmetric_zeros)
                except UserError:
                    self.formats.check_shape(spec, s, name if name == t.name else f"{name} (of {t.name})")
                    raise  # the same refusal, naming the tensor
            self._nbytes[key] = total
        return self._nbytes[key]

    def usage(self, layer: int) -> np.ndarray | None:
        if self.stats is None:
            return None
        if layer not in self._usage:
            self._usage[layer] = usage_weights(
                self.stats, layer, self.num_experts[layer], self.recipe.experts.usage_floor
            )
        return self._usage[layer]

    def tensor_loss(self, t: TensorInfo, key: str) -> float | None:
        if self.stats is None:
            return None
        if not self.formats.spec_of(key).quantized:
            return 0.0
        if (t.layer, t.proj, key) not in self._sensitivity:
            if t.layer not in self.stats.layers:
                raise UserError(
                    f"the calibration statistics have no MoE layer {t.layer}; rerun `moequant calibrate` on this model."
                )
            table = self.stats.layers[t.layer].sensitivity
            self._sensitivity[(t.layer, t.proj, key)] = sensitivity(table, t.layer, t.proj, key)
        scale = self.layer_scale[(t.layer, t.proj)] if self.layer_scale else 1.0
        return float(scale * self.usage(t.layer)[t.expert] * self._sensitivity[(t.layer, t.proj, key)][t.expert])

    def members(self, expert: tuple) -> list[TensorInfo]:
        """The routed tensors of (layer, expert), or of (layer, expert, proj) alone."""
        ts = self.experts[expert[:2]]
        return ts if len(expert) == 2 else [t for t in ts if t.proj == expert[2]]

    def expert_loss(self, expert: tuple, key: str) -> float | None:
        cache_key = (expert, key)
        if cache_key not in self._loss:
            parts = [self.tensor_loss(t, key) for t in self.members(expert)]
            self._loss[cache_key] = None if any(p is None for p in parts) else float(sum(parts))
        return self._loss[cache_key]

    def expert_bytes(self, expert: tuple, spec) -> int:
        return sum(self.nbytes(spec, t) for t in self.members(expert))


def _probe_scales(ctx: _Context) -> tuple[dict[tuple[int, str], float] | None, dict]:
    """Loss scales per (layer, projection) from the statistics' KL probe: (scales or None, what the
    summary says).

    scale_L = layer L's measured KL share in the probe format / this plan's predicted loss of layer
    L in that format (with the recipe's usage floor), so that after scaling, the predicted loss of
    layer L in the probe format is its measured share. Where the probe also measured each
    projection alone (probe.py, `projections`), the share is split between the projections in
    proportion to their one-projection KLs: scale_L,p = kl_L * kl_alone_p / sum_q kl_alone_q /
    predicted_L,p (the projections' sensitivities are errors in two different spaces, see probe.py);
    else every projection takes scale_L. Used only when every MoE layer of the plan has a positive,
    finite scale; otherwise the losses stay unscaled and `why` says so.
    """
    probe = getattr(ctx.stats, "probe", None)
    if not probe or not probe.get("layers"):
        return None, {
            "used": False,
            "why": "the calibration statistics hold no per-layer KL probe "
            "(calibration.probe_samples 0, or statistics from an older version)",
        }
    scales, summary = {}, {}
    for layer in ctx.layers:
        entry = probe["layers"].get(str(layer))
        if entry is None:
            return None, {"used": False, "why": f"the KL probe has no layer {layer}"}
        key, kl = entry["format"], float(entry["kl"])
        if layer not in ctx.stats.layers:
            return None, {"used": False, "why": f"the calibration statistics have no MoE layer {layer}"}
        table = ctx.stats.layers[layer].sensitivity
        try:
            predicted = {p: float(np.dot(ctx.usage(layer), sensitivity(table, layer, p, key))) for p in PROJECTIONS}
        except UserError:
            return None, {"used": False, "why": f"the statistics have no sensitivity for the probe format {key}"}
        total = sum(predicted.values())
        if not (total > 0 and math.isfinite(kl) and kl >= 0):
            return None, {
                "used": False,
                "why": f"the KL probe of layer {layer} has no usable ratio (KL {kl:.3g}, predicted {total:.3g})",
            }
        alone = {p: float(v["kl_alone"]) for p, v in (entry.get("projections") or {}).items()}
        split = set(alone) == set(PROJECTIONS) and all(
            alone[p] > 0 and math.isfinite(alone[p]) and predicted[p] > 0 for p in PROJECTIONS
        )
        if split:
            share = {p: alone[p] / sum(alone.values()) for p in PROJECTIONS}
            scales.update({(layer, p): kl * share[p] / predicted[p] for p in PROJECTIONS})
            summary[str(layer)] = {"kl": kl, "scale": {p: scales[(layer, p)] for p in PROJECTIONS}}
        else:
            scales.update({(layer, p): kl / total for p in PROJECTIONS})
            summary[str(layer)] = {"kl": kl, "scale": kl / total}
    formats_used = sorted({probe["layers"][str(L)]["format"] for L in ctx.layers})
    return scales, {
        "used": True,
        "format": ", ".join(formats_used),
        "samples": probe.get("samples"),
        "tokens": probe.get("tokens"),
        "algorithm": probe.get("algorithm"),
        "held_out": probe.get("held_out", False),
        "layers": summary,
    }


def _keep_match(recipe: Recipe, t: TensorInfo) -> str | None:
    for entry in recipe.keep:
        if entry in KEEP_GROUP_ROLES:
            if KEEP_GROUP_ROLES[entry] == t.role:
                return f"keep: {entry}"
        elif fnmatch.fnmatchcase(t.name, entry) or t.name.startswith(entry.rstrip(".") + "."):
            return f"keep: {entry}"
    return None


def _groups(ctx: _Context, target: str, free: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
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


def _group_options(ctx: _Context, group, specs, notes: list[str] | None):
    """Per candidate that can hold every tensor of the group: (spec, bytes, loss)."""
    options = []
    for spec in specs:
        try:
            total = sum(ctx.expert_bytes(e, spec) for e in group)
        except UserError as error:
            if notes is not None:  # one note per format: the layers it skips and the first reason
                layers, projs, _ = ctx.unfit.setdefault(spec.key, (set(), set(), str(error).rstrip(".")))
                layers.update(item[0] for item in group)
                projs.update(item[2] for item in group if len(item) == 3)  # (layer, expert, proj) items
            continue
        losses = [ctx.expert_loss(e, spec.key) for e in group]
        loss = None if any(x is None for x in losses) else float(sum(losses))
        options.append((spec, total, loss))
    return options


def _layer_text(group) -> str:
    """Layers of a group of (layer, expert) as compact ranges: '0-3, 7'."""
    layers = sorted({item[0] for item in group})
    runs: list[list[int]] = []
    for L in layers:
        if runs and L == runs[-1][1] + 1:
            runs[-1][1] = L
        else:
            runs.append([L, L])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _dedupe(specs) -> list:
    seen, out = set(), []
    for spec in specs:
        if spec.key not in seen:
            seen.add(spec.key)
            out.append(spec)
    return out


def _budget_limit(recipe: Recipe, routed_numel: int, other_bytes: int, fixed_routed: int) -> int:
    """Bytes the decided routed experts may use (may be negative: infeasible)."""
    budget = recipe.experts.budget
    if budget.bits_per_weight is not None:
        return math.floor(Fraction(str(budget.bits_per_weight)) * routed_numel / 8) - fixed_routed
    return math.floor(Fraction(str(budget.gigabytes)) * 10**9) - other_bytes - fixed_routed


def _infeasible_budget(
    recipe: Recipe, min_group_bytes: int, routed_numel: int, other_bytes: int, fixed_routed: int, candidates: list[str]
) -> UserError:
    budget = recipe.experts.budget
    if budget.bits_per_weight is not None:
        minimum = Fraction((min_group_bytes + fixed_routed) * 8, routed_numel)
        shown = math.ceil(minimum * 10**4) / 10**4
        return UserError(
            f"experts.budget.bits_per_weight {budget.bits_per_weight} is below the smallest feasible plan for "
            f"target {recipe.target} with candidates {', '.join(candidates)}: {shown:.4f} bits per routed-expert "
            f"weight; accepted: bits_per_weight >= {shown:.4f}."
        )
    minimum_bytes = min_group_bytes + fixed_routed + other_bytes
    shown = math.ceil(minimum_bytes / 10**3) / 10**6
    return UserError(
        f"experts.budget.gigabytes {budget.gigabytes} is below the smallest feasible plan for target "
        f"{recipe.target} with candidates {', '.join(candidates)}: {minimum_bytes} bytes for the whole model; "
        f"accepted: gigabytes >= {shown:.6f}."
    )


def _option_table(ctx: _Context, groups, specs, notes) -> list[list[tuple]]:
    """_group_options of every group; a group no candidate can hold is refused."""
    table = []
    for group in groups:
        options = _group_options(ctx, group, specs, notes)
        if not options:
            raise UserError(
                f"no candidate format can hold the routed experts of layer(s) {_layer_text(group)}; "
                f"accepted: add a format whose group size divides their input dimension (e.g. int8 or fp8)."
            )
        table.append(options)
    return table


def _solve(ctx: _Context, target: str, free, specs, limit: int, notes, extra=None) -> tuple[dict, int] | None:
    """Budget solve for one target: (expert -> spec, routed bytes of the choice), or None.
    `extra`: {tensor name: [(spec, bytes, loss)]} of non-expert tensors solved in the same budget;
    their choices are in the assignment under their names (their bytes are not in the routed bytes)."""
    groups = _groups(ctx, target, free)
    table = _option_table(ctx, groups, specs, notes)
    extra = extra or {}
    table_all = table + list(extra.values())
    choice = solve_choices(
        [[o[1] for o in opts] for opts in table_all], [[o[2] for o in opts] for opts in table_all], limit, notes
    )
    if choice is None:
        return None
    assignment = {}
    used = 0
    for group, opts, index in zip(groups, table, choice):
        spec, nbytes, _ = opts[index]
        used += nbytes
        for e in group:
            assignment[e] = spec
    for name, opts, index in zip(extra, extra.values(), choice[len(table) :]):
        assignment[name] = opts[index][0]
    return assignment, used


def _non_expert_options(ctx: _Context, recipe: Recipe, plans: list, reference, shapes_only: bool) -> dict:
    """{tensor name: [(spec, bytes, measured KL)]} of the non-expert tensors planned in `reference`
    (non_experts.format) that the budget may move to one of non_experts.formats."""
    if recipe.experts.method != "budget" or not recipe.non_experts.formats or not reference.quantized:
        return {}
    if recipe.target == "sglang":
        raise UserError(
            "non_experts.formats (a per-tensor choice) is not offered for target sglang; use non_experts.format."
        )
    specs = []
    for spec in _dedupe(resolve_format(recipe, f) for f in [recipe.non_experts.format, *recipe.non_experts.formats]):
        why = spec.refuses(recipe.target, routed=False)
        if why and spec.quantized:
            raise UserError(f"non_experts.formats offers {spec.key}, which target {recipe.target} cannot serve: {why}.")
        specs.append(spec)
    measured = None if shapes_only else (getattr(ctx.stats, "tensor_probe", None) or {}).get("tensors")
    out = {}
    for p in plans:
        if p.kept is not None or p.format != reference.key or p.role not in NON_EXPERT_ROLES:
            continue
        options = []
        for spec in specs:
            try:
                nbytes = ctx.nbytes(spec, p)
            except UserError:
                continue  # cannot hold this tensor: not offered
            loss = 0.0
            if spec.quantized and not shapes_only:
                kl = (measured or {}).get(p.name, {}).get(spec.key)
                if kl is None:
                    raise UserError(
                        f"the calibration statistics hold no per-tensor KL of {p.name} in {spec.key} "
                        f"(non_experts.formats); rerun `moequant calibrate --recipe` with this recipe."
                    )
                loss = float(kl)
            options.append((spec, nbytes, loss))
        out[p.name] = options
    return out


def _sglang_per_layer(spec) -> bool:
    """SGLang's WNA16 MoE takes per-layer schemes only in a pack-quantized checkpoint (int, or bf16 kept)."""
    return spec.family.ct_format in ("pack-quantized", "dense")


def _solve_sglang(ctx: _Context, free, specs, limit: int, notes):
    """SGLang: the better of one format for the model and one INT4 / INT8 (/ bf16) format per layer."""
    best = _solve(ctx, "sglang", free, specs, limit, notes)
    per_layer_specs = [s for s in specs if _sglang_per_layer(s)]
    why = sglang_per_layer_block({t.name for ts in ctx.experts.values() for t in ts})
    if why:
        if notes is not None:
            notes.append(f"{why}: one routed-expert format for the whole model.")
        return best
    if not per_layer_specs:
        return best
    per_layer = _solve(ctx, "vllm", free, per_layer_specs, limit, None)  # vllm's unit: one format per layer
    if per_layer is not None and (best is None or _predicted_loss(ctx, per_layer[0]) <= _predicted_loss(ctx, best[0])):
        return per_layer
    return best


def _min_bytes(ctx: _Context, target: str, free, specs) -> int:
    return sum(min(o[1] for o in _group_options(ctx, g, specs, None)) for g in _groups(ctx, target, free))


def needs_statistics(recipe: Recipe) -> bool:
    """Whether the plan depends on calibration statistics: a budget (sensitivities) or rules on
    routing shares. Uniform formats and layer rules need none: such a run calibrates nothing
    (the quantize pass collects GPTQ / AWQ's inputs itself)."""
    if recipe.experts.method == "budget":
        return True
    if recipe.experts.method == "rules":
        return any(r.share_at_least is not None or r.share_below is not None for r in recipe.experts.rules or [])
    return False


def _apply_rules(ctx: _Context, recipe: Recipe, free) -> dict:
    rules = recipe.experts.rules
    needs_share = any(r.share_at_least is not None or r.share_below is not None for r in rules)
    if needs_share and ctx.stats is None:
        raise UserError(
            "experts.rules use share_at_least / share_below, which need calibration statistics; "
            "run `moequant calibrate` first and pass its statistics."
        )
    specs = [resolve_format(recipe, r.format) for r in rules]
    layer_sets = [r.layer_set() for r in rules]
    assignment = {}
    shares = {}
    for layer, expert in free:
        if needs_share and layer not in shares:
            shares[layer] = relative_shares(ctx.stats, layer, ctx.num_experts[layer])
        for i, rule in enumerate(rules):
            if layer_sets[i] is not None and layer not in layer_sets[i]:
                continue
            share = shares[layer][expert] if needs_share else None
            if rule.share_at_least is not None and not share >= rule.share_at_least:
                continue
            if rule.share_below is not None and not share < rule.share_below:
                continue
            assignment[(layer, expert)] = specs[i]
            break
        else:
            detail = f" (routing share {shares[layer][expert]:.3g}x the layer mean)" if needs_share else ""
            raise UserError(
                f"no rule in experts.rules matches layer {layer} expert {expert}{detail}; "
                f"accepted: end the rules with one without conditions, such as {{format: int4}}."
            )
    return assignment


def _check_uniform_groups(ctx: _Context, target: str, assignment: dict) -> None:
    unit = GRANULARITY[target]
    if (
        target == "sglang"
        and all(_sglang_per_layer(s) for s in assignment.values())
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


def _copied_tensors(ctx: _Context, tensors: list[TensorInfo]) -> list[TensorPlan]:
    """Kept entries for the tensors the export layout adds (GGUF: output.weight, a copy of tied
    embeddings), so the plan's bytes and a gigabytes budget count them."""
    by_name = {t.name: t for t in tensors}
    bf16 = _formats().get_format("bf16")
    out = []
    for name, role, source in ctx.layout.copied_tensors(by_name):
        if source not in by_name:
            continue  # nothing to copy in this tensor list
        t = dataclasses.replace(by_name[source], name=name, role=role)
        out.append(
            TensorPlan(
                t.name,
                t.role,
                t.layer,
                t.expert,
                t.proj,
                t.shape,
                bf16.key,
                spec_params(bf16),
                ctx.recipe.algorithm_for(bf16.name),
                ctx.nbytes(bf16, t),
                kept=f"the {ctx.layout.name} export writes {source} again as {name}",
            )
        )
    return out


def _short_list(values: list[int]) -> str:
    return ", ".join(map(str, values[:6])) + (", ..." if len(values) > 6 else "")


def make_plan(recipe: Recipe, checkpoint_or_tensors, stats=None) -> Plan:
    """Decide a format for every tensor.

    checkpoint_or_tensors: an open checkpoint (its adapter classifies the tensors), or a list of
    TensorInfo / (name, role, layer, expert, proj, shape) tuples. stats: a loaded statistics
    object, a statistics directory, or None (allowed for uniform plans and layer-only rules).
    """
    return _make_plan(recipe, checkpoint_or_tensors, _load_stats(stats), shapes_only=False)


def check_plan(recipe: Recipe, checkpoint_or_tensors) -> list[str]:
    """Refuse, before any calibration, what the recipe and the tensor shapes alone decide: an
    infeasible budget (the smallest plan is known from shapes), a format that cannot hold a tensor,
    a format the target cannot serve, keep entries the target cannot serve. Returns the plan's notes
    (e.g. a candidate not offered to some layers, and why). Reads no weights or statistics."""
    return _make_plan(recipe, checkpoint_or_tensors, None, shapes_only=True)


def _make_plan(recipe: Recipe, checkpoint_or_tensors, stats, shapes_only: bool):
    """make_plan, or with shapes_only the checks of check_plan (its notes returned, no plan)."""
    config = None
    if hasattr(checkpoint_or_tensors, "keys") and hasattr(checkpoint_or_tensors, "shape"):
        tensors = tensors_from_checkpoint(checkpoint_or_tensors)
        config = checkpoint_or_tensors.config
    else:
        tensors = as_tensor_infos(checkpoint_or_tensors)
    ctx = _Context(recipe, tensors, stats, config)
    target = recipe.target
    notes: list[str] = []
    if not ctx.experts:
        raise UserError(f"model {recipe.model} has no routed expert weights for moequant to plan.")

    # Non-routed tensors: fixed formats.
    non_expert_spec = resolve_format(recipe, recipe.non_experts.format)
    plans = _non_expert_plans(ctx, recipe, tensors, non_expert_spec)
    kept_experts = _kept_experts(recipe, tensors)
    _check_kept_experts(ctx, recipe, kept_experts, notes)
    free = [e for e in sorted(ctx.experts) if e not in kept_experts]
    sizes = _byte_sizes(ctx, plans, kept_experts)

    # Routed experts.
    method = recipe.experts.method
    dropped: dict[str, str] = {}
    budget_info = None
    if method == "budget":
        solved = _budget_assignment(ctx, recipe, plans, non_expert_spec, free, sizes, shapes_only, notes)
        if solved is None:  # shapes_only: the smallest plan fits the budget
            return notes
        assignment, specs, dropped, budget_info = solved
    else:
        assignment = _rules_assignment(ctx, recipe, free, shapes_only)
        specs = _dedupe(assignment.values())
    _check_expert_bytes(ctx, assignment)
    if shapes_only:
        return notes

    bf16 = _formats().get_format("bf16")
    for e in kept_experts:
        assignment[e] = bf16
    plans += _routed_plans(ctx, recipe, tensors, assignment, kept_experts)
    used_specs = _dedupe([*specs, *assignment.values()])
    plan = Plan(
        model=recipe.model,
        target=target,
        method=method,
        budget=budget_info,
        candidates=[s.key for s in specs],
        dropped_candidates=dropped,
        usage_floor=recipe.experts.usage_floor,
        formats={
            s.key: {"name": s.name, "params": spec_params(s), "algorithm": recipe.algorithm_for(s.name)}
            for s in used_specs
        },
        tensors=plans,
        notes=notes,
        recipe=recipe_to_dict(recipe),
    )
    plan.summary = _summary(plan, ctx, free, budget_info)
    return plan


def _non_expert_plans(ctx: _Context, recipe: Recipe, tensors: list[TensorInfo], non_expert_spec) -> list[TensorPlan]:
    """The plans of every tensor but the routed experts: non_experts.format, or bf16 with the reason."""
    reason = non_expert_spec.refuses(recipe.target, routed=False)
    if reason and non_expert_spec.quantized:
        raise UserError(
            f"non_experts.format {non_expert_spec.key} cannot be served by target {recipe.target}: "
            f"{reason}; accepted: bf16, fp8, int8, int4 (symmetric or not), mxfp4, nvfp4."
        )
    bf16 = _formats().get_format("bf16")
    plans: list[TensorPlan] = []
    for t in tensors:
        if t.is_routed_weight:
            continue
        why = _non_expert_kept_reason(recipe, t) or ctx.layout.kept_reason(ctx.model_type, t.name)
        spec = bf16 if why else non_expert_spec
        if not spec.quantized and not why:
            why = "non_experts.format is bf16"
        try:
            nbytes = ctx.nbytes(spec, t)
        except UserError as error:
            raise UserError(
                f"non_experts.format {spec.key} cannot hold tensor {t.name}: {str(error).rstrip('.')}."
            ) from None
        plans.append(
            TensorPlan(
                t.name,
                t.role,
                t.layer,
                t.expert,
                t.proj,
                t.shape,
                spec.key,
                spec_params(spec),
                recipe.algorithm_for(spec.name),
                nbytes,
                kept=None if spec.quantized else why,
            )
        )
    plans += _copied_tensors(ctx, tensors)
    return plans


def _non_expert_kept_reason(recipe: Recipe, t: TensorInfo) -> str | None:
    """Why a non-routed tensor stays bf16 whatever non_experts.format says, or None."""
    why = ALWAYS_BF16_ROLES.get(t.role)
    if why is None and (len(t.shape) < 2 or t.name.endswith("bias") or t.role == "routed_expert"):
        why = "biases and vectors are not quantized"
    if why is None:
        why = _keep_match(recipe, t)
    if why is None and t.role not in NON_EXPERT_ROLES:
        why = f"role {t.role} is not quantized"
    return why


def _kept_experts(recipe: Recipe, tensors: list[TensorInfo]) -> dict[tuple[int, int], str]:
    """(layer, expert) -> the keep entry that holds it bf16 (any one of its projections matching)."""
    kept: dict[tuple[int, int], str] = {}
    for t in tensors:
        if t.is_routed_weight:
            why = _keep_match(recipe, t)
            if why:
                kept.setdefault((t.layer, t.expert), why)
    return kept


def _check_kept_experts(ctx: _Context, recipe: Recipe, kept_experts: dict, notes: list[str]) -> None:
    """Note keep entries that match only some projections of an expert; refuse kept experts that
    split a group the target serves in one format."""
    target = recipe.target
    for (layer, expert), why in kept_experts.items():
        projs = {t.proj for t in ctx.experts[(layer, expert)] if _keep_match(recipe, t)}
        if len(projs) < len(ctx.experts[(layer, expert)]):
            notes.append(
                f"{why} matches only some projections of layer {layer} expert {expert}; the whole expert "
                f"stays bf16, since one format covers an expert's gate, up and down."
            )
    unit = GRANULARITY[target]
    if unit != "expert" and kept_experts:
        per_layer = unit in ("layer", "layer_proj") or target == "sglang"  # sglang: kept layers are ignored ones
        scopes = {L for L, _ in kept_experts} if per_layer else {"all"}
        for scope in scopes:
            members = [e for e in ctx.experts if unit == "model" or e[0] == scope]
            partial = [e for e in members if e not in kept_experts]
            if partial:
                where = f"layer {scope}" if per_layer else "the model"
                raise UserError(
                    f"keep holds only some routed experts of {where} in bf16, which target {target} "
                    f"cannot serve (one format per {unit}); accepted: keep whole layers "
                    f"(e.g. model.layers.3.mlp.experts.*), routed_experts, or target transformers."
                )


def _byte_sizes(ctx: _Context, plans: list[TensorPlan], kept_experts: dict) -> tuple[int, int, int]:
    """(routed_numel, other_bytes, fixed_routed): the routed experts' element count, the bytes of the
    non-routed tensors as planned, the bytes of the kept experts in bf16 (what a budget counts)."""
    bf16 = _formats().get_format("bf16")
    other_bytes = sum(p.bytes for p in plans)
    routed_numel = sum(t.numel for ts in ctx.experts.values() for t in ts)
    fixed_routed = sum(ctx.expert_bytes(e, bf16) for e in kept_experts)
    return routed_numel, other_bytes, fixed_routed


def _budget_candidates(recipe: Recipe) -> tuple[list, dict[str, str]]:
    """experts.formats the target can serve, and {format key: why} of those it cannot."""
    target = recipe.target
    dropped: dict[str, str] = {}
    specs = []
    for spec in _dedupe(resolve_format(recipe, f) for f in recipe.experts.formats):
        why = spec.refuses(target, routed=True)
        if why:
            dropped[spec.key] = why
        else:
            specs.append(spec)
    if not specs:
        raise UserError(
            f"experts.formats offers no format that target {target} can serve "
            f"({'; '.join(f'{k}: {v}' for k, v in dropped.items())}); accepted: fp8, int8, "
            f"symmetric int4, mxfp4, nvfp4, bf16."
        )
    return specs, dropped


def _budget_assignment(
    ctx: _Context,
    recipe: Recipe,
    plans: list[TensorPlan],
    non_expert_spec,
    free,
    sizes: tuple[int, int, int],
    shapes_only: bool,
    notes: list[str],
):
    """experts.method budget: (expert -> spec, candidates, dropped candidates, the plan's budget), with
    the non-expert tensors of non_experts.formats moved to their chosen formats in `plans`. With
    shapes_only None, once the smallest plan is known to fit. sizes: _byte_sizes."""
    target = recipe.target
    if ctx.stats is None and not shapes_only:
        raise UserError(
            "experts.method budget needs calibration statistics (routing and sensitivity); "
            "run `moequant calibrate` first and pass its statistics."
        )
    specs, dropped = _budget_candidates(recipe)
    limit = _budget_limit(recipe, *sizes)
    flexible = _non_expert_options(ctx, recipe, plans, non_expert_spec, shapes_only)
    flex_bytes = sum(p.bytes for p in plans if p.name in flexible)
    limit += flex_bytes  # the budget counts them at non_experts.format; the solve may move bytes
    if shapes_only:  # feasibility is the smallest option of every group against the limit
        table = _option_table(ctx, _groups(ctx, target, free), specs, notes) + list(flexible.values())
        minimum = sum(min(o[1] for o in options) for options in table)
        notes.extend(_unfit_notes(ctx))
        if minimum > limit:  # shown per routed weight, the flexible tensors counted at non_experts.format
            raise _infeasible_budget(recipe, minimum - flex_bytes, *sizes, [s.key for s in specs])
        return None
    if not (free or flexible):
        solved = ({}, 0)
    elif target == "sglang":
        solved = _solve_sglang(ctx, free, specs, limit, notes)
    else:
        solved = _solve(ctx, target, free, specs, limit, notes, extra=flexible)
    notes.extend(_unfit_notes(ctx))
    if solved is None:
        raise _infeasible_budget(recipe, _min_bytes(ctx, target, free, specs), *sizes, [s.key for s in specs])
    assignment, _ = solved
    _set_non_expert_choices(recipe, plans, flexible, assignment)
    budget_info = {
        "bits_per_weight": recipe.experts.budget.bits_per_weight,
        "gigabytes": recipe.experts.budget.gigabytes,
        "routed_bytes_limit": limit + sizes[2],
    }
    return assignment, specs, dropped, budget_info


def _unfit_notes(ctx: _Context) -> list[str]:
    notes = []
    for key, (layers, projs, why) in ctx.unfit.items():
        which = f"{', '.join(f'{p}_proj' for p in PROJECTIONS if p in projs)} of " if projs else ""
        notes.append(f"{key} is not offered to {which}layer(s) {_layer_text([(L, 0) for L in layers])}: {why}.")
    return notes


def _set_non_expert_choices(recipe: Recipe, plans: list[TensorPlan], flexible: dict, assignment: dict) -> None:
    """Move the solved non-expert tensors (popped from `assignment`) to their chosen formats, with their measured KL."""
    for p in plans:
        if p.name in flexible:
            spec = assignment.pop(p.name)
            p.format, p.params, p.algorithm = spec.key, spec_params(spec), recipe.algorithm_for(spec.name)
            p.bytes = next(b for s_, b, _ in flexible[p.name] if s_.key == spec.key)
            p.predicted_loss = next(loss for s_, _, loss in flexible[p.name] if s_.key == spec.key)
            p.kept = None if spec.quantized else "non_experts.formats"


def _rules_assignment(ctx: _Context, recipe: Recipe, free, shapes_only: bool) -> dict:
    """experts.method uniform / rules: expert -> spec, refused where the target cannot serve it. With
    shapes_only and rules on routing shares (which rule matches needs statistics) the rules' formats
    are checked and the assignment is empty."""
    target, method = recipe.target, recipe.experts.method
    if method == "uniform":
        spec = resolve_format(recipe, recipe.experts.format)
        assignment = {e: spec for e in free}
    elif shapes_only and needs_statistics(recipe):
        assignment = {}
        for rule in recipe.experts.rules:
            spec = resolve_format(recipe, rule.format)
            why = spec.refuses(target, routed=True)
            if why:
                raise UserError(
                    f"experts.rules gives routed experts {spec.key}, which target {target} cannot "
                    f"serve: {why}; accepted: {_servable_routed(target)}, or target transformers."
                )
    else:
        assignment = _apply_rules(ctx, recipe, free)
    for spec in _dedupe(assignment.values()):
        why = spec.refuses(target, routed=True)
        if why:
            key = "experts.format" if method == "uniform" else "experts.rules"
            raise UserError(
                f"{key} gives routed experts {spec.key}, which target {target} cannot serve: {why}; "
                f"accepted: {_servable_routed(target)}, or target transformers."
            )
    _check_uniform_groups(ctx, target, assignment)
    return assignment


def _check_expert_bytes(ctx: _Context, assignment: dict) -> None:
    """Refuse a format that cannot hold an expert (or an expert's projection) it was given."""
    for key, spec in assignment.items():
        try:
            ctx.expert_bytes(key, spec)
        except UserError as error:
            what = f"layer {key[0]} expert {key[1]}" + (f" ({key[2]})" if len(key) == 3 else "")
            raise UserError(f"format {spec.key} cannot hold {what}: {str(error).rstrip('.')}.") from None


def _routed_plans(
    ctx: _Context, recipe: Recipe, tensors: list[TensorInfo], assignment: dict, kept_experts: dict
) -> list[TensorPlan]:
    """The plans of the routed-expert tensors in their assigned formats, with usage and predicted loss."""
    plans = []
    for t in tensors:
        if not t.is_routed_weight:
            continue
        spec = assignment.get((t.layer, t.expert, t.proj)) or assignment[(t.layer, t.expert)]
        usage = ctx.usage(t.layer)
        loss = ctx.tensor_loss(t, spec.key) if ctx.stats is not None else None
        plans.append(
            TensorPlan(
                t.name,
                t.role,
                t.layer,
                t.expert,
                t.proj,
                t.shape,
                spec.key,
                spec_params(spec),
                recipe.algorithm_for(spec.name),
                ctx.nbytes(spec, t),
                kept=kept_experts.get((t.layer, t.expert)),
                usage=None if usage is None else float(usage[t.expert]),
                predicted_loss=loss,
            )
        )
    return plans


def _predicted_loss(ctx: _Context, assignment: dict) -> float | None:
    if ctx.stats is None:
        return None
    try:
        return float(sum(ctx.expert_loss(e, spec.key) for e, spec in assignment.items()))
    except UserError:
        return None


def _summary(plan: Plan, ctx: _Context, free, budget_info) -> dict:
    recipe = ctx.recipe
    bytes_by_role: Counter = Counter()
    weights_by_role: Counter = Counter()
    for t in plan.tensors:
        bytes_by_role[t.role] += t.bytes
        weights_by_role[t.role] += math.prod(t.shape)
    routed = [t for t in plan.tensors if t.role == "routed_expert" and t.expert is not None and t.proj in PROJECTIONS]
    routed_bytes = sum(t.bytes for t in routed)
    routed_numel = sum(math.prod(t.shape) for t in routed)
    total_bytes = sum(bytes_by_role.values())
    total_numel = sum(weights_by_role.values())
    expert_keys = plan.expert_formats()
    legend = _legend(sorted(set(expert_keys.values())))
    char_of = {k: c for c, k in legend.items()}
    layers = {}
    for layer in ctx.layers:
        keys = [expert_keys[(layer, e)] for e in range(ctx.num_experts[layer]) if (layer, e) in expert_keys]
        layers[str(layer)] = {"map": "".join(char_of[k] for k in keys), "counts": dict(Counter(keys))}
    has_loss = ctx.stats is not None and all(t.predicted_loss is not None for t in routed)
    loss = float(sum(t.predicted_loss for t in routed)) if has_loss else None

    # What the same bytes buy per expert (target transformers), and what uniform formats cost.
    alternative = budget_alternative = None
    uniform = []
    if ctx.stats is not None and free:
        free_set = set(free)
        fixed_bytes = sum(t.bytes for t in routed if (t.layer, t.expert) not in free_set)
        entries = list(recipe.experts.formats) + list(plan.formats)
        limit = (budget_info["routed_bytes_limit"] if budget_info else routed_bytes) - fixed_bytes
        if plan.target != "transformers":
            alternative = _alternative(ctx, "transformers", free, entries, limit, fixed_bytes)
        if plan.method != "budget":
            budget_alternative = _alternative(ctx, plan.target, free, entries, limit, fixed_bytes)
        for key in plan.candidates:
            spec = _formats().parse_key(key)
            try:
                nbytes = sum(ctx.expert_bytes(e, spec) for e in free)
            except UserError:
                continue
            uniform.append(
                {
                    "format": key,
                    "routed_bytes": nbytes + fixed_bytes,
                    "predicted_loss": _predicted_loss(ctx, {e: spec for e in free}),
                }
            )
    for alt in [alternative, budget_alternative, *uniform]:  # the same bits per weight as this plan's
        if alt:
            alt["routed_bits_per_weight"] = bits_per_weight(alt["routed_bytes"], routed_numel)
    return {
        "layers": layers,
        "legend": legend,
        "bytes_by_role": dict(bytes_by_role),
        "weights_by_role": dict(weights_by_role),
        "total_bytes": total_bytes,
        "bits_per_weight": {
            "overall": bits_per_weight(total_bytes, total_numel),
            "routed_experts": bits_per_weight(routed_bytes, routed_numel),
        },
        "routed_bytes": routed_bytes,
        "predicted_loss": loss,
        "per_expert_alternative": alternative,
        "budget_alternative": budget_alternative,
        "uniform_alternatives": uniform,
        "probe": ctx.probe_info,
    }


def _alternative(ctx: _Context, target: str, free, entries, limit: int, fixed_bytes: int) -> dict | None:
    """The budget plan for `target` over `entries` (servable, with sensitivities) within `limit`."""
    specs = []
    for spec in _dedupe(resolve_format(ctx.recipe, f) for f in entries):
        if spec.refuses(target, routed=True):
            continue
        try:
            for e in free:
                ctx.expert_loss(e, spec.key)
        except UserError:
            continue
        specs.append(spec)
    try:
        solver = _solve_sglang if target == "sglang" else (lambda c, *a: _solve(c, target, *a))
        solved = solver(ctx, free, specs, limit, None) if specs else None
    except UserError:
        return None
    if solved is None:
        return None
    assignment, used = solved
    return {
        "predicted_loss": _predicted_loss(ctx, assignment),  # kept experts are bf16: loss 0
        "routed_bytes": used + fixed_bytes,
        "candidates": [s.key for s in specs],
        "counts": dict(Counter(s.key for s in assignment.values())),
    }


def _legend(keys: list[str]) -> dict[str, str]:
    legend: dict[str, str] = {}
    spare = iter("abcdefghijklmnopqrstuvwxyz")
    for key in keys:
        spec = _formats().parse_key(key)
        char = spec.family.map_char(spec)
        if char is None or char in legend:
            char = next(spare)
        legend[char] = key
    return legend


def budget_frontier(recipe: Recipe, checkpoint_or_tensors, stats, bits_per_weight: Sequence[float]) -> dict:
    """Predicted loss vs routed-expert bytes for several budgets (the quality-memory frontier).

    For each budget in bits per routed-expert weight: the plan for the recipe's target and the
    per-expert plan (target transformers, the recipe's full candidate list), or the sentence
    saying why that budget is infeasible; plus every candidate as a uniform plan. Measured KL
    for these points comes from `moequant eval` on the plans' checkpoints.
    """
    if hasattr(checkpoint_or_tensors, "keys") and hasattr(checkpoint_or_tensors, "shape"):
        checkpoint_or_tensors = tensors_from_checkpoint(checkpoint_or_tensors)
    stats = _load_stats(stats)
    experts = recipe.experts.model_copy(update={"method": "budget"})

    def point(target: str, bits: float) -> dict:
        budget = (
            experts.budget.model_copy(update={"bits_per_weight": bits, "gigabytes": None}) if experts.budget else None
        )
        if budget is None:
            from moequant.plan.recipe import Budget

            budget = Budget(bits_per_weight=bits)
        variant = recipe.model_copy(update={"target": target, "experts": experts.model_copy(update={"budget": budget})})
        try:
            plan = make_plan(variant, checkpoint_or_tensors, stats)
        except UserError as error:
            return {"bits_per_weight": bits, "error": str(error)}
        s = plan.summary
        counts = Counter(plan.expert_formats().values())
        return {
            "bits_per_weight": bits,
            "routed_bytes": s["routed_bytes"],
            "total_bytes": s["total_bytes"],
            "routed_bits_per_weight": s["bits_per_weight"]["routed_experts"],
            "predicted_loss": s["predicted_loss"],
            "counts": dict(counts),
        }

    budgets = [float(b) for b in bits_per_weight]
    out = {
        "target": recipe.target,
        "budgets": budgets,
        "serving": [point(recipe.target, b) for b in budgets],
        "per_expert": [point("transformers", b) for b in budgets] if recipe.target != "transformers" else None,
        "uniform": [],
    }
    for entry in _dedupe_entries(recipe):
        variant = recipe.model_copy(
            update={
                "target": "transformers",
                "experts": experts.model_copy(update={"method": "uniform", "format": entry}),
            }
        )
        try:
            plan = make_plan(variant, checkpoint_or_tensors, stats)
        except UserError as error:
            out["uniform"].append({"format": entry, "error": str(error)})
            continue
        s = plan.summary
        out["uniform"].append(
            {
                "format": next(iter(plan.expert_formats().values())),
                "routed_bytes": s["routed_bytes"],
                "routed_bits_per_weight": s["bits_per_weight"]["routed_experts"],
                "predicted_loss": s["predicted_loss"],
            }
        )
    return out


def _dedupe_entries(recipe: Recipe) -> list[str]:
    seen, out = set(), []
    for entry in recipe.experts.formats:
        key = resolve_format(recipe, entry).key
        if key not in seen:
            seen.add(key)
            out.append(entry)
    return out
