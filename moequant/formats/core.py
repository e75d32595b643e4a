"""Quantize / dequantize for every format, on [out, in] or stacked [E, out, in] weights.

Plain tensor math, vectorised over experts, rows and groups; CPU or CUDA, any float dtype in
(the arithmetic is float32; every scale is rounded once to its storage dtype). Scales are per
expert always: a [E, out, in] weight gets exactly the scales that E separate [out, in] calls would give.

This module is shape-generic: it lays a weight out so that the elements sharing one scale sit on
the last axis (per row, per group, per 128x128 block, per tensor), and asks the format's family
(`spec.family`, one file per family in this package) for the element math: `fit` (the scale
rule), `encode`, `decode`. The scale rules are documented there (integer.py, fp8.py, mxfp4.py,
nvfp4.py); ggml block types quantize whole rows with their own search (ggml.py).

Codes are signed int8 for integer formats, float8_e4m3fn for fp8, uint8 e2m1 codes (0..15,
one per byte, unpacked) for mxfp4 / nvfp4. Rounding is half-to-even everywhere. Values beyond
a format's range saturate to its largest code (fp8 +-448, e2m1 +-6, int clamps). All-zero
groups get scale 0 (fp8, int; e8m0 2^-127 for mxfp4), codes equal to the zero point, and exact
zeros back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from moequant.errors import UserError
from moequant.formats import search_triton
from moequant.formats.specs import FormatSpec, _label, check_shape, get_format
from moequant.formats.specs import nbytes as _nbytes


@dataclass(frozen=True)
class QuantizedTensor:
    """Codes and scales of one weight ([out, in]) or one stack of experts ([E, out, in]).

    codes:        int8 (int formats, signed), float8_e4m3fn (fp8), uint8 e2m1 codes (mxfp4/nvfp4),
                  bfloat16 (bf16); same shape as the weight
    scales:       fp32 [..., out, 1] (fp8-channel) | [..., ceil(out/128), ceil(in/128)] (fp8-block)
                  | [..., 1, 1] (fp8-tensor); bf16 [..., out, 1] (int8) | [..., out, in/g] (intB);
                  uint8 e8m0 [..., out, in/32] (mxfp4); float8_e4m3fn [..., out, in/16] (nvfp4)
    zeros:        int8 [..., out, in/g] signed zero points (asymmetric int), else None
    global_scale: nvfp4 only: fp32 [] (2-D) or [E], the divisor g of the block scales
    """

    spec: FormatSpec
    shape: tuple
    codes: torch.Tensor
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of codes + scales + zero points as compressed-tensors stores them
        (formats.nbytes(spec, shape, symmetric_zeros=True) for GPTQ / AWQ, which add zeros to symmetric formats)."""
        return _nbytes(self.spec, self.shape)

    @property
    def bits_per_weight(self) -> float:
        return self.spec.bits_per_weight(self.shape)

    @property
    def num_experts(self) -> int | None:
        return self.shape[0] if len(self.shape) == 3 else None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)

    def expert(self, e: int) -> "QuantizedTensor":
        """The [out, in] QuantizedTensor of expert `e` of a stacked one (views, no copy)."""
        if len(self.shape) != 3:
            raise ValueError("expert() needs a stacked [E, out, in] QuantizedTensor")
        pick = lambda t: None if t is None else t[e]  # noqa: E731
        return QuantizedTensor(
            self.spec,
            tuple(self.shape[1:]),
            self.codes[e],
            pick(self.scales),
            pick(self.zeros),
            pick(self.global_scale),
        )

    def to(self, device) -> "QuantizedTensor":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(
            self,
            codes=self.codes.to(device),
            scales=move(self.scales),
            zeros=move(self.zeros),
            global_scale=move(self.global_scale),
        )


def stack_experts(qs: list) -> QuantizedTensor:
    """[out, in] QuantizedTensors of one format -> one stacked [E, out, in] QuantizedTensor."""
    first = qs[0]
    if any(q.spec != first.spec or q.shape != first.shape for q in qs):
        raise ValueError("stack_experts needs QuantizedTensors of one format and one shape")
    st = lambda ts: None if ts[0] is None else torch.stack(ts)  # noqa: E731
    return QuantizedTensor(
        first.spec,
        (len(qs),) + tuple(first.shape),
        st([q.codes for q in qs]),
        st([q.scales for q in qs]),
        st([q.zeros for q in qs]),
        st([q.global_scale for q in qs]),
    )


# ---------------------------------------------------------------- entry points


def quantize(
    weight: torch.Tensor,
    spec,
    *,
    name: str | None = None,
    global_scale=None,
    grid: str = "minmax",
    importance: torch.Tensor | None = None,
    triton: bool = True,
    **params,
) -> QuantizedTensor:
    """Quantize `weight` ([out, in] or [E, out, in], any float dtype, CPU or CUDA) to `spec`.

    spec: a FormatSpec, a format name with its parameters (quantize(w, "int4", group_size=64)),
    or a key ("int4-g64-asym"). name: the tensor's name, used in error messages.
    global_scale: nvfp4 only, to impose the per-expert global scale(s) (shape [] or [E]);
    default 448 * 6 / amax of each expert.
    grid: "minmax" (the rules in the module doc) or "searched" (integer formats: per group the
    scale / zero point of least importance-weighted error, `searched_fit`).
    importance: per input column ([in] or [E, in], the inputs' second moments), weighting the
    searched grid's error (ggml types: their scale search); None weighs all columns alike.
    triton: the searched grid may run as a Triton kernel on CUDA (search_triton; the recipe's gptq.gpu_math.triton).
    """
    spec = get_format(spec, **params)
    if spec.is_ggml:
        return quantize_ggml(weight, spec, name=name, importance=importance)
    if grid not in GRIDS:
        raise UserError("unknown grid %r; accepted: %s" % (grid, ", ".join(GRIDS)))
    if grid == "searched" and not spec.is_int:
        raise UserError("the searched grid applies to integer formats (int8, int4, int3, int2), not %s" % spec.key)
    if importance is not None and grid != "searched":
        raise UserError("importance weights the searched grid only; pass grid='searched' (format %s)" % spec.key)
    if global_scale is not None and not spec.family.global_scale:
        raise UserError("global_scale applies to nvfp4 only, not %s" % spec.key)
    if (
        spec.quantized
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 3
        and weight.shape[0] > 1
        and weight.numel() > _chunk_elements(weight.device)
    ):
        return _quantize_in_expert_chunks(weight, spec, name, global_scale, grid, importance, triton)
    x = _prepare(weight, spec, name)
    if not spec.quantized:
        return QuantizedTensor(spec, tuple(weight.shape), weight.to(torch.bfloat16))
    gs = _global_scale(spec, x, global_scale, name)
    xg = _reduction_view(spec, x)
    if grid == "searched":
        scales, zeros = searched_fit(spec, xg, _importance_view(spec, importance, x, name), name, triton)
    else:
        scales, zeros = _fit(spec, xg, _bcast_gs(gs, xg.dim() - 1), name)
    if spec.granularity == "block":
        codes = _encode(spec, x, _expand_block(scales, spec.group_size, *x.shape[-2:]), None, None)
    else:
        view = _scale_view(spec, x)
        codes = _encode(spec, view, _bcast(spec, scales), _bcast(spec, zeros), _bcast_gs(gs, view.dim()))
        codes = codes.reshape(x.shape)
    return QuantizedTensor(spec, tuple(weight.shape), codes, scales, zeros, gs)


# Stacks larger than this many elements (CPU; 8x more on accelerators, where launches cost more
# than memory) are quantized a few experts at a time: the float32 working copies and temporaries
# stay bounded while each chunk is still one vectorised computation. Results are identical,
# since every scale is per expert.
CHUNK_ELEMENTS = 1 << 24


def _chunk_elements(device: torch.device) -> int:
    return CHUNK_ELEMENTS if device.type == "cpu" else 8 * CHUNK_ELEMENTS


def _quantize_in_expert_chunks(weight, spec, name, global_scale, grid, importance, triton) -> QuantizedTensor:
    per = max(1, _chunk_elements(weight.device) // weight[0].numel())
    # per-expert importance [E, in] is sliced with its experts; [in] (or [1, in]) is shared by all
    per_expert = importance is not None and importance.dim() == 2 and importance.shape[0] > 1
    gs = None if global_scale is None else torch.as_tensor(global_scale, dtype=torch.float32, device=weight.device)
    if gs is not None and tuple(gs.shape) != (weight.shape[0],):
        raise UserError(
            "nvfp4 global_scale for %s must have shape %s, got %s" % (_label(name), (weight.shape[0],), tuple(gs.shape))
        )
    parts = [
        quantize(
            weight[i : i + per],
            spec,
            name=name,
            global_scale=None if gs is None else gs[i : i + per],
            grid=grid,
            importance=importance[i : i + per] if per_expert else importance,
            triton=triton,
        )
        for i in range(0, weight.shape[0], per)
    ]
    cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
    return QuantizedTensor(
        spec,
        tuple(weight.shape),
        cat([p.codes for p in parts]),
        cat([p.scales for p in parts]),
        cat([p.zeros for p in parts]),
        cat([p.global_scale for p in parts]),
    )


def quantize_ggml(
    weight: torch.Tensor, spec, *, name: str | None = None, importance=None, hessian=None
) -> QuantizedTensor:
    """A ggml block type: codes are the packed blocks (uint8 [..., out, row bytes]); importance
    per input column ([in] or [E, in], the inputs' second moments) weights the scale search;
    a Hessian ([in, in] or [E, in, in]) instead runs GPTQ on the type's grid (ggml.gptq_tensor)."""
    spec = get_format(spec)
    x = _prepare(weight, spec, name)
    check_finite(_absmax(x.flatten(), 0), x, name)
    codes = spec.family.quantize(x, spec, importance=importance, hessian=hessian)
    return QuantizedTensor(spec, tuple(weight.shape), codes.to(weight.device))


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Codes and scales -> weight in `dtype` (computed in float32, then cast once)."""
    spec = q.spec
    if spec.is_ggml:
        return spec.family.dequantize(q.codes, spec, q.shape).to(device=q.codes.device, dtype=dtype)
    if not spec.quantized:
        return q.codes.to(dtype)
    if spec.granularity == "block":
        w = _decode(spec, q.codes, _expand_block(q.scales, spec.group_size, *q.codes.shape[-2:]), None, None)
        return w.to(dtype)
    view = _scale_view(spec, q.codes)
    w = _decode(spec, view, _bcast(spec, q.scales), _bcast(spec, q.zeros), _bcast_gs(q.global_scale, view.dim()))
    return w.reshape(q.codes.shape).to(dtype)


def qdq(weight: torch.Tensor, spec, *, name: str | None = None, **params) -> torch.Tensor:
    """Quantize then dequantize (round-to-nearest), in the weight's dtype."""
    return quantize(weight, spec, name=name, **params).dequantize(weight.dtype)


# ---------------------------------------------------------------- GPTQ-style column quantizer


@dataclass(frozen=True)
class ColumnParams:
    """Scales (and zero points) of one group of input columns, shaped for [..., out, k] columns:
    [..., out, 1] for group / channel formats, [..., 1, 1] for fp8-tensor, [..., ceil(out/128), 1]
    for fp8-block."""

    scales: torch.Tensor
    zeros: torch.Tensor | None = None


class ColumnQuantizer:
    """Quantize columns with fixed scales, for GPTQ-style algorithms.

    Create it with the whole (original) weight; for nvfp4 this fixes the per-expert global
    scale. Walk the input columns in groups of `group_width` (fp8-block's last group may be
    narrower when in % 128 != 0): `fit` the group's scales from the current (error-updated)
    columns, then `quantize` / `dequantize` / `qdq` any of its columns with those scales, and
    finally `assemble` the codes and the per-group params into a QuantizedTensor. On an
    unchanged weight this gives exactly `quantize(weight, spec)`.
    """

    def __init__(
        self,
        spec,
        weight: torch.Tensor,
        *,
        name: str | None = None,
        global_scale=None,
        grid: str = "minmax",
        triton: bool = True,
    ):
        self.spec = get_format(spec)
        if not self.spec.quantized:
            raise UserError("format bf16 keeps weights as they are; there is nothing to quantize column by column")
        if grid not in GRIDS:
            raise UserError("unknown grid %r; accepted: %s" % (grid, ", ".join(GRIDS)))
        if grid == "searched" and not (self.spec.is_int and self.spec.granularity in ("group", "channel")):
            raise UserError(
                "the searched grid applies to integer formats (int8, int4, int3, int2), not %s" % self.spec.key
            )
        self.grid = grid
        self.triton = triton  # the searched grid's Triton kernel may run (search_triton)
        x = _prepare(weight, self.spec, name)
        check_finite(_absmax(x.flatten(), 0), x, name)  # fail before any column work, as quantize() does
        self.name = name
        self.shape = tuple(weight.shape)
        self.rows, self.cols = self.shape[-2:]
        self.group_width = self.spec.group_size if self.spec.granularity in ("group", "block") else self.cols
        self.global_scale = _global_scale(self.spec, x, global_scale, name)

    def fit(self, w_group: torch.Tensor, importance: torch.Tensor | None = None) -> ColumnParams:
        """Scales / zero points of one group from its columns [..., out, k], k <= group_width.
        With the searched grid, importance (broadcasting against w_group, e.g. [..., 1, k]: the
        group's columns' diag(H)) weighs each element's error in the search."""
        x = w_group.to(torch.float32)
        spec = self.spec
        if self.grid == "searched":
            return ColumnParams(
                *searched_fit(
                    spec,
                    x.unsqueeze(-2),
                    None if importance is None else importance.unsqueeze(-2),
                    self.name,
                    self.triton,
                )
            )
        if spec.granularity == "block":
            b = spec.group_size
            pad = -x.shape[-2] % b
            xp = F.pad(x, (0, 0, 0, pad)) if pad else x
            xg = xp.unflatten(-2, (xp.shape[-2] // b, b)).flatten(-2)  # [..., nbo, b * k]
            scales, zeros = _fit(spec, xg, None, self.name)
            return ColumnParams(scales.unsqueeze(-1), None)
        if spec.granularity == "tensor":
            xg = x.flatten(-2)[..., None, None, :]
        else:
            xg = x.unsqueeze(-2)
        gs = None if self.global_scale is None else self.global_scale.reshape(self.global_scale.shape + (1, 1))
        scales, zeros = _fit(spec, xg, gs, self.name)
        return ColumnParams(scales, zeros)

    def _column_scales(self, params: ColumnParams) -> torch.Tensor:
        if self.spec.granularity == "block":
            return params.scales.repeat_interleave(self.spec.group_size, dim=-2)[..., : self.rows, :]
        return params.scales

    def _gs(self, ndim: int):
        return _bcast_gs(self.global_scale, ndim)

    def quantize(self, w_cols: torch.Tensor, params: ColumnParams) -> torch.Tensor:
        """Codes of columns [..., out, k] under fixed params."""
        x = w_cols.to(torch.float32)
        return _encode(self.spec, x, self._column_scales(params), params.zeros, self._gs(x.dim()))

    def dequantize(self, codes: torch.Tensor, params: ColumnParams) -> torch.Tensor:
        """float32 values of column codes [..., out, k] under fixed params."""
        return _decode(self.spec, codes, self._column_scales(params), params.zeros, self._gs(codes.dim()))

    def qdq(self, w_cols: torch.Tensor, params: ColumnParams) -> torch.Tensor:
        """Quantize-dequantize columns with fixed params, returned in w_cols' dtype."""
        return self.dequantize(self.quantize(w_cols, params), params).to(w_cols.dtype)

    def assemble(self, codes, params_list) -> QuantizedTensor:
        """Codes (one tensor [..., out, in], or a list of column blocks in order) and the params
        of every group in order -> the QuantizedTensor."""
        if not isinstance(codes, torch.Tensor):
            codes = torch.cat(list(codes), dim=-1)
        if tuple(codes.shape) != self.shape:
            raise ValueError("assembled codes have shape %s, expected %s" % (tuple(codes.shape), self.shape))
        params_list = list(params_list)
        n_groups = math.ceil(self.cols / self.group_width)
        if len(params_list) != n_groups:
            raise ValueError("got params for %d groups, expected %d" % (len(params_list), n_groups))
        scales = torch.cat([p.scales for p in params_list], dim=-1)
        zeros = None if params_list[0].zeros is None else torch.cat([p.zeros for p in params_list], dim=-1)
        return QuantizedTensor(self.spec, self.shape, codes, scales, zeros, self.global_scale)


def column_quantizer(
    spec, weight: torch.Tensor, *, name: str | None = None, global_scale=None, grid: str = "minmax", triton=True
) -> ColumnQuantizer:
    """A ColumnQuantizer for `weight` ([out, in] or [E, out, in]) in format `spec`."""
    return ColumnQuantizer(spec, weight, name=name, global_scale=global_scale, grid=grid, triton=triton)


# ---------------------------------------------------------------- internals


def _prepare(weight, spec: FormatSpec, name) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise UserError(
            "%s must be a floating-point tensor, got %s" % (_label(name), getattr(weight, "dtype", type(weight)))
        )
    if weight.dim() not in (2, 3):
        raise UserError(
            "%s has shape %s; accepted: [out, in] or [experts, out, in]" % (_label(name), tuple(weight.shape))
        )
    check_shape(spec, weight.shape, name)
    if not spec.quantized:
        check_finite(_absmax(weight.flatten().float(), 0), weight, name)
        return weight
    return weight.to(torch.float32)


def check_finite(stat: torch.Tensor, x: torch.Tensor, name) -> None:
    """Reductions (amax / amin) propagate NaN and Inf, so checking them covers the whole weight."""
    if not bool(torch.isfinite(stat).all()):
        bad = x.to(torch.float32)
        raise UserError(
            "%s contains %d NaN and %d infinite values; only finite weights can be quantized"
            % (_label(name), int(torch.isnan(bad).sum()), int(torch.isinf(bad).sum()))
        )


def _global_scale(spec: FormatSpec, x: torch.Tensor, given, name):
    """The per-expert fp32 global scale of formats that have one (nvfp4), given or from each expert's amax."""
    if not spec.family.global_scale:
        if given is not None:
            raise UserError("global_scale applies to nvfp4 only, not %s" % spec.key)
        return None
    lead = x.shape[:-2]
    if given is not None:
        g = torch.as_tensor(given, dtype=torch.float32, device=x.device)
        if g.numel() == 1 and not lead:
            g = g.reshape(())
        if tuple(g.shape) != tuple(lead) or not bool((torch.isfinite(g) & (g > 0)).all()):
            raise UserError(
                "nvfp4 global_scale for %s must be positive, finite and of shape %s, got %s"
                % (_label(name), tuple(lead), tuple(g.shape))
            )
        return g
    return spec.family.default_global_scale(absmax_checked(x.flatten(-2), name))


def _importance_view(spec: FormatSpec, importance, x: torch.Tensor, name):
    """Per-column importance ([in] or [E, in]) shaped to broadcast against _reduction_view(spec, x)."""
    if importance is None:
        return None
    imp = torch.as_tensor(importance, dtype=torch.float32, device=x.device)
    cols = x.shape[-1]
    if (
        imp.dim() not in (1, 2)
        or imp.shape[-1] != cols
        or (imp.dim() == 2 and (x.dim() != 3 or imp.shape[0] not in (1, x.shape[0])))
    ):
        raise UserError(
            "importance for %s must have shape [%d] or [experts, %d] matching the weight %s, got %s"
            % (_label(name), cols, cols, tuple(x.shape), tuple(imp.shape))
        )
    if not bool((torch.isfinite(imp) & (imp >= 0)).all()):
        raise UserError("importance for %s must be finite and non-negative" % _label(name))
    if imp.dim() == 2:
        imp = imp[:, None, :]  # [E, 1 (rows), in]
    if spec.granularity == "group":
        return imp.unflatten(-1, (cols // spec.group_size, spec.group_size))
    return imp.unsqueeze(-2)  # channel: [..., 1, 1, in]


def _reduction_view(spec: FormatSpec, x: torch.Tensor) -> torch.Tensor:
    """View of x whose last axis holds the elements that share one scale."""
    rows, cols = x.shape[-2:]
    if spec.granularity == "group":
        return x.unflatten(-1, (cols // spec.group_size, spec.group_size))
    if spec.granularity == "channel":
        return x.unsqueeze(-2)  # [..., out, 1, in]
    if spec.granularity == "tensor":
        return x.flatten(-2)[..., None, None, :]  # [..., 1, 1, out*in]
    b = spec.group_size  # 128x128 blocks, zero-padded at the ragged edges (zeros do not change amax)
    xp = F.pad(x, (0, -cols % b, 0, -rows % b))
    nbo, nbi = xp.shape[-2] // b, xp.shape[-1] // b
    return xp.unflatten(-1, (nbi, b)).unflatten(-3, (nbo, b)).transpose(-3, -2).flatten(-2)  # [..., nbo, nbi, b*b]


def _scale_view(spec: FormatSpec, t: torch.Tensor) -> torch.Tensor:
    """View of a [..., out, in] tensor in which per-group scales broadcast with one trailing axis."""
    if spec.granularity == "group":
        return t.unflatten(-1, (t.shape[-1] // spec.group_size, spec.group_size))
    return t


def _bcast(spec: FormatSpec, s):
    return None if s is None else (s.unsqueeze(-1) if spec.granularity == "group" else s)


def _bcast_gs(gs, ndim: int):
    return None if gs is None else gs.reshape(gs.shape + (1,) * (ndim - gs.dim()))


def _expand_block(scales: torch.Tensor, b: int, rows: int, cols: int) -> torch.Tensor:
    return scales.repeat_interleave(b, dim=-2)[..., :rows, :].repeat_interleave(b, dim=-1)[..., :cols]


def _absmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """max |x| along `dim` without a |x| temporary (NaN propagates; +0 for all-zero groups).
    Two plain reductions measured faster than torch.aminmax or abs().amax on CPU."""
    return torch.maximum(x.amax(dim), -x.amin(dim)).abs()


def absmax_checked(xg: torch.Tensor, name) -> torch.Tensor:
    """max |x| over the last axis, refusing NaN / Inf (which the reduction propagates)."""
    amax = _absmax(xg, -1)
    check_finite(amax, xg, name)
    return amax


def _fit(spec: FormatSpec, xg: torch.Tensor, gs, name):
    """Scales (and zero points) over the last axis of xg -> tensors of shape xg.shape[:-1]."""
    return spec.family.fit(spec, xg, gs, name)


def _encode(spec: FormatSpec, x: torch.Tensor, s, z, gs) -> torch.Tensor:
    """float32 values -> codes, with scales (zero points, global scale) broadcast against x.
    A zero scale (all-zero group) divides by +inf instead, so its codes are +-0 (the zero point)."""
    return spec.family.encode(spec, x, s, z, gs)


def _decode(spec: FormatSpec, codes: torch.Tensor, s, z, gs) -> torch.Tensor:
    """codes -> float32 values."""
    return spec.family.decode(spec, codes, s, z, gs)


# ---------------------------------------------------------------- searched integer grids

GRIDS = ("minmax", "searched")
# Candidates per group of the searched grid. Symmetric: the scale amax / d for divisors d from
# qmax to 1.6 qmax (clipping up to 37% of amax), the -2^(B-1) end level (d = 2^(B-1)) and the
# default d = qmax + 1/2. Asymmetric: (max - min) / (2^B - 1 + delta) for delta in [-1, 1] on the
# group's own min, as llama.cpp's make_qkx2_quants searches its k-quant mins. Every candidate is
# also refitted by weighted least squares on its own codes (llama.cpp's rule too).
SEARCH_STEPS = 21


def searched_fit(
    spec, xg: torch.Tensor, importance: torch.Tensor | None = None, name: str | None = None, triton: bool = True
):
    """`_search`'s scales (and zero points), and for symmetric group formats the sign of each
    group's scale too: the two's complement grid -2^(B-1)..2^(B-1)-1 has one more level below zero
    than above, and a negative scale puts that level on the positive side, so a group whose extreme
    element is positive (or whose error is smaller mirrored) takes -s with the codes of -x. Both
    signs are searched together (the mirrored search is the search on -x, see `_search`) and each
    group keeps the one with the smaller error, its codes as `_encode` gives them, ties positive. No
    byte more: the scale is a bf16 number either way, and every dequantizer multiplies by it
    (w = q * s); on tiny-deepseek-v3 it cuts the importance-weighted round-to-nearest error of
    int4-g32-sym by 12% (benchmarks/RESULTS.md, bench_quality.py: symmetric scale signs). triton=False: the
    torch loop even where the Triton kernel applies."""
    spec = get_format(spec)
    return _search(spec, xg, importance, name, signed=signed_scales(spec), triton=triton)


def signed_scales(spec) -> bool:
    """Whether the searched grid chooses each group's scale sign: symmetric integer group formats."""
    return spec.is_int and spec.symmetric and spec.granularity == "group"


def _symmetric_error(spec, x: torch.Tensor, w: torch.Tensor | None, s: torch.Tensor) -> torch.Tensor:
    """sum w (x - dequantized)^2 per group of a symmetric format, codes as `_encode` gives them."""
    sc = s.to(torch.float32).unsqueeze(-1)
    d = x - _encode(spec, x, sc, None, None).to(torch.float32) * sc
    d = d.square_()
    return (d if w is None else w * d).sum(-1)


def _choose_sign(spec, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, s_mirrored: torch.Tensor) -> torch.Tensor:
    """Per group s, or -s_mirrored (the search on -x) where its error is strictly smaller, the errors
    on the codes `_encode` stores."""
    better = _symmetric_error(spec, x, w, -s_mirrored) < _symmetric_error(spec, x, w, s)
    return torch.where(better, -s_mirrored, s)


def _search(
    spec, xg: torch.Tensor, importance: torch.Tensor | None = None, name: str | None = None, signed=False, triton=True
):
    """Scales (and zero points) over the last axis of xg ([..., k] elements per group) that minimise
    sum_i importance_i * (x_i - dequantized_i)^2 over a candidate set that contains the format's
    own min/max rule (so the result is never worse than `_fit`'s on that objective).

    Integer group / channel formats only. importance broadcasts against xg (the inputs' second
    moments per column, i.e. diag(H)); None weighs every element alike. Scales are stored (bf16)
    before their codes and error are computed, as everywhere else. Returns (scales, zeros)
    shaped xg.shape[:-1], like `_fit`.

    A candidate's error takes an element's code as round(x * (1 / s)) with 1 / s rounded once per
    group, not round(x / s) as `_encode`: one IEEE division per group instead of one per element
    and candidate, which bound the search. The two differ only where x / s lies within a rounding
    of a half-integer, where either code has the same error to that rounding, so the chosen scale
    is the same up to ties (tests/test_quality_grids.py measures it against the division). The
    codes a least-squares candidate is fitted on stay divisions: they define the candidate.
    The codes of the chosen scale are always `_encode`'s.

    signed (symmetric formats): each group's scale sign too, `_choose_sign` between this search and
    the search on -x. Rounding half to even is odd, so on -x every candidate's codes are the negated
    codes of x clamped to the mirrored range -(2^(B-1)-1)..2^(B-1), and its error and least-squares
    refit are those of x on that range, bit for bit: one rounding per candidate serves both signs,
    in the torch loop and in the Triton kernel (which makes the choice too)."""
    spec = get_format(spec)
    if not spec.is_int:
        raise UserError("the searched grid applies to integer formats (int8, int4, int3, int2), not %s" % spec.key)
    x = xg.to(torch.float32)
    w = torch.ones_like(x) if importance is None else importance.to(torch.float32).expand_as(x)
    qmin, qmax = -(2 ** (spec.bits - 1)), 2 ** (spec.bits - 1) - 1
    best_s, best_z = _fit(spec, x, None, name)
    divisors = (
        torch.linspace(qmax, 1.6 * qmax, SEARCH_STEPS).tolist() + [qmax + 0.5, -qmin]
        if spec.symmetric
        else [float(2**spec.bits - 1) + d for d in torch.linspace(-1.0, 1.0, SEARCH_STEPS).tolist()]
    )
    # candidate = spread * (1 / divisor), 1 / divisor in float32: what torch computes on CUDA for a
    # tensor divided by a Python number, here on every device alike
    factors = 1.0 / torch.tensor(divisors, dtype=torch.float32)
    mirrored = signed and spec.symmetric
    if triton and search_triton.usable(spec, x):  # every candidate of every group in one kernel (same arithmetic)
        return search_triton.searched_fit_triton(spec, x, importance, best_s, best_z, factors, mirrored)
    factors = factors.tolist()
    # the code ranges searched: the format's own, and the mirrored one for the search on -x
    ranges = [(qmin, qmax), (-qmax, -qmin)] if mirrored else [(qmin, qmax)]

    def errors(s, z, which):
        """{range index: the candidate's error on that range} for the ranges in `which`: one rounding."""
        sc = s.to(torch.float32)
        y = (x * torch.where(sc > 0, 1.0 / torch.where(sc > 0, sc, 1.0), 0.0).unsqueeze(-1)).round_()
        zc = None if z is None else z.to(torch.float32).unsqueeze(-1)
        if zc is not None:
            y.add_(zc)
        out = {}
        for i in which:
            back = y.clamp(*ranges[i])
            if zc is not None:
                back.sub_(zc)
            out[i] = (w * (x - back.mul_(sc.unsqueeze(-1))).square()).sum(-1)
        return out

    every = range(len(ranges))
    best = errors(best_s, best_z, every)
    best_s = {i: best_s for i in every}
    best_z = {i: best_z for i in every}

    def consider(s32, z, which):
        s32 = torch.where(torch.isfinite(s32) & (s32 > 0), s32, torch.zeros_like(s32))
        s = s32.to(torch.bfloat16)
        if z is not None:  # zero point on the stored scale: w = (q - z) * s
            z = torch.nan_to_num(z(s.to(torch.float32)), nan=0.0, posinf=qmax, neginf=qmin).clamp(qmin, qmax)
            z = torch.where(s > 0, z, torch.zeros_like(z)).to(torch.int8)
        for i, err in errors(s, z, which).items():
            better = err < best[i]
            best[i] = torch.where(better, err, best[i])
            best_s[i] = torch.where(better, s, best_s[i])
            if z is not None:
                best_z[i] = torch.where(better, z, best_z[i])

    if spec.symmetric:
        amax = _absmax(x, -1)
        for f in factors:
            s32 = amax * f
            consider(s32, None, every)
            # each range's weighted least-squares refit on its codes of the unrounded candidate
            quotient = torch.round(x / torch.where(s32 > 0, s32, 1.0).unsqueeze(-1))
            for i in every:
                codes = torch.clamp(quotient, *ranges[i])
                consider((w * x * codes).sum(-1) / (w * codes.square()).sum(-1), None, [i])
        return (_choose_sign(spec, x, w, best_s[0], best_s[1]) if mirrored else best_s[0]), None

    lo, hi = x.amin(-1), x.amax(-1)
    steps = 2**spec.bits - 1
    sw, sx = w.sum(-1), (w * x).sum(-1)
    for f in factors:
        s0 = (hi - lo) * f
        consider(s0, lambda s, lo=lo: qmin + torch.round(-lo / s), [0])
        # weighted least squares x ~ s * l + m on the candidate's codes l in 0..2^B-1
        l = torch.clamp(torch.round((x - lo.unsqueeze(-1)) / torch.where(s0 > 0, s0, 1.0).unsqueeze(-1)), 0, steps)
        sl, sll, slx = (w * l).sum(-1), (w * l * l).sum(-1), (w * l * x).sum(-1)
        det = sw * sll - sl * sl
        s_ls = (sw * slx - sl * sx) / det
        m_ls = (sll * sx - sl * slx) / det
        # x ~ s * (q - qmin) + m = s * (q - z) with z = qmin - m / s
        consider(s_ls, lambda s, m=m_ls: qmin + torch.round(-m / s), [0])
    return best_s[0], best_z[0]
