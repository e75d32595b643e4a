"""The plan's summary as text (`moequant plan` prints it): format_summary reads a Plan's summary dict
(which plan.policy builds) and writes its lines, bytes with plan.memory.format_bytes."""

from __future__ import annotations

from moequant.plan.model import Plan


def _bits(alt: dict) -> str:
    return f" ({alt['routed_bits_per_weight']:.3f} bits per weight)" if "routed_bits_per_weight" in alt else ""


def format_summary(plan: Plan) -> str:
    from moequant.plan.memory import format_bytes  # here, not at import: plan.memory imports moequant.arch (torch)

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
    lines.append("routed experts per layer (" + ", ".join(f"{c}={k}" for c, k in s["legend"].items()) + "):")
    for layer, info in s["layers"].items():
        counts = ", ".join(f"{k} x{n}" for k, n in info["counts"].items())
        row = f"  L{int(layer):>3}  {counts}"
        if len(info["counts"]) > 1 and len(info["map"]) <= 128:
            row += f"  [{info['map']}]"
        lines.append(row)
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
