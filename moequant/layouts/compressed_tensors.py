"""The compressed-tensors layout (the default): one config group per scheme, every format moequant has, the per-expert map of target vllm-moequant and the guard that stops plain transformers on mixed experts."""

from __future__ import annotations

import json
from collections import defaultdict

import torch

from moequant import formats
from moequant.errors import UserError
from moequant.layouts.base import Layout, module_name

ENGINE_TARGETS = (
    "vllm",
    "sglang",
    "vllm-moequant",
    "vllm-cuda",
)  # load through an engine's own kernels: int formats of 4 or 8 bits
SGLANG_EXPERT_NAMES = {"gate_proj", "up_proj", "down_proj"}  # the names SGLang reads a layer's scheme from

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


class CompressedTensors(Layout):
    name = "compressed-tensors"

    def _scheme_key(self, q) -> str:
        return json.dumps(_ct_scheme(q.spec, self.int8_activations), sort_keys=True)

    @staticmethod
    def refuses(spec, target):
        if target in ENGINE_TARGETS and spec.is_int and spec.bits not in (4, 8):
            return f"only 4- and 8-bit integer formats for target {target} (its kernels)"
        return None

    def check(self) -> None:
        self._require_unfused()
        for name, q in self.items.items():
            if len(q.shape) != 2 or not name.endswith(".weight"):
                raise UserError(f"the compressed-tensors layout writes 2-D Linear weights; {name} is not one.")
        self._refuse_formats()
        if self.target in ("vllm", "vllm-cuda", "sglang"):
            self._one_format_per_moe_layer()
        if self.target in ENGINE_TARGETS:
            self._one_format_per_fused_group()
        if self.target == "vllm-moequant":
            self._one_format_per_expert()
        if self.target == "sglang":
            self._sglang_routed_rule()

    def pack(self, name, q):
        module = module_name(name)
        tensors = formats.pack_compressed_tensors(q)
        if _ct_scheme(q.spec, self.int8_activations)["format"] == "int-quantized":
            # W8A8 int-quantized stores the int8 codes unpacked, with an fp32 per-channel scale
            tensors = {"weight": q.codes.to(torch.int8), "weight_scale": q.scales.to(torch.float32)}
        return {f"{module}.{k}": v for k, v in tensors.items()}

    def _sglang_routed_rule(self) -> None:
        """Routed formats may differ per layer only as INT4 / INT8 weight-only groups of experts named
        gate/up/down_proj (see moequant.plan.policy's docstring for the SGLang code this comes from)."""
        routed = {n: q.spec for n, q in self.items.items() if self.roles[n].role == "routed_expert"}
        keys = {s.key for s in routed.values()}
        if len(keys) <= 1:
            return
        odd = sorted(s.key for s in routed.values() if not (s.is_int and s.symmetric and s.bits in (4, 8)))
        if odd:
            raise UserError(
                f"target sglang takes per-layer routed-expert formats only as INT4 / INT8 weight-only groups "
                f"(top-level format pack-quantized); the plan mixes {', '.join(sorted(keys))}, and {odd[0]} "
                f"would make the format mixed-precision, which SGLang's WNA16 MoE refuses."
            )
        why = sglang_per_layer_block(routed)
        if why:
            raise UserError(f"target sglang cannot load per-layer routed-expert formats here: {why}; use one format.")

    def groups(self) -> list[tuple[dict, list[str]]]:
        by_scheme: dict[str, list[str]] = defaultdict(list)
        for name, q in sorted(self.items.items()):
            by_scheme[self._scheme_key(q)].append(module_name(name))
        return [(json.loads(k), sorted(v)) for k, v in sorted(by_scheme.items())]

    def quantization_config(self) -> dict:
        config_groups = {}
        group_formats = set()
        groups = self.groups()
        routed = {module_name(n) for n, q in self.items.items() if self.roles[n].role == "routed_expert"}
        if self.target != "vllm-moequant" and sum(1 for _, targets in groups if routed.intersection(targets)) > 1:
            config_groups[TRANSFORMERS_GUARD] = transformers_guard_group()  # first: the group transformers takes
        for i, (scheme, targets) in enumerate(groups):
            config_groups[f"group_{i}"] = {"targets": targets, **scheme}
            group_formats.add(scheme["format"])
        if len(group_formats) == 1:
            global_format = group_formats.pop()
        else:
            global_format = "mixed-precision"
        if self.target == "sglang" and any(
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
        if self.target == "vllm-moequant":  # served by moequant's vLLM plugin (moequant.vllm_plugin)
            from moequant.vllm_plugin.names import EXPERT_FORMATS, QUANT_METHOD

            config.update({"quant_method": QUANT_METHOD, EXPERT_FORMATS: self._expert_formats()})
        return config

    def _one_format_per_expert(self) -> None:
        """The plugin groups a layer's experts by format: an expert's gate, up and down share one."""
        per_expert: dict[tuple, dict[str, str]] = defaultdict(dict)
        for name in self.ckpt.keys():
            role = self.roles[name]
            if role.role == "routed_expert" and role.expert is not None and name.endswith(".weight"):
                q = self.items.get(name)
                per_expert[(role.layer, role.expert)][role.proj] = q.spec.key if q is not None else "bf16"
        for (layer, expert), projs in sorted(per_expert.items()):
            if len(set(projs.values())) > 1:
                desc = ", ".join(f"{p}={k}" for p, k in sorted(projs.items()))
                raise UserError(
                    f"target vllm-moequant serves each routed expert in one format (vLLM stacks an "
                    f"expert's gate, up and down together); expert {expert} of layer {layer} has {desc}."
                )

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


def sglang_per_layer_block(names) -> str | None:
    """Why SGLang cannot resolve routed-expert schemes per layer for these on-disk expert tensor names."""
    leaves = {n.rsplit(".", 2)[-2] if n.endswith(".weight") else n.rsplit(".", 1)[-1] for n in names}
    if leaves <= SGLANG_EXPERT_NAMES:
        return None
    return (
        f"SGLang resolves a layer's scheme from its expert 0's gate_proj / up_proj / down_proj, and this "
        f"model's experts are {', '.join(sorted(leaves - SGLANG_EXPERT_NAMES))}"
    )
