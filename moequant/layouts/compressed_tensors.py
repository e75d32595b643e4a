"""The compressed-tensors layout (the default): one config group per scheme, every format moequant has, the
per-expert map of target vllm-moequant and the guard that stops plain transformers on mixed experts; its reader
reads compressed-tensors checkpoints of other tools too (llm-compressor, Kimi-K2-Thinking).

What it writes: one 2-D tensor set per module under the checkpoint's own names,
`quantization_config` with one config group per distinct scheme (targets disjoint: exact module names,
and one `re:` target per group for the MoE layers whose routed experts all share that group's scheme, see
`experts_target`), `ignore` for every Linear left in bf16, per-group `format`, global
`format` = the single group format or `mixed-precision` (SGLang: `pack-quantized` when any
group is integer), `quantization_status: compressed`. int8 is W8A16 `pack-quantized`, or W8A8
`int-quantized` with dynamic per-token int8 activations when int8_activations="dynamic".
What the serving target loads is the target's (moequant.targets): one format per MoE layer or per expert,
one per fused module group, the formats its kernels take. A target that reads a per-expert format map
(moequant's vLLM plugin) gets `quant_method: moequant` with `expert_formats` = {MoE layer module: [format key
per expert]}; moequant.load reads it as compressed-tensors.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict

import torch

from moequant import formats
from moequant.errors import UserError
from moequant.formats import QuantizedTensor
from moequant.layouts.base import Layout, module_name
from moequant.layouts.reading import FLOAT8, FLOATS, SAFETENSORS_DTYPE, Encoding, dims, need
from moequant.vllm_plugin.names import EXPERT_FORMATS, QUANT_METHOD

_CT_ACTIVATIONS = {
    "num_bits": 8,
    "symmetric": True,
    "dynamic": True,
    "block_structure": None,
    "actorder": None,
    "observer": None,
    "observer_kwargs": {},
}


def _ct_scheme(spec, int8_activations: str) -> dict:
    """compressed-tensors QuantizationScheme (without targets) for one format: the format's own
    weight args (moequant.formats), and the dynamic activations its kernels quantize inputs with."""
    weights = {
        "actorder": None,
        "block_structure": None,
        "group_size": None,
        "observer": "minmax",
        "observer_kwargs": {},
        **formats.compressed_tensors_weight_args(spec),
    }
    fmt = formats.compressed_tensors_format(spec)
    inputs = None
    if weights["type"] == "float" and spec.bits == 8:  # fp8 W8A8: per token, or per 128 inputs with blocks
        block = spec.granularity == "block"
        inputs = {
            **_CT_ACTIVATIONS,
            "type": "float",
            "strategy": "group" if block else "token",
            "group_size": spec.group_size if block else None,
        }
    elif weights["type"] == "int" and spec.bits == 8 and int8_activations == "dynamic":
        fmt = "int-quantized"  # W8A8 with dynamic per-token int8 activations
        inputs = {**_CT_ACTIVATIONS, "type": "int", "strategy": "token", "group_size": None}
    return {"weights": weights, "input_activations": inputs, "output_activations": None, "format": fmt}


CT_FORMATS = (
    "pack-quantized",
    "int-quantized",
    "naive-quantized",
    "float-quantized",
    "mxfp4-pack-quantized",
    "nvfp4-pack-quantized",
)


def _ct_formats() -> tuple[str, ...]:
    """The compressed-tensors formats moequant reads: those above and every registered format's own."""
    return tuple(dict.fromkeys(CT_FORMATS + tuple(f.ct_format for f in formats.REGISTRY.values() if f.quantized)))


def spec_from_ct_scheme(scheme: dict):
    """The moequant format of a compressed-tensors config group (UserError if it has none)."""
    w = scheme.get("weights") or {}
    kind, bits, strategy, group = w.get("type", "int"), w.get("num_bits"), w.get("strategy"), w.get("group_size")
    try:
        if kind == "int":
            if strategy == "channel" and bits == 8:
                return formats.get_format("int8")
            if strategy == "group":
                return formats.get_format(f"int{bits}", group_size=group, symmetric=bool(w.get("symmetric", True)))
        if kind == "float" and bits == 8 and strategy in ("channel", "tensor"):
            return formats.get_format("fp8", granularity=strategy)
        if kind == "float" and bits == 8 and strategy == "block" and list(w.get("block_structure") or []) == [128, 128]:
            return formats.get_format("fp8", granularity="block")
        if kind == "float" and bits == 4 and group == 32:
            return formats.get_format("mxfp4")
        if kind == "float" and bits == 4 and group == 16:
            return formats.get_format("nvfp4")
    except UserError:
        pass
    spec = _registered_ct_spec(w)
    if spec is not None:
        return spec
    raise UserError(
        f"compressed-tensors weights scheme {w} is not a format moequant reads (int2..int8 group, int8 "
        "channel, fp8 tensor / channel / 128x128 block, mxfp4, nvfp4)."
    )


def _registered_ct_spec(w: dict):
    """The registered format whose own compressed-tensors weight args the scheme has (None if none)."""
    given = {"symmetric": True, "dynamic": False, **w}
    for key in formats.all_keys():
        args = formats.compressed_tensors_weight_args(key) or {}
        if args and all(given.get(k) == v for k, v in args.items()):
            return formats.parse_key(key)
    return None


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern == module


def _ct_modules(targets, ignore, modules: list[str], where) -> list[str]:
    out = []
    for t in targets:
        if t.startswith("re:") or t in modules:
            out += [m for m in modules if _matches(t, m)]
        elif t[:1].isupper():  # a class name (Linear): what stores quantization parameters
            out += list(modules)
        else:
            raise UserError(
                f"compressed-tensors target {t!r} in {where}/config.json matches no module of the checkpoint."
            )
    return [m for m in dict.fromkeys(out) if not any(_matches(p, m) for p in ignore)]


def read_compressed_tensors(qc, stored, where, read):
    quantized_modules = sorted({n.rsplit(".", 1)[0] for n in stored if n.endswith((".weight_packed", ".weight_scale"))})
    groups, ignore, top = qc.get("config_groups") or {}, qc.get("ignore") or [], qc.get("format")
    if not (
        isinstance(groups, dict)
        and all(
            isinstance(g, dict)
            and isinstance(g.get("targets", []), list)
            and all(isinstance(t, str) for t in g.get("targets", []))
            and isinstance(g.get("weights") or {}, dict)
            for g in groups.values()
        )
        and isinstance(ignore, list)
        and all(isinstance(i, str) for i in ignore)
    ):
        raise UserError(
            f"{where}/config.json: the compressed-tensors quantization_config is malformed; it needs "
            "config_groups {name: {targets: [names], weights: {...}}} and ignore [names]."
        )
    out = {}
    for group, scheme in groups.items():
        if not scheme.get("weights"):
            continue  # activations only: the weights stay as they are
        spec = spec_from_ct_scheme(scheme)
        fmt = scheme.get("format") or top
        if fmt in (None, "mixed-precision"):  # unsaid: the format compressed-tensors infers for the scheme
            fmt = formats.compressed_tensors_format(spec)
        if fmt not in _ct_formats():
            raise UserError(
                f"{where}/config.json: compressed-tensors format {fmt!r} (config group {group}) is not one "
                f"moequant reads; accepted: {', '.join(_ct_formats())}."
            )
        if spec.is_int and fmt in ("int-quantized", "naive-quantized") and (not spec.symmetric or spec.bits != 8):
            raise UserError(
                f"{where}/config.json: {fmt} {spec.key} (config group {group}) is not one moequant reads; "
                "accepted there: symmetric int8."
            )
        for module in _ct_modules(scheme.get("targets", []), ignore, quantized_modules, where):
            name = f"{module}.weight"
            if name in out:
                raise UserError(f"module {module} is targeted by two config groups in {where}/config.json.")
            if f"{module}.weight_g_idx" in stored:
                raise UserError(
                    f"{where}: {module}.weight_g_idx (activation reordering) is not supported; accepted: "
                    "compressed-tensors weights without act-order."
                )
            out[name] = _ct_encoding(stored, where, module, spec, fmt, read)
    return out


def _ct_encoding(stored, where, module: str, spec, fmt: str, read) -> Encoding:
    p = lambda role: f"{module}.{role}"  # noqa: E731
    name = p("weight")
    if spec.family.ct_format == fmt and fmt not in CT_FORMATS:  # a registered format with no rules below
        return _registered_ct_encoding(stored, where, module, spec, fmt)
    if spec.name == "fp8":
        need(stored, where, name, FLOAT8[:1])
        rows, cols = dims(stored, where, name, 2)
        scale = {"channel": (rows, 1), "block": (math.ceil(rows / 128), math.ceil(cols / 128))}.get(spec.granularity)
        s = need(stored, where, p("weight_scale"), FLOATS, scale)
        if spec.granularity == "tensor" and math.prod(s.shape) != 1:
            raise UserError(
                f"{where}: tensor {p('weight_scale')!r} has shape {list(s.shape)}; a per-tensor scale holds one value."
            )
        return Encoding(name, (rows, cols), spec, fmt, {"weight": name, "weight_scale": p("weight_scale")})
    if spec.is_fp4:
        packed = p("weight_packed")
        need(stored, where, packed, ("U8",))
        rows, half = dims(stored, where, packed, 2)
        cols = 2 * half
        group = 32 if spec.name == "mxfp4" else 16
        if cols % group:
            raise UserError(
                f"{where}: tensor {packed!r} holds {cols} columns, not a multiple of {spec.key}'s group of {group}."
            )
        parts = {"weight_packed": packed, "weight_scale": p("weight_scale")}
        need(
            stored, where, parts["weight_scale"], ("U8",) if spec.name == "mxfp4" else FLOAT8[:1], (rows, cols // group)
        )
        if spec.name == "nvfp4":
            parts["weight_global_scale"] = p("weight_global_scale")
            g = need(stored, where, parts["weight_global_scale"], FLOATS)
            if math.prod(g.shape) != 1:
                raise UserError(
                    f"{where}: tensor {parts['weight_global_scale']!r} has shape {list(g.shape)}; it holds one value."
                )
        return Encoding(name, (rows, cols), spec, fmt, parts)
    if fmt in ("int-quantized", "naive-quantized"):
        need(stored, where, name, ("I8",))
        rows, cols = dims(stored, where, name, 2)
        need(stored, where, p("weight_scale"), FLOATS, (rows, 1))
        return Encoding(name, (rows, cols), spec, fmt, {"weight": name, "weight_scale": p("weight_scale")})
    packed = p("weight_packed")
    need(stored, where, packed, ("I32",))
    rows, words = dims(stored, where, packed, 2)
    scale = need(stored, where, p("weight_scale"), FLOATS)
    if spec.granularity == "group":
        cols = tuple(scale.shape)[-1] * spec.group_size if len(scale.shape) == 2 else -1
        groups = cols // spec.group_size
    else:  # per channel: the column count is only in weight_shape (int8: up to 3 unused codes per row)
        if p("weight_shape") not in stored:
            raise UserError(
                f"{where} lacks tensor {p('weight_shape')!r}, which a per-channel pack-quantized weight needs."
            )
        need(stored, where, p("weight_shape"), ("I64", "I32"), (2,))
        cols = int(read(p("weight_shape"))[1])
        groups = 1
    if cols <= 0 or tuple(scale.shape) != (rows, groups) or math.ceil(cols * spec.bits / 32) != words:
        raise UserError(
            f"{where}: tensor {p('weight_scale')!r} has shape {list(scale.shape)}, which does not fit "
            f"{packed!r} {[rows, words]} as {spec.key}."
        )
    parts = {"weight_packed": packed, "weight_scale": p("weight_scale")}
    if p("weight_shape") in stored:
        need(stored, where, p("weight_shape"), ("I64", "I32"), (2,))
        parts["weight_shape"] = p("weight_shape")
    if not spec.symmetric:
        parts["weight_zero_point"] = p("weight_zero_point")
        need(stored, where, parts["weight_zero_point"], ("I32",), (math.ceil(rows * spec.bits / 32), groups))
    return Encoding(name, (rows, cols), spec, fmt, parts)


def _registered_ct_encoding(stored, where, module: str, spec, fmt: str) -> Encoding:
    """A registered format's compressed-tensors tensors, checked against what its own packer writes for
    one group (names, dtypes; how many logical columns one stored column of the codes holds)."""
    probe_cols = spec.group_size or 1
    probe = formats.pack_compressed_tensors(formats.quantize(torch.zeros(1, probe_cols), spec))
    codes_role = next(iter(probe))
    parts = {role: f"{module}.{role}" for role in probe}
    for role, t in probe.items():
        need(stored, where, parts[role], (SAFETENSORS_DTYPE[t.dtype],))
    rows, stored_cols = dims(stored, where, parts[codes_role], 2)
    cols = stored_cols * probe_cols // probe[codes_role].shape[-1]
    formats.check_shape(spec, (rows, cols), parts[codes_role])
    one_row = formats.pack_compressed_tensors(formats.quantize(torch.zeros(1, cols), spec))  # per row: shapes [1, ...]
    for role, t in one_row.items():
        need(stored, where, parts[role], (SAFETENSORS_DTYPE[t.dtype],), (rows,) + tuple(t.shape[1:]))
    return Encoding(f"{module}.weight", (rows, cols), spec, fmt, parts)


def unpack_compressed_tensors_encoding(enc: Encoding, t: dict) -> QuantizedTensor:
    spec, layout, shape = enc.spec, enc.layout, enc.shape
    if layout in ("int-quantized", "naive-quantized"):
        return QuantizedTensor(spec, shape, t["weight"], t["weight_scale"])
    if layout == "pack-quantized":
        if "weight_shape" in t and tuple(int(v) for v in t["weight_shape"].tolist()) != tuple(shape):
            raise UserError(
                f"tensor {enc.parts['weight_shape']!r} says {t['weight_shape'].tolist()}, but "
                f"{enc.parts['weight_packed']!r} and its scales hold a weight of shape {list(shape)}."
            )
        t = {**t, "weight_shape": torch.tensor(shape, dtype=torch.int64)}
    return formats.unpack_compressed_tensors(t, spec)


class CompressedTensors(Layout):
    name = "compressed-tensors"
    quant_methods = ("compressed-tensors", QUANT_METHOD)  # the quantization_config.quant_method values it reads back
    read_encodings = staticmethod(read_compressed_tensors)
    unpack = staticmethod(unpack_compressed_tensors_encoding)

    def _scheme_key(self, q) -> str:
        return json.dumps(_ct_scheme(q.spec, self.int8_activations), sort_keys=True)

    def check(self) -> None:
        self._require_unfused()
        for name, q in self.items.items():
            if len(q.shape) != 2 or not name.endswith(".weight"):
                raise UserError(f"the compressed-tensors layout writes 2-D Linear weights; {name} is not one.")
        self._refuse_formats()
        self._serving_checks()

    def pack(self, name, q):
        module = module_name(name)
        tensors = formats.pack_compressed_tensors(q)
        if _ct_scheme(q.spec, self.int8_activations)["format"] == "int-quantized":
            # W8A8 int-quantized stores the int8 codes unpacked, with an fp32 per-channel scale
            tensors = {"weight": q.codes.to(torch.int8), "weight_scale": q.scales.to(torch.float32)}
        return {f"{module}.{k}": v for k, v in tensors.items()}

    def groups(self) -> list[tuple[dict, list[str]]]:
        by_scheme: dict[str, list[str]] = defaultdict(list)
        for name, q in sorted(self.items.items()):
            by_scheme[self._scheme_key(q)].append(module_name(name))
        return [(json.loads(k), sorted(v)) for k, v in sorted(by_scheme.items())]

    def quantization_config(self) -> dict:
        config_groups = {}
        group_formats = set()
        groups = self.groups()
        routed = set().union(*self._routed_schemes().values())  # "bf16" among them for experts left unquantized
        if not self.target.expert_format_map and len(routed) > 1:
            config_groups[TRANSFORMERS_GUARD] = transformers_guard_group()  # first: the group transformers takes
        elif routed and groups and not any(self.roles[n].role == "routed_expert" for n in self.items):
            config_groups[UNQUANTIZED_EXPERTS] = unquantized_experts_group()
        renamed = self.adapter.transformers_module_names()
        for i, (scheme, targets) in enumerate(groups):
            aliases = sorted(renamed[m] for m in targets if m in renamed)
            if not self.target.expert_format_map:  # the plugin's per-expert map names every expert itself
                targets = self._whole_layers_as_regex(targets)
            if aliases:
                targets = [*targets, transformers_alias_target(aliases)]
            config_groups[f"group_{i}"] = {"targets": targets, **scheme}
            group_formats.add(scheme["format"])
        if len(group_formats) == 1:
            global_format = group_formats.pop()
        else:
            global_format = "mixed-precision"
        if self.target.pack_quantized_top_level and any(
            f in ("pack-quantized", "int-quantized") for f in group_formats | {global_format}
        ):
            global_format = "pack-quantized"
        config = {
            "quant_method": "compressed-tensors",
            "format": global_format,
            "quantization_status": "compressed",
            "config_groups": config_groups,
            "ignore": sorted(self._linear_modules_kept()),
            "kv_cache_scheme": None,
            "global_compression_ratio": None,
        }
        if self.target.expert_format_map:  # served by moequant's vLLM plugin (moequant.vllm_plugin)
            config.update({"quant_method": QUANT_METHOD, EXPERT_FORMATS: self._expert_formats()})
        return config

    def _whole_layers_as_regex(self, targets: list[str]) -> list[str]:
        """A group's targets with the routed experts of every MoE layer that lies wholly in the group replaced by
        one `experts_target` (the group's other modules keep their names)."""
        chosen = set(targets)
        whole: dict[tuple[str, tuple[str, ...]], list[int]] = defaultdict(list)
        taken: set[str] = set()
        for layer in self.adapter.moe_layers:
            modules = {
                module_name(self.adapter.expert_tensor_name(layer, e, p))
                for e in range(self.adapter.num_experts)
                for p in self.adapter.projections
            }
            experts = {m.rsplit(".", 2)[0] for m in modules}  # model.layers.L.mlp.experts
            marker = f".{layer}."
            if not modules <= chosen or len(experts) != 1 or marker not in next(iter(experts)):
                continue
            (prefix,) = experts
            head, tail = prefix.split(marker, 1)
            if tail.rsplit(".", 1)[-1] != "experts":
                continue
            whole[(head + ".", tuple(sorted({m.rsplit(".", 1)[1] for m in modules})))].append(layer)
            taken |= modules
        regexes = [experts_target(head, layers, leaves) for (head, leaves), layers in whole.items()]
        return regexes + [t for t in targets if t not in taken]

    def _expert_formats(self) -> dict[str, list[str]]:
        """{MoE layer module (vLLM's fused experts module): [format key of each expert]}."""
        out = {}
        for layer in self.adapter.moe_layers:
            keys = []
            for expert in range(self.adapter.num_experts):
                name = self.adapter.expert_tensor_name(layer, expert, "gate")
                q = self.items.get(name)
                keys.append(q.spec.key if q is not None else "bf16")
            module = self.adapter.expert_tensor_name(layer, 0, "gate").rsplit(".", 3)[0]  # ....experts
            out[module] = keys
        return out


def experts_target(head: str, layers: list[int], leaves) -> str:
    """One compressed-tensors target for the routed experts of `layers` (module names `{head}{L}.….experts.{E}.{leaf}`):
    it matches each expert's projections as vLLM, SGLang, compressed-tensors and moequant name them, and the fused
    `….experts` module of those layers in a transformers 5 model, whose experts are one module, not one Linear
    per expert. A list of every expert's name matched nothing there, and compressed-tensors' loader warned
    "Could not match" once per expert projection (192 lines for tiny-qwen2moe); transformers picks its experts'
    scheme from the first group whose `re:` targets name `experts` (integrations/compressed_tensors.py,
    get_experts_scheme), which this target is. vLLM names an image-text model's text layers
    `language_model.model.…` where its checkpoints say `model.language_model.…` (its models' hf_to_vllm_mapper
    renames module paths but leaves `re:` targets as written), so such a head matches under both names."""
    alternatives = "|".join(str(layer) for layer in layers)
    names = "|".join(re.escape(leaf) for leaf in leaves)
    heads = re.escape(head)
    for ours, theirs in (MULTIMODAL_TEXT, MULTIMODAL_TEXT[::-1]):  # (MiniMax-M3-VL's checkpoints say vLLM's)
        if head.startswith(ours):
            heads = f"(?:{heads}|{re.escape(theirs + head[len(ours) :])})"
    return f"re:^{heads}(?:{alternatives})\\.(?:[^.]+\\.)*experts(?:\\.\\d+\\.(?:{names}))?$"


def transformers_alias_target(modules: list[str]) -> str:
    """One `re:` target naming `modules` as transformers' model holds them, where its weight conversion renames a
    family's on-disk names on load (DeepSeek-V4's `layers.0.attn.wo_b` is its `model.layers.0.self_attn.o_b_proj`,
    Nemotron-H's `backbone.` is `model.`, A.X-K2's `q_b_proj` is `q_gate_proj` ...). compressed-tensors matches
    targets against the model's module names, so under the on-disk names alone transformers left those modules
    plain and initialised them at random (only its MISSING / UNEXPECTED report said so). vLLM, SGLang and moequant
    match on-disk names, which the group's plain targets still give; this target matches none of theirs
    (moequant's reader checks: a module targeted twice is refused). It never spells "experts" (a shared expert's
    name has it: `expert[s]`), since transformers takes the routed experts' scheme from the first group whose
    `re:` targets contain that word (get_experts_scheme). A module of every layer is one alternative with its layer
    numbers as an alternation, so a 61-layer model's target stays a few kilobytes."""
    layers: dict[tuple[str, str], list[str]] = defaultdict(list)  # (before, after the layer number): layers
    for m in modules:
        numbered = re.fullmatch(r"(.*?\.layers\.)(\d+)(\..*)", m)
        if numbered:
            layers[(numbered[1], numbered[3])].append(numbered[2])
        else:
            layers[(m, "")] = []
    names = []
    for (head, tail), found in sorted(layers.items()):
        at = f"(?:{'|'.join(sorted(found, key=int))})" if found else ""
        names.append(
            re.escape(head).replace("experts", "expert[s]") + at + re.escape(tail).replace("experts", "expert[s]")
        )
    return f"re:^(?:{'|'.join(names)})$"


# an image-text model's text layers: as transformers and the checkpoints name them, as vLLM does
MULTIMODAL_TEXT = ("model.language_model.", "language_model.model.")


TRANSFORMERS_GUARD = "moequant_transformers_guard"
TRANSFORMERS_REFUSAL = (
    "moequant: transformers' from_pretrained decodes every routed expert of a checkpoint with "
    "one format, and this one has several, so load it with moequant.load or serve it with vLLM "
    "or SGLang"
)


def transformers_guard_group() -> dict:
    """A config group that matches no module and makes plain transformers refuse a checkpoint whose routed
    experts have more than one format. transformers 5.x decodes every routed expert with one scheme: the
    first group whose `re:` targets name `experts` (integrations/compressed_tensors.get_experts_scheme), so a
    per-layer mix would load silently wrong. This group comes first and says FP8 per channel: transformers
    then takes the packed codes as FP8 weights and stops at the first expert, and its warning for the target
    no module matches prints TRANSFORMERS_REFUSAL. vLLM, SGLang and moequant resolve each
    layer by its own name, so an unmatched target changes nothing there (the scheme is the one moequant
    writes for fp8-channel experts); the top-level format ignores this group."""
    target = f"re:^{TRANSFORMERS_REFUSAL} - experts$"  # a valid regex as it reads: '.' matches itself too
    return {"targets": [target], **_ct_scheme(formats.parse_key("fp8-channel"), "none")}


UNQUANTIZED_EXPERTS = "moequant_unquantized_experts"


def unquantized_experts_group() -> dict:
    """A config group that matches no module and lets plain transformers load bf16 routed experts beside quantized
    modules (e.g. recipes/non-experts-only.yaml). transformers 5.x runs every checkpoint's routed experts through
    the scheme of the first group whose `re:` targets name `experts` (get_experts_scheme); under an integer scheme it
    keeps only packed codes, so bf16 experts arrived as nothing ("Concatenate ... Ckpt contains: 0"). Under an FP8
    scheme a weight without a scale passes through as it is (integrations/compressed_tensors.py, checked in 5.17 and
    5.25), so this group says FP8. Its target names no module, so vLLM, SGLang and moequant, which match each layer by
    name and find the experts in `ignore`, read the export as before; compressed-tensors' loader warns once that the
    target, a sentence saying why, matched nothing."""
    target = "re:^moequant: the routed experts are stored unquantized, this group matches no module - experts$"
    return {"targets": [target], **_ct_scheme(formats.parse_key("fp8-channel"), "none")}


# config.json's key that makes plain transformers refuse a per-layer mix up front (transformers_stop)
TRANSFORMERS_STOP_KEY = "attn_implementation"
# and its sentence for a quantized module transformers splits into several on load (LaRA-mini's linear_attn.in_proj)
SPLIT_REFUSAL = (
    "moequant: transformers splits some of this model's quantized modules into several on load and cannot split "
    "their packed weights, so load it with moequant.load or serve it with vLLM or SGLang"
)
# and the one that makes it refuse, until moequant.register_for_transformers ran, the per-expert tensors of a family
# whose own checkpoints keep a layer's experts in one tensor (transformers has no per-expert mapping for it)
FUSED_STOP_KEY = "experts_implementation"
FUSED_REFUSAL = (
    "moequant: this export stores one tensor per routed expert and transformers reads this family's experts "
    "fused, so call moequant.register_for_transformers(path) once before from_pretrained, or load it with "
    "moequant.load"
)


def accept_fused_stop() -> None:
    """Make transformers in this process take FUSED_REFUSAL as an experts implementation: its default one
    (grouped_mm), registered under that name through its public ExpertsInterface. moequant.register_for_transformers
    calls it beside the per-expert mapping; the vLLM plugin calls it so that vLLM's Transformers modeling backend,
    which builds transformers' model from config.json for a family without a vLLM class of its own (and replaces
    the experts with its own), is not stopped."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:  # a transformers without the experts interface validates no experts_implementation either
        return
    ALL_EXPERTS_FUNCTIONS.register(FUSED_REFUSAL, ALL_EXPERTS_FUNCTIONS["grouped_mm"])


def transformers_stop(config: dict, experts_fused_on_disk: bool = False, split_quantized: bool = False) -> dict:
    """`config` (a checkpoint's config.json) with the stops for plain transformers added.

    Where its quantization_config has the guard group (routed experts in several formats): no targets make
    transformers 5 read such a mix (it takes one experts scheme per model, get_experts_scheme), and the guard alone
    lets it warn once, then fail mid-load with an AttributeError of its own. transformers validates
    `attn_implementation` before it builds the model and raises one ValueError quoting an unknown value:
    TRANSFORMERS_REFUSAL. A caller passing attn_implementation overrides it and meets the guard.

    Where the family's own checkpoints keep experts fused (`experts_fused_on_disk`): transformers would load the
    export's per-expert tensors as unexpected keys and the experts at random, with warnings only. It validates
    `experts_implementation` the same way and raises quoting FUSED_REFUSAL; moequant.register_for_transformers adds
    the per-expert mapping and accepts that sentence (accept_fused_stop), so the same from_pretrained then loads the
    export. A caller passing experts_implementation overrides it.

    Where a quantized module is one transformers' weight conversion splits into several on load
    (`split_quantized`): it splits the stored weight, not a packed one with its scales, and those modules loaded at
    random. The same key as the mix's stop, saying SPLIT_REFUSAL (a mix's sentence first where both hold).

    vLLM's own model classes read neither key (tests/test_vllm.py, tests/test_vllm_families.py; SGLang's are not
    run here); `{"": ...}` sets them on the top-level config only, not on sub-configs (a vision tower an engine
    builds from transformers' classes). vLLM's Transformers modeling backend builds transformers' model from the
    config: it sets the text config's attn_implementation itself, and moequant's vLLM plugin, where installed,
    accepts the experts stop. moequant drops both on reading (without_transformers_stop)."""
    groups = (config.get("quantization_config") or {}).get("config_groups") or {}
    if TRANSFORMERS_GUARD in groups:
        config = {**config, TRANSFORMERS_STOP_KEY: {"": TRANSFORMERS_REFUSAL}}
    elif split_quantized:
        config = {**config, TRANSFORMERS_STOP_KEY: {"": SPLIT_REFUSAL}}
    if experts_fused_on_disk:
        config = {**config, FUSED_STOP_KEY: {"": FUSED_REFUSAL}}
    return config


# (config.json key, a sentence transformers_stop writes there)
STOPS = (
    (TRANSFORMERS_STOP_KEY, TRANSFORMERS_REFUSAL),
    (TRANSFORMERS_STOP_KEY, SPLIT_REFUSAL),
    (FUSED_STOP_KEY, FUSED_REFUSAL),
)


def without_transformers_stop(config: dict) -> dict:
    """config.json as moequant reads it: transformers_stop's keys removed (moequant builds the model from it)."""
    ours = [(key, {"": sentence}) for key, sentence in STOPS]
    if not any(config.get(k) == v for k, v in ours):
        return config
    return {k: v for k, v in config.items() if (k, v) not in ours}


def has_fused_stop(config: dict) -> bool:
    """Whether config.json is our export of a family transformers reads fused (it needs register_for_transformers)."""
    return config.get(FUSED_STOP_KEY) == {"": FUSED_REFUSAL}


def clear_stops(config) -> None:
    """A transformers config read from our export's config.json, its stops for plain transformers cleared (they
    resolve, on the config object, to `_attn_implementation` / `_experts_implementation` holding the sentence)."""
    for key, sentence in STOPS:
        if getattr(config, f"_{key}", None) == sentence:
            setattr(config, f"_{key}", None)
