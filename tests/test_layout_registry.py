"""A new export layout is one file: a layout defined and registered here, in the test, is checked by the
precheck and the recipe, written by export_checkpoint and by `apply`, and read back by open_checkpoint,
with no other change to moequant."""

from __future__ import annotations

import json

import pytest
import torch
from test_export_models import quantize_named

from moequant import formats
from moequant.errors import UserError
from moequant.export.write import export_checkpoint
from moequant.io.checkpoint import open_checkpoint
from moequant.layouts import LAYOUTS, RECIPE_LAYOUTS, Layout, layout_refusal, register
from moequant.layouts.base import module_name
from moequant.layouts.reading import Encoding, dims, modules_with, need
from moequant.zoo import path as zoo_path

QUANT_METHOD = "int8-rows-test"


def read_int8_rows(qc, stored, where, read):
    out = {}
    for module in modules_with(stored, "row_scale"):
        parts = {"codes": f"{module}.codes_i8", "row_scale": f"{module}.row_scale"}
        need(stored, where, parts["codes"], ("I8",))
        rows, cols = dims(stored, where, parts["codes"], 2)
        need(stored, where, parts["row_scale"], ("BF16", "F32"), (rows, 1))
        out[f"{module}.weight"] = Encoding(
            f"{module}.weight", (rows, cols), formats.get_format("int8"), "int8-rows", parts
        )
    return out


class Int8Rows(Layout):
    """An engine that takes int8 per output channel only, as `codes_i8` and `row_scale` beside each module."""

    name = "int8-rows"
    quant_methods = (QUANT_METHOD,)
    read_encodings = staticmethod(read_int8_rows)

    @staticmethod
    def unpack(enc, t):
        return formats.QuantizedTensor(enc.spec, enc.shape, t["codes"], t["row_scale"])

    @staticmethod
    def refuses(spec):
        return None if spec == formats.get_format("int8") else "int8 per output channel only"

    def check(self):
        self._require_unfused()
        self._refuse_formats()

    def pack(self, name, q):
        return {f"{module_name(name)}.codes_i8": q.codes.to(torch.int8), f"{module_name(name)}.row_scale": q.scales}

    def quantization_config(self):
        return {"quant_method": QUANT_METHOD, "modules_to_not_convert": sorted(self._linear_modules_kept())}


@pytest.fixture
def int8_rows():
    register(Int8Rows)
    yield Int8Rows
    LAYOUTS.pop(Int8Rows.name)
    RECIPE_LAYOUTS.pop(Int8Rows.name)


def test_a_registered_layout_is_written_read_back_and_refuses_what_it_cannot_hold(tmp_path, int8_rows):
    source = zoo_path("tiny-qwen2moe")
    experts = quantize_named(source, lambda name, role: "int8" if role == "routed_expert" else None)
    out = export_checkpoint(source, experts, tmp_path / "out", layout="int8-rows", target="transformers")

    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == QUANT_METHOD
    assert json.loads((out / "moequant_export.json").read_text())["layout"] == "int8-rows"
    written = open_checkpoint(out)
    assert set(written.encodings) == set(experts)  # every expert read back through the layout's reader
    src = open_checkpoint(source)
    for name, q in experts.items():
        assert torch.equal(written.get(name), q.dequantize(torch.float32)), name
    for name in src.keys():  # everything else as the source holds it
        if name not in experts:
            assert torch.equal(written.get(name), src.get(name)), name

    int4 = formats.get_format("int4", group_size=32, symmetric=True)
    from moequant.arch import adapter_for

    adapter = adapter_for(src.config)
    assert "int8 per output channel only" in layout_refusal("int8-rows", int4, "transformers", adapter)
    assert layout_refusal("int8-rows", formats.get_format("int8"), "transformers", adapter) is None
    with pytest.raises(UserError, match="the int8-rows layout holds int8 per output channel only"):
        bad = quantize_named(source, lambda name, role: int4.key if role == "routed_expert" else None)
        export_checkpoint(source, bad, tmp_path / "bad", layout="int8-rows", target="transformers")
    assert not (tmp_path / "bad").exists()


def test_an_unregistered_layout_is_refused_by_name(tmp_path):
    source = zoo_path("tiny-qwen2moe")
    with pytest.raises(UserError, match="export layout 'int8-rows' is not supported"):
        export_checkpoint(source, {}, tmp_path / "out", layout="int8-rows", target="transformers")


def test_apply_plans_writes_and_evaluates_a_registered_layout(tmp_path, int8_rows):
    from moequant.pipeline.apply import apply

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "model: zoo:tiny-qwen2moe\n"
        f"output: {tmp_path / 'run'}\n"
        "target: transformers\n"
        "calibration: {dataset: builtin:mix, samples: 4, seq_len: 32}\n"
        "keep: [router, shared_expert_gate, shared_experts, attention, embeddings, lm_head]\n"
        "experts: {method: uniform, format: int8}\n"
        "algorithms: {int8: rtn}\n"
        "export: {format: int8-rows}\n"
        "evaluate: {dataset: builtin:mix, samples: 4, seq_len: 32}\n"
    )
    apply(recipe, progress=False, log=lambda *a: None)
    out = tmp_path / "run" / "checkpoint"
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == QUANT_METHOD
    written = open_checkpoint(out)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    planned = {t["name"] for t in plan["tensors"] if t["format"] == "int8-channel"}
    assert planned and set(written.encodings) == planned  # the plan's int8 tensors, in the registered layout
    assert all(e.reader == "int8-rows" for e in written.encodings.values())
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["quality"]["kl_mean"] > 0  # evaluated on the checkpoint read back through the layout's reader
    assert all(e["format"] == "int8-channel" for e in report["experts"])
    assert any(e["error"] for e in report["experts"])  # experts routed to: their output error measured
