"""The report's section on pruned experts (issue 58): what `apply`'s prune stage dropped and what it cost.

OUTPUT/prune/prune.json (moequant.pipeline.prune) becomes report.json's `prune` (absent for a run that dropped
nothing) and one table of report.md / report.html: per MoE layer the experts dropped, their share of the
calibration workload's routing and the bytes saved; then the price of pruning alone, KL and top-1 of the smaller
model against the original per evaluation domain (the report's quality section is the quantization's, against
the smaller model). A run whose budget chose the count (`prune: {by: budget}`) also shows what every count it
tried would have cost.
"""

from __future__ import annotations

import json
from pathlib import Path

PRUNE_RECORD = Path("prune") / "prune.json"


def prune_record(output_dir) -> dict | None:
    """prune.json's dict of a run directory, None when the run pruned nothing."""
    path = Path(output_dir) / PRUNE_RECORD if output_dir is not None else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def prune_tables(report: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) tables of report.json's `prune`, none without it."""
    p = report.get("prune")
    if not p:
        return []
    layers = [
        [L, ", ".join(map(str, v["dropped"])), f"{v['routing_mass']:.1%}", f"{v['bytes_saved'] / 1e6:.2f} MB"]
        for L, v in sorted(p["layers"].items(), key=lambda kv: int(kv[0]))
    ]
    title = f"Experts dropped ({p['experts'] - p['kept']} of {p['experts']} per MoE layer, by {p['saliency']})"
    tables = [(title, ["layer", "experts dropped", "their routing share", "saved"], layers)]
    budget = p.get("budget")
    if budget:  # by: budget: what each count it could drop would have cost (moequant.plan.drop)
        rows = [
            [
                str(c["count"]),
                f"{c['drop_loss']:.4g}",
                f"{c['quant_loss']:.4g}",
                f"{c['drop_loss'] + c['quant_loss']:.4g}",
            ]
            if c["fits"]
            else [str(c["count"]), "", "", "over the budget"]
            for c in budget["counts"]
        ]
        tables.append(
            (
                "The budget's choice of how many experts to drop (predicted KL per count tried)",
                ["dropped per layer", "drop KL (measured, summed)", "formats' KL (predicted)", "total"],
                rows,
            )
        )
    q = p.get("quality")
    if q:
        rows = [["all", f"{q['kl_mean']:.4g}", f"{q['kl_p99']:.4g}", f"{q['top1']:.3f}"]]
        rows += [[d, f"{v['kl_mean']:.4g}", f"{v['kl_p99']:.4g}", f"{v['top1']:.3f}"] for d, v in q["domains"].items()]
        tables.append(
            (
                f"Price of pruning alone (smaller model vs original, {q['dataset']}, evaluation split)",
                ["domain", "KL mean", "KL p99", "top-1 agreement"],
                rows,
            )
        )
    return tables
