"""How fast stored expert bytes reach the GPU, by the way they are read: one FP8-block shard of DeepSeek-V3-width
experts (`--experts` tensors of 2048 x 7168 float8 codes and their 128 x 128-block float32 scales, 3.8 GB at 256) is
written, read once to warm the page cache (as the evaluation finds a checkpoint the run has just written), then read
into one bf16 stack on the GPU per variant and thread count:

- `pageable`: as moequant.io.checkpoint.Checkpoint.read_stored read a tensor for a GPU before 82ea05a (and still
  reads one for the host): a zero-filled bytearray, a positioned read into it, then `.to(device, non_blocking=True)`
  from that pageable memory, decoded on the GPU;
- `pinned`: as it reads one for a GPU since: the positioned read lands in page-locked memory (torch's caching host
  allocator), then an asynchronous copy, decoded on the GPU.

Printed: seconds and GB/s of stored bytes for each, and whether every variant's stack equals the first one's.

    python benchmarks/bench_host_read.py --experts 256 --threads 1 8

Dated results, each with its command: benchmarks/RESULTS.md, section bench_host_read.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file

ROWS, COLS, BLOCK = 2048, 7168, 128


def write_shard(path: Path, experts: int) -> dict[str, tuple[int, int, tuple, torch.dtype]]:
    """The shard and {name: (offset, nbytes, shape, dtype)} of its tensors (read from its header)."""
    tensors = {}
    g = torch.Generator().manual_seed(0)
    for e in range(experts):
        codes = torch.randint(0, 120, (ROWS, COLS), dtype=torch.uint8, generator=g)  # finite e4m3 codes
        tensors[f"e{e}.weight"] = codes.view(torch.float8_e4m3fn)
        tensors[f"e{e}.weight_scale_inv"] = torch.rand(ROWS // BLOCK, COLS // BLOCK, generator=g) + 0.5
    save_file(tensors, str(path))
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    start = 8 + n
    dtypes = {"F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32}
    return {
        name: (
            start + h["data_offsets"][0],
            h["data_offsets"][1] - h["data_offsets"][0],
            tuple(h["shape"]),
            dtypes[h["dtype"]],
        )
        for name, h in header.items()
        if name != "__metadata__"
    }


def read_pageable(path, entry, device):
    offset, nbytes, shape, dtype = entry
    buf = bytearray(nbytes)
    with open(path, "rb") as f:
        f.seek(offset)
        f.readinto(buf)
    return torch.frombuffer(buf, dtype=dtype).reshape(shape).to(device, non_blocking=True)


def read_pinned(path, entry, device):
    offset, nbytes, shape, dtype = entry
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    with open(path, "rb") as f:
        f.seek(offset)
        f.readinto(buf.numpy())
    return buf.view(dtype).reshape(shape).to(device, non_blocking=True)


def decode_into(out, e, read, path, entries, device):
    codes = read(path, entries[f"e{e}.weight"], device)
    scales = read(path, entries[f"e{e}.weight_scale_inv"], device)
    w = codes.float().view(ROWS // BLOCK, BLOCK, COLS // BLOCK, BLOCK) * scales[:, None, :, None]
    if not torch.isfinite(w).all():  # the decoder's check (one device sync per tensor, as in moequant)
        raise ValueError(e)
    out[e] = w.view(ROWS, COLS)


def run(variant, threads, path, entries, experts, device):
    read = {"pageable": read_pageable, "pinned": read_pinned}[variant]
    out = torch.empty((experts, ROWS, COLS), dtype=torch.bfloat16, device=device)
    torch.cuda.synchronize()
    start = time.perf_counter()
    if threads == 1:
        for e in range(experts):
            decode_into(out, e, read, path, entries, device)
    else:
        with ThreadPoolExecutor(threads) as pool:
            for job in [pool.submit(decode_into, out, e, read, path, entries, device) for e in range(experts)]:
                job.result()
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--threads", type=int, nargs="+", default=(1, 8))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--work", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        path = Path(tmp) / "experts.safetensors"
        entries = write_shard(path, args.experts)
        stored = sum(v[1] for v in entries.values())
        with open(path, "rb") as f:  # warm the page cache
            while f.read(1 << 26):
                pass
        print(
            f"{datetime.date.today()} {torch.cuda.get_device_name()} torch {torch.__version__}: "
            f"{args.experts} experts, {stored / 1e9:.2f} GB stored"
        )
        rows, first = [], None
        for _ in range(args.repeats):
            for variant in ("pageable", "pinned"):
                for threads in args.threads:
                    seconds, out = run(variant, threads, path, entries, args.experts, device)
                    same = True if first is None else bool(torch.equal(out, first))
                    first = out if first is None else first
                    del out
                    rows.append(
                        {
                            "variant": variant,
                            "threads": threads,
                            "s": seconds,
                            "GB/s": stored / seconds / 1e9,
                            "equal": same,
                        }
                    )
                    print(
                        f"  {variant:<9} {threads:>2} threads  {seconds:6.2f} s  {stored / seconds / 1e9:6.2f} GB/s  equal {same}"
                    )
        if args.json:
            Path(args.json).write_text(json.dumps({"stored_bytes": stored, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
