"""A layer's routed experts read from disk for the quantize pass: where they go (`experts_placement`: the GPU in
the compute dtype, or host copies), and the next layer's read on a thread while this one computes, its GPU bytes
reserved in the memory budget until they are allocated (`submit_read_ahead`, when `read_ahead_fits`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from moequant import parallel, timing

READ_THREADS = 4  # threads reading and decoding one layer's experts on a GPU run
READ_SLICE = 4  # experts a thread reads at a time (its temporary on the GPU: that many experts)


def read_layer_experts(adapter, ckpt, layer: int, own: range | None, device=None, dtype=None) -> dict:
    """A layer's routed-expert weights {proj: [E, out, in]} from disk; this rank's experts only. With a GPU
    `device` their stored bytes go there and are decoded there, into `dtype`, by several threads a few experts
    at a time (one thread reading expert after expert was the model-free plans' limit); without, on the host as
    read (float32 for quantized sources: the CPU's exact path). Its seconds less the disk reads' are "decode"
    (transfer, decode and stacking; moequant.timing)."""
    with timing.stage("decode"):
        if device is None or dtype is None or adapter.fused_experts:
            return {
                p: parallel.read_experts(adapter, ckpt, layer, p, own, device=device, dtype=dtype)
                for p in adapter.projections
            }
        experts = own if own is not None else range(adapter.num_experts)
        stacks = {
            p: torch.empty((len(experts),) + tuple(adapter.expert_shape(p)), dtype=dtype, device=device)
            for p in adapter.projections
        }

        def fill(p, lo: int, hi: int) -> None:  # the same values read_experts gives, in their place
            stacks[p][lo:hi] = parallel.read_experts(
                adapter, ckpt, layer, p, experts[lo:hi], device=device, dtype=dtype
            )

        with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="moequant-read-experts") as pool:
            jobs = [
                pool.submit(fill, p, lo, min(len(experts), lo + READ_SLICE))
                for p in adapter.projections
                for lo in range(0, len(experts), READ_SLICE)
            ]
            for job in jobs:
                job.result()
        return stacks


def experts_placement(run, prepared: bool = False) -> tuple:
    """(device, dtype) `read_layer_experts` reads a layer into: on a GPU run the device, in the compute
    dtype when a forward runs (one resident copy serves the forward, the statistics and GPTQ; float32 only
    per chunk being solved), else float32 (round-to-nearest of the decoded values); (None, None) on the
    CPU and for a layer an algorithm prepares (AWQ's search), on host copies."""
    device = torch.device(run.settings.device)
    if device.type != "cuda" or prepared:
        return None, None
    return device, run.runner.dtype if run.runner is not None else torch.float32


def expert_bytes(adapter, experts: int, dtype) -> int:
    """Bytes of `experts` experts' three projections in `dtype`."""
    return experts * 3 * adapter.hidden * adapter.expert_intermediate * torch.finfo(dtype).bits // 8


def submit_read_ahead(reader, run, L: int, prepared: bool):
    """Read layer L's experts on the reader thread; on a GPU their bytes are reserved in the budget from now
    until they are allocated, so chunks sized meanwhile (this layer's statistics, GPTQ) leave room for them."""
    from moequant import memory_budget as budget

    device, dtype = experts_placement(run, prepared)
    n = run.adapter.num_experts if run.own is None else len(run.own)
    release = budget.reserve_gpu(expert_bytes(run.adapter, n, dtype)) if device is not None else (lambda: None)

    def read():
        try:
            return read_layer_experts(run.adapter, run.ckpt, L, run.own, device, dtype)
        finally:
            release()

    return reader.submit(read)


def read_ahead_fits(adapter, run, own: range | None, prepared: bool) -> bool:
    """Whether the next layer's experts may be read while this one computes: always into host memory; onto
    a GPU only when the budget (moequant.memory_budget) holds a second layer's experts besides this one's work."""
    from moequant import memory_budget as budget

    device, dtype = experts_placement(run, prepared)
    if device is None:
        return True
    n = adapter.num_experts if own is None else len(own)
    return budget.device_free_bytes(device) > 3 * expert_bytes(adapter, n, dtype)


def expert_buffers(adapter, experts: int, dtype, device) -> dict:
    """Empty {proj: [experts, out, in]} tensors for a layer's dequantized experts."""
    return {
        p: torch.empty((experts,) + tuple(adapter.expert_shape(p)), dtype=dtype, device=device)
        for p in adapter.projections
    }
