"""Integer formats: int8 per output channel; int4 / int3 / int2 per group of 32, 64 or 128 inputs,
symmetric or asymmetric (zero points). Codes are signed int8 in memory, bit-packed in int32 words
on disk (moequant.formats.packing).

- symmetric: s = bf16(amax / (2^(B-1) - 1/2)), q = clamp(round(w / s), -2^(B-1), 2^(B-1)-1).
  The grid is the 2^B levels -2^(B-1)..2^(B-1)-1 (GPTQ's and compressed-tensors' convention):
  +-amax land on +-(2^(B-1) - 1/2), half a step from the end levels, so the largest element
  is off by at most the ordinary rounding error while the step is 2^(B-1)-1/2 : 2^(B-1)-1
  finer than with amax / (2^(B-1) - 1).
- asymmetric: the range [min(w, 0), max(w, 0)] is spread over 2^B - 1 steps,
  s = bf16((max - min) / (2^B - 1)), z = clamp(-2^(B-1) + round(-min / s)), q = clamp(round(w / s) + z)
  in signed codes -2^(B-1)..2^(B-1)-1, w = (q - z) * s (zero is exactly representable).
- the searched grid (core.searched_fit) of a symmetric group format also chooses each scale's sign:
  a negative scale mirrors the grid, so its extra level -2^(B-1) serves the group's positive side.

Scales are computed in float32 and rounded once to bfloat16, and codes are computed with that
stored scale. A bf16 scale is exactly representable in fp16 (within fp16's normal range, which
the GPTQ / AWQ packers check) and fp32, so whatever dtype an engine casts the scales to, it
multiplies by exactly the scale we used.
"""

from __future__ import annotations

import math
import re

import torch

from moequant.errors import UserError
from moequant.formats.specs import INT_GROUP_SIZES, Format, FormatSpec, register, take_params

_KEY = re.compile(r"^int([234])-g(\d+)-(sym|asym)$")


class Integer(Format):
    names = ("int8", "int4", "int3", "int2")
    integer = True

    def spec(self, name, params):
        if name == "int8":
            p = take_params(name, params, {"symmetric": True, "granularity": "channel"})
            if p["symmetric"] is not True or p["granularity"] != "channel":
                raise UserError(
                    "int8 is symmetric per output channel only; got symmetric=%r, granularity=%r"
                    % (p["symmetric"], p["granularity"])
                )
            return FormatSpec("int8", 8, "channel")
        p = take_params(name, params, {"group_size": 128, "symmetric": True})
        if p["group_size"] not in INT_GROUP_SIZES:
            raise UserError(
                "%s group_size %r is not supported; accepted: %s"
                % (name, p["group_size"], ", ".join(map(str, INT_GROUP_SIZES)))
            )
        if not isinstance(p["symmetric"], bool):
            raise UserError("%s symmetric must be true or false, got %r" % (name, p["symmetric"]))
        return FormatSpec(name, int(name[3:]), "group", p["group_size"], p["symmetric"])

    def key(self, spec):
        if spec.name == "int8":
            return "int8-channel"
        return "%s-g%d-%s" % (spec.name, spec.group_size, "sym" if spec.symmetric else "asym")

    def keys(self):
        return ["int8-channel"] + [
            "int%d-g%d-%s" % (b, g, s) for b in (4, 3, 2) for g in INT_GROUP_SIZES for s in ("sym", "asym")
        ]

    def default_algorithm(self, name):
        return "rtn" if name == "int8" else "gptq"  # int8 per channel is near lossless already

    def map_char(self, spec):
        return str(spec.bits)

    def keys_help(self):
        return "int8-channel, int{4,3,2}-g{%s}-{sym,asym}" % ",".join(map(str, INT_GROUP_SIZES))

    def parse_key(self, key):
        if key == "int8-channel":
            return self.spec("int8", {})
        m = _KEY.match(key)
        if m is None:
            return None
        return self.spec("int" + m.group(1), {"group_size": int(m.group(2)), "symmetric": m.group(3) == "sym"})

    def nbytes(self, spec, rows, cols, symmetric_zeros):
        words_per_row = math.ceil(cols * spec.bits / 32)
        groups = 1 if spec.granularity == "channel" else cols // spec.group_size
        per = 4 * rows * words_per_row + 2 * rows * groups
        if not spec.symmetric or symmetric_zeros:
            per += 4 * math.ceil(rows * spec.bits / 32) * groups
        return per

    def fit(self, spec, xg, gs, name):
        from moequant.formats.core import absmax_checked, check_finite

        if not spec.symmetric:
            lo, hi = xg.amin(-1), xg.amax(-1)
            check_finite(lo + hi, xg, name)
            lo = lo.clamp(max=0.0)
            hi = hi.clamp(min=0.0)
            scale = int_scale((hi - lo) / float(2**spec.bits - 1), name)
            s = scale.to(torch.float32)
            qmin, qmax = -(2 ** (spec.bits - 1)), 2 ** (spec.bits - 1) - 1
            z = torch.clamp(qmin + torch.round(-lo / torch.where(s > 0, s, 1.0)), qmin, qmax)
            z = torch.where(s > 0, z, torch.zeros_like(z))
            return scale, z.to(torch.int8)
        return int_scale(absmax_checked(xg, name) / (2 ** (spec.bits - 1) - 0.5), name), None

    def encode(self, spec, x, s, z, gs):
        s = s.to(torch.float32)
        y = (x / torch.where(s != 0, s, torch.inf)).round_()  # s < 0: core.signed_scales
        if z is not None:
            y += z.to(torch.float32)
        return y.clamp_(-(2 ** (spec.bits - 1)), 2 ** (spec.bits - 1) - 1).to(torch.int8)

    def decode(self, spec, codes, s, z, gs):
        q = codes.to(torch.float32)
        if z is not None:
            q = q - z.to(torch.float32)
        return q * s.to(torch.float32)

    def ct_weight_args(self, spec):
        args = {"num_bits": spec.bits, "type": "int", "symmetric": spec.symmetric, "dynamic": False}
        if spec.granularity == "channel":
            args["strategy"] = "channel"
        else:
            args.update(strategy="group", group_size=spec.group_size)
        return args

    def pack_ct(self, q):
        from moequant.formats.packing import along_rows, pack_int32, unsigned

        out = {
            "weight_packed": pack_int32(unsigned(q.codes, q.spec.bits), q.spec.bits),
            "weight_scale": q.scales,
            "weight_shape": torch.tensor(q.shape, dtype=torch.int64),
        }
        if q.zeros is not None:
            out["weight_zero_point"] = along_rows(pack_int32, unsigned(q.zeros, q.spec.bits), q.spec.bits)
        return out

    def unpack_ct(self, tensors, spec):
        from moequant.formats.core import QuantizedTensor
        from moequant.formats.packing import signed, unpack_int32

        shape = tuple(int(v) for v in tensors["weight_shape"].tolist())
        codes = signed(unpack_int32(tensors["weight_packed"], spec.bits, shape[-1]), spec.bits)
        zeros = None
        if not spec.symmetric:
            zp = tensors["weight_zero_point"]
            zeros = signed(unpack_int32(zp.transpose(-2, -1), spec.bits, shape[-2]).transpose(-2, -1), spec.bits)
            zeros = zeros.contiguous()
        return QuantizedTensor(spec, shape, codes, tensors["weight_scale"], zeros)


def int_scale(s32: torch.Tensor, name) -> torch.Tensor:
    """float32 scales -> bf16 (one rounding); overflowing ranges are a user error."""
    if not bool(torch.isfinite(s32).all()):
        from moequant.formats.specs import _label

        raise UserError(
            "%s spans a range too wide for integer scales (max - min overflows float32); "
            "rescale the weight or keep it in bf16" % _label(name)
        )
    return s32.to(torch.bfloat16)


register(Integer())
