"""The gptq layout: GPTQ v1 symmetric int4 / int8 (qweight, qzeros, scales fp16, g_idx), quantize_config.json and
per-module `dynamic` overrides, as vLLM and GPTQModel read it.

Packing (pack_gptq / unpack_gptq; integer bit streams as moequant.formats.packing describes them):
GPTQ v1: qweight = the same stream along the input axis, stored transposed [ceil(in*B/32), out];
qzeros [groups, ceil(out*B/32)] hold (zero - 1) (the v1 off-by-one that readers add back, so
unsigned zero points 1..2^B are storable and 0 is not; symmetric tensors store 2^(B-1) - 1,
which vLLM ignores); scales fp16 [groups, out];
g_idx int32 [in] (no activation reordering). version=2 (GPTQModel's gptq_v2) stores zero as is.

What it writes: GPTQ v1 symmetric int4 / int8 (qweight, qzeros, scales fp16, g_idx), quantize_config.json,
per-module `dynamic` overrides: "+:" for modules whose bits / group differ from the base,
"-:" for Linear modules kept in bf16.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict

import torch

from moequant import formats
from moequant.errors import UserError
from moequant.formats import FormatSpec, QuantizedTensor, get_format
from moequant.formats.packing import pack_int32, signed, unpack_int32, unsigned
from moequant.layouts.base import Layout, fp16_scales, module_name, require_int_bits
from moequant.layouts.reading import Encoding, dims, modules_with, need

# vLLM's names for those fused modules (GPTQ `dynamic` rules are matched against them)
_FUSED_NAMES = {
    ("k_proj", "q_proj", "v_proj"): "qkv_proj",
    ("gate_proj", "up_proj"): "gate_up_proj",
    ("kv_a_proj_with_mqa", "q_a_proj"): "fused_qkv_a_proj",
}


def _gptq_group(spec) -> int:
    return -1 if spec.granularity == "channel" else spec.group_size


def _group_size(spec: FormatSpec, cols: int) -> int:
    return cols if spec.granularity == "channel" else spec.group_size


def pack_gptq(q: QuantizedTensor, version: int = 1) -> dict:
    """GPTQ checkpoint tensors: qweight, qzeros, scales, g_idx (see the module docstring)."""
    spec = q.spec
    require_int_bits(spec, "GPTQ", (2, 3, 4, 8))
    bits, cols = spec.bits, q.shape[-1]
    u = unsigned(q.codes, bits)
    qweight = pack_int32(u, bits).transpose(-2, -1).contiguous()  # stream along the input axis
    if q.zeros is None:
        zeros = torch.full(q.scales.shape, 1 << (bits - 1), dtype=torch.int16, device=u.device)
    else:
        zeros = unsigned(q.zeros, bits).to(torch.int16)
    if version == 1:
        if bool((zeros == 0).any()):
            raise UserError(
                "GPTQ v1 cannot store a zero point of 0 (it writes zero - 1): %d groups of this "
                "asymmetric %s tensor have one; use gptq_v2, compressed-tensors or a symmetric format"
                % (int((zeros == 0).sum()), spec.key)
            )
        zeros = zeros - 1
    elif version != 2:
        raise ValueError("GPTQ version must be 1 or 2")
    qzeros = pack_int32(zeros.transpose(-2, -1).contiguous(), bits)  # [..., groups, words over out]
    g = _group_size(spec, cols)
    return {
        "qweight": qweight,
        "qzeros": qzeros,
        "scales": fp16_scales(q, "GPTQ"),
        "g_idx": torch.arange(cols, dtype=torch.int32, device=u.device) // g,
    }


def unpack_gptq(tensors: dict, spec, shape, version: int = 1) -> QuantizedTensor:
    """Inverse of pack_gptq for a weight of `shape` ([out, in] or [E, out, in])."""
    spec = get_format(spec)
    require_int_bits(spec, "GPTQ", (2, 3, 4, 8))
    bits, shape = spec.bits, tuple(shape)
    rows, cols = shape[-2:]
    codes = signed(unpack_int32(tensors["qweight"].transpose(-2, -1).contiguous(), bits, cols), bits)
    scales = tensors["scales"].transpose(-2, -1).contiguous()
    zeros = None
    if not spec.symmetric:
        z = unpack_int32(tensors["qzeros"], bits, rows).to(torch.int16)
        z = z + 1 if version == 1 else z  # v1 readers add 1 after unpacking: a stored 2^B - 1 means 2^B
        zeros = signed(z, bits).transpose(-2, -1).contiguous()
    return QuantizedTensor(spec, shape, codes, scales, zeros)


def read_gptq(qc, stored, where, read):
    if qc.get("checkpoint_format", "gptq") != "gptq" or qc.get("desc_act"):
        raise UserError(
            f"{where}: GPTQ checkpoints with act-order or checkpoint_format "
            f"{qc.get('checkpoint_format')!r} are not a source format moequant reads; accepted: GPTQ v1 "
            "without act-order."
        )
    symmetric = bool(qc.get("sym", True))
    out = {}
    for module in modules_with(stored, "qweight"):
        parts = {r: f"{module}.{r}" for r in ("qweight", "qzeros", "scales", "g_idx")}
        for r, dtypes in (
            ("qweight", ("I32",)),
            ("qzeros", ("I32",)),
            ("scales", ("F16", "BF16", "F32")),
            ("g_idx", ("I32", "I64")),
        ):
            need(stored, where, parts[r], dtypes)
        cols = math.prod(stored[parts["g_idx"]].shape)
        groups, rows = dims(stored, where, parts["scales"], 2)
        words = dims(stored, where, parts["qweight"], 2)[0]
        bits = words * 32 // cols if cols else 0
        try:
            spec = (
                formats.get_format("int8")
                if bits == 8 and groups == 1
                else formats.get_format(f"int{bits}", group_size=cols // groups, symmetric=symmetric)
            )
        except UserError:
            raise UserError(
                f"{where}: GPTQ module {module} ({words} x {rows} qweight words for {cols} inputs in "
                f"{groups} groups) is not a format moequant reads."
            ) from None
        need(stored, where, parts["qweight"], ("I32",), (math.ceil(cols * bits / 32), rows))
        out[f"{module}.weight"] = Encoding(f"{module}.weight", (rows, cols), spec, "gptq", parts)
    return out


def unpack_gptq_encoding(enc: Encoding, t: dict) -> QuantizedTensor:
    return unpack_gptq(t, enc.spec, enc.shape, version=1)


class Gptq(Layout):
    name = "gptq"
    quant_methods = ("gptq",)  # the quantization_config.quant_method values it reads back
    read_encodings = staticmethod(read_gptq)
    unpack = staticmethod(unpack_gptq_encoding)
    symmetric_zeros = True

    @staticmethod
    def refuses(spec):
        if not (spec.is_int and spec.symmetric and spec.bits in (4, 8)):
            return "symmetric int4 / int8 only (GPTQ v1 as vLLM and GPTQModel read it)"
        return None

    def check(self) -> None:
        self._require_unfused()
        self._refuse_formats()
        if not self.items:
            raise UserError("the gptq layout needs at least one quantized tensor.")
        self._serving_checks()
        counts = Counter((q.spec.bits, _gptq_group(q.spec)) for q in self.items.values())
        self.base_bits, self.base_group = counts.most_common(1)[0][0]

    def pack(self, name, q):
        module = module_name(name)
        return {f"{module}.{k}": v for k, v in pack_gptq(q, version=1).items()}

    def _dynamic(self) -> dict:
        dynamic = {}
        overrides: dict[tuple, list[str]] = defaultdict(list)
        for name, q in sorted(self.items.items()):
            key = (q.spec.bits, _gptq_group(q.spec))
            if key != (self.base_bits, self.base_group):
                overrides[key].append(module_name(name))
        for (bits, group), modules in sorted(overrides.items()):
            for pattern in _module_patterns(modules, self._all_modules()):
                dynamic["+:" + pattern] = {"bits": bits, "group_size": group}
        for pattern in _module_patterns(self._linear_modules_kept(), self._all_modules()):
            dynamic["-:" + pattern] = {}
        return dynamic

    def _all_modules(self) -> set[str]:
        return {module_name(n) for n in self.ckpt.keys() if n.endswith(".weight")}

    def _base(self) -> dict:
        # true_sequential False: down_proj's Hessian comes from the unquantized gate/up activations
        # (true-sequential within a layer was measured and dropped: benchmarks/RESULTS.md, bench_quality.py)
        return {
            "bits": self.base_bits,
            "group_size": self.base_group,
            "desc_act": False,
            "sym": True,
            "static_groups": False,
            "true_sequential": False,
            "damp_percent": 0.01,
            "checkpoint_format": "gptq",
            "quant_method": "gptq",
            "pack_dtype": "int32",
            "lm_head": False,
        }

    def quantization_config(self) -> dict:
        config = self._base()
        dynamic = self._dynamic()
        if dynamic:
            config["dynamic"] = dynamic
        return config

    def extra_files(self) -> dict:
        return {"quantize_config.json": self.quantization_config()}


def _module_patterns(modules: list[str], all_modules: set[str]) -> list[str]:
    """Anchored regexes (re.match, as vLLM and GPTQModel use) that select exactly `modules`.

    A whole MoE layer's experts collapse to one pattern for their prefix, because vLLM asks about
    the fused `...experts` module while GPTQModel asks about each `...experts.N.proj`; a part of
    a layer's experts (transformers target) is listed module by module.
    """
    patterns = []
    modules = list(modules)
    leaves: dict[str, set] = defaultdict(set)
    for m in modules:
        parent, _, leaf = m.rpartition(".")
        leaves[parent].add(leaf)
    for parent, present in leaves.items():
        for members, fused in _FUSED_NAMES.items():
            if set(members) <= present:
                modules.append(f"{parent}.{fused}")
    by_prefix: dict[str, list[str]] = defaultdict(list)
    for m in modules:
        head, sep, _ = m.partition(".experts.")
        by_prefix[head + ".experts" if sep else m].append(m)
    for prefix, members in sorted(by_prefix.items()):
        whole_layer = {m for m in all_modules if m.startswith(prefix + ".")} <= set(members)
        if prefix.endswith(".experts") and whole_layer:
            patterns.append(re.escape(prefix) + r"(\.|$)")
        else:
            patterns += [re.escape(m) + "$" for m in members]
    return patterns
