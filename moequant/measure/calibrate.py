"""Calibration: per-expert routing and input statistics, layer by layer in bounded memory.

For each decoder layer (one in memory at a time, see layers.py) the calibration hidden
states go through the layer; on MoE layers two hooks record:
- the router's output (the model's own router, so routing is exactly transformers'): real
  top-k hits, routing weights, rank of each choice, per domain;
- the experts' input: with all-experts coverage (default) every token is pushed through every
  expert *for the statistics only* — the layer output still uses the real routing — so rarely
  used experts get full-rank Hessians. Statistics over the real routed tokens are kept beside
  them: they are the usage signal and what GPTQ prefers when an expert has enough tokens.

Sensitivity of (expert, projection, format) is the predicted squared output error per token of
round-to-nearest in that format: tr(ΔW H ΔWᵀ) / n, with H = XᵀX over the expert's routed tokens
when it has at least `min_tokens` of them, else over all tokens (the all-experts Hessian).

Resumable: after each layer the carried hidden states and a progress marker are written to
`stats/.work/`; a rerun with the same inputs continues from the next layer. `summary.json` is
written last, so its presence means the statistics are complete.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file

from moequant.algorithms.registry import algorithm
from moequant.errors import UserError
from moequant.formats import REGISTRY
from moequant.io.checkpoint import atomic_write_text, open_checkpoint, save_atomic
from moequant.io.layers import LayerRunner, compute_dtype
from moequant.measure.collector import LayerCollector
from moequant.measure.probe import auto_probe_algorithm, probe_algorithm_for
from moequant.measure.settings import (  # noqa: F401  (the names library callers import from here)
    DEFAULT_SENSITIVITY_FORMATS,
    FINGERPRINT_VERSION,
    HESSIAN_WEIGHTINGS,
    MIN_ROUTED_TOKENS,
    CalibrationSettings,
    HessianRule,
)
from moequant.measure.stats import chosen_hessian, layer_file


def model_fingerprint(checkpoint) -> str:
    """Identifies a model by its config and tensor list (names, shapes, dtypes), not its path."""
    h = hashlib.sha256(json.dumps(checkpoint.config, sort_keys=True).encode())
    for name in sorted(checkpoint.entries):
        e = checkpoint.entries[name]
        h.update(f"{name}:{e.dtype}:{e.shape}".encode())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------- collection


def sensitivity(
    weights: dict[str, torch.Tensor],
    stats: dict[str, torch.Tensor],
    format_keys,
    rule: HessianRule,
    grid: str = "minmax",
    triton: bool = True,
):
    """Predicted per-token squared output error of round-to-nearest per (proj, format): tr(ΔW H ΔWᵀ)
    per expert, on the grid the quantize pass rounds onto: integer group formats (GPTQ's) on `grid`
    (the recipe's `gptq.grid`; searched: weighted by diag(H), with symmetric groups' scale signs),
    ggml types on their scale search weighted by diag(H), the others on their min/max rule.

    H is `chosen_hessian`'s. Computed where the statistics are (the layer's device), in chunks of
    experts, float64 on the CPU and float32 on accelerators (a ranking signal: 1e-6 relative is
    plenty). Formats that cannot hold a shape are left out (and reported). triton: the searched grid's Triton
    kernel may run (the recipe's gptq.gpu_math.triton)."""
    from moequant import formats

    out, skipped = {}, []
    for proj, W in weights.items():
        group = "down" if proj == "down" else "gate_up"
        if f"hessian.{group}" not in stats:
            break
        dev = stats[f"hessian_routed.{group}"].device
        dtype = torch.float64 if dev.type == "cpu" else torch.float32
        E, _, d = W.shape
        chunk = max(1, (2**30 if dev.type != "cpu" else 2**26) // (d * d))  # Hessian elements per chunk
        specs = []
        for key in format_keys:
            spec = formats.parse_key(key)
            try:  # the shape check alone: a trial quantization of an i-quant would start llama.cpp
                formats.check_shape(spec, tuple(W.shape[1:]))
                specs.append((key, spec))
            except UserError:
                skipped.append(f"{proj}:{key}")
        parts = {key: [] for key, _ in specs}
        for lo in range(0, E, chunk):
            idx = torch.arange(lo, min(E, lo + chunk), device=dev)
            _, H = chosen_hessian(stats, group, idx, rule)
            H = H.to(dtype)
            w = W[lo : lo + chunk].to(dev, torch.float32)
            imp = torch.diagonal(H, dim1=-2, dim2=-1).float()  # the scale searches' column weights
            for key, spec in specs:
                if spec.is_ggml:  # as the quantize pass will: the scale search weighted by diag(H)
                    q = formats.quantize_ggml(w, spec, importance=imp)
                elif grid == "searched" and spec.is_int and spec.granularity == "group":
                    q = formats.quantize(w, spec, grid="searched", importance=imp, triton=triton)
                else:
                    q = formats.quantize(w, spec)
                dW = w.to(dtype) - q.dequantize(dtype=dtype)
                parts[key].append(torch.einsum("eoi,eij,eoj->e", dW, H, dW).double())
        for key, _ in specs:
            out[f"sensitivity.{proj}.{key}"] = torch.cat(parts[key]).clamp_min(0)
    return out, skipped


def calibrate(
    model: str,
    output: str | Path,
    settings: CalibrationSettings,
    overwrite: bool = False,
    tokenizer=None,
    progress=True,
    samples=None,
) -> Path:
    """Calibrate `model` on `settings.dataset`; writes `output/` (see stats.py). Returns the path."""
    from moequant.io.run_lock import output_lock

    if settings.hessian_weighting not in HESSIAN_WEIGHTINGS:
        raise UserError(
            f"hessian_weighting {settings.hessian_weighting!r} is not one of {', '.join(HESSIAN_WEIGHTINGS)}."
        )
    if settings.batch_size < 1:
        raise UserError(f"batch_size {settings.batch_size} is not a number of samples; accepted: 1 or more.")

    ckpt = open_checkpoint(model)  # a bad checkpoint is refused before the directory is touched
    if ckpt.config_only:
        raise UserError(f"{model} has no weights (config only); calibration needs a full checkpoint.")
    with output_lock(output, "calibrate"):  # one writer per directory, before anything is read or written
        return _calibrate(ckpt, output, settings, overwrite, tokenizer, progress, samples)


def _calibrate(ckpt, output, settings: CalibrationSettings, overwrite, tokenizer, progress, samples) -> Path:
    from moequant import parallel

    world = parallel.world()  # None: one process; else this rank collects its slice of every layer's experts
    adapter = ckpt.adapter
    adapter.check_shapes(ckpt)
    settings = settings.model_copy(update={"probe_algorithm": _probe_algorithm(settings, adapter)})
    output = Path(output)
    fingerprint = {"model": model_fingerprint(ckpt), **settings.fingerprint_fields()}
    fingerprint["formats"] = list(fingerprint["formats"])
    fingerprint["probe_tokens"] = "held-out" if samples is None else "in-sample"
    if samples is not None:  # the caller's pre-tokenised samples stand for the dataset (before the reuse check)
        fingerprint["dataset"] = hashlib.sha256(b"".join(s.input_ids.numpy().tobytes() for s in samples)).hexdigest()[
            :16
        ]
    if parallel.shared(lambda: _reusable_or_cleared(output, fingerprint, overwrite), "the statistics' reuse check"):
        return output  # complete and identical: reuse

    max_pos = int(ckpt.config.get("max_position_embeddings") or 0)
    if max_pos and settings.seq_len > max_pos:
        raise UserError(f"seq_len {settings.seq_len} exceeds the model's max_position_embeddings ({max_pos}).")
    samples, probe_ids = _calibration_samples(ckpt, adapter, settings, tokenizer, samples)
    input_ids = torch.stack([s.input_ids for s in samples])
    domains = sorted({s.domain for s in samples})
    token_domain = torch.tensor([domains.index(s.domain) for s in samples]).repeat_interleave(settings.seq_len)

    work = output / ".work"
    work.mkdir(parents=True, exist_ok=True)
    runner = LayerRunner(
        ckpt,
        adapter,
        input_ids,
        batch_size=settings.batch_size,
        device=settings.device,
        dtype=compute_dtype(settings.compute_dtype, settings.device),
    )
    if settings.probe_samples > 0 and adapter.moe_layers and runner.shared_between_layers:
        from moequant.measure.probe import shared_layers_refusal

        raise UserError(shared_layers_refusal(runner))  # now, not after the statistics pass
    start_layer, hidden = load_carried(work, fingerprint, len(runner.batches))
    hidden = runner.embedded if hidden is None else hidden
    writer = world is None or world.rank == 0  # the one process that writes stats/
    if start_layer and progress:
        print(
            f"calibrating: resuming at layer {start_layer} (layers 0-{start_layer - 1} were finished by an earlier run)"
        )
    if writer:
        atomic_write_text(work / "fingerprint.json", json.dumps(fingerprint))
    own = world.experts(adapter.num_experts) if world is not None else range(adapter.num_experts)

    timings = {}
    # whether the probe's algorithm reads the full Hessians (an algorithm the probe does not run is refused here)
    probe_needs_hessians = (
        settings.probe_samples > 0
        and bool(adapter.moe_layers)
        and algorithm(probe_algorithm_for(settings.probe_algorithm, settings.hessians)).hessians
    )
    for L in _progress(
        range(start_layer, adapter.num_layers), progress, "calibrating", adapter.num_layers, start_layer
    ):
        t0 = time.perf_counter()
        # expert-parallel: each rank reads its own experts, the layer's others are all-gathered (moequant.parallel)
        whole = parallel.whole_layer_experts(adapter, ckpt, L, world) if world and L in adapter.moe_layers else None
        with _naming_damaged_weights(ckpt, adapter, L), runner.materialized(L, experts=whole) as module:
            del whole
            if L in adapter.moe_layers:
                hidden, tensors, skipped, tokens = _moe_layer_statistics(
                    runner, module, L, hidden, ckpt, adapter, settings, domains, token_domain, own, world
                )
                if writer:
                    _write_layer_statistics(
                        output, work, L, tensors, skipped, tokens, settings.save_hessians, probe_needs_hessians
                    )
                del tensors
            else:
                hidden = runner.forward(module, L, hidden)
        if writer:
            save_carried(work, fingerprint, L + 1, hidden)
        timings[L] = time.perf_counter() - t0
    if not writer:  # rank 0 alone runs the probe and writes the summary; the others wait for it
        world.barrier("the calibration's probe and summary on rank 0")
        return output

    # The probes read the layers' sensitivities just written; they run before summary.json, so a
    # run killed during them resumes there (every layer already done).
    _run_probes(ckpt, adapter, output, settings, input_ids, probe_ids, progress)
    summary = _summary(ckpt, adapter, output, fingerprint, settings, domains, input_ids.shape[0], work)
    atomic_write_text(output / "summary.json", json.dumps(summary, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    try:
        plot_routing(output)
    except Exception as e:  # a plot must never lose the statistics
        print(f"warning: routing plot not written ({e})")
    if world is not None:
        world.barrier("the calibration's probe and summary on rank 0")
    return output


def _probe_algorithm(settings: CalibrationSettings, adapter) -> str:
    """The algorithm the probe runs: settings.probe_algorithm, where `auto` (a library caller's default) is
    the probe format's family default algorithm as the probe measures it (apply resolves `auto` with
    the recipe's `algorithms:` map before calibration)."""
    if settings.probe_algorithm != "auto":
        return settings.probe_algorithm
    if not settings.probe_samples:
        return "rtn"  # nothing is probed
    shapes = [tuple(adapter.expert_shape(p)) for p in adapter.projections]
    return auto_probe_algorithm(settings.formats, shapes, lambda name: REGISTRY[name].default_algorithm(name))


def _calibration_samples(ckpt, adapter, settings: CalibrationSettings, tokenizer, samples):
    """(samples, the probe's held-out input ids or None). Drawn from settings.dataset when `samples`
    is None; else the caller's pre-tokenised samples (library use, tests)."""
    from moequant.measure.data import load_samples_with_holdout

    probe_ids = None  # the probe's own samples when they are held out from the statistics
    if samples is None:
        if tokenizer is None:
            tokenizer = ckpt.tokenizer
        n_probe = settings.probe_samples if adapter.moe_layers else 0
        samples, held_out = load_samples_with_holdout(
            settings.dataset,
            tokenizer,
            settings.samples,
            n_probe,
            settings.seq_len,
            split="calibration",
            seed=settings.seed,
            allow_fewer=settings.allow_fewer,
        )
        if held_out:
            probe_ids = torch.stack([s.input_ids for s in held_out])
    return samples, probe_ids


def _moe_layer_statistics(
    runner, module, L: int, hidden, ckpt, adapter, settings: CalibrationSettings, domains, token_domain, own, world
):
    """One MoE layer's statistics (routing, Hessians, sensitivities; all-gathered under expert
    parallelism): (hidden states after the layer, tensors, skipped sensitivities, routed tokens)."""
    from moequant import parallel

    bs = settings.batch_size
    col = LayerCollector(
        adapter,
        adapter.experts_in_layer(module, L),
        adapter.num_experts,
        adapter.top_k,
        domains,
        settings.all_experts,
        settings.hessians,
        first_expert=own.start,
        chunk_experts=len(own),
        hessian_weighting=settings.hessian_weighting,
        reap=True,
    )

    def set_domains(b, col=col):
        col.token_domains = token_domain[b * bs * settings.seq_len : (b + 1) * bs * settings.seq_len]

    hidden = collect_moe_stats(runner, module, L, col, hidden, before_batch=set_domains)
    tensors = col.finish()
    weights = {p: parallel.read_experts(adapter, ckpt, L, p, own) for p in adapter.projections}
    sens, skipped = sensitivity(
        weights,
        tensors,
        settings.formats,
        settings.hessian_rule,
        settings.gptq_grid,
        settings.gptq.gpu_math.triton,
    )
    tensors.update(sens)
    _check_finite(tensors, L)
    if world is not None:
        tensors = _gathered_statistics(world, tensors, adapter.num_experts, settings.all_experts, L)
    return hidden, tensors, skipped, col.tokens


def _write_layer_statistics(
    output: Path, work: Path, L: int, tensors: dict, skipped, tokens, save_hessians: bool, probe_needs_hessians: bool
) -> None:
    """stats/ of one MoE layer. The full [E, d, d] Hessians live only inside this layer; the
    statistics keep their diagonals (stats.py); the GPTQ probe gets its own scratch copy."""
    hessians = {k: v for k, v in tensors.items() if k.startswith("hessian")}
    kept = {k: v for k, v in tensors.items() if not k.startswith("hessian")}
    kept.update(
        {f"{k.split('.')[0]}_diag.{k.split('.')[1]}": torch.diagonal(v, dim1=-2, dim2=-1) for k, v in hessians.items()}
    )
    if save_hessians:
        kept.update(hessians)
    elif hessians and probe_needs_hessians:
        save_atomic(hessians, work / f"hessians_{L:03d}.safetensors", {"layer": str(L)})
    save_atomic(kept, layer_file(output, L), {"layer": str(L), "tokens": str(tokens)})
    (work / f"skipped_{L:03d}.json").write_text(json.dumps(skipped))


def _run_probes(ckpt, adapter, output: Path, settings: CalibrationSettings, input_ids, probe_ids, progress) -> None:
    """The per-layer KL probe and the per-tensor probe (settings.tensor_formats), each file replaced."""
    from moequant.measure.probe import probe_indices, run_probe, run_tensor_probe
    from moequant.measure.stats import PROBE_FILE, TENSOR_PROBE_FILE, write_probe, write_tensor_probe

    (output / PROBE_FILE).unlink(missing_ok=True)
    if settings.probe_samples > 0 and adapter.moe_layers:
        # Held-out samples when calibrate drew the data itself: the probe then measures GPTQ out of
        # sample (its Hessians never saw those tokens). Caller-given samples: the probe takes evenly
        # spaced ones of them (in sample).
        held_out = probe_ids is not None
        if not held_out:
            probe_ids = input_ids[probe_indices(input_ids.shape[0], settings.probe_samples)]
        probe = run_probe(
            ckpt,
            adapter,
            probe_ids,
            output,
            settings.formats,
            batch_size=settings.batch_size,
            device=settings.device,
            algorithm=settings.probe_algorithm,
            hessians=settings.hessians,
            rule=settings.hessian_rule,
            options=settings.algorithm_options,
            projections=settings.probe_projections,
            progress=progress,
        )
        write_probe(output, {**probe, "held_out": held_out})
    (output / TENSOR_PROBE_FILE).unlink(missing_ok=True)
    if settings.tensor_formats and settings.probe_samples > 0:
        if probe_ids is None:
            probe_ids = input_ids[probe_indices(input_ids.shape[0], settings.probe_samples)]
        write_tensor_probe(
            output,
            run_tensor_probe(
                ckpt,
                adapter,
                probe_ids,
                settings.tensor_formats,
                batch_size=settings.batch_size,
                device=settings.device,
                progress=progress,
            ),
        )


def _reusable_or_cleared(output: Path, fingerprint: dict, overwrite: bool) -> bool:
    """True when `output` holds complete statistics of this fingerprint; else it is made ready (cleared
    when `overwrite`), or refused."""
    from moequant.io.run_lock import clear_directory, is_lock_file

    summary_path = output / "summary.json"
    if summary_path.exists():
        made = json.loads(summary_path.read_text()).get("fingerprint", {})
        if made == fingerprint:
            return True
        version = made.get("version", 1)
        if version != FINGERPRINT_VERSION and made.get("model") == fingerprint["model"]:
            # an earlier moequant's statistics of this model: their settings cannot be compared, so made again once
            print(
                f"calibration: {output} holds statistics of an earlier moequant (fingerprint version {version}, now "
                f"{FINGERPRINT_VERSION}); calibrating again"
            )
        elif not overwrite:
            what = "another model" if made.get("model") != fingerprint["model"] else "other settings"
            raise UserError(
                f"{output} already holds calibration statistics of {what}; pass --overwrite to replace them, "
                "or choose another --output."
            )
        clear_directory(output)  # not rmtree: the held lock file stays
    elif output.exists() and any(not is_lock_file(p) for p in output.iterdir()) and not (output / ".work").exists():
        if not overwrite:
            raise UserError(
                f"{output} exists and is not a statistics directory; choose another --output or pass --overwrite."
            )
        clear_directory(output)
    return False


def _gathered_statistics(world, tensors: dict, num_experts: int, all_experts: bool, layer: int) -> dict | None:
    """One rank's statistics of its experts -> the whole layer's on rank 0 (None elsewhere). The routing
    counts and the all-tokens gate/up Hessian ([1, d, d]) are the same on every rank: rank 0's are kept."""
    out = {}
    for key in sorted(tensors):
        same_everywhere = key.startswith("routing.") or (all_experts and key in ("hessian.gate_up",))
        out[key] = (
            tensors[key]
            if same_everywhere
            else world.gather_experts(tensors[key], num_experts, f"layer {layer}'s statistic {key}")
        )
    return out if world.rank == 0 else None


def _summary(ckpt, adapter, output, fingerprint, settings, domains, n_samples, work) -> dict:
    layers, underused = [], []
    for L in adapter.moe_layers:
        t = load_file(str(layer_file(output, L)))
        count = t["routing.count"]
        tokens = int(count.sum()) // adapter.top_k
        layers.append({"layer": L, "tokens": tokens})
        for e in range(adapter.num_experts):
            if int(count[e]) < settings.min_tokens:
                underused.append({"layer": L, "expert": e, "routed_tokens": int(count[e])})
    skipped = {}
    for L in adapter.moe_layers:
        p = work / f"skipped_{L:03d}.json"
        if p.exists() and json.loads(p.read_text()):
            skipped[str(L)] = json.loads(p.read_text())
    return {
        "fingerprint": fingerprint,
        "model": str(ckpt.path),
        "model_type": adapter.model_type,
        "num_experts": adapter.num_experts,
        "top_k": adapter.top_k,
        "moe_layers": adapter.moe_layers,
        "samples": n_samples,
        "seq_len": settings.seq_len,
        "domains": domains,
        "all_experts": settings.all_experts,
        "min_tokens": settings.min_tokens,
        "layers": layers,
        "underused_experts": underused,
        "sensitivity_formats": list(settings.formats),
        "sensitivity_skipped": skipped,
    }


@contextmanager
def _naming_damaged_weights(ckpt, adapter, layer: int):
    """A non-finite activation or statistic in `layer` is re-raised naming the checkpoint tensor
    (and expert) that holds NaN/Inf, when there is one; only read on that failure path."""
    try:
        yield
    except UserError as error:
        prefix = f"model.layers.{layer}."
        names = [n for n in ckpt.keys() if n.startswith(prefix)] + (["model.embed_tokens.weight"] if layer == 0 else [])
        for name in names:
            t = ckpt.get(name) if name in ckpt else None
            if t is None or not t.is_floating_point():
                continue
            bad = ~torch.isfinite(t)
            if not bad.any():
                continue
            role = adapter.classify(name)
            expert = role.expert
            if expert is None and role.role == "routed_expert" and t.dim() == 3:  # fused [E, ...]
                expert = int(bad.flatten(1).any(1).nonzero()[0])
            where = f"layer {layer}" + (f", expert {expert}" if expert is not None else "") + f", {role.role}"
            raise UserError(
                f"checkpoint tensor {name} ({where}) holds {int(torch.isnan(t).sum())} NaN and "
                f"{int(torch.isinf(t).sum())} infinite values; the checkpoint is damaged."
            ) from None
        raise error


def _check_finite(tensors: dict, layer: int) -> None:
    for k, v in tensors.items():
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise UserError(f"calibration statistic {k} of layer {layer} is not finite; the model produced NaN/Inf.")


def hidden_record(fingerprint, next_layer: int) -> dict:
    """Metadata of `work/hidden.safetensors`: the run (fingerprint digest) and layer they feed."""
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()
    return {"fingerprint": digest, "next_layer": str(next_layer)}


def resume_layer(work: Path, fingerprint) -> int | None:
    """The layer to continue at from the carried hidden states in `work/`, or None to start over.

    The hidden states say themselves which run and layer they belong to: they are written
    before progress.json, so after a kill between the two writes they are one layer ahead of it
    (trusting progress.json would run that layer twice)."""
    from safetensors import safe_open

    path = work / "hidden.safetensors"
    if not path.exists():
        return None
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if meta.get("fingerprint") != hidden_record(fingerprint, 0)["fingerprint"]:
        return None
    return int(meta["next_layer"])


def load_carried(work: Path, fingerprint, num_batches: int):
    """(layer to continue at, carried hidden states per batch) from `work/`, or (0, None)."""
    start = resume_layer(work, fingerprint)
    if start is None:
        return 0, None
    saved = load_file(str(work / "hidden.safetensors"))
    return start, [saved[f"batch_{b}"] for b in range(num_batches)]


def save_carried(work: Path, fingerprint, next_layer: int, hidden: list) -> None:
    """The hidden states feeding `next_layer` (they record their run and layer), then progress.json."""
    save_atomic(
        {f"batch_{b}": h for b, h in enumerate(hidden)},
        work / "hidden.safetensors",
        hidden_record(fingerprint, next_layer),
    )
    atomic_write_text(work / "progress.json", json.dumps({"fingerprint": fingerprint, "next_layer": next_layer}))


def collect_moe_stats(runner, module, layer: int, collector: "LayerCollector", hidden, before_batch=None):
    """Run one MoE layer with the collector hooked to its router and experts; returns the outputs."""
    adapter = runner.adapter
    mlp = adapter.block_in_layer(module, layer)
    hooks = [
        adapter.router_module(mlp).register_forward_hook(collector.on_router),
        adapter.experts_in_layer(module, layer).register_forward_pre_hook(collector.on_experts, with_kwargs=True),
    ]
    try:
        return runner.forward(module, layer, hidden, before_batch=before_batch)
    finally:
        for h in hooks:
            h.remove()


def _progress(iterable, enabled, label, total, start):
    if not enabled:
        return iterable
    from rich.progress import track

    return track(iterable, description=label, total=total - start)


# ----------------------------------------------------------------------------- plots


def plot_routing(stats_dir: str | Path) -> Path:
    """routing.png: layers × experts routing share, and per-domain shares of one layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moequant.measure.stats import load_stats

    s = load_stats(stats_dir, with_hessians=False)
    layers = sorted(s.layers)
    share = torch.stack([s.layers[L].share for L in layers]).numpy()
    domains = s.layers[layers[0]].domains
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1.2, 1]})
    im = axes[0].imshow(share * s.layers[layers[0]].num_experts, aspect="auto", cmap="viridis")
    axes[0].set_xlabel("expert")
    axes[0].set_ylabel("MoE layer")
    axes[0].set_yticks(range(len(layers)), [str(L) for L in layers])
    axes[0].set_title("routing share × experts (1 = uniform)")
    fig.colorbar(im, ax=axes[0])
    mid = layers[len(layers) // 2]
    width = 0.8 / max(len(domains), 1)
    E = s.layers[mid].num_experts
    for i, d in enumerate(domains):
        axes[1].bar([e + i * width for e in range(E)], s.layers[mid].domain_share(d).numpy(), width=width, label=d)
    axes[1].set_title(f"layer {mid}: routing share per domain")
    axes[1].set_xlabel("expert")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    path = Path(stats_dir) / "routing.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
