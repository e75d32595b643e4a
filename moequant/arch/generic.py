"""Any MoE that transformers ships with its standard experts interface, derived from transformers itself.

transformers knows each family's module structure (its model class, instantiated here on the meta
device from the config) and the on-disk name of every tensor (its weight conversion mapping, which
`save_pretrained` reverses to write a checkpoint). This adapter asks both instead of hand-writing a
name table:

- structure: a decoder layer is an MoE layer when it holds a module decorated with transformers'
  `use_experts_implementation` (fused `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`); the
  module around it is the MoE block, whose other parameters are the router (and the shared experts
  where a child's name says `shared`);
- on-disk names: every in-memory parameter goes through transformers' reverse conversion on its own.
  For the experts, the reversed tensor is a small *tag* tensor whose values are row numbers, so the
  values that land in each on-disk tensor say which expert and which projection it holds and whether
  it is stored transposed, whatever chain of operations the family's mapping uses. Where the experts stay
  fused on disk, each expert's projection is presented under its per-expert name, read as a slice
  (`experts_fused_on_disk`); parameters stored together or row-permuted are read by their rows (`_add_split`).

Only what this rule cannot express keeps a family file (gpt-oss's interleaved, transposed experts with
biases).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
from collections import defaultdict

import torch

from moequant.arch.base import PROJECTIONS, Adapter, Routing, TensorRole, cfg_get
from moequant.errors import UserError

_SHARED = re.compile(r"shared")
# a decoder layer's attention child (self_attn, attention, linear_attn, ...): its gate projection (AFMoE's, Beam's,
# HY-V4's output gate) is the attention's, not a dense MLP's gate. A norm named after the attention
# (post_attention_layernorm) is not one
_ATTENTION = re.compile(r"^(?!.*norm).*(attn|attention)", re.IGNORECASE)
# a hyper-connection's residual mixing (Qwen4-Exp's attn_ / mlp_hyper_connection: low-rank sigmoid gates over the
# residual streams) steers every token like a router does: not attention, kept at the source's precision
_HYPER_CONNECTION = re.compile(r"hyper_connection")


def _quiet():
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    return logger, level


try:  # huggingface_hub's validation errors of strict config dataclasses (transformers 5.x configs)
    from huggingface_hub.errors import StrictDataclassError as _StrictError

    _CONFIG_ERRORS: tuple = (_StrictError,)
except ImportError:  # an older huggingface_hub: its configs raise ValueError / TypeError, caught upstream
    _CONFIG_ERRORS = ()


def decode_special_floats(config: dict) -> dict:
    """config.json as transformers reads it: its `{"__float__": "Infinity"}` tags back to floats."""
    from transformers import PretrainedConfig

    decode = getattr(PretrainedConfig, "_decode_special_floats", None)
    return decode(config) if decode else config


def model_class(config: dict):
    """transformers' auto class for a checkpoint: its image-text model where config.json names that class or
    the family has no causal LM (Qwen3.5-MoE, Qwen3-VL-MoE and Kimi-K2.5 ship the text model inside a
    multimodal one, vision tower beside it), else its causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    t = config.get("model_type")
    causal, image_text = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(t), MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(t)
    named = (config.get("architectures") or [None])[0]
    if image_text and (causal is None or (named == image_text and named != causal)):
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


@functools.lru_cache(maxsize=8)
def meta_model(config_json: str):
    """transformers' model for a config.json (`model_class`), on the meta device (no memory)."""
    from transformers import AutoConfig

    config = decode_special_floats(json.loads(config_json))
    raw = {k: v for k, v in config.items() if k != "model_type"}
    logger, level = _quiet()
    try:
        hf = AutoConfig.for_model(config["model_type"], **raw)
        with torch.device("meta"):
            return model_class(config).from_config(hf)
    except _CONFIG_ERRORS as e:  # transformers' own validation of a config value: one sentence upstream
        raise ValueError(str(e).splitlines()[-1].strip() or type(e).__name__) from None
    finally:
        logger.setLevel(level)


@functools.lru_cache(maxsize=1)
def standard_experts_families() -> tuple[str, ...]:
    """model_types of the installed transformers with a causal-LM or image-text model whose own modeling code uses
    `use_experts_implementation`: read from the modeling files' text and the model types' folder names, nothing
    imported (importing every config module cost most of a first command's start)."""
    import pathlib

    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    root = pathlib.Path(transformers.__file__).parent / "models"
    folders = {
        p.parent.name
        for p in root.glob("*/modeling_*.py")
        if "use_experts_implementation" in p.read_text(errors="replace")
    }
    types = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    return tuple(sorted(t for t in types if t in CONFIG_MAPPING_NAMES and model_type_to_module_name(t) in folders))


@functools.lru_cache(maxsize=None)
def wraps_experts_family(model_type: str) -> bool:
    """An image-text model whose text model is another such family's (Kimi-K2.5 wraps DeepSeek-V3's: its own
    modeling file has no experts), as its config's default text config names it."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES or model_type not in CONFIG_MAPPING:
        return False
    config_class = CONFIG_MAPPING[model_type]
    if "text_config" not in getattr(config_class, "sub_configs", {}):
        return False
    try:
        text_type = config_class().get_text_config().model_type
    except Exception:  # noqa: BLE001  (a config whose defaults do not build is no family moequant can take)
        return False
    return text_type != model_type and text_type in standard_experts_families()


def is_experts_module(module) -> bool:
    """A module decorated with transformers' `use_experts_implementation` (it sets these attributes)."""
    return hasattr(module, "is_concatenated") and hasattr(module, "has_gate") and hasattr(module, "down_proj")


def decoder_layers(model):
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise UserError(f"{type(model).__name__} has no list of decoder layers moequant can walk.")
    return base, layers


class _Reverter:
    """transformers' reverse weight conversion, one in-memory tensor at a time."""

    def __init__(self, model):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange

        self.model = model
        convs = [
            c
            for c in get_model_conversion_mapping(model, add_legacy=False)
            if not isinstance(c, (PrefixChange, per_expert_merge()))
        ]
        self.none = not convs  # the family's names on disk are its names in memory
        model._weight_conversions = convs  # (None would make transformers look the mapping up again)

    def __call__(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        from transformers.core_model_loading import revert_weight_conversion

        return {key: tensor} if self.none else self._as_shipped(revert_weight_conversion(self.model, {key: tensor}))

    def _as_shipped(self, reverted: dict) -> dict:
        """Names as the family's checkpoints spell them where transformers' reversal does not (see AS_SHIPPED)."""
        fix = AS_SHIPPED.get(self.model.config.model_type)
        return {re.sub(fix[0], fix[1], n): t for n, t in reverted.items()} if fix else reverted

    def together(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Several in-memory tensors reversed at once (those a family stores as one tensor on disk)."""
        from transformers.core_model_loading import revert_weight_conversion

        return dict(tensors) if self.none else self._as_shipped(revert_weight_conversion(self.model, dict(tensors)))

    def renamed_together(self, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """{key: {on-disk name: tensor}} for the keys that are only renamed, reversed all at once: a group rename
        (Kimi-K2.5's vision blocks: norm1/norm2 on disk norm0/norm1) renames a key only beside its partners. A
        renamed tensor comes back as itself, which says whose name it now has; the rest is left to `__call__`."""
        from transformers.core_model_loading import revert_weight_conversion

        if self.none:
            return {k: {k: t} for k, t in tensors.items()}
        owner = {id(t): k for k, t in tensors.items()}
        out = {}
        for name, t in self._as_shipped(revert_weight_conversion(self.model, dict(tensors))).items():
            if id(t) in owner and owner[id(t)] not in out:
                out[owner[id(t)]] = {name: t}
        return out


# Where transformers' reverse conversion misspells a family's on-disk names: Kimi-K2.5's mapping renames the vision
# tower's `blocks` to `layers` with an unanchored pattern, so reversing it also renames the text model's layers,
# which its checkpoints (and vLLM's loader) spell `language_model.model.layers.N`.
AS_SHIPPED = {"kimi_k25": (r"^language_model\.model\.blocks\.", "language_model.model.layers.")}


def _tag(shape: tuple[int, ...], axis: int) -> torch.Tensor:
    """[E, ...] with 1 everywhere but the expert axis and `axis`: value = expert * n + index along `axis`."""
    E, n = shape[0], shape[axis]
    small = [1] * len(shape)
    small[0], small[axis] = E, n
    return torch.arange(E * n, dtype=torch.float64).reshape(small)


class GenericAdapter(Adapter):
    """Every family whose experts follow transformers' standard experts interface."""

    def derive(self):
        """Sizes from transformers' own (text) config of the model: its names and defaults, not ours."""
        model = meta_model(json.dumps(self.config, sort_keys=True, default=str))
        text = model.config.get_text_config()
        self.hidden, self.vocab = int(text.hidden_size), int(text.vocab_size)
        self.tie_embeddings = model.get_output_embeddings() is None or (
            model.get_output_embeddings().weight is model.get_input_embeddings().weight
        )
        self.setup(model)

    def setup(self, model):
        self.model_class = type(model).__name__
        self._revert = _Reverter(model)
        base, layers = decoder_layers(model)
        base_prefix = _prefix_of(model, base)
        self._layers_prefix = base_prefix + "layers."
        self._memory_to_disk: dict[str, str] = {}
        self._itemsizes: dict[str, int] = {}
        self._joined: dict[str, tuple[int, list[str]]] = {}  # memory key -> (axis, on-disk parts in order)
        self._records: dict[int | None, dict] = {}  # per layer walked in full: what it added
        self._entries: dict[str, tuple[tuple[int, ...], TensorRole]] = {}
        self._expert_names: dict[tuple[int, int, str], tuple[str, bool]] = {}  # (L, e, proj) -> (disk name, transposed)
        # experts fused on disk: each expert's tensor under the name its per-expert checkpoints would have
        self._fused: dict[str, tuple] = {}  # name -> (fused name, expert, first row, end row, its shape untransposed)
        self._fused_disk: dict[str, tuple[tuple[int, ...], TensorRole]] = {}  # fused name -> (shape, role)
        self._split: dict[str, tuple[str, tuple[int, ...]]] = {}  # memory key -> (stored with others as, its rows)
        self.moe_layers, self.block_path, self.experts_path = [], {}, {}
        shapes = set()
        for L, layer in enumerate(layers):
            found = [(n, m) for n, m in layer.named_modules() if is_experts_module(m)]
            if len(found) > 1:
                raise UserError(
                    f"layer {L} of this {self.model_type} model holds {len(found)} experts modules; moequant reads one per layer."
                )
            if found:
                name, experts = found[0]
                self._check_standard(experts)
                self.moe_layers.append(L)
                self.experts_path[L] = name
                self.block_path[L] = name.rsplit(".", 1)[0] if "." in name else ""
                self.has_gate = experts.has_gate
                shapes.add(self._expert_sizes(experts))
        if not self.moe_layers:
            raise UserError(
                f"this {self.model_type} model has no MoE layers (no experts module in transformers' {self.model_class}); "
                "moequant quantizes Mixture-of-Experts models."
            )
        if len(shapes) > 1:
            raise UserError(
                f"this {self.model_type} model's MoE layers differ in expert count or width ({sorted(shapes)})."
            )
        self.num_experts, self.expert_intermediate = shapes.pop()
        hf_text = model.config.get_text_config()
        text = hf_text.to_dict()
        top_k = [
            getattr(hf_text, k, None) for k in ("num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts", "top_k")
        ]
        self.top_k = int(next((k for k in top_k if isinstance(k, int) and not isinstance(k, bool)), 1))
        self.text_config = {**text, **{k: v for k, v in self.config.items() if k in text}}
        self.num_layers = len(layers)
        self._walk(model, layers)

    # ---- structure ---------------------------------------------------------------------------
    def _check_standard(self, experts) -> None:
        if experts.is_transposed or not experts.is_concatenated or experts.has_bias:
            raise UserError(
                f"this {self.model_type} model's experts are stored "
                f"{'transposed' if experts.is_transposed else 'interleaved' if not experts.is_concatenated else 'with biases'}; "
                "moequant's generic reader takes transformers' standard [E, 2I, H] layout."
            )

    def _expert_sizes(self, experts) -> tuple[int, int]:
        E, H, I = experts.down_proj.shape  # noqa: E741
        return int(E), int(I)

    @property
    def projections(self) -> tuple[str, ...]:
        return PROJECTIONS if self.has_gate else ("up", "down")

    def _walk(self, model, layers) -> None:
        """Every parameter's on-disk names, shapes and roles. Layers of one structure share their names but for
        the layer index: the first layer of each structure is reversed, the second reversed too and compared with
        the first one's names renumbered, and the rest are renumbered only if those agree (DeepSeek-V3's 61 layers
        cost three layers' reversals)."""
        # parameters once each (a tied lm_head is the embedding's own parameter) and persistent buffers
        state = model.state_dict()
        kept = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
        modules = dict(model.named_modules())
        by_layer: dict[int | None, list] = {}
        for key, tensor in state.items():
            if key not in kept:
                continue
            L, rest = None, key
            if key.startswith(self._layers_prefix):
                index, rest = key[len(self._layers_prefix) :].split(".", 1)
                L = int(index)
            by_layer.setdefault(L, []).append((key, rest, tensor))
        seen: dict[tuple, list] = {}  # structure -> [first layer, renumbering verified: None / True / False]
        for L, items in by_layer.items():
            structure = (L in self.experts_path, tuple((rest, tuple(t.shape), t.dtype) for _, rest, t in items))
            first = seen.get(structure) if L is not None else None
            if first is not None and first[1]:
                self._merge(self._renumbered(first[0], L))
                continue
            record = self._walk_layer(L, items, modules)
            if L is not None and first is None:
                seen[structure] = [L, None]
            elif first is not None:
                first[1] = self._renumbered(first[0], L) == record
            self._records[L] = record
            self._merge(record)

    def _walk_layer(self, L, items, modules) -> dict:
        record = {
            "m2d": {},
            "entries": {},
            "experts": {},
            "joined": {},
            "itemsizes": {},
            "fused": {},
            "fused_disk": {},
            "split": {},
        }
        plain = {
            key: tensor
            for key, rest, tensor in items
            if not (L is not None and L in self.experts_path and rest.startswith(self.experts_path[L] + "."))
        }
        renamed = self._revert.renamed_together(plain)
        for key, rest, tensor in items:
            if key not in plain:
                self._add_experts(record, key, L, rest[len(self.experts_path[L]) + 1 :], tensor)
                continue
            disk = renamed.get(key) or self._revert(key, tensor)
            if len(disk) > 1:  # one parameter stored as several tensors (Kimi-Linear's q/k/v convolutions)
                record["joined"][key] = (self._joined_axis(key, tensor, disk), list(disk))
            module = modules.get(key.rsplit(".", 1)[0])
            role = self._role(key, L, rest, tensor, module)
            for name, t in disk.items():
                record["m2d"].setdefault(key, name)
                record["entries"][name] = (tuple(t.shape), role)
                if not tensor.is_floating_point():  # an integer table (DeepSeek-V4's hash routing): its own width
                    record["itemsizes"][name] = tensor.element_size()
        self._add_split(record, plain)
        return record

    def _add_split(self, record, plain) -> None:
        """Parameters whose rows are stored elsewhere than at their own rows: several stored together as one
        tensor (Kimi-K2.5's vision attention: q, k and v in one `wqkv`), or one stored with its rows permuted for
        a rotary embedding (Kimi-K2.5's and Mistral-Large-4's vision q and k). Reversing tags of row numbers
        (together, for those stored together) says which stored rows each parameter's rows are."""
        sharing: dict[str, list[str]] = {}
        for key, name in record["m2d"].items():
            if key in plain and key not in record["joined"] and plain[key].dim() > 0:
                sharing.setdefault(name, []).append(key)
        for name, keys in sharing.items():
            tags, start = {}, 0
            for k in keys:
                n, rest = plain[k].shape[0], plain[k].dim() - 1
                tags[k] = torch.arange(start, start + n, dtype=torch.float64).reshape(n, *[1] * rest)
                start += n
            rows = self._revert.together(tags).get(name)
            if rows is None or rows.shape[0] != start or rows.numel() != start:  # not rows (transposed, reshaped)
                if len(keys) > 1:
                    raise UserError(
                        f"this {self.model_type} model stores {', '.join(keys)} together as {name} in a way moequant "
                        "cannot split."
                    )
                continue
            rows = rows.flatten().long()
            if len(keys) == 1 and torch.equal(rows, torch.arange(start)):
                continue  # stored as it is
            whole = self._revert.together({k: plain[k] for k in keys})[name]
            record["entries"][name] = (tuple(whole.shape), record["entries"][name][1])
            start = 0
            for k in keys:
                n = plain[k].shape[0]
                at = ((rows >= start) & (rows < start + n)).nonzero().flatten()
                index = torch.empty(n, dtype=torch.long)
                index[rows[at] - start] = at
                record["split"][k] = (name, tuple(index.tolist()))
                start += n

    def _renumbered(self, L0: int, L: int) -> dict:
        """Layer L0's record with its layer index replaced by L (memory keys, on-disk names and roles)."""
        on_disk = re.compile(rf"(^|\.)layers\.{L0}\.")

        def name(n: str) -> str:
            return on_disk.sub(rf"\g<1>layers.{L}.", n, count=1)

        def key(k: str) -> str:
            return f"{self._layers_prefix}{L}." + k[len(f"{self._layers_prefix}{L0}.") :]

        r = self._records[L0]
        return {
            "m2d": {key(k): name(n) for k, n in r["m2d"].items()},
            "entries": {
                name(n): (shape, dataclasses.replace(role, layer=L)) for n, (shape, role) in r["entries"].items()
            },
            "experts": {(L, e, p): (name(n), t) for (_, e, p), (n, t) in r["experts"].items()},
            "joined": {key(k): (axis, [name(n) for n in names]) for k, (axis, names) in r["joined"].items()},
            "itemsizes": {name(n): size for n, size in r["itemsizes"].items()},
            "fused": {name(v): (name(d), *rest) for v, (d, *rest) in r["fused"].items()},
            "fused_disk": {
                name(n): (shape, dataclasses.replace(role, layer=L)) for n, (shape, role) in r["fused_disk"].items()
            },
            "split": {key(k): (name(n), index) for k, (n, index) in r["split"].items()},
        }

    def _merge(self, record: dict) -> None:
        self._memory_to_disk.update(record["m2d"])
        self._entries.update(record["entries"])
        self._expert_names.update(record["experts"])
        self._joined.update(record["joined"])
        self._itemsizes.update(record["itemsizes"])
        self._fused.update(record["fused"])
        self._fused_disk.update(record["fused_disk"])
        self._split.update(record["split"])

    def _role(self, key, L, rest, t, module) -> TensorRole:
        leaf = key.rsplit(".", 1)[-1]
        norm = module is not None and "norm" in type(module).__name__.lower()
        if L is None:
            if "embed_tokens" in key or key.endswith("embeddings.weight"):
                return TensorRole("embedding")
            if key.startswith("lm_head."):
                return TensorRole("lm_head")
            return TensorRole("norm") if norm else TensorRole("other")
        linear = isinstance(module, torch.nn.Linear) and leaf in ("weight", "bias")
        if norm or (linear and "norm" in rest.split(".")[0].lower()):
            # a gated norm's own low-rank gate (AXK2's GatedRMSNorm: hidden -> 16 -> hidden) is part of the norm:
            # a fraction of a percent of the layer, and 16 input columns no group format holds
            return TensorRole("norm", L)
        proj = _proj_of(rest)
        block = self.block_path.get(L)
        # experts right in the decoder layer (Gemma-4): the layer is the block, and only its router and shared
        # experts are the MoE's own; its dense MLP and attention beside them are what they are
        inside = rest if block == "" else rest[len(block) + 1 :] if block and rest.startswith(block + ".") else None
        if inside is not None:
            head = inside.split(".")[0]
            if _SHARED.search(head):
                if t.dim() == 2 and t.shape[0] == 1:
                    return TensorRole("shared_expert_gate", L)
                return TensorRole("shared_expert", L, None, proj) if linear else TensorRole("other", L)
            if block or head in ("gate", "router"):
                return TensorRole("router", L)  # the block's own parameters: the router's (and its bias)
        head = rest.split(".")[0]
        # a Linear right on the decoder layer (Gemma-4's per-layer input gate and projection) or in a hyper-connection
        # is neither attention nor an MLP of the recipe's: other, kept as stored
        if linear and (rest.count(".") == 1 or _HYPER_CONNECTION.search(head)):
            return TensorRole("other", L)
        # an MLP the decoder layer names shared, beside its MoE block: that block's shared expert (Granite's
        # `shared_mlp`, which llama.cpp's converter writes as ffn_*_shexp)
        if linear and proj is not None and block is not None and _SHARED.search(head):
            return TensorRole("shared_expert", L, None, proj)
        # a dense MLP's projection outside the MoE block, in a dense layer or beside the block in an MoE layer
        # (LongCat-Flash's two always-on MLPs, `mlps.0` / `mlps.1`)
        if linear and proj is not None and not _ATTENTION.search(head):
            return TensorRole("dense_mlp", L, None, proj)
        if linear:
            return TensorRole("attention", L)
        return TensorRole("other", L)

    def _joined_axis(self, key, tensor, disk) -> int:
        """The axis along which the on-disk parts of `key` concatenate to it, checked on a tag tensor."""
        shape = tuple(tensor.shape)
        for axis in range(len(shape)):
            if (
                all(t.dim() == len(shape) for t in disk.values())
                and sum(t.shape[axis] for t in disk.values()) == shape[axis]
            ):
                small = [1] * len(shape)
                small[axis] = shape[axis]
                tag = torch.arange(shape[axis], dtype=torch.float64).reshape(small)
                parts = list(self._revert(key, tag).values())
                if torch.equal(torch.cat(parts, axis), tag):
                    return axis
        raise UserError(f"this {self.model_type} model stores {key} as {len(disk)} tensors moequant cannot join.")

    def read_tensor(self, checkpoint, memory_key: str, device=None, tensors=None) -> torch.Tensor:
        """As the base class, for parameters stored as several tensors (joined) or as rows of one (split) too;
        `tensors` replaces on-disk tensors by name."""
        tensors = tensors or {}

        def get(name):
            return tensors[name] if name in tensors else checkpoint.get(name, device)

        split = self._split.get(memory_key)
        if split is not None:
            name, rows = split
            t = get(name)
            return t[torch.tensor(rows, device=t.device)]
        if memory_key in self._joined:
            axis, names = self._joined[memory_key]
            return torch.cat([get(n) for n in names], axis)
        return get(self.disk_name(memory_key))

    def layer_state_dict(self, checkpoint, layer, keys, dtype=torch.float32, experts=None, tensors=None, device=None):
        prefix = f"{self._layers_prefix}{layer}."
        apart = {k for k in keys if prefix + k in self._split or prefix + k in self._joined}
        out = super().layer_state_dict(
            checkpoint, layer, [k for k in keys if k not in apart], dtype, experts, tensors, device
        )
        for k in apart:
            t = self.read_tensor(checkpoint, prefix + k, device, tensors)
            out[k] = t.to(dtype) if t.is_floating_point() else t
        return out

    def _add_experts(self, record, key, L, param, tensor) -> None:
        """On-disk names of one fused experts parameter, by reversing a tag tensor of its values."""
        E, I, H = self.num_experts, self.expert_intermediate, self.hidden  # noqa: E741
        if param == "gate_up_proj":
            halves = ("gate", "up")
            rows = 2 * I
        elif param == "up_proj" and not self.has_gate:
            halves, rows = ("up",), I
        elif param == "down_proj":
            halves, rows = ("down",), H
        else:
            raise UserError(f"this {self.model_type} model's experts hold {param}, which moequant does not know.")
        if tuple(tensor.shape) != (E, rows, tensor.shape[2]):
            raise UserError(f"{key} has shape {list(tensor.shape)}; the standard experts layout is [{E}, {rows}, ...].")
        width = rows // len(halves)
        shapes = {n: tuple(int(d) for d in t.shape) for n, t in self._revert(key, tensor).items()}
        if all(len(shape) == 3 for shape in shapes.values()):
            self._add_fused(record, key, L, halves, tensor, shapes)
            return
        for name, t in self._revert(key, _tag(tuple(tensor.shape), 1)).items():
            values = t.flatten()
            first = int(values[0])
            e, r = divmod(first, rows)
            half = halves[r // width]
            if (
                len(shapes.get(name, ())) != 2
                or values.numel() != width
                or not torch.equal(values, first + torch.arange(width, dtype=values.dtype))
            ):
                raise UserError(
                    f"this {self.model_type} model stores its experts fused on disk ({name}); "
                    "moequant's generic reader takes one tensor per expert."
                )
            # [out, in] on disk unless the rows are the second axis (a tag of one column may come back 1-D)
            transposed = t.shape[0] == 1 if t.dim() == 2 else shapes[name][0] != width
            record["experts"][(L, e, half)] = (name, transposed)
            record["entries"][name] = (shapes[name], TensorRole("routed_expert", L, e, half))
            if transposed:
                raise UserError(
                    f"this {self.model_type} model stores expert weights transposed ({name}); not supported yet."
                )

    def _add_fused(self, record, key, L, halves, tensor, shapes) -> None:
        """Experts stored fused on disk: one tensor of every expert as in memory, or gate and up apart (Step-3.7),
        possibly with the last two axes swapped where the family's mapping transposes them (Qwen3-VL-MoE;
        transformers then goes by the stored shape, and so does Checkpoint.present_fused_experts). A tag of the
        rows says which rows each stored tensor holds. Each expert's projection is presented under the name a
        per-expert checkpoint gives it (`experts.N.gate_proj.weight`: what vLLM's loaders and transformers'
        per-expert mapping take), read as a slice of the fused tensor; the export writes those names."""
        E, rows, cols = (int(d) for d in tensor.shape)
        width = rows // len(halves)
        found = {}
        for name, t in self._revert(key, _tag((E, rows, cols), 1)).items():
            values = t.reshape(E, -1) - torch.arange(E, dtype=torch.float64)[:, None] * rows  # rows of each expert
            first, n = int(values[0, 0]), values.shape[1]
            if not torch.equal(values, first + torch.arange(n, dtype=torch.float64).expand(E, n)):
                raise UserError(
                    f"this {self.model_type} model stores its experts fused on disk in a layout moequant does not know ({name})."
                )
            record["fused_disk"][name] = (shapes[name], TensorRole("routed_expert", L, None, "_".join(halves)))
            for i, half in enumerate(halves):
                if first <= i * width and (i + 1) * width <= first + n:
                    found[half] = (name, i * width - first, (i + 1) * width - first, (E, n, cols))
        if set(found) != set(halves):
            raise UserError(
                f"this {self.model_type} model's fused experts on disk do not hold {sorted(set(halves) - set(found))}."
            )
        for e in range(E):
            for half, (name, start, end, shape) in found.items():
                per_expert = f"{self._layers_prefix}{L}.{self.experts_path[L]}.{e}.{half}_proj.weight"
                virtual = next(iter(self._revert(per_expert, torch.empty(width, cols, device="meta"))))
                record["experts"][(L, e, half)] = (virtual, False)
                record["entries"][virtual] = ((width, cols), TensorRole("routed_expert", L, e, half))
                record["fused"][virtual] = (name, e, start, end, shape)

    @property
    def experts_fused_on_disk(self) -> dict[str, tuple]:
        """{per-expert name: (fused on-disk name, expert, first row, end row, that tensor's shape untransposed)} where the
        family's checkpoints keep a layer's experts in one tensor (empty otherwise)."""
        return self._fused

    def classify(self, name):
        fused = self._fused_disk.get(name)
        return fused[1] if fused else super().classify(name)

    # ---- the Adapter contract ------------------------------------------------------------------
    @property
    def routing(self) -> Routing:
        """Metadata for the report (calibration runs the model's own router): the config's routing keys,
        where it has them; a selection bias (DeepSeek-V3's `e_score_correction_bias`) implies sigmoid scores;
        a config without `norm_topk_prob` renormalises its top-k weights (Mixtral's rule)."""
        c = self.text_config
        bias = any(
            r.role == "router" and ("correction" in n or n.endswith(".expert_bias"))  # AFMoE's: selection only
            for n, (_, r) in self._entries.items()
        )
        scoring = str(cfg_get(c, "scoring_func", "score_func", default="sigmoid" if bias else "softmax")).lower()
        grouped = cfg_get(c, "topk_method", default="group_limited_greedy") in ("group_limited_greedy", "noaux_tc")
        return Routing(
            "sigmoid" if "sigmoid" in scoring else "softmax",
            self.top_k,
            # the families' own names too: Kimi-Linear's moe_renormalize / num_expert_group, AFMoE's route_scale
            normalize_topk=bool(cfg_get(c, "norm_topk_prob", "moe_renormalize", default=True)),
            groups=int(cfg_get(c, "n_group", "num_expert_group", default=1) or 1) if grouped else 1,
            topk_groups=int(cfg_get(c, "topk_group", default=1) or 1) if grouped else 1,
            scaling=float(cfg_get(c, "routed_scaling_factor", "route_scale", default=1.0) or 1.0),
            correction_bias=bias,
            router_bias=any(
                r.role == "router" and n.endswith(".bias") and "correction" not in n
                for n, (_, r) in self._entries.items()
            ),
        )

    @property
    def num_shared_experts(self) -> int:
        """Shared experts per MoE layer: the config's count (DeepSeek's one block of n_shared_experts widths counts
        as that many, as llama.cpp counts it), else 1 where the layer holds a shared expert."""
        L = self.moe_layers[0]
        if not any(r.role == "shared_expert" and r.layer == L for _, r in self._entries.values()):
            return 0
        counts = [self.text_config.get(k) for k in ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")]
        return next((int(n) for n in counts if isinstance(n, int) and not isinstance(n, bool) and n > 0), 1)

    def stored_itemsizes(self):
        return self._itemsizes

    @functools.cached_property
    def router_choices(self) -> int:  # read for every calibration batch: the entries are scanned once
        """How many choices the router picks among: its rows. More than the experts where it also picks weightless
        "zero" (identity) experts, numbered after the real ones (LongCat-Flash); statistics count the real ones."""
        L = self.moe_layers[0]
        rows = [
            s[0]
            for n, (s, r) in self._entries.items()
            if r.role == "router" and r.layer == L and len(s) == 2 and s[1] == self.hidden and n not in self._itemsizes
        ]
        return max(rows + [self.num_experts])

    @property
    def shared_intermediate(self) -> int:
        """Width of a MoE layer's shared expert(s) together (0 without one), from its down projection."""
        L = self.moe_layers[0]
        for shape, r in self._entries.values():
            if r.role == "shared_expert" and r.layer == L and r.proj == "down" and len(shape) == 2:
                return int(shape[1])
        return 0

    def expected_tensors(self):
        return self._entries

    def expert_tensor_name(self, layer, expert, proj):
        self._check_expert(layer, expert, proj)
        return self._expert_names[(layer, expert, proj)][0]

    def _check_expert(self, layer, expert, proj):
        if proj not in self.projections:
            raise UserError(f"projection {proj!r} is not one of {', '.join(self.projections)}.")
        super()._check_expert(layer, expert, "down")

    def decoder(self, model):
        return decoder_layers(model)

    def moe_block(self, model, layer):
        return self.decoder(model)[1][layer].get_submodule(self.block_path[layer])

    def block_in_layer(self, layer_module, layer):
        return layer_module.get_submodule(self.block_path[layer])

    def experts_in_layer(self, layer_module, layer):
        return layer_module.get_submodule(self.experts_path[layer])

    def experts_module(self, model, layer):
        return self.decoder(model)[1][layer].get_submodule(self.experts_path[layer])

    def router_module(self, mlp):
        for name in ("gate", "router"):
            if isinstance(getattr(mlp, name, None), torch.nn.Module):
                return getattr(mlp, name)
        raise UserError(f"this {self.model_type} model's MoE block has no router module moequant can find.")

    def memory_to_disk(self, layer, key):
        return self._memory_to_disk[f"{self._layers_prefix}{layer}.{key}"]

    def disk_name(self, memory_key: str) -> str:
        return self._memory_to_disk[memory_key]

    def transformers_module_names(self) -> dict[str, str]:
        renamed: dict[str, list[str]] = defaultdict(list)
        for key, name in self._memory_to_disk.items():
            one_to_one = key not in self._joined and key not in self._split
            if one_to_one and key != name and key.endswith(".weight") and name.endswith(".weight"):
                renamed[name.removesuffix(".weight")].append(key.removesuffix(".weight"))
        return {name: keys[0] for name, keys in renamed.items() if len(keys) == 1}

    def transformers_split_modules(self) -> set[str]:
        return {stored.removesuffix(".weight") for stored, _ in self._split.values() if stored.endswith(".weight")}

    def expert_from_module(self, experts, expert, proj):
        i = self.expert_intermediate
        if proj == "down":
            return experts.down_proj[expert]
        if not self.has_gate:
            return experts.up_proj[expert]
        gate_up = experts.gate_up_proj[expert]
        return gate_up[:i] if proj == "gate" else gate_up[i:]

    def expert_hidden(self, experts, x, expert):
        return self.experts_hidden(experts, x, [expert])[0]

    def experts_hidden(self, experts, x, ids):
        if not self.has_gate:
            return experts.act_fn(torch.matmul(x, experts.up_proj[ids].transpose(-1, -2)))
        return experts._apply_gate(torch.matmul(x, experts.gate_up_proj[ids].transpose(-1, -2)))


def _proj_of(rest: str) -> str | None:
    """The MLP projection a weight's name says: gate/up/down, Mixtral's w1/w3/w2, an ungated MLP's fc1/fc2 (up,
    down), or Granite's input_linear / output_linear (gate and up rows in one tensor, down)."""
    m = re.search(r"(?:^|\.)(gate|up|down|w1|w2|w3|fc1|fc2|input_linear|output_linear)(?:_proj)?\.weight$", rest)
    if not m:
        return None
    names = {"w1": "gate", "w3": "up", "w2": "down", "fc1": "up", "fc2": "down"}
    return {**names, "input_linear": "gate_up", "output_linear": "down"}.get(m.group(1), m.group(1))


def _prefix_of(model, base) -> str:
    for name, module in model.named_modules():
        if module is base:
            return name + "." if name else ""
    raise UserError(f"{type(model).__name__}'s decoder is not one of its modules.")


@functools.cache
def per_expert_merge():
    """transformers' WeightConverter under a name of ours: the adapter's reversal (_Reverter) leaves these out,
    so the family's own on-disk names stay what it reads."""
    from transformers.core_model_loading import WeightConverter

    return type("MoequantPerExpertMerge", (WeightConverter,), {})
