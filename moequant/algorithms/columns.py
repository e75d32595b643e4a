"""Glue between GPTQ's batched sweep and a format's column quantizer (moequant.formats.column_quantizer): its
methods on [c, out, k] columns of c experts (the quantizer of a 2-D weight has no c), its params mapped over
their trees, and the QuantizedTensors of consecutive chunks of experts stacked into one."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch


def cq_call(method, cols, params, squeeze):
    """A column-quantizer method on [c, out, k] columns (the quantizer of a 2-D weight has no c)."""
    if squeeze:
        return method(cols[0], squeeze_params(params, True)).unsqueeze(0)
    return method(cols, params)


def cq_fit(cq, w_group, squeeze, importance=None):
    if importance is not None and squeeze:
        importance = importance[0]
    params = (
        cq.fit(w_group[0] if squeeze else w_group)
        if importance is None
        else cq.fit(w_group[0] if squeeze else w_group, importance)
    )
    return tree_map(lambda t: t.unsqueeze(0), params) if squeeze else params


def squeeze_params(params, squeeze):
    return tree_map(lambda t: t[0], params) if squeeze else params


def tree_map(fn: Callable, *trees):
    first = trees[0]
    if isinstance(first, torch.Tensor):
        return fn(*trees)
    if first is None or isinstance(first, (int, float, str, bool)):
        return first
    if isinstance(first, (tuple, list)):
        return type(first)(tree_map(fn, *parts) for parts in zip(*trees))
    if isinstance(first, dict):
        return {k: tree_map(fn, *(t[k] for t in trees)) for k in first}
    if dataclasses.is_dataclass(first):
        return dataclasses.replace(
            first, **{f.name: tree_map(fn, *(getattr(t, f.name) for t in trees)) for f in dataclasses.fields(first)}
        )
    raise TypeError(f"cannot batch column-quantizer params of type {type(first).__name__}")


def stack_chunks(parts):
    """QuantizedTensors of consecutive expert chunks -> one QuantizedTensor of all experts."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    cat = lambda ts: None if ts[0] is None else torch.cat(ts, dim=0)  # noqa: E731
    return dataclasses.replace(
        first,
        shape=(sum(p.shape[0] for p in parts),) + tuple(first.shape[1:]),
        codes=cat([p.codes for p in parts]),
        scales=cat([p.scales for p in parts]),
        zeros=cat([p.zeros for p in parts]),
        global_scale=cat([p.global_scale for p in parts]),
    )
