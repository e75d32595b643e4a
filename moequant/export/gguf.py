"""GGUF export for llama.cpp / Ollama / LM Studio: `export: {format: gguf}` -> checkpoint/model.gguf.

    export_gguf(ckpt, adapter, items, out_dir, float_type="bf16")

`items` maps on-disk tensor names to QuantizedTensors (as `export_checkpoint` resolves them);
ggml-typed ones are written as their packed blocks, bf16 ones and everything else as `plain_type`
says: in `float_type` (bf16 | f16 | f32), but 1-D tensors (norms, biases) and the routers in F32,
as llama.cpp's own converter writes them, and token_embd / output in the ggml type `types` gives
them. The plan's byte account asks the same `plain_nbytes` (through the gguf layout), so it counts
what this file holds. Names and layouts are llama.cpp's:

- routed experts of layer N stacked per projection: `blk.N.ffn_{gate,up,down}_exps.weight`,
  ggml shape {n_embd, n_ff_exp, n_expert} (down {n_ff_exp, n_embd, n_expert}); one ggml type per
  tensor, so every expert of a (layer, projection) must share its format;
- qwen2moe's shared expert `ffn_{gate,up,down}_shexp` and its gate `ffn_gate_inp_shexp` {n_embd};
- `output.weight` always (a copy of the embeddings when they are tied: llama.cpp's qwen2moe
  loader requires it);
- mixtral is llama.cpp's `llama` architecture, whose rope rotates interleaved pairs: q/k rows
  are permuted from the HF (rotate-half) order, as llama.cpp's converter does.

The tokenizer (a byte-level BPE with GPT-2's pre-tokenizer, as both bundled models have) goes in
as `tokenizer.ggml.*`: tokens by id, merges, token types (added special tokens are control
tokens), bos / eos / padding ids and add_bos = whether the HF post-processor adds one.
Anything llama.cpp could not run as planned (another architecture, another tokenizer, a
normalised top-k for qwen2moe, mixed types inside one stacked tensor) is a UserError before
anything is written. The file is written in a temporary sibling directory and renamed.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import torch

from moequant.errors import UserError
from moequant.formats import get_format, quantize_ggml
from moequant.io.checkpoint import EXPORT_INFO, atomic_directory

GGUF_FILE = "model.gguf"
FLOAT_TYPES = ("bf16", "f16", "f32")
ARCHS = {"qwen2_moe": "qwen2moe", "mixtral": "llama"}

_COMMON = [
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"blk.\1.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"blk.\1.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)", r"blk.\1.attn_\2.\3"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", r"blk.\1.attn_output.weight"),
]
_NAMES = {
    "qwen2_moe": _COMMON + [
        (r"model\.layers\.(\d+)\.mlp\.gate\.weight", r"blk.\1.ffn_gate_inp.weight"),
        (r"model\.layers\.(\d+)\.mlp\.shared_expert\.(gate|up|down)_proj\.weight", r"blk.\1.ffn_\2_shexp.weight"),
        (r"model\.layers\.(\d+)\.mlp\.shared_expert_gate\.weight", r"blk.\1.ffn_gate_inp_shexp.weight"),
    ],
    "mixtral": _COMMON + [(r"model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight", r"blk.\1.ffn_gate_inp.weight")],
}
_F32_ROLES = ("router", "shared_expert_gate")  # ffn_gate_inp(_shexp): F32, never quantized
_TYPED_ROLES = {"embedding": "token_embd.weight", "lm_head": "output.weight"}  # the tensors `types` may set, by role
_ELEMENT_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


def gguf_name(model_type: str, hf_name: str) -> str | None:
    for pattern, repl in _NAMES[model_type]:
        if re.fullmatch(pattern, hf_name):
            return re.sub(pattern, repl, hf_name)
    return None


def _ggml_type(spec):
    import gguf

    return gguf.GGMLQuantizationType[spec.name.upper()]


def tied_output(names) -> str | None:
    """The checkpoint tensor written again as output.weight: the embeddings when `names` hold no
    lm_head.weight (tied; llama.cpp's qwen2moe loader requires output.weight), else None."""
    return None if "lm_head.weight" in names else "model.embed_tokens.weight"


def plain_type(role: str, ndim: int, float_type: str, types) -> str:
    """How a tensor written unquantized (the plan keeps it, or plans bf16) is stored: f32 | f16 | bf16 or
    the ggml type `types` ({GGUF name: type}) gives token_embd / output. `role`: the adapter's, lm_head
    for output.weight (also the tied copy); `ndim` of the tensor as written."""
    typed = types.get(_TYPED_ROLES.get(role)) if types else None
    if typed:
        return typed
    return "f32" if role in _F32_ROLES or ndim == 1 else float_type


def plain_nbytes(role: str, shape, float_type: str, types) -> int:
    """Bytes of a tensor written unquantized (plain_type), as the file holds them."""
    key = plain_type(role, len(shape), float_type, types)
    if key in _ELEMENT_BYTES:
        return _ELEMENT_BYTES[key] * math.prod(int(s) for s in shape)
    from moequant.formats import nbytes

    return nbytes(key, shape)


def _plain(t: torch.Tensor, key: str, name: str):
    """(numpy array, raw ggml type or None) of a tensor stored as plain_type `key`."""
    import gguf

    if key == "f32":
        return t.to(torch.float32).numpy(), None
    if key == "f16":
        return t.to(torch.float16).numpy(), None
    if key in FLOAT_TYPES:  # bf16: numpy has no bfloat16, so its raw bytes as ggml's BF16
        raw = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint8)  # last axis: 2 bytes each
        return raw, gguf.GGMLQuantizationType.BF16
    q = quantize_ggml(t.float(), key, name=name)
    return q.codes.numpy(), _ggml_type(q.spec)


def _rope_permute(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF rotate-half row order -> llama.cpp's interleaved pairs, per head (rows of any width)."""
    r = rows.shape[0]
    return rows.reshape(n_head, 2, r // n_head // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def check_gguf(ckpt, adapter, items: dict) -> None:
    """Refuse, before any work, what llama.cpp could not run as planned."""
    mt = adapter.model_type
    if mt not in ARCHS:
        raise UserError(f"GGUF export supports qwen2_moe and mixtral (llama.cpp's qwen2moe and llama graphs); "
                        f"this checkpoint is {mt}.")
    c = ckpt.config
    if mt == "qwen2_moe" and c.get("norm_topk_prob"):
        raise UserError("llama.cpp's qwen2moe graph does not renormalise the top-k routing weights, but this "
                        "checkpoint's config.json sets norm_topk_prob: true; it cannot be exported to GGUF as is.")
    if mt == "qwen2_moe" and (c.get("mlp_only_layers") or int(c.get("decoder_sparse_step", 1)) != 1):
        raise UserError("llama.cpp's qwen2moe graph needs every layer to be an MoE layer; this checkpoint has "
                        "dense layers (mlp_only_layers / decoder_sparse_step).")
    if c.get("sliding_window") and c.get("use_sliding_window"):
        raise UserError("GGUF export does not write sliding-window attention; config.json enables use_sliding_window.")
    tok = _tokenizer_json(ckpt.directory)
    model = tok.get("model", {})
    pre = tok.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True) \
            or pre.get("add_prefix_space") or tok.get("normalizer"):
        raise UserError(f"GGUF export writes byte-level BPE tokenizers with GPT-2's pre-tokenizer; "
                        f"{ckpt.directory}/tokenizer.json has model {model.get('type')!r} with pre-tokenizer "
                        f"{pre.get('type')!r}{' and a normalizer' if tok.get('normalizer') else ''}.")
    for name, q in items.items():
        if q.spec.quantized and not q.spec.is_ggml:
            raise UserError(f"the gguf layout holds ggml block types (q8_0 ... q2_k) or bf16; tensor {name} is planned "
                            f"as {q.spec.key} (use target llama.cpp).")
        role = adapter.classify(name)
        if q.spec.is_ggml and (role.role in ("router", "shared_expert_gate", "norm") or len(q.shape) < 2):
            raise UserError(f"tensor {name} ({role.role}) stays unquantized in GGUF; it is planned as {q.spec.key}.")
    for layer in adapter.moe_layers:
        for proj in adapter.projections:
            keys = {items[n].spec.key if n in items else "bf16"
                    for n in (adapter.expert_tensor_name(layer, e, proj) for e in range(adapter.num_experts))}
            if len(keys) > 1:
                raise UserError(f"GGUF stacks the experts of a layer per projection into one tensor of one ggml type, but "
                                f"layer {layer} {proj} has {', '.join(sorted(keys))}; plan with target llama.cpp.")


def _tokenizer_json(directory) -> dict:
    path = Path(directory) / "tokenizer.json"
    if not path.exists():
        raise UserError(f"GGUF export needs the tokenizer: {path} is missing.")
    return json.loads(path.read_text())


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
    writer.add_tokenizer_pre("gpt-2")
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

    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                     ("pad_token", writer.add_pad_token_id)):
        if token_id(key) is not None:
            add(token_id(key))
    single = (tok.get("post_processor") or {}).get("single") or []  # a template that starts with a special token
    writer.add_add_bos_token(bool(single) and "SpecialToken" in single[0])
    writer.add_add_eos_token(False)


def _add_hparams(writer, adapter, config: dict, file_type: int) -> None:
    c = config
    n_head = int(c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or adapter.hidden // n_head)
    rope = c.get("rope_parameters") or {}
    writer.add_name(str(c.get("_name_or_path") or adapter.model_type))
    writer.add_context_length(int(c.get("max_position_embeddings", 4096)))
    writer.add_embedding_length(adapter.hidden)
    writer.add_block_count(adapter.num_layers)
    writer.add_feed_forward_length(int(c.get("intermediate_size", adapter.expert_intermediate)))
    writer.add_head_count(n_head)
    writer.add_head_count_kv(int(c.get("num_key_value_heads", n_head)))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", c.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", 1e-6)))
    writer.add_expert_count(adapter.num_experts)
    writer.add_expert_used_count(adapter.top_k)
    writer.add_vocab_size(int(c["vocab_size"]))
    if adapter.model_type == "qwen2_moe":
        writer.add_expert_feed_forward_length(adapter.expert_intermediate)
        writer.add_expert_shared_feed_forward_length(adapter.shared_intermediate)
    writer.add_file_type(file_type)
    writer.add_quantization_version(2)


def _file_type(items: dict, float_type: str) -> int:  # noqa: C901
    """general.file_type: the most common ggml type among the weights (llama.cpp's LLAMA_FTYPE)."""
    from collections import Counter

    ftypes = {"q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q2_k": 10, "q3_k": 12, "q4_k": 15, "q5_k": 17,
              "q6_k": 18}
    counts = Counter()
    for q in items.values():
        if q.spec.is_ggml:
            counts[q.spec.name] += int(np.prod(q.shape))
    if counts:
        return ftypes[counts.most_common(1)[0][0]]
    return {"f32": 0, "f16": 1, "bf16": 32}[float_type]


def export_gguf(ckpt, adapter, items: dict, out_dir, *, kept: dict | None = None, float_type: str = "bf16",
                info: dict | None = None, max_shard_bytes: int = 0, types: dict | None = None) -> Path:
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
    c = ckpt.config
    n_head, n_kv = int(c["num_attention_heads"]), int(c.get("num_key_value_heads", c["num_attention_heads"]))
    expert_names = {adapter.expert_tensor_name(L, e, p) for L in adapter.moe_layers for e in range(adapter.num_experts)
                    for p in adapter.projections}
    plan_of = {}
    for name in ckpt.keys():
        if name in expert_names:
            continue
        target = gguf_name(mt, name)
        if target is None:
            raise UserError(f"tensor {name} of {ckpt.path} has no GGUF counterpart in llama.cpp's {ARCHS[mt]} graph.")
        plan_of[target] = name
    copied = tied_output(ckpt.keys())
    if copied:
        plan_of["output.weight"] = copied

    def tensor_for(hf_name: str, out_name: str):
        """(numpy array, raw ggml type or None) of one 2-D/1-D tensor."""
        q = items.get(hf_name) if out_name != "output.weight" or hf_name == "lm_head.weight" else None
        if q is not None and q.spec.is_ggml:
            arr, raw = q.codes.cpu(), _ggml_type(q.spec)
        else:
            arr, raw = (q.codes if q is not None else read(hf_name)), None
        if mt == "mixtral" and re.fullmatch(r"blk\.\d+\.attn_[qk]\.(weight|bias)", out_name):
            arr = _rope_permute(arr, n_head if ".attn_q." in out_name else n_kv)
        if raw is not None:
            return arr.numpy(), raw
        if out_name.endswith("ffn_gate_inp_shexp.weight"):
            arr = arr.reshape(-1)  # llama.cpp's {n_embd}
        role = "lm_head" if out_name == "output.weight" else adapter.classify(hf_name).role
        return _plain(arr, plain_type(role, arr.dim(), float_type, types), out_name)

    def experts_for(layer: int, proj: str):
        names = [adapter.expert_tensor_name(layer, e, proj) for e in range(adapter.num_experts)]
        if names[0] in items and items[names[0]].spec.is_ggml:
            return torch.stack([items[n].codes.cpu() for n in names]).numpy(), _ggml_type(items[names[0]].spec)
        stacked = torch.stack([items[n].codes if n in items else read(n) for n in names])
        name = f"blk.{layer}.ffn_{proj}_exps.weight"
        return _plain(stacked, plain_type("routed_expert", stacked.dim(), float_type, types), name)

    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        writer = gguf.GGUFWriter(str(tmp / GGUF_FILE), ARCHS[mt], split_max_size=max_shard_bytes)
        _add_hparams(writer, adapter, c, _file_type(items, float_type))
        add_tokenizer(writer, ckpt.directory)
        order = ["token_embd.weight", "output_norm.weight", "output.weight"]
        for target in order:
            arr, raw = tensor_for(plan_of[target], target)
            writer.add_tensor(target, arr, raw_dtype=raw)
        for L in range(adapter.num_layers):
            for target in sorted(t for t in plan_of if t.startswith(f"blk.{L}.")):
                arr, raw = tensor_for(plan_of[target], target)
                writer.add_tensor(target, arr, raw_dtype=raw)
            if L in adapter.moe_layers:
                for proj in adapter.projections:
                    arr, raw = experts_for(L, proj)
                    writer.add_tensor(f"blk.{L}.ffn_{proj}_exps.weight", arr, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        (tmp / EXPORT_INFO).write_text(json.dumps(info or {"layout": "gguf"}, indent=2) + "\n")
    return out_dir


_ROLES = [(r"token_embd\.", "embedding"), (r"output\.", "lm_head"), (r".*norm\.", "norm"),
          (r".*ffn_gate_inp_shexp\.", "shared_expert_gate"), (r".*ffn_gate_inp\.", "router"),
          (r".*_shexp\.", "shared_expert"), (r".*_exps\.", "routed_expert"), (r".*attn_", "attention")]


def gguf_bytes(path) -> dict:
    """The byte account of a GGUF file as `report.checkpoint_bytes` gives it for safetensors:
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
    return {"by_role": dict(by_role), "weights_by_role": dict(weights), "experts": dict(experts),
            "fused_experts": {}, "total": sum(by_role.values())}


def write_imatrix(stats_dir, out_path) -> Path:
    """llama.cpp's imatrix GGUF from our calibration statistics, for llama-quantize / llama_model_quantize.

    Per routed-expert tensor `blk.N.ffn_{gate,up,down}_exps.weight`: `<name>.in_sum2` {n_in, n_expert}
    = Σ x² over the expert's statistic tokens and `<name>.counts` {1, n_expert} = those tokens (with
    all-experts coverage every token, so every expert has data; llama-imatrix sees only the routed
    ones). qwen2moe's shared-expert gate / up take the same input: written from the all-token
    statistics when calibration ran with all-experts coverage.
    """
    import gguf

    from moequant.calib.stats import load_stats

    stats = load_stats(stats_dir, with_hessians=False)
    out_path = Path(out_path)
    if out_path.suffix != ".gguf":
        raise UserError(f"the imatrix file {out_path} must end in .gguf (llama.cpp's GGUF imatrix format).")
    entries = {}
    for L, ls in sorted(stats.layers.items()):
        for group, projs in (("gate_up", ("gate", "up")), ("down", ("down",))):
            sq, n = ls.tensors.get(f"input.{group}.sq_mean"), ls.tensors.get(f"input.{group}.tokens")
            if sq is None or n is None:
                raise UserError(f"the statistics in {stats_dir} hold no input.{group}.sq_mean for layer {L}; "
                                f"calibrate again with this version.")
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
