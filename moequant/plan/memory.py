"""The memory account of an MoE model, from its config alone (weights never loaded).

Conventions (stated because published figures differ):
- `total_params`: every tensor of the checkpoint the config implies (MTP / next-token-prediction
  modules that transformers does not load are not counted, as DeepSeek's 671B does not).
- `active_params`: parameters used for one token = everything except the routed experts, plus
  top_k of the routed experts, embedding table included (Mistral, Qwen and OLMoE count so).
- `active_params_excluding_embedding`: the same without the input embedding table, which a
  token only looks one row up in (DeepSeek and OpenAI count so; it is also what decoding reads),
  unless the table is tied to the output projection, which reads all of it.
- Bytes per decoded token: weight bytes read to produce one token at batch size 1 = the active
  weights without the embedding table (one row of it is negligible).
- GPUs needed: weights × 1.2 (20 % headroom for KV cache and activations) over the GPU's memory
  in decimal gigabytes (24 / 80 / 141 GB as sold), rounded up.
"""

from __future__ import annotations

import math

from moequant.arch import Adapter

GPU_SIZES_GB = (24, 80, 141)
KV_HEADROOM = 0.20

# Formats for routed experts in the memory table; everything else stays bf16.
EXPERT_VARIANTS = {
    "bf16": "bf16",
    "fp8": "fp8-channel",
    "int8": "int8-channel",
    "int4-g128": "int4-g128-sym",
    "mxfp4": "mxfp4",
}


def bits_per_weight(nbytes: int, weights: int) -> float:
    """The one bits-per-weight of every account (plan, report, inspect): 8 * bytes / elements, where
    bytes are the weights' own (codes, scales, zero points; formats.nbytes), never layout metadata."""
    return 8 * nbytes / weights


def routed_expert_bytes(adapter: Adapter, format_key: str) -> int:
    """Bytes of all routed experts held in one format (exact, scales included)."""
    from moequant import formats

    spec = formats.parse_key(format_key)
    per_layer = 0
    for proj in adapter.projections:
        out_f, in_f = adapter.expert_shape(proj)
        per_layer += formats.nbytes(spec, (adapter.num_experts, out_f, in_f))
    bias_bytes = 0
    for shape, role in adapter.expected_tensors().values():
        if role.role == "routed_expert" and role.proj and role.proj.endswith("bias"):
            bias_bytes += formats.nbytes("bf16", shape)
    return per_layer * len(adapter.moe_layers) + bias_bytes


def _fitting_variant(adapter: Adapter, key: str):
    """Bytes in `key`, or in the same format with a smaller group when the shapes need it
    (gpt-oss's 2880 columns take int4 in groups of 64, not 128)."""
    from moequant.errors import UserError

    candidates = [key] + ([key.replace("g128", "g64"), key.replace("g128", "g32")] if "g128" in key else [])
    for k in candidates:
        try:
            return k, routed_expert_bytes(adapter, k)
        except UserError:
            continue
    return key, None


def account(adapter: Adapter) -> dict:
    """The whole memory account as one plain dict (what `moequant inspect --json` prints)."""
    from moequant import formats

    by_role = adapter.params_by_role()
    total = sum(by_role.values())
    routed = by_role["routed_expert"]
    k, E = adapter.top_k, adapter.num_experts
    active = total - routed + routed * k // E
    # a tied embedding is also the output projection, read whole for every token
    embedding = 0 if adapter.tie_embeddings else by_role["embedding"]
    non_routed_bf16 = formats.nbytes("bf16", (total - routed,))
    variants = {}
    for label, key in EXPERT_VARIANTS.items():
        key, experts = _fitting_variant(adapter, key)
        if experts is None:
            variants[label] = None  # no group size of this format divides the expert shapes
            continue
        whole = non_routed_bf16 + experts
        per_token = non_routed_bf16 - 2 * embedding + experts * k / E
        variants[label] = {
            "expert_format": key,
            "bytes": whole,
            "gigabytes": whole / 1e9,
            "routed_expert_bytes": experts,
            "bytes_per_token": int(per_token),
            "gpus_needed": {f"{g}GB": math.ceil(whole * (1 + KV_HEADROOM) / (g * 1e9)) for g in GPU_SIZES_GB},
        }
    return {
        "architecture": adapter.describe(),
        "total_params": int(total),
        "active_params": int(active),
        "active_params_excluding_embedding": int(active - embedding),
        "params_by_role": {r: int(n) for r, n in by_role.items() if n},
        "routed_expert_share": routed / total if total else 0.0,
        "variants": variants,
        "gpu_sizes_gb": list(GPU_SIZES_GB),
        "kv_headroom": KV_HEADROOM,
    }


def _fmt_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def format_bytes(n: float) -> str:
    """Bytes in decimal SI units (kB = 1000 bytes), the one way every command and report writes them."""
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def format_account(acc: dict, name: str) -> str:
    """Human-readable text of `account()`."""
    a = acc["architecture"]
    lines = [
        f"{name}: {a['model_type']}, {a['layers']} layers ({a['moe_layers']} MoE, {a['dense_layers']} dense), "
        f"{a['experts']} experts top-{a['top_k']}" + (f", {a['shared_experts']} shared" if a["shared_experts"] else ""),
        f"parameters: {_fmt_count(acc['total_params'])} total, {_fmt_count(acc['active_params'])} active per token "
        f"({_fmt_count(acc['active_params_excluding_embedding'])} without the embedding table); "
        f"routed experts hold {100 * acc['routed_expert_share']:.1f}%",
        "by role: " + ", ".join(f"{r} {_fmt_count(n)}" for r, n in acc["params_by_role"].items()),
        "",
        f"{'routed experts in':<18}{'weights':>12}{'read/token':>13}"
        + "".join(f"{g + ' GPUs':>11}" for g in (f"{s}GB" for s in acc["gpu_sizes_gb"])),
    ]
    for label, v in acc["variants"].items():
        if v is None:
            lines.append(f"{label:<18}{'n/a: shapes do not fit the format':>40}")
            continue
        if v["expert_format"] != EXPERT_VARIANTS[label]:
            label = v["expert_format"]
        lines.append(
            f"{label:<18}{format_bytes(v['bytes']):>12}{format_bytes(v['bytes_per_token']):>13}"
            + "".join(f"{v['gpus_needed'][f'{s}GB']:>11}" for s in acc["gpu_sizes_gb"])
        )
    lines.append(
        f"(everything but routed experts bf16; GPUs with {int(100 * acc['kv_headroom'])}% headroom for KV cache)"
    )
    if "bytes_on_disk" in acc:
        lines.append(
            f"on disk: {format_bytes(acc['bytes_on_disk'])} in {acc['tensors_on_disk']} tensors, "
            f"{_fmt_count(acc['params_on_disk'])} parameters"
        )
        if acc.get("source_formats"):
            lines.append("stored quantized: " + ", ".join(f"{n} weights {f}" for f, n in acc["source_formats"].items()))
    return "\n".join(lines)
