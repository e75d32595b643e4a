"""The gguf layout (llama.cpp / Ollama / LM Studio, `export: {format: gguf}` -> checkpoint/model.gguf): what
llama.cpp's graphs hold, how tensors are typed and packed there (what each architecture's graph reads and how
its tensors are named: gguf_graphs.py). The file itself is written by moequant.export.gguf (its header,
tokenizer and tensor order).

    export_gguf(ckpt, adapter, items, out_dir, float_type="bf16")

`items` maps on-disk tensor names to QuantizedTensors (as `export_checkpoint` resolves them);
ggml-typed ones (and MXFP4 routed experts) are written as their packed blocks, bf16 ones and
everything else as `plain_type` says: in `float_type` (bf16 | f16 | f32), but 1-D tensors (norms,
biases), expert biases and the routers in F32, as llama.cpp's own converter writes them (ggml adds
expert biases in F32 only), and token_embd / output in the ggml type `types` gives them. The plan's
byte account asks the same `plain_nbytes` (through the gguf layout), so it counts what this file
holds (gpt-oss's 2-D expert biases aside: the account counts them in `float_type`).

gpt-oss's experts as the source stores them (MXFP4 `*_blocks` / `*_scales`, nothing replacing them)
are written as their own codes. The tokenizer (a byte-level BPE with GPT-2's pre-tokenizer, as the
bundled models have, or Qwen2 / Qwen3's: `tokenizer_pre`) goes in as `tokenizer.ggml.*`: tokens by
id, merges, token types (added special tokens are control tokens), bos / eos / padding ids and
add_bos = whether the HF post-processor adds one. Not written yet: DeepSeek-V3's and gpt-oss's own
pre-tokenizers (refused, one sentence), Kimi-K2 (model_type kimi_k2 has no adapter).
Anything llama.cpp could not run as planned is a UserError before anything is written. The file
is written in a temporary sibling directory and renamed; tensors are read and packed layer by
layer as gguf-py writes them (only the one being written is in memory).
"""

from __future__ import annotations

import math
import re

import numpy as np
import torch

from moequant.formats import quantize_ggml
from moequant.layouts.base import Layout
from moequant.layouts.gguf_graphs import (  # noqa: F401  (ARCHS, REFUSED: tests/families.py reads them here)
    ARCHS,
    GRAPHS,
    REFUSED,
    gguf_targets,
    graph_config,
    model_refusal,
    prediction_layer,
    reshaped_reason,
    written_shapes,
)
from moequant.layouts.gguf_transforms import RESHAPES, ROW_ORDER

GGUF_FILE = "model.gguf"
FLOAT_TYPES = ("bf16", "f16", "f32")
RAW_TYPES = {"mxfp4": "MXFP4"}  # non-ggml formats that GGUF stores natively (routed experts), by ggml name
_ELEMENT_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
_F32_ROLES = ("router", "shared_expert_gate")  # ffn_gate_inp(_shexp): F32, never quantized
# GGUF names llama.cpp's converter writes F32 whatever the file's type, as its graphs read them (ggml's ssm_conv and
# short conv take F32 kernels only): norms, the (short) convolutions' kernels, DSA's indexer projection, and a
# tensor stored without a .weight suffix (Mamba's ssm_a, biases)
_F32_NAMES = re.compile(
    r".*(_norm\.weight|\.ssm_conv1d(_[qkv])?\.weight|\.shortconv\.conv\.weight|\.indexer\.proj\.weight)|.*(?<!\.weight)"
)
_TYPED_ROLES = {"embedding": "token_embd.weight", "lm_head": "output.weight"}  # the tensors `types` may set, by role


def ggml_type(spec):
    import gguf

    return gguf.GGMLQuantizationType[RAW_TYPES.get(spec.name, spec.name.upper())]


def stores_natively(spec) -> bool:
    """Whether GGUF holds this format's codes as they are: ggml block types, MXFP4."""
    return spec.is_ggml or spec.name in RAW_TYPES


def tied_output(names) -> str | None:
    """The checkpoint tensor written again as output.weight: the embeddings when `names` hold no
    lm_head.weight (tied; several llama.cpp loaders require output.weight), else None. A multimodal
    checkpoint's text model holds them under its own prefix (model.language_model.embed_tokens.weight)."""
    names = list(names)
    if any(n == "lm_head.weight" or n.endswith(".lm_head.weight") for n in names):
        return None
    return next((n for n in names if n.endswith("language_model.embed_tokens.weight")), "model.embed_tokens.weight")


def plain_type(role: str, ndim: int, float_type: str, types, gguf_names=()) -> str:
    """How a tensor written unquantized (the plan keeps it, or plans bf16) is stored: f32 | f16 | bf16 or
    the ggml type `types` ({GGUF name: type}) gives token_embd / output. `role`: the adapter's, lm_head
    for output.weight (also the tied copy); `ndim` of the tensor as written; `gguf_names` what it is in the file."""
    typed = types.get(_TYPED_ROLES.get(role)) if types else None
    if typed:
        return typed
    f32 = role in _F32_ROLES or ndim == 1 or any(_F32_NAMES.fullmatch(n) for n in gguf_names)
    return "f32" if f32 else float_type


def plain_nbytes(role: str, shape, float_type: str, types, gguf_names=()) -> int:
    """Bytes of a tensor written unquantized (plain_type), as the file holds them."""
    key = plain_type(role, len(shape), float_type, types, gguf_names)
    if key in _ELEMENT_BYTES:
        return _ELEMENT_BYTES[key] * math.prod(int(s) for s in shape)
    from moequant.formats import nbytes

    return nbytes(key, shape)


def plain_array(t: torch.Tensor, key: str, name: str):
    """(numpy array, raw ggml type or None) of a tensor stored as plain_type `key`."""
    import gguf

    if key == "f32":
        return t.to(torch.float32).contiguous().numpy(), None
    if key == "f16":
        return t.to(torch.float16).contiguous().numpy(), None
    if key in FLOAT_TYPES:  # bf16: numpy has no bfloat16, so its raw bytes as ggml's BF16
        raw = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint8)  # last axis: 2 bytes each
        return raw, gguf.GGMLQuantizationType.BF16
    q = quantize_ggml(t.float(), key, name=name)
    return q.codes.numpy(), ggml_type(q.spec)


def _mxfp4_blocks(codes: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """e2m1 codes [..., n] and e8m0 scales [..., n/32] -> ggml MXFP4 blocks uint8 [..., n/32 * 17]."""
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 32)
    packed = c[..., :16] | (c[..., 16:] << 4)
    blocks = torch.cat([scales.to(torch.uint8).unsqueeze(-1), packed], dim=-1)
    return blocks.reshape(*codes.shape[:-1], -1).numpy()


def packed_blocks(q, rows=slice(None)):
    """(numpy blocks, raw ggml type) of a QuantizedTensor GGUF stores natively, rows [..., rows, :] only."""
    if q.spec.is_ggml:
        return q.codes[..., rows, :].cpu().contiguous().numpy(), ggml_type(q.spec)
    return _mxfp4_blocks(q.codes[..., rows, :].cpu(), q.scales[..., rows, :].cpu()), ggml_type(q.spec)


def reordered_rows(q, order: torch.Tensor):
    """QuantizedTensor q with its rows (output channels) in `order` (packed ggml rows are independent)."""
    from moequant.formats import QuantizedTensor

    return QuantizedTensor(q.spec, q.shape, q.codes[order], None if q.scales is None else q.scales[order])


class Gguf(Layout):
    """One file in llama.cpp's names and block layouts, written by moequant.export.gguf: its plain tensors
    as gguf.plain_type stores them (F32 norms, biases and routers), tied embeddings again as output.weight."""

    name = "gguf"
    container = "gguf"

    @staticmethod
    def plain_nbytes(role, shape, export, element_size=2, name=None, config=None):
        mt = (config or {}).get("model_type")
        if name and mt in ARCHS and prediction_layer(config, name):
            return 0  # a multi-token-prediction layer: GGUF export leaves it out
        names = [g for g, _ in gguf_targets(mt, name)] if name and mt in ARCHS else []
        if name and mt in ARCHS and not names and "text_config" in config:
            return 0  # a multimodal checkpoint's vision tower: llama.cpp's separate mmproj file, not this one
        return plain_nbytes(role, shape, export.gguf_float, export.gguf_types, names)

    @staticmethod
    def kept_reason(model_type, name):
        return reshaped_reason(model_type, name)

    @staticmethod
    def written_shapes(config, name, shape):
        return [(n, s) for n, s in written_shapes(config, name, shape) if len(s) == 2] or [(name, tuple(shape))]

    @staticmethod
    def copied_tensors(names):
        source = tied_output(names)
        return [("output.weight", "lm_head", source)] if source else []

    @staticmethod
    def added_tensors(adapter, config):
        graph = GRAPHS.get(config.get("model_type"))
        if graph is None or graph.extra is None:
            return []
        made = graph.extra(graph_config(adapter, config))  # as export_gguf writes them (Gemma-4's rope_freqs)
        return [(n, "other", tuple(t.shape), t.numel() * t.element_size()) for n, t in made.items()]

    @staticmethod
    def refuses(spec):
        return None if stores_natively(spec) else "ggml block types (q8_0 ... q2_k, iq4_xs ... iq2_xxs), MXFP4 or bf16"

    @classmethod
    def refuses_model(cls, adapter):
        return model_refusal(adapter, adapter.config)


# ---- reading a GGUF file back (moequant.load of a GGUF export) -------------------------------------


def _inverse(fn, gguf_tensor: torch.Tensor, shape, config) -> torch.Tensor | None:
    """The HF tensor of shape `shape` that `fn` (one of the transforms above, or None) wrote as `gguf_tensor`;
    None for a transform that does not only reshape or reorder rows (kv_b_proj's split halves, gpt-oss's
    de-interleaved gate / up)."""
    if fn is None or fn in RESHAPES:
        return gguf_tensor.reshape(shape)
    if fn in ROW_ORDER:  # where each original row went: the transform of the row indices
        rows = torch.arange(shape[0], dtype=torch.float64).reshape(shape[0], 1)
        moved = fn(rows, config).reshape(-1).long()
        out = torch.empty(shape, dtype=gguf_tensor.dtype)
        out[moved] = gguf_tensor.reshape(shape)
        return out
    return None


def read_gguf_weights(
    path, adapter, config: dict
) -> tuple[dict[str, torch.Tensor], dict[tuple[int, str], torch.Tensor]]:
    """Every weight of the GGUF file `path` (as moequant.export.gguf writes it for `adapter`'s model) dequantized by
    gguf-py (float32), under the HF checkpoint's names: ({HF name: tensor} of everything but the routed experts,
    {(layer, projection): [E, out, in]} of the routed experts, each GGUF stack as it is). A tensor llama.cpp's
    graph holds transformed in a way that is not a reshape or a row order, or one the file lacks, is refused."""
    import gguf

    from moequant.errors import UserError

    reader = gguf.GGUFReader(str(path))
    stored = {t.name: t for t in reader.tensors}

    def dequantized(name: str) -> torch.Tensor:
        t = stored.get(name)
        if t is None:
            raise UserError(f"{path} lacks tensor {name}, which the {adapter.model_type} model needs.")
        return torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))

    if adapter.fused_experts:
        raise UserError(
            f"{path}: reading a GGUF file of {adapter.model_type} (fused experts, de-interleaved on export) back is "
            "not supported; load the safetensors export of the same plan, or run the file in llama.cpp."
        )
    tensors, experts = {}, {}
    for name, (shape, role) in adapter.expected_tensors().items():
        if role.role == "routed_expert":
            continue
        targets = gguf_targets(adapter.model_type, name)
        if len(targets) != 1:
            raise UserError(
                f"{path}: {name} is written as {len(targets)} GGUF tensors, which reading back does not support; "
                "load the safetensors export of the same plan, or run the file in llama.cpp."
            )
        ((target, fn),) = targets
        hf = _inverse(fn, dequantized(target), tuple(shape), config)
        if hf is None:
            raise UserError(
                f"{path}: {name} is written transformed as {target}, which reading back does not support; "
                "load the safetensors export of the same plan, or run the file in llama.cpp."
            )
        tensors[name] = hf
    for layer in adapter.moe_layers:
        for proj in adapter.projections:
            stack = dequantized(f"blk.{layer}.ffn_{proj}_exps.weight")  # ggml {in, out, E} = torch [E, out, in]
            experts[(layer, proj)] = stack.reshape(adapter.num_experts, *adapter.expert_shape(proj))
    return tensors, experts
