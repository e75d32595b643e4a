"""What every export layout shares: the `Layout` base class with the checks several layouts run, and the
names they agree on. One file per layout beside this one; moequant.layouts.registry lists them."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from moequant.errors import UserError
from moequant.formats import FormatSpec, QuantizedTensor
from moequant.targets import get_target

# Linear modules a serving engine fuses into one: they must share one scheme.
FUSED_SIBLINGS = (
    {"q_proj", "k_proj", "v_proj"},
    {"gate_proj", "up_proj"},
    {"w1", "w3"},
    {"q_a_proj", "kv_a_proj_with_mqa"},
)
NOT_LINEAR_ROLES = ("norm", "embedding")


def module_name(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def layer_of_experts(roles, name):
    r = roles.get(name)
    return r.layer if r is not None and r.role == "routed_expert" else None


def require_int_bits(spec: FormatSpec, layout: str, bits_ok) -> None:
    """Refuse a spec that is not an integer format of one of `bits_ok` bits (GPTQ and AWQ pack only those)."""
    if not spec.is_int or spec.bits not in bits_ok:
        raise UserError(
            "the %s layout holds %s integer formats, not %s"
            % (layout, "/".join("int%d" % b for b in bits_ok), spec.key)
        )


def fp16_scales(q: QuantizedTensor, layout: str) -> torch.Tensor:
    """GPTQ / AWQ store fp16 scales: convert, refusing any scale that fp16 cannot hold exactly."""
    s16 = q.scales.to(torch.float16)
    bad = s16.to(torch.float32) != q.scales.to(torch.float32)
    if bool(bad.any()):
        raise UserError(
            "the %s layout stores fp16 scales, and %d scales of this %s tensor (largest %.4g) are not "
            "exactly representable in fp16 (normal range 6.1e-05..65504); use compressed-tensors"
            % (layout, int(bad.sum()), q.spec.key, float(q.scales.float().abs().max()))
        )
    return s16.transpose(-2, -1).contiguous()


class Layout:
    """One export layout, registered by `name` (moequant.layouts.registry.register). `check()` refuses what the
    layout cannot hold, `pack()` gives the tensors of one weight, `quantization_config()` and `extra_files()`
    what the export writes beside them; the static methods answer the planner before any work."""

    name = ""
    recipe_name = ""  # what a recipe's export.format calls it, when not `name`
    symmetric_zeros = False  # stores zero points for symmetric formats too (the byte account counts them)
    routed_only = False  # quantizes routed experts only
    # how the output is stored: "safetensors" shards (written layer by layer as they are quantized, read back
    # by moequant's reader) or "gguf" (one file whose header lists every tensor first, run by llama.cpp)
    container = "safetensors"
    quant_methods: tuple[str, ...] = ()  # the quantization_config.quant_method values it reads back (none: GGUF)
    stored_transposed = False  # the stored codes are the transpose of the parameter they encode (gpt-oss)

    @staticmethod
    def read_encodings(qc: dict, stored: dict, where, read) -> dict:
        """{logical name: Encoding (moequant.layouts.reading)} of every weight a checkpoint written in this
        layout stores encoded, from its quantization_config and safetensors headers (`read`: a stored
        tensor, for the few facts only a tensor holds)."""
        raise NotImplementedError

    @staticmethod
    def unpack(enc, t: dict) -> QuantizedTensor:
        """The QuantizedTensor of `enc` from its stored tensors `t` ({role: tensor})."""
        raise NotImplementedError

    @staticmethod
    def refuses(spec) -> str | None:
        """What the layout holds, when it cannot hold `spec` (None: it can). What the serving target loads is
        the target's to say (moequant.targets)."""
        return None

    @staticmethod
    def plain_nbytes(role: str, shape, export, element_size: int = 2, name=None, config=None) -> int:
        """Bytes the layout writes a tensor in that it leaves unquantized (kept, or planned bf16), `export`
        being the recipe's export section: the plan's byte account asks this. Kept tensors are copied
        as they are stored: `element_size` bytes per element (DeepSeek-V3's F32 routers: 4). `name` and the
        model's `config`: for a layout that stores some tensors by name (GGUF's F32 convolution kernels)."""
        return math.prod(shape) * element_size

    @staticmethod
    def kept_reason(model_type: str | None, name: str) -> str | None:
        """Why the layout writes this non-expert tensor unquantized whatever the recipe says (None: it
        takes the planned format). The plan keeps such tensors and counts them as written."""
        return None

    @staticmethod
    def written_shapes(config: dict, name: str, shape) -> list[tuple[str, tuple]]:
        """(name written, shape) of each tensor the layout writes for this one in a quantized format, the
        last axis being the one the format's groups run along: the plan checks and counts each."""
        return [(name, tuple(shape))]

    @staticmethod
    def copied_tensors(names) -> list[tuple[str, str, str]]:
        """Tensors the layout writes beyond the checkpoint's `names`: (name written, its role, the tensor
        it copies). The plan counts them as kept tensors."""
        return []

    @staticmethod
    def added_tensors(adapter, config: dict) -> list[tuple[str, str, tuple, int]]:
        """Tensors the layout writes that no checkpoint tensor is the source of, made from the model's `config`
        (and its `adapter`, the caller's: layouts sit below arch/): (name written, its role, shape, bytes). The plan
        counts them as kept tensors."""
        return []

    @classmethod
    def refuses_model(cls, adapter) -> str | None:
        """Why the layout cannot write this architecture at all (None: it can)."""
        if adapter.fused_experts:
            return (
                f"the {cls.name} layout needs one tensor per expert on disk; {adapter.model_type} stores its "
                f"experts fused (use layout gpt-oss-mxfp4)"
            )
        return None

    def __init__(self, ckpt, adapter, items, roles, target, int8_activations):
        self.ckpt, self.adapter, self.items, self.roles = ckpt, adapter, items, roles
        self.target, self.int8_activations = get_target(target), int8_activations  # the target: moequant.targets
        self.carried: set[str] = set()  # source tensors written in their stored encoding

    def check(self) -> None:
        pass

    def carries(self, encoding) -> bool:
        """Whether a source tensor stored in `encoding` (moequant.io.dequant) can be written as it is."""
        return False

    def pack(self, name: str, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def quantization_config(self) -> dict:
        raise NotImplementedError

    def extra_files(self) -> dict:
        return {}

    # shared checks
    def _refuse_formats(self) -> None:
        for name, q in self.items.items():
            what = self.refuses(q.spec)
            if what:
                raise UserError(f"the {self.name} layout holds {what}; tensor {name} is planned as {q.spec.key}.")
            why = self.target.check(q.spec, routed=self.roles[name].role == "routed_expert")
            if why:
                raise UserError(f"target {self.target} cannot serve {q.spec.key}, the format of {name}: {why}.")

    def _serving_checks(self) -> None:
        """What the serving target asks of the routed experts and fused modules a plan gives formats to."""
        if self.target.granularity in ("layer", "model"):
            self._one_format_per_moe_layer()
        if self.target.fuses_projections:
            self._one_format_per_fused_group()
        if self.target.expert_format_map:
            self._one_format_per_expert()
        routed = {n: q.spec for n, q in self.items.items() if self.roles[n].role == "routed_expert"}
        why = self.target.check(routed_mix=routed)
        if why:
            raise UserError(why + ".")

    def _require_unfused(self) -> None:
        why = self.refuses_model(self.adapter)
        if why:
            raise UserError(why + ".")

    def _linear_modules_kept(self) -> list[str]:
        """2-D weights left in bf16 whose module is a Linear (not a norm or an embedding)."""
        out = []
        for name in self.ckpt.keys():
            if (
                name in self.items
                or name in self.carried
                or not name.endswith(".weight")
                or len(self.ckpt.shape(name)) != 2
            ):
                continue
            if self.roles[name].role in NOT_LINEAR_ROLES:
                continue
            out.append(module_name(name))
        return out

    def _routed_schemes(self) -> dict[int, set[str]]:
        """{MoE layer: the scheme keys of its routed experts' weights}, "bf16" for those left unquantized."""
        per_layer: dict[int, set] = defaultdict(set)
        for name in self.ckpt.keys():
            layer = layer_of_experts(self.roles, name)
            if layer is None or not name.endswith("weight"):
                continue
            q = self.items.get(name)
            per_layer[layer].add(self._scheme_key(q) if q is not None else "bf16")
        return per_layer

    def _one_format_per_moe_layer(self) -> None:
        for layer, keys in sorted(self._routed_schemes().items()):
            if len(keys) > 1:
                raise UserError(
                    f"target {self.target} needs one format for all routed experts of an MoE layer, but layer {layer} "
                    f"has {', '.join(sorted(keys))}; use target transformers for per-expert mixes."
                )

    def _one_format_per_fused_group(self) -> None:
        groups: dict[tuple, dict[str, str]] = defaultdict(dict)
        for name in self.ckpt.keys():
            if not name.endswith(".weight") or self.roles[name].role in NOT_LINEAR_ROLES:
                continue
            parent, _, leaf = module_name(name).rpartition(".")
            for i, siblings in enumerate(FUSED_SIBLINGS):
                if leaf in siblings:
                    q = self.items.get(name)
                    groups[(parent, i)][name] = self._scheme_key(q) if q is not None else "bf16"
        for (parent, _), members in groups.items():
            if len(set(members.values())) > 1:
                desc = ", ".join(f"{n.rsplit('.', 2)[-2]}={k}" for n, k in sorted(members.items()))
                raise UserError(
                    f"target {self.target} fuses the projections of {parent} into one module, so they need "
                    f"one format; the plan gives {desc}."
                )

    def _one_format_per_expert(self) -> None:
        """The target reads one format per expert (moequant's vLLM plugin groups a layer's experts by format):
        an expert's gate, up and down share one."""
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
                    f"target {self.target} serves each routed expert in one format (it stacks an expert's gate, "
                    f"up and down together); expert {expert} of layer {layer} has {desc}."
                )

    def _scheme_key(self, q) -> str:
        return q.spec.key
