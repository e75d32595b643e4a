"""`moequant apply` end to end on a tiny model with its own tokenizer: outputs, reuse, resume, budget."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny import build_tiny_with_tokenizer

from moequant.cli import main

SMALL = ["calibration.samples=8", "calibration.seq_len=64", "evaluate.samples=4", "evaluate.seq_len=64"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_with_tokenizer("qwen2_moe", tmp_path_factory.mktemp("m") / "tiny")


def run_apply(model_dir, out, *extra, expect=0):
    args = ["apply", "--recipe", "recipes/selective.yaml", "--model", str(model_dir), "--output", str(out)]
    for s in SMALL + list(extra):
        args += ["--set", s]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == expect, result.output
    return result.output


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def test_apply_writes_everything_and_reuses_unchanged_stages(model_dir, tmp_path):
    out = tmp_path / "run"
    first = run_apply(model_dir, out)
    for name in ("checkpoint", "stats", "plan.json", "report.json", "report.md", "report.html"):
        assert (out / name).exists(), name
    assert first.strip().splitlines()[-1].endswith("report.html")
    report = json.loads((out / "report.json").read_text())
    for key in ("model", "recipe", "target", "memory", "quality", "experts", "timings"):
        assert key in report
    # the plan's budget (bits per routed-expert weight) holds on the written checkpoint
    plan = json.loads((out / "plan.json").read_text())
    budget = plan["budget"]["bits_per_weight"]
    assert report["memory"]["bits_per_weight_experts"] <= budget + 1e-9
    # every layer's routed experts share one format (target vllm)
    for layer, formats in _layer_formats(plan).items():
        assert len(formats) == 1, (layer, formats)
    before = digest(out / "checkpoint")
    second = run_apply(model_dir, out)
    assert "(reused)" in second and "unchanged, reused" in second and "up to date, reused" in second
    assert digest(out / "checkpoint") == before


def _layer_formats(plan):
    out = {}
    for t in plan["tensors"]:
        if t["role"] == "routed_expert" and t["expert"] is not None:
            out.setdefault(t["layer"], set()).add(t["format"])
    return out


def test_interrupted_quantize_resumes_to_an_identical_checkpoint(model_dir, tmp_path, monkeypatch):
    whole = tmp_path / "whole"
    run_apply(model_dir, whole)
    from moequant.io import layers

    real_forward = layers.LayerRunner.forward
    state = {"calls": 0}

    def dying(self, module, layer, hidden, before_batch=None):
        # calibration runs first (3 layers), then the quantize pass: die in its layer 2
        state["calls"] += 1
        if layer == 2 and state["calls"] > 6:
            raise KeyboardInterrupt
        return real_forward(self, module, layer, hidden, before_batch)

    monkeypatch.setattr(layers.LayerRunner, "forward", dying)
    resumed = tmp_path / "resumed"
    assert "interrupted: the finished stages and layers are kept" in run_apply(model_dir, resumed, expect=130)  # Ctrl-C
    assert not (resumed / "checkpoint").exists()
    progress = json.loads((resumed / "work" / "progress.json").read_text())
    assert progress["next_layer"] == 2
    monkeypatch.setattr(layers.LayerRunner, "forward", real_forward)
    out = run_apply(model_dir, resumed)
    assert "(reused)" in out  # the statistics survived the interruption
    assert "quantizing: resuming at layer 2 (layers 0-1 were finished by an earlier run)" in out
    assert digest(resumed / "checkpoint") == digest(whole / "checkpoint")


def test_gptq_pass_beats_rtn_on_held_out_data(model_dir, tmp_path):
    """The sequential GPTQ pass gives smaller MoE-block output error and KL than RTN of the same plan,
    measured on the evaluation split (disjoint from the calibration tokens)."""
    quality = {}
    for algo in ("gptq", "rtn"):
        out = tmp_path / algo
        run_apply(
            model_dir,
            out,
            "experts.method=uniform",
            "experts.format=int4",
            f"algorithms.int4={algo}",
            "calibration.samples=16",
            "evaluate.samples=16",
        )
        quality[algo] = json.loads((out / "report.json").read_text())["quality"]
    assert quality["gptq"]["moe_output_error"] < quality["rtn"]["moe_output_error"], quality
    assert quality["gptq"]["kl_mean"] < quality["rtn"]["kl_mean"], quality


def test_bad_recipe_is_one_sentence(model_dir, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: tensorrt\n")
    result = CliRunner().invoke(
        main, ["apply", "--recipe", str(bad), "--model", str(model_dir), "--output", str(tmp_path / "o")]
    )
    assert result.exit_code == 2 and result.output.startswith("error: ") and "target" in result.output
    assert not (tmp_path / "o").exists()


def test_awq_apply_on_a_zoo_model_writes_a_checkpoint_both_readers_take(tmp_path):
    """recipes/uniform-int4-awq.yaml end to end: the folded norm / router reach the checkpoint,
    moequant.load and compressed-tensors' own decompression read it and agree tensor for tensor."""
    import glob

    import torch
    from safetensors.torch import load_file

    import moequant
    from moequant.io.checkpoint import open_checkpoint
    from moequant.io.loader import dequantized_state_dict

    out = tmp_path / "awq"
    args = ["apply", "--recipe", "recipes/uniform-int4-awq.yaml", "--model", "zoo:tiny-mixtral", "--output", str(out)]
    for s in SMALL:
        args += ["--set", s]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    quant = json.loads((out / "checkpoint.json").read_text())["quantize"]
    source = open_checkpoint("zoo:tiny-mixtral")
    tensors = {}
    for f in sorted(glob.glob(str(out / "checkpoint" / "*.safetensors"))):
        tensors.update(load_file(f))
    for layer, entry in quant.items():
        assert entry["down:int4-g32-sym"]["algorithm"] == "awq"
        for name in entry["awq_shared_scale"]["folded_into"]:  # norm and router, changed and kept in bf16
            assert tensors[name].dtype == torch.bfloat16 and not torch.equal(tensors[name], source.get(name)), name

    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    theirs = CompressedTensorsDequantizer(str(out / "checkpoint"), dtype=torch.float32).validate(tensors)
    # compressed-tensors dequantizes at the precision of the scales (bf16): compare there
    ours = dequantized_state_dict(out / "checkpoint", torch.bfloat16)
    assert set(theirs) == set(ours)
    for name, t in theirs.items():
        assert torch.equal(t.to(torch.bfloat16), ours[name]), name
    model = moequant.load(out / "checkpoint", dtype=torch.float32)
    report = json.loads((out / "report.json").read_text())
    assert report["quality"]["kl_mean"] < 0.1 and model.config.model_type == "mixtral"


def _first_layer_runs(model_dir, tmp_path, overrides: list[str], contrast: list[str]):
    """Uniform int4 GPTQ applied with `overrides` and with `contrast`: (adapter, settings of the
    override run, {"changed" | "contrast": {proj: first MoE layer's experts [E, out, in]}},
    {proj: (original experts, calibration's chosen Hessian under those settings, computed separately)})."""
    import torch

    import moequant
    from moequant.arch import adapter_for
    from moequant.io.checkpoint import open_checkpoint
    from moequant.measure.calibrate import MIN_ROUTED_TOKENS, CalibrationSettings, HessianRule, calibrate
    from moequant.measure.stats import chosen_hessian, load_stats
    from moequant.pipeline.apply import calibration_settings, resolve_recipe

    ckpt = open_checkpoint(model_dir)
    adapter = adapter_for(ckpt.config)
    layer = adapter.moe_layers[0]
    uniform = ["experts.method=uniform", "experts.format=int4", "algorithms.int4=gptq"]
    experts = {}
    for name, extra in (("changed", overrides), ("contrast", contrast)):
        run_apply(model_dir, tmp_path / name, *uniform, *extra)
        module = adapter.experts_module(moequant.load(tmp_path / name / "checkpoint", dtype=torch.float32), layer)
        experts[name] = {
            p: torch.stack([adapter.expert_from_module(module, e, p).detach() for e in range(adapter.num_experts)])
            for p in adapter.projections
        }
    settings = calibration_settings(
        resolve_recipe("recipes/selective.yaml", model_dir, tmp_path / "x", SMALL + uniform + overrides)
    )
    stats_dir = calibrate(
        str(model_dir),
        tmp_path / "stats",
        CalibrationSettings(**{**settings.__dict__, "save_hessians": True, "probe_samples": 0}),
        progress=False,
    )
    tensors = load_stats(stats_dir).layers[layer].tensors
    references = {}
    for proj in adapter.projections:
        group = "down" if proj == "down" else "gate_up"
        _, h = chosen_hessian(
            tensors, group, torch.arange(adapter.num_experts), HessianRule(MIN_ROUTED_TOKENS, settings.hessian_prior)
        )
        references[proj] = (adapter.read_experts(ckpt, layer, proj).float(), h.float())
    return adapter, settings, experts, references


def test_routing_weighted_hessians_reach_the_quantize_pass(model_dir, tmp_path):
    """calibration.hessian_weighting=routing: the first MoE layer's GPTQ (its input is the original model's)
    equals GPTQ on calibration's routing-weighted Hessians, computed separately, and differs from tokens'
    (both on the min/max grid without refit, so the Hessian is the only difference)."""
    import torch

    from moequant.algorithms.gptq import gptq

    plain = ["gptq.grid=minmax", "gptq.refit=false"]
    _, settings, experts, references = _first_layer_runs(
        model_dir,
        tmp_path,
        ["calibration.hessian_weighting=routing", *plain],
        ["calibration.hessian_weighting=tokens", *plain],
    )
    assert settings.hessian_weighting == "routing"
    for proj, (w, h) in references.items():
        want = gptq(w, h, "int4-g32-sym", act_order=True, static_groups=True)[0].dequantize(torch.float32)
        close = torch.isclose(experts["changed"][proj], want, rtol=1e-3, atol=1e-6).float().mean()
        assert close > 0.99, (proj, float(close))
        assert not torch.allclose(experts["contrast"][proj], want)


def test_the_hessian_prior_reaches_the_quantize_pass(model_dir, tmp_path):
    """calibration.hessian_prior: the first MoE layer's GPTQ equals GPTQ on calibration's Hessians shrunk by that
    prior (stats.chosen_hessian, computed separately), and differs from the run without a prior; the
    statistics' fingerprint names it."""
    import torch

    from moequant.algorithms.gptq import gptq
    from moequant.pipeline.apply import calibration_settings, resolve_recipe

    plain = ["gptq.grid=minmax", "gptq.refit=false"]
    _, settings, experts, references = _first_layer_runs(
        model_dir, tmp_path, ["calibration.hessian_prior=4", *plain], ["calibration.hessian_prior=0", *plain]
    )
    default = calibration_settings(resolve_recipe("recipes/selective.yaml", model_dir, tmp_path / "d", []))
    assert settings.hessian_prior == 4 and default.hessian_prior == 1
    assert settings.fingerprint_fields() != default.fingerprint_fields()
    for proj, (w, h) in references.items():
        want = gptq(w, h, "int4-g32-sym", act_order=True, static_groups=True)[0].dequantize(torch.float32)
        close = torch.isclose(experts["changed"][proj], want, rtol=1e-3, atol=1e-6).float().mean()
        assert close > 0.99, (proj, float(close))
        if proj != "down":  # down's Hessian has no prior
            assert not torch.allclose(experts["contrast"][proj], want)


def test_searched_grid_and_refit_reach_the_quantize_pass(model_dir, tmp_path):
    """gptq: {grid: searched, refit: true}: the first MoE layer's experts equal GPTQ onto the searched
    grid followed by the least-squares scale refit, run separately on calibration's Hessians, and
    differ from the min/max grid's (both with token-weighted Hessians); the statistics' fingerprint
    names the choice, and the recipe's defaults are routing Hessians on the searched grid with the refit."""
    import torch
    from support.plain import plain_settings

    from moequant.algorithms.gptq import gptq
    from moequant.algorithms.refit import refit_scales
    from moequant.pipeline.apply import calibration_settings, resolve_recipe

    tokens = "calibration.hessian_weighting=tokens"
    _, settings, experts, references = _first_layer_runs(
        model_dir,
        tmp_path,
        ["gptq.grid=searched", "gptq.refit=true", tokens],
        ["gptq.grid=minmax", "gptq.refit=false", tokens],
    )
    assert (settings.gptq_grid, settings.gptq_refit) == ("searched", True)
    default = calibration_settings(resolve_recipe("recipes/selective.yaml", model_dir, tmp_path / "d", []))
    assert (default.hessian_weighting, default.gptq_grid, default.gptq_refit) == ("routing", "searched", True)
    assert settings.fingerprint_fields()["gptq"] == ["searched", True]
    assert plain_settings().fingerprint_fields()["gptq"] == ["minmax", False]
    for proj, (w, h) in references.items():
        q, _ = gptq(w, h, "int4-g32-sym", act_order=True, static_groups=True, grid="searched")
        want = refit_scales(q, w, h).dequantize(torch.float32)
        close = torch.isclose(experts["changed"][proj], want, rtol=1e-3, atol=1e-6).float().mean()
        assert close > 0.99, (proj, float(close))
        assert not torch.allclose(experts["contrast"][proj], want)


def test_one_apply_reads_each_checkpoint_s_headers_once(model_dir, tmp_path, monkeypatch):
    """The source checkpoint is opened once and handed to every stage (calibration, probe, plan, quantize,
    export, evaluation and report), the output once for the evaluation and the report: config.json and every
    safetensors header are read once per checkpoint (they were read 13 times on a DeepSeek-V3-sized model,
    ~0.5 s each), and each checkpoint's adapter is built once, kept on it."""
    import traceback
    from collections import Counter

    import moequant.io.checkpoint as checkpoint
    from moequant.arch.base import Adapter

    reads, opened, adapters = [], Counter(), Counter()
    real_read, real_init, real_post_init = (
        checkpoint._read_entries,
        checkpoint.Checkpoint.__init__,
        Adapter.__post_init__,
    )

    def counted_init(self, path, *args, **kwargs):
        opened[str(Path(path).resolve())] += 1
        real_init(self, path, *args, **kwargs)

    def counted_post_init(self):  # every adapter of every architecture, whoever builds it: who asked for it
        frames = [f for f in traceback.extract_stack()[:-1] if "moequant" in f.filename and "/arch/" not in f.filename]
        adapters[(Path(frames[-1].filename).name, frames[-1].name)] += 1
        real_post_init(self)

    monkeypatch.setattr(checkpoint, "_read_entries", lambda path: reads.append(Path(path).resolve()) or real_read(path))
    monkeypatch.setattr(checkpoint.Checkpoint, "__init__", counted_init)
    monkeypatch.setattr(Adapter, "__post_init__", counted_post_init)
    out = tmp_path / "run"
    run_apply(model_dir, out, "calibration.probe_samples=4")
    assert (out / "report.json").exists() and json.loads((out / "plan.json").read_text())["method"] == "budget"
    source, output = str(Path(model_dir).resolve()), str((out / "checkpoint").resolve())
    assert sorted(map(str, reads)) == sorted([source, output])
    assert opened == {source: 1, output: 1}
    # the source's and the output's, each built once by its Checkpoint, and no stage builds its own
    assert adapters[("checkpoint.py", "adapter")] == 2
    assert {where for where in adapters if where[0] != "checkpoint.py"} == set()
