"""TF32 tensor-core products for float32 CUDA matrix products, switched on only inside a block."""

from __future__ import annotations

import torch


class tf32_products:
    """Within the block, float32 CUDA matrix products may use TF32 tensor cores (when `enabled`);
    the caller's setting is restored on exit. Uses torch's fp32_precision setting where it
    exists (torch >= 2.9: mixing it with the legacy allow_tf32 flag raises on reads there)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self):
        if not self.enabled:
            return self
        matmul = torch.backends.cuda.matmul
        try:
            self.before, self.new_api = matmul.fp32_precision, True
        except AttributeError:
            self.new_api = False
        if self.new_api:
            matmul.fp32_precision = "tf32"
        else:
            self.before = matmul.allow_tf32
            matmul.allow_tf32 = True
        return self

    def __exit__(self, *exc):
        if self.enabled:
            if self.new_api:
                torch.backends.cuda.matmul.fp32_precision = self.before
            else:
                torch.backends.cuda.matmul.allow_tf32 = self.before
        return False
