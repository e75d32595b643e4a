"""What a recipe asks of calibration: the format keys it measures (every format the plan may give a routed
expert, and the non-expert formats a budget may choose) and the settings of a calibration run, built
from the recipe alone (`calibration:`, `gptq:`, `algorithms:`, `seed`) and the model's shapes."""

from __future__ import annotations

from moequant.io.checkpoint import open_checkpoint
from moequant.measure.settings import CalibrationSettings
from moequant.plan.recipe import Recipe, resolve_format
from moequant.targets import get_target


def sensitivity_formats(recipe: Recipe) -> tuple[str, ...]:
    """Every format key the plan may give a routed expert, so calibration measures each."""
    entries = [*recipe.experts.formats, *([recipe.experts.format] if recipe.experts.format else [])]
    return _quantized_keys(recipe, entries + [rule.format for rule in recipe.experts.rules or []])


def tensor_formats(recipe: Recipe) -> tuple[str, ...]:
    """The format keys the budget may give non-expert tensors (calibration's per-tensor probe measures each)."""
    return _quantized_keys(recipe, recipe.non_experts.formats) if recipe.experts.method == "budget" else ()


def _quantized_keys(recipe: Recipe, entries) -> tuple[str, ...]:
    """The keys of the quantized formats among a recipe's format entries, each once, in order."""
    keys = [spec.key for spec in (resolve_format(recipe, entry) for entry in entries) if spec.quantized]
    return tuple(dict.fromkeys(keys))


def calibration_settings(
    recipe: Recipe, device: str = "cpu", formats: tuple[str, ...] | None = None, ckpt=None
) -> CalibrationSettings:
    from moequant.measure.probe import auto_probe_algorithm

    c = recipe.calibration
    formats = formats or sensitivity_formats(recipe)
    non_expert_formats = tensor_formats(recipe)
    adapter = open_checkpoint(ckpt or recipe.model).adapter
    # the probe scales a budget's predicted losses; plans without a budget never read it. Its cost
    # grows with layers² (one stream per probed layer), so past PROBE_MAX_EXPERT_PARAMS routed-expert
    # parameters it runs only when the recipe asks for it by name
    probe_samples = c.probe_samples if recipe.experts.method == "budget" else 0
    if (
        probe_samples
        and "probe_samples" not in c.model_fields_set
        and adapter.routed_expert_params > PROBE_MAX_EXPERT_PARAMS
    ):
        probe_samples = 0
    # the probe's algorithm; auto: the registered algorithm the quantize pass will give the probe's format,
    # as the probe measures it (gptq where the recipe says gptq, else rtn: the probe runs no AWQ)
    probe_algorithm = c.probe_algorithm if probe_samples else "rtn"
    if probe_algorithm == "auto":
        shapes = [tuple(adapter.expert_shape(p)) for p in adapter.projections]
        probe_algorithm = auto_probe_algorithm(formats, shapes, recipe.algorithm_for)
    return CalibrationSettings(
        dataset=c.dataset,
        samples=c.samples,
        seq_len=c.seq_len,
        seed=recipe.seed,
        all_experts=c.all_experts,
        formats=formats,
        device=device,
        probe_samples=probe_samples,
        probe_algorithm=probe_algorithm,
        compute_dtype=c.compute_dtype,
        tensor_formats=non_expert_formats,
        hessian_weighting=c.hessian_weighting,
        hessian_prior=c.hessian_prior,
        gptq=recipe.gptq,
        probe_projections=bool(probe_samples) and get_target(recipe.target).granularity == "layer_proj",
    )


PROBE_MAX_EXPERT_PARAMS = 2 * 10**9  # the default probe's limit (routed-expert parameters)
