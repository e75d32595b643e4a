"""One memory budget for a run: how much device and host memory moequant's chunked work may take.

`--max-gpu-memory` / `--max-host-memory` (CLI; `configure` here) cap what this process holds;
by default the cap is what is free (on a GPU at most GPU_DEFAULT_SHARE of the card), less a margin, and on a
GPU `bound_allocator` holds what torch's caching allocator reserves within the same room. Every chunk size on
the quantize path (GPTQ batches, the scale refit, statistics Hessians) asks `temporary_bytes(device)`: the memory one
such computation may add on top of what is already resident, from the same accounting, instead
of a constant of its own. Results never depend on the budget: chunks split experts, whose
computations are independent (tests/test_memory_budget.py checks bit for bit).
"""

from __future__ import annotations

import os
import re
import threading

import torch

from moequant.errors import UserError

MARGIN_BYTES = 2 * 2**30  # left free for the allocator's fragmentation, kernels' workspaces, other processes
# without --max-gpu-memory, a run allocates at most this share of the card and its caching allocator reserves at
# most GPU_RESERVED_SHARE (`bound_allocator`): the rest is for serving processes and other work beside it (issue 55
# item 3: a DeepSeek-V3 layer within 60 GiB of an 80 GB card; what is allocated alone did not bound what the
# allocator reserved, 13 GiB above it)
GPU_DEFAULT_SHARE = 0.70
GPU_RESERVED_SHARE = 0.75
# the CPU's default share, small so that a CPU-only run's host memory stays near its resident layers (issue 55
# item 7, benchmarks/bench_host_rss.py); GPTQ batches and statistics chunks give the same codes at any size
CPU_TEMPORARY_BYTES = 2**30
_limits: dict[str, int | None] = {"gpu": None, "host": None}  # the caps; None: what is free
_reserved = {"gpu": 0}  # bytes promised to work in flight on another thread (a read-ahead) not yet allocated
_reserved_lock = threading.Lock()


def parse_bytes(text: str, what: str) -> int:
    """'80GiB', '60G', '512MiB', '1.5T', or a plain number of bytes -> bytes; anything else a UserError."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", str(text), re.IGNORECASE)
    if m is None:
        raise UserError(f"{what} {text!r} is not a memory size; write it like 60GiB, 512MiB or 1.5T")
    unit = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2).upper()]
    return int(float(m.group(1)) * unit)


def configure(max_gpu: str | int | None = None, max_host: str | int | None = None) -> None:
    """Set the run's caps (None: what is free). Strings as `parse_bytes` reads them. Without a cap,
    MOEQUANT_MAX_GPU_MEMORY / MOEQUANT_MAX_HOST_MEMORY give one."""
    for key, value, flag in (("gpu", max_gpu, "--max-gpu-memory"), ("host", max_host, "--max-host-memory")):
        _limits[key] = None if value is None else (value if isinstance(value, int) else parse_bytes(value, flag))


def _limit(key: str) -> int | None:
    if _limits[key] is not None:
        return _limits[key]
    env = f"MOEQUANT_MAX_{key.upper()}_MEMORY"
    return parse_bytes(os.environ[env], env) if os.environ.get(env) else None


def gpu_limit_bytes() -> int | None:
    """The GPU cap, or None when the cap is what is free."""
    return _limit("gpu")


def host_limit_bytes() -> int | None:
    """The host cap (--max-host-memory / MOEQUANT_MAX_HOST_MEMORY), or None when the cap is what is free."""
    return _limit("host")


def host_available_bytes() -> int:
    """MemAvailable (Linux), else a conservative 8 GiB."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def check_device(device) -> str:
    """`device` as given, once this machine has it: cpu, cuda or cuda:N with that GPU present. Anything else
    is one sentence (the CLI's exit code 2), before a run writes anything."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise UserError(f"--device {device!r} is not a device moequant runs on; accepted: cpu, cuda or cuda:N.")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            why = "this PyTorch is a CPU-only build" if torch.version.cuda is None else "PyTorch finds no CUDA GPU here"
            raise UserError(f"--device {device} asks for a GPU, but {why}; run with --device cpu.")
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise UserError(
                f"--device {device} names GPU {parsed.index}, but this machine has {count} "
                f"(cuda:0 .. cuda:{count - 1}); name one of those."
            )
    return device


def device_free_bytes(device) -> int:
    """What this process may still allocate on `device`: free memory, within the cap (by default
    GPU_DEFAULT_SHARE of a GPU), less the margin."""
    device = torch.device(device)
    if device.type != "cuda":
        free = host_available_bytes()
        cap = _limit("host")
        if cap is not None:
            free = min(free, cap - rss_bytes())
        return max(0, free - MARGIN_BYTES)
    free, total = torch.cuda.mem_get_info(device)
    # memory the caching allocator holds but does not use is free for us too
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    cap = gpu_cap(_limit("gpu"), total)
    free = min(free, cap - torch.cuda.memory_allocated(device))
    return max(0, free - MARGIN_BYTES - _reserved["gpu"])


def gpu_cap(limit: int | None, total: int) -> int:
    """Bytes a run may allocate on a GPU of `total` bytes: --max-gpu-memory, else GPU_DEFAULT_SHARE of the card."""
    return limit if limit is not None else int(GPU_DEFAULT_SHARE * total)


def reserved_cap(limit: int | None, total: int) -> int:
    """Bytes the caching allocator may reserve: the cap plus the room the default leaves it (GPU_RESERVED_SHARE
    of the card, or of --max-gpu-memory scaled alike), never more than the card."""
    return min(total, int(gpu_cap(limit, total) * GPU_RESERVED_SHARE / GPU_DEFAULT_SHARE))


def bound_allocator(device) -> None:
    """On a GPU, hold the caching allocator's reserved memory to `reserved_cap` (it returns its cached blocks and
    retries before it goes past), in expandable segments unless PYTORCH_CUDA_ALLOC_CONF says otherwise: the
    fixed-size segments of the layer-sized buffers left gigabytes reserved and unusable beside what was allocated."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    if not os.environ.get("PYTORCH_CUDA_ALLOC_CONF") and not os.environ.get("PYTORCH_ALLOC_CONF"):
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9; older: the env only
        if setter is not None:
            setter("expandable_segments:True")
    index = device.index if device.index is not None else torch.cuda.current_device()  # "cuda": the current one
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(reserved_cap(_limit("gpu"), total) / total, index)


def reserve_gpu(nbytes: int):
    """Promise `nbytes` of the GPU to work that a thread is about to allocate (the next layer's read-ahead):
    chunks sized meanwhile leave them free. Returns the function that ends the promise (call it once that
    work holds its memory, or failed): while both count, the budget errs on the small side."""
    with _reserved_lock:
        _reserved["gpu"] += nbytes
    done = []

    def release() -> None:
        with _reserved_lock:
            if not done:
                _reserved["gpu"] -= nbytes
                done.append(True)

    return release


def temporary_bytes(device) -> int:
    """Memory one chunked computation (a GPTQ batch, a refit chunk, a chunk's Hessians) may add now."""
    device = torch.device(device)
    if device.type != "cuda":
        return max(2**26, min(CPU_TEMPORARY_BYTES, device_free_bytes(device) // 2))
    return max(2**26, int(0.85 * device_free_bytes(device)))


def rss_bytes() -> int:
    """This process's resident memory now (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
