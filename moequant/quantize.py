"""The sequential quantize pass: layer L is quantized on the outputs of the already quantized layers < L.

For each decoder layer, one in memory at a time:
1. the carried calibration hidden states (outputs of the quantized layers before it) go through
   the layer with its original weights, while the calibration hooks collect the experts'
   Hessians on exactly these inputs (all-experts coverage, routed-token Hessians kept apart);
2. every tensor of the layer gets the plan's format and algorithm: GPTQ batched over the
   experts that share a (projection, format) — on the expert's routed-token Hessian when it has
   at least `min_tokens` tokens, else on the all-tokens one (reported per expert) — or RTN;
   gate, up and down all use the Hessians of step 1 (down's inputs come from the layer's
   unquantized gate/up: one forward per layer instead of three);
   non-expert tensors (attention, shared experts, dense MLP) use RTN in this version; GPTQ
   uses activation order with static groups for integer formats (what vLLM loads);
3. the layer runs again with the dequantized weights; its output is what layer L+1 sees.

Resumable: each finished layer's quantized tensors, report and carried hidden states are
written to `work/`; a rerun with the same plan and data continues at the next layer.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moequant import formats
from moequant.arch import adapter_for
from moequant.calibrate import (CalibrationSettings, _LayerCollector, collect_moe_stats, load_carried, load_tokenizer,
                                save_carried)
from moequant.checkpoint import atomic_write_text, open_checkpoint
from moequant.errors import UserError
from moequant.layers import LayerRunner
from moequant.policy import Plan


def _plan_fingerprint(plan: Plan, settings: CalibrationSettings, extra: str) -> str:
    body = json.dumps({"tensors": [(t.name, t.layer, t.expert, t.proj, t.format, t.algorithm) for t in plan.tensors],
                       "settings": settings.fingerprint_fields(), "extra": extra}, sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- QuantizedTensor files


def _key_text(key) -> str:
    return f"expert:{key[0]}:{key[1]}:{key[2]}" if isinstance(key, tuple) else f"tensor:{key}"


def _key_from_text(text: str):
    kind, rest = text.split(":", 1)
    if kind == "expert":
        layer, expert, proj = rest.split(":")
        return (int(layer), int(expert), proj)
    return rest


def save_quantized(items: dict, path: Path) -> None:
    """QuantizedTensors → one safetensors file (codes / scales / zeros / global scale + JSON index)."""
    tensors, index = {}, {}
    for i, (key, q) in enumerate(items.items()):
        entry = {"key": _key_text(key), "spec": q.spec.key, "shape": list(q.shape), "parts": []}
        for part in ("codes", "scales", "zeros", "global_scale"):
            t = getattr(q, part)
            if t is not None:
                tensors[f"{i}.{part}"] = t.contiguous().clone()
                entry["parts"].append(part)
        index[str(i)] = entry
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata={"index": json.dumps(index)})
    tmp.replace(path)


def load_quantized(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        index = json.loads(f.metadata()["index"])
    tensors = load_file(str(path))
    out = {}
    for i, entry in index.items():
        parts = {p: tensors[f"{i}.{p}"] for p in entry["parts"]}
        out[_key_from_text(entry["key"])] = formats.QuantizedTensor(
            spec=formats.parse_key(entry["spec"]), shape=tuple(entry["shape"]), **parts)
    return out


# ----------------------------------------------------------------------------- one layer


def _quantize_experts(adapter, ckpt, layer: int, plan_rows, collected: dict | None, min_tokens: int, device):
    """GPTQ / RTN for one layer's routed experts, batched per (projection, format, algorithm)."""
    from moequant.algorithms.gptq import gptq

    groups: dict[tuple[str, str, str], list[int]] = {}
    for t in plan_rows:
        if t.format == "bf16":
            continue
        groups.setdefault((t.proj, t.format, t.algorithm), []).append(t.expert)
    quantized, report, dequant = {}, {}, {}
    weights = {p: adapter.read_experts(ckpt, layer, p).float() for p in adapter.projections}
    for proj in adapter.projections:
        dequant[proj] = weights[proj].clone()
    for (proj, key, algo), experts in sorted(groups.items()):
        experts = sorted(experts)
        idx = torch.tensor(experts)
        W = weights[proj][idx]
        spec = formats.parse_key(key)
        entry = {"experts": experts, "format": key, "algorithm": algo}
        if algo == "gptq" and collected is not None:
            group = "down" if proj == "down" else "gate_up"
            h_routed = collected[f"hessian_routed.{group}"][idx]
            h_all = collected[f"hessian.{group}"]
            h_all = h_all.expand(adapter.num_experts, -1, -1)[idx] if h_all.shape[0] == 1 else h_all[idx]
            tokens = collected[f"input_routed.{group}.tokens"][idx]
            # each expert's own routed-token Hessian when it has enough tokens, else all tokens'
            own = tokens >= min_tokens
            H = torch.where(own[:, None, None], h_routed, h_all)
            # activation order with static groups: better codes, and vLLM accepts it (no dynamic g_idx)
            q, rep = gptq(W, H, spec, act_order=spec.name.startswith("int"), static_groups=True, device=device)
            fallbacks = {str(experts[e]): f"all-tokens Hessian: {int(tokens[e])} routed tokens < {min_tokens}"
                         for e in range(len(experts)) if not own[e]}
            fallbacks.update({str(experts[e]): why for e, why in rep.fallbacks().items()})
            entry["gptq"] = {"fallbacks": fallbacks, "damp": rep.damp}
        else:
            q = formats.quantize(W, spec, name=f"layer {layer} {proj} experts")
            entry["algorithm"] = "rtn"
        deq = q.dequantize(torch.float32)
        if not torch.isfinite(deq).all():
            raise RuntimeError(f"quantizing layer {layer} {proj} in {key} produced non-finite weights")
        dequant[proj][idx] = deq
        for i, e in enumerate(experts):
            quantized[(layer, e, proj)] = q.expert(i)
        report[f"{proj}:{key}"] = entry
    return quantized, report, dequant


def _quantize_other(ckpt, rows) -> tuple[dict, dict]:
    """RTN for non-expert tensors the plan quantizes; returns QuantizedTensors and dequantized copies."""
    quantized, dequant = {}, {}
    for t in rows:
        if t.format == "bf16":
            continue
        q = formats.quantize(ckpt.get(t.name).float(), formats.parse_key(t.format), name=t.name)
        quantized[t.name] = q
        dequant[t.name] = q.dequantize(torch.float32)
    return quantized, dequant


# ----------------------------------------------------------------------------- the pass


def quantize_model(model: str, plan: Plan, settings: CalibrationSettings, work_dir: str | Path,
                   samples=None, progress: bool = True) -> tuple[dict, dict]:
    """Run the sequential pass. Returns (quantized tensors keyed as `export_checkpoint` takes them,
    a per-layer report of algorithms and fallbacks)."""
    from moequant.data import load_samples

    ckpt = open_checkpoint(model)
    adapter = adapter_for(ckpt.config)
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if samples is None:
        tokenizer = load_tokenizer(ckpt.directory)
        samples = load_samples(settings.dataset, tokenizer, settings.samples, settings.seq_len, split="calibration",
                               seed=settings.seed, allow_fewer=settings.allow_fewer)
    input_ids = torch.stack([s.input_ids for s in samples])
    fingerprint = _plan_fingerprint(plan, settings, hashlib.sha256(input_ids.numpy().tobytes()).hexdigest())

    awq = sorted({t.format for t in plan.tensors if t.algorithm == "awq" and t.format != "bf16"})
    if awq:
        raise UserError(f"algorithm awq (asked for {', '.join(awq)}) is not wired into the sequential pass yet; "
                        "accepted in recipes: gptq or rtn (moequant.algorithms.awq is available as a library).")
    rows_by_layer: dict[int | None, list] = {}
    for t in plan.tensors:
        rows_by_layer.setdefault(t.layer, []).append(t)

    runner = LayerRunner(ckpt, adapter, input_ids, batch_size=settings.batch_size, device=settings.device)
    start, hidden = load_carried(work, fingerprint, len(runner.batches))
    if hidden is None:
        hidden = runner.embedded
        for p in work.glob("layer_*"):
            p.unlink()

    layers = range(start, adapter.num_layers)
    if progress:
        from rich.progress import track

        layers = track(layers, description="quantizing", total=adapter.num_layers - start)
    for L in layers:
        t0 = time.perf_counter()
        rows = rows_by_layer.get(L, [])
        expert_rows = [t for t in rows if t.role == "routed_expert" and t.expert is not None and t.proj in ("gate", "up", "down")]
        other_rows = [t for t in rows if t not in expert_rows]
        collected = None
        needs_hessians = any(t.algorithm == "gptq" and t.format != "bf16" for t in expert_rows)
        if L in adapter.moe_layers and needs_hessians:
            with runner.materialized(L) as module:
                col = _LayerCollector(adapter, module.mlp.experts, adapter.num_experts, adapter.top_k, [], True, True)
                col.token_domains = torch.zeros(0, dtype=torch.long)
                collect_moe_stats(runner, module, L, col, hidden)
                collected = col.finish()
        quantized, report, experts_dq = ({}, {}, None)
        if expert_rows:
            quantized, report, experts_dq = _quantize_experts(adapter, ckpt, L, expert_rows, collected,
                                                              settings.min_tokens, settings.device)
        q_other, other_dq = _quantize_other(ckpt, other_rows)
        quantized.update(q_other)
        with runner.materialized(L, experts=experts_dq, tensors=other_dq) as module:
            hidden = runner.forward(module, L, hidden)
        save_quantized(quantized, work / f"layer_{L:03d}.safetensors")
        report["seconds"] = time.perf_counter() - t0
        atomic_write_text(work / f"layer_{L:03d}.json", json.dumps(report, indent=2))
        save_carried(work, fingerprint, L + 1, hidden)

    # tensors outside the decoder layers (lm_head when the plan quantizes it)
    q_top, _ = _quantize_other(ckpt, rows_by_layer.get(None, []))
    quantized_all, reports = dict(q_top), {}
    for L in range(adapter.num_layers):
        quantized_all.update(load_quantized(work / f"layer_{L:03d}.safetensors"))
        reports[L] = json.loads((work / f"layer_{L:03d}.json").read_text())
    return quantized_all, reports
