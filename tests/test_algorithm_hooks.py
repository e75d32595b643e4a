"""An algorithm with its own per-layer preparation and refusal, registered here alone (nothing in pipeline/ or
precheck.py names it): the quantize pass hands it each layer's float32 weights, statistics and recorded tokens
before rounding and rounds what it prepared; its refusal stops apply (one sentence, exit 2, nothing written)
and the library pass before any work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from support.plain import plain_settings
from tiny import build_tiny_with_tokenizer

from moequant import formats
from moequant.algorithms.layer import PreparedLayer
from moequant.algorithms.registry import ALGORITHMS, Algorithm
from moequant.errors import UserError
from moequant.io.checkpoint import load_tokenizer, open_checkpoint
from moequant.measure.data import load_samples
from moequant.pipeline.quantize import quantize_model
from moequant.plan.policy import make_plan
from moequant.plan.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 40  # the toy's `prepare_tokens`: fewer than the calibration tokens, so the cap shows


def _rtn(weights, spec, hessian, options, device, label):
    return [formats.quantize(w, spec, name=label) for w in weights], None


def _halving(calls: list):
    """A toy preparation: each of its experts' down_proj doubled and up_proj halved (exact in float, the
    layer's output unchanged); it records what it was given and reports the factor."""

    def prepare(layer):
        ids = sorted({t.expert for t in layer.rows if t.algorithm == layer.algorithm and t.quantized})
        idx = torch.tensor(ids)
        own, *_ = layer.choose("down", idx)
        calls.append(
            {
                "layer": layer.layer,
                "dtype": layer.weights["down"].dtype,
                "tokens": sum(x.shape[0] for x in layer.tokens["x"]),
                "routed": layer.statistics["input_routed.down.tokens"][idx].tolist(),
                "own": own.tolist(),
            }
        )
        layer.weights["down"][idx] *= 2
        layer.weights["up"][idx] /= 2
        changed = {p: torch.zeros(layer.adapter.num_experts, dtype=torch.bool) for p in layer.adapter.projections}
        changed["down"][idx] = changed["up"][idx] = True

        def finish(report, routing_before, routing_after, attention_quantized, diagnostics):
            for key, entry in report.items():
                if key.startswith("down:"):
                    entry["halving"] = {"factor": 2.0, "batches": [len(routing_before), len(routing_after)]}

        return PreparedLayer(changed=changed, finish=finish)

    return prepare


def _refuse_mixtral(adapter, rows, processes):
    if adapter.model_type == "mixtral":
        return "algorithm halving does not run on mixtral (a test's refusal); use rtn or gptq."
    return None


def _register(monkeypatch, calls):
    monkeypatch.setitem(
        ALGORITHMS,
        "halving",
        Algorithm(
            "halving",
            _rtn,
            statistics=True,
            prepare_layer=_halving(calls),
            prepare_tokens=TOKENS,
            refusal=_refuse_mixtral,
        ),
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_with_tokenizer("qwen2_moe", tmp_path_factory.mktemp("m") / "tiny")


def _plan(model):
    recipe = load_recipe(
        ROOT / "recipes" / "uniform-int4.yaml",
        [f"model={model}", "formats.int4.group_size=32", "algorithms.int4=halving"],
    )
    return make_plan(recipe, open_checkpoint(model), None)


def test_the_pass_rounds_what_the_registered_preparation_made(model_dir, tmp_path, monkeypatch):
    calls = []
    _register(monkeypatch, calls)
    plan = _plan(model_dir)
    rows = [t for t in plan.tensors if t.role == "routed_expert" and t.quantized]
    assert rows and all(t.algorithm == "halving" for t in rows)
    samples = load_samples("builtin:stdlib-prose", load_tokenizer(model_dir), 4, 32, split="calibration", seed=0)
    settings = plain_settings(samples=4, seq_len=32, batch_size=2)
    quantized, report = quantize_model(str(model_dir), plan, settings, tmp_path / "work", samples=samples)

    ckpt = open_checkpoint(model_dir)
    adapter = ckpt.adapter
    layers = sorted({t.layer for t in rows})
    assert [c["layer"] for c in calls] == layers  # once per layer, in order
    for c in calls:
        assert c["dtype"] == torch.float32 and c["tokens"] == TOKENS  # 4 x 32 tokens recorded, capped
        assert sum(c["routed"]) == 4 * 32 * adapter.top_k  # the statistics of the layer's own forward
        assert c["own"] == [n >= settings.min_tokens for n in c["routed"]]  # calibration's rule, asked per expert
    for t in rows:
        w = adapter.read_experts(ckpt, t.layer, t.proj)[t.expert : t.expert + 1].float()
        factor = {"down": 2.0, "up": 0.5, "gate": 1.0}[t.proj]
        want = formats.quantize(w * factor, t.format).dequantize(torch.float32)[0]
        got = quantized[(t.layer, t.expert, t.proj)].dequantize(torch.float32)
        assert torch.equal(got, want), (t.layer, t.expert, t.proj)
    for L in layers:
        entry = report[L][f"down:{rows[0].format}"]
        assert entry["algorithm"] == "halving" and entry["halving"]["factor"] == 2.0
        before, after = entry["halving"]["batches"]
        assert before == after == 2  # the routing of both forwards of the layer, per batch (4 samples / 2)


def test_its_refusal_stops_apply_and_the_library_pass_before_any_work(tmp_path, monkeypatch):
    from moequant.cli import main

    _register(monkeypatch, [])
    out = tmp_path / "run"
    args = ["apply", "--recipe", str(ROOT / "recipes" / "uniform-int4.yaml"), "--model", "zoo:tiny-mixtral"]
    result = CliRunner().invoke(main, [*args, "--output", str(out), "--set", "algorithms.int4=halving"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1] == (
        "error: algorithm halving does not run on mixtral (a test's refusal); use rtn or gptq."
    )
    assert not out.exists()

    plan = _plan(open_checkpoint("zoo:tiny-mixtral").directory)
    with pytest.raises(UserError, match="algorithm halving does not run on mixtral"):
        quantize_model("zoo:tiny-mixtral", plan, plain_settings(samples=2, seq_len=16), tmp_path / "work")
    assert not (tmp_path / "work").exists()
