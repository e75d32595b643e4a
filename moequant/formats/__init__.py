"""Number formats: configs, exact quantize / dequantize, column quantizer, byte accounting, packing.

    from moequant import formats
    spec = formats.get_format("int4", group_size=128, symmetric=True)   # spec.key == "int4-g128-sym"
    q = formats.quantize(weight, spec)          # weight [out, in] or [E, out, in]
    w_hat = q.dequantize(torch.float32); q.nbytes
    tensors = formats.pack_compressed_tensors(q)

specs.py: FormatSpec, the `Format` family interface and its registry; one file per family,
registering itself: bf16.py, fp8.py, integer.py (int8 / int4 / int3 / int2), mxfp4.py, nvfp4.py,
ggml.py (llama.cpp's block types). Each holds its spec parsing, key, byte cost, scale rule,
element encoding and compressed-tensors packing (which serving engines load it: moequant.targets).
elements.py: e2m1 / e8m0 / e4m3 encodings; core.py: quantize, dequantize and the GPTQ column
quantizer (shape-generic, asking the family for the element math); packing.py: bit streams,
compressed-tensors packing and the byte account's layout metadata (the GPTQ, AWQ, DeepSeek-FP8 and gpt-oss
layouts pack in their own files, moequant.layouts).
"""

from moequant.formats.core import (  # noqa: F401
    GRIDS,
    ColumnParams,
    ColumnQuantizer,
    QuantizedTensor,
    column_quantizer,
    dequantize,
    qdq,
    quantize,
    quantize_ggml,
    searched_fit,
    stack_experts,
)
from moequant.formats.packing import (  # noqa: F401
    LAYOUT_METADATA,
    compressed_tensors_format,
    compressed_tensors_weight_args,
    pack_compressed_tensors,
    pack_e2m1,
    pack_int32,
    packed_nbytes,
    unpack_compressed_tensors,
    unpack_e2m1,
    unpack_int32,
)
from moequant.formats.specs import (  # noqa: F401
    REGISTRY,
    Format,
    FormatSpec,
    all_keys,
    check_shape,
    format_names,
    get_format,
    nbytes,
    parse_key,
    register,
    spec_of,
)


def _register_every_format() -> None:
    """Import every module of this package: each format family registers itself (one file per family)."""
    import importlib
    import pkgutil

    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_register_every_format()
