"""The smaller model that dropping experts leaves: same architecture, fewer experts, written as a checkpoint.

`write_pruned_checkpoint(source, drops, output)` writes every tensor of `source` but the dropped experts':
each layer's kept experts renumbered 0.. in their original order (on-disk names from the pruned model's own
adapter, so every family transformers' conversion mapping names works alike), the router's rows of the
dropped experts removed (its weight, a router bias, DeepSeek's `e_score_correction_bias`), fused on-disk
experts (gpt-oss) sliced, and config.json's expert count set (the family's own key: `num_experts`,
`n_routed_experts`, `num_local_experts` ..., checked by building the pruned config's adapter). Grouped routing
dropping whole groups gets `n_group` and `topk_group` to match; top-k is unchanged. The result loads in
transformers, vLLM, SGLang and llama.cpp as the original family does, and the rest of moequant (calibrate,
plan, quantize, every export layout) takes it as any other model.

`layout` is a moequant.plan.prune.PruneLayout (count, experts, kept, mode, groups, topk_groups), `drops` its
choice per layer. Tensors are written as they are read (a quantized source is decoded, so its copy is in the model's dtype).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from moequant.errors import UserError
from moequant.io.checkpoint import (
    atomic_directory,
    atomic_write_text,
    copy_aux_files,
    model_dtype,
    open_checkpoint,
)
from moequant.io.shards import ShardWriter

COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts", "num_routed_experts")
PRUNE_FILE = "moequant_prune.json"  # beside config.json: what was dropped, for a reader and the report


def pruned_config(config: dict, adapter, layout) -> dict:
    """config.json of the pruned model: the expert count (where the family keeps it: top level or its text
    config), and, when whole groups go, the groups."""
    out = copy.deepcopy(config)
    text = out.get("text_config") if isinstance(out.get("text_config"), dict) else out
    keys = [k for k in COUNT_KEYS if text.get(k) == layout.experts]
    if not keys:
        raise UserError(
            f"config.json of this {adapter.model_type} model names its {layout.experts} experts under none of "
            f"{', '.join(COUNT_KEYS)}; moequant cannot write its pruned config."
        )
    for k in keys:
        text[k] = layout.kept
    if layout.mode == "whole_groups":
        text["n_group"] = layout.groups - layout.count // (layout.experts // layout.groups)
        text["topk_group"] = layout.topk_groups
    from moequant.arch import adapter_for

    derived = adapter_for(out).num_experts
    if derived != layout.kept:  # transformers reads the count elsewhere: never write a config it misreads
        raise UserError(
            f"the pruned config of this {adapter.model_type} model gives {derived} experts, not {layout.kept}; "
            "moequant cannot write its pruned config."
        )
    return out


def write_pruned_checkpoint(
    source, drops: dict[int, list[int]], layout, output, source_fingerprint: str | None = None
) -> Path:
    """Write the model `source` (a path or an open Checkpoint) without the experts `drops` ({MoE layer: experts})
    into `output`, atomically; `source_fingerprint` (the source's identity) is kept in its PRUNE_FILE.
    Returns the directory."""
    ckpt = open_checkpoint(source)
    adapter = ckpt.adapter
    if sorted(drops) != sorted(adapter.moe_layers) or any(len(set(d)) != layout.count for d in drops.values()):
        raise ValueError(f"drops must name {layout.count} experts of every MoE layer {adapter.moe_layers}")
    config = pruned_config(ckpt.config, adapter, layout)
    from moequant.arch import adapter_for

    small = adapter_for(config)
    kept = {L: [e for e in range(layout.experts) if e not in set(d)] for L, d in drops.items()}
    renamed = {}  # original on-disk name -> pruned on-disk name, for every kept expert
    skipped = set()
    for L in adapter.moe_layers:
        new_of = {e: i for i, e in enumerate(kept[L])}
        for e in range(layout.experts):
            for proj in adapter.projections:
                if adapter.fused_experts:
                    continue
                name = adapter.expert_tensor_name(L, e, proj)
                if e in new_of:
                    renamed[name] = small.expert_tensor_name(L, new_of[e], proj)
                else:
                    skipped.add(name)
    dtype = model_dtype(ckpt.config)
    with atomic_directory(output) as tmp:
        writer = ShardWriter(tmp)
        for name in ckpt.keys():
            if name in skipped:
                continue
            tensor = ckpt.get(name)
            role = adapter.classify(name)
            if role.layer in kept and role.role == "router" and tensor.shape[:1] == (layout.experts,):
                tensor = tensor[kept[role.layer]]  # the router's rows (weight, bias, selection bias) of kept experts
            elif role.layer in kept and role.role == "routed_expert" and role.expert is None:
                tensor = tensor[kept[role.layer]]  # fused on disk: [E, ...]
            if ckpt.encodings and name in ckpt.encodings and tensor.is_floating_point():
                tensor = tensor.to(dtype)  # a decoded quantized weight: stored in the model's dtype
            writer.add(renamed.get(name, name), tensor.contiguous())
        writer.finish()
        atomic_write_text(tmp / "config.json", json.dumps(config, indent=2) + "\n")
        copy_aux_files(ckpt.directory, tmp)
        # every tensor as the pruned config implies (a router row or expert the adapter did not see is refused)
        small.check_shapes(open_checkpoint(tmp))
        record = {
            "schema": "moequant.prune/1",
            "source": str(ckpt.path),
            "source_fingerprint": source_fingerprint,
            "experts": layout.experts,
            "kept": layout.kept,
            "mode": layout.mode,
            "dropped": {str(L): drops[L] for L in sorted(drops)},
        }
        atomic_write_text(tmp / PRUNE_FILE, json.dumps(record, indent=1) + "\n")
    return Path(output)
