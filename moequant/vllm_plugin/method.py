"""The moequant quantization method inside vLLM (imported by moequant.vllm_plugin.register only).

`MoequantConfig` is vLLM's compressed-tensors config plus the per-expert format map; its
routed experts get `MixedExpertsMoEMethod`, everything else vLLM's own compressed-tensors methods.

How one MoE layer is served (written against vLLM 0.32's fused-MoE interfaces):

* one `ExpertGroup` module per format, a child of vLLM's `RoutedExperts` layer: it looks to vLLM's
  own method for that scheme like a whole layer of `len(experts)` experts, so that method
  allocates, loads, repacks and runs its weights as it would for a one-format layer;
* checkpoint tensors reach the right group through `_GroupLoader` objects that stand, on the
  `RoutedExperts` layer, under the parameter names vLLM's expert mapping looks up
  (`w13_weight_packed`, `w2_weight_scale`, ...): each maps the global expert id to its group
  and the group-local id and hands the tensor to vLLM's own `RoutedExperts.weight_loader`;
* `apply` receives vLLM's routing (top-k weights and global ids, computed once by the layer's
  router) and runs the fused MoE of every group that has routed slots, with the ids mapped to
  group-local ones; a slot routed to another group gets weight 0 (vLLM's CPU kernels take no
  expert map, and an id of -1 would index out of their per-expert counts, so the slot points at
  the group's expert 0 and adds nothing). The groups' outputs are summed.

Why every group sees all slots rather than only its own (numbers: benchmarks/bench_vllm_plugin.py):
on vLLM's CPU kernels, handing each group only its slots (sorted by group, token rows gathered,
scatter-added back) was slower at 1 to 256 tokens, since the zero-weight slots all land on one
expert and the sort, gather and scatter cost more than the rows they save. What did cost was
Python: vLLM's modular-kernel wrapper takes ~40 us a call, so where it would only pass the tensors
through (`_direct_experts`), the group's vLLM experts object is called directly.
"""

from __future__ import annotations

import dataclasses

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, RoutedExperts
from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import MoEPrepareAndFinalizeNoDPEPModular
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
    CompressedTensorsMoEMethod,
)

from moequant.vllm_plugin.names import EXPERT_FORMATS, QUANT_METHOD

# RoutedExperts attributes that vLLM's per-scheme methods read from "their" layer
_LAYER_ATTRS = (
    "activation",
    "top_k",
    "renormalize",
    "use_grouped_topk",
    "num_expert_group",
    "topk_group",
    "custom_routing_function",
    "scoring_func",
    "routed_scaling_factor",
    "swiglu_limit",
    "swiglu_alpha",
    "swiglu_beta",
    "e_score_correction_bias",
    "apply_router_weight_on_input",
    "params_dtype",
    "ckpt_gate_proj_name",
    "ckpt_up_proj_name",
    "ckpt_down_proj_name",
    "layer_name",
    "routing_sink",
    "hidden_size",
    "intermediate_size_per_partition",
)


class MoequantConfig(CompressedTensorsConfig):
    """compressed-tensors, with `expert_formats` saying which format each routed expert is in."""

    expert_formats: dict[str, list[str]]

    def get_name(self):
        return QUANT_METHOD

    @classmethod
    def from_config(cls, config: dict) -> MoequantConfig:
        formats = config.get(EXPERT_FORMATS)
        if not isinstance(formats, dict) or not all(isinstance(v, list) for v in formats.values()):
            raise ValueError(
                f"moequant: quantization_config.{EXPERT_FORMATS} must map each MoE layer module to the "
                "list of its experts' format keys; re-export the checkpoint with target vllm-moequant."
            )
        out = super().from_config(dict(config))
        out.expert_formats = {str(k): [str(f) for f in v] for k, v in formats.items()}
        return out

    def apply_vllm_mapper(self, hf_to_vllm_mapper):
        super().apply_vllm_mapper(hf_to_vllm_mapper)
        self.expert_formats = {(hf_to_vllm_mapper._map_name(k) or k): v for k, v in self.expert_formats.items()}

    def get_quant_method(self, layer, prefix):
        if isinstance(layer, RoutedExperts):
            formats = self.expert_formats.get(prefix)
            if formats is None:
                raise ValueError(
                    f"moequant: quantization_config.{EXPERT_FORMATS} has no entry for the MoE layer "
                    f"{prefix}; re-export the checkpoint with target vllm-moequant."
                )
            return MixedExpertsMoEMethod(self, layer, prefix, formats)
        return super().get_quant_method(layer, prefix)


def _refusal(prefix: str, fmt: str, reason: BaseException | str) -> ValueError:
    why = str(reason).strip().splitlines()[0].rstrip(".") if str(reason).strip() else type(reason).__name__
    return ValueError(
        f"moequant: MoE layer {prefix} has experts in {fmt}, a format vLLM has no fused-MoE kernel for "
        f"on this backend ({why})."
    )


class ExpertGroup(torch.nn.Module):
    """The experts of one format of one MoE layer, shaped as vLLM's method for the scheme expects a layer."""

    def __init__(self, layer: RoutedExperts, fmt: str, experts: list[int]):
        super().__init__()
        self.format, self.experts = fmt, experts
        n = len(experts)
        self.moe_config = dataclasses.replace(
            layer.moe_config, num_experts=n, num_local_experts=n, num_logical_experts=n
        )
        for attr in _LAYER_ATTRS:  # plain attributes: a tensor among them stays the layer's, not a group parameter
            object.__setattr__(self, attr, getattr(layer, attr, None))
        self.global_num_experts = self.local_num_experts = n
        self.expert_map = None  # every expert of the group is local (expert parallelism is refused)

    def _expert_routing_tables(self):
        return None


class _GroupLoader:
    """Stands under one parameter name on the RoutedExperts layer while the checkpoint loads: sends
    each expert's tensor to that parameter of the expert's group, at its group-local index."""

    def __init__(self, layer: RoutedExperts, method: MixedExpertsMoEMethod, name: str):
        self.layer, self.method, self.name = layer, method, name

    def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        group, local = self.method.owner[expert_id]
        target = group._parameters.get(self.name)
        if target is None:
            raise ValueError(
                f"moequant: checkpoint tensor {weight_name} of expert {expert_id} does not belong to the "
                f"{group.format} experts of {self.method.prefix}; the checkpoint contradicts its "
                f"{EXPERT_FORMATS}."
            )
        return self.layer.weight_loader(target, loaded_weight, weight_name, shard_id, local, return_success)


class MixedExpertsMoEMethod(FusedMoEMethodBase):
    """Routed experts of one layer in several formats: one vLLM fused-MoE method per format group."""

    def __init__(self, config: MoequantConfig, layer: RoutedExperts, prefix: str, formats: list[str]):
        super().__init__(layer.moe_config)
        self.prefix = prefix
        if layer.use_ep:
            raise ValueError(
                f"moequant: MoE layer {prefix} is split by expert parallelism, which the moequant "
                "plugin does not serve; run without --enable-expert-parallel."
            )
        if len(formats) != layer.global_num_experts:
            raise ValueError(
                f"moequant: quantization_config.{EXPERT_FORMATS} gives {len(formats)} formats for MoE "
                f"layer {prefix}, which has {layer.global_num_experts} experts."
            )
        by_format: dict[str, list[int]] = {}
        for expert, fmt in enumerate(formats):
            by_format.setdefault(fmt, []).append(expert)
        self.groups: list[ExpertGroup] = []
        self.methods: list[FusedMoEMethodBase] = []
        self.owner: dict[int, tuple[ExpertGroup, int]] = {}
        for fmt, experts in by_format.items():
            group = ExpertGroup(layer, fmt, experts)
            scheme = _group_scheme(config, layer, prefix, fmt, experts)
            own = CompressedTensorsConfig(
                target_scheme_map={"re:.*": scheme} if scheme else {},
                ignore=[],
                quant_format=scheme["format"] if scheme else None,
            )
            try:  # vLLM's own choice of method and kernel for this scheme
                method = CompressedTensorsMoEMethod.get_moe_method(own, group, layer_name=prefix)
            except (ValueError, RuntimeError, NotImplementedError, AssertionError) as e:
                raise _refusal(prefix, fmt, e) from None
            if method.is_monolithic and len(by_format) > 1:
                why = (
                    f"its {type(method).__name__} kernel routes inside itself, so it cannot run one format group "
                    "of a mixed layer; vLLM's CPU int4 experts run group by group only on AMX"
                )
                raise _refusal(prefix, fmt, why)
            self.groups.append(group)
            self.methods.append(method)
            self.owner.update({e: (group, i) for i, e in enumerate(experts)})
        # for the forward, [group, global expert id]: 1 where the expert is the group's, and its group-local id
        # (0 where it is not: that slot runs at weight 0 on the group's expert 0)
        self.member = torch.zeros(len(self.groups), len(formats))
        self.local_ids = torch.zeros(len(self.groups), len(formats), dtype=torch.int32)
        for e, (group, local) in self.owner.items():
            self.member[self.groups.index(group), e] = 1
            self.local_ids[self.groups.index(group), e] = local
        self.direct: list = []  # per group: its vLLM experts object when called directly, else None
        self.loader_names: list[str] = []

    @property
    def is_monolithic(self) -> bool:
        return len(self.methods) == 1 and self.methods[0].is_monolithic

    def create_weights(
        self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra_weight_attrs
    ):
        for i, (group, method) in enumerate(zip(self.groups, self.methods)):
            layer.add_module(f"moequant_group{i}", group)
            attrs = {**extra_weight_attrs, "global_num_experts": len(group.experts)}
            try:
                method.create_weights(
                    layer=group,
                    num_experts=len(group.experts),
                    hidden_size=hidden_size,
                    intermediate_size_per_partition=intermediate_size_per_partition,
                    params_dtype=params_dtype,
                    **attrs,
                )
            except (ValueError, RuntimeError, NotImplementedError, AssertionError) as e:
                raise _refusal(self.prefix, group.format, e) from None
        self.loader_names = sorted({name for group in self.groups for name in group._parameters})
        for name in self.loader_names:
            setattr(layer, name, _GroupLoader(layer, self, name))

    def process_weights_after_loading(self, layer) -> None:
        for name in self.loader_names:
            delattr(layer, name)
        self.loader_names = []
        for group, method in zip(self.groups, self.methods):
            try:
                method.process_weights_after_loading(group)
            except (ValueError, RuntimeError, NotImplementedError, AssertionError) as e:
                raise _refusal(self.prefix, group.format, e) from None
        self.direct = [_direct_experts(method, group) for group, method in zip(self.groups, self.methods)]

    def get_fused_moe_quant_config(self, layer):
        return None  # each group's method holds its own

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        # shared experts: this method has no modular kernel of its own, so vLLM's runner runs them itself
        if len(self.groups) == 1:
            return self.methods[0].apply(self.groups[0], x, topk_weights, topk_ids, None, None)
        wanted = (topk_ids.device, topk_weights.dtype, topk_ids.dtype)
        if (self.member.device, self.member.dtype, self.local_ids.dtype) != wanted:
            self.member = self.member.to(topk_ids.device, topk_weights.dtype)
            self.local_ids = self.local_ids.to(topk_ids.device, topk_ids.dtype)
        member = self.member[:, topk_ids]  # [group, token, slot]
        routed = member.sum((1, 2)).tolist()
        weights, local = member.mul_(topk_weights), self.local_ids[:, topk_ids]
        out = None
        for i, (group, method, experts) in enumerate(zip(self.groups, self.methods, self.direct)):
            if not routed[i]:
                continue  # no slot routed to this group's experts
            if experts is None:
                y = method.apply(group, x, weights[i], local[i], None, None)
            else:
                y = torch.empty_like(x)
                experts.apply(
                    output=y,
                    hidden_states=x,
                    w1=group.w13_weight,
                    w2=group.w2_weight,
                    topk_weights=weights[i],
                    topk_ids=local[i],
                    activation=group.activation,
                    global_num_experts=len(group.experts),
                    expert_map=None,
                    a1q_scale=None,
                    a2_scale=experts.a2_scale,
                    workspace13=None,
                    workspace2=None,
                    expert_tokens_meta=None,
                    apply_router_weight_on_input=group.apply_router_weight_on_input,
                )
            out = y if out is None else out.add_(y)
        return out if out is not None else torch.zeros_like(x)  # no tokens at all

    def apply_monolithic(self, layer, x, router_logits, input_ids=None):
        return self.methods[0].apply_monolithic(self.groups[0], x, router_logits, input_ids)


def _direct_experts(method: FusedMoEMethodBase, group: ExpertGroup):
    """The vLLM experts object behind a group's method when calling it directly does all that vLLM's
    modular kernel would: no dispatch, the input handed over unquantized, scratch space and the top-k
    reduction inside the experts (vLLM's CPU kernels). None otherwise: then the method's apply runs."""
    kernel = getattr(method, "moe_kernel", None)
    if (
        kernel is None
        or kernel.is_monolithic
        or type(kernel.prepare_finalize) is not MoEPrepareAndFinalizeNoDPEPModular
    ):
        return None
    experts = kernel.fused_experts
    n, moe = len(group.experts), group.moe_config
    workspaces = experts.workspace_shapes(
        1, moe.intermediate_size_per_partition * 2, moe.hidden_dim, group.top_k, n, n, None, group.activation
    )
    if (
        not experts.expects_unquantized_inputs
        or workspaces[:2] != ((0,), (0,))
        or not isinstance(experts.finalize_weight_and_reduce_impl(), TopKWeightAndReduceNoOP)
    ):
        return None
    return experts


def _group_scheme(config: MoequantConfig, layer: RoutedExperts, prefix: str, fmt: str, experts: list[int]):
    """The compressed-tensors scheme of a format group (None: unquantized), the same for all its tensors."""
    names = (layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name)
    schemes = [config.get_scheme_dict(layer, f"{prefix}.{e}.{p}") for e in experts for p in names if p]
    if any(s != schemes[0] for s in schemes):
        raise ValueError(
            f"moequant: the {fmt} experts of MoE layer {prefix} have different compressed-tensors "
            f"schemes in the checkpoint; {EXPERT_FORMATS} and config_groups disagree."
        )
    if (schemes[0] is None) != (fmt == "bf16"):
        raise ValueError(
            f"moequant: {EXPERT_FORMATS} gives experts {experts[:4]} of MoE layer {prefix} format {fmt}, "
            f"but config_groups {'leave them unquantized' if schemes[0] is None else 'quantize them'}."
        )
    return schemes[0]
