"""`moequant inspect`: the memory account of a model, cross-checked against its safetensors headers."""

from __future__ import annotations

from moequant.arch import adapter_for
from moequant.checkpoint import open_checkpoint
from moequant.memory import account


def inspect_model(model: str) -> dict:
    """Account for a checkpoint directory, a bare config.json or zoo:NAME.

    When weights are present, every tensor the config implies must exist with the implied
    shape (a mismatch is a UserError), and the byte count on disk is reported beside the account.
    """
    ckpt = open_checkpoint(model)
    adapter = adapter_for(ckpt.config)
    acc = account(adapter)
    acc["model"] = str(model)
    acc["weights_checked"] = not ckpt.config_only
    if not ckpt.config_only:
        adapter.check_shapes(ckpt)
        acc["bytes_on_disk"] = sum(e.nbytes for e in ckpt.entries.values())
        acc["tensors_on_disk"] = len(ckpt.entries)
    return acc
