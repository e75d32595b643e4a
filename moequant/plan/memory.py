"""Every memory account of an MoE model, and the one way bytes are written as text.

- From the config alone (weights never loaded): `account`, its text `format_account`, `routed_expert_bytes`
  (all routed experts in one format); `inspect_model`, `moequant inspect`'s account cross-checked against the
  safetensors headers.
- Of checkpoints on disk, from their safetensors headers (or a GGUF file's, export.gguf.gguf_bytes):
  `checkpoint_bytes` (bytes by role and per routed expert), `original_tensor_name`, `is_expert_bias`,
  and `memory_account`, the `memory` section of report.json (moequant.report documents its keys;
  pipeline.pareto reads it too).
- Shared by both and by the plan: `bits_per_weight`, `gpus_needed`, GPU_SIZES_GB / KV_HEADROOM, and
  `format_bytes`, the byte formatter of the plan's summary, `inspect` and the report's tables and text
  (decimal SI units, "720.90 kB"; precheck's GiB and the report's plot axes write their own units).

Conventions (stated because published figures differ):
- `total_params`: every tensor of the checkpoint the config implies (MTP / next-token-prediction
  modules that transformers does not load are not counted, as DeepSeek's 671B does not).
- `active_params`: parameters used for one token = everything except the routed experts, plus
  top_k of the routed experts, embedding table included (Mistral, Qwen and OLMoE count so).
- `active_params_excluding_embedding`: the same without the input embedding table, which a
  token only looks one row up in (DeepSeek and OpenAI count so; it is also what decoding reads),
  unless the table is tied to the output projection, which reads all of it.
- Bytes per decoded token: weight bytes read to produce one token at batch size 1 = every tensor
  except the routed experts and the embedding table (one row of it is read, negligible; when lm_head
  is tied to it the table is read in full), plus the routed experts weighted by their expected use:
  top_k / E each from the config alone; top_k * share per layer in a checkpoint's account when routing
  shares are known.
- GPUs needed: weights × 1.2 (20 % headroom for KV cache and activations) over the GPU's memory
  in decimal gigabytes (24 / 80 / 141 GB as sold), rounded up.
- A checkpoint's bytes by role: every stored tensor is mapped back to the original tensor it encodes
  (compressed-tensors `X.weight_packed`, `X.weight_scale`, ... -> `X.weight`; GPTQ / AWQ `X.qweight`,
  `X.scales`, ... -> `X.weight`; DeepSeek `X.weight_scale_inv`; gpt-oss `..._blocks` / `..._scales`) and
  classified by the architecture adapter on that original name. Layout metadata (compressed-tensors
  `weight_shape`, GPTQ `g_idx`) counts in the total only, not in a role's bytes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from moequant.arch import Adapter
from moequant.errors import UserError

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
    for name, itemsize in adapter.stored_itemsizes().items():  # integer tables are not 2-byte floats
        non_routed_bf16 += (itemsize - 2) * math.prod(adapter.expected_tensors()[name][0])
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


# ----------------------------------------------------------------------------- a checkpoint's account

# Suffixes of stored tensors that encode the original tensor `module + ".weight"` (or `module`
# for gpt-oss's fused expert tensors, which have no ".weight").
_ENCODING_SUFFIXES = (
    ".weight_packed",
    ".weight_scale",
    ".weight_zero_point",
    ".weight_shape",
    ".weight_global_scale",
    ".weight_g_idx",
    ".weight_scale_inv",
    ".input_scale",
    ".input_zero_point",
    ".input_global_scale",
    ".qweight",
    ".qzeros",
    ".scales",
    ".g_idx",
    "_blocks",
    "_scales",
)


def original_tensor_name(name: str, expected) -> str:
    """The tensor of the original checkpoint that stored tensor `name` encodes (itself if none)."""
    if name in expected:
        return name
    for suffix in _ENCODING_SUFFIXES:
        if name.endswith(suffix):
            module = name[: -len(suffix)]
            for candidate in (module + ".weight", module):
                if candidate in expected:
                    return candidate
    return name


def checkpoint_bytes(path, adapter=None) -> dict:
    """Bytes of a checkpoint's tensors from its safetensors headers, by role and per routed expert.

    Returns {"by_role": {role: bytes}, "experts": {(layer, expert): bytes}, "fused_experts":
    {layer: bytes} (tensors holding every expert of a layer), "total": bytes (all as stored: codes
    and scales of quantized weights), "weights_by_role": {role: elements of the logical model, each
    quantized weight counted by its dense shape}, "layout_metadata": bytes, "expert_biases": {"bytes": int,
    "weights": int} (of the routed experts' bytes and elements: their biases, e.g. gpt-oss's)}.
    Layout metadata (compressed-tensors `weight_shape`, GPTQ `g_idx`: formats.LAYOUT_METADATA) is
    counted in "total" only, not in a role's bytes: those are the weights' own bytes (codes, scales,
    zero points), the account `formats.nbytes` and so the plan keep.
    """
    from moequant.export.gguf import GGUF_FILE, gguf_bytes
    from moequant.formats import LAYOUT_METADATA
    from moequant.io.checkpoint import open_checkpoint

    if (Path(path) / GGUF_FILE).exists():  # a GGUF export (moequant.export.gguf)
        return gguf_bytes(Path(path) / GGUF_FILE)
    ckpt = open_checkpoint(path)
    if ckpt.config_only:
        raise UserError(f"{path} has no safetensors weights to account for.")
    adapter = adapter or ckpt.adapter  # built once, kept on the checkpoint
    expected = adapter.expected_tensors()
    by_role: dict[str, int] = defaultdict(int)
    weights: dict[str, int] = defaultdict(int)
    experts: dict[tuple[int, int], int] = defaultdict(int)
    fused: dict[int, int] = defaultdict(int)
    metadata = 0
    biases = {"bytes": 0, "weights": 0}
    for name, entry in ckpt.entries.items():  # the logical model: quantized weights by their dense shape
        role = adapter.classify(name)
        weights[role.role] += entry.numel
        if is_expert_bias(role):
            biases["weights"] += entry.numel
    for name, entry in ckpt.stored.items():  # bytes as stored: codes and scales
        if name.rsplit(".", 1)[-1] in LAYOUT_METADATA:
            metadata += entry.nbytes
            continue
        role = adapter.classify(original_tensor_name(name, expected))
        by_role[role.role] += entry.nbytes
        if is_expert_bias(role):
            biases["bytes"] += entry.nbytes
        if role.role == "routed_expert":
            if role.expert is None:
                fused[role.layer] += entry.nbytes
            else:
                experts[(role.layer, role.expert)] += entry.nbytes
    return {
        "by_role": dict(by_role),
        "weights_by_role": dict(weights),
        "experts": dict(experts),
        "fused_experts": dict(fused),
        "total": sum(by_role.values()) + metadata,
        "layout_metadata": metadata,
        "expert_biases": biases,
    }


def is_expert_bias(role) -> bool:
    """A routed expert's bias (gpt-oss): counted with the routed experts' bytes, but not with the weight
    matrices that experts.budget.bits_per_weight and the plan's routed_bytes count."""
    return role.role == "routed_expert" and (role.proj or "").endswith("bias")


def _config_only_bytes(adapter) -> dict:
    """The original's account from its config alone (bf16), when its weights are not on disk."""
    from moequant.formats import nbytes

    weights = {r: n for r, n in adapter.params_by_role().items() if n}
    per_expert = {}
    biases = {"bytes": 0, "weights": 0}
    for shape, role in adapter.expected_tensors().values():
        if is_expert_bias(role):
            biases["bytes"] += nbytes("bf16", shape)
            biases["weights"] += math.prod(shape)
        if role.role == "routed_expert" and role.expert is not None:
            key = (role.layer, role.expert)
            per_expert[key] = per_expert.get(key, 0) + nbytes("bf16", shape)
    fused = {}
    if not per_expert:
        routed = nbytes("bf16", (weights.get("routed_expert", 0),))
        fused = {L: routed // max(len(adapter.moe_layers), 1) for L in adapter.moe_layers}
    by_role = {r: nbytes("bf16", (n,)) for r, n in weights.items()}
    return {
        "by_role": by_role,
        "weights_by_role": weights,
        "experts": per_expert,
        "fused_experts": fused,
        "total": sum(by_role.values()),
        "layout_metadata": 0,
        "expert_biases": biases,
    }


def _bytes_per_token(account: dict, adapter, shares: dict | None) -> int:
    """Weight bytes read per decoded token (module docstring)."""
    by_role = account["by_role"]
    fixed = sum(b for r, b in by_role.items() if r != "routed_expert")
    if not adapter.tie_embeddings:
        fixed -= by_role.get("embedding", 0)
    k, E = adapter.top_k, adapter.num_experts
    routed = 0.0
    for L in adapter.moe_layers:
        if L in account["fused_experts"]:
            routed += account["fused_experts"][L] * k / E
        for e in range(E):
            b = account["experts"].get((L, e), 0)
            use = k * shares[L][e] if shares and L in shares else k / E
            routed += use * b
    return int(round(fixed + routed))


def gpus_needed(nbytes: int) -> dict:
    """GPUs of each size needed to hold `nbytes` of weights with KV headroom (moequant.plan.memory convention)."""
    return {f"{g}GB": math.ceil(nbytes * (1 + KV_HEADROOM) / (g * 1e9)) for g in GPU_SIZES_GB}


def memory_account(original, checkpoint, shares: dict | None = None) -> dict:
    """The `memory` section of report.json: the original vs the written checkpoint, from file headers.

    `shares` maps layer -> [share per expert] (routing shares) for the bytes-per-token estimate.
    """
    from moequant.io.checkpoint import open_checkpoint

    orig_ckpt = open_checkpoint(original)
    adapter = orig_ckpt.adapter
    orig = _config_only_bytes(adapter) if orig_ckpt.config_only else checkpoint_bytes(original, adapter)
    quant = checkpoint_bytes(checkpoint, adapter)
    weights = orig["weights_by_role"]
    roles = [r for r in dict.fromkeys([*weights, *quant["by_role"]])]
    by_role = {
        r: {
            "weights": int(weights.get(r, 0)),
            "bytes_original": int(orig["by_role"].get(r, 0)),
            "bytes_quantized": int(quant["by_role"].get(r, 0)),
        }
        for r in roles
    }
    n_weights = sum(weights.values())

    def biases(account: dict, key: str) -> int:  # of the routed experts' weights or bytes (GGUF: none)
        return account.get("expert_biases", {}).get(key, 0)

    # the routed experts' weight matrices (their biases left out): what the budget and the plan count
    experts = {
        "weights": int(weights.get("routed_expert", 0) - biases(orig, "weights")),
        "bytes_original": int(orig["by_role"].get("routed_expert", 0) - biases(orig, "bytes")),
        "bytes_quantized": int(quant["by_role"].get("routed_expert", 0) - biases(quant, "bytes")),
    }

    def bpw(nbytes, n):
        return bits_per_weight(nbytes, n) if n else float("nan")

    return {
        "bytes_original": int(orig["total"]),
        "bytes_quantized": int(quant["total"]),
        "compression": orig["total"] / quant["total"] if quant["total"] else float("nan"),
        "weights": int(n_weights),
        "layout_metadata_bytes": int(quant.get("layout_metadata", 0)),  # none in a GGUF file
        "bits_per_weight": bpw(quant["total"] - quant.get("layout_metadata", 0), n_weights),
        "bits_per_weight_experts": bpw(experts["bytes_quantized"], experts["weights"]),
        "bits_per_weight_original": bpw(orig["total"], n_weights),
        "bits_per_weight_experts_original": bpw(experts["bytes_original"], experts["weights"]),
        "by_role": by_role,
        "routed_expert_matrices": experts,
        "bytes_per_token": {
            "original": _bytes_per_token(orig, adapter, shares),
            "quantized": _bytes_per_token(quant, adapter, shares),
        },
        "gpus_needed": {"original": gpus_needed(orig["total"]), "quantized": gpus_needed(quant["total"])},
        "gpu_sizes_gb": list(GPU_SIZES_GB),
        "kv_headroom": KV_HEADROOM,
    }


def inspect_model(model: str) -> dict:
    """Account for a checkpoint directory, a bare config.json or zoo:NAME.

    When weights are present, every tensor the config implies must exist with the implied
    shape (a mismatch is a UserError), and the byte count on disk is reported beside the account:
    `bytes_on_disk` / `tensors_on_disk` as the files store them (a quantized source: its codes and
    scales), `params_on_disk` the parameters of the logical model (every tensor the checkpoint
    holds, quantized weights counted by their dense shape, scales not counted; MTP layers included),
    and `source_formats` {format: weights} for a quantized source.
    """
    from moequant.io.checkpoint import open_checkpoint

    ckpt = open_checkpoint(model)
    adapter = ckpt.adapter
    acc = account(adapter)
    acc["model"] = str(model)
    acc["weights_checked"] = not ckpt.config_only
    if not ckpt.config_only:
        adapter.check_shapes(ckpt)
        acc["bytes_on_disk"] = ckpt.stored_bytes
        acc["tensors_on_disk"] = len(ckpt.stored)
        acc["params_on_disk"] = sum(e.numel for e in ckpt.entries.values())
        if ckpt.encodings:
            counts: dict[str, int] = {}
            for enc in ckpt.encodings.values():
                counts[enc.description] = counts.get(enc.description, 0) + 1
            acc["source_formats"] = dict(sorted(counts.items()))
    return acc
