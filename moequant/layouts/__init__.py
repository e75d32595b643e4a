"""Export layouts, one file each: what the layout holds and refuses, how it packs a tensor, the config it
writes. base.py: the shared Layout class; registry.py: the layouts by name, which every caller asks.

compressed_tensors.py (the default), gptq.py, awq.py, deepseek_fp8.py, gpt_oss_mxfp4.py, gguf.py.
moequant.export writes any of them (export_checkpoint, the streamed export); moequant.export.gguf writes
the GGUF file itself. A new layout is one file whose class is passed to `register`."""

from moequant.layouts.awq import Awq
from moequant.layouts.base import Layout  # noqa: F401
from moequant.layouts.compressed_tensors import CompressedTensors
from moequant.layouts.deepseek_fp8 import DeepseekFp8
from moequant.layouts.gguf import Gguf
from moequant.layouts.gpt_oss_mxfp4 import GptOssMxfp4
from moequant.layouts.gptq import Gptq
from moequant.layouts.registry import LAYOUTS, RECIPE_LAYOUTS, layout_for, layout_refusal, register  # noqa: F401

for _layout in (CompressedTensors, Gptq, Awq, DeepseekFp8, GptOssMxfp4, Gguf):  # in the order messages list them
    register(_layout)
