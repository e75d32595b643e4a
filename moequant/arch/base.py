"""What every architecture adapter knows, and the generic code built on it.

An adapter turns a `config.json` into the complete list of on-disk tensors — name, shape and
role — so that everything else (inspect's memory account, the shape check of a checkpoint,
tensor classification, the plan) is one lookup in that list. Architectures differ only in
names and shapes; an adapter subclass fills in a few small methods.

Routed expert weights are always handled in the nn.Linear convention `[out, in]`:
gate / up are `[expert_intermediate, hidden]`, down is `[hidden, expert_intermediate]`,
whatever the checkpoint stores (gpt-oss stores them fused and transposed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from moequant.errors import UserError

PROJECTIONS = ("gate", "up", "down")

ROLES = (
    "routed_expert",
    "shared_expert",
    "shared_expert_gate",
    "router",
    "attention",
    "embedding",
    "lm_head",
    "norm",
    "dense_mlp",
    "other",
)


@dataclass(frozen=True)
class TensorRole:
    """The role of one on-disk tensor; layer / expert / proj where they apply."""

    role: str
    layer: int | None = None
    expert: int | None = None  # None for a fused tensor that holds every expert
    proj: str | None = None


@dataclass(frozen=True)
class Routing:
    """The routing rule, as metadata for reports (calibration runs the model's own router)."""

    scoring: str  # "softmax" | "sigmoid" | "softmax_over_topk"
    top_k: int
    normalize_topk: bool
    groups: int = 1  # DeepSeek grouped top-k: n_group
    topk_groups: int = 1  # groups kept per token
    scaling: float = 1.0  # routed_scaling_factor
    correction_bias: bool = False  # DeepSeek-V3 e_score_correction_bias (selection only)
    router_bias: bool = False  # gpt-oss router has a bias


def _cfg(config: dict, *keys, default=None):
    for k in keys:
        if k in config and config[k] is not None:
            return config[k]
    return default


@dataclass
class Adapter:
    """Base adapter. Subclasses set `model_types` and override the name/shape hooks."""

    config: dict
    model_types: ClassVar[tuple[str, ...]] = ()
    fused_experts: ClassVar[bool] = False

    # filled by __post_init__ from the config
    num_layers: int = field(init=False)
    hidden: int = field(init=False)
    vocab: int = field(init=False)
    num_experts: int = field(init=False)
    top_k: int = field(init=False)
    expert_intermediate: int = field(init=False)
    moe_layers: list[int] = field(init=False)
    tie_embeddings: bool = field(init=False)

    def __post_init__(self):
        self.derive()
        self._expected: dict[str, tuple[tuple[int, ...], TensorRole]] | None = None

    def derive(self) -> None:
        """Sizes and structure from the config (a subclass may derive them otherwise: arch/generic.py)."""
        c = self.config
        try:
            self.num_layers = int(c["num_hidden_layers"])
            self.hidden = int(c["hidden_size"])
            self.vocab = int(c["vocab_size"])
        except KeyError as e:
            raise UserError(f"config.json lacks {e.args[0]!r}, which a {self.model_type} config must have.") from None
        self.tie_embeddings = bool(c.get("tie_word_embeddings", False))
        self.setup()

    # ---- hooks ---------------------------------------------------------------------------
    def setup(self) -> None:
        """Read the MoE fields of the config (num_experts, top_k, moe_layers, ...)."""
        raise NotImplementedError

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", self.model_types[0] if self.model_types else "?")

    @property
    def routing(self) -> Routing:
        raise NotImplementedError

    def attention_tensors(self, layer: int) -> dict[str, tuple[int, ...]]:
        """Attention tensors of one layer (names relative to `model.layers.L.`), norms excluded."""
        raise NotImplementedError

    def attention_norms(self, layer: int) -> dict[str, tuple[int, ...]]:
        return {}

    def moe_prefix(self, layer: int) -> str:
        return f"model.layers.{layer}.mlp."

    def router_tensors(self, layer: int) -> dict[str, tuple[int, ...]]:
        return {self.moe_prefix(layer) + "gate.weight": (self.num_experts, self.hidden)}

    def expert_proj_name(self, proj: str) -> str:
        return {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}[proj]

    def expert_tensor_name(self, layer: int, expert: int, proj: str) -> str:
        """On-disk name of one expert's projection (unfused architectures)."""
        return f"{self.moe_prefix(layer)}experts.{expert}.{self.expert_proj_name(proj)}.weight"

    def routed_expert_tensors(self, layer: int) -> dict[str, tuple[tuple[int, ...], TensorRole]]:
        out = {}
        for e in range(self.num_experts):
            for proj in PROJECTIONS:
                out[self.expert_tensor_name(layer, e, proj)] = (
                    self.expert_shape(proj),
                    TensorRole("routed_expert", layer, e, proj),
                )
        return out

    def shared_expert_tensors(self, layer: int) -> dict[str, tuple[tuple[int, ...], TensorRole]]:
        return {}

    def dense_mlp_intermediate(self) -> int:
        return int(self.config.get("intermediate_size", 0))

    # ---- generic --------------------------------------------------------------------------
    def expert_shape(self, proj: str) -> tuple[int, int]:
        i, h = self.expert_intermediate, self.hidden
        return (h, i) if proj == "down" else (i, h)

    @property
    def routed_expert_params(self) -> int:
        """Parameters of all routed experts of all MoE layers."""
        per_expert = sum(rows * cols for rows, cols in map(self.expert_shape, self.projections))
        return len(self.moe_layers) * self.num_experts * per_expert

    @property
    def dense_layers(self) -> list[int]:
        moe = set(self.moe_layers)
        return [i for i in range(self.num_layers) if i not in moe]

    @property
    def projections(self) -> tuple[str, ...]:
        return PROJECTIONS

    def expected_tensors(self) -> dict[str, tuple[tuple[int, ...], TensorRole]]:
        """Every tensor a complete checkpoint of this config holds: name → (shape, role)."""
        if self._expected is not None:
            return self._expected
        h = self.hidden
        t: dict[str, tuple[tuple[int, ...], TensorRole]] = {
            "model.embed_tokens.weight": ((self.vocab, h), TensorRole("embedding")),
            "model.norm.weight": ((h,), TensorRole("norm")),
        }
        if not self.tie_embeddings:
            t["lm_head.weight"] = ((self.vocab, h), TensorRole("lm_head"))
        moe = set(self.moe_layers)
        for L in range(self.num_layers):
            p = f"model.layers.{L}."
            t[p + "input_layernorm.weight"] = ((h,), TensorRole("norm", L))
            t[p + "post_attention_layernorm.weight"] = ((h,), TensorRole("norm", L))
            for name, shape in self.attention_tensors(L).items():
                t[p + name] = (shape, TensorRole("attention", L))
            for name, shape in self.attention_norms(L).items():
                t[p + name] = (shape, TensorRole("norm", L))
            if L in moe:
                for name, shape in self.router_tensors(L).items():
                    t[name] = (shape, TensorRole("router", L))
                t.update(self.routed_expert_tensors(L))
                t.update(self.shared_expert_tensors(L))
            else:
                i = self.dense_mlp_intermediate()
                for proj in PROJECTIONS:
                    shape = (h, i) if proj == "down" else (i, h)
                    t[f"{p}mlp.{proj}_proj.weight"] = (shape, TensorRole("dense_mlp", L, None, proj))
        self._expected = t
        return t

    def classify(self, name: str) -> TensorRole:
        entry = self.expected_tensors().get(name)
        return entry[1] if entry else TensorRole("other")

    def expert_tensor_names(self, layer: int) -> list[str]:
        return [n for n, (_, r) in self.expected_tensors().items() if r.role == "routed_expert" and r.layer == layer]

    def layer_tensor_names(self, layer: int) -> list[str]:
        return [n for n, (_, r) in self.expected_tensors().items() if r.layer == layer]

    def check_shapes(self, checkpoint) -> None:
        """Refuse a checkpoint whose tensors disagree with its config (missing ones too)."""
        expected = self.expected_tensors()
        for name, (shape, _) in expected.items():
            if name not in checkpoint.entries:
                raise UserError(f"checkpoint {checkpoint.path} lacks tensor {name}, which its config.json implies.")
            got = checkpoint.entries[name].shape
            if tuple(got) != tuple(shape):
                raise UserError(
                    f"tensor {name} in {checkpoint.path} has shape {list(got)}, but config.json implies {list(shape)}."
                )

    # ---- expert weights on disk ------------------------------------------------------------
    def read_expert(self, checkpoint, layer: int, expert: int, proj: str, device=None) -> torch.Tensor:
        """One routed expert's projection as a 2-D `[out, in]` tensor, exactly as stored (decoded on
        `device` when given)."""
        self._check_expert(layer, expert, proj)
        return checkpoint.get(self.expert_tensor_name(layer, expert, proj), device)

    def read_experts(
        self, checkpoint, layer: int, proj: str, experts=None, device=None, dtype=None, out=None
    ) -> torch.Tensor:
        """The experts of one layer and projection (all, or those in `experts`) as `[E, out, in]`, in
        `dtype` (default: as read) on `device` (default: the host), or written into `out` (a slice of a larger
        stack: no second copy). On a device, each expert's stored bytes are decoded there into one preallocated
        stack: no host copy beyond one stored expert."""
        for i, e in enumerate(range(self.num_experts) if experts is None else experts):
            w = self.read_expert(checkpoint, layer, e, proj, device)
            if out is None:
                n = self.num_experts if experts is None else len(experts)
                out = torch.empty((n,) + tuple(w.shape), dtype=dtype or w.dtype, device=w.device)
            out[i] = w
            del w
        return out

    def write_expert(
        self, tensors: dict[str, torch.Tensor], layer: int, expert: int, proj: str, weight: torch.Tensor
    ) -> None:
        """Put one expert's `[out, in]` weight into a dict of on-disk tensors (in place)."""
        self._check_expert(layer, expert, proj)
        if tuple(weight.shape) != self.expert_shape(proj):
            raise ValueError(f"expert weight shape {tuple(weight.shape)} != {self.expert_shape(proj)}")
        tensors[self.expert_tensor_name(layer, expert, proj)] = weight

    def _check_expert(self, layer: int, expert: int, proj: str) -> None:
        if layer not in self.moe_layers:
            raise UserError(
                f"layer {layer} is not an MoE layer of this {self.model_type} model (MoE layers: {_ranges(self.moe_layers)})."
            )
        if not 0 <= expert < self.num_experts:
            raise UserError(f"expert {expert} is out of range: this model has {self.num_experts} experts per layer.")
        if proj not in PROJECTIONS:
            raise UserError(f"projection {proj!r} is not one of {', '.join(PROJECTIONS)}.")

    @property
    def router_choices(self) -> int:
        """How many choices the router picks among (the experts, unless it also picks weightless ones)."""
        return self.num_experts

    def stored_itemsizes(self) -> dict[str, int]:
        """Bytes per element of the tensors a checkpoint does not store as 2-byte floats (integer tables)."""
        return {}

    # ---- the same model as transformers builds it ----------------------------------------------
    def disk_name(self, memory_key: str) -> str:
        """On-disk name of an in-memory parameter outside the decoder layers (embedding, final norm, head)."""
        return memory_key

    def transformers_module_names(self) -> dict[str, str]:
        """{on-disk module: the module transformers' model holds it in} for the Linear weights transformers' weight
        conversion renames on load (one tensor to one tensor); the families that keep their names: {}."""
        return {}

    def transformers_split_modules(self) -> set[str]:
        """On-disk modules whose weight transformers' weight conversion splits into several modules on load."""
        return set()

    def decoder(self, model):
        """(the decoder module, its list of decoder layers) of a transformers causal LM of this family."""
        return model.model, model.model.layers

    def moe_block(self, model, layer: int):
        """The MoE block of decoder layer `layer` (router, experts, shared experts)."""
        return self.decoder(model)[1][layer].mlp

    def block_in_layer(self, layer_module, layer: int):
        """The MoE block of one decoder layer module."""
        return layer_module.mlp

    def experts_in_layer(self, layer_module, layer: int):
        return self.block_in_layer(layer_module, layer).experts

    # ---- the same experts in a loaded transformers model (fused 3-D parameters) --------------
    def experts_module(self, model, layer: int):
        return self.moe_block(model, layer).experts

    def expert_from_module(self, experts, expert: int, proj: str) -> torch.Tensor:
        """Slice one expert's `[out, in]` weight out of transformers' fused parameters."""
        i = self.expert_intermediate
        if proj == "down":
            return experts.down_proj[expert]
        gate_up = experts.gate_up_proj[expert]  # [2I, H]: gate rows first, then up
        return gate_up[:i] if proj == "gate" else gate_up[i:]

    # ---- one decoder layer of a transformers model, materialised from disk -------------------
    def memory_to_disk(self, layer: int, key: str) -> str:
        """On-disk name of a (non-expert) parameter of decoder layer `layer`, given its in-memory key."""
        return f"model.layers.{layer}.{key}"

    def router_module(self, mlp):
        return mlp.gate

    def expert_hidden(self, experts, x: torch.Tensor, expert: int) -> torch.Tensor:
        """The input of expert `expert`'s down projection for tokens x (transformers' own math)."""
        gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[expert]).chunk(2, dim=-1)
        return experts.act_fn(gate) * up

    def experts_hidden(self, experts, x: torch.Tensor, ids: list[int]) -> torch.Tensor:
        """`expert_hidden` of several experts at once: [len(ids), n, I], one batched matmul."""
        gate, up = torch.matmul(x, experts.gate_up_proj[ids].transpose(-1, -2)).chunk(2, dim=-1)
        return experts.act_fn(gate) * up

    def read_tensor(self, checkpoint, memory_key: str, device=None, tensors=None) -> torch.Tensor:
        """The in-memory tensor `memory_key` (outside the routed experts) read from the checkpoint, or taken from
        `tensors` (on-disk name -> replacement)."""
        name = self.disk_name(memory_key)
        return tensors[name] if tensors and name in tensors else checkpoint.get(name, device)

    def layer_state_dict(
        self, checkpoint, layer: int, keys, dtype=torch.float32, experts=None, tensors=None, device=None
    ) -> dict:
        """State dict of decoder layer `layer` in transformers' in-memory layout.

        `experts` optionally maps proj → `[E, out, in]` replacement weights (e.g. dequantized), or "gate_up" →
        `[E, 2 * out, in]` (gate rows, then up rows: taken as it is, no second copy of the largest tensor), and
        `tensors` maps on-disk name → replacement for anything else. With `device`, what is read from
        the checkpoint goes there as stored and is decoded there.
        """
        experts, tensors = experts or {}, tensors or {}

        def given_or_read(proj):  # the replacement where one is given (any projection), else the checkpoint's
            given = experts.get(proj)
            return (
                self.read_experts(checkpoint, layer, proj, device=device, dtype=dtype)
                if given is None
                else given.to(dtype)
            )

        out = {}
        for key in keys:
            routed = key.split(".")[-2:-1] == ["experts"]  # the routed experts' (not a fused shared_experts module's)
            if routed and key.endswith("experts.gate_up_proj") and not self.fused_experts and "gate_up" in experts:
                out[key] = experts["gate_up"].to(dtype)
            elif routed and key.endswith("experts.gate_up_proj") and not self.fused_experts:
                # gate then up, each cast into its half as it arrives: one [E, 2I, H] tensor in `dtype`
                # and one projection in flight (a cat of two float32 stacks held three)
                fused = None
                for half, proj in enumerate(("gate", "up")):
                    part = experts.get(proj)
                    part = self.read_experts(checkpoint, layer, proj, device=device) if part is None else part
                    if fused is None:  # where the parts are (the device, when read there)
                        fused = torch.empty(
                            (part.shape[0], 2 * part.shape[1], part.shape[2]), dtype=dtype, device=part.device
                        )
                    fused[:, half * part.shape[1] : (half + 1) * part.shape[1]] = part
                    del part
                out[key] = fused
            elif routed and key.endswith("experts.up_proj") and not self.fused_experts:  # experts without a gate
                out[key] = given_or_read("up")
            elif routed and key.endswith("experts.down_proj") and not self.fused_experts:
                out[key] = given_or_read("down")
            elif (
                routed
                and self.fused_experts
                and (key.endswith("experts.gate_up_proj") or key.endswith("experts.down_proj"))
                and experts
            ):
                out[key] = self.fuse_experts(checkpoint, layer, key, experts).to(dtype)
            else:
                name = self.memory_to_disk(layer, key)
                t = tensors[name] if name in tensors else checkpoint.get(name, device)
                out[key] = t.to(dtype) if t.is_floating_point() else t
        return out

    def fuse_experts(self, checkpoint, layer, key, experts):
        raise NotImplementedError

    # ---- accounting ------------------------------------------------------------------------
    def params_by_role(self) -> dict[str, int]:
        counts = {r: 0 for r in ROLES}
        for shape, role in self.expected_tensors().values():
            n = 1
            for d in shape:
                n *= d
            counts[role.role] += n
        return counts

    def active_params(self) -> int:
        """Parameters touched per token: all but the routed experts, plus top_k of them."""
        by_role = self.params_by_role()
        total = sum(by_role.values())
        routed = by_role["routed_expert"]
        return total - routed + routed * self.top_k // self.num_experts

    def describe(self) -> dict:
        r = self.routing
        return {
            "model_type": self.model_type,
            "layers": self.num_layers,
            "moe_layers": len(self.moe_layers),
            "dense_layers": len(self.dense_layers),
            "experts": self.num_experts,
            "top_k": self.top_k,
            "shared_experts": self.num_shared_experts,
            "hidden_size": self.hidden,
            "expert_intermediate_size": self.expert_intermediate,
            "routing": {
                "scoring": r.scoring,
                "top_k": r.top_k,
                "normalize_topk": r.normalize_topk,
                "groups": r.groups,
                "topk_groups": r.topk_groups,
                "scaling": r.scaling,
                "correction_bias": r.correction_bias,
                "router_bias": r.router_bias,
            },
        }

    @property
    def num_shared_experts(self) -> int:
        return 0


def _ranges(xs: list[int]) -> str:
    if not xs:
        return "none"
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(out)


def gqa_attention(config: dict, hidden: int, bias: bool = False, o_bias: bool = False) -> dict[str, tuple[int, ...]]:
    """q/k/v/o of grouped-query attention; head_dim defaults to hidden / heads."""
    heads = int(config["num_attention_heads"])
    kv = int(_cfg(config, "num_key_value_heads", default=heads))
    hd = int(_cfg(config, "head_dim", default=hidden // heads))
    t = {
        "self_attn.q_proj.weight": (heads * hd, hidden),
        "self_attn.k_proj.weight": (kv * hd, hidden),
        "self_attn.v_proj.weight": (kv * hd, hidden),
        "self_attn.o_proj.weight": (hidden, heads * hd),
    }
    if bias:
        t["self_attn.q_proj.bias"] = (heads * hd,)
        t["self_attn.k_proj.bias"] = (kv * hd,)
        t["self_attn.v_proj.bias"] = (kv * hd,)
    if o_bias:
        t["self_attn.o_proj.bias"] = (hidden,)
    return t


cfg_get = _cfg
