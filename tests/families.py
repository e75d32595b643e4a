"""Tiny random checkpoints of every MoE family the installed transformers ships with its standard experts
interface, built from each family's own config class defaults, shrunk.

Shrinking sets only the size fields a config already has (so each family keeps its own structure:
shared experts, dense layers, linear-attention layers, MLA, grouped routing), keeps one layer of each
kind its per-layer lists name, and uses the bundled models' tokenizer so the whole pipeline runs.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from pathlib import Path

import torch

from moequant.arch import supported_model_types
from moequant.zoo import path as zoo_path

VOCAB = 4096  # the bundled tokenizer's
LAYERS = 4
EXPERT_WIDTH = 128  # a multiple of every int4 group size

SIZES = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "ffn_hidden_size": 256,
    "dense_intermediate_size": 256,
    "moe_intermediate_size": EXPERT_WIDTH,
    "expert_ffn_hidden_size": EXPERT_WIDTH,
    "expert_intermediate_size": EXPERT_WIDTH,
    "shared_expert_intermediate_size": 128,
    "shared_intermediate_size": 128,  # Granite's shared MLP beside the MoE block (its default 0: none)
    "moe_shared_expert_intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 8,
    "n_routed_experts": 8,
    "num_local_experts": 8,
    "moe_num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "top_k_experts": 2,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "qk_head_dim": 32,
    "v_head_dim": 32,
    "o_lora_rank": 32,
    "o_groups": 2,
    "index_n_heads": 2,
    "index_num_heads": 2,
    "index_head_dim": 32,
    "index_topk": 16,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "mamba_num_heads": 8,
    "mamba_head_dim": 32,
    "mamba_n_heads": 8,  # GraniteMoeHybrid's names: its heads times their width must be 2 x hidden_size
    "mamba_d_head": 32,
    "mamba_d_state": 16,
    "mamba_dt_rank": 16,
    "ssm_state_size": 16,
    "n_groups": 1,
    "chunk_size": 32,
    "max_position_embeddings": 512,
    "sliding_window": 64,
    "zero_expert_num": 2,
    "num_dense_layers": 1,
    "first_k_dense_replace": 1,
    "n_shared_experts": 1,
    "moe_num_shared_experts": 1,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "attn_layer_period": 2,
    "attn_layer_offset": 0,
}
# families whose config derives its per-layer lists from the layer count: built with it
BUILD_WITH: dict[str, dict] = {
    # Kolibri-1.1 as its checkpoints are: indexed-attention layers, one reusing another's keys and values and
    # the index pool handed from layer to layer
    "kolibri1_1": {
        "num_hidden_layers": LAYERS,
        "layer_types": ["sliding_attention", "indexed_attention", "indexed_attention", "indexed_attention"],
        "index_layers": [1, 3],
        "kv_source_layers": [0, 1, 1, 3],
    }
}
# where a family's own config rules out the generic sizes above
OVERRIDES: dict[str, dict] = {
    "zaya": {"num_experts_per_tok": 1},
    # Qwen4-Exp leaves its attention indexer's sizes unset in the defaults
    "qwen4_exp": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 32,
        "indexer_budget": 64,
        "indexer_compress_ratio": 4,
    },
    "glm5_next": {"qk_rope_head_dim": 0},  # its indexed attention takes no rotary part
    "ernie4_5_vl_moe": {"moe_intermediate_size": [EXPERT_WIDTH, EXPERT_WIDTH]},  # text and vision experts
    "glm4v_moe": {  # its rotary sections fill half of the tiny heads' rotary part
        "rope_parameters": {
            "rope_theta": 1e4,
            "partial_rotary_factor": 0.5,
            "rope_type": "default",
            "mrope_section": [2, 3, 3],
        }
    },
    "hy_v4_vl": {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "mrope_section": [2, 3, 3]}},
    "mistral4": {"head_dim": SIZES["qk_nope_head_dim"] + SIZES["qk_rope_head_dim"]},  # rotary: half of head_dim
    "gemma4": {"enable_moe_block": True, "pad_token_id": 0},  # its multimodal forward masks with the pad id
    # GLM-5: layers that reuse the previous layer's indexer top-k (handed from layer to layer), as its checkpoints do
    "glm_moe_dsa": {"indexer_types": ["full", "shared", "full", "shared"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    # Granite-4.0-H as its checkpoints are: Mamba-2 layers with an attention layer between (the default is Mamba only)
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"]},
}

_TYPES = set(supported_model_types())
# The installed transformers' MoE families with the standard experts interface (one model_type per modeling
# folder that has a causal-LM class), and those moequant does not take, each with the start of its refusal.
FAMILIES = sorted(
    t
    for t in __import__("moequant.arch", fromlist=["x"]).supported_model_types()
    if not t.endswith("_text") or t[:-5] not in __import__("moequant.arch", fromlist=["x"]).supported_model_types()
)
NAMED = (
    "qwen3_5_moe",
    "qwen3_next",
    "glm4_moe",
    "glm_moe_dsa",
    "deepseek_v32",
    "deepseek_v4",
    "minimax_m2",
    "gemma4",
    "ernie4_5_moe",
    "hunyuan_v1_moe",
    "dots1",
    "longcat_flash",
    "granitemoe",
    "phimoe",
    "lfm2_moe",
    "nemotron_h",
    "jamba",
    "kimi_linear",
    "kimi_k25",
    "mistral4",
    "qwen3_vl_moe",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v2",
    "deepseek_v3",
    "olmoe",
    "gpt_oss",
)
FUSED = "stores its experts fused on disk"
NOT_SUPPORTED: dict[str, str] = {
    # the refusal's words: experts layouts the generic reader does not take yet
    "aria": "experts are stored transposed",
    "ergo": "experts are stored transposed",
    "inkling2": "stores its experts fused on disk in a layout moequant does not know",
    "inkling2_loop": "tensors moequant cannot join",
    "nemotron_h_omni": "has no list of decoder layers moequant can walk",
}
# families whose layers the layer-by-layer runner refuses (calibration and evaluation run one layer at a time):
# `apply` stops in one sentence with these words
REFUSED_LAYER_BY_LAYER: dict[str, str] = {
    "zaya": "its decoder layers take more than one state from the layers before them",
}
# families whose export plain transformers 5.25 cannot load, for reasons of its own (the test checks they still fail)
CONV_CONCAT = "its weight conversion concatenates the q/k/v convolutions and fails under a quantization_config"
# families whose plain transformers 5.25 load fails under any quantization_config, even one quantizing nothing it touches
ANY_QUANTIZATION_CONFIG: dict[str, str] = {
    "minimax_m3_vl": "its weight conversion concatenates the shared expert's gate and up, which its "
    "compressed-tensors loader drops under any quantization_config",
}
TRANSFORMERS_CANNOT_RELOAD: dict[str, str] = {
    "bailing_hybrid": CONV_CONCAT,
    "kimi_linear": CONV_CONCAT,
    "gpt_oss": "its MXFP4 loader needs accelerate, which the test extra does not install",
    "unlimited_ocr": "its weight conversion splits the q/k/v projection and fails under a quantization_config",
    **ANY_QUANTIZATION_CONFIG,
}
# families this fixture cannot build a tiny model of (their config validators tie sizes it does not set):
# untested, not refused
UNBUILT: dict[str, str] = {
    "dots3_note": "per-layer attention kinds that must be homogeneous",
    "deepseek_ocr2": "vision encoders sized by fields the fixture does not shrink: the default build needs over 9 GB",
    "inkling_mm_model": "vision and audio encoders sized by fields the fixture does not shrink: over 9 GB",
    "diffusion_gemma": "its per-layer attention kinds do not survive the fixture's shrinking",
    "ernie4_5_vl_moe": "text and vision experts of their own widths in one layer",
    "muse_spark": "its experts' output width is a size field the fixture does not shrink",
    "glm5_next": "transformers 5.25 does not reload the fixture's quantized export (its weight conversion fails)",
    "inkling_text": "the tiny random model's routed experts do not move its logits after int4 (KL < 1e-7)",
}

# families whose experts are fused on disk export in their own layout (compressed-tensors needs one tensor each)
OWN_LAYOUT = {"gpt_oss": ("gpt-oss-mxfp4", "mxfp4")}
# quantized checkpoints read natively, as these families ship them (tests/test_families.py builds each)
QUANTIZED_SOURCES: dict[str, str] = {
    "deepseek_v32": "FP8-block",
    "deepseek_v4": "FP8-block",
    "glm4_moe": "FP8-block",
    "qwen3_5_moe": "FP8-block",
    "minimax_m2": "FP8-block",
    "deepseek_v3": "INT4 compressed-tensors",  # Kimi-K2.5's text model, saved alone
    "kimi_k25": "INT4 compressed-tensors",  # as it ships: routed experts int4, vision tower bf16
}

# families whose llama.cpp graph takes only what their checkpoints have, where the defaults above differ: the config
# tests/test_gguf_families.py builds them with (what, overrides); other configs are refused by the GGUF precheck
GGUF_OVERRIDES: dict[str, tuple[str, dict]] = {
    # llama.cpp asserts that the sections fit the rotary dimensions; transformers' default [24, 20, 20] fills heads of
    # 128 (Qwen3-VL's), not the tiny model's 32
    "qwen3_vl_moe": (
        "M-RoPE sections that fill each head's rotary half",
        {"rope_parameters": {"rope_theta": 5e5, "rope_type": "default", "mrope_section": [6, 5, 5]}},
    ),
    "qwen3_omni_moe_thinker": (
        "M-RoPE sections that fill each head's rotary half",
        {"rope_parameters": {"rope_theta": 1e6, "rope_type": "default", "mrope_section": [6, 5, 5]}},
    ),
    "dots1": (
        "as many key / value heads as query heads",
        {"num_key_value_heads": SIZES["num_attention_heads"], "first_k_dense_replace": 3},  # one MoE layer (below)
    ),
    "lfm2_moe": ("tied embeddings", {"tie_word_embeddings": True}),
    # one MoE layer (here and below): a random sigmoid router has near ties that llama.cpp's 8-bit activations in the
    # quantized layers before it flip (tests/test_gguf_archs.py's DeepSeek-V3 has one too)
    "glm4_moe_lite": ("dense layers first", {"mlp_layer_types": ["dense", "dense", "dense", "sparse"]}),
    # GLM-5's: three dense layers first, then MoE layers; 32 indexer heads of 128 (llama.cpp's Hadamard rotation takes
    # power-of-two widths of 64 or more; with 2 heads many index scores are exactly 0, all heads' ReLU at 0, and
    # top-k's ties break apart); the indexer's top-k (16) below the test's texts, so the selection acts
    "glm_moe_dsa": (
        "dense layers first, indexer heads of a power-of-two width of 64 or more (128)",
        {"mlp_layer_types": ["dense", "dense", "dense", "sparse"], "index_head_dim": 128, "index_n_heads": 32},
    ),
    "qwen3_next": (
        "full attention every full_attention_interval-th layer",
        {"layer_types": ["linear_attention"] * 3 + ["full_attention"]},
    ),
    # Nemotron-3-Nano's kinds of layers: Mamba-2, MoE, attention (no dense MLP)
    "nemotron_h": (
        "no dense MLP layers",
        {"layers_block_type": ["linear_attention", "moe", "full_attention", "linear_attention"]},
    ),
    # the tiny model keeps Gemma-4's 262,144 per-layer embedding rows beside its 4,096 tokens; llama.cpp looks both up
    # by token
    "gemma4": ("per-layer embeddings over the token vocabulary", {"vocab_size_per_layer_input": VOCAB}),
    "unlimited_ocr": (
        "multi-head attention, dense layers first",
        {
            "num_key_value_heads": SIZES["num_attention_heads"],
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        },
    ),
    # Trinity's attention (three sliding layers, then a full one without rope) and its muP embedding scale and
    # route_scale (Trinity-Mini's), which transformers' defaults leave off
    "afmoe": (
        "three sliding-window layers to one full-attention layer, and muP's embedding scale",
        {
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
            "sliding_window": 16,  # shorter than the test's texts: the window acts
            "mup_enabled": True,
            "route_scale": 2.826,
            # one MoE layer (as GLM-4.7-Flash's): with three, llama.cpp vs our dequantization is 4.6e-2 of KL with the
            # routers at 8x, 1.0e-3 at 32x (measured): the random sigmoid routers' near ties
            "num_dense_layers": 3,
        },
    ),
    # Kimi-Linear-48B-A3B's layout: as many KDA heads as attention heads, no q compression, three KDA layers to one
    # MLA layer, dense layers first; one MoE layer (as GLM-4.7-Flash's): with three, every one's experts quantized,
    # llama.cpp vs our dequantization is 2.7e-3 of KL with the routers at 8x, 3.1e-2 at 4x, and 2.6e-4 with the last
    # layer's alone (F32 file 6e-8; measured): the quantized layers' 8-bit activations flip the later sigmoid routers'
    # near ties
    "kimi_linear": (
        "as many KDA heads as attention heads and dense layers first",
        {
            "linear_num_heads": SIZES["num_attention_heads"],
            "linear_head_dim": 32,
            "q_lora_rank": None,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "mlp_layer_types": ["dense"] * 3 + ["sparse"],
        },
    ),
    "exaone_moe": (
        "dense layers first",
        {
            "mlp_layer_types": ["dense", "dense", "dense", "sparse"],
            "sliding_window": 16,  # shorter than the test's texts: the window acts
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        },
    ),
}

PER_LAYER_LISTS = ("layer_types", "mlp_layer_types", "layers_block_type", "hybrid_override_pattern")


def _shrunk_list(values: list, n: int) -> list:
    """n entries that keep every distinct kind the list names (first occurrences first, in order)."""
    firsts = sorted({v: i for i, v in reversed(list(enumerate(values)))}.values())
    picked = sorted(set(firsts[:n]) | set(range(n - min(n, len(firsts)), 0)))[:n]
    out = [values[i] for i in picked]
    i = 0
    while len(out) < n:  # pad with the list's own pattern
        out.append(values[i % len(values)])
        i += 1
    return out


def tiny_family_config(model_type: str):
    """The family's config with its defaults, its text part shrunk to LAYERS layers of tiny width."""
    from transformers import AutoConfig

    top = AutoConfig.for_model(model_type, **BUILD_WITH.get(model_type, {}))
    config = top.get_text_config()
    keys = config.to_dict()
    for key, value in SIZES.items():  # under the config's own names or its aliases
        if key in OVERRIDES.get(model_type, {}):
            continue
        if key in keys or key in getattr(config, "attribute_map", {}):
            setattr(config, key, value)
    if "qk_rope_head_dim" in keys and "head_dim" in keys:  # MLA: the rotary part is the head_dim transformers uses
        config.head_dim = SIZES["qk_rope_head_dim"]
    if "kv_lora_rank" in keys and "num_key_value_heads" in keys:  # MLA: one key / value per query head
        config.num_key_value_heads = SIZES["num_attention_heads"]
    if (getattr(config, "n_group", None) or 1) > 1:  # grouped routing (the key may be an alias)
        config.n_group, config.topk_group = 2, 1
    layers_key = "num_hidden_layers" if "num_hidden_layers" in keys else "num_layers"
    before = keys.get(layers_key)
    setattr(config, layers_key, LAYERS)
    for key, value in keys.items():  # per-layer lists: one layer of each kind they name
        if isinstance(value, list) and len(value) > LAYERS and (key in PER_LAYER_LISTS or len(value) == before):
            setattr(config, key, _shrunk_list(value, LAYERS))
    if isinstance(keys.get("per_layer_config"), dict):  # Gemma-4: overrides for some layer indices
        config.per_layer_config = {k: v for k, v in keys["per_layer_config"].items() if int(k) < LAYERS}
    for key in ("mlp_only_layers",):
        if keys.get(key):
            setattr(config, key, [])
    config.vocab_size = VOCAB
    if "unpadded_vocab_size" in keys:  # Inkling-2: the head's rows (the checkpoint pads the unembedding)
        config.unpadded_vocab_size = VOCAB
    config.tie_word_embeddings = False
    config.bos_token_id, config.eos_token_id = 0, 0
    try:
        config.pad_token_id = None
    except Exception:  # noqa: BLE001  (a config that requires one, Step-3.7: its validator's own error)
        config.pad_token_id = 0
    if "num_nextn_predict_layers" in keys:
        config.num_nextn_predict_layers = 0
    for key, value in OVERRIDES.get(model_type, {}).items():
        setattr(config, key, value)
    if top is not config:
        top.tie_word_embeddings = False
    if model_type in AS_SHIPPED:  # the class its checkpoints name, towers and all
        top.architectures = [AS_SHIPPED[model_type]]
    for key in ("vision_config", "audio_config"):  # the non-text towers, kept as they are: tiny too
        tower = getattr(top, key, None)
        if tower is not None and not isinstance(tower, dict):
            depth = {k: tower.to_dict().get(k) for k in ("depth", "num_hidden_layers")}
            for name, value in TOWER_SIZES.items():
                if name in tower.to_dict():
                    setattr(tower, name, config.hidden_size if value is None else value)
            for key, value in tower.to_dict().items():  # the tower's per-layer lists: one entry a layer left
                if isinstance(value, list) and len(value) > 1 and len(value) in [d for d in depth.values() if d]:
                    setattr(tower, key, value[: TOWER_SIZES["num_hidden_layers"]])
            if getattr(tower, "deepstack_visual_indexes", None):
                tower.deepstack_visual_indexes = [0]
    if top is not config:  # the wrapper's and towers' derived sizes as transformers' reload recomputes them
        again = type(top).from_dict(top.to_dict())  # (MiniMax-M3-VL's projector width, Step-3.7's vision MLP)
        for key, value in vars(again).items():
            if key != "text_config" and key in vars(top) and not key.startswith("_"):
                setattr(top, key, value)
    return top


# families whose checkpoints ship the text model inside a multimodal one: built as that (vision tower kept)
AS_SHIPPED = {"qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
TOWER_SIZES = {
    "depth": 1,
    "num_hidden_layers": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "out_hidden_size": None,  # the text model's hidden size
    "text_hidden_size": None,
}


def build_family(model_type: str, directory: Path, seed: int = 0, **text: object) -> Path:
    """Save a tiny random model of the family (bf16, transformers' own on-disk names) with the bundled tokenizer;
    `text` sets fields of its text config."""
    from moequant.arch.generic import model_class

    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        torch.manual_seed(seed)
        config = tiny_family_config(model_type)
        for key, value in text.items():
            setattr(config.get_text_config(), key, value)
        model = model_class(config.to_dict()).from_config(config)
        with torch.no_grad():
            for name, b in model.named_buffers():
                if "correction_bias" in name:
                    b.normal_(0, 0.02)
        model = model.to(torch.bfloat16)
        directory = Path(directory)
        with _as_transformers_ships():
            model.save_pretrained(directory)
    finally:
        logger.setLevel(level)
    if model_type == "kimi_k25":  # its text layers as its checkpoints name them (transformers' save misspells them)
        _respell(directory, "language_model.model.blocks.", "language_model.model.layers.")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(zoo_path("tiny-qwen2moe") / name, directory / name)
    return directory


@contextlib.contextmanager
def _as_transformers_ships():
    """transformers' own conversion mappings, without the per-expert merge moequant.register_for_transformers adds
    (saving reverses it: a family whose checkpoints keep experts fused would be saved one tensor per expert)."""
    from transformers import conversion_mapping

    from moequant.arch.generic import per_expert_merge

    cache = conversion_mapping._checkpoint_conversion_mapping_cache or {}
    saved = dict(cache)
    for key, convs in saved.items():
        if convs and any(isinstance(c, per_expert_merge()) for c in convs):
            cache[key] = [c for c in convs if not isinstance(c, per_expert_merge())]
    try:
        yield
    finally:
        cache.update(saved)


def _respell(directory: Path, old: str, new: str) -> None:
    import json

    from safetensors.torch import load_file, save_file

    for shard in directory.glob("*.safetensors"):
        tensors = {k.replace(old, new, 1) if k.startswith(old) else k: v for k, v in load_file(shard).items()}
        save_file(tensors, shard, metadata={"format": "pt"})
    index = directory / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {
            k.replace(old, new, 1) if k.startswith(old) else k: v for k, v in data["weight_map"].items()
        }
        index.write_text(json.dumps(data))


def support_table() -> str:
    """The README's table of families, from the lists above (what tests/test_families.py checks)."""
    from moequant.layouts.gguf import ARCHS, REFUSED

    lines = [
        "| family (`model_type`) | apply + transformers reload | compressed-tensors | GGUF | quantized source |",
        "|---|---|---|---|---|",
    ]
    for family in FAMILIES:
        if family in NOT_SUPPORTED or family in UNBUILT or family in REFUSED_LAYER_BY_LAYER:
            refused = NOT_SUPPORTED.get(family) or REFUSED_LAYER_BY_LAYER.get(family)
            why = f"refused: {refused}" if refused else f"untested ({UNBUILT[family]})"
            lines.append(f"| {family} | {why} | — | — | — |")
            continue
        export = "gpt-oss-mxfp4 layout" if family in OWN_LAYOUT else "yes"
        reload = "yes" if family not in TRANSFORMERS_CANNOT_RELOAD else "apply: yes; transformers: no (below)"
        gguf = (
            "precheck refuses (below)"
            if family not in ARCHS
            else "yes, as shipped (below)"
            if family in GGUF_OVERRIDES
            else "yes"
        )
        source = QUANTIZED_SOURCES.get(family, "—")
        lines.append(f"| {family} | {reload} | {export} | {gguf} | {source} |")
    lines.append("")
    for family, why in sorted(TRANSFORMERS_CANNOT_RELOAD.items()):
        lines.append(f"- {family}: plain transformers cannot reload the export: {why}.")
    lines.append("")
    lines.append(
        'GGUF "yes": llama.cpp (llama-cpp-python 0.3.36) runs the export as transformers runs our dequantization '
        "(tests/test_gguf_archs.py, tests/test_gguf_families.py, tests/test_gguf.py)."
    )
    lines.append("")
    for family, (what, _) in sorted(GGUF_OVERRIDES.items()):
        lines.append(f"- {family}: GGUF as its checkpoints are: {what}; other configs are refused by the precheck.")
    for family in taken_families():
        if family not in ARCHS:
            why = REFUSED.get(family, "llama.cpp (llama-cpp-python 0.3.36) has no graph for it")
            lines.append(f"- {family}: GGUF refused: {why}.")
    return "\n".join(lines) + "\n"


def readme_table(readme_text: str) -> str:
    start, end = readme_text.index(TABLE_START) + len(TABLE_START), readme_text.index(TABLE_END)
    return readme_text[start:end].lstrip("\n")


TABLE_START, TABLE_END = "<!-- families table: python tests/families.py -->", "<!-- end of families table -->"


def tested_families() -> dict:
    """moequant/arch/tested_families.json: the families moequant takes here and this transformers' version."""
    import transformers

    return {"transformers": transformers.__version__, "model_types": taken_families()}


def taken_families() -> list[str]:
    """The families moequant takes here: those the tests run through the whole pipeline."""
    return [f for f in FAMILIES if f not in NOT_SUPPORTED and f not in UNBUILT and f not in REFUSED_LAYER_BY_LAYER]


if __name__ == "__main__":  # rewrite the README's table and the tested families from the lists above
    import json

    from moequant.arch import TESTED_FAMILIES

    readme = Path(__file__).parent.parent / "README.md"
    text = readme.read_text()
    start, end = text.index(TABLE_START) + len(TABLE_START), text.index(TABLE_END)
    readme.write_text(text[:start] + "\n" + support_table() + text[end:])
    TESTED_FAMILIES.write_text(json.dumps(tested_families(), indent=1) + "\n")
