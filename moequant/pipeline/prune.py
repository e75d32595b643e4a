"""`apply`'s prune stage (issue 58): the experts a workload never needs dropped before anything is quantized.

With `experts.prune` in the recipe, `apply` first writes OUTPUT/prune/:

  stats/       the source model's routing and REAP saliency on the calibration data (no Hessians, no
               sensitivities: what the choice reads; reused as OUTPUT/stats is)
  model/       the smaller model (moequant.export.prune: same family, fewer experts; its moequant_prune.json
               says what each layer dropped), reused while the source and the choice are unchanged
  prune.json   per MoE layer the experts dropped, their share of the calibration workload's routing, the
               bytes saved; and the price of pruning alone: KL / top-1 of the smaller model against the
               source on the evaluation split of the recipe's evaluation data, per domain

and the rest of the run (calibration, plan, quantize, export, evaluation, report) takes the smaller model as its
source: every export layout writes it as it writes any model of its family, and the report's quality is the
quantization's against the smaller model (prune.json holds the pruning's against the original).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import defaultdict

import numpy as np
import torch

from moequant.io.checkpoint import atomic_write_text, model_dtype, open_checkpoint
from moequant.measure.saliency import DROP_KL

PRUNE_SCHEMA = "moequant.prune_stage/1"


def prune_stage(run, settings):
    """OUTPUT/prune/ for `run` (a moequant.pipeline.run.Run whose recipe sets experts.prune); returns the Run
    whose source is the smaller model."""
    from moequant.export.prune import PRUNE_FILE, write_pruned_checkpoint
    from moequant.measure.calibrate import calibrate, model_fingerprint
    from moequant.measure.stats import load_stats
    from moequant.plan.prune import choose_drops, prune_layout, routing_mass

    prune = run.recipe.experts.prune
    directory = run.directory / "prune"
    by_budget = prune.by == "budget"
    criterion = "kl" if by_budget else prune.saliency
    if by_budget:  # the whole calibration of the source: the budget weighs dropping against its formats
        calibrate(run.source, directory / "stats", settings, overwrite=run.overwrite, progress=run.progress)
    else:
        light = _replaced(settings, hessians=False, formats=(), probe_samples=0, tensor_formats=(), save_hessians=False)
        calibrate(run.source, directory / "stats", light, overwrite=run.overwrite, progress=run.progress)
    stats = load_stats(directory / "stats", with_hessians=False)
    tensors = {L: dict(s.tensors) for L, s in stats.layers.items()}
    if criterion == "kl":
        drop_kl = _drop_probe(run, settings, directory)
        for L in tensors:
            tensors[L][DROP_KL] = torch.tensor(drop_kl[L], dtype=torch.float64)
    choice = None
    if by_budget:
        from moequant.plan.drop import drop_budget, drop_layouts, pruned_recipe

        drop_kl = {L: np.asarray(v) for L, v in drop_kl.items()}
        measure = lambda sets: _drop_sets(run, settings, sets)  # noqa: E731  (the KL of each count's drops at once)
        choice = drop_budget(run.recipe, run.source, stats, drop_kl, drop_layouts(run.adapter), measure=measure)
        rest = pruned_recipe(run.recipe, choice.layout)
        atomic_write_text(directory / "budget.json", json.dumps(_budget_record(choice), indent=1) + "\n")
        if choice.layout is None:
            (directory / "prune.json").unlink(missing_ok=True)  # an earlier run's: this run's report has no prune
            run.log("prune: the budget drops no expert (quantizing costs less than dropping at these bytes)")
            return dataclasses.replace(run, recipe=rest, plan=None)
        layout = choice.layout
        run = dataclasses.replace(run, recipe=rest)
        run.log(
            f"prune: the budget drops {layout.count} of {layout.experts} experts per MoE layer (drop KL "
            f"{choice.drop_loss:.4g}, formats' predicted KL {choice.quant_loss:.4g})"
        )
    else:
        layout = prune_layout(prune, run.adapter)
    drops = choice.drops if choice is not None else choose_drops(tensors, layout, criterion)
    model_dir = directory / "model"
    source_id = model_fingerprint(run.source)
    record_path = model_dir / PRUNE_FILE
    old = json.loads(record_path.read_text()) if record_path.exists() else {}
    wanted = {str(L): d for L, d in drops.items()}
    if old.get("dropped") != wanted or old.get("source_fingerprint") != source_id or old.get("mode") != layout.mode:
        write_pruned_checkpoint(run.source, drops, layout, model_dir, source_fingerprint=source_id)
        run.log(f"pruned model: {model_dir} ({layout.kept} of {layout.experts} experts per MoE layer)")
    else:
        run.log(f"pruned model: {model_dir} (up to date, reused)")
    small = open_checkpoint(model_dir)
    mass = routing_mass(tensors, drops)
    saved = run.source.stored_bytes - small.stored_bytes
    per_layer = {L: _expert_bytes(run.source, run.adapter, L, drops[L]) for L in drops}
    e = run.recipe.evaluate
    cost = pruning_cost(run.source, small, e.dataset, e.samples, e.seq_len, run.recipe.seed, device=run.device)
    record = {
        "schema": PRUNE_SCHEMA,
        "saliency": criterion,
        "by": prune.by or "count",
        "experts": layout.experts,
        "kept": layout.kept,
        "mode": layout.mode,
        "layers": {str(L): {"dropped": drops[L], "routing_mass": mass[L], "bytes_saved": per_layer[L]} for L in drops},
        "bytes_saved": saved,
        "quality": cost,
    }
    if choice is not None:
        record["budget"] = _budget_record(choice)
    atomic_write_text(directory / "prune.json", json.dumps(record, indent=1) + "\n")
    worst = max(mass.values())
    run.log(
        f"pruned {layout.count} of {layout.experts} experts per MoE layer ({criterion}): up to "
        f"{worst:.1%} of a layer's calibration routing, {saved / 1e6:.1f} MB saved, KL {cost['kl_mean']:.4g} "
        f"against the source on {e.dataset}"
    )
    return dataclasses.replace(run, source=small, plan=None)


def _replaced(settings, **changes):
    """`settings` with `changes` (CalibrationSettings: a dataclass, or a pydantic model since the settings refactor)."""
    if hasattr(settings, "model_copy"):
        return settings.model_copy(update=changes)
    return dataclasses.replace(settings, **changes)


def _probe_windows(run, settings) -> torch.Tensor:
    """The calibration data's held-out probe windows (those the quantization probe measures on)."""
    from moequant.measure.data import load_samples_with_holdout

    _, held_out = load_samples_with_holdout(
        settings.dataset, run.source.tokenizer, settings.samples, settings.probe_samples or 32, settings.seq_len,
        split="calibration", seed=settings.seed, allow_fewer=settings.allow_fewer,
    )  # fmt: skip
    return torch.stack([w.input_ids for w in held_out])


def _drop_sets(run, settings, sets: dict) -> dict:
    """{count: KL of the source with that count's drops all at once} on the probe windows."""
    from moequant.measure.drop_probe import run_drop_sets

    ids = _probe_windows(run, settings)
    return run_drop_sets(run.source, run.adapter, ids, sets, settings.batch_size, run.device)


def _drop_probe(run, settings, directory) -> dict[int, list[float]]:
    """{MoE layer: KL of dropping each expert} on the calibration data's held-out probe windows (the quantization
    probe's), measured once and kept in OUTPUT/prune/drop_probe.json while the source and the windows are the same."""
    from moequant.measure.calibrate import model_fingerprint
    from moequant.measure.drop_probe import run_drop_probe

    ids = _probe_windows(run, settings)
    key = {"source": model_fingerprint(run.source), "windows": hashlib.sha256(ids.numpy().tobytes()).hexdigest()}
    path = directory / "drop_probe.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    if old.get("key") != key:
        probe = run_drop_probe(run.source, run.adapter, ids, settings.batch_size, run.device)
        atomic_write_text(path, json.dumps({**probe, "key": key}) + "\n")
        old = {**probe, "key": key}
    return {int(L): v for L, v in old["layers"].items()}


def _budget_record(choice) -> dict:
    """budget.json: what the budget chose and what each count it tried cost."""
    return {
        "count": 0 if choice.layout is None else choice.layout.count,
        "drop_loss": choice.drop_loss,  # measured with the count's drops all at once (plan.drop)
        "quant_loss": choice.quant_loss,
        "routed_bytes": choice.routed_bytes,
        "counts": choice.counts,
    }


def _expert_bytes(ckpt, adapter, layer: int, experts: list[int]) -> int:
    """Stored bytes of some routed experts of one layer (a fused on-disk tensor: their share of it)."""
    if adapter.fused_experts:
        names = [n for n in adapter.expert_tensor_names(layer) if n in ckpt.stored]
        return sum(ckpt.stored[n].nbytes for n in names) * len(experts) // adapter.num_experts
    names = [adapter.expert_tensor_name(layer, e, p) for e in experts for p in adapter.projections]
    return sum(ckpt.entries[n].nbytes for n in names)


def pruning_cost(original, pruned, dataset, samples, seq_len, seed, batch_size=4, device="cpu") -> dict:
    """KL(original || pruned) mean / p99 and top-1 agreement over the evaluation split of `dataset`, overall and
    per domain: both models run layer by layer (moequant.io.layers.LayerRunner), only their logits compared
    (moequant.evaluate compares layer by layer and needs equal expert counts)."""
    from moequant.measure.data import load_samples
    from moequant.metrics import token_statistics

    original, pruned = open_checkpoint(original), open_checkpoint(pruned)
    windows = load_samples(dataset, original.tokenizer, samples, seq_len, split="evaluation", seed=seed)
    ids = torch.stack([w.input_ids for w in windows])
    domains = [w.domain for w in windows]
    dtype = model_dtype(original.config)
    logits = [_logits(c, ids, batch_size, device, dtype) for c in (original, pruned)]
    kl, same = token_statistics(logits[0].flatten(0, 1), logits[1].flatten(0, 1))[:2]
    kl, same = kl.reshape(ids.shape), same.reshape(ids.shape)
    by_domain = defaultdict(list)
    for i, d in enumerate(domains):
        by_domain[d].append(i)

    def summary(rows):
        k = kl[rows].flatten()
        return {
            "kl_mean": float(k.mean()),
            "kl_p99": float(torch.quantile(k, 0.99)),
            "top1": float(same[rows].float().mean()),
        }

    return {
        "dataset": dataset,
        "samples": len(windows),
        "seq_len": seq_len,
        **summary(list(range(len(windows)))),
        "domains": {d: summary(rows) for d, rows in sorted(by_domain.items())},
    }


def _logits(ckpt, ids, batch_size, device, dtype) -> torch.Tensor:
    """[N, T, V] float32 logits of `ckpt` on token windows `ids`, one decoder layer in memory at a time."""
    from moequant.io.layers import LayerRunner, make_head_real

    adapter = ckpt.adapter
    runner = LayerRunner(ckpt, adapter, ids, batch_size, device, dtype)
    hidden = list(runner.embedded)
    with torch.no_grad():
        for L in range(adapter.num_layers):
            with runner.materialized(L) as module:
                hidden = runner.forward(module, L, hidden)
        make_head_real(runner.model, ckpt, adapter, runner.device, runner.dtype)
        head = runner.model.get_output_embeddings()
        out = [head(runner.finish(b, h).to(head.weight.device)).float().cpu() for b, h in enumerate(hidden)]
    return torch.cat(out)
