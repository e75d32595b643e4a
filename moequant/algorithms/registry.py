"""The quantization algorithms as the pipeline sees them: one small entry per algorithm, by name.

A plan row names its algorithm (the recipe's `algorithms:` map, else the format family's default);
calibration, the KL probe and the quantize pass look that name up here and ask the entry what it
needs and how it rounds, so none of them compares algorithm names. The numeric kernels stay in
their own modules (rtn.py, gptq.py, awq.py, refit*.py); an entry only joins them to the pipeline.

An entry's `quantize(weights, spec, hessian, options, device, label)` rounds a list of [E, out, in]
float32 stacks that read one input (gate and up, when `joins_gate_up(spec)`; else one stack) and
returns (a QuantizedTensor per stack, a report or None). With a report ({"fallbacks": {index of the
expert in the stack: why}, "damp": ...}), the quantize pass records it under the algorithm's name.

An algorithm that changes a whole layer's weights before they are rounded (AWQ) says so with `prepare_layer`
(the quantize pass calls it once per layer; what it reads and returns: layer.py), and one that cannot run
on some models or runs with `refusal` (precheck and the quantize pass ask it before any work).

A new algorithm is one `register(Algorithm(...))`; a recipe may then name it in `algorithms:`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict

from moequant.algorithms.gpu_math import GpuMath
from moequant.registry import Registry


class GptqOptions(BaseModel):
    """How GPTQ rounds (the quantize pass and the probe alike, algorithms.gptq.gptq_pass): the recipe's
    `gptq:` section. Quality and cost of each choice: benchmarks/bench_quality.py and bench_gptq.py."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # minmax: each group's scale from its largest weight; searched: the scale (and zero point) that
    # minimises the input-weighted error (formats.searched_fit)
    grid: Literal["minmax", "searched"] = "searched"
    # re-solve each row's scales by least squares for GPTQ's codes (algorithms/refit.py)
    refit: bool = True
    # how it computes on a GPU (TF32 products, the Cholesky routine, Triton kernels, CUDA graphs): gpu_math.py
    gpu_math: GpuMath = GpuMath()


PLAIN_GPTQ = GptqOptions(grid="minmax", refit=False)  # GPTQ as published: the min/max grid, no refit


def _never(spec) -> bool:
    return False


@dataclass(frozen=True)
class Algorithm:
    """One algorithm: what the pipeline must collect for it, and how it rounds (module docstring)."""

    name: str
    quantize: Callable  # (weights, spec, hessian, options, device, label) -> (quantized, report or None)
    # reads each expert's input Hessian (calibration's chosen one: stats.chosen_hessian); without one
    # (no statistics) the quantize pass rounds to nearest instead
    hessians: bool = False
    # the quantize pass collects the layer's input statistics for it (a forward of the layer)
    statistics: bool = False
    # (layer.LayerToPrepare) -> layer.PreparedLayer: changes the whole layer's weights before rounding (AWQ's
    # scales, folded into the norm, the router, the shared expert and up_proj), on float32 host copies
    prepare_layer: Callable | None = None
    prepare_tokens: int = 0  # the MoE block's input tokens (with their routing) the preparation reads, at most
    # (adapter, plan rows that name it, processes) -> why it cannot run there, or None; precheck asks with no
    # rows (the plan does not exist yet), the quantize pass with the plan's
    refusal: Callable | None = None
    # gate and up (one input) share one solve when both are in `spec` for the same experts
    joins_gate_up: Callable = _never
    # the algorithm the calibration KL probe measures this one's formats with (the probe runs no AWQ)
    probe: str = "rtn"
    options: type[BaseModel] | None = None  # its options: the recipe's section of the algorithm's name

    @property
    def scales_layer(self) -> bool:
        """Whether it prepares whole layers before rounding (then on host copies, the layer at once)."""
        return self.prepare_layer is not None


ALGORITHMS: Registry = Registry("algorithm", "'{name}' is not an algorithm; accepted: {accepted}", ValueError)


def register(algorithm: Algorithm) -> Algorithm:
    return ALGORITHMS.add(algorithm, algorithm.name)


def algorithm(name: str) -> Algorithm:
    """The registered algorithm `name` (a plan row's `algorithm`)."""
    return ALGORITHMS.find(name)


def probe_algorithms() -> tuple[str, ...]:
    """The algorithms the KL probe runs itself (the others it measures with their `probe`)."""
    return tuple(n for n, a in ALGORITHMS.items() if a.probe == n)


# ---------------------------------------------------------------------------------------------- entries


def _rtn(weights, spec, hessian, options, device, label):
    from moequant import formats

    return [formats.quantize(w, spec, name=label) for w in weights], None


def _gptq(weights, spec, hessian, options, device, label):
    from moequant import formats

    if spec.is_ggml:  # on the ggml type's grid, one projection at a time
        return [formats.quantize_ggml(w, spec, name=label, hessian=hessian) for w in weights], None
    from moequant.algorithms.gptq import gptq_pass_shared

    options = options or GptqOptions()
    qs, rep = gptq_pass_shared(
        weights, hessian, spec, device=device, grid=options.grid, refit=options.refit, gpu_math=options.gpu_math
    )
    return qs, {"fallbacks": rep.fallbacks(), "damp": rep.damp}


def _imatrix(weights, spec, hessian, options, device, label):
    """ggml types: round-to-nearest with the scale search weighted by diag(H)."""
    import torch

    from moequant import formats

    importance = torch.diagonal(hessian, dim1=-2, dim2=-1).float()
    return [formats.quantize_ggml(w, spec, name=label, importance=importance) for w in weights], None


register(Algorithm("rtn", _rtn))
register(
    Algorithm(
        "gptq",
        _gptq,
        hessians=True,
        statistics=True,
        joins_gate_up=lambda spec: not spec.is_ggml,
        probe="gptq",
        options=GptqOptions,
    )
)


def _awq_prepare(layer):
    from moequant.algorithms.awq_layer import prepare_layer

    return prepare_layer(layer)


def _awq_refusal(adapter, rows, processes):
    from moequant.algorithms.awq_layer import refusal

    return refusal(adapter, rows, processes)


# AWQ rounds to nearest once its preparation has scaled the layer (awq_layer.py; the search is awq.py)
register(
    Algorithm(
        "awq",
        _rtn,
        statistics=True,
        prepare_layer=_awq_prepare,
        prepare_tokens=65536,  # calibration tokens kept per layer for the shared gate/up scale search
        refusal=_awq_refusal,
    )
)
register(Algorithm("imatrix", _imatrix, hessians=True, statistics=True))
