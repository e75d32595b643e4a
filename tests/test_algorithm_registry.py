"""Algorithms are registered objects: a recipe names one, and calibration, the KL probe and the quantize
pass all use that one entry (moequant.algorithms.registry); a new algorithm is one registration."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from tiny import build_tiny_with_tokenizer

from moequant import formats
from moequant.algorithms.registry import ALGORITHMS, PLAIN_GPTQ, Algorithm, GptqOptions, algorithm
from moequant.errors import UserError

SMALL = ["calibration.samples=8", "calibration.seq_len=64", "calibration.probe_samples=2"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_with_tokenizer("qwen2_moe", tmp_path_factory.mktemp("m") / "tiny")


def _negated_rtn(calls):
    """A toy algorithm: round-to-nearest of the negated weights, recording who called it and on what."""

    def quantize(weights, spec, hessian, options, device, label):
        calls.append({"caller": sys._getframe(1).f_code.co_name, "format": spec.key, "label": label})
        return [formats.quantize(-w, spec, name=label) for w in weights], None

    return quantize


def test_the_recipe_accepts_an_algorithm_once_it_is_registered(monkeypatch):
    from moequant.plan.recipe import load_recipe

    with pytest.raises(UserError, match="'algorithms.int4' has value 'negated'; accepted: 'rtn', 'gptq'"):
        load_recipe(None, ["algorithms.int4=negated"])
    monkeypatch.setitem(ALGORITHMS, "negated", Algorithm("negated", _negated_rtn([]), probe="negated"))
    recipe = load_recipe(None, ["algorithms.int4=negated"])
    assert recipe.algorithm_for("int4") == "negated" and recipe.algorithm_for("int8") == "rtn"


def test_a_registered_algorithm_runs_through_calibrate_probe_and_quantize(model_dir, tmp_path, monkeypatch):
    """A toy algorithm registered here and named by the recipe is what the probe measures the probe format
    with and what the quantize pass rounds every int4 expert with (its codes are the toy's, not RTN's);
    nothing else changes."""
    from moequant.measure.calibrate import calibrate
    from moequant.pipeline.apply import calibration_settings, plan_stage, resolve_recipe
    from moequant.pipeline.quantize import quantize_model
    from moequant.pipeline.run import open_run

    calls = []
    monkeypatch.setitem(ALGORITHMS, "negated", Algorithm("negated", _negated_rtn(calls), probe="negated"))
    overrides = [*SMALL, "algorithms.int4=negated", "experts.budget.bits_per_weight=4.5"]
    recipe = resolve_recipe("recipes/selective.yaml", model_dir, tmp_path / "run", overrides)
    settings = calibration_settings(recipe)
    assert settings.probe_algorithm == "negated"  # `auto`: the probe format's algorithm, as it says to probe it

    stats = calibrate(recipe.model, tmp_path / "stats", settings, progress=False)
    probe = json.loads((stats / "probe.json").read_text())
    probed = [c for c in calls if c["caller"] == "_probed_experts"]
    assert probe["algorithm"] == "negated" and probed
    assert {c["format"] for c in probed} == {layer["format"] for layer in probe["layers"].values()}

    run = open_run(recipe)
    run.directory.mkdir(parents=True, exist_ok=True)
    plan, _ = plan_stage(run, stats, settings)
    int4 = [t for t in plan.tensors if t.role == "routed_expert" and t.quantized and t.format.startswith("int4")]
    assert int4 and all(t.algorithm == "negated" for t in int4)
    calls.clear()
    quantized, report = quantize_model(recipe.model, plan, settings, tmp_path / "work", progress=False)
    assert {c["caller"] for c in calls} == {"_quantize_experts"}
    assert {(c["label"].split()[1], c["format"]) for c in calls} == {(str(t.layer), t.format) for t in int4}

    from moequant.arch import adapter_for
    from moequant.io.checkpoint import open_checkpoint

    ckpt = open_checkpoint(recipe.model)
    adapter = adapter_for(ckpt.config)
    t = int4[0]
    weight = adapter.read_experts(ckpt, t.layer, t.proj)[t.expert : t.expert + 1].float()
    got = next(q for key, q in quantized.items() if key in ((t.layer, t.expert, t.proj), t.name))
    toy = formats.quantize(-weight, t.format).dequantize(torch.float32)[0]
    assert torch.equal(got.dequantize(torch.float32), toy)
    assert not torch.equal(toy, formats.quantize(weight, t.format).dequantize(torch.float32)[0])
    entries = [e for layer in report.values() if isinstance(layer, dict) for e in layer.values() if isinstance(e, dict)]
    assert any(e.get("algorithm") == "negated" for e in entries)


def test_entries_say_what_they_need():
    """What calibration and the quantize pass read from each entry instead of comparing names."""
    gptq, awq, imatrix, rtn = (algorithm(n) for n in ("gptq", "awq", "imatrix", "rtn"))
    assert gptq.hessians and imatrix.hessians and not awq.hessians and not rtn.hessians
    assert awq.scales_layer and not any(a.scales_layer for a in (gptq, imatrix, rtn))
    assert (gptq.probe, awq.probe, imatrix.probe, rtn.probe) == ("gptq", "rtn", "rtn", "rtn")
    assert gptq.joins_gate_up(formats.parse_key("int4-g32-sym")) and not gptq.joins_gate_up(formats.parse_key("q4_k"))
    assert gptq.options is GptqOptions and GptqOptions() != PLAIN_GPTQ  # the recipe's default: searched + refit
    with pytest.raises(ValueError, match="accepted: rtn, gptq, awq, imatrix"):
        algorithm("magic")


def test_library_settings_default_to_the_recipe_s():
    """CalibrationSettings without a recipe are the recipe schema's defaults; from a recipe they are built
    in one place (moequant.plan.measurements.calibration_settings) and carry its `gptq:` section itself."""
    from support.plain import plain_settings

    from moequant.measure.calibrate import CalibrationSettings
    from moequant.pipeline.apply import calibration_settings, resolve_recipe
    from moequant.plan.recipe import Recipe

    library, recipe = CalibrationSettings(), Recipe()
    c = recipe.calibration
    assert (library.dataset, library.samples, library.seq_len, library.probe_samples, library.hessian_weighting) == (
        c.dataset,
        c.samples,
        c.seq_len,
        c.probe_samples,
        c.hessian_weighting,
    )
    assert library.gptq == recipe.gptq and library.probe_algorithm == c.probe_algorithm
    from_recipe = calibration_settings(
        resolve_recipe(None, overrides=["gptq.grid=minmax", "experts.method=uniform", "experts.format=int4"])
    )
    assert (
        from_recipe.gptq == GptqOptions(grid="minmax", refit=True)
        and from_recipe.algorithm_options["gptq"].grid == "minmax"
    )
    assert from_recipe.fingerprint_fields()["gptq"] == ["minmax", True]
    assert plain_settings().fingerprint_fields()["gptq"] == ["minmax", False]  # every choice is named
