"""Expert-parallel runs over torch.distributed: `torchrun --nproc-per-node N -m moequant apply ...`.

The design, chosen so that every file of the run equals a one-process run's, bit for bit:
- Each rank (one process, one GPU) owns a contiguous slice of every MoE layer's routed experts
  (`World.experts`); it reads only those experts' weights from disk.
- Everything else of a layer (attention, norms, router, shared experts, dense MLPs) runs on every
  rank over the same calibration tokens: it is cheap next to the experts' statistics and GPTQ, and
  it needs no communication.
- Each rank accumulates the statistics and Hessians of its own experts only and runs GPTQ / RTN
  on them. Then the layer's expert weights (the originals in calibration, the dequantized ones in
  the quantize pass) are all-gathered, so every rank runs the whole layer itself: the hidden
  states carried to the next layer are the one-process run's exactly (summing per-rank partial
  MoE outputs would change the order of the float additions, and so the next layer's GPTQ codes).
  The quantize pass's first forward only records the MoE block's input and routing, so there the
  other ranks' experts stay zeros and nothing is gathered.
- Rank 0 writes every shared file (stats/, plan.json, the carried hidden states, the progress
  records, the checkpoint, the report): statistics are gathered to it per layer. Each rank writes
  its experts' quantized codes to its own file in work/; rank 0 reads them all when it exports.
  A layer counts as finished once every rank has written it (a collective stands between the
  ranks' writes and rank 0's progress record), so a rerun after a killed rank continues at the
  last layer every rank finished.
- Decisions rank 0 takes from the files (reuse the statistics, the plan, the checkpoint; a refused
  lock or bad input) are broadcast (`shared`), so every rank takes the same path or stops with the
  same sentence. After the quantize pass the process group ends and rank 0 alone exports,
  evaluates and reports.
- Every collective has a timeout (MOEQUANT_COLLECTIVE_TIMEOUT seconds, default 1800): a rank that
  died or hangs makes the others stop with one sentence (`RankLost`, exit code 1) instead of
  waiting forever. torchrun itself also stops the other ranks when one fails.

A one-process run (WORLD_SIZE unset or 1) never creates a process group: `world()` is None and
every caller keeps its one-process code path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from moequant.errors import RankLost, UserError

DEFAULT_TIMEOUT_S = 1800.0
_WORLD: "World | None" = None
_JOINED = False  # this process has joined a torchrun job (stays True after `finish`)


def world_size() -> int:
    """Processes of this run from torchrun's environment (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def is_helper_rank() -> bool:
    """A rank other than 0 of a torchrun job (it prints nothing and writes no shared file)."""
    return world_size() > 1 and os.environ.get("RANK", "0").strip() not in ("", "0")


def world() -> "World | None":
    """The expert-parallel world of this process, or None in a one-process run."""
    return _WORLD


def says_errors() -> bool:
    """Whether this process prints a UserError: rank 0 always; another rank only once it has joined
    the job (before, every rank refuses the same input, and rank 0 says it once)."""
    return not is_helper_rank() or _JOINED


def expert_range(num_experts: int, rank: int, size: int) -> range:
    """Rank `rank`'s contiguous slice of `num_experts` experts (sizes differ by at most one)."""
    return range(rank * num_experts // size, (rank + 1) * num_experts // size)


def start(num_experts: int, device: str = "cpu") -> str:
    """Join the torchrun job (once per process) when WORLD_SIZE > 1; returns this rank's device
    (`cuda` becomes `cuda:LOCAL_RANK`). More ranks than experts are refused before the rendezvous."""
    global _WORLD, _JOINED
    size = world_size()
    if size <= 1:
        return device
    if size > num_experts:
        raise UserError(
            f"{size} processes were started but the model has {num_experts} routed experts per MoE layer; "
            f"every process needs at least one expert: start at most {num_experts} "
            f"(torchrun --nproc-per-node {num_experts})."
        )
    cuda = torch.device(device).type == "cuda"
    if cuda:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    if _WORLD is None:
        import torch.distributed as dist

        timeout = float(os.environ.get("MOEQUANT_COLLECTIVE_TIMEOUT", DEFAULT_TIMEOUT_S))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout))
        _WORLD = World(
            rank=dist.get_rank(),
            size=dist.get_world_size(),
            timeout=timeout,
            device=torch.device(device) if cuda else torch.device("cpu"),
        )
        _JOINED = True
    return device


def finish() -> None:
    """End the process group (every rank at the same point of the run); later code runs in one process."""
    global _WORLD
    if _WORLD is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
        _WORLD = None


def shared(fn, what: str):
    """`fn()` on rank 0, its result (or its UserError) handed to every rank; `fn()` itself without a world."""
    w = world()
    if w is None:
        return fn()
    outcome = None
    if w.rank == 0:
        try:
            outcome = ("ok", fn())
        except UserError as error:
            outcome = ("error", str(error))
            w.broadcast(outcome, what)
            raise
    outcome = w.broadcast(outcome, what)
    if outcome[0] == "error":
        error = UserError(outcome[1])
        error.said_by_rank0 = True  # the command line prints it once, on rank 0
        raise error
    return outcome[1]


@dataclass
class World:
    rank: int
    size: int
    timeout: float
    device: torch.device  # where collectives' tensors live: the rank's GPU (NCCL) or the CPU (gloo)

    def experts(self, num_experts: int) -> range:
        return expert_range(num_experts, self.rank, self.size)

    def _run(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RuntimeError as error:  # DistBackendError (a lost peer, a timeout) is a RuntimeError
            first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
            raise RankLost(
                f"rank {self.rank} of {self.size}: {what} did not complete ({first}); another rank has "
                f"stopped or did not answer within {self.timeout:.0f} s, so this rank stops too; run the "
                "same command again to continue from the last layer every rank finished."
            ) from None

    def barrier(self, what: str) -> None:
        import torch.distributed as dist

        # a tiny all-reduce, not dist.barrier(): it honours the group's timeout on every backend
        self._run(what, dist.all_reduce, torch.zeros(1, device=self.device))

    def broadcast(self, obj, what: str):
        """Rank 0's `obj` on every rank (any picklable value)."""
        import torch.distributed as dist

        box = [obj]
        self._run(what, dist.broadcast_object_list, box, src=0, device=self.device)
        return box[0]

    def gather_objects(self, obj, what: str) -> list | None:
        """Every rank's `obj` in rank order on rank 0 (None elsewhere): small values only."""
        import torch.distributed as dist

        out = [None] * self.size if self.rank == 0 else None
        self._run(what, dist.gather_object, obj, out, dst=0)
        return out

    def _padded(self, local: torch.Tensor, num_experts: int) -> torch.Tensor:
        most = max(len(expert_range(num_experts, r, self.size)) for r in range(self.size))
        padded = torch.zeros((most,) + tuple(local.shape[1:]), dtype=local.dtype, device=self.device)
        padded[: local.shape[0]] = local
        return padded

    def _joined(self, parts: list[torch.Tensor], num_experts: int, like: torch.Tensor) -> torch.Tensor:
        rows = [p[: len(expert_range(num_experts, r, self.size))] for r, p in enumerate(parts)]
        return torch.cat(rows).to(like.device)

    def all_gather_experts(self, local: torch.Tensor, num_experts: int, what: str) -> torch.Tensor:
        """[own experts, ...] on every rank -> [num_experts, ...] on every rank (rows in expert order)."""
        import torch.distributed as dist

        padded = self._padded(local, num_experts)
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        self._run(what, dist.all_gather, parts, padded)
        return self._joined(parts, num_experts, local)

    def gather_experts(self, local: torch.Tensor, num_experts: int, what: str) -> torch.Tensor | None:
        """[own experts, ...] on every rank -> [num_experts, ...] on rank 0 (None elsewhere)."""
        import torch.distributed as dist

        padded = self._padded(local, num_experts)
        parts = [torch.empty_like(padded) for _ in range(self.size)] if self.rank == 0 else None
        self._run(what, dist.gather, padded, parts, dst=0)
        return self._joined(parts, num_experts, local) if self.rank == 0 else None


def read_experts(
    adapter, checkpoint, layer: int, proj: str, experts: range | None = None, device=None, dtype=None
) -> torch.Tensor:
    """`adapter.read_experts` for the experts of `experts` only (all when None): `[len, out, in]`."""
    if experts is not None and len(experts) == adapter.num_experts:
        experts = None
    return adapter.read_experts(checkpoint, layer, proj, experts, device=device, dtype=dtype)


def whole_layer_experts(adapter, checkpoint, layer: int, w: World) -> dict[str, torch.Tensor]:
    """A layer's original expert weights on every rank: each rank reads its own slice, the rest is all-gathered."""
    own = w.experts(adapter.num_experts)
    return {
        p: w.all_gather_experts(
            read_experts(adapter, checkpoint, layer, p, own), adapter.num_experts, f"layer {layer}'s {p} experts"
        )
        for p in adapter.projections
    }
