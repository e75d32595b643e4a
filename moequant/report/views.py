"""The report's views of report.json's dict: report.md (`render_markdown`), the plots, and the self-contained
report.html (`render_html`); the tables both share (`_summary_tables`)."""

from __future__ import annotations

import base64
import html
import io
import math

from moequant.plan.memory import bits_per_weight, format_bytes

# ----------------------------------------------------------------------------- text


def _copy_of_weights(role: str) -> str:
    """The weights column of a role the original holds none of but the checkpoint stores bytes for."""
    if role == "lm_head":  # tied embeddings: GGUF loaders (llama.cpp's qwen2moe) need output.weight written out
        return "0 (tied: a copy of the embeddings)"
    return "0 (not in the original)"


def _b(n) -> str:
    """A table cell of bytes: plan.memory.format_bytes, or "–" where there is no value."""
    return "–" if n is None else format_bytes(n)


def _bits(x) -> str:
    """Bits per weight, written the same way everywhere (as `moequant plan` prints them)."""
    return "–" if x is None or not math.isfinite(x) else f"{x:.3f}"


def _f(x, digits=4) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _summary_tables(report: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) tables shared by the Markdown and HTML renderings."""
    m = report["memory"]
    tables = [
        (
            "Memory",
            ["", "original", "quantized"],
            [
                ["bytes", _b(m["bytes_original"]), _b(m["bytes_quantized"])],
                ["bits per weight", _bits(m["bits_per_weight_original"]), _bits(m["bits_per_weight"])],
                [
                    "bits per weight, routed experts",
                    _bits(m["bits_per_weight_experts_original"]),
                    _bits(m["bits_per_weight_experts"]),
                ],
                ["layout metadata (tensor shapes, column order; not weights)", "–", _b(m.get("layout_metadata_bytes"))],
                [
                    "bytes read per decoded token",
                    _b(m["bytes_per_token"]["original"]),
                    _b(m["bytes_per_token"]["quantized"]),
                ],
                *[
                    [
                        f"{g} GB GPUs ({int(100 * m['kv_headroom'])}% headroom)",
                        str(m["gpus_needed"]["original"][f"{g}GB"]),
                        str(m["gpus_needed"]["quantized"][f"{g}GB"]),
                    ]
                    for g in m["gpu_sizes_gb"]
                ],
            ],
        )
    ]
    tables.append(
        (
            "Bytes by role",
            ["role", "weights", "original", "quantized", "bits/weight"],
            [
                [
                    r,
                    f"{v['weights']:,}" if v["weights"] or not v["bytes_quantized"] else _copy_of_weights(r),
                    _b(v["bytes_original"]),
                    _b(v["bytes_quantized"]),
                    _bits(bits_per_weight(v["bytes_quantized"], v["weights"])) if v["weights"] else "–",
                ]
                for r, v in m["by_role"].items()
            ],
        )
    )
    layers = layer_formats(report["experts"])
    if layers:
        tables.append(
            (
                "Formats per MoE layer (routed experts)",
                ["layer", "formats", "experts per format"],
                [
                    [str(L), ", ".join(counts), ", ".join(f"{k} ×{n}" for k, n in counts.items())]
                    for L, counts in layers.items()
                ],
            )
        )
    q = report.get("quality")
    if q:
        tables.append(
            (
                "Quality",
                ["metric", "value"],
                [
                    ["perplexity, original", _f(q.get("ppl_original"))],
                    ["perplexity, quantized", _f(q.get("ppl_quantized"))],
                    [
                        "KL(original ‖ quantized) mean / p90 / p99",
                        " / ".join(_f(q.get(k)) for k in ("kl_mean", "kl_p90", "kl_p99")),
                    ],
                    ["top-1 agreement", _f(q.get("top1_agreement"))],
                    ["routing agreement (mean over MoE layers)", _f(q.get("routing_agreement"))],
                    [
                        "MoE-block relative error (reference input / own input)",
                        f"{_f(q.get('moe_output_error'))} / {_f(q.get('moe_output_error_accumulated'))}",
                    ],
                    ["evaluation tokens", _f(q.get("tokens"))],
                ],
            )
        )
        if q.get("layers"):
            tables.append(
                (
                    "Per MoE layer",
                    ["layer", "routing agreement", "block error (ref. input)", "block error (own input)"],
                    [
                        [
                            str(r["layer"]),
                            _f(r["routing_agreement"]),
                            _f(r["moe_output_error"]),
                            _f(r["moe_output_error_accumulated"]),
                        ]
                        for r in q["layers"]
                    ],
                )
            )
        if q.get("by_domain"):
            tables.append(
                (
                    "Per domain",
                    ["domain", "tokens", "ppl original", "ppl quantized", "KL mean", "KL p99", "top-1", "routing"],
                    [
                        [
                            d,
                            str(v["tokens"]),
                            _f(v["ppl_original"]),
                            _f(v["ppl_quantized"]),
                            _f(v["kl_mean"]),
                            _f(v["kl_p99"]),
                            _f(v["top1_agreement"]),
                            _f(v["routing_agreement"]),
                        ]
                        for d, v in q["by_domain"].items()
                    ],
                )
            )
    plan = report.get("plan") or {}
    if plan.get("predicted_loss") is not None or plan.get("uniform_alternatives"):
        routed = m["by_role"].get("routed_expert", {})

        def bits_of(nbytes):  # the memory account's bits per routed-expert weight, for any byte count
            return (
                _bits(bits_per_weight(nbytes, routed["weights"]))
                if nbytes is not None and routed.get("weights")
                else "–"
            )

        rows = [
            [
                "this plan (" + str(plan.get("method") or "?") + ")",
                _b(routed.get("bytes_quantized")),
                bits_of(routed.get("bytes_quantized")),
                _f(plan.get("predicted_loss")),
            ]
        ]
        alt = plan.get("per_expert_alternative")
        if alt:
            rows.append(
                [
                    "per-expert plan (transformers target)",
                    _b(alt.get("routed_bytes")),
                    bits_of(alt.get("routed_bytes")),
                    _f(alt.get("predicted_loss")),
                ]
            )
        for u in plan.get("uniform_alternatives") or []:
            rows.append(
                [
                    f"uniform {u.get('format')}",
                    _b(u.get("routed_bytes")),
                    bits_of(u.get("routed_bytes")),
                    _f(u.get("predicted_loss")),
                ]
            )
        tables.append(
            (
                "Plan vs alternatives (routed experts, predicted)",
                [
                    "plan",
                    "routed-expert bytes",
                    "bits/weight",
                    "predicted loss (usage × error; ≈ KL/token when probe-scaled)",
                ],
                rows,
            )
        )
    from moequant.report.prune import prune_tables

    tables += prune_tables(report)  # experts dropped and their price, when the run pruned (issue 58)
    if report.get("timings"):
        tables.append(
            (
                "Timings",
                ["stage", "seconds"],
                [[k, f"{v:.1f}"] for k, v in report["timings"].items()]
                + [["total", f"{sum(report['timings'].values()):.1f}"]],
            )
        )
    return tables


def layer_formats(rows: list[dict]) -> dict[int, dict[str, int]]:
    """MoE layer -> {format key: routed experts in it}, from the per-expert rows (formats most used first)."""
    out: dict[int, dict[str, int]] = {}
    for r in rows:
        if r["format"] is not None:
            counts = out.setdefault(r["layer"], {})
            counts[r["format"]] = counts.get(r["format"], 0) + 1
    return {L: dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))) for L, c in sorted(out.items())}


# What each error column of the per-expert table measures, and in which unit.
ERROR_COLUMNS = (
    (
        "predicted sq. error/token",
        "calibration's prediction for round-to-nearest in the expert's format: "
        "Σ over gate/up/down of tr(ΔW H ΔWᵀ), the squared L2 error of each projection's output per routed token "
        "(units: squared activations; the plan weights it by usage into its predicted loss)",
    ),
    (
        "measured sq. error/token",
        "measured on the evaluation tokens the original router sends to the expert, with "
        "the exported weights (GPTQ / AWQ included): ‖y_q − y‖² of the expert's output per routed token (same units "
        "as the prediction, but of the whole expert, not summed per projection)",
    ),
    ("measured relative error", "‖y_q − y‖ / ‖y‖ of the expert's output over those tokens (no unit; 0.01 = 1 %)"),
)


def _expert_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    domains = sorted({d for r in rows for d in r["share_by_domain"]})
    header = ["layer", "expert", "share", *[f"share {d}" for d in domains], "format", *[c for c, _ in ERROR_COLUMNS]]
    body = [
        [
            str(r["layer"]),
            str(r["expert"]),
            _f(r["share"], 3),
            *[_f(r["share_by_domain"].get(d), 3) for d in domains],
            r["format"] or "–",
            _f(r["predicted_error"], 3),
            _f(r["sq_error_per_token"], 3),
            _f(r["error"], 3),
        ]
        for r in rows
    ]
    return header, body


def _error_legend() -> list[str]:
    return [f"{name}: {what}." for name, what in ERROR_COLUMNS]


def _md_table(header, rows) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(out)


def _headline(report: dict) -> str:
    m, q = report["memory"], report.get("quality") or {}
    s = (
        f"{_b(m['bytes_original'])} → {_b(m['bytes_quantized'])} ({_f(m['compression'], 3)}× smaller, "
        f"{_bits(m['bits_per_weight'])} bits/weight overall, {_bits(m['bits_per_weight_experts'])} in routed experts)"
    )
    if q.get("kl_mean") is not None:
        s += (
            f"; perplexity {_f(q.get('ppl_original'))} → {_f(q.get('ppl_quantized'))}, KL mean "
            f"{_f(q.get('kl_mean'))}, top-1 agreement {_f(q.get('top1_agreement'))}"
        )
    return s + "."


def render_markdown(report: dict, top_experts: int = 20) -> str:
    lines = [
        f"# moequant report: {report['model']}",
        "",
        f"target: {report.get('target') or '–'} · checkpoint: `{report['checkpoint']}`"
        + (f" · expert-parallel over {report['ranks']} ranks" if report.get("ranks", 1) > 1 else ""),
        "",
        _headline(report),
        "",
    ]
    for title, header, rows in _summary_tables(report):
        lines += [f"## {title}", "", _md_table(header, rows), ""]
    rows = report["experts"]
    measured = [r for r in rows if r["error"] is not None]
    if measured:
        worst = sorted(measured, key=lambda r: -r["error"])[:top_experts]
        header, body = _expert_table(worst)
        lines += [
            f"## The {len(worst)} experts with the largest measured relative error",
            "",
            _md_table(header, body),
            "",
            *[f"- {line}" for line in _error_legend()],
            "",
        ]
    lines += [f"The full per-expert table ({len(rows)} experts) is in report.json and report.html.", ""]
    plan = report.get("plan") or {}
    if plan.get("notes"):
        lines += ["## Plan notes", ""] + [f"- {n}" for n in plan["notes"]] + [""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plots


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grid(rows, key):
    layers = sorted({r["layer"] for r in rows})
    E = max(r["expert"] for r in rows) + 1
    grid = [[None] * E for _ in layers]
    for r in rows:
        grid[layers.index(r["layer"])][r["expert"]] = r[key]
    return layers, E, grid


def plot_routing_heatmap(rows) -> str | None:
    if not rows or all(r["share"] is None for r in rows):
        return None
    import numpy as np

    plt = _plt()
    layers, E, grid = _grid(rows, "share")
    data = np.array([[np.nan if v is None else v * E for v in row] for row in grid])
    fig, ax = plt.subplots(figsize=(min(14, 3 + 0.12 * E + 3), 1.5 + 0.25 * len(layers)))
    im = ax.imshow(data, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(len(layers)), [str(L) for L in layers])
    ax.set_title("routing share × experts (1 = uniform use)")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    return _png(fig)


def plot_format_map(rows) -> str | None:
    if not rows or all(r["format"] is None for r in rows):
        return None
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    plt = _plt()
    keys = sorted({r["format"] or "unknown" for r in rows}, key=_format_order)
    layers, E, grid = _grid(rows, "format")
    data = np.array([[keys.index(v or "unknown") for v in row] for row in grid])
    colors = plt.get_cmap("tab10").colors
    fig, ax = plt.subplots(figsize=(min(14, 3 + 0.12 * E + 3), 1.8 + 0.25 * len(layers)))
    ax.imshow(
        data,
        aspect="auto",
        cmap=ListedColormap([colors[i % 10] for i in range(len(keys))]),
        vmin=-0.5,
        vmax=len(keys) - 0.5,
        interpolation="nearest",
    )
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(len(layers)), [str(L) for L in layers])
    ax.set_title("format of each routed expert")
    ax.legend(
        handles=[Patch(color=colors[i % 10], label=k) for i, k in enumerate(keys)],
        loc="upper left",
        bbox_to_anchor=(1.01, 1),
        fontsize=8,
    )
    fig.tight_layout()
    return _png(fig)


def _format_order(key: str):
    from moequant import formats

    try:
        return -formats.parse_key(key).bits_per_weight((128, 128)), key
    except Exception:  # a joined or foreign key: after the known ones
        return 0.0, key


def plot_error_vs_share(rows) -> str | None:
    pts = [r for r in rows if r["error"] is not None and r["share"] is not None]
    if not pts:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.get_cmap("tab10").colors
    keys = sorted({r["format"] or "unknown" for r in pts}, key=_format_order)
    for i, k in enumerate(keys):
        sel = [r for r in pts if (r["format"] or "unknown") == k]
        ax.scatter([r["share"] for r in sel], [r["error"] for r in sel], s=14, color=colors[i % 10], label=k, alpha=0.8)
    ax.set_xlabel("routing share of the expert in its layer")
    ax.set_ylabel("measured relative output error")
    if all(r["error"] > 0 for r in pts):
        ax.set_yscale("log")
    ax.set_title("expert error vs how much the expert is used")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)


def plot_memory_by_role(memory: dict) -> str:
    import numpy as np

    plt = _plt()
    roles = [r for r, v in memory["by_role"].items() if v["bytes_original"] or v["bytes_quantized"]]
    y = np.arange(len(roles))
    largest = max([memory["by_role"][r]["bytes_original"] for r in roles] + [1])
    unit, div = next((u, d) for u, d in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("bytes", 1)) if largest >= d)
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.45 * len(roles)))
    ax.barh(y - 0.2, [memory["by_role"][r]["bytes_original"] / div for r in roles], height=0.4, label="original")
    ax.barh(y + 0.2, [memory["by_role"][r]["bytes_quantized"] / div for r in roles], height=0.4, label="quantized")
    ax.set_yticks(y, roles)
    ax.invert_yaxis()
    ax.set_xlabel(f"{unit} on disk")
    ax.set_title("memory by role")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)


def plot_pareto(runs: list[dict]) -> str | None:
    """KL vs bytes of every run sharing the output's parent; the Pareto front joined by a line."""
    if len(runs) < 2:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        ax.scatter(
            r["bytes"] / 1e6,
            r["kl_mean"],
            s=40 if r["this"] else 20,
            color="tab:red" if r["this"] else "tab:blue",
            zorder=3,
        )
        ax.annotate(r["name"], (r["bytes"] / 1e6, r["kl_mean"]), fontsize=8, xytext=(4, 4), textcoords="offset points")
    front, best = [], float("inf")
    for r in sorted(runs, key=lambda r: (r["bytes"], r["kl_mean"])):
        if r["kl_mean"] < best:
            front.append(r)
            best = r["kl_mean"]
    ax.plot(
        [r["bytes"] / 1e6 for r in front],
        [r["kl_mean"] for r in front],
        color="gray",
        lw=1,
        zorder=2,
        label="Pareto front",
    )
    ax.set_xlabel("checkpoint MB")
    ax.set_ylabel("KL(original ‖ quantized), mean per token")
    if all(r["kl_mean"] > 0 for r in runs):
        ax.set_yscale("log")
    ax.set_title("runs of this model in this directory: quality vs size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)


def report_plots(report: dict, runs: list[dict] | None = None) -> dict[str, tuple[str, str]]:
    """id -> (title, base64 PNG) of every plot the data allows."""
    rows = report["experts"]
    candidates = [
        ("routing-share", "Routing share per expert", lambda: plot_routing_heatmap(rows)),
        ("format-map", "Format map", lambda: plot_format_map(rows)),
        ("error-vs-share", "Measured error vs routing share", lambda: plot_error_vs_share(rows)),
        ("memory-by-role", "Memory by role", lambda: plot_memory_by_role(report["memory"])),
        ("pareto", "KL vs bytes of this model's runs next to this one", lambda: plot_pareto(runs or [])),
    ]
    out = {}
    for pid, title, make in candidates:
        png = make()
        if png is not None:
            out[pid] = (title, png)
    return out


# ----------------------------------------------------------------------------- HTML

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f3f3f3; position: sticky; top: 0; }
.headline { font-size: 1.05em; background: #f6f8fa; padding: 0.7em 1em; border-left: 4px solid #4a7; }
figure { margin: 1em 0; } figcaption { font-size: 0.9em; color: #555; }
img { max-width: 100%; height: auto; }
.scroll { max-height: 32em; overflow: auto; display: inline-block; }
"""


def _html_table(header, rows) -> str:
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_html(report: dict, runs: list[dict] | None = None) -> str:
    """One self-contained page: tables, and every plot as an embedded PNG (no scripts, no links)."""
    e = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<link rel="icon" href="data:,">',
        f"<title>moequant report: {e(report['model'])}</title><style>{_CSS}</style></head><body>",
        f"<h1>moequant report: {e(report['model'])}</h1>",
        f"<p>target: <b>{e(str(report.get('target') or '–'))}</b> · checkpoint: <code>{e(report['checkpoint'])}</code></p>",
        f'<p class="headline">{e(_headline(report))}</p>',
    ]
    for title, header, rows in _summary_tables(report):
        parts += [f"<h2>{e(title)}</h2>", _html_table(header, rows)]
    plots = report_plots(report, runs)
    parts.append("<h2>Plots</h2>")
    for pid, (title, png) in plots.items():
        parts.append(
            f'<figure id="plot-{pid}"><img class="plot" alt="{e(title)}" '
            f'src="data:image/png;base64,{png}"><figcaption>{e(title)}</figcaption></figure>'
        )
    plan = report.get("plan") or {}
    if plan.get("notes"):
        parts += ["<h2>Plan notes</h2><ul>"] + [f"<li>{e(n)}</li>" for n in plan["notes"]] + ["</ul>"]
    if report["experts"]:
        header, body = _expert_table(report["experts"])
        parts += [
            f"<h2>Per expert ({len(body)})</h2>",
            '<div class="scroll">',
            _html_table(header, body),
            "</div>",
            "<ul>" + "".join(f"<li>{e(line)}</li>" for line in _error_legend()) + "</ul>",
        ]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
