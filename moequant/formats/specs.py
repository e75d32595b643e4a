"""Format configs: what a number format is, its canonical key, and its exact byte cost.

A format is one frozen `FormatSpec`. Every spec has a canonical `key` ("int4-g128-sym",
"fp8-block128", "mxfp4", ...) that round-trips through `parse_key`, so plans and reports can
name formats with plain strings.

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

import math
import re
from dataclasses import dataclass

from moequant.errors import UserError

FORMAT_NAMES = ("bf16", "fp8", "int8", "int4", "int3", "int2", "mxfp4", "nvfp4")
# llama.cpp's block types (moequant.formats.ggml): one per name, no parameters
GGML_FORMAT_NAMES = ("q8_0", "q6_k", "q5_k", "q5_1", "q5_0", "q4_k", "q4_1", "q4_0", "q3_k", "q2_k")
ALL_FORMAT_NAMES = FORMAT_NAMES + GGML_FORMAT_NAMES
INT_GROUP_SIZES = (32, 64, 128)
FP8_GRANULARITIES = ("channel", "block", "tensor")
FP8_BLOCK = 128
MX_GROUP = 32
NV_GROUP = 16


@dataclass(frozen=True)
class FormatSpec:
    """One number format.

    name:        "bf16" | "fp8" | "int8" | "int4" | "int3" | "int2" | "mxfp4" | "nvfp4"
    bits:        bits per element code (16, 8, 4, 3, 2)
    granularity: "none" (bf16) | "channel" (one scale per output row) | "tensor" |
                 "block" (fp8 128x128) | "group" (one scale per `group_size` inputs)
    group_size:  input columns per scale for "group"; block edge for "block"; else None
    symmetric:   False only for asymmetric integer groups (they store zero points)
    """

    name: str
    bits: int
    granularity: str
    group_size: int | None = None
    symmetric: bool = True

    @property
    def key(self) -> str:
        if self.name in ("bf16", "mxfp4", "nvfp4") or self.is_ggml:
            return self.name
        if self.name == "fp8":
            return "fp8-block%d" % self.group_size if self.granularity == "block" else "fp8-" + self.granularity
        if self.name == "int8":
            return "int8-channel"
        return "%s-g%d-%s" % (self.name, self.group_size, "sym" if self.symmetric else "asym")

    @property
    def is_int(self) -> bool:
        return self.name in ("int8", "int4", "int3", "int2")

    @property
    def is_ggml(self) -> bool:
        return self.name in GGML_FORMAT_NAMES

    @property
    def is_fp4(self) -> bool:
        return self.name in ("mxfp4", "nvfp4")

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


def get_format(name, **params) -> FormatSpec:
    """The spec for format `name` with its parameters; a FormatSpec passes through unchanged.

    bf16, mxfp4, nvfp4: no parameters (mxfp4 / nvfp4 accept their fixed group_size 32 / 16).
    fp8:  granularity="channel" (default) | "block" | "tensor"; block_size=128 for "block".
    int8: symmetric per output channel only.
    int4, int3, int2: group_size 32 | 64 | 128 (default 128), symmetric=True (default) | False.
    """
    if isinstance(name, FormatSpec):
        if params:
            raise UserError("format %s is already a spec; got extra parameters %s" % (name.key, sorted(params)))
        return name
    if not isinstance(name, str) or name not in ALL_FORMAT_NAMES:
        if isinstance(name, str) and _KEY_RE.match(name):
            if params:
                raise UserError("format key %r already fixes its parameters; got extra %s" % (name, sorted(params)))
            return parse_key(name)
        raise UserError("unknown format %r; accepted: %s" % (name, ", ".join(ALL_FORMAT_NAMES)))

    def take(allowed: dict) -> dict:
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            accepted = ", ".join(sorted(allowed)) or "none"
            raise UserError("format %s does not take parameter(s) %s; accepted: %s" % (name, ", ".join(unknown), accepted))
        return {k: params.get(k, v) for k, v in allowed.items()}

    if name == "bf16":
        take({})
        return FormatSpec("bf16", 16, "none")
    if name in GGML_FORMAT_NAMES:
        from moequant.formats.ggml import TYPES

        take({})
        t = TYPES[name]
        return FormatSpec(name, t.bits, "group", t.block, name in ("q8_0", "q6_k", "q5_0", "q4_0", "q3_k"))
    if name in ("mxfp4", "nvfp4"):
        fixed = MX_GROUP if name == "mxfp4" else NV_GROUP
        p = take({"group_size": fixed, "symmetric": True})
        if p["group_size"] != fixed or p["symmetric"] is not True:
            raise UserError("format %s has fixed group_size=%d and is symmetric; got group_size=%r, symmetric=%r"
                            % (name, fixed, p["group_size"], p["symmetric"]))
        return FormatSpec(name, 4, "group", fixed, True)
    if name == "fp8":
        p = take({"granularity": "channel", "block_size": FP8_BLOCK})
        if p["granularity"] not in FP8_GRANULARITIES:
            raise UserError("fp8 granularity %r is not supported; accepted: %s"
                            % (p["granularity"], ", ".join(FP8_GRANULARITIES)))
        if p["granularity"] == "block":
            if p["block_size"] != FP8_BLOCK:
                raise UserError("fp8 block_size %r is not supported; accepted: %d" % (p["block_size"], FP8_BLOCK))
            return FormatSpec("fp8", 8, "block", FP8_BLOCK)
        if "block_size" in params:
            raise UserError("fp8 block_size applies only to granularity='block', not %r" % p["granularity"])
        return FormatSpec("fp8", 8, p["granularity"])
    if name == "int8":
        p = take({"symmetric": True, "granularity": "channel"})
        if p["symmetric"] is not True or p["granularity"] != "channel":
            raise UserError("int8 is symmetric per output channel only; got symmetric=%r, granularity=%r"
                            % (p["symmetric"], p["granularity"]))
        return FormatSpec("int8", 8, "channel")
    p = take({"group_size": 128, "symmetric": True})
    if p["group_size"] not in INT_GROUP_SIZES:
        raise UserError("%s group_size %r is not supported; accepted: %s"
                        % (name, p["group_size"], ", ".join(map(str, INT_GROUP_SIZES))))
    if not isinstance(p["symmetric"], bool):
        raise UserError("%s symmetric must be true or false, got %r" % (name, p["symmetric"]))
    return FormatSpec(name, int(name[3:]), "group", p["group_size"], p["symmetric"])


_KEY_RE = re.compile(r"^(bf16|mxfp4|nvfp4|q8_0|q6_k|q5_k|q5_1|q5_0|q4_k|q4_1|q4_0|q3_k|q2_k|fp8-channel|fp8-tensor|fp8-block(\d+)|int8-channel|(int[234])-g(\d+)-(sym|asym))$")


def parse_key(key: str) -> FormatSpec:
    """Inverse of `FormatSpec.key`: "int4-g128-asym" -> the spec."""
    m = _KEY_RE.match(key) if isinstance(key, str) else None
    if m is None:
        raise UserError("unknown format key %r; accepted: bf16, fp8-channel, fp8-block128, fp8-tensor, "
                        "int8-channel, int{4,3,2}-g{32,64,128}-{sym,asym}, mxfp4, nvfp4" % (key,))
    if m.group(2):
        return get_format("fp8", granularity="block", block_size=int(m.group(2)))
    if m.group(3):
        return get_format(m.group(3), group_size=int(m.group(4)), symmetric=m.group(5) == "sym")
    if key.startswith("fp8-"):
        return get_format("fp8", granularity=key[4:])
    if key in GGML_FORMAT_NAMES:
        return get_format(key)
    if key == "int8-channel":
        return get_format("int8")
    return get_format(key)


def all_keys() -> list[str]:
    """Every valid format key, cheapest-first within a family."""
    keys = ["bf16", "fp8-channel", "fp8-block128", "fp8-tensor", "int8-channel"]
    for bits in (4, 3, 2):
        for g in INT_GROUP_SIZES:
            keys += ["int%d-g%d-sym" % (bits, g), "int%d-g%d-asym" % (bits, g)]
    return keys + ["mxfp4", "nvfp4"]


def _split_shape(shape) -> tuple[int, int, int]:
    shape = tuple(int(s) for s in shape)
    if len(shape) == 2:
        return 1, shape[0], shape[1]
    if len(shape) == 3:
        return shape
    raise UserError("weight shape %s is not supported; accepted: [out, in] or [experts, out, in]" % (shape,))


LAYOUTS = ("compressed-tensors", "gptq", "awq", "deepseek", "gpt-oss")


def nbytes(spec, shape, layout: str = "compressed-tensors") -> int:
    """Exact bytes of codes + scales + zero points for a weight of `shape` ([out, in] or [E, out, in];
    bf16 takes any shape: 2 bytes per element).

    Equal to the bytes of the tensors the packers write (per-expert scales for [E, out, in]).
    All layouts of a format cost the same, except that GPTQ and AWQ also store zero points
    for symmetric integer formats (layout="gptq" / "awq" counts them).
    Shapes the format cannot hold raise UserError, as `quantize` would.
    """
    spec = get_format(spec)
    if layout not in LAYOUTS:
        raise UserError("unknown layout %r; accepted: %s" % (layout, ", ".join(LAYOUTS)))
    if spec.name == "bf16":  # a plain tensor of any shape (norms, biases, a whole model's count)
        return 2 * math.prod(int(s) for s in shape)
    experts, rows, cols = _split_shape(shape)
    check_shape(spec, (rows, cols))
    if spec.is_ggml:  # whole blocks: 34 / 18 / 20 / 22 / 24 bytes per 32, 84 ... 210 per 256
        from moequant.formats.ggml import row_bytes

        per = rows * row_bytes(spec.name, cols)
    elif spec.name == "fp8":
        if spec.granularity == "channel":
            n_scales = rows
        elif spec.granularity == "tensor":
            n_scales = 1
        else:
            n_scales = math.ceil(rows / spec.group_size) * math.ceil(cols / spec.group_size)
        per = rows * cols + 4 * n_scales
    elif spec.is_int:
        words_per_row = math.ceil(cols * spec.bits / 32)
        groups = 1 if spec.granularity == "channel" else cols // spec.group_size
        per = 4 * rows * words_per_row + 2 * rows * groups
        if not spec.symmetric or layout in ("gptq", "awq"):
            per += 4 * math.ceil(rows * spec.bits / 32) * groups
    elif spec.name == "mxfp4":
        per = rows * cols // 2 + rows * cols // MX_GROUP
    else:  # nvfp4
        per = rows * cols // 2 + rows * cols // NV_GROUP + 4
    return experts * per


def check_shape(spec: FormatSpec, shape, name: str | None = None) -> None:
    """UserError when a weight of `shape` cannot be stored in `spec` (fp8 blocks allow ragged edges)."""
    rows, cols = int(shape[-2]), int(shape[-1])
    if rows < 1 or cols < 1:
        raise UserError("%s has empty shape %s; format %s needs at least one row and column"
                        % (_label(name), tuple(shape), spec.key))
    if spec.granularity == "group" and cols % spec.group_size:
        raise UserError("%s has %d input columns, not a multiple of the group size %d of format %s; "
                        "accepted: input columns divisible by %d (or a format with a smaller group)"
                        % (_label(name), cols, spec.group_size, spec.key, spec.group_size))


def _label(name: str | None) -> str:
    return "tensor %r" % name if name else "the weight"
