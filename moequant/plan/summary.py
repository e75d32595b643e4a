"""The plan's summary: the dict make_plan stores in plan.summary (plan_summary: bytes and bits by role,
the per-layer map, the predicted loss and the alternatives at the same bytes) and its text, which
`moequant plan` prints (format_summary, bytes with plan.memory.format_bytes)."""

from __future__ import annotations

import math
from collections import Counter

from moequant.errors import UserError
from moequant.plan.budget import alternative_budget_plan
from moequant.plan.context import PlanContext, predicted_loss
from moequant.plan.memory import bits_per_weight, format_bytes
from moequant.plan.model import PROJECTIONS, Plan, _formats
from moequant.targets import ANY_MIX


def plan_summary(plan: Plan, ctx: PlanContext, free, budget_info) -> dict:
    """The plan's summary dict (plan.json's `summary`, laid out in plan.model's docstring)."""
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
        if plan.target != ANY_MIX:
            alternative = alternative_budget_plan(ctx, ANY_MIX, free, entries, limit, fixed_bytes)
        if plan.method != "budget":
            budget_alternative = alternative_budget_plan(ctx, plan.target, free, entries, limit, fixed_bytes)
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
                    "predicted_loss": predicted_loss(ctx, {e: spec for e in free}),
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


def _bits(alt: dict) -> str:
    return f" ({alt['routed_bits_per_weight']:.3f} bits per weight)" if "routed_bits_per_weight" in alt else ""


MAP_WIDTH = 128  # a layer's map is cut after this many experts (the counts cover them all)


def format_summary(plan: Plan) -> str:
    s = plan.summary
    lines = [f"plan for {plan.model}: target {plan.target}, method {plan.method}"]
    if plan.budget:
        b = plan.budget
        what = (
            f"{b['bits_per_weight']} bits per routed-expert weight"
            if b.get("bits_per_weight") is not None
            else f"{b['gigabytes']} GB for the whole model"
        )
        lines.append(f"budget: {what} (routed experts may use {format_bytes(b['routed_bytes_limit'])})")
    if plan.candidates:
        lines.append("candidates: " + ", ".join(plan.candidates))
    for key, why in plan.dropped_candidates.items():
        lines.append(f"dropped for target {plan.target}: {key} ({why})")
    legend = ", ".join(f"{c}={k}" for c, k in s["legend"].items())
    lines.append(f"routed experts per layer, one character per expert ({legend}), and their counts:")
    for layer, info in s["layers"].items():
        counts = ", ".join(f"{k} x{n}" for k, n in info["counts"].items())
        shown = info["map"] if len(info["map"]) <= MAP_WIDTH else f"{info['map'][:MAP_WIDTH]}... ({len(info['map'])})"
        lines.append(f"  L{int(layer):>3}  {shown}  {counts}")
    bpw = s["bits_per_weight"]
    lines.append(f"bits per weight: {bpw['routed_experts']:.3f} routed experts, {bpw['overall']:.3f} overall")
    lines.append(
        f"bytes: {format_bytes(s['total_bytes'])} total; "
        + ", ".join(
            f"{role} {format_bytes(n)}" for role, n in sorted(s["bytes_by_role"].items(), key=lambda kv: -kv[1])
        )
    )
    if s["predicted_loss"] is not None:
        lines.append(f"predicted loss: {s['predicted_loss']:.6g}")
    alt = s.get("per_expert_alternative")
    if alt:
        extra = (
            f"; serving with {plan.target} costs {(s['predicted_loss'] / alt['predicted_loss'] - 1) * 100:+.1f}%"
            if alt["predicted_loss"] and s["predicted_loss"] is not None
            else ""
        )
        lines.append(
            f"per-expert plan (target transformers) at the same budget: predicted loss "
            f"{alt['predicted_loss']:.6g}, {format_bytes(alt['routed_bytes'])} routed{_bits(alt)}{extra}"
        )
    alt = s.get("budget_alternative")
    if alt:
        lines.append(
            f"budget plan (target {plan.target}) at the same bytes: predicted loss "
            f"{alt['predicted_loss']:.6g}, {format_bytes(alt['routed_bytes'])} routed{_bits(alt)}"
        )
    for u in s.get("uniform_alternatives", []):
        loss = f"{u['predicted_loss']:.6g}" if u["predicted_loss"] is not None else "n/a"
        lines.append(
            f"uniform {u['format']}: {format_bytes(u['routed_bytes'])} routed{_bits(u)}, predicted loss {loss}"
        )
    probe = s.get("probe")
    if probe and probe.get("used"):
        # a layer's scale is one number, or one per projection where the probe measured them alone
        split = {L: isinstance(v["scale"], dict) for L, v in probe["layers"].items()}
        scales = ", ".join(
            f"L{L} " + " ".join(f"{p} x{x:.3g}" for p, x in v["scale"].items())
            if split[L]
            else f"L{L} x{v['scale']:.3g}"
            for L, v in probe["layers"].items()
        )
        where = "held-out" if probe.get("held_out") else "calibration"
        lines.append(
            f"per-layer KL probe used ({probe['format']} {probe.get('algorithm') or 'rtn'}, "
            f"{probe['tokens']} {where} tokens): losses scaled to measured KL per layer"
            f"{' and projection' if any(split.values()) else ''}: {scales}"
        )
    elif probe:
        lines.append(f"per-layer KL probe not used: {probe['why']}; losses are layer-output errors added unscaled")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
