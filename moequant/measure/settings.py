"""Calibration's settings: the recipe's `calibration:` section (its one definition) and the settings a
calibration run and the quantize pass read, whose defaults are that section's and the recipe's `gptq:`.

`moequant.plan.measurements.calibration_settings` builds the settings from a recipe; a library caller that
passes no recipe gets the recipe schema's defaults. The fields a recipe does not hold (device, batch
size, the formats measured, what the probe measures: derived from the recipe by apply) have their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from moequant.algorithms.registry import PLAIN_GPTQ, GptqOptions

DEFAULT_SENSITIVITY_FORMATS = ("fp8-channel", "int8-channel", "int4-g128-sym", "mxfp4", "int3-g128-sym", "int2-g64-sym")
MIN_ROUTED_TOKENS = 64  # below this an expert's own Hessian is too noisy: use the all-experts one
DEFAULT_DATASET = "builtin:mix"

# How a routed token counts in its expert's Hessian hessian_routed.{group} = sum_t c_t x_t x_t^T / sum_t c_t:
# "tokens": c = 1 (every routed token alike); "routing": c = r, the token's routing weight for the
# expert (MoEQuant's affinity-guided GPTQ). The all-tokens Hessians (all-experts coverage) stay
# unweighted. c = r^2 (the weight of the squared output error, since the expert's output reaches the
# layer multiplied by r) was measured too and dropped: it beat "tokens" on two of four runs and lost to
# "routing" on three (benchmarks/RESULTS.md, bench_quality.py).
HESSIAN_WEIGHTINGS = ("tokens", "routing")


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


_RECIPE = Calibration()


@dataclass
class CalibrationSettings:
    dataset: str = _RECIPE.dataset
    samples: int = _RECIPE.samples
    seq_len: int = _RECIPE.seq_len
    seed: int = 0  # the recipe's `seed`
    batch_size: int = 8
    all_experts: bool = _RECIPE.all_experts
    hessians: bool = True
    formats: tuple[str, ...] = DEFAULT_SENSITIVITY_FORMATS
    min_tokens: int = MIN_ROUTED_TOKENS
    allow_fewer: bool = False
    device: str = "cpu"
    # per-layer KL probe on this many samples (probe.py), held out when calibrate loads the data; 0: none
    probe_samples: int = _RECIPE.probe_samples
    # how the probe quantizes its layer: a registered algorithm it runs (probe.probe_algorithm_for), or
    # auto: the probe format's family default algorithm as the probe measures it (apply resolves auto
    # with the recipe's `algorithms:` before calibration)
    probe_algorithm: str = _RECIPE.probe_algorithm
    compute_dtype: str = _RECIPE.compute_dtype  # the layers' forward: auto | float32 | bfloat16
    save_hessians: bool = False  # also write the full [E, d, d] Hessians into stats/ (inspection; large)
    hessian_weighting: str = _RECIPE.hessian_weighting  # each routed token's weight in its expert's Hessian
    # how GPTQ rounds in the probe and the quantize pass: the recipe's `gptq:` section
    gptq: GptqOptions = field(default_factory=GptqOptions)
    # formats of the per-tensor probe (probe.run_tensor_probe: KL of each non-expert weight alone in
    # each), measured when a recipe lets the budget choose non-expert formats; (): none
    tensor_formats: tuple[str, ...] = ()
    # the KL probe also measures each projection alone (probe.py), for plans that choose a format
    # per (layer, projection): llama.cpp's
    probe_projections: bool = False

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
            )
        }
        # Fields added since the first fingerprint are written only away from what that fingerprint implied, so
        # statistics made before each was added keep their fingerprint: token weighting and GPTQ as published
        # (the first defaults; the recipe's defaults now add these fields)
        if self.hessian_weighting != "tokens":
            fields["hessian_weighting"] = self.hessian_weighting
        if self.gptq != PLAIN_GPTQ:  # likewise
            fields["gptq"] = [self.gptq.grid, self.gptq.refit]
        if self.gptq.grid == "searched":  # the first statistics held min/max sensitivities
            fields["sensitivity_grid"] = "searched"
        if self.tensor_formats:  # likewise
            fields["tensor_formats"] = list(self.tensor_formats)
        if self.probe_projections:  # likewise
            fields["probe_projections"] = True
        from moequant.algorithms.gpu_math import gpu_math_switches

        switches = gpu_math_switches()
        if switches:  # GPU math set away from its defaults by environment variables changes GPTQ's codes
            fields["gpu_math"] = switches
        return fields
