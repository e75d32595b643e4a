"""Quantized layers are decoded where they are computed. With a `device` (what LayerRunner.materialized
passes on a GPU, for the quantize pass and both models of the streamed evaluation), layer_state_dict sends
every stored tensor there as the file holds it and decodes it there: no float32 host copy of an expert.

On the CPU the device path runs with the CPU as its device. A guard on the stored tensors (what
Checkpoint.read_stored returns) refuses every host operation on them but the copy to the device, so a
decode on the host fails the test; the tensors are bit for bit the host path's. Every export layout,
every quantized format of the compressed-tensors one, and the quantized sources moequant reads."""

from __future__ import annotations

import threading

import pytest
import torch
from test_export_models import build_model, quantize_experts, quantize_named

from benchmarks.make_sources import make_deepseek_fp8, make_gpt_oss_mxfp4, make_qwen_int4
from moequant.arch import adapter_for
from moequant.export.write import export_checkpoint
from moequant.io.checkpoint import Checkpoint, open_checkpoint
from moequant.io.layers import build_skeleton


class _Stored(torch.Tensor):
    """A stored tensor on the host: its metadata may be read and it may be copied to a device; any other
    operation (a cast, an unpack, arithmetic) would be decoding on the host and raises."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        copy = func is torch.Tensor.to and (
            "device" in kwargs or (len(args) > 1 and isinstance(args[1], (str, torch.device)))
        )
        if not copy and getattr(func, "__name__", "") not in ("__get__", "dim", "size", "numel", "element_size"):
            raise AssertionError(f"{getattr(func, '__name__', func)} on a stored tensor on the host")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            return out.clone() if copy else out  # a copy, as a transfer to a GPU makes one


def _guarded(monkeypatch) -> list:
    """Checkpoint.read_stored returns guarded tensors from now on; returns the list of names read."""
    read, real = [], Checkpoint.read_stored

    def guarded(self, name, pinned=False):
        read.append(name)
        return real(self, name, pinned).as_subclass(_Stored)

    monkeypatch.setattr(Checkpoint, "read_stored", guarded)
    return read


def _layers_decode_on_the_device(path, monkeypatch, dtype=torch.float32) -> None:
    ckpt = open_checkpoint(path)
    assert ckpt.encodings  # the checkpoint is quantized
    adapter = adapter_for(ckpt.config)
    model = build_skeleton(ckpt, dtype)
    host = {}
    for L in adapter.moe_layers:
        keys = list(model.model.layers[L].state_dict())
        host[L] = adapter.layer_state_dict(ckpt, L, keys, dtype)
    with monkeypatch.context() as patch:
        read = _guarded(patch)
        for L in adapter.moe_layers:
            keys = list(model.model.layers[L].state_dict())
            there = adapter.layer_state_dict(ckpt, L, keys, dtype, device=torch.device("cpu"))
            assert there.keys() == host[L].keys()
            for key, t in there.items():
                assert type(t) is torch.Tensor and t.dtype == host[L][key].dtype, key
                assert torch.equal(t, host[L][key]), key
    parts = {p for enc in ckpt.encodings.values() for p in enc.parts.values()}
    assert parts & set(read)  # the guard saw the quantized tensors' parts


def _mix(keys):
    return lambda L, e, p: keys[(L + e + ("gate", "up", "down").index(p)) % len(keys)]


CT_KEYS = [
    "int4-g32-sym",
    "int4-g32-asym",
    "int8-channel",
    "int3-g64-sym",
    "fp8-channel",
    "fp8-block128",
    "fp8-tensor",
    "mxfp4",
    "nvfp4",
    "mxfp8",
]


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return build_model("mixtral", tmp_path_factory.mktemp("src") / "mixtral")


def test_compressed_tensors_every_format(mixtral, tmp_path, monkeypatch):
    experts = quantize_experts(mixtral, _mix(CT_KEYS))
    attention = quantize_named(mixtral, lambda n, role: "int8-channel" if role == "attention" else None)
    out = export_checkpoint(mixtral, {**experts, **attention}, tmp_path / "ct", target="transformers")
    _layers_decode_on_the_device(out, monkeypatch)


@pytest.mark.parametrize(
    "layout, keys",
    [("gptq", ["int4-g128-sym", "int8-channel"]), ("awq", ["int4-g128-asym"]), ("awq", ["int4-g64-sym"])],
)
def test_gptq_and_awq(layout, keys, mixtral, tmp_path, monkeypatch):
    experts = quantize_experts(mixtral, lambda L, e, p: keys[L % len(keys)])
    out = export_checkpoint(mixtral, experts, tmp_path / layout, layout=layout, target="transformers")
    _layers_decode_on_the_device(out, monkeypatch, torch.bfloat16)


def test_deepseek_fp8_and_gpt_oss_mxfp4_exports(tmp_path, monkeypatch):
    ds = build_model("deepseek_v3", tmp_path / "ds3")
    fp8 = quantize_named(ds, lambda n, role: "fp8-block128" if role in ("routed_expert", "attention") else None)
    _layers_decode_on_the_device(
        export_checkpoint(ds, fp8, tmp_path / "fp8", layout="deepseek-fp8", target="transformers"), monkeypatch
    )
    oss = build_model("gpt_oss", tmp_path / "oss")
    mx = quantize_experts(oss, lambda L, e, p: "mxfp4")
    _layers_decode_on_the_device(
        export_checkpoint(oss, mx, tmp_path / "mx", layout="gpt-oss-mxfp4", target="transformers"), monkeypatch
    )


@pytest.mark.parametrize("make", [make_deepseek_fp8, make_qwen_int4, make_gpt_oss_mxfp4])
def test_quantized_sources(make, tmp_path, monkeypatch):
    _layers_decode_on_the_device(make(tmp_path / "src"), monkeypatch)


@pytest.mark.parametrize("make", [make_deepseek_fp8, make_qwen_int4])
def test_a_layer_read_by_several_threads_equals_one_thread_s(make, tmp_path, monkeypatch):
    """The quantize pass's GPU read of a layer's experts (several threads, a few experts each, decoded where
    they go) gives the values read_experts gives expert after expert, for every expert and for one rank's
    slice; forced onto the host's device here, where the decoding runs the same code."""
    import moequant.pipeline.read_ahead as read_ahead
    from moequant import parallel

    monkeypatch.setattr(read_ahead, "READ_SLICE", 3)  # slices that do not divide the experts evenly
    ckpt = open_checkpoint(make(tmp_path / "src"))
    adapter = adapter_for(ckpt.config)
    L, cpu = adapter.moe_layers[-1], torch.device("cpu")
    threads = set()
    real = parallel.read_experts

    def counted(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(parallel, "read_experts", counted)
    for own in (None, range(1, adapter.num_experts - 1)):
        together = read_ahead.read_layer_experts(adapter, ckpt, L, own, cpu, torch.bfloat16)
        for p in adapter.projections:
            alone = real(adapter, ckpt, L, p, own, device=cpu, dtype=torch.bfloat16)
            assert together[p].dtype == torch.bfloat16 and torch.equal(together[p], alone), (own, p)
    assert any(name.startswith("moequant-read-experts") for name in threads)
