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
   an algorithm that prepares the whole layer first (AWQ: moequant.algorithms.awq_layer) gets the
   layer's float32 host copies and statistics before any of this, through its registered hook
   (`Algorithm.prepare_layer`), and may hand back full-precision tensors it changed;
3. the layer runs again with the dequantized weights (and the prepared full-precision tensors,
   rounded to their dtype as exported); its output is what layer L+1 sees.

Resumable: each finished layer's quantized (and replaced full-precision) tensors, report and
carried hidden states are written to `work/`; a rerun with the same plan and data continues at
the next layer. Under `moequant apply` (any safetensors layout) a layer's tensors are written as the
output's own shards while it is quantized (moequant.export.streamed: packed where the codes are,
the GPU); the library call and GGUF keep a work file of codes per layer (moequant.io.work_files).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from moequant import parallel, timing
from moequant.algorithms.registry import algorithm
from moequant.arch import Adapter
from moequant.errors import UserError
from moequant.io.checkpoint import Checkpoint, open_checkpoint
from moequant.io.layers import LayerRunner, compute_dtype, release_freed_memory
from moequant.measure.calibrate import CalibrationSettings
from moequant.measure.collector import LayerCollector
from moequant.pipeline.experts import _merge_chunk_report, _quantize_experts, _quantize_other
from moequant.pipeline.read_ahead import (
    expert_buffers,
    expert_bytes,
    experts_placement,
    read_ahead_fits,
    read_layer_experts,
    submit_read_ahead,
)
from moequant.pipeline.resume import collect_layer_files, plan_fingerprint, resume_point, save_layer
from moequant.pipeline.whole_layer import prepare_statistics, quantize_whole_layer, routing_recorder
from moequant.plan.model import Plan
from moequant.progress import LayerProgress


def _experts_per_chunk(adapter, device) -> int:
    """Experts whose Hessians (gate/up d x d, down I x I routed and all-tokens; sums and normalised
    copies, float32) and float32 weights fit half the run's memory budget (moequant.memory_budget; the other
    half is GPTQ's), on a GPU and on the CPU alike (chunks give the same codes: test_grouped_pipeline)."""
    from moequant import memory_budget as budget

    d, i = adapter.hidden, adapter.expert_intermediate
    per_expert = 2 * 4 * (d * d + 2 * i * i) + 4 * 3 * d * i
    return max(1, min(adapter.num_experts, budget.temporary_bytes(device) // 2 // per_expert))


def _statistics_and_quantize_in_chunks(
    runner, adapter, layer: int, hidden, expert_rows, host: dict, settings, own: range | None = None, store=None
):
    """GPTQ / RTN of one MoE layer's routed experts from one forward of the original layer.

    The forward records the MoE block's input and the router's choices (bf16 on the device, one
    copy of the calibration tokens); then, one chunk of experts at a time, the chunk's statistics
    and Hessians are built from that record, its weights (float32 on the device) quantized and
    its dequantized weights kept in the compute dtype, and the chunk's Hessians freed. With one
    chunk (small layers) this is the whole-layer computation itself.
    With `own` (an expert-parallel rank's slice, moequant.parallel), `host` and the returned
    dequantized experts hold those experts only; the others are zeros in the recording forward.
    Returns (quantized, report, dequantized experts {proj: [E, out, in]}, routed tokens per expert)."""
    E, dev, dtype = adapter.num_experts, runner.device, runner.dtype
    first, last = (own.start, own.stop) if own is not None else (0, E)
    if own is not None:  # the forward only records the experts' input: other ranks' experts need not be read
        host = {
            p: torch.cat(
                [
                    torch.zeros((first,) + tuple(h.shape[1:]), dtype=h.dtype, device=h.device),
                    h,
                    torch.zeros((E - last,) + tuple(h.shape[1:]), dtype=h.dtype, device=h.device),
                ]
            )
            for p, h in host.items()
        }
    record = {"x": [], "indices": [], "weights": []}

    def on_router(_module, _args, output):
        _, weights, indices = output
        record["indices"].append(indices.reshape(-1, adapter.top_k))
        weighted = settings.hessian_weighting != "tokens"  # routing weights kept only when the Hessians use them
        record["weights"].append(weights.detach().reshape(-1, adapter.top_k) if weighted else None)

    def on_experts(_module, args, kwargs):
        x = (args[0] if args else kwargs["hidden_states"]).detach()
        record["x"].append(x.reshape(-1, x.shape[-1]))

    quantized, report = {}, {}
    with _materialized(runner, layer, experts=host) as module:
        hooks = [
            adapter.router_module(adapter.block_in_layer(module, layer)).register_forward_hook(on_router),
            adapter.experts_in_layer(module, layer).register_forward_pre_hook(on_experts, with_kwargs=True),
        ]
        try:
            with timing.stage("forward"):  # only the record is used: the next layer reads the quantized output
                runner.forward(module, layer, hidden)
        finally:
            for hook in hooks:
                hook.remove()
        routed_tokens = torch.bincount(torch.cat(record["indices"]).reshape(-1), minlength=E)[:E].tolist()
        # one resident copy: each chunk's dequantized values overwrite its original weights once they are
        # copied for solving (a second layer-sized buffer where the resident copy is not in the compute dtype)
        in_place = own is None and all(
            h.dtype == dtype and h.device.type == torch.device(dev).type for h in host.values()
        )
        dequant = host if in_place else expert_buffers(adapter, last - first, dtype, dev)
        on_gpu = torch.device(dev).type == "cuda"
        chunk = _experts_per_chunk(adapter, dev)
        for lo in range(first, last, chunk):
            hi = min(last, lo + chunk)
            with timing.stage("statistics"):  # the chunk's input statistics and Hessians
                col = LayerCollector(
                    adapter,
                    adapter.experts_in_layer(module, layer),
                    E,
                    adapter.top_k,
                    [],
                    True,
                    True,
                    first_expert=lo,
                    chunk_experts=hi - lo,
                    hessian_weighting=settings.hessian_weighting,
                    # all tokens through an expert only where its routed tokens are too few for its own Hessian
                    all_tokens_experts=[n < settings.min_tokens for n in routed_tokens[lo:hi]],
                )
                for x, indices, weights in zip(record["x"], record["indices"], record["weights"]):
                    col.add_batch(x, indices, weights)
                collected = col.finish()
                col.t.clear()
            with timing.stage("solve_copy"):  # the chunk's float32 working copy
                weights = {p: host[p][lo:hi].to(dev, torch.float32) for p in adapter.projections}
            rows = [t for t in expert_rows if lo <= t.expert < hi]
            q, rep, dq = _quantize_experts(
                adapter,
                layer,
                rows,
                collected,
                settings.hessian_rule,
                dev,
                weights=weights,
                first_expert=lo,
                options=settings.algorithm_options,
                codes_to="cpu" if on_gpu else None,
                store=store,
            )
            with timing.stage("solve_copy"):  # the dequantized chunk back into the resident copy
                for p in adapter.projections:
                    dequant[p][lo - first : hi - first] = dq[p].to(dtype)
            quantized.update(q)
            _merge_chunk_report(report, rep)
            del collected, weights, dq
    return quantized, report, dequant, routed_tokens


def quantize_model(
    model: str,
    plan: Plan,
    settings: CalibrationSettings,
    work_dir: str | Path,
    samples=None,
    progress: bool = True,
    lazy: bool = False,
    export=None,
) -> tuple[dict, dict]:
    """`_quantize_model`, its seconds outside the stages it times (moequant.timing) as "quantize"."""
    with timing.stage("quantize"):
        return _quantize_model(model, plan, settings, work_dir, samples, progress, lazy, export)


def _quantize_model(
    model: str,
    plan: Plan,
    settings: CalibrationSettings,
    work_dir: str | Path,
    samples=None,
    progress: bool = True,
    lazy: bool = False,
    export=None,
) -> tuple[dict, dict]:
    """Run the sequential pass. Returns (quantized tensors keyed as `export_checkpoint` takes them,
    a per-layer report of algorithms and fallbacks). `lazy`: their codes stay in the work directory's
    layer files until the export reads them (which must happen before `work_dir` is removed).
    `export` (moequant.export.streamed.StreamedExport): each layer is written as the output's shards as
    it is quantized, no work file; the returned tensors are then only those outside the decoder
    layers, for `export.finish`.

    Where a layer preparation (AWQ) folded its scales into tensors that stay in full precision (post-attention
    norm, router, shared expert, experts the plan keeps), the mapping also holds them as plain tensors under
    their on-disk names, in the checkpoint's dtype: `export_checkpoint` writes them as they are."""
    world = parallel.world()  # None: one process; else this rank quantizes its slice of every layer's experts
    ckpt = open_checkpoint(model)
    adapter = ckpt.adapter
    _refuse_unsupported(plan, adapter, world)  # before any work
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    with timing.stage("data"):  # the calibration samples' tokens
        input_ids = _calibration_input_ids(ckpt, settings, samples)
    fingerprint = plan_fingerprint(
        plan,
        settings,
        hashlib.sha256(input_ids.numpy().tobytes()).hexdigest()
        + (f" ranks {world.size}" if world is not None else "")  # work/ files per rank
        + (f" streamed export {export.describe}" if export is not None else " work files"),
    )
    own = world.experts(adapter.num_experts) if world is not None else None

    rows_by_layer: dict[int | None, list] = {}
    for t in plan.tensors:
        rows_by_layer.setdefault(t.layer, []).append(t)

    # layers whose quantization reads calibration activations (GPTQ / AWQ / imatrix experts); after the
    # last of them no forward is needed at all (round-to-nearest reads only the weights)
    data_layers = sorted(
        {
            t.layer
            for t in plan.tensors
            if t.role == "routed_expert"
            and t.quantized
            and algorithm(t.algorithm).statistics
            and t.layer in adapter.moe_layers
        }
    )
    last_data_layer = data_layers[-1] if data_layers else -1
    runner = None
    if data_layers:
        with timing.stage("skeleton"):  # the model's skeleton, the embedded calibration tokens
            runner = LayerRunner(
                ckpt,
                adapter,
                input_ids,
                batch_size=settings.batch_size,
                device=settings.device,
                dtype=compute_dtype(settings.compute_dtype, settings.device),
            )
    with timing.stage("resume"):
        start, hidden = resume_point(work, fingerprint, runner, last_data_layer, world)
    bar = LayerProgress("quantizing", adapter.num_layers - start, int(input_ids.numel()), progress)
    run = _Pass(ckpt, adapter, settings, world, own, runner, work, fingerprint, last_data_layer, bar, export)
    # the next layer's experts are read from disk (into host memory) while this one computes
    from concurrent.futures import ThreadPoolExecutor

    reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moequant-read")
    if world is None:  # each layer's writes and resume record finish while the next layer computes
        run.saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moequant-save")
    read_ahead = {}
    try:
        for L in range(start, adapter.num_layers):
            bar.start(L)
            pending = read_ahead.pop(L, None)
            next_rows = rows_by_layer.get(L + 1, [])
            if (
                L + 1 in adapter.moe_layers
                and any(t.role == "routed_expert" for t in next_rows)
                and not _rtn_streamed(run, _routed_expert_rows(next_rows))
                and read_ahead_fits(adapter, run, own, _preparing(next_rows) is not None)
            ):
                read_ahead[L + 1] = submit_read_ahead(reader, run, L + 1, _preparing(next_rows) is not None)
            # `hidden` is held only here and in the call: each layer's input is freed once it returns its output
            with timing.stage("read_wait"):  # what the read-ahead did not hide behind the last layer's work
                host_experts = pending.result() if pending is not None else None
            hidden = _quantize_layer(run, L, rows_by_layer.get(L, []), hidden, host_experts)
            del host_experts
            with timing.stage("release"):
                release_freed_memory()
            bar.done(L)
        run.wait_saved()
    finally:
        reader.shutdown(wait=True, cancel_futures=True)
        if run.saver is not None:  # a stopped run still finishes the layer it was saving: its record stays whole
            run.saver.shutdown(wait=True)
        bar.close()

    if world is not None and world.rank != 0:  # rank 0 exports: it reads every rank's work/ files
        return {}, {}
    with timing.stage("collect"):
        return collect_layer_files(ckpt, adapter, work, rows_by_layer.get(None, []), world, lazy, export is None)


def _calibration_input_ids(ckpt, settings: CalibrationSettings, samples) -> torch.Tensor:
    """[samples, seq_len] token ids of the calibration samples (`samples`, or loaded as `settings` say)."""
    from moequant.measure.data import load_samples

    if samples is None:
        tokenizer = ckpt.tokenizer
        samples = load_samples(
            settings.dataset,
            tokenizer,
            settings.samples,
            settings.seq_len,
            split="calibration",
            seed=settings.seed,
            allow_fewer=settings.allow_fewer,
        )
    return torch.stack([s.input_ids for s in samples])


@dataclass
class _Pass:
    """What every layer of one quantize pass reads (fixed for the pass)."""

    ckpt: Checkpoint
    adapter: Adapter
    settings: CalibrationSettings
    world: parallel.World | None  # None: one process
    own: range | None  # this rank's experts (expert parallel), or None: all of them
    runner: LayerRunner | None  # None: no layer needs calibration activations
    work: Path
    fingerprint: str
    last_data_layer: int  # the last layer whose quantization reads activations (-1: none)
    bar: LayerProgress
    export: object = None  # StreamedExport: layers written as the output's shards (else work files)
    saver: object = None  # one process: the thread that finishes each layer's writes (`save_layer`)
    saving: object = None  # the future of the layer being saved there, if any

    def wait_saved(self) -> None:
        """Wait for the last layer's save (its exception, if any, raised here)."""
        if self.saving is not None:
            saving, self.saving = self.saving, None
            with timing.stage("save_wait"):
                saving.result()

    @property
    def rank(self) -> int:
        return self.world.rank if self.world is not None else 0


@contextlib.contextmanager
def _materialized(runner, layer: int, **weights):
    """`runner.materialized`, its set-up (the layer's module built, its non-expert tensors read) and its
    teardown timed as "materialize"."""
    with contextlib.ExitStack() as stack:
        with timing.stage("materialize"):
            module = stack.enter_context(runner.materialized(layer, **weights))
        yield module
        with timing.stage("materialize"):  # the module back on the meta device, its memory returned
            stack.close()


def _store(run: _Pass):
    """Where quantized stacks of experts go: the streamed export's packer, or (None) the returned mapping."""
    return run.export.store if run.export is not None else None


def _preparing(rows):
    """The algorithm that prepares the layer before rounding (AWQ: `Algorithm.prepare_layer`) in these rows, or
    None (one per layer: `_refuse_unsupported`)."""
    names = sorted({t.algorithm for t in rows if t.role == "routed_expert" and t.quantized})
    return next((algorithm(n) for n in names if algorithm(n).prepare_layer is not None), None)


RTN_CHUNK_BYTES = 2 * 2**30  # float32 expert weights per chunk of a streamed round-to-nearest layer: it is
# bound by reading the source, so larger chunks buy nothing but memory


def _routed_expert_rows(rows) -> list:
    """A layer's plan rows of routed experts' gate / up / down."""
    return [t for t in rows if t.role == "routed_expert" and t.expert is not None and t.proj in ("gate", "up", "down")]


def _needs_statistics(expert_rows) -> bool:
    """Whether quantizing these routed experts reads their inputs' statistics (GPTQ, AWQ, imatrix)."""
    return any(t.quantized and algorithm(t.algorithm).statistics for t in expert_rows)


def _rtn_streamed(run: "_Pass", expert_rows) -> bool:
    """Whether a layer's routed experts are round-to-nearest on a GPU with no statistics: then they are read,
    decoded, quantized and moved to the host a chunk of experts at a time (the next chunk read meanwhile),
    never a whole layer in float32 on the device."""
    return bool(expert_rows) and not _needs_statistics(expert_rows) and torch.device(run.settings.device).type == "cuda"


def _rtn_experts_streamed(run: "_Pass", L: int, mine: list):
    """Round-to-nearest of layer L's routed experts (this rank's), a chunk at a time (`_rtn_streamed`); codes
    go to the host per chunk. Returns (quantized, report, dequantized experts in the compute dtype when a
    later layer's forward needs them, else None)."""
    from concurrent.futures import ThreadPoolExecutor

    adapter, device = run.adapter, torch.device(run.settings.device)
    read_dtype = experts_placement(run)[1]
    first, last = (run.own.start, run.own.stop) if run.own is not None else (0, adapter.num_experts)
    chunk = max(1, RTN_CHUNK_BYTES // expert_bytes(adapter, 1, torch.float32))
    forward = L < run.last_data_layer
    dequant = expert_buffers(adapter, last - first, run.runner.dtype, device) if forward else None
    quantized, report = {}, {}
    starts = list(range(first, last, chunk))
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="moequant-read") as reader:

        def read(lo):
            return reader.submit(
                read_layer_experts, adapter, run.ckpt, L, range(lo, min(last, lo + chunk)), device, read_dtype
            )

        pending = read(starts[0])
        for i, lo in enumerate(starts):
            hi = min(last, lo + chunk)
            with timing.stage("read_wait"):
                weights = pending.result()
            if i + 1 < len(starts):
                pending = read(starts[i + 1])
            with timing.stage("decode"):
                weights = {p: w.to(device, torch.float32) for p, w in weights.items()}
            rows = [t for t in mine if lo <= t.expert < hi]
            q, rep, dq = _quantize_experts(
                adapter,
                L,
                rows,
                None,
                run.settings.hessian_rule,
                device,
                weights=weights,
                first_expert=lo,
                codes_to="cpu",
                store=_store(run),
            )
            quantized.update(q)
            _merge_chunk_report(report, rep)
            if forward:
                with timing.stage("solve_copy"):
                    for p in adapter.projections:
                        dequant[p][lo - first : hi - first] = dq[p].to(run.runner.dtype)
            del weights, q, dq
    return quantized, report, dequant


def _quantize_layer(run: _Pass, L: int, rows: list, hidden, host_experts: dict | None):
    """One decoder layer of the pass (module docstring): its plan `rows`, the hidden states entering it,
    `host_experts` read ahead (or None). Returns the hidden states the next layer reads."""
    t0 = time.perf_counter()
    adapter = run.adapter
    if run.export is not None:
        with timing.stage("pack_write"):
            run.export.begin_layer(L, run.rank)
    expert_rows = _routed_expert_rows(rows)
    other_rows = [t for t in rows if t not in expert_rows]
    mine = (
        expert_rows if run.own is None else [t for t in expert_rows if t.expert in run.own]
    )  # what this rank quantizes
    needs_stats = _needs_statistics(expert_rows)
    preparer = _preparing(expert_rows)  # AWQ: it changes the layer's weights before they are rounded
    collected, routed_tokens, routing_before, tokens, weights = None, None, [], {}, None
    streamed = _rtn_streamed(run, expert_rows)
    if expert_rows and (preparer or not needs_stats) and not streamed:
        dev = "cpu" if preparer else run.settings.device  # a preparation runs on host copies
        host = host_experts or read_layer_experts(
            adapter, run.ckpt, L, run.own, *experts_placement(run, preparer is not None)
        )
        with timing.stage("decode"):
            weights = {p: host[p].to(dev, torch.float32) for p in adapter.projections}
        del host
    chunked = None
    if L in adapter.moe_layers and needs_stats and not preparer:
        run.bar.stage("statistics and GPTQ")
        host = host_experts or read_layer_experts(adapter, run.ckpt, L, run.own, *experts_placement(run))
        chunked = _statistics_and_quantize_in_chunks(
            run.runner, adapter, L, hidden, mine, host, run.settings, run.own, _store(run)
        )
        del host
    elif L in adapter.moe_layers and needs_stats:
        run.bar.stage("statistics")
        collected, routed_tokens, routing_before, tokens = prepare_statistics(
            run.runner, adapter, L, hidden, weights, run.settings.hessian_weighting, preparer.prepare_tokens
        )
    quantized, report, experts_dq, replaced, prepared = {}, {}, None, {}, None
    if chunked is not None:
        quantized, report, experts_dq, routed_tokens = chunked
    elif streamed:
        run.bar.stage("quantizing experts")
        quantized, report, experts_dq = _rtn_experts_streamed(run, L, mine)
    elif expert_rows:
        run.bar.stage("quantizing experts")
        quantized, report, experts_dq, replaced, prepared = quantize_whole_layer(
            run, L, expert_rows, mine, weights, collected, tokens, preparer
        )
    with timing.stage("non_experts"):  # attention, shared experts, router: round-to-nearest or kept
        q_other, kept, forward_tensors = _quantize_layer_other(run, L, other_rows, replaced, experts_dq)
    if run.world is None or run.world.rank == 0:  # rank 0's work/ file holds the layer's non-expert tensors
        quantized.update(q_other)
    # a later layer's GPTQ / AWQ reads this layer's quantized output; a prepared layer's report also
    # compares its routing before and after the preparation
    routing_after = []
    if L < run.last_data_layer or (preparer and routing_before):
        run.bar.stage("quantized forward")
        hidden, routing_after = _quantized_forward(
            run, L, hidden, experts_dq, forward_tensors, record_routing=bool(preparer and routing_before)
        )
    del weights, experts_dq, collected
    if prepared is not None and prepared.finish is not None:  # its report entries; its diagnostics in work/
        diagnostics = run.work / f"{preparer.name}_{L:03d}.safetensors"
        prepared.finish(report, routing_before, routing_after, bool(q_other), diagnostics)
    quantized.update(kept)
    save_layer(run, L, quantized, report, routed_tokens, t0, hidden)
    return hidden


def _quantize_layer_other(run: _Pass, L: int, other_rows: list, replaced: dict, experts_dq: dict | None):
    """RTN of the layer's non-expert tensors (from `replaced` where a preparation changed them), and the
    full-precision replacements the plan keeps, in their checkpoint dtype; routed experts among those
    go into `experts_dq` (in place). Returns (quantized non-expert tensors, kept replacements,
    the non-expert tensors the quantized forward uses)."""
    adapter, ckpt, world = run.adapter, run.ckpt, run.world
    if world is not None and world.rank != 0 and L >= run.last_data_layer:
        other_rows = []  # rank 0 quantizes them; this rank runs no forward of the layer that would need them
    q_other, other_dq = _quantize_other(ckpt, other_rows, replaced)
    # full-precision replacements keep their checkpoint dtype; the forward sees them as exported
    kept = {n: t.to(ckpt.get(n).dtype) for n, t in replaced.items() if n not in q_other}
    for name, t in kept.items():
        role = adapter.classify(name)
        if role.role == "routed_expert":
            experts_dq[role.proj][role.expert] = t.float()
    forward_tensors = {
        **other_dq,
        **{n: t.float() for n, t in kept.items() if adapter.classify(n).role != "routed_expert"},
    }
    return q_other, kept, forward_tensors


def _quantized_forward(
    run: _Pass, L: int, hidden, experts_dq: dict | None, forward_tensors: dict, record_routing: bool
):
    """The layer with its dequantized weights (every rank runs the whole layer).
    Returns (its output hidden states, its routing [per batch] when `record_routing`, else [])."""
    world, routing_after = run.world, []
    if world is not None and experts_dq is not None:  # every rank runs the whole quantized layer
        experts_dq = {
            p: world.all_gather_experts(t, run.adapter.num_experts, f"layer {L}'s quantized {p} experts")
            for p, t in experts_dq.items()
        }
    with _materialized(run.runner, L, experts=experts_dq, tensors=forward_tensors) as module:
        hook = routing_recorder(run.adapter, module, L, routing_after) if record_routing else None
        try:
            with timing.stage("forward"):
                hidden = run.runner.forward(module, L, hidden)
        finally:
            if hook is not None:
                hook.remove()
    return hidden, routing_after


def _refuse_unsupported(plan: Plan, adapter, world) -> None:
    """What the plan's algorithms refuse for this model and run (`Algorithm.refusal`), before any work; and a
    layer two algorithms would both prepare."""
    rows_of: dict[str, list] = {}
    for t in plan.tensors:
        if t.quantized:
            rows_of.setdefault(t.algorithm, []).append(t)
    for name, rows in rows_of.items():
        refusal = algorithm(name).refusal
        why = refusal(adapter, rows, world.size if world is not None else 1) if refusal is not None else None
        if why:
            raise UserError(why)
    preparing: dict[int, set] = {}
    for name, rows in rows_of.items():
        if algorithm(name).prepare_layer is not None:
            for t in rows:
                preparing.setdefault(t.layer, set()).add(name)
    for L, names in sorted(preparing.items()):
        if len(names) > 1:
            raise UserError(
                f"layer {L}: algorithms {' and '.join(sorted(names))} would each prepare its weights before "
                "rounding; name one of them for that layer's formats."
            )
