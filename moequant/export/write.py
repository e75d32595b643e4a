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

Layouts (moequant.layouts, one file each, found by name in its registry; each refuses, before any work,
a plan it cannot hold — one sentence, UserError): compressed-tensors (default), gptq, awq, deepseek-fp8,
gpt-oss-mxfp4, gguf. export_checkpoint writes any registered layout: safetensors shards in the layout's
tensors, with its quantization_config, or (the gguf layout's container) one GGUF file (moequant.export.gguf).

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
from collections import defaultdict
from pathlib import Path
from typing import Mapping

import torch

from moequant import formats
from moequant.arch import adapter_for
from moequant.errors import UserError
from moequant.formats import QuantizedTensor
from moequant.io.checkpoint import (
    EXPORT_INFO,
    atomic_directory,
    copy_aux_files,
    model_dtype,
    open_checkpoint,
)
from moequant.io.shards import ShardWriter
from moequant.layouts import LAYOUTS
from moequant.layouts.base import module_name
from moequant.layouts.compressed_tensors import transformers_stop
from moequant.targets import TARGETS, Target, get_target


def export_checkpoint(
    source_dir,
    quantized: Mapping,
    out_dir,
    *,
    kept: Mapping[str, torch.Tensor] | None = None,
    layout: str = "compressed-tensors",
    target="vllm",  # a registered target's name, or a moequant.targets.Target
    int8_activations: str = "none",
    max_shard_bytes: int = 2 * 1024**3,
    gguf_float: str = "bf16",
    gguf_types: Mapping[str, str] | None = None,
) -> Path:
    """Write `out_dir`: the source checkpoint with `quantized` tensors in `layout`. Returns the path."""
    check_export_options(layout, target, int8_activations)
    ckpt = open_checkpoint(source_dir)
    if ckpt.config_only:
        raise UserError(f"{source_dir} has no safetensors weights to export.")
    adapter = adapter_for(ckpt.config)
    quantized, kept = _split_replacements(quantized, kept, ckpt, source_dir)
    items = resolve_keys(quantized, ckpt, adapter)
    both = sorted(set(items) & set(kept))
    if both:
        raise UserError(f"tensor {both[0]!r} is given both quantized and kept; give it once.")
    # bf16 "quantized" tensors are written dense, read when written (their codes may still be on disk)
    plain = {n: q for n, q in items.items() if not q.spec.quantized}
    items = {n: q for n, q in items.items() if q.spec.quantized}

    options = dict(
        layout=layout,
        target=target,
        int8_activations=int8_activations,
        max_shard_bytes=max_shard_bytes,
        gguf_float=gguf_float,
        gguf_types=gguf_types,
    )
    return CONTAINERS[LAYOUTS[layout].container](ckpt, adapter, items, plain, kept, Path(out_dir), options)


def _export_safetensors(ckpt, adapter, items: dict, plain: dict, kept: dict, out_dir: Path, options: dict) -> Path:
    """Sharded safetensors in the layout's tensors, config.json with its quantization_config."""
    layout, target, int8_activations = options["layout"], options["target"], options["int8_activations"]
    writer = make_writer(ckpt, adapter, items, layout, target, int8_activations, excluded=set(kept) | set(plain))
    with atomic_directory(out_dir) as tmp:
        _write_shards(tmp, ckpt, adapter, writer, items, plain, kept, options["max_shard_bytes"])
        write_checkpoint_files(tmp, ckpt, writer)
    return out_dir


def _export_gguf(ckpt, adapter, items: dict, plain: dict, kept: dict, out_dir: Path, options: dict) -> Path:
    """One file in llama.cpp's names and block layouts (moequant.export.gguf)."""
    from moequant.export.gguf import export_gguf

    for n, q in plain.items():
        kept.setdefault(n, _from_linear(adapter, n, q.codes))
    formats_written = {n: q.spec.key for n, q in sorted(items.items())}
    info = {"layout": options["layout"], "target": options["target"], "formats": formats_written}
    return export_gguf(
        ckpt,
        adapter,
        {**items, **plain},
        out_dir,
        kept=kept,
        float_type=options["gguf_float"],
        info=info,
        types=options["gguf_types"],
    )


CONTAINERS = {"safetensors": _export_safetensors, "gguf": _export_gguf}  # by the layout's `container`


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
    qc = writer.quantization_config()
    if qc.get("quant_method") != "compressed-tensors" or qc.get("config_groups"):
        config["quantization_config"] = qc
    # else nothing was quantized (a pruned model kept in bf16): a plain checkpoint, since transformers' compressed-
    # tensors loader takes the experts' scheme from the first config group and fails on a config with none
    # a per-layer mix, or per-expert tensors of a family transformers reads fused: plain transformers refuses
    # it in one line (the latter until moequant.register_for_transformers ran)
    split = writer.adapter.transformers_split_modules()
    config = transformers_stop(
        config,
        experts_fused_on_disk=bool(getattr(writer.adapter, "experts_fused_on_disk", None)),
        split_quantized=any(module_name(n) in split for n in writer.items),
    )
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for fname, content in writer.extra_files().items():
        (tmp / fname).write_text(json.dumps(content, indent=2) + "\n")
    formats_written = {n: q.spec.key for n, q in sorted(writer.items.items())}
    info = {"layout": writer.name, "target": writer.target.name, "formats": formats_written}
    (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
    copy_aux_files(ckpt.directory, tmp)


def check_export_options(layout: str, target, int8_activations: str) -> None:
    """Refuse an unknown layout, target (a registered name, or a Target) or int8_activations, or a layout the
    target cannot load."""
    if layout not in LAYOUTS:
        raise UserError(f"export layout {layout!r} is not supported; accepted: {', '.join(LAYOUTS)}.")
    if not isinstance(target, Target) and target not in TARGETS:
        raise UserError(f"export target {target!r} is not supported; accepted: {', '.join(TARGETS)}.")
    why = get_target(target).check(layout=LAYOUTS[layout])
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


# ---------------------------------------------------------------------------------------------
# Inputs


def resolve_keys(quantized: Mapping, ckpt, adapter) -> dict[str, QuantizedTensor]:
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
        expected = linear_shape(adapter, name, ckpt.shape(name))
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


def linear_shape(adapter, name: str, disk_shape) -> tuple:
    """[out, in] (or [E, out, in]) shape of an on-disk weight: fused gpt-oss tensors are [E, in, out]."""
    if adapter.fused_experts and len(disk_shape) == 3:
        return (disk_shape[0], disk_shape[2], disk_shape[1])
    return tuple(disk_shape)


def _from_linear(adapter, name: str, weight: torch.Tensor) -> torch.Tensor:
    """Inverse of linear_shape for a dense tensor."""
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
    expected = linear_shape(adapter, name, disk_shape)
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
