"""Plain transformers (`AutoModelForCausalLM.from_pretrained`, the installed 5.x) on our compressed-tensors
exports: a checkpoint whose routed experts share one format loads with moequant.load's weights (logits
KL <= 1e-4) and no per-expert warning; one whose routed experts have several formats (the selective plan's
int8 / int4 layers), which transformers cannot decode, stops before loading in one line naming moequant.load,
never loaded silently wrong."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_export_models import quantize_experts

from moequant.cli import main
from moequant.export.write import export_checkpoint
from moequant.io.checkpoint import open_checkpoint
from moequant.io.loader import load
from moequant.layouts.compressed_tensors import (
    FUSED_REFUSAL,
    SPLIT_REFUSAL,
    TRANSFORMERS_REFUSAL,
    UNQUANTIZED_EXPERTS,
    transformers_alias_target,
    transformers_stop,
    without_transformers_stop,
)
from moequant.zoo import path as zoo_path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["calibration.samples=8", "calibration.seq_len=64", "evaluate.samples=4", "evaluate.seq_len=64"]
TOKENS = torch.randint(1, 1000, (2, 32), generator=torch.Generator().manual_seed(0))


def plain_transformers(checkpoint, dtype=torch.float32, **options):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=dtype, **options).eval()


def apply(recipe: str, out: Path) -> Path:
    """`moequant apply` of a bundled recipe on the default model (zoo:tiny-qwen2moe), small settings."""
    args = ["apply", "--recipe", str(ROOT / "recipes" / recipe), "--model", "zoo:tiny-qwen2moe", "--output", str(out)]
    for s in SMALL:
        args += ["--set", s]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out / "checkpoint"


@pytest.fixture(scope="module")
def selective(tmp_path_factory):
    checkpoint = apply("selective.yaml", tmp_path_factory.mktemp("selective") / "run")
    plan = json.loads((checkpoint.parent / "plan.json").read_text())
    assert len({t["format"] for t in plan["tensors"] if t["role"] == "routed_expert"}) > 1  # a per-layer mix
    return checkpoint


def kl_to_moequant(checkpoint, model) -> float:
    with torch.no_grad():
        ours = torch.log_softmax(load(checkpoint, torch.float32)(TOKENS).logits, -1)
        theirs = torch.log_softmax(model(TOKENS).logits, -1)
    return float((ours.exp() * (ours - theirs)).sum(-1).mean())


def test_one_routed_expert_format_loads_with_moequant_weights_and_no_warning_per_expert(tmp_path, capfd, caplog):
    """transformers 5 holds a layer's experts in one module: targets naming every expert matched nothing there and
    compressed-tensors warned "Could not match" once per expert projection (192 lines on tiny-qwen2moe)."""
    source = zoo_path("tiny-qwen2moe")
    out = export_checkpoint(source, quantize_experts(source, lambda L, e, p: "int4-g32-sym"), tmp_path / "int4")
    with caplog.at_level(logging.WARNING):
        model = plain_transformers(out)
    said = capfd.readouterr().err + caplog.text
    assert "Could not match" not in said, said[-2000:]
    assert kl_to_moequant(out, model) <= 1e-4


def test_an_export_with_nothing_quantized_is_a_plain_checkpoint_transformers_loads(tmp_path):
    """Nothing quantized (a pruned model kept in bf16, or a plan keeping every tensor): no quantization_config is
    written, since transformers' compressed-tensors loader takes the experts' scheme from the first config group
    and failed on a config with none; the export's logits are the source's in transformers itself, bit for bit."""
    from transformers import AutoModelForCausalLM

    source = zoo_path("tiny-qwen2moe")
    out = export_checkpoint(source, {}, tmp_path / "plain", target="transformers")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()(TOKENS).logits
        ours = plain_transformers(out)(TOKENS).logits
    assert torch.equal(ours, theirs)


def test_uniform_recipe_checkpoint_loads_quietly_with_moequant_weights(tmp_path, capfd, caplog):
    """The same through `moequant apply --recipe uniform-int4.yaml` (GPTQ's mirrored grids: negative scales)."""
    checkpoint = apply("uniform-int4.yaml", tmp_path / "run")
    assert "attn_implementation" not in json.loads((checkpoint / "config.json").read_text())
    capfd.readouterr()
    with caplog.at_level(logging.WARNING):
        model = plain_transformers(checkpoint, dtype=torch.bfloat16)
    said = capfd.readouterr().err + caplog.text
    assert "Could not match" not in said, said[-2000:]
    # equal in the checkpoint's own dtype: transformers multiplies the codes by the bf16 scales in bf16, moequant
    # in float32 and rounds once (in float32 the two differ by that rounding: KL ~2e-4 here)
    with torch.no_grad():
        assert torch.equal(model(TOKENS).logits, load(checkpoint, torch.bfloat16)(TOKENS).logits)


def test_non_experts_only_recipe_checkpoint_loads_with_moequant_weights(tmp_path, capfd, caplog):
    """recipes/non-experts-only.yaml: attention and shared experts int8, routed experts bf16. transformers runs the
    routed experts through one group's scheme whatever `ignore` says, and under the int8 group it kept only packed
    codes: the load failed ("Concatenate ... Ckpt contains: 0"). The export now names an FP8 group first (matching
    no module), under which transformers passes weights without a scale through: it loads moequant's weights."""
    checkpoint = apply("non-experts-only.yaml", tmp_path / "run")
    config = json.loads((checkpoint / "config.json").read_text())
    assert "attn_implementation" not in config
    assert list(config["quantization_config"]["config_groups"])[0] == UNQUANTIZED_EXPERTS
    capfd.readouterr()
    with caplog.at_level(logging.WARNING):
        model = plain_transformers(checkpoint, dtype=torch.bfloat16)
    said = capfd.readouterr().err + caplog.text
    unmatched = {line.split("Could not match", 1)[1] for line in said.splitlines() if "Could not match" in line}
    assert len(unmatched) <= 1 and all("stored unquantized" in u for u in unmatched), said[-2000:]
    with torch.no_grad():
        assert torch.equal(model(TOKENS).logits, load(checkpoint, torch.bfloat16)(TOKENS).logits)
    assert open_checkpoint(checkpoint).config["quantization_config"] == config["quantization_config"]


def test_bf16_routed_experts_beside_int4_ones_stop_plain_transformers_in_one_line(tmp_path, capfd, caplog):
    """Some MoE layers' experts int4 and the others bf16 is a mix transformers cannot read either (it decodes every
    routed expert with the int4 scheme and found no codes in the bf16 layers, failing mid-load): bf16 counts as a
    format, so the export has the mix's stop; moequant reads it."""
    source = zoo_path("tiny-qwen2moe")
    experts = quantize_experts(source, lambda L, e, p: "int4-g32-sym" if L % 2 == 0 else None)
    out = export_checkpoint(source, experts, tmp_path / "half")
    capfd.readouterr()
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError) as refused:
        plain_transformers(out)
    assert TRANSFORMERS_REFUSAL in str(refused.value)
    every_int4 = export_checkpoint(source, quantize_experts(source, lambda L, e, p: "int4-g32-sym"), tmp_path / "all")
    assert kl_to_moequant(every_int4, plain_transformers(every_int4)) <= 1e-4  # one format: no stop
    ours, theirs = load(out, torch.float32).model.layers, load(source, torch.float32).model.layers
    for L in range(len(ours)):  # moequant reads each layer's own format: the bf16 layers are the source's
        assert torch.equal(ours[L].mlp.experts.down_proj, theirs[L].mlp.experts.down_proj) == (L % 2 == 1)


def test_selective_recipe_checkpoint_stops_plain_transformers_in_one_line(selective, capfd, caplog):
    """transformers 5 decodes every routed expert with one scheme, so no quantization_config makes it read a
    per-layer int4 / int8 mix: it must refuse before building the model, in one line naming moequant.load.
    Before, one "Could not match" warning among its progress bars, then its own AttributeError mid-load."""
    capfd.readouterr()
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError) as refused:
        plain_transformers(selective)
    said = capfd.readouterr().err + caplog.text
    message = str(refused.value)
    assert TRANSFORMERS_REFUSAL in message and "\n" not in message
    assert "moequant.load" in TRANSFORMERS_REFUSAL
    assert said.strip() == "", said[-2000:]  # nothing printed before it: no warning, no progress bar
    # moequant reads past the stop and builds the model transformers would (its default attention)
    assert "attn_implementation" not in open_checkpoint(selective).config
    assert load(selective, torch.float32).config._attn_implementation == "sdpa"


def test_selective_checkpoint_is_refused_when_attn_implementation_is_given(selective, capfd, caplog):
    """A caller's own attn_implementation overrides config.json's stop: the guard group still stops the load,
    with its one warning naming moequant.load and no expert's name, never decoding a layer with another's scheme."""
    capfd.readouterr()
    with caplog.at_level(logging.WARNING), pytest.raises(Exception):  # noqa: B017 - transformers' own error type
        plain_transformers(selective, attn_implementation="sdpa")
    said = capfd.readouterr().err + caplog.text
    unmatched = {line.split("Could not match", 1)[1] for line in said.splitlines() if "Could not match" in line}
    assert len(unmatched) == 1 and TRANSFORMERS_REFUSAL in unmatched.pop(), said[-2000:]


def test_the_stop_is_written_and_dropped_only_for_a_mix():
    mixed = {"model_type": "qwen2_moe", "quantization_config": {"config_groups": {"moequant_transformers_guard": {}}}}
    stopped = transformers_stop(mixed)
    assert stopped["attn_implementation"] == {"": TRANSFORMERS_REFUSAL}
    assert without_transformers_stop(stopped) == mixed
    uniform = {"model_type": "qwen2_moe", "quantization_config": {"config_groups": {"group_0": {}}}}
    assert transformers_stop(uniform) == uniform
    own = {"model_type": "qwen2_moe", "attn_implementation": "eager"}  # a source's own choice is kept
    assert without_transformers_stop(own) == own
    split = transformers_stop(uniform, split_quantized=True)  # a quantized module transformers splits on load
    assert split["attn_implementation"] == {"": SPLIT_REFUSAL} and without_transformers_stop(split) == uniform
    assert transformers_stop(mixed, split_quantized=True)["attn_implementation"] == {"": TRANSFORMERS_REFUSAL}


def test_the_fused_experts_stop_is_written_and_dropped_beside_the_mix_stop():
    """A family whose own checkpoints keep experts fused gets its stop on experts_implementation, also beside a
    mix's stop; moequant drops both and keeps a source's own experts_implementation."""
    uniform = {"model_type": "gemma4", "quantization_config": {"config_groups": {"group_0": {}}}}
    stopped = transformers_stop(uniform, experts_fused_on_disk=True)
    assert stopped["experts_implementation"] == {"": FUSED_REFUSAL} and "attn_implementation" not in stopped
    assert without_transformers_stop(stopped) == uniform
    mixed = {"model_type": "gemma4", "quantization_config": {"config_groups": {"moequant_transformers_guard": {}}}}
    both = transformers_stop(mixed, experts_fused_on_disk=True)
    assert both["attn_implementation"] == {"": TRANSFORMERS_REFUSAL}  # checked first: no registration reads a mix
    assert both["experts_implementation"] == {"": FUSED_REFUSAL}
    assert without_transformers_stop(both) == mixed
    own = {"model_type": "gemma4", "experts_implementation": "eager"}
    assert without_transformers_stop(own) == own


def test_the_fused_experts_stop_is_accepted_where_moequant_says_so():
    """What vLLM's Transformers modeling backend does with an export's config (AutoModel.from_config, then its own
    experts): in a fresh process transformers stops at the fused-experts sentence, and after accept_fused_stop (the
    vLLM plugin's call; register_for_transformers makes it too) it builds the model."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from transformers import AutoConfig, AutoModel\n"
        "from moequant.layouts.compressed_tensors import FUSED_REFUSAL, accept_fused_stop\n"
        "config = AutoConfig.for_model('granitemoe', hidden_size=32, intermediate_size=16, num_hidden_layers=1,\n"
        "    num_attention_heads=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,\n"
        "    vocab_size=64, experts_implementation={'': FUSED_REFUSAL})\n"
        "try: AutoModel.from_config(config)\n"
        "except ValueError as e: print(FUSED_REFUSAL in str(e))\n"
        "else: print('built')\n"
        "accept_fused_stop()\n"
        "print(type(AutoModel.from_config(config)).__name__)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["True", "GraniteMoeModel"], run.stdout


def test_the_alias_target_names_exactly_its_modules_and_never_spells_experts():
    """transformers takes the routed experts' scheme from the first group whose `re:` targets say "experts": the
    alias of a shared expert's module must not, and it must match its modules and no other layer's."""
    import re

    modules = [f"model.layers.{L}.self_attn.o_b_proj" for L in (0, 1, 12)] + ["model.layers.3.mlp.shared_experts.w1"]
    target = transformers_alias_target(modules)
    assert target.startswith("re:") and "experts" not in target
    others = [
        "model.layers.2.self_attn.o_b_proj",
        "model.layers.120.self_attn.o_b_proj",
        "model.layers.1.mlp.shared_experts.w1",
    ]
    assert [m for m in modules + others if re.match(target[3:], m)] == modules
