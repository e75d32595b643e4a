"""The two ways to run both models over the same tokens and feed one Tally: `evaluate` on two loaded models (the
reference implementation) and `evaluate_streaming` on two checkpoints one decoder layer at a time, the next
layer read ahead on a GPU."""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict

import torch

from moequant import timing
from moequant.evaluate.capture import Capture, has_fused_experts
from moequant.evaluate.tally import Tally, as_windows, check_batch_size, equal_length_batches, same_structure


def _input_device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


def _adapter(model):
    from moequant.arch import adapter_for

    return adapter_for(model.config.to_dict())


def evaluate(
    reference_model,
    quantized_model,
    samples,
    batch_size: int = 4,
    per_expert: bool = True,
    progress: bool = False,
    grouped: bool | None = None,
) -> dict:
    """Compare `quantized_model` with `reference_model` (transformers causal LMs, already loaded,
    eval mode) on `samples` (moequant.measure.data Samples, 1-D token tensors, or a [N, T] tensor).

    Returns a plain dict (JSON-ready); keys are described in the module docstring and below:
    tokens, samples, ppl_original, ppl_quantized, nll_original, nll_quantized, kl_mean, kl_p90,
    kl_p99, kl_max, top1_agreement, routing_agreement, moe_output_error,
    moe_output_error_accumulated, layers [{layer, routing_agreement, moe_output_error,
    moe_output_error_accumulated, tokens}], experts [{layer, expert, tokens, share, error,
    sq_error_per_token}], by_domain {domain: {...}}, seconds.

    This whole-model version is the reference implementation of `evaluate_streaming`, which
    computes the same numbers from checkpoints one decoder layer at a time. `grouped`: the per-expert
    errors by grouped matmuls (True) or one expert at a time (False); None: grouped on an accelerator.
    """
    check_batch_size(batch_size)
    adapter = _adapter(reference_model)
    same_structure(adapter, _adapter(quantized_model))
    windows = as_windows(samples)
    layers = list(adapter.moe_layers)
    expert_errors = per_expert and all(
        has_fused_experts(m, adapter, L) for m in (reference_model, quantized_model) for L in layers
    )
    tally = Tally(layers, adapter.num_experts, expert_errors, grouped)
    ref_cap = Capture(reference_model, adapter, keep_inputs=True)
    q_cap = Capture(quantized_model, adapter, keep_inputs=False)

    batches = list(equal_length_batches(windows, batch_size))
    it = batches
    if progress:
        from rich.progress import track

        it = track(batches, description="evaluating", total=len(batches))
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            for idx in it:
                ids = torch.stack([windows[i][0] for i in idx])
                doms = [windows[i][1] for i in idx]
                ref_cap.clear()
                q_cap.clear()
                ref_logits = reference_model(input_ids=ids.to(_input_device(reference_model)), use_cache=False).logits
                q_logits = quantized_model(input_ids=ids.to(_input_device(quantized_model)), use_cache=False).logits
                tally.add_logits(ids, doms, ref_logits, q_logits)
                del ref_logits, q_logits
                tally.add_tokens(doms, ids.shape[1])
                for li, L in enumerate(layers):
                    tally.add_moe_layer(
                        li, L, adapter, reference_model, quantized_model, ref_cap, q_cap, doms, ids.shape[1]
                    )
                ref_cap.clear()
                q_cap.clear()
    finally:
        ref_cap.remove()
        q_cap.remove()
    return tally.result(len(windows), time.perf_counter() - start)


def _logits(runner, b: int, hidden: torch.Tensor) -> torch.Tensor:
    """The causal LM's head on batch b's last decoder layer output (the decoder's final norm, then lm_head)."""
    head = runner.model.get_output_embeddings()
    # the skeleton keeps its final norm (and a tied head) on the host, an untied head on the device
    # (a decoder's own head, as DeepSeek-V4's and Hunyuan-V4's hyper-connection head, may end in another dtype)
    return head(runner.finish(b, hidden).to(head.weight.device, head.weight.dtype))


def _real_head(runner, adapter) -> None:
    """Make the skeleton's lm_head real (build_skeleton leaves it on the meta device)."""
    from moequant.io.layers import make_head_real

    make_head_real(runner.model, runner.checkpoint, adapter, runner.device, runner.dtype)


def evaluate_streaming(
    reference,
    quantized,
    samples,
    batch_size: int = 4,
    per_expert: bool = True,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
    grouped: bool | None = None,
) -> dict:
    """evaluate()'s numbers from two checkpoints (paths or open Checkpoints), without loading
    either model: both run layer by layer over the evaluation tokens (moequant.io.layers.LayerRunner,
    one decoder layer of each in memory at a time, the quantized one read through its
    dequantizing reader), with the same hooks and the same per-batch arithmetic as evaluate().
    Host memory: two decoder layers, the embedding and head, and both models' hidden states.
    `grouped`: as in evaluate()."""
    from moequant.io.checkpoint import open_checkpoint
    from moequant.io.layers import LayerRunner
    from moequant.io.loader import require_complete

    check_batch_size(batch_size)
    ref_ckpt = reference if hasattr(reference, "entries") else open_checkpoint(reference)
    q_ckpt = quantized if hasattr(quantized, "entries") else open_checkpoint(quantized)
    adapter, q_adapter = ref_ckpt.adapter, q_ckpt.adapter
    same_structure(adapter, q_adapter)
    for ckpt, ad in ((ref_ckpt, adapter), (q_ckpt, q_adapter)):
        require_complete(ckpt, ad)
    windows = as_windows(samples)
    layers = list(adapter.moe_layers)
    by_len: dict[int, list[int]] = defaultdict(list)  # the batches of evaluate(): equal lengths, original order
    for i, (ids, _) in enumerate(windows):
        by_len[ids.numel()].append(i)
    tally = None
    start = time.perf_counter()
    steps = [(length, L) for length in sorted(by_len) for L in range(adapter.num_layers)]
    if progress:
        from rich.progress import Progress

        bar = Progress()
        bar.start()
        task = bar.add_task("evaluating (layer by layer)", total=len(steps))
    try:
        with torch.no_grad():
            for length in sorted(by_len):
                idx = by_len[length]
                ids = torch.stack([windows[i][0] for i in idx])
                doms = [windows[i][1] for i in idx]
                batch_doms = [doms[s : s + batch_size] for s in range(0, len(idx), batch_size)]
                with timing.part("evaluate: set-up"):
                    ref_run = LayerRunner(ref_ckpt, adapter, ids, batch_size, device, dtype)
                    q_run = LayerRunner(q_ckpt, q_adapter, ids, batch_size, device, dtype)
                if tally is None:
                    expert_errors = per_expert and all(
                        has_fused_experts(r.model, adapter, L) for r in (ref_run, q_run) for L in layers
                    )
                    tally = Tally(layers, adapter.num_experts, expert_errors, grouped)
                for d in batch_doms:
                    tally.add_tokens(d, length)
                ref_cap = Capture(ref_run.model, adapter, keep_inputs=True)
                q_cap = Capture(q_run.model, q_adapter, keep_inputs=False)
                h_ref, h_q = list(ref_run.embedded), list(q_run.embedded)
                try:
                    layer_states = _timed(_layers_read_ahead((ref_run, q_run), adapter), "evaluate: read (waited for)")
                    for L, (ref_state, q_state) in layer_states:
                        with contextlib.ExitStack() as stack:
                            with timing.part("evaluate: materialize"):
                                ref_layer = stack.enter_context(ref_run.materialized(L, state=ref_state))
                                q_layer = stack.enter_context(q_run.materialized(L, state=q_state))
                            del ref_state, q_state  # the layers hold them: freed when they go back to meta
                            for b in range(len(h_ref)):
                                ref_cap.clear()
                                q_cap.clear()
                                with timing.part("evaluate: layers"):
                                    h_ref[b] = ref_run.run(ref_layer, L, b, h_ref[b])
                                    h_q[b] = q_run.run(q_layer, L, b, h_q[b])
                                if L in layers:
                                    with timing.part("evaluate: tally"):
                                        tally.add_moe_layer(
                                            layers.index(L),
                                            L,
                                            adapter,
                                            ref_run.model,
                                            q_run.model,
                                            ref_cap,
                                            q_cap,
                                            batch_doms[b],
                                            length,
                                        )
                            with timing.part("evaluate: materialize"):  # the layers back on the meta device
                                stack.close()
                        if progress:
                            bar.advance(task)
                finally:
                    ref_cap.remove()
                    q_cap.remove()
                with timing.part("evaluate: heads and logits"):
                    _real_head(ref_run, adapter)
                    _real_head(q_run, q_adapter)
                    for b, batch_ids in enumerate(ref_run.batches):
                        ref_logits, q_logits = _logits(ref_run, b, h_ref[b]), _logits(q_run, b, h_q[b])
                        tally.add_logits(batch_ids, batch_doms[b], ref_logits, q_logits)
    finally:
        if progress:
            bar.stop()
    return tally.result(len(windows), time.perf_counter() - start)


def _timed(states, name: str):
    """`states` (an iterator), the seconds spent waiting for each next item added to timing's part `name`."""
    it = iter(states)
    while True:
        with timing.part(name):
            item = next(it, None)
        if item is None:
            return
        yield item
        del item  # not held while the next one is read


def _layers_read_ahead(runs, adapter, ahead: bool | None = None):
    """(L, [each run's layer L state, or None: read when materialized]) for every decoder layer. With `ahead`
    (None: on a GPU with room for a second layer of every run, moequant.memory_budget) the next layer is read and
    decoded while this one computes: the evaluation was bound by reading both models' layers one after the
    other. Its routed experts are read by several threads at once, both models' together (`_read_states`).
    On the host it is not (host memory stays at one layer of each model)."""
    from concurrent.futures import ThreadPoolExecutor

    from moequant import memory_budget as budget

    if ahead is None:
        device = torch.device(runs[0].device)
        one_layer = sum(_layer_bytes(r, adapter) for r in runs)
        ahead = device.type == "cuda" and budget.device_free_bytes(device) >= 3 * one_layer
    if not ahead:
        for L in range(adapter.num_layers):
            yield L, [None] * len(runs)
        return
    with (
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="moequant-eval-read") as reader,
        ThreadPoolExecutor(max_workers=_READ_THREADS, thread_name_prefix="moequant-eval-read-experts") as slices,
    ):

        def read(L):
            return reader.submit(_read_states, runs, adapter, L, slices)

        pending = read(0)
        for L in range(adapter.num_layers):
            states = pending.result()
            if L + 1 < adapter.num_layers:
                pending = read(L + 1)
            yield L, states
            del states


_READ_THREADS = 8  # threads that read and decode one layer's routed experts (both models' at once)


def _read_states(runs, adapter, L: int, pool) -> list:
    """Each run's layer L state (LayerRunner.read_layer). An MoE layer's routed experts, stored one tensor per
    expert, are read first as slices of experts on `pool`'s threads, every run's at once, each slice cast into
    its place in one stack per projection, gate and up into the halves of the one gate_up stack transformers
    holds (one thread reading both models expert after expert was the evaluation's cost on a GPU; a separate
    gate and up stack cast into gate_up afterwards held a DeepSeek-V3 layer's largest tensor twice), then handed
    to read_layer, which reads the rest: the same values in the same dtype as read_layer reads itself."""
    if L not in adapter.moe_layers or adapter.fused_experts or pool is None:
        return [r.read_layer(L) for r in runs]
    E = adapter.num_experts
    step = max(1, -(-E // _READ_THREADS))

    def fill(r, p, stack, part, device):
        r.adapter.read_experts(r.checkpoint, L, p, part, device, r.dtype, out=stack[part.start : part.stop])

    shape = {p: (E,) + tuple(adapter.expert_shape(p)) for p in adapter.projections}
    stacks, jobs = [], []
    for r in runs:
        device = r.device if torch.device(r.device).type == "cuda" else None  # as read_layer: decoded there
        mine, into = {}, {}
        if "gate" in shape:  # [E, 2I, H]: gate rows, then up rows (the layout layer_state_dict builds)
            rows = shape["gate"][1]
            mine["gate_up"] = torch.empty((E, 2 * rows, shape["gate"][2]), dtype=r.dtype, device=device)
            into = {"gate": mine["gate_up"][:, :rows], "up": mine["gate_up"][:, rows:]}
        for p in adapter.projections:
            if p not in into:
                into[p] = mine[p] = torch.empty(shape[p], dtype=r.dtype, device=device)
            for lo in range(0, E, step):
                jobs.append(pool.submit(fill, r, p, into[p], range(lo, min(E, lo + step)), device))
        stacks.append(mine)
    for job in jobs:
        job.result()
    return [r.read_layer(L, experts=mine) for r, mine in zip(runs, stacks)]


def _layer_bytes(run, adapter) -> int:
    """Bytes of the largest decoder layer in the run's compute dtype (its routed experts dominate)."""
    experts = adapter.num_experts * sum(math.prod(adapter.expert_shape(p)) for p in adapter.projections)
    return experts * torch.empty((), dtype=run.dtype).element_size()
