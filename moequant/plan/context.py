"""What the planner computes once per plan (PlanContext: routed experts, usage, byte and loss lookups),
the tensor list it plans (from a checkpoint or a list) and the readers of calibration statistics.

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
effect on the final KL). When the statistics hold the per-layer KL probe (moequant.measure.probe: layer
L's measured share of the KL with its routed experts in one format, the mean of the KL of
quantizing L alone and of the KL saved by restoring L when every MoE layer is quantized),
every loss of layer L (all its experts and formats) is multiplied by

    scale_L = probe KL_L / sum_e usage(L, e) * sum_p sensitivity_L[p][probe format][e]

so layer L in the probe format predicts exactly its measured share, and the solver's objective
approximates the end-to-end KL. Without a complete probe the losses stay unscaled;
`summary.probe` says which happened and why.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable

import numpy as np

from moequant.errors import UserError
from moequant.layouts import layout_for
from moequant.plan.model import NON_EXPERT_ROLES, PROJECTIONS, TensorInfo, _formats
from moequant.plan.recipe import Recipe


def _layout_for(export_format: str):
    """The export layout of a recipe's export.format (moequant.layouts. registry), which the plan's
    byte account asks, so the plan's bytes are the bytes the export writes (tests/test_byte_account.py):
    the zero points it stores (`symmetric_zeros`), how it stores the tensors it leaves unquantized
    (`plain_nbytes`: GGUF writes norms, biases and routers F32, the rest in export.gguf_float, token_embd /
    output in export.gguf_token_embd / gguf_output) and the tensors it adds (`copied_tensors`: GGUF's
    output.weight copy of tied embeddings; `added_tensors`: Gemma-4's GGUF rope_freqs)."""
    return layout_for(export_format)


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
    adapter = adapter or ckpt.adapter  # built once, kept on the checkpoint
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
            out.append(TensorInfo(name, role.role, role.layer, role.expert, role.proj, shape, ckpt.kept_itemsize(name)))
    return out


def loaded_stats(stats):
    if stats is None or hasattr(stats, "layers"):
        return stats
    from moequant.measure.stats import load_stats

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


class PlanContext:
    """What make_plan computes once: routed experts, usage, byte and loss lookups."""

    def __init__(self, recipe: Recipe, tensors: list[TensorInfo], stats, config: dict | None = None, adapter=None):
        self.recipe, self.tensors, self.stats = recipe, tensors, stats
        self.config = config or {}  # the checkpoint's config.json ({} for a list of tensors)
        self.model_type = self.config.get("model_type")
        self.formats = _formats()
        self.layout = _layout_for(recipe.export.format)
        # what the export layout does to this model's tensors whatever the recipe says, asked once: the
        # non-expert tensors it writes unquantized (name -> why) and the tensors it adds (name, role, source)
        names = {t.name for t in tensors}
        self.layout_kept = {
            t.name: why
            for t in tensors
            if not t.is_routed_weight and (why := self.layout.kept_reason(self.model_type, t.name))
        }
        self.layout_copies = [c for c in self.layout.copied_tensors(names) if c[2] in names]
        # and those it makes from the config alone (name, role, shape, bytes): Gemma-4's GGUF rope_freqs
        # (the checkpoint's adapter, built once on it: none for a list of tensors)
        self.layout_added = self.layout.added_tensors(adapter, self.config) if adapter is not None else []
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
        self.use_stats(stats)

    def use_stats(self, stats) -> None:
        """Plan from these statistics (or None) from now on: what was looked up before is forgotten, but for the
        bytes, which shapes alone decide (the precheck's context is the plan stage's: policy.PlanShapes)."""
        self.stats = stats
        self._usage.clear()
        self._loss.clear()
        self._sensitivity.clear()
        self.unfit.clear()
        self.layer_scale, self.probe_info = _probe_scales(self) if stats is not None else (None, None)

    def nbytes(self, spec, t) -> int:
        """Bytes of tensor `t` (a TensorInfo / TensorPlan) in `spec`, as the export layout writes them."""
        shape = tuple(t.shape)
        if not spec.quantized:  # a layout stores plain tensors by role and, copying them, in their stored dtype
            element_size = getattr(t, "element_size", 2)
            name = None if t.role == "routed_expert" else t.name  # a layout may store the others by name
            key = (spec.key, shape, t.role, element_size, name)
            if key not in self._nbytes:
                self._nbytes[key] = self.layout.plain_nbytes(
                    t.role, shape, self.recipe.export, element_size, name=name, config=self.config
                )
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


def _probe_scales(ctx: PlanContext) -> tuple[dict[tuple[int, str], float] | None, dict]:
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


def predicted_loss(ctx: PlanContext, assignment: dict) -> float | None:
    if ctx.stats is None:
        return None
    try:
        return float(sum(ctx.expert_loss(e, spec.key) for e, spec in assignment.items()))
    except UserError:
        return None
