"""Architecture adapters: one small file per MoE family, looked up by `model_type`.

Adding an architecture: subclass `Adapter` in a new file, list it in `ADAPTERS`.
"""

from __future__ import annotations

from moequant.arch.base import PROJECTIONS, ROLES, Adapter, Routing, TensorRole  # noqa: F401
from moequant.arch.deepseek import DeepseekV2Adapter, DeepseekV3Adapter
from moequant.arch.gpt_oss import GptOssAdapter
from moequant.arch.mixtral import MixtralAdapter
from moequant.arch.olmoe import OlmoeAdapter
from moequant.arch.qwen_moe import Qwen2MoeAdapter, Qwen3MoeAdapter
from moequant.errors import UserError

ADAPTERS: dict[str, type[Adapter]] = {
    t: cls
    for cls in (MixtralAdapter, Qwen2MoeAdapter, Qwen3MoeAdapter, DeepseekV2Adapter, DeepseekV3Adapter,
                OlmoeAdapter, GptOssAdapter)
    for t in cls.model_types
}


def supported_model_types() -> list[str]:
    return sorted(ADAPTERS)


def adapter_for(config: dict) -> Adapter:
    """The adapter for a config dict (from config.json); UserError for unknown model types."""
    model_type = config.get("model_type")
    if model_type not in ADAPTERS:
        raise UserError(
            f"model_type {model_type!r} is not supported; moequant supports: {', '.join(supported_model_types())}."
        )
    return ADAPTERS[model_type](with_defaults(config))


def with_defaults(config: dict) -> dict:
    """The config as written, completed with transformers' defaults for keys it leaves out.

    Keys the file names win; transformers' canonical spellings (e.g. `num_local_experts` for
    `num_experts`) are added beside them, so adapters can read either.
    """
    import logging

    from transformers import AutoConfig

    raw = {k: v for k, v in config.items() if k != "model_type"}
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
