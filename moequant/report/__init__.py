"""The run report: report.json (a contract), report.md, and a self-contained report.html.

    report = build_report(model="zoo:tiny-mixtral", checkpoint="out/checkpoint", original=None,
                          recipe=recipe_dict, target="vllm", plan=plan_dict, quality=evaluate_dict,
                          stats="out/stats", timings={"calibrate": 12.3, ...}, output_dir="out")

report.json (schema "moequant.report/1"; keys may be added, none of these removed or renamed)
------------------------------------------------------------------------------------------
{
  "schema": "moequant.report/1",
  "run_fingerprint": str | null,      # the run of plan.json and the checkpoint (moequant.io.fingerprint)
  "model": str,                       # what the user named (path or zoo:NAME)
  "checkpoint": str,                  # the written checkpoint directory
  "recipe": dict | null,              # the resolved recipe
  "target": "vllm" | "sglang" | "transformers" | null,
  "memory": {
    "bytes_original": int,            # tensor bytes of the original checkpoint (safetensors headers)
    "bytes_quantized": int,           # tensor bytes of the written checkpoint (headers; = file sizes
                                      #   minus the safetensors headers)
    "compression": float,             # bytes_original / bytes_quantized
    "weights": int,                   # elements of the original tensors (the "weights" bits are per)
    "layout_metadata_bytes": int,     # of bytes_quantized: tensors that record a layout, not weights
                                      #   (compressed-tensors weight_shape, GPTQ g_idx)
    "bits_per_weight": float,         # 8 * (bytes_quantized - layout_metadata_bytes) / weights
    "bits_per_weight_experts": float, # the same over the routed experts' weight matrices only (as
                                      #   experts.budget.bits_per_weight counts): their own bytes (codes,
                                      #   scales, zero points), which is formats.nbytes, so it equals the
                                      #   plan's summary.bits_per_weight.routed_experts
    "bits_per_weight_original": float, "bits_per_weight_experts_original": float,
    "by_role": {role: {"weights": int, "bytes_original": int, "bytes_quantized": int}},  # no metadata
    "routed_expert_matrices": {"weights": int, "bytes_original": int, "bytes_quantized": int},
                                      # by_role's routed_expert without expert biases (gpt-oss): the
                                      #   plan's summary.routed_bytes, what the budget limits
    "bytes_per_token": {"original": int, "quantized": int},
    "gpus_needed": {"original": {"24GB": int, "80GB": int, "141GB": int}, "quantized": {...}},
    "gpu_sizes_gb": [24, 80, 141], "kv_headroom": 0.2
  },
  "quality": {                        # moequant.evaluate.evaluate() without its per-expert list
    "ppl_original": float, "ppl_quantized": float, "kl_mean": float, "kl_p90": float,
    "kl_p99": float, "kl_max": float, "top1_agreement": float, "routing_agreement": float,
    "moe_output_error": float, "moe_output_error_accumulated": float, "tokens": int,
    "layers": [{layer, routing_agreement, moe_output_error, moe_output_error_accumulated, tokens}],
    "by_domain": {domain: {tokens, ppl_original, ppl_quantized, kl_mean, kl_p99, top1_agreement,
                           routing_agreement}}, ...
  } | null,
  "experts": [{                       # one row per routed expert of every MoE layer
    "layer": int, "expert": int,
    "share": float | null,            # routing share on the calibration data (stats), else on the
                                      #   evaluation tokens; a layer's shares sum to 1
    "share_by_domain": {domain: float},
    "format": str | null,             # format key the plan / the export gave the expert
    "predicted_error": float | null,  # calibration's predicted squared output error per routed
                                      #   token in that format, summed over gate/up/down
    "predicted_loss": float | null,   # the plan's usage-weighted loss of the expert
    "error": float | null,            # measured relative output error of the expert on the
                                      #   tokens routed to it (evaluate), None without tokens
    "sq_error_per_token": float | null, "eval_tokens": int | null
  }],
  "plan": {"method", "bits_per_weight", "predicted_loss", "per_expert_alternative",
           "uniform_alternatives", "notes"} | null,
  "timings": {stage: seconds},
  "ranks": int                        # processes of the run (more than 1: expert-parallel)
}

ReportFile below is the one definition of this shape: write_report writes through it, read_report
reads through it (a malformed file is one sentence naming the file and the key).

The `memory` section is computed by memory_account in moequant.plan.memory, the module of every memory
account, whose docstring states the conventions (bytes per decoded token, GPUs needed, how stored
tensors map back to the original tensors and their roles). This module builds the rest (the per-expert
table, report.json); views.py renders the text, the plots and the HTML.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer

from moequant.errors import UserError, schema_refusal
from moequant.plan.memory import memory_account, original_tensor_name
from moequant.plan.plan_io import Alternative, BitsPerWeight, UniformAlternative
from moequant.report.views import _headline, render_html, render_markdown

SCHEMA = "moequant.report/1"


# ----------------------------------------------------------------------------- report.json's schema
# The one definition of report.json's shape (the module docstring explains the keys); field order is the
# file's key order. NaN / Infinity are written as null (_finite), so computed ratios are Optional. Numbers
# other modules measure (evaluate) are `int | float`: written as they were given.

Number = Union[int, float]


class _Part(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class RoleBytes(_Part):
    weights: int
    bytes_original: int
    bytes_quantized: int


class BytesPerToken(_Part):
    original: int
    quantized: int


class GpusNeeded(_Part):
    original: dict[str, int]  # "24GB" -> GPUs
    quantized: dict[str, int]


class MemorySection(_Part):
    """plan.memory.memory_account's dict."""

    bytes_original: int
    bytes_quantized: int
    compression: Optional[float]
    weights: int
    layout_metadata_bytes: int
    bits_per_weight: Optional[float]
    bits_per_weight_experts: Optional[float]
    bits_per_weight_original: Optional[float]
    bits_per_weight_experts_original: Optional[float]
    by_role: dict[str, RoleBytes]
    routed_expert_matrices: RoleBytes
    bytes_per_token: BytesPerToken
    gpus_needed: GpusNeeded
    gpu_sizes_gb: list[int]
    kv_headroom: float


class ExpertRow(_Part):
    layer: int
    expert: int
    share: Optional[Number]
    share_by_domain: dict[str, float]
    format: Optional[str]
    predicted_error: Optional[float]
    predicted_loss: Optional[float]
    error: Optional[Number]
    sq_error_per_token: Optional[Number]
    eval_tokens: Optional[int]


class PlanDigest(_Part):
    method: Optional[str]
    bits_per_weight: Optional[BitsPerWeight]
    predicted_loss: Optional[float]
    per_expert_alternative: Optional[Alternative]
    uniform_alternatives: Optional[list[UniformAlternative]]
    notes: list[str]


class ReportFile(_Part):
    schema_: Literal[SCHEMA] = Field(alias="schema")
    run_fingerprint: Optional[str]
    model: str
    checkpoint: str
    recipe: Optional[dict[str, Any]]  # the resolved recipe (plan.recipe.Recipe)
    target: Optional[str]
    memory: MemorySection
    quality: Optional[dict[str, Any]]  # moequant.evaluate's dict without its per-expert list
    experts: list[ExpertRow]
    plan: Optional[PlanDigest]
    timings: dict[str, float]
    ranks: int
    prune: Optional[dict[str, Any]] = None  # what apply's prune stage dropped (report.prune), only when it ran

    @model_serializer(mode="wrap")
    def _without_absent_prune(self, handler):
        data = handler(self)
        if data.get("prune") is None:  # only a run that pruned has the key, so a report reads back as written
            data.pop("prune", None)
        return data


# ----------------------------------------------------------------------------- per-expert table


def _load_stats(stats):
    if stats is None or hasattr(stats, "layers"):
        return stats
    from moequant.measure.stats import load_stats

    return load_stats(stats, with_hessians=False)


def _expert_formats(plan: dict | None, checkpoint, adapter) -> dict[tuple[int, int], str]:
    """(layer, expert) -> format key, from the plan, else from the export's record in the checkpoint; an expert
    whose projections differ (GGUF: one type per layer and projection) reads e.g. `gate+up:q4_k down:q5_0`."""
    per: dict[tuple[int, int], list[tuple[str | None, str]]] = defaultdict(list)  # [(projection, key)]
    if plan:
        for t in plan.get("tensors", []):
            if t.get("role") == "routed_expert" and t.get("expert") is not None:
                per[(t["layer"], t["expert"])].append((t.get("proj"), t["format"]))
    elif checkpoint is not None:
        from moequant.io.checkpoint import EXPORT_INFO

        info_path = Path(checkpoint) / EXPORT_INFO
        if info_path.exists():
            info = json.loads(info_path.read_text())
            expected = adapter.expected_tensors()
            for name, key in info.get("formats", {}).items():
                role = adapter.classify(original_tensor_name(name, expected))
                if role.role != "routed_expert":
                    continue
                experts = range(adapter.num_experts) if role.expert is None else [role.expert]
                for e in experts:
                    per[(role.layer, e)].append((role.proj, key))
            for L in adapter.moe_layers:  # experts the export does not list were written in bf16
                for e in range(adapter.num_experts):
                    per.setdefault((L, e), [(None, "bf16")])
    return {k: _projection_formats(v) for k, v in per.items()}


def _projection_formats(pairs: list[tuple[str | None, str]]) -> str:
    keys = list(dict.fromkeys(key for _, key in pairs))
    if len(keys) == 1:
        return keys[0]
    return " ".join("+".join(dict.fromkeys(p or "?" for p, k in pairs if k == key)) + ":" + key for key in keys)


def expert_rows(
    adapter, plan: dict | None = None, stats=None, quality: dict | None = None, checkpoint=None
) -> list[dict]:
    """The per-expert table (see the module docstring), one row per (MoE layer, routed expert)."""
    stats = _load_stats(stats)
    fmt = _expert_formats(plan, checkpoint, adapter)
    predicted_loss: dict[tuple[int, int], float] = defaultdict(float)
    has_loss: set = set()
    for t in (plan or {}).get("tensors", []):
        if t.get("role") == "routed_expert" and t.get("expert") is not None and t.get("predicted_loss") is not None:
            predicted_loss[(t["layer"], t["expert"])] += float(t["predicted_loss"])
            has_loss.add((t["layer"], t["expert"]))
    measured = {(r["layer"], r["expert"]): r for r in (quality or {}).get("experts", [])}
    rows = []
    for L in adapter.moe_layers:
        ls = stats.layers.get(L) if stats is not None else None
        domains = ls.domains if ls is not None else []
        dshare = {d: ls.domain_share(d) for d in domains}
        sens = ls.sensitivity if ls is not None else {}
        for e in range(adapter.num_experts):
            m = measured.get((L, e), {})
            key = fmt.get((L, e))
            predicted = None
            if key and sens and all(key in sens.get(p, {}) for p in adapter.projections):
                predicted = float(sum(float(sens[p][key][e]) for p in adapter.projections))
            elif key == "bf16":
                predicted = 0.0
            share = float(ls.share[e]) if ls is not None else m.get("share")
            rows.append(
                {
                    "layer": L,
                    "expert": e,
                    "share": share,
                    "share_by_domain": {d: float(s[e]) for d, s in dshare.items()},
                    "format": key,
                    "predicted_error": predicted,
                    "predicted_loss": predicted_loss[(L, e)] if (L, e) in has_loss else None,
                    "error": m.get("error"),
                    "sq_error_per_token": m.get("sq_error_per_token"),
                    "eval_tokens": m.get("tokens"),
                }
            )
    return rows


# ----------------------------------------------------------------------------- report.json


def _plan_summary(plan: dict | None) -> dict | None:
    if not plan:
        return None
    s = plan.get("summary", {})
    return {
        "method": plan.get("method"),
        "bits_per_weight": s.get("bits_per_weight"),
        "predicted_loss": s.get("predicted_loss"),
        "per_expert_alternative": s.get("per_expert_alternative"),
        "uniform_alternatives": s.get("uniform_alternatives"),
        "notes": plan.get("notes", []),
    }


def _finite(obj):
    """JSON has no NaN / Infinity: write them as null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def build_report(
    *,
    model: str,
    checkpoint,
    original=None,
    recipe: dict | None = None,
    target: str | None = None,
    plan: dict | None = None,
    quality: dict | None = None,
    stats=None,
    timings: dict | None = None,
    output_dir=None,
    ranks: int = 1,
) -> dict:
    """report.json's dict from plain inputs; also writes report.json / .md / .html when output_dir is given.

    `original` is the original checkpoint (defaults to `model`), `stats` a stats directory or a
    loaded Stats, `quality` the dict of moequant.evaluate.evaluate(), `ranks` the processes of the
    run (more than 1: expert-parallel over torchrun, moequant.parallel).
    """
    from moequant.io.checkpoint import open_checkpoint
    from moequant.io.fingerprint import KEY, checkpoint_fingerprint

    run = (plan or {}).get(KEY)  # the run that made the plan; its checkpoint must carry the same one
    if run is not None and checkpoint_fingerprint(checkpoint) != run:
        raise UserError(
            f"the report of {checkpoint} would mix two runs: the checkpoint's run fingerprint is "
            f"{checkpoint_fingerprint(checkpoint) or 'missing'} but its plan's is {run}; rerun "
            "`moequant apply` to remake the checkpoint."
        )
    original = original if original is not None else model
    adapter = open_checkpoint(original).adapter
    stats = _load_stats(stats)
    rows = expert_rows(adapter, plan=plan, stats=stats, quality=quality, checkpoint=checkpoint)
    shares: dict[int, list[float]] = defaultdict(lambda: [0.0] * adapter.num_experts)
    for r in rows:
        if r["share"] is not None:
            shares[r["layer"]][r["expert"]] = r["share"]
    report = {
        "schema": SCHEMA,
        KEY: run,
        "model": str(model),
        "checkpoint": str(checkpoint),
        "recipe": recipe,
        "target": target if target is not None else (plan or {}).get("target"),
        "memory": memory_account(original, checkpoint, dict(shares) or None),
        "quality": {k: v for k, v in quality.items() if k != "experts"} if quality else None,
        "experts": rows,
        "plan": _plan_summary(plan),
        "timings": {k: float(v) for k, v in (timings or {}).items()},
        "ranks": int(ranks),
    }
    from moequant.report.prune import prune_record

    if prune_record(output_dir) is not None:  # a run that dropped experts (issue 58); the key is absent otherwise
        report["prune"] = prune_record(output_dir)
    report = _finite(report)
    if output_dir is not None:
        write_report(report, output_dir)
    return report


def write_report(report: dict, output_dir) -> dict[str, Path]:
    """Write report.json, report.md and report.html into output_dir (each atomically)."""
    from moequant.io.checkpoint import atomic_write_text

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "md": out / "report.md", "html": out / "report.html"}
    data = ReportFile.model_validate(report).model_dump(by_alias=True)  # a report it refuses is a bug
    atomic_write_text(paths["json"], json.dumps(data, indent=2) + "\n")
    return {"json": paths["json"], **write_views(report, out)}


def write_views(report: dict, output_dir) -> dict[str, Path]:
    """report.md and report.html of report.json's dict in output_dir (each atomically; the HTML's runs plot from
    the runs of the same model next to it as they are now). Returns {"md": path, "html": path}."""
    from moequant.io.checkpoint import atomic_write_text

    out = Path(output_dir)
    paths = {"md": out / "report.md", "html": out / "report.html"}
    atomic_write_text(paths["md"], render_markdown(report))
    atomic_write_text(paths["html"], render_html(report, sibling_runs(out, report["model"])))
    return paths


def headline(report: dict) -> str:
    """The report's one-line summary: sizes, bits per weight and, when evaluated, perplexity, KL and top-1."""
    return _headline(report)


def read_report(path) -> dict:
    """report.json's dict, once ReportFile accepts it; one sentence naming the file and the bad key if not."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"report {path} does not exist; write it with `moequant apply`.")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        raise UserError(f"{path} is not valid JSON; rerun `moequant apply` to write it again.") from None
    try:
        ReportFile.model_validate(data)
    except ValidationError as error:
        # "keys may be added, none removed or renamed": a report written before a key was added (missing)
        # or by a later version (extra) still reads; a key of the wrong type or shape is refused
        wrong = [e for e in error.errors() if e["type"] not in ("missing", "extra_forbidden")]
        if wrong:
            raise UserError(
                f"report {path} is malformed: {schema_refusal(wrong[0])}; rerun `moequant apply` to write it again."
            ) from None
    return data


def sibling_runs(output_dir, model: str | None = None) -> list[dict]:
    """{name, bytes, kl_mean, top1} of every run under output_dir's parent that has a report.json (of `model`,
    report.json's `model`, when given: runs of other models share no frontier)."""
    runs = []
    for p in sorted(Path(output_dir).resolve().parent.glob("*/report.json")):
        try:
            r = json.loads(p.read_text())
            if model is not None and r["model"] != model:
                continue
            runs.append(
                {
                    "name": p.parent.name,
                    "bytes": r["memory"]["bytes_quantized"],
                    "kl_mean": (r.get("quality") or {}).get("kl_mean"),
                    "top1": (r.get("quality") or {}).get("top1_agreement"),
                    "this": p.parent == Path(output_dir).resolve(),
                }
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a moequant report: leave it out of the comparison
    return [r for r in runs if r["kl_mean"] is not None]
