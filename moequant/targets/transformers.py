"""transformers (target `transformers`): any per-expert mix, loaded by `moequant.load` (transformers' own
model classes, each expert dequantized by moequant's reader). Plain `from_pretrained` decodes every routed
expert of a compressed-tensors checkpoint with one scheme, so the compressed-tensors layout adds a guard
group when a checkpoint's routed experts have several formats (moequant.layouts.compressed_tensors)."""

from __future__ import annotations

from moequant.targets.base import Target


class Transformers(Target):
    name = "transformers"
    granularity = "expert"
    routed_formats = "every format moequant has but llama.cpp's block types"
