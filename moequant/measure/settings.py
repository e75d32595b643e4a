"""Calibration's settings: the recipe's `calibration:` section (its one definition) and the settings a
calibration run and the quantize pass read (CalibrationSettings: that section, extended by the recipe's
`seed` and `gptq:` and what apply derives from the recipe and the command).

`moequant.plan.measurements.calibration_settings` builds the settings from a recipe; a library caller that
passes no recipe gets the recipe schema's defaults.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moequant.algorithms.registry import GptqOptions
from moequant.errors import UserError, schema_refusal

DEFAULT_SENSITIVITY_FORMATS = ("fp8-channel", "int8-channel", "int4-g128-sym", "mxfp4", "int3-g128-sym", "int2-g64-sym")
MIN_ROUTED_TOKENS = 64  # below this an expert's own Hessian is too noisy: use the all-experts one
# Above it, an expert's own gate/up Hessian is shrunk toward the layer's all-token one as if HESSIAN_PRIOR x d
# tokens of the layer's input (d: its width) joined its n routed tokens: H = (n H_own + k H_all) / (n + k),
# k = HESSIAN_PRIOR d. n routed tokens estimate a d x d matrix poorly when n is not well above d (a DeepSeek-V3 or
# GLM-4.6 expert sees 2-3k of 65k calibration tokens at d = 5120-7168: its own Hessian is rank-deficient).
# Measured on the zoo models (benchmarks/RESULTS.md, Hessian prior, 2026-12-07); down's input (the expert's own
# activation) has no all-token Hessian unless every token runs through every expert, so it is left as it is.
HESSIAN_PRIOR = 1.0
DEFAULT_DATASET = "builtin:mix"

# How a routed token counts in its expert's Hessian hessian_routed.{group} = sum_t c_t x_t x_t^T / sum_t c_t:
# "tokens": c = 1 (every routed token alike); "routing": c = r, the token's routing weight for the
# expert (MoEQuant's affinity-guided GPTQ). The all-tokens Hessians (all-experts coverage) stay
# unweighted. c = r^2 (the weight of the squared output error, since the expert's output reaches the
# layer multiplied by r) was measured too and dropped: it beat "tokens" on two of four runs and lost to
# "routing" on three (benchmarks/RESULTS.md, bench_quality.py).
HESSIAN_WEIGHTINGS = ("tokens", "routing")


class HessianRule(NamedTuple):
    """Which Hessian an expert's rounding reads (stats.chosen_hessian): its own routed-token one when it has at
    least `min_tokens` routed tokens, else the all-token one; an own gate/up Hessian shrunk toward the layer's by
    `prior` tokens per input column (HESSIAN_PRIOR's note). One value, so the callers pass the rule, not its parts."""

    min_tokens: int = MIN_ROUTED_TOKENS
    prior: float = HESSIAN_PRIOR


class Calibration(BaseModel):
    """The recipe's `calibration:` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: str = DEFAULT_DATASET
    samples: int = Field(128, gt=0)
    seq_len: int = Field(512, gt=0)
    all_experts: bool = True
    # per-layer KL probe (moequant.measure.probe) on this many further samples of the calibration split,
    # held out from the statistics; 0 turns it off. 32: on tiny-mixtral 8 samples ranked the layers by
    # noise (the half-way vLLM plan was the 4th best of 6), 16 and 32 picked the best (probe.py)
    probe_samples: int = Field(32, ge=0)
    # how the probe quantizes its layer; auto: as the quantize pass will (the registered algorithm of the
    # probe format, measured as that algorithm's `probe` says: gptq where the recipe quantizes the probe
    # format with GPTQ, else rtn)
    probe_algorithm: Literal["auto", "rtn", "gptq"] = "auto"
    # the layers' forward: auto = bf16 on CUDA (the checkpoint's dtype), float32 on the CPU
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # each routed token's weight in its expert's Hessian (GPTQ, sensitivity, probe): routing = its
    # routing weight to that expert (MoEQuant's affinity-guided GPTQ), tokens = 1 (measured:
    # benchmarks/bench_quality.py, where routing lowers GPTQ's KL on both bundled models)
    hessian_weighting: Literal[HESSIAN_WEIGHTINGS] = "routing"
    # an expert's own gate/up Hessian shrunk toward the layer's all-token one by this many tokens per input
    # column (HESSIAN_PRIOR's note); 0: its own routed tokens alone
    hessian_prior: float = Field(HESSIAN_PRIOR, ge=0)


# Which set of fields fingerprint_fields writes; raise it when a field is added or changes meaning. Statistics of
# another version are made again once (calibrate says so) instead of being refused as other settings.
# 1 (unnumbered): fields added after the first were written only away from their first defaults.
FINGERPRINT_VERSION = 3


class CalibrationSettings(Calibration):
    """A calibration run's and the quantize pass's settings: the recipe's `calibration:` section (inherited, so
    its fields and defaults are defined once), the recipe's `seed` and `gptq:`, and what apply derives from the
    recipe and the command (device, batch size, the formats measured, what the probe measures)."""

    seed: int = 0  # the recipe's `seed`
    # any registered algorithm the probe runs (probe.probe_algorithm_for checks), not only the recipe's rtn / gptq
    probe_algorithm: str = "auto"
    batch_size: int = 8
    hessians: bool = True
    formats: tuple[str, ...] = DEFAULT_SENSITIVITY_FORMATS
    min_tokens: int = MIN_ROUTED_TOKENS
    allow_fewer: bool = False
    device: str = "cpu"
    save_hessians: bool = False  # also write the full [E, d, d] Hessians into stats/ (inspection; large)
    # how GPTQ rounds in the probe and the quantize pass: the recipe's `gptq:` section
    gptq: GptqOptions = GptqOptions()
    # formats of the per-tensor probe (probe.run_tensor_probe: KL of each non-expert weight alone in
    # each), measured when a recipe lets the budget choose non-expert formats; (): none
    tensor_formats: tuple[str, ...] = ()
    # the KL probe also measures each projection alone (probe.py), for plans that choose a format
    # per (layer, projection): llama.cpp's
    probe_projections: bool = False

    @property
    def hessian_rule(self) -> HessianRule:
        return HessianRule(self.min_tokens, self.hessian_prior)

    def __init__(self, **fields):
        try:
            super().__init__(**fields)
        except ValidationError as error:  # a library caller's bad value: one sentence, as a recipe's is
            raise UserError(f"calibration settings: {schema_refusal(error.errors()[0])}") from None

    @property
    def gptq_grid(self) -> str:
        return self.gptq.grid

    @property
    def gptq_refit(self) -> bool:
        return self.gptq.refit

    @property
    def algorithm_options(self) -> dict:
        """{algorithm name: its options} for the registered algorithms' `quantize` (the others: defaults)."""
        return {"gptq": self.gptq}

    def fingerprint_fields(self) -> dict:
        """Everything here that decides the statistics and the codes, with FINGERPRINT_VERSION; the recipe's
        gptq.gpu_math switches set away from their defaults too (moequant.algorithms.gpu_math), as they change
        GPTQ's codes ({} at the defaults, as before the switches were recipe keys)."""
        fields = {
            k: getattr(self, k)
            for k in (
                "dataset",
                "samples",
                "seq_len",
                "seed",
                "all_experts",
                "hessians",
                "formats",
                "min_tokens",
                "allow_fewer",
                "probe_samples",
                "probe_algorithm",
                "compute_dtype",
                "save_hessians",
                "hessian_weighting",
                "hessian_prior",
                "probe_projections",
            )
        }
        return {
            "version": FINGERPRINT_VERSION,
            **fields,
            "gptq": [self.gptq.grid, self.gptq.refit],
            "tensor_formats": list(self.tensor_formats),
            "gpu_math": self.gptq.gpu_math.changed(),
        }
