"""GGUF files for llama.cpp / Ollama / LM Studio: `export: {format: gguf}` -> checkpoint/model.gguf.

    export_gguf(ckpt, adapter, items, out_dir, float_type="bf16")

`items` maps on-disk tensor names to QuantizedTensors (as `export_checkpoint` resolves them);
what llama.cpp's graphs hold, the tensor names and types and the packed blocks are the gguf layout's
(moequant.layouts.gguf); this module writes the file: the checks llama.cpp needs before any work,
the metadata, the tokenizer (a byte-level BPE with GPT-2's pre-tokenizer, as the bundled models have,
or Qwen2 / Qwen3's: `tokenizer_pre`) as `tokenizer.ggml.*`: tokens by id, merges, token types (added
special tokens are control tokens), bos / eos / padding ids and add_bos = whether the HF
post-processor adds one, and the tensors in llama.cpp's order. Not written yet: DeepSeek-V3's and
gpt-oss's own pre-tokenizers (refused, one sentence), a multimodal checkpoint's vision tower (llama.cpp reads it
from a separate mmproj file: the file holds the text model). Anything llama.cpp could not run as planned is
a UserError before anything is written. The file is written in a temporary sibling directory and
renamed; tensors are read and packed layer by layer as gguf-py writes them (only the one being
written is in memory). Also here: the GGUF byte account (`gguf_bytes`) and llama.cpp's imatrix
(`write_imatrix`).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from moequant.errors import UserError
from moequant.formats import check_shape, get_format
from moequant.io.checkpoint import EXPORT_INFO, atomic_directory
from moequant.layouts.gguf import (
    FLOAT_TYPES,
    GGUF_FILE,
    ggml_type,
    packed_blocks,
    plain_array,
    plain_type,
    reordered_rows,
    stores_natively,
    tied_output,
)
from moequant.layouts.gguf_graphs import (
    GRAPHS,
    gguf_targets,
    graph_config,
    model_refusal,
    outside_text_model,
    prediction_layer,
    reshaped_reason,
    written_shapes,
)
from moequant.layouts.gguf_metadata import add_common_metadata
from moequant.layouts.gguf_transforms import SPLITS


def check_gguf(ckpt, adapter, items: dict) -> None:
    """Refuse, before any work, what llama.cpp could not run as planned."""
    mt = adapter.model_type
    why = model_refusal(adapter, ckpt.config)
    if why:
        raise UserError(f"{why}; it cannot be exported to GGUF as is.")
    c = graph_config(adapter, ckpt.config)
    if c.get("sliding_window") and c.get("use_sliding_window"):
        raise UserError("GGUF export does not write sliding-window attention; config.json enables use_sliding_window.")
    tokenizer_pre(ckpt.directory)
    expert_names = _expert_names(adapter)
    for name, q in items.items():
        role = adapter.classify(name)
        if q.spec.quantized and not (q.spec.is_ggml or (stores_natively(q.spec) and name in expert_names)):
            raise UserError(
                f"the gguf layout holds ggml block types (q8_0 ... q2_k), MXFP4 routed experts or bf16; "
                f"tensor {name} is planned as {q.spec.key} (use target llama.cpp)."
            )
        if q.spec.quantized and (role.role in ("router", "shared_expert_gate", "norm") or len(q.shape) < 2):
            raise UserError(f"tensor {name} ({role.role}) stays unquantized in GGUF; it is planned as {q.spec.key}.")
        if q.spec.quantized and name not in expert_names:
            if reshaped_reason(mt, name):
                raise UserError(f"{reshaped_reason(mt, name)}; tensor {name} is planned as {q.spec.key} (keep it).")
            for out, shape in written_shapes(c, name, q.shape):
                check_shape(q.spec, shape, f"{out} (of {name})")
    for layer in adapter.moe_layers:
        for proj in adapter.projections:
            if adapter.fused_experts:
                q = items.get(adapter.expert_tensor_name(layer, 0, proj))
                keys = {q.spec.key if q is not None else "bf16"}
            else:
                keys = {
                    items[n].spec.key if n in items else "bf16"
                    for n in (adapter.expert_tensor_name(layer, e, proj) for e in range(adapter.num_experts))
                }
            if len(keys) > 1:
                raise UserError(
                    f"GGUF stacks the experts of a layer per projection into one tensor of one ggml type, but "
                    f"layer {layer} {proj} has {', '.join(sorted(keys))}; plan with target llama.cpp."
                )


def _expert_names(adapter) -> set:
    return {
        adapter.expert_tensor_name(L, e, p)
        for L in adapter.moe_layers
        for e in range(adapter.num_experts)
        for p in adapter.projections
    }


def _tokenizer_json(directory) -> dict:
    path = Path(directory) / "tokenizer.json"
    if not path.exists():
        raise UserError(f"GGUF export needs the tokenizer: {path} is missing.")
    return json.loads(path.read_text())


# Pre-tokenizers llama.cpp knows (src/llama-vocab.cpp), by the split regex of tokenizer.json's
# Sequence[Split(Isolated), ByteLevel(use_regex false)]: Qwen2 / Qwen2.5 / Qwen3 (and their MoEs).
_SPLIT_PRES = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
}
_NORMALIZERS_IGNORED = ({"type": "NFC"},)  # Qwen's; llama.cpp does not normalise (as its own converter writes it)


def tokenizer_pre(directory) -> str:
    """llama.cpp's tokenizer.ggml.pre for this tokenizer.json (a byte-level BPE), or a UserError."""
    tok = _tokenizer_json(directory)
    model = tok.get("model", {})
    pre = tok.get("pre_tokenizer") or {}
    norm = tok.get("normalizer")
    name = None
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space") and not norm:
        name = "gpt-2"
    parts = pre.get("pretokenizers") or []
    if (
        pre.get("type") == "Sequence"
        and len(parts) == 2
        and parts[0].get("type") == "Split"
        and parts[0].get("behavior") == "Isolated"
        and not parts[0].get("invert")
        and parts[1].get("type") == "ByteLevel"
        and not parts[1].get("use_regex", True)
        and not parts[1].get("add_prefix_space")
        and (norm is None or norm in _NORMALIZERS_IGNORED)
    ):
        name = _SPLIT_PRES.get((parts[0].get("pattern") or {}).get("Regex"))
    if model.get("type") != "BPE" or name is None:
        raise UserError(
            f"GGUF export writes byte-level BPE tokenizers with GPT-2's or Qwen2's pre-tokenizer; "
            f"{directory}/tokenizer.json has model {model.get('type')!r} with pre-tokenizer "
            f"{pre.get('type')!r}{' and a normalizer' if norm else ''}."
        )
    return name


def add_tokenizer(writer, directory) -> None:
    import gguf

    tok = _tokenizer_json(directory)
    vocab = tok["model"]["vocab"]
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    n = max(max(vocab.values()), max(added, default=-1)) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [gguf.TokenType.UNUSED] * n
    for text, i in vocab.items():
        tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for i, a in added.items():
        tokens[i] = a["content"]
        types[i] = gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer_pre(directory))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    cfg_path = Path(directory) / "tokenizer_config.json"
    tcfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    ids = {a["content"]: i for i, a in added.items()}
    ids.update({t: i for t, i in vocab.items() if t not in ids})

    def token_id(key):
        t = tcfg.get(key)
        t = t.get("content") if isinstance(t, dict) else t
        return ids.get(t)

    for key, add in (
        ("bos_token", writer.add_bos_token_id),
        ("eos_token", writer.add_eos_token_id),
        ("pad_token", writer.add_pad_token_id),
    ):
        if token_id(key) is not None:
            add(token_id(key))
    single = (tok.get("post_processor") or {}).get("single") or []  # a template that starts with a special token
    writer.add_add_bos_token(bool(single) and "SpecialToken" in single[0])
    writer.add_add_eos_token(False)


_FTYPES = {
    "q4_0": 2,
    "q4_1": 3,
    "q8_0": 7,
    "q5_0": 8,
    "q5_1": 9,
    "q2_k": 10,
    "q3_k": 12,
    "q4_k": 15,
    "q5_k": 17,
    "q6_k": 18,
    "iq2_xxs": 19,
    "iq2_xs": 20,
    "iq3_xxs": 23,
    "iq3_s": 26,
    "iq2_s": 28,
    "iq4_xs": 30,
    "mxfp4": 38,
}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*


def _file_type(items: dict, float_type: str) -> int:
    """general.file_type: the most common stored type among the weights (llama.cpp's LLAMA_FTYPE)."""
    from collections import Counter

    counts = Counter()
    for q in items.values():
        if q.spec.quantized:
            counts[q.spec.name] += int(np.prod(q.shape))
    if counts:
        return _FTYPES[counts.most_common(1)[0][0]]
    return {"f32": 0, "f16": 1, "bf16": 32}[float_type]


class _Lazy:
    """A tensor gguf-py writes when its turn comes: shape / dtype / nbytes known ahead, data made in tofile()."""

    def __init__(self, shape, dtype, nbytes: int, make: Callable):
        self.shape, self.dtype, self.nbytes, self._make = tuple(shape), np.dtype(dtype), int(nbytes), make

    def tofile(self, fp) -> None:
        arr = np.ascontiguousarray(self._make())
        if arr.nbytes != self.nbytes or arr.dtype != self.dtype:
            raise RuntimeError(
                f"GGUF tensor data ({arr.dtype}, {arr.nbytes} bytes) differs from its header "
                f"({self.dtype}, {self.nbytes} bytes)"
            )
        arr.tofile(fp)


def _plain_meta(shape, key: str):
    """(numpy shape, numpy dtype, raw ggml type or None) of a tensor of `shape` stored as plain_type `key`."""
    import gguf

    shape = tuple(int(s) for s in shape)
    if key == "f32":
        return shape, np.float32, None
    if key == "f16":
        return shape, np.float16, None
    if key in FLOAT_TYPES:
        return (*shape[:-1], 2 * shape[-1]), np.uint8, gguf.GGMLQuantizationType.BF16
    from moequant.formats import nbytes

    spec = get_format(key)
    return (*shape[:-1], nbytes(key, (1, shape[-1]))), np.uint8, ggml_type(spec)


def export_gguf(
    ckpt,
    adapter,
    items: dict,
    out_dir,
    *,
    kept: dict | None = None,
    float_type: str = "bf16",
    info: dict | None = None,
    max_shard_bytes: int = 0,
    types: dict | None = None,
) -> Path:
    """Write out_dir/model.gguf (split as llama.cpp names splits when max_shard_bytes > 0 and exceeded)."""
    import gguf

    if float_type not in FLOAT_TYPES:
        raise UserError(f"gguf float type {float_type!r} is not supported; accepted: {', '.join(FLOAT_TYPES)}.")
    check_gguf(ckpt, adapter, items)
    types = {k: v for k, v in (types or {}).items() if v}  # GGUF name -> ggml type, e.g. output.weight: q6_k
    unknown = sorted(set(types) - {"token_embd.weight", "output.weight"})
    if unknown:
        raise UserError(f"gguf types can be set for token_embd.weight and output.weight, not {unknown[0]}.")
    for t in types.values():
        get_format(t)
    kept = kept or {}
    read = lambda n: kept[n] if n in kept else ckpt.get(n)  # noqa: E731
    mt = adapter.model_type
    graph = GRAPHS[mt]
    c = graph_config(adapter, ckpt.config)
    expert_names = _expert_names(adapter)
    plan_of = {}  # GGUF name -> (HF name, transform)
    for name in ckpt.keys():
        if name in expert_names or prediction_layer(c, name):  # a multi-token-prediction layer: llama.cpp's --no-mtp
            continue
        targets = gguf_targets(mt, name)
        if not targets and outside_text_model(adapter, c, name):  # the vision tower: llama.cpp's mmproj file
            continue
        if not targets:
            raise UserError(f"tensor {name} of {ckpt.path} has no GGUF counterpart in llama.cpp's {graph.arch} graph.")
        for target, fn in targets:
            plan_of[target] = (name, fn)
    copied = tied_output(ckpt.keys())
    if copied:
        plan_of["output.weight"] = (copied, None)

    def plain_key(hf_name, out_name, ndim):
        if out_name.endswith(".bias"):  # gpt-oss's expert biases are 2-D; ggml adds biases in F32 only
            return "f32"
        role = "lm_head" if out_name == "output.weight" else adapter.classify(hf_name).role
        return plain_type(role, ndim, float_type, types, [out_name])

    def tensor_for(out_name: str) -> _Lazy:
        hf_name, fn = plan_of[out_name]
        q = items.get(hf_name) if out_name != "output.weight" or hf_name == "lm_head.weight" else None
        if q is not None and q.spec.quantized and fn in SPLITS:
            return _split(q, fn, lambda: read(hf_name), out_name)
        if q is not None and q.spec.quantized:  # packed blocks, one-to-one or rows reordered (check_gguf)
            arr, raw = packed_blocks(q if fn is None else reordered_rows(q, fn(torch.arange(q.shape[0]), c)))
            return _Lazy(arr.shape, arr.dtype, arr.nbytes, lambda: arr), raw
        source = (lambda: q.codes) if q is not None else (lambda: read(hf_name))
        shape = tuple(ckpt.shape(hf_name)) if q is None else tuple(q.shape)
        if fn is not None:
            shape = tuple(fn(torch.empty(shape, device="meta"), c).shape)
        key = plain_key(hf_name, out_name, len(shape))
        np_shape, dtype, raw = _plain_meta(shape, key)

        def make():
            t = source()
            t = fn(t, c) if fn is not None else t
            return plain_array(t, key, out_name)[0]

        return _Lazy(np_shape, dtype, np.dtype(dtype).itemsize * math.prod(np_shape), make), raw

    def _split(q, fn, original, out_name):
        """One part of a tensor llama.cpp's graph splits (kv_b_proj -> attn_k_b / attn_v_b) in q's type: rows
        the part keeps along the same axis are q's own packed rows (its codes, GPTQ's where it ran); a
        transposed part (attn_k_b) is quantized here from the original weights along its new rows (no
        statistics of its input, q_nope, exist: the type's own scale search)."""
        rows = fn(torch.arange(q.shape[0]).unsqueeze(-1), c)
        if rows.shape[-1] == 1:  # rows of q, reordered: [..., rows, 1] of row indices
            order = rows[..., 0]
            arr = q.codes[order.reshape(-1)].cpu().reshape(*order.shape, q.codes.shape[-1]).contiguous().numpy()
            return _Lazy(arr.shape, arr.dtype, arr.nbytes, lambda: arr), ggml_type(q.spec)
        shape = tuple(fn(torch.empty(tuple(q.shape), device="meta"), c).shape)
        np_shape, dtype, raw = _plain_meta(shape, q.spec.key)
        return _Lazy(
            np_shape,
            dtype,
            np.dtype(dtype).itemsize * math.prod(np_shape),
            lambda: plain_array(fn(original(), c), q.spec.key, out_name)[0],
        ), raw

    class _Source:  # the checkpoint as adapters read it, kept tensors first
        def get(self, n, device=None):  # read_experts passes a device; GGUF is written from the host
            return read(n)

        def get_slice(self, n):
            return read(n)

    def stored(hf_name):
        """The source's own codes of a tensor nobody replaces, when GGUF stores its format as it is (gpt-oss's
        MXFP4 experts): written as they are, never dequantized and requantized."""
        enc = ckpt.encodings.get(hf_name)
        if enc is None or hf_name in kept or hf_name in items or not stores_natively(enc.spec):
            return None
        from moequant.io import dequant

        dequant.decode(enc, ckpt.read_stored)  # its scales checked and its values finite, or one sentence
        return dequant.quantized_tensor(enc, {role: ckpt.read_stored(n) for role, n in enc.parts.items()})

    def experts_for(layer: int, proj: str) -> tuple[_Lazy, object]:
        name = f"blk.{layer}.ffn_{proj}_exps.weight"
        if adapter.fused_experts:  # gpt-oss: gate / up interleaved rows of one [E, 2I, H] tensor
            fused = adapter.expert_tensor_name(layer, 0, proj)
            q = items.get(fused) or stored(fused)
            rows = slice(None) if proj == "down" else slice(0 if proj == "gate" else 1, None, 2)
            if q is not None and q.spec.quantized:
                arr, raw = packed_blocks(q, rows)
                return _Lazy(arr.shape, arr.dtype, arr.nbytes, lambda: arr), raw
            make_stacked = (
                (lambda: q.codes[:, rows]) if q is not None else (lambda: adapter.read_experts(_Source(), layer, proj))
            )
        else:
            names = [adapter.expert_tensor_name(layer, e, proj) for e in range(adapter.num_experts)]
            if names[0] in items and items[names[0]].spec.quantized:
                stacked = torch.stack([items[n].codes.cpu() for n in names]) if items[names[0]].spec.is_ggml else None
                if stacked is not None:
                    arr = stacked.numpy()
                else:
                    from moequant.formats import stack_experts

                    arr, _ = packed_blocks(stack_experts([items[n] for n in names]))
                return _Lazy(arr.shape, arr.dtype, arr.nbytes, lambda: arr), ggml_type(items[names[0]].spec)
            make_stacked = lambda: torch.stack([items[n].codes if n in items else read(n) for n in names])  # noqa: E731
        shape = (adapter.num_experts, *adapter.expert_shape(proj))
        key = plain_type("routed_expert", 3, float_type, types)
        np_shape, dtype, raw = _plain_meta(shape, key)
        return _Lazy(
            np_shape,
            dtype,
            np.dtype(dtype).itemsize * math.prod(np_shape),
            lambda: plain_array(make_stacked(), key, name)[0],
        ), raw

    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        writer = gguf.GGUFWriter(str(tmp / GGUF_FILE), graph.arch, split_max_size=max_shard_bytes)
        add_common_metadata(writer, adapter, c)
        graph.hparams(writer, adapter, c)
        writer.add_file_type(_file_type(items, float_type))
        writer.add_quantization_version(2)
        add_tokenizer(writer, ckpt.directory)
        order = [t for t in ("token_embd.weight", "output_norm.weight", "output.weight") if t in plan_of]
        order += sorted(t for t in plan_of if not t.startswith("blk.") and t not in order)  # output_norm.bias ...
        extra = {n: t.numpy() for n, t in (graph.extra(c) if graph.extra else {}).items()}  # Gemma-4's rope_freqs
        order += sorted(extra)
        for L in range(adapter.num_layers):
            order += sorted(t for t in plan_of if t.startswith(f"blk.{L}."))
            if L in adapter.moe_layers:
                order += [f"blk.{L}.ffn_{p}_exps.weight" for p in adapter.projections]
        for target in order:
            m = re.fullmatch(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight", target)
            if target in extra:
                arr = extra[target]
                lazy, raw = _Lazy(arr.shape, arr.dtype, arr.nbytes, lambda arr=arr: arr), None
            else:
                lazy, raw = experts_for(int(m[1]), m[2]) if m and target not in plan_of else tensor_for(target)
            writer.add_tensor_info(target, lazy.shape, lazy.dtype, lazy.nbytes, raw_dtype=raw)
            writer.tensors[-1][target].tensor = lazy  # written (made) in order by write_tensors_to_file
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        # the model's config.json (its source quantization left out: the file says how it is stored), which
        # moequant.load builds the transformers model from when it reads this file back (io/loader.py)
        config = {k: v for k, v in ckpt.config.items() if k not in ("quantization_config", "moequant")}
        info = {**(info or {"layout": "gguf"}), "config": config}
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return out_dir


_ROLES = [
    (r"token_embd\.", "embedding"),
    (r"output\.", "lm_head"),
    (r".*norm\.", "norm"),
    (r".*ffn_gate_inp_shexp\.", "shared_expert_gate"),
    (r".*(ffn_gate_inp|exp_probs_b)\.", "router"),
    (r".*ffn_(gate|up|down)\.", "dense_mlp"),
    (r".*_shexp\.", "shared_expert"),
    (r".*_exps\.", "routed_expert"),
    (r".*attn_", "attention"),
]


def gguf_bytes(path) -> dict:
    """The byte account of a GGUF file as `plan.memory.checkpoint_bytes` gives it for safetensors:
    bytes by role, per (layer, expert) (a stacked tensor's bytes split evenly: one type per tensor)."""
    from collections import defaultdict

    import gguf

    reader = gguf.GGUFReader(str(path))
    n_expert = next((int(f.parts[-1][0]) for k, f in reader.fields.items() if k.endswith(".expert_count")), 1)
    by_role, weights, experts = defaultdict(int), defaultdict(int), defaultdict(int)
    for t in reader.tensors:
        role = next(r for p, r in _ROLES + [(r"", "other")] if re.match(p, t.name))
        by_role[role] += int(t.n_bytes)
        weights[role] += int(t.n_elements)
        if role == "routed_expert":
            layer = int(t.name.split(".")[1])
            for e in range(n_expert):
                experts[(layer, e)] += int(t.n_bytes) // n_expert
    return {
        "by_role": dict(by_role),
        "weights_by_role": dict(weights),
        "experts": dict(experts),
        "fused_experts": {},
        "total": sum(by_role.values()),
    }


def write_imatrix(stats_dir, out_path) -> Path:
    """llama.cpp's imatrix GGUF from our calibration statistics, for llama-quantize / llama_model_quantize.

    Per routed-expert tensor `blk.N.ffn_{gate,up,down}_exps.weight`: `<name>.in_sum2` {n_in, n_expert}
    = Σ x² over the expert's statistic tokens and `<name>.counts` {1, n_expert} = those tokens (with
    all-experts coverage every token, so every expert has data; llama-imatrix sees only the routed
    ones). qwen2moe's shared-expert gate / up take the same input: written from the all-token
    statistics when calibration ran with all-experts coverage.
    """
    import gguf

    from moequant.measure.stats import load_stats

    stats = load_stats(stats_dir, with_hessians=False)
    out_path = Path(out_path)
    if out_path.suffix != ".gguf":
        raise UserError(f"the imatrix file {out_path} must end in .gguf (llama.cpp's GGUF imatrix format).")
    entries = {}
    for L, ls in sorted(stats.layers.items()):
        for group, projs in (("gate_up", ("gate", "up")), ("down", ("down",))):
            sq, n = ls.tensors.get(f"input.{group}.sq_mean"), ls.tensors.get(f"input.{group}.tokens")
            if sq is None or n is None:
                raise UserError(
                    f"the statistics in {stats_dir} hold no input.{group}.sq_mean for layer {L}; "
                    f"calibrate again with this version."
                )
            sums = (sq.double() * n.double()[:, None]).float()
            for p in projs:
                entries[f"blk.{L}.ffn_{p}_exps.weight"] = (sums, n.float())
        if stats.summary.get("all_experts") and stats.summary.get("model_type") == "qwen2_moe":
            sums, n = entries[f"blk.{L}.ffn_gate_exps.weight"]
            for p in ("gate", "up"):
                entries[f"blk.{L}.ffn_{p}_shexp.weight"] = (sums[:1], n[:1])
    dataset = stats.summary.get("fingerprint", {}).get("dataset", "moequant")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    writer = gguf.GGUFWriter(str(tmp), "imatrix")
    writer.add_type("imatrix")
    writer.add_array("imatrix.datasets", [str(dataset)])
    tokens = max(int(ls.tokens) for ls in stats.layers.values())
    writer.add_uint32("imatrix.chunk_count", 1)
    writer.add_uint32("imatrix.chunk_size", tokens)
    for name, (sums, n) in entries.items():
        writer.add_tensor(name + ".in_sum2", sums.numpy())  # numpy [E, n_in] = ggml {n_in, E}
        writer.add_tensor(name + ".counts", n.reshape(-1, 1).numpy())  # ggml {1, E}
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out_path)
    return out_path
