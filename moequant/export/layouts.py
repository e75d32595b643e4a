"""Write quantized checkpoints that serving engines load.

    export_checkpoint(source_dir, quantized, out_dir, kept=None,
                      layout="compressed-tensors", target="vllm")

`quantized` maps a tensor to its QuantizedTensor. Keys are either on-disk tensor names of the
source checkpoint ("model.layers.3.mlp.experts.7.down_proj.weight", "...self_attn.q_proj.weight")
or (layer, expert, proj) tuples for routed experts, resolved through the architecture adapter
(the only way to address gpt-oss's fused experts one by one). A QuantizedTensor in format bf16
is written as a plain bf16 weight. `kept` maps on-disk names to full-precision tensors written
instead of the source's (e.g. a norm or router an AWQ fold changed); a plain tensor value in
`quantized` (under its on-disk name, as `moequant.pipeline.quantize.quantize_model` returns them) is
the same thing. Everything else is copied from the source as is.

A quantized source (FP8-block, compressed-tensors INT4, gpt-oss MXFP4, ...; see moequant.io.dequant)
is read as its dequantized logical model. Its tensors that this export does not quantize (the
recipe keeps them, or an MTP layer no adapter knows) are written **dense in the model's dtype**
(config `torch_dtype`, bf16 by default), not re-encoded as the source had them, with one exception:
tensors no adapter knows (DeepSeek's MTP layers, `num_nextn_predict_layers`) go into a deepseek-fp8
export in the source's own FP8-block codes and scales, unchanged. The output's
`quantization_config` describes only what this export wrote (the source's is dropped), so every
reader of the layout loads it. bf16 costs 2 bytes per kept weight where FP8 had 1, and rounds
the dequantized value to bf16's 8 significant bits (the source's e4m3 code times its fp32 scale
can need more).

Layouts (each refuses, before any work, a plan it cannot hold — one sentence, UserError):

- "compressed-tensors" (default): one 2-D tensor set per module under the checkpoint's own names,
  `quantization_config` with one config group per distinct scheme (exact module names as
  targets, disjoint), `ignore` for every Linear left in bf16, per-group `format`, global
  `format` = the single group format or `mixed-precision` (SGLang: `pack-quantized` when any
  group is integer), `quantization_status: compressed`. int8 is W8A16 `pack-quantized`, or W8A8
  `int-quantized` with dynamic per-token int8 activations when int8_activations="dynamic".
  target "vllm"/"sglang" needs one format per MoE layer's routed experts, one format per fused
  module group (q/k/v, gate/up) and int formats of 4 or 8 bits; target "transformers" takes any
  per-expert mix (loaded by moequant.load()); target "vllm-moequant" takes a per-expert mix too,
  one format per expert (its gate, up and down), and writes `quant_method: moequant` with
  `expert_formats` = {MoE layer module: [format key per expert]} for moequant's vLLM plugin
  (moequant.vllm_plugin), which serves it; moequant.load reads it as compressed-tensors.
- "gptq": GPTQ v1 symmetric int4 / int8 (qweight, qzeros, scales fp16, g_idx), quantize_config.json,
  per-module `dynamic` overrides: "+:" for modules whose bits / group differ from the base,
  "-:" for Linear modules kept in bf16.
- "awq": AutoAWQ GEMM int4 (asymmetric or symmetric, one group size).
- "deepseek-fp8": weight float8_e4m3fn + weight_scale_inv per 128x128 block, `weight_block_size`.
- "gpt-oss-mxfp4": gpt-oss experts as `*_blocks` / `*_scales` (gate/up interleaved as on disk),
  biases and every other tensor kept.
- "gguf": one `model.gguf` for llama.cpp, ggml block types (moequant.export.gguf).

The output directory is built in a temporary sibling and renamed into place at the end; a
`moequant_export.json` beside the weights records the layout, target and every tensor's format.

What reads these (tests/test_export*.py, tests/test_vllm.py): compressed-tensors' decompression
equals moequant.load() bit for bit for every format; vLLM 0.32 CPU runs W4A16 (CT), W8A8 int8
(CT), their per-layer mix and GPTQ v1 int4 of Mixtral / Qwen2-MoE; vLLM's CPU MoE has no kernel
for W8A16 int8 (pack-quantized, a GPU/Marlin format) and runs int8 W8A8 only in bfloat16;
GPTQModel 7.6 reads GPTQ exports of Qwen2/3-MoE (it expects Mixtral experts under
transformers-5 module names, `mlp.experts.N.gate_proj`, not the on-disk `block_sparse_moe.experts.N.w1`).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Mapping

import torch

from moequant import formats
from moequant.arch import adapter_for
from moequant.errors import UserError
from moequant.formats import QuantizedTensor
from moequant.io.checkpoint import EXPORT_INFO, ShardWriter, atomic_directory, copy_aux_files, open_checkpoint

TARGETS = ("vllm", "sglang", "transformers", "llama.cpp", "vllm-moequant", "vllm-cuda")
ENGINE_TARGETS = (
    "vllm",
    "sglang",
    "vllm-moequant",
    "vllm-cuda",
)  # load through an engine's own kernels: int formats of 4 or 8 bits

# Linear modules a serving engine fuses into one: they must share one scheme.
_FUSED_SIBLINGS = (
    {"q_proj", "k_proj", "v_proj"},
    {"gate_proj", "up_proj"},
    {"w1", "w3"},
    {"q_a_proj", "kv_a_proj_with_mqa"},
)
_NOT_LINEAR_ROLES = ("norm", "embedding")
SGLANG_EXPERT_NAMES = {"gate_proj", "up_proj", "down_proj"}  # the names SGLang reads a layer's scheme from
# vLLM's names for those fused modules (GPTQ `dynamic` rules are matched against them)
_FUSED_NAMES = {
    ("k_proj", "q_proj", "v_proj"): "qkv_proj",
    ("gate_proj", "up_proj"): "gate_up_proj",
    ("kv_a_proj_with_mqa", "q_a_proj"): "fused_qkv_a_proj",
}


def export_checkpoint(
    source_dir,
    quantized: Mapping,
    out_dir,
    *,
    kept: Mapping[str, torch.Tensor] | None = None,
    layout: str = "compressed-tensors",
    target: str = "vllm",
    int8_activations: str = "none",
    max_shard_bytes: int = 2 * 1024**3,
    gguf_float: str = "bf16",
    gguf_types: Mapping[str, str] | None = None,
) -> Path:
    """Write `out_dir`: the source checkpoint with `quantized` tensors in `layout`. Returns the path."""
    _check_export_options(layout, target, int8_activations)
    ckpt = open_checkpoint(source_dir)
    if ckpt.config_only:
        raise UserError(f"{source_dir} has no safetensors weights to export.")
    adapter = adapter_for(ckpt.config)
    quantized, kept = _split_replacements(quantized, kept, ckpt, source_dir)
    items = _resolve(quantized, ckpt, adapter)
    both = sorted(set(items) & set(kept))
    if both:
        raise UserError(f"tensor {both[0]!r} is given both quantized and kept; give it once.")
    # bf16 "quantized" tensors are written dense, read when written (their codes may still be on disk)
    plain = {n: q for n, q in items.items() if not q.spec.quantized}
    items = {n: q for n, q in items.items() if q.spec.quantized}

    if layout == "gguf":  # one file in llama.cpp's names and block layouts (moequant.export.gguf)
        from moequant.export.gguf import export_gguf

        for n, q in plain.items():
            kept.setdefault(n, _from_linear(adapter, n, q.codes))
        info = {"layout": layout, "target": target, "formats": {n: q.spec.key for n, q in sorted(items.items())}}
        return export_gguf(
            ckpt, adapter, {**items, **plain}, out_dir, kept=kept, float_type=gguf_float, info=info, types=gguf_types
        )
    writer = make_writer(ckpt, adapter, items, layout, target, int8_activations, excluded=set(kept) | set(plain))
    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        _write_shards(tmp, ckpt, adapter, writer, items, plain, kept, max_shard_bytes)
        write_checkpoint_files(tmp, ckpt, writer)
    return out_dir


def make_writer(ckpt, adapter, items: Mapping, layout: str, target: str, int8_activations: str, excluded=()):
    """The layout's writer for `items` ({on-disk name: QuantizedTensor}; only their spec and shape are read
    here), checked: a plan the layout cannot hold is refused before any work."""
    roles = {n: adapter.classify(n) for n in ckpt.keys()}
    writer = LAYOUTS[layout](ckpt, adapter, dict(items), roles, target, int8_activations)
    writer.check()
    # tensors no adapter knows (DeepSeek's MTP layers) that the source holds in the output's own
    # encoding: carried through unchanged, codes and scales as stored (`excluded`: written otherwise)
    writer.carried = {
        n for n, enc in ckpt.encodings.items() if roles[n].role == "other" and n not in excluded and writer.carries(enc)
    }
    return writer


def write_checkpoint_files(tmp: Path, ckpt, writer) -> None:
    """Everything of an export beside its weights: config.json with the layout's quantization_config, the
    layout's own files, moequant_export.json (layout, target, every tensor's format), tokenizer files."""
    # auto_map: code we neither copy nor run; the source's own quantization_config described the
    # source: the output's describes only what this export wrote
    config = {k: v for k, v in ckpt.config.items() if k not in ("auto_map", "quantization_config")}
    config["quantization_config"] = writer.quantization_config()
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for fname, content in writer.extra_files().items():
        (tmp / fname).write_text(json.dumps(content, indent=2) + "\n")
    formats_written = {n: q.spec.key for n, q in sorted(writer.items.items())}
    info = {"layout": writer.name, "target": writer.target, "formats": formats_written}
    (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
    copy_aux_files(ckpt.directory, tmp)


def _check_export_options(layout: str, target: str, int8_activations: str) -> None:
    """Refuse an unknown layout, target or int8_activations, or a layout the target cannot load."""
    if layout not in LAYOUTS:
        raise UserError(f"export layout {layout!r} is not supported; accepted: {', '.join(LAYOUTS)}.")
    if target not in TARGETS:
        raise UserError(f"export target {target!r} is not supported; accepted: {', '.join(TARGETS)}.")
    why = _target_refusal(layout, target)
    if why:
        raise UserError(why + ".")
    if int8_activations not in ("none", "dynamic"):
        raise UserError(f"int8_activations {int8_activations!r} is not supported; accepted: none, dynamic.")


def _split_replacements(
    quantized: Mapping, kept: Mapping[str, torch.Tensor] | None, ckpt, source_dir
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the QuantizedTensor entries of `quantized`, kept with its plain-tensor entries added), every
    kept tensor checked against the checkpoint's names and shapes."""
    kept = dict(kept or {})
    replacements = {k: v for k, v in quantized.items() if isinstance(v, torch.Tensor)}
    quantized = {k: v for k, v in quantized.items() if not isinstance(v, torch.Tensor)}
    for name, tensor in replacements.items():
        if not isinstance(name, str):
            raise UserError(
                f"quantized[{name!r}] is a plain tensor: full-precision replacements are keyed by their "
                "on-disk tensor name."
            )
        if name in kept:
            raise UserError(f"tensor {name!r} is given twice (as a plain tensor in quantized and in kept).")
        kept[name] = tensor
    for name, tensor in kept.items():
        if name not in ckpt:
            raise UserError(f"kept tensor {name!r} is not a tensor of {source_dir}.")
        if tuple(tensor.shape) != tuple(ckpt.shape(name)):
            raise UserError(
                f"kept tensor {name!r} has shape {list(tensor.shape)}, but the checkpoint's is "
                f"{list(ckpt.shape(name))}."
            )
    return quantized, kept


PACK_WORKERS = 4  # threads packing quantized tensors (torch releases the GIL) while the main thread writes
PACK_AHEAD = 8  # packed tensors waiting at most: host memory stays at a few tensors, never a shard


def _write_shards(tmp: Path, ckpt, adapter, writer, items: dict, plain: dict, kept: dict, max_shard_bytes: int) -> None:
    """Every tensor of the source in checkpoint order: packed by the layout, carried as stored,
    bf16 from its codes, or kept / copied (dense in the model's dtype when the source stored it quantized).
    Quantized tensors are read and packed by a few threads ahead of the writer (reading the work file,
    unpacking and packing were the export's time, not the disk)."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    shards = ShardWriter(tmp, max_shard_bytes=max_shard_bytes)
    names = list(ckpt.keys())
    packed = deque()  # (name, future) of the next quantized tensors, in checkpoint order
    upcoming = iter([n for n in names if n in items])
    with ThreadPoolExecutor(PACK_WORKERS, thread_name_prefix="moequant-pack") as pool:

        def refill():
            while len(packed) < PACK_AHEAD:
                name = next(upcoming, None)
                if name is None:
                    return
                packed.append((name, pool.submit(writer.pack, name, items[name])))

        for name in names:
            if name in items:
                refill()
                ahead, future = packed.popleft()
                assert ahead == name
                for packed_name, tensor in future.result().items():
                    shards.add(packed_name, tensor)
            else:
                write_unquantized(shards, ckpt, adapter, writer, name, plain, kept)
    shards.finish()


def write_unquantized(shards, ckpt, adapter, writer, name: str, plain: Mapping, kept: Mapping) -> None:
    """A source tensor the layout does not pack: carried as stored, bf16 from its codes (`plain`), the
    given replacement (`kept`), or copied (dense in the model's dtype when the source stored it quantized)."""
    if name in writer.carried:
        for stored in ckpt.encodings[name].parts.values():
            shards.add(stored, ckpt.read_stored(stored))
    elif name in plain:
        shards.add(name, _from_linear(adapter, name, plain[name].codes))
    else:
        tensor = kept[name] if name in kept else ckpt.get(name)
        if name in ckpt.encodings:  # the source stored it quantized: kept tensors are written dense
            tensor = tensor.to(model_dtype(ckpt.config))
        shards.add(name, tensor)


def model_dtype(config: dict) -> torch.dtype:
    """The model's dense dtype from config.json (`dtype` / `torch_dtype`), bfloat16 when unsaid."""
    name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16").replace("torch.", "")
    return {"float16": torch.float16, "float32": torch.float32}.get(name, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Inputs


def _resolve(quantized: Mapping, ckpt, adapter) -> dict[str, QuantizedTensor]:
    """Keys → on-disk names; per-expert tuples of fused architectures are stacked per tensor."""
    out: dict[str, QuantizedTensor] = {}
    fused_parts: dict[str, dict[tuple[int, str], QuantizedTensor]] = defaultdict(dict)
    for key, q in quantized.items():
        if not isinstance(q, QuantizedTensor):
            raise UserError(f"quantized[{key!r}] is a {type(q).__name__}, not a QuantizedTensor.")
        if isinstance(key, tuple):
            if len(key) != 3:
                raise UserError(f"quantized key {key!r} must be a tensor name or (layer, expert, proj).")
            layer, expert, proj = key
            adapter._check_expert(layer, expert, proj)
            name = adapter.expert_tensor_name(layer, expert, proj)
            if adapter.fused_experts:
                fused_parts[name][(expert, proj)] = q
                continue
        else:
            name = key
        if name not in ckpt:
            raise UserError(f"quantized tensor {name!r} is not a tensor of {ckpt.path}.")
        if name in out:
            raise UserError(f"tensor {name!r} is given twice in the quantized mapping.")
        expected = _linear_shape(adapter, name, ckpt.shape(name))
        if tuple(q.shape) != expected:
            raise UserError(
                f"quantized tensor {name!r} has shape {list(q.shape)}, but the checkpoint's weight is "
                f"{list(expected)} (in the [out, in] convention)."
            )
        out[name] = q
    for name, parts in fused_parts.items():
        if name in out:
            raise UserError(f"tensor {name!r} is given both whole and per expert.")
        out[name] = _fuse_experts(adapter, name, parts, ckpt.shape(name))
    return out


def _linear_shape(adapter, name: str, disk_shape) -> tuple:
    """[out, in] (or [E, out, in]) shape of an on-disk weight: fused gpt-oss tensors are [E, in, out]."""
    if adapter.fused_experts and len(disk_shape) == 3:
        return (disk_shape[0], disk_shape[2], disk_shape[1])
    return tuple(disk_shape)


def _from_linear(adapter, name: str, weight: torch.Tensor) -> torch.Tensor:
    """Inverse of _linear_shape for a dense tensor."""
    if adapter.fused_experts and weight.dim() == 3:
        return weight.transpose(1, 2).contiguous()
    return weight


def _fuse_experts(adapter, name: str, parts: dict, disk_shape) -> QuantizedTensor:
    """Per-expert gpt-oss pieces → one [E, out, in] QuantizedTensor, gate / up rows interleaved."""
    E = adapter.num_experts
    projs = ("down",) if name.endswith("down_proj") else ("gate", "up")
    missing = [(e, p) for e in range(E) for p in projs if (e, p) not in parts]
    if missing:
        raise UserError(
            f"{name} is fused on disk: every expert's {'/'.join(projs)} must be given; missing "
            f"(expert, proj) {missing[0]} and {len(missing) - 1} more."
        )
    specs = {q.spec for q in parts.values()}
    if len(specs) > 1:
        raise UserError(f"{name} is fused on disk and holds one format; got {', '.join(sorted(s.key for s in specs))}.")
    if projs == ("down",):
        return formats.stack_experts([parts[(e, "down")] for e in range(E)])
    per_expert = []
    for e in range(E):
        g, u = parts[(e, "gate")], parts[(e, "up")]
        per_expert.append(
            QuantizedTensor(
                g.spec,
                (2 * g.shape[0], g.shape[1]),
                _interleave(g.codes, u.codes),
                _interleave(g.scales, u.scales),
                _interleave(g.zeros, u.zeros),
                g.global_scale,
            )
        )
    q = formats.stack_experts(per_expert)
    expected = _linear_shape(adapter, name, disk_shape)
    if tuple(q.shape) != expected:
        raise UserError(f"experts of {name} stack to {list(q.shape)}, expected {list(expected)}.")
    return q


def _interleave(a, b):
    if a is None:
        return None
    if a.shape[0] == 1 and a.dim() >= 1 and b.shape[0] == 1:  # per-tensor scale: cannot interleave
        raise UserError("gate and up of a fused gpt-oss expert cannot have per-tensor scales.")
    out = torch.empty((a.shape[0] * 2,) + tuple(a.shape[1:]), dtype=a.dtype)
    out[0::2], out[1::2] = a, b
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


def _module(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _layer_of_experts(roles, name):
    r = roles.get(name)
    return r.layer if r is not None and r.role == "routed_expert" else None


# ---------------------------------------------------------------------------------------------
# Layout writers: check() refuses, pack() gives the tensors of one weight, then the config.


class _Layout:
    """One export layout: registered in LAYOUTS by `name`, the only place that lists them."""

    name = ""
    recipe_name = ""  # what a recipe's export.format calls it, when not `name`
    symmetric_zeros = False  # stores zero points for symmetric formats too (the byte account counts them)
    routed_only = False  # quantizes routed experts only

    @staticmethod
    def refuses(spec, target: str) -> str | None:
        """What the layout holds, when it cannot hold `spec` for `target` (None: it can)."""
        return None

    @staticmethod
    def plain_nbytes(role: str, shape, export, element_size: int = 2) -> int:
        """Bytes the layout writes a tensor in that it leaves unquantized (kept, or planned bf16), `export`
        being the recipe's export section: the plan's byte account asks this. Kept tensors are copied
        as they are stored: `element_size` bytes per element (DeepSeek-V3's F32 routers: 4)."""
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
        self.target, self.int8_activations = target, int8_activations
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
            what = self.refuses(q.spec, self.target)
            if what:
                raise UserError(f"the {self.name} layout holds {what}; tensor {name} is planned as {q.spec.key}.")

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
            if self.roles[name].role in _NOT_LINEAR_ROLES:
                continue
            out.append(_module(name))
        return out

    def _one_format_per_moe_layer(self) -> None:
        per_layer: dict[int, set] = defaultdict(set)
        for name in self.ckpt.keys():
            layer = _layer_of_experts(self.roles, name)
            if layer is None or not name.endswith("weight"):
                continue
            q = self.items.get(name)
            per_layer[layer].add(self._scheme_key(q) if q is not None else "bf16")
        for layer, keys in sorted(per_layer.items()):
            if len(keys) > 1:
                raise UserError(
                    f"target {self.target} needs one format for all routed experts of an MoE layer, but layer {layer} "
                    f"has {', '.join(sorted(keys))}; use target transformers for per-expert mixes."
                )

    def _one_format_per_fused_group(self) -> None:
        groups: dict[tuple, dict[str, str]] = defaultdict(dict)
        for name in self.ckpt.keys():
            if not name.endswith(".weight") or self.roles[name].role in _NOT_LINEAR_ROLES:
                continue
            parent, _, leaf = _module(name).rpartition(".")
            for i, siblings in enumerate(_FUSED_SIBLINGS):
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

    def _scheme_key(self, q) -> str:
        return q.spec.key


# ---- compressed-tensors -----------------------------------------------------------------------

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


class _CompressedTensors(_Layout):
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
        module = _module(name)
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
            by_scheme[self._scheme_key(q)].append(_module(name))
        return [(json.loads(k), sorted(v)) for k, v in sorted(by_scheme.items())]

    def quantization_config(self) -> dict:
        config_groups = {}
        group_formats = set()
        groups = self.groups()
        routed = {_module(n) for n, q in self.items.items() if self.roles[n].role == "routed_expert"}
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


# ---- GPTQ v1 --------------------------------------------------------------------------------------


def _gptq_group(spec) -> int:
    return -1 if spec.granularity == "channel" else spec.group_size


class _Gptq(_Layout):
    name = "gptq"
    symmetric_zeros = True

    @staticmethod
    def refuses(spec, target):
        if not (spec.is_int and spec.symmetric and spec.bits in (4, 8)):
            return "symmetric int4 / int8 only (GPTQ v1 as vLLM and GPTQModel read it)"
        return None

    def check(self) -> None:
        self._require_unfused()
        self._refuse_formats()
        if not self.items:
            raise UserError("the gptq layout needs at least one quantized tensor.")
        if self.target in ("vllm", "vllm-cuda", "sglang"):
            self._one_format_per_moe_layer()
            self._one_format_per_fused_group()
        counts = Counter((q.spec.bits, _gptq_group(q.spec)) for q in self.items.values())
        self.base_bits, self.base_group = counts.most_common(1)[0][0]

    def pack(self, name, q):
        module = _module(name)
        return {f"{module}.{k}": v for k, v in formats.pack_gptq(q, version=1).items()}

    def _dynamic(self) -> dict:
        dynamic = {}
        overrides: dict[tuple, list[str]] = defaultdict(list)
        for name, q in sorted(self.items.items()):
            key = (q.spec.bits, _gptq_group(q.spec))
            if key != (self.base_bits, self.base_group):
                overrides[key].append(_module(name))
        for (bits, group), modules in sorted(overrides.items()):
            for pattern in _module_patterns(modules, self._all_modules()):
                dynamic["+:" + pattern] = {"bits": bits, "group_size": group}
        for pattern in _module_patterns(self._linear_modules_kept(), self._all_modules()):
            dynamic["-:" + pattern] = {}
        return dynamic

    def _all_modules(self) -> set[str]:
        return {_module(n) for n in self.ckpt.keys() if n.endswith(".weight")}

    def _base(self) -> dict:
        # true_sequential False: down_proj's Hessian comes from the unquantized gate/up activations
        # (true-sequential within a layer was measured and dropped: bench_quality, 2026-12-02)
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


# ---- AWQ GEMM ----------------------------------------------------------------------------------------


class _Awq(_Layout):
    name = "awq"
    symmetric_zeros = True

    @staticmethod
    def refuses(spec, target):
        return None if spec.name == "int4" and spec.granularity == "group" else "int4 with groups only (AutoAWQ GEMM)"

    def check(self) -> None:
        self._require_unfused()
        self._refuse_formats()
        if not self.items:
            raise UserError("the awq layout needs at least one quantized tensor.")
        specs = {(q.spec.group_size, q.spec.symmetric) for q in self.items.values()}
        if len(specs) > 1:
            raise UserError(
                f"the awq layout holds one group size and one zero-point mode for the whole model; "
                f"the plan has {len(specs)} int4 variants ({', '.join(sorted({q.spec.key for q in self.items.values()}))})."
            )
        self.group, self.symmetric = specs.pop()

    def pack(self, name, q):
        module = _module(name)
        return {f"{module}.{k}": v for k, v in formats.pack_awq(q).items()}

    def quantization_config(self) -> dict:
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": self.group,
            "zero_point": not self.symmetric,
            "version": "gemm",
            "modules_to_not_convert": sorted(self._linear_modules_kept()),
        }


# ---- DeepSeek FP8 block ------------------------------------------------------------------------------


class _DeepseekFp8(_Layout):
    name = "deepseek-fp8"
    recipe_name = "fp8-block"

    @staticmethod
    def refuses(spec, target):
        return None if spec.key == "fp8-block128" else "fp8-block128 only (DeepSeek-V3's FP8 layout)"

    def check(self) -> None:
        self._require_unfused()
        self._refuse_formats()

    def carries(self, encoding) -> bool:
        return encoding.layout == "deepseek-fp8"

    def pack(self, name, q):
        module = _module(name)
        return {f"{module}.{k}": v for k, v in formats.pack_deepseek_fp8(q).items()}

    def quantization_config(self) -> dict:
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": sorted(self._linear_modules_kept()),
        }


# ---- gpt-oss MXFP4 -----------------------------------------------------------------------------------


class _GptOssMxfp4(_Layout):
    name = "gpt-oss-mxfp4"
    routed_only = True

    @staticmethod
    def refuses(spec, target):
        return None if spec.name == "mxfp4" else "mxfp4 only (gpt-oss's own layout)"

    @classmethod
    def refuses_model(cls, adapter):
        if adapter.model_type != "gpt_oss":
            return f"the gpt-oss-mxfp4 layout is gpt-oss's own; this checkpoint is {adapter.model_type}"
        return None

    def check(self) -> None:
        if self.adapter.model_type != "gpt_oss":
            raise UserError(f"the gpt-oss-mxfp4 layout is gpt-oss's own; this checkpoint is {self.adapter.model_type}.")
        self._refuse_formats()
        for name in self.items:
            if self.roles[name].role != "routed_expert":
                raise UserError(
                    f"the gpt-oss-mxfp4 layout quantizes routed experts only; {name} is {self.roles[name].role}."
                )
        for layer in self.adapter.moe_layers:
            for name in (self.adapter.fused_names(layer)[k] for k in ("gate_up", "down")):
                if name not in self.items:
                    raise UserError(
                        f"the gpt-oss-mxfp4 layout (as transformers and vLLM read it) needs every "
                        f"expert in mxfp4; {name} is planned as bf16."
                    )

    def pack(self, name, q):
        packed = formats.pack_gpt_oss_mxfp4(q)
        return {f"{name}_blocks": packed["blocks"], f"{name}_scales": packed["scales"]}

    def quantization_config(self) -> dict:
        # gpt-oss's own spelling: everything but the experts stays in bf16
        return {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        }


# ---- GGUF (llama.cpp) ----------------------------------------------------------------------------


class _Gguf(_Layout):
    """One file in llama.cpp's names and block layouts, written by moequant.export.gguf: its plain tensors
    as gguf.plain_type stores them (F32 norms, biases and routers), tied embeddings again as output.weight."""

    name = "gguf"

    @staticmethod
    def plain_nbytes(role, shape, export, element_size=2):
        from moequant.export.gguf import plain_nbytes  # GGUF chooses its own float types

        return plain_nbytes(role, shape, export.gguf_float, export.gguf_types)

    @staticmethod
    def kept_reason(model_type, name):
        from moequant.export.gguf import reshaped_reason

        return reshaped_reason(model_type, name)

    @staticmethod
    def written_shapes(config, name, shape):
        from moequant.export.gguf import written_shapes  # deepseek2's kv_b_proj: attn_k_b and attn_v_b

        return [(n, s) for n, s in written_shapes(config, name, shape) if len(s) == 2] or [(name, tuple(shape))]

    @staticmethod
    def copied_tensors(names):
        from moequant.export.gguf import tied_output

        source = tied_output(names)
        return [("output.weight", "lm_head", source)] if source else []

    @staticmethod
    def refuses(spec, target):
        from moequant.export.gguf import stores_natively

        return None if stores_natively(spec) else "ggml block types (q8_0 ... q2_k, iq4_xs ... iq2_xxs), MXFP4 or bf16"

    @classmethod
    def refuses_model(cls, adapter):
        from moequant.export.gguf import ARCHS

        if adapter.model_type not in ARCHS:
            return f"the gguf layout writes {', '.join(ARCHS)}, not {adapter.model_type}"
        return None


LAYOUTS = {layout.name: layout for layout in (_CompressedTensors, _Gptq, _Awq, _DeepseekFp8, _GptOssMxfp4, _Gguf)}
RECIPE_LAYOUTS = {layout.recipe_name or name: layout for name, layout in LAYOUTS.items()}  # recipe export.format


def layout_for(export_format: str) -> type[_Layout]:
    """The layout a recipe's `export.format` names (a layout's own name is accepted too)."""
    layout = RECIPE_LAYOUTS.get(export_format) or LAYOUTS.get(export_format)
    if layout is None:
        raise UserError(f"export layout {export_format!r} is not supported; accepted: {', '.join(RECIPE_LAYOUTS)}.")
    return layout


def sglang_per_layer_block(names) -> str | None:
    """Why SGLang cannot resolve routed-expert schemes per layer for these on-disk expert tensor names."""
    leaves = {n.rsplit(".", 2)[-2] if n.endswith(".weight") else n.rsplit(".", 1)[-1] for n in names}
    if leaves <= SGLANG_EXPERT_NAMES:
        return None
    return (
        f"SGLang resolves a layer's scheme from its expert 0's gate_proj / up_proj / down_proj, and this "
        f"model's experts are {', '.join(sorted(leaves - SGLANG_EXPERT_NAMES))}"
    )


def _target_refusal(layout: str, target: str) -> str | None:
    if target == "vllm-moequant" and layout != "compressed-tensors":
        return (
            f"target vllm-moequant (moequant's vLLM plugin) reads the compressed-tensors layout, not {layout}; "
            "set export.format compressed-tensors"
        )
    return None


def layout_refusal(layout: str, spec, target: str, adapter, routed: bool = True) -> str | None:
    """Why `layout` cannot write a tensor in `spec` (a routed expert's, or another's) of this model for
    `target`, decided from the format and the architecture alone, so before any work (None: it can).
    The same rules as the layouts' own check() on a finished plan."""
    why = _target_refusal(layout, target)
    if why:
        return why
    if layout not in LAYOUTS:
        return f"export layout {layout!r} is not supported; accepted: {', '.join(LAYOUTS)}"
    writer = LAYOUTS[layout]
    why = writer.refuses_model(adapter)
    if why:
        return why
    if not spec.quantized:
        return None
    if writer.routed_only and not routed:
        return f"the {layout} layout quantizes routed experts only, not {spec.key} non-expert tensors"
    what = writer.refuses(spec, target)
    return f"the {layout} layout holds {what}, not {spec.key}" if what else None
