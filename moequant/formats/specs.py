"""What a number format is: `FormatSpec` (plain data), the `Format` family interface, the registry.

A format is one frozen `FormatSpec`. Every spec has a canonical `key` ("int4-g128-sym",
"fp8-block128", "mxfp4", ...) that round-trips through `parse_key`, so plans and reports can
name formats with plain strings. Everything a format does is its family's (`spec.family`): one
`Format` subclass per file of this package, registered by name; the rest of moequant asks the
spec (`spec.quantized`, `spec.is_int`, `nbytes(spec, shape)`) instead of comparing names.

Storage (what the packers in `moequant.formats.packing` write, and what `nbytes` counts):

| key                  | codes                         | scales                                  | zeros |
|----------------------|-------------------------------|-----------------------------------------|-------|
| bf16                 | bfloat16                      | -                                       | -     |
| fp8-channel          | float8_e4m3fn                 | fp32 per output row                     | -     |
| fp8-block128         | float8_e4m3fn                 | fp32 per 128x128 block (ragged edges)   | -     |
| fp8-tensor           | float8_e4m3fn                 | one fp32                                | -     |
| int8-channel         | int8 packed 4 per int32       | bf16 per output row                     | -     |
| intB-gG-sym/asym     | B bits packed densely in int32| bf16 per G inputs (fp16 in GPTQ / AWQ)  | B-bit packed in int32 (asym) |
| mxfp4                | e2m1, two per byte            | e8m0 (uint8) per 32 inputs              | -     |
| nvfp4                | e2m1, two per byte            | float8_e4m3fn per 16 inputs + one fp32  | -     |

`nbytes` counts codes + scales + zero points. It leaves out shape metadata that some layouts
carry (compressed-tensors' `weight_shape`, GPTQ's `g_idx`): those do not scale with the weight.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from moequant.errors import UserError
from moequant.registry import Registry

INT_GROUP_SIZES = (32, 64, 128)
FP8_GRANULARITIES = ("channel", "block", "tensor")
FP8_BLOCK = 128
MX_GROUP = 32
NV_GROUP = 16


@dataclass(frozen=True)
class FormatSpec:
    """One number format.

    name:        a registered format name ("bf16", "fp8", "int4", "mxfp4", "q4_k", ...)
    bits:        bits per element code (16, 8, 4, 3, 2)
    granularity: "none" (bf16) | "channel" (one scale per output row) | "tensor" |
                 "block" (fp8 128x128) | "group" (one scale per `group_size` inputs)
    group_size:  input columns per scale for "group"; block edge for "block"; else None
    symmetric:   False only for asymmetric integer groups (they store zero points)

    What the format *does* (its key, bytes, scale rule, packing, which engines load it) is its
    family's, `spec.family`: one `Format` registered per name (see `Format`).
    """

    name: str
    bits: int
    granularity: str
    group_size: int | None = None
    symmetric: bool = True

    @property
    def family(self) -> "Format":
        return REGISTRY[self.name]

    @property
    def key(self) -> str:
        return self.family.key(self)

    @property
    def quantized(self) -> bool:
        """False for bf16, which keeps the weights as they are."""
        return self.family.quantized

    @property
    def is_int(self) -> bool:
        return self.family.integer

    @property
    def is_ggml(self) -> bool:
        return self.family.ggml

    @property
    def is_fp4(self) -> bool:
        return self.family.e2m1

    @property
    def group_width(self) -> int | None:
        """Input columns that share one scale set (None: the whole row, i.e. per channel / tensor)."""
        if self.granularity in ("group", "block"):
            return self.group_size
        return None

    def bits_per_weight(self, shape) -> float:
        """Stored bits per weight element, scales and zero points included."""
        return 8.0 * nbytes(self, shape) / math.prod(shape)

    def __str__(self) -> str:
        return self.key


class Format:
    """A family of number formats: everything that depends on which format a tensor is in.

    Adding a format is one file in moequant/formats/ that subclasses this and calls `register`
    at import (the package imports every module in it). Methods take the spec, so one family
    serves several names (int8 / int4 / int3 / int2) and parameters (group sizes, symmetry).
    Shape-generic machinery (scale views by granularity, expert chunking, GPTQ's column walk)
    stays in moequant.formats.core and asks the family for the element math only.
    """

    names: tuple[str, ...] = ()
    quantized = True  # False: bf16, the weights as they are
    integer = False  # signed integer codes, bit-packed in int32 words
    ggml = False  # a llama.cpp block type: codes are the packed blocks (own quantizer)
    e2m1 = False  # 4-bit float elements, two per byte
    global_scale = False  # a per-expert fp32 scale on top of the block scales (nvfp4)
    ct_format = "pack-quantized"  # compressed-tensors' `format` of a group in this format

    # ---- what the format is
    def spec(self, name: str, params: dict) -> FormatSpec:
        """The spec of `name` with the user's parameters (validated; `take_params` helps)."""
        raise NotImplementedError

    def key(self, spec: FormatSpec) -> str:
        return spec.name

    def keys(self) -> list[str]:
        """Every key of the family (for all_keys; ggml types list theirs separately)."""
        return list(self.names)

    def map_char(self, spec: FormatSpec) -> str | None:
        """The letter of a format in a plan's expert map (bf16 "B", fp8 "F", mxfp4 "M", ...; None: a spare one)."""
        return spec.name[0].upper()

    def keys_help(self) -> str:
        """The family's keys as an error message lists them."""
        return ", ".join(self.keys())

    def parse_key(self, key: str) -> FormatSpec | None:
        return get_format(key) if key in self.names else None

    def nbytes(self, spec: FormatSpec, rows: int, cols: int, symmetric_zeros: bool) -> int:
        """Bytes of codes + scales (+ zero points) of one [rows, cols] weight; symmetric_zeros:
        the layout stores zero points for symmetric formats too (GPTQ, AWQ)."""
        raise NotImplementedError

    def check_cols(self, spec: FormatSpec, cols: int) -> str | None:
        """Why `cols` input columns cannot be stored (None when they can)."""
        if spec.granularity == "group" and cols % spec.group_size:
            return "not a multiple of the group size %d" % spec.group_size
        return None

    def default_algorithm(self, name: str) -> str:
        """What quantizes format `name` when a recipe's `algorithms` map does not name it."""
        return "gptq"

    # ---- the element math (float32 in and out; scales broadcast against x)
    def fit(self, spec: FormatSpec, xg, gs, name):
        """Scales (and zero points) over the last axis of xg -> tensors shaped xg.shape[:-1]."""
        raise NotImplementedError

    def encode(self, spec: FormatSpec, x, s, z, gs):
        raise NotImplementedError

    def decode(self, spec: FormatSpec, codes, s, z, gs):
        raise NotImplementedError

    # ---- compressed-tensors
    def ct_weight_args(self, spec: FormatSpec) -> dict | None:
        """The `weights` quantization args of a compressed-tensors config group (JSON data)."""
        raise UserError(f"format {spec.key} has no compressed-tensors scheme.")

    def pack_ct(self, q) -> dict:
        raise UserError(f"format {q.spec.key} has no compressed-tensors scheme.")

    def unpack_ct(self, tensors: dict, spec: FormatSpec):
        raise UserError(f"format {spec.key} has no compressed-tensors scheme.")


REGISTRY: Registry = Registry("format")  # get_format refuses an unknown name itself (it also parses keys)


def register(family: Format) -> Format:
    return REGISTRY.add(family, *family.names, unique=True)


def format_names(ggml: bool | None = None) -> tuple[str, ...]:
    """Registered format names, llama.cpp's block types last; ggml=False / True: without / only those."""
    if ggml is None:
        return format_names(False) + format_names(True)
    return tuple(n for n, f in REGISTRY.items() if f.ggml == ggml)


def get_format(name, **params) -> FormatSpec:
    """The spec for format `name` with its parameters; a FormatSpec passes through unchanged.

    bf16, mxfp4, nvfp4: no parameters (mxfp4 / nvfp4 accept their fixed group_size 32 / 16).
    fp8:  granularity="channel" (default) | "block" | "tensor"; block_size=128 for "block".
    int8: symmetric per output channel only.
    int4, int3, int2: group_size 32 | 64 | 128 (default 128), symmetric=True (default) | False.
    A format key ("int4-g64-asym") is accepted too, without parameters.
    """
    if isinstance(name, FormatSpec):
        if params:
            raise UserError("format %s is already a spec; got extra parameters %s" % (name.key, sorted(params)))
        return name
    if not isinstance(name, str) or name not in REGISTRY:
        spec = _parse(name) if isinstance(name, str) else None
        if spec is not None:
            if params:
                raise UserError("format key %r already fixes its parameters; got extra %s" % (name, sorted(params)))
            return spec
        raise UserError("unknown format %r; accepted: %s" % (name, ", ".join(format_names())))
    return REGISTRY[name].spec(name, params)


def take_params(name: str, params: dict, allowed: dict) -> dict:
    """`params` over the defaults `allowed`, refusing any parameter format `name` does not take."""
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        accepted = ", ".join(sorted(allowed)) or "none"
        raise UserError("format %s does not take parameter(s) %s; accepted: %s" % (name, ", ".join(unknown), accepted))
    return {k: params.get(k, v) for k, v in allowed.items()}


def fixed_group_spec(name: str, params: dict, group: int, bits: int) -> FormatSpec:
    """A symmetric format with one fixed group size (mxfp4, nvfp4): its spec, refusing other parameters."""
    p = take_params(name, params, {"group_size": group, "symmetric": True})
    if p["group_size"] != group or p["symmetric"] is not True:
        raise UserError(
            "format %s has fixed group_size=%d and is symmetric; got group_size=%r, symmetric=%r"
            % (name, group, p["group_size"], p["symmetric"])
        )
    return FormatSpec(name, bits, "group", group, True)


def _parse(key: str) -> FormatSpec | None:
    for family in dict.fromkeys(REGISTRY.values()):
        spec = family.parse_key(key)
        if spec is not None:
            return spec
    return None


def parse_key(key: str) -> FormatSpec:
    """Inverse of `FormatSpec.key`: "int4-g128-asym" -> the spec."""
    spec = _parse(key) if isinstance(key, str) else None
    if spec is None:
        families = dict.fromkeys(REGISTRY.values())
        raise UserError("unknown format key %r; accepted: %s" % (key, ", ".join(f.keys_help() for f in families)))
    return spec


@functools.lru_cache(maxsize=None)
def spec_of(key: str) -> FormatSpec:
    """parse_key, remembered: plans name their formats by key, row by row."""
    return parse_key(key)


def all_keys() -> list[str]:
    """Every valid format key but llama.cpp's block types, cheapest-first within a family."""
    out = []
    for family in dict.fromkeys(REGISTRY.values()):
        if not family.ggml:
            out += family.keys()
    return out


def _split_shape(shape) -> tuple[int, int, int]:
    shape = tuple(int(s) for s in shape)
    if len(shape) == 2:
        return 1, shape[0], shape[1]
    if len(shape) == 3:
        return shape
    raise UserError("weight shape %s is not supported; accepted: [out, in] or [experts, out, in]" % (shape,))


def nbytes(spec, shape, symmetric_zeros: bool = False) -> int:
    """Exact bytes of codes + scales + zero points for a weight of `shape` ([out, in] or [E, out, in];
    bf16 takes any shape: 2 bytes per element): the one byte account that inspect, the budget solver,
    the plan summary and the report share.

    Equal to the bytes of the tensors the packers write (per-expert scales for [E, out, in]).
    All layouts of a format cost the same, except that some also store zero points for symmetric
    integer formats (GPTQ, AWQ: their export layout's `symmetric_zeros`, which counts them here).
    Shapes the format cannot hold raise UserError, as `quantize` would.
    """
    spec = get_format(spec)
    if not spec.quantized:  # a plain tensor of any shape (norms, biases, a whole model's count)
        return spec.family.nbytes(spec, 1, math.prod(int(s) for s in shape), symmetric_zeros)
    experts, rows, cols = _split_shape(shape)
    check_shape(spec, (rows, cols))
    return experts * spec.family.nbytes(spec, rows, cols, symmetric_zeros)


def check_shape(spec: FormatSpec, shape, name: str | None = None) -> None:
    """UserError when a weight of `shape` cannot be stored in `spec` (fp8 blocks allow ragged edges)."""
    rows, cols = int(shape[-2]), int(shape[-1])
    if rows < 1 or cols < 1:
        raise UserError(
            "%s has empty shape %s; format %s needs at least one row and column"
            % (_label(name), tuple(shape), spec.key)
        )
    why = spec.family.check_cols(spec, cols)
    if why:
        size = spec.group_size
        raise UserError(
            "%s has %d input columns, %s of format %s; "
            "accepted: input columns divisible by %d (or a format with a smaller group)"
            % (_label(name), cols, why, spec.key, size)
        )


def _label(name: str | None) -> str:
    return "tensor %r" % name if name else "the weight"
