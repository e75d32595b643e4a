"""`moequant inspect`: the memory account of a model, cross-checked against its safetensors headers."""

from __future__ import annotations

from moequant.io.checkpoint import open_checkpoint
from moequant.plan.memory import account


def inspect_model(model: str) -> dict:
    """Account for a checkpoint directory, a bare config.json or zoo:NAME.

    When weights are present, every tensor the config implies must exist with the implied
    shape (a mismatch is a UserError), and the byte count on disk is reported beside the account:
    `bytes_on_disk` / `tensors_on_disk` as the files store them (a quantized source: its codes and
    scales), `params_on_disk` the parameters of the logical model (every tensor the checkpoint
    holds, quantized weights counted by their dense shape, scales not counted; MTP layers included),
    and `source_formats` {format: weights} for a quantized source.
    """
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
