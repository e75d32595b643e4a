"""One layer's routed experts rounded by their plan rows' algorithms, batched per (projection, format,
algorithm) — the quantize pass's inner step (moequant.pipeline.quantize), for a whole layer or one chunk of
its experts — and the round-to-nearest of the tensors outside the experts."""

from __future__ import annotations

import torch

from moequant import formats, timing
from moequant.algorithms.registry import algorithm
from moequant.measure.settings import HessianRule
from moequant.measure.stats import chosen_hessian


def _chosen_statistics(collected: dict, group: str, idx: torch.Tensor, rule: HessianRule):
    """Per expert of `idx`: (own, routed tokens, Hessian, mean |x|, token count used) — the expert's
    own routed-token statistics when it has at least `rule.min_tokens` tokens, else all tokens'
    (`stats.chosen_hessian`'s rule)."""
    tokens = collected[f"input_routed.{group}.tokens"][idx]
    own, H = chosen_hessian(collected, group, idx, rule)
    own = own.to(tokens.device)
    m = torch.where(
        own[:, None], collected[f"input_routed.{group}.abs_mean"][idx], collected[f"input.{group}.abs_mean"][idx]
    )
    used = torch.where(own, tokens, collected[f"input.{group}.tokens"][idx])
    return own.cpu(), tokens.cpu(), H, m, used


def _quantize_experts(
    adapter,
    layer: int,
    plan_rows,
    collected: dict | None,
    rule: HessianRule,
    device,
    weights: dict,
    input_scale: torch.Tensor | None = None,
    first_expert: int = 0,
    options: dict | None = None,
    codes_to=None,
    store=None,
):
    """One layer's routed experts, batched per (projection, format, algorithm), each batch rounded by its
    registered algorithm (moequant.algorithms.registry) with its `options` ({algorithm name: options},
    the recipe's sections; GPTQ's: `gptq_pass`); an algorithm that reads Hessians rounds to nearest
    where there are no statistics.
    `codes_to`: the device the returned codes and scales are moved to (the host: off the GPU per chunk).
    `store(layer, proj, experts, stacked codes)`: where each quantized stack goes instead (the streamed
    export packs and writes it); it returns what the caller must still hold, keyed (layer, expert, proj).

    `weights` (proj -> [E, out, in] float32) are the weights to quantize (AWQ-scaled where AWQ
    ran); AWQ rows are round-to-nearest of them. `input_scale`: the shared gate/up scale folded
    into the norm, so gate/up's GPTQ Hessians are those of the input divided by it. With
    `first_expert`, `weights` and `collected` hold the experts from there on (one chunk of a layer)."""
    groups: dict[tuple[str, str, str], list[int]] = {}
    for t in plan_rows:
        if not t.quantized:
            continue
        groups.setdefault((t.proj, t.format, t.algorithm), []).append(t.expert)
    # gate and up read the same input: where both are in one format for the same experts and the
    # algorithm solves them together (GPTQ), they share one Hessian, one factorization and one sweep
    jobs = []
    for (proj, key, name), experts in sorted(groups.items()):
        shared = (
            algorithm(name).joins_gate_up(formats.parse_key(key))
            and proj in ("gate", "up")
            and sorted(groups.get(("gate", key, name), [])) == sorted(groups.get(("up", key, name), [None]))
        )
        if shared and proj == "up":
            continue  # joined to gate's job
        projs = ("gate", "up") if shared else (proj,)
        jobs.append((projs, key, name, sorted(experts)))
    quantized, report = {}, {}
    # dequantized in place: each quantized row is read once, before its own dequantized copy lands
    # (saves a float32 copy of the layer's experts on the device)
    dequant = weights
    for projs, key, name, experts in jobs:
        idx = torch.tensor(experts) - first_expert  # rows of `weights` / `collected` (a chunk's, from first_expert)
        spec = formats.parse_key(key)
        group = "down" if projs[0] == "down" else "gate_up"
        label = f"layer {layer} {'/'.join(projs)} experts"
        algo, H = algorithm(name), None
        if algo.hessians and collected is None:
            algo = algorithm("rtn")  # no statistics to read
        if algo.hessians:
            with timing.stage("statistics"):
                own, tokens, H, _, _ = _chosen_statistics(collected, group, idx, rule)
                if input_scale is not None and group == "gate_up":
                    H = H / (input_scale[:, None] * input_scale[None, :])  # Hessian of x / s
        entries = {p: {"experts": experts, "format": key, "algorithm": algo.name} for p in projs}
        with timing.stage(algo.name):  # gptq: its grid and refit are stages of their own (gptq_grid, gptq_refit)
            qs, rep = algo.quantize(
                [weights[p][idx] for p in projs], spec, H, (options or {}).get(algo.name), device, label
            )
        if rep is not None:  # per-expert fallbacks: an expert's too few routed tokens, then the solver's own
            fallbacks = {
                str(experts[e]): f"all-tokens Hessian: {int(tokens[e])} routed tokens < {rule.min_tokens}"
                for e in range(len(experts))
                if not own[e]
            }
            fallbacks.update({str(experts[e]): why for e, why in rep["fallbacks"].items()})
            for p in projs:
                entries[p][algo.name] = {"fallbacks": fallbacks, "damp": rep["damp"]}
        for p, q in zip(projs, qs):
            with timing.stage("dequantize"):
                deq = q.dequantize(torch.float32)
                if not torch.isfinite(deq).all():
                    raise RuntimeError(f"quantizing layer {layer} {p} in {key} produced non-finite weights")
                dequant[p][idx] = deq
            with timing.stage("pack_write"):  # packed and queued for the writer thread, or codes to the host
                if store is not None:
                    quantized.update(store(layer, p, experts, q))
                else:
                    q = q.to(codes_to) if codes_to is not None else q  # one copy per stack, not one per expert
                    for i, e in enumerate(experts):
                        quantized[(layer, e, p)] = q.expert(i)
            report[f"{p}:{key}"] = entries[p]
    return quantized, report, dequant


def _merge_chunk_report(report: dict, chunk: dict) -> None:
    """One (projection, format) entry over all chunks: experts, damping and fallbacks joined."""
    for key, entry in chunk.items():
        if key not in report:
            report[key] = entry
            continue
        whole = report[key]
        whole["experts"] = whole["experts"] + entry["experts"]
        solver = entry["algorithm"]  # its report, when it gives one (_quantize_experts)
        if solver in entry:
            whole[solver]["fallbacks"].update(entry[solver]["fallbacks"])
            whole[solver]["damp"] = list(whole[solver]["damp"]) + list(entry[solver]["damp"])


def _quantize_other(ckpt, rows, replaced: dict | None = None) -> tuple[dict, dict]:
    """RTN for non-expert tensors the plan quantizes (from `replaced` where an AWQ fold changed
    them); returns QuantizedTensors and dequantized copies."""
    quantized, dequant = {}, {}
    replaced = replaced or {}
    for t in rows:
        if not t.quantized:
            continue
        w = replaced[t.name] if t.name in replaced else ckpt.get(t.name).float()
        q = formats.quantize(w, formats.parse_key(t.format), name=t.name)
        quantized[t.name] = q
        dequant[t.name] = q.dequantize(torch.float32)
    return quantized, dequant
