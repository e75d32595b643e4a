"""Every MoE family of the installed transformers whose experts use its standard experts interface.

For each family a tiny random model is built from the family's own config class (tests/families.py) and
saved with `save_pretrained`, so its on-disk names are transformers' own. Then:
- `inspect` from config.json alone accounts the saved files' bytes to the byte (whole model and routed
  experts, the latter counted from the files' own names);
- one quantized export (every routed expert int4, round to nearest) loads in plain transformers with the
  logits of moequant's own dequantized model (KL <= 1e-5);
- (slow) `moequant apply` with uniform int4 GPTQ, and with the selective recipe for the named families,
  writes a checkpoint that plain transformers loads with moequant.load's logits.
A family moequant does not take is refused in one sentence whose reason the list below names.
"""

from __future__ import annotations

import re
import struct

import pytest
import torch
from click.testing import CliRunner
from families import FAMILIES, NAMED, NOT_SUPPORTED, build_family

from moequant.arch import adapter_for
from moequant.cli import main
from moequant.errors import UserError
from moequant.io.checkpoint import open_checkpoint
from moequant.io.loader import load

SUPPORTED = [f for f in FAMILIES if f not in NOT_SUPPORTED]
TOKENS = torch.randint(1, 4000, (2, 24), generator=torch.Generator().manual_seed(0))
PER_EXPERT = re.compile(r"\.experts\.\d+\.")
SMALL = [
    "calibration.samples=4",
    "calibration.seq_len=32",
    "evaluate.samples=2",
    "evaluate.seq_len=32",
    "gptq.grid=minmax",
    "gptq.refit=false",
]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def get(model_type):
        if model_type not in cache:
            cache[model_type] = build_family(model_type, tmp_path_factory.mktemp(model_type) / "model")
        return cache[model_type]

    return get


def test_at_least_forty_families_and_every_named_one_pass():
    assert len(SUPPORTED) >= 40, (len(SUPPORTED), sorted(NOT_SUPPORTED))
    assert not set(NAMED) & set(NOT_SUPPORTED), set(NAMED) & set(NOT_SUPPORTED)
    assert set(NAMED) <= set(FAMILIES), set(NAMED) - set(FAMILIES)


def _file_bytes(folder):
    data, routed = 0, 0
    from safetensors import safe_open

    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as handle:
            header = struct.unpack("<Q", handle.read(8))[0]
        data += f.stat().st_size - 8 - header
        with safe_open(str(f), framework="pt") as handle:
            for n in handle.keys():
                if PER_EXPERT.search(n):
                    shape = handle.get_slice(n).get_shape()
                    routed += 2 * int(torch.tensor(shape).prod())
    return data, routed


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_inspect_accounts_the_saved_bytes(model_type, built):
    from moequant.plan.inspect import inspect_model

    folder = built(model_type)
    data, routed = _file_bytes(folder)
    acc = inspect_model(str(folder / "config.json"))  # from the config alone, no weights read
    assert acc["variants"]["bf16"]["bytes"] == data
    if routed:  # families that store one tensor per expert: counted from the files' own names
        assert acc["variants"]["bf16"]["routed_expert_bytes"] == routed
    assert acc["params_by_role"]["routed_expert"] > 0


def _kl(a, b) -> float:
    a, b = torch.log_softmax(a.float(), -1), torch.log_softmax(b.float(), -1)
    return float((a.exp() * (a - b)).sum(-1).mean())


def _transformers_matches_moequant(checkpoint) -> float:
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    ours = load(checkpoint, torch.float32)
    with torch.no_grad():
        return _kl(ours(TOKENS).logits, theirs(TOKENS).logits)


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_int4_experts_export_reloads_in_transformers(model_type, built, tmp_path):
    from test_export_models import quantize_experts

    from moequant.export.layouts import export_checkpoint

    source = built(model_type)
    out = export_checkpoint(source, quantize_experts(source, lambda L, e, p: "int4-g32-sym"), tmp_path / "int4")
    # the export's experts are quantized: moequant's own reading differs from the source...
    with torch.no_grad():
        ref = load(source, torch.float32)(TOKENS).logits
    assert _kl(ref, load(out, torch.float32)(TOKENS).logits) > 1e-7
    # ...and plain transformers reads the same weights
    assert _transformers_matches_moequant(out) <= 1e-5


@pytest.mark.parametrize("model_type", sorted(NOT_SUPPORTED))
def test_a_family_moequant_does_not_take_is_refused_in_one_sentence(model_type, tmp_path):
    from families import tiny_family_config

    try:
        config = tiny_family_config(model_type).to_dict()
    except Exception:  # noqa: BLE001 - its own config class cannot be shrunk here: the reason says so
        assert "fixture" in NOT_SUPPORTED[model_type]
        return
    config["model_type"] = model_type
    with pytest.raises(UserError) as e:
        adapter_for(config)
    said = str(e.value)
    assert "\n" not in said and said.endswith("."), said
    assert NOT_SUPPORTED[model_type].split(":")[0] in said, (said, NOT_SUPPORTED[model_type])


def _apply(model_dir, out, recipe):
    args = ["apply", "--recipe", recipe, "--model", str(model_dir), "--output", str(out)]
    for s in SMALL:
        args += ["--set", s]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output[-3000:]
    return out / "checkpoint"


@pytest.mark.slow
@pytest.mark.parametrize("model_type", SUPPORTED)
def test_apply_uniform_int4_gptq_reloads_in_transformers(model_type, built, tmp_path):
    checkpoint = _apply(built(model_type), tmp_path / "run", "recipes/uniform-int4.yaml")
    ckpt = open_checkpoint(checkpoint)
    assert any(ckpt.entries[n].encoding != "dense" for n in ckpt.keys() if PER_EXPERT.search(n) or "experts" in n)
    assert _transformers_matches_moequant(checkpoint) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(NAMED))
def test_apply_selective_on_the_named_families(model_type, built, tmp_path):
    checkpoint = _apply(built(model_type), tmp_path / "run", "recipes/selective.yaml")
    with torch.no_grad():
        assert torch.isfinite(load(checkpoint, torch.float32)(TOKENS).logits).all()
