"""Architecture adapters. Every MoE family whose experts use transformers' standard experts interface goes
through `GenericAdapter`, which derives structure and on-disk names from transformers itself; a family file
exists only for what that rule cannot express (gpt-oss), listed in `ADAPTERS`.
"""

from __future__ import annotations

import json
from pathlib import Path

from moequant.arch.base import PROJECTIONS, ROLES, Adapter, Routing, TensorRole  # noqa: F401
from moequant.arch.generic import (
    GenericAdapter,
    decode_special_floats,
    per_expert_merge,
    standard_experts_families,
    wraps_experts_family,
)
from moequant.arch.gpt_oss import GptOssAdapter
from moequant.errors import UserError

ADAPTERS: dict[str, type[Adapter]] = {t: cls for cls in (GptOssAdapter,) for t in cls.model_types}


def supported_model_types() -> list[str]:
    """Every model type of the installed transformers whose experts use its standard interface."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    wrappers = {t for t in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES if wraps_experts_family(t)}
    return sorted(set(ADAPTERS) | set(standard_experts_families()) | wrappers)


def adapter_for(config: dict) -> Adapter:
    """The adapter for a config dict (from config.json); UserError for unknown model types."""
    model_type = config.get("model_type")
    if model_type not in ADAPTERS:
        refuse_unknown(model_type)
    try:
        adapter = ADAPTERS.get(model_type, GenericAdapter)(with_defaults(config))
        _check_sizes(adapter)
        adapter.expected_tensors()
        adapter.routing  # noqa: B018  (reads the routing fields: bad values fail here, as one sentence)
    except (TypeError, ValueError, ZeroDivisionError, KeyError, OverflowError, AttributeError) as e:
        raise UserError(
            f"config.json of this {model_type} model has a value moequant cannot use "
            f"({type(e).__name__}: {str(e)[:120]}); sizes must be positive integers."
        ) from None
    return adapter


# Generous bounds: DeepSeek-V3 has 61 layers × 256 experts; these only stop absurd configs
# (num_hidden_layers: 2**40) from exhausting memory while the tensor list is built.
LIMITS = {
    "num_layers": 10_000,
    "num_experts": 100_000,
    "top_k": 100_000,
    "hidden": 1_000_000,
    "vocab": 100_000_000,
    "expert_intermediate": 10_000_000,
}


def _check_sizes(adapter: Adapter) -> None:
    for field, limit in LIMITS.items():
        value = getattr(adapter, field)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise ValueError(f"{field} is {value!r}, accepted: an integer from 1 to {limit}")
    if adapter.top_k > adapter.num_experts:
        raise ValueError(f"top_k {adapter.top_k} exceeds the {adapter.num_experts} experts")
    if adapter.num_layers * adapter.num_experts > 2_000_000:
        raise ValueError(f"{adapter.num_layers} layers × {adapter.num_experts} experts is beyond any real model")


def refuse_unknown(model_type) -> None:
    """One sentence for a model type transformers does not know, or knows without MoE experts."""
    from transformers import CONFIG_MAPPING, __version__

    tested = tested_families()
    if isinstance(model_type, str) and model_type not in CONFIG_MAPPING and model_type in tested["model_types"]:
        raise UserError(
            f"model_type {model_type!r} is not known to the installed transformers {__version__}; moequant takes it "
            f"with transformers {tested['transformers']} (pip install -U 'transformers>={tested['transformers']}')."
        )
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise UserError(
            f"model_type {model_type!r} is not known to the installed transformers {__version__}; "
            "a newer transformers may have it (pip install -U transformers)."
        )
    if model_type not in standard_experts_families() and not wraps_experts_family(model_type):
        raise UserError(
            f"model_type {model_type!r} has no experts module with transformers' standard experts interface "
            f"(transformers {__version__}): it is not an MoE moequant can quantize; supported: "
            f"{', '.join(supported_model_types())}."
        )


def with_defaults(config: dict) -> dict:
    """The config as written, completed with transformers' defaults for keys it leaves out.

    Keys the file names win; transformers' canonical spellings (e.g. `num_local_experts` for
    `num_experts`) are added beside them, so adapters can read either.
    """
    import logging

    from transformers import AutoConfig

    raw = {k: v for k, v in decode_special_floats(config).items() if k != "model_type"}
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        full = AutoConfig.for_model(config["model_type"], **raw).to_dict()
    except Exception:  # an unusual but readable config: use it as it is
        full = {}
    finally:
        logger.setLevel(level)
    return {**full, **config}


TESTED_FAMILIES = Path(__file__).with_name("tested_families.json")


def tested_families() -> dict:
    """The families tests/test_families.py passes and the transformers version it ran with (written by
    `python tests/families.py`): what a too-old transformers is told to upgrade to."""
    return json.loads(TESTED_FAMILIES.read_text())


_REGISTERED: set[str] = set()  # model types given the per-expert merge in this process


def register_for_transformers(config: dict) -> bool:
    """Teach transformers' from_pretrained to load a moequant export of a family whose own checkpoints keep a
    layer's experts in one tensor (Gemma-4, GraniteMoE, Qwen3-VL-MoE, Mistral-4 ...): the export stores one
    tensor per expert, as vLLM loads it, and transformers has no per-expert mapping for these families. The
    family's own mapping is kept and transformers' per-expert merge (its qwen2_moe rule) added, through its public
    `register_checkpoint_conversion_mapping`. The export's config.json names FUSED_REFUSAL as its experts
    implementation so that transformers stops before this ran (compressed_tensors.transformers_stop); that sentence
    is registered as transformers' default experts function (grouped_mm), through its public ExpertsInterface
    (accept_fused_stop), so the export then loads as it is. Returns whether the family needed it (False: nothing
    done)."""
    adapter = adapter_for(config)
    if not getattr(adapter, "experts_fused_on_disk", None):
        return False
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )
    from transformers.core_model_loading import Concatenate, MergeModulelist

    from moequant.layouts.compressed_tensors import accept_fused_stop

    accept_fused_stop()
    model_type = config["model_type"]
    if model_type in _REGISTERED:
        return True
    own = get_checkpoint_conversion_mapping(model_type) or []
    if adapter.has_gate:
        merge = [
            per_expert_merge()(
                source_patterns=["experts.*.gate_proj.weight", "experts.*.up_proj.weight"],
                target_patterns="experts.gate_up_proj",
                operations=[MergeModulelist(dim=0), Concatenate(dim=1)],
            )
        ]
    else:
        merge = [
            per_expert_merge()(
                source_patterns="experts.*.up_proj.weight",
                target_patterns="experts.up_proj",
                operations=[MergeModulelist(dim=0)],
            )
        ]
    merge.append(
        per_expert_merge()(
            source_patterns="experts.*.down_proj.weight",
            target_patterns="experts.down_proj",
            operations=[MergeModulelist(dim=0)],
        )
    )
    _REGISTERED.add(model_type)
    register_checkpoint_conversion_mapping(model_type, own + merge, overwrite=True)
    return True
