"""Recipe schema: bundled recipes parse, overrides apply, and bad input gets one exact sentence."""

from pathlib import Path

import pytest

from moequant.errors import UserError
from moequant.plan.recipe import apply_overrides, load_recipe, parse_layer_ranges, recipe_from_dict

ROOT = Path(__file__).resolve().parents[1]

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
BUDGET = {"method": "budget", "budget": {"bits_per_weight": 4.5}}


def error_of(data) -> str:
    with pytest.raises(UserError) as info:
        recipe_from_dict(data, "r.yaml")
    return str(info.value)


def test_bundled_recipes_parse():
    names = sorted(p.name for p in RECIPES.glob("*.yaml"))
    for required in (
        "selective.yaml",
        "uniform-int4.yaml",
        "uniform-fp8.yaml",
        "mxfp4-experts.yaml",
        "fp8-block.yaml",
        "non-experts-only.yaml",
        "frequency-rules.yaml",
        "per-expert.yaml",
    ):
        assert required in names
    # the default model, but for the low-bit GGUF budgets: 64-wide down projections hold no K / IQ type
    wide = {"gguf-lowbit.yaml", "gguf-iq.yaml"}
    for name in names:
        recipe = load_recipe(RECIPES / name)
        assert recipe.model == ("zoo:tiny-qwen3moe" if name in wide else "zoo:tiny-qwen2moe"), name
    selective = load_recipe(RECIPES / "selective.yaml")
    assert (selective.target, selective.experts.method) == ("vllm", "budget")
    per_expert = load_recipe(RECIPES / "per-expert.yaml")
    assert (per_expert.target, per_expert.experts.method) == ("transformers", "budget")
    assert load_recipe(RECIPES / "frequency-rules.yaml").experts.rules[0].share_at_least == 2.0


def test_defaults_without_a_file():
    recipe = load_recipe(None)
    assert recipe.model == "zoo:tiny-qwen2moe"
    assert recipe.target == "vllm"
    assert recipe.experts.method == "budget" and recipe.experts.budget.bits_per_weight == 5.5
    assert recipe.algorithm_for("int4") == "gptq" and recipe.algorithm_for("bf16") == "none"
    assert recipe.calibration.probe_samples == 32  # the per-layer KL probe is on by default
    assert load_recipe(None, ["calibration.probe_samples=0"]).calibration.probe_samples == 0


def test_overrides_set_nested_keys_with_yaml_values(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("target: vllm\nexperts: {method: budget, budget: {bits_per_weight: 4.5}}\n")
    recipe = load_recipe(
        path,
        [
            "experts.budget.bits_per_weight=4.75",
            "target=transformers",
            "keep=[router, attention]",
            "model=zoo:other",
            "formats.int4.group_size=64",
        ],
    )
    assert recipe.experts.budget.bits_per_weight == 4.75
    assert recipe.target == "transformers"
    assert recipe.keep == ["router", "attention"]
    assert recipe.model == "zoo:other"
    assert recipe.formats == {"int4": {"group_size": 64}}
    swapped = load_recipe(path, ["experts.budget={gigabytes: 2}"])
    assert swapped.experts.budget.gigabytes == 2 and swapped.experts.budget.bits_per_weight is None


def test_override_errors(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("target: vllm\n")
    with pytest.raises(UserError) as info:
        load_recipe(path, ["target"])
    assert str(info.value) == (
        "override 'target' is not of the form dotted.key=value (e.g. experts.budget.bits_per_weight=4.5)."
    )
    with pytest.raises(UserError) as info:
        load_recipe(path, ["target.kind=x"])
    assert (
        str(info.value)
        == "override 'target.kind=x': key 'target' holds 'vllm', not a mapping, so it has no key 'kind'."
    )
    with pytest.raises(UserError) as info:
        load_recipe(path, ["targte=vllm"])
    # the typo is the override's, not the file's
    assert str(info.value).startswith(
        f"--set targte=vllm (on recipe {path}): unknown key 'targte'; accepted keys here: model, output, target,"
    )
    with pytest.raises(UserError) as info:
        load_recipe(path, ["experts.budget.bits_per_weigth=4"])
    assert str(info.value).startswith(
        f"--set experts.budget.bits_per_weigth=4 (on recipe {path}): unknown key 'experts.budget.bits_per_weigth'"
    )
    # the input dict is not modified
    data = {"experts": {"method": "uniform"}}
    apply_overrides(data, ["experts.format=int4"])
    assert data == {"experts": {"method": "uniform"}}


def test_file_errors(tmp_path):
    with pytest.raises(UserError) as info:
        load_recipe(tmp_path / "missing.yaml")
    assert str(info.value) == f"recipe {tmp_path / 'missing.yaml'} does not exist or is not a file."
    bad = tmp_path / "bad.yaml"
    bad.write_text("experts: {method: [\n")
    with pytest.raises(UserError) as info:
        load_recipe(bad)
    assert str(info.value).startswith(f"recipe {bad} is not valid YAML at line ")


def test_yaml_errors_name_the_line_of_the_mistake(tmp_path):
    """The line the typo is on (1-based), also for an unclosed bracket that the parser notices a line later."""
    shipped = (ROOT / "recipes" / "selective.yaml").read_text().splitlines()
    line = next(i for i, text in enumerate(shipped) if text.startswith("  budget: {"))
    for typo in (shipped[line].replace("}", ""), shipped[line].replace("  budget", " budget")):
        bad = tmp_path / "bad.yaml"
        bad.write_text("\n".join([*shipped[:line], typo, *shipped[line + 1 :]]) + "\n")
        with pytest.raises(UserError) as info:
            load_recipe(bad)
        assert str(info.value).startswith(f"recipe {bad} is not valid YAML at line {line + 1}:"), (typo, info.value)
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    with pytest.raises(UserError) as info:
        load_recipe(listed)
    assert str(info.value) == (
        f"recipe {listed}: the top level is list, but a mapping of keys (model, target, experts, ...) is accepted."
    )


def test_unknown_keys():
    assert error_of({"colour": 1}) == (
        "recipe r.yaml: unknown key 'colour'; accepted keys here: model, output, target, calibration, keep, "
        "non_experts, experts, algorithms, gptq, formats, export, evaluate, seed."
    )
    assert error_of({"experts": {**BUDGET, "foo": 1}}) == (
        "recipe r.yaml: unknown key 'experts.foo'; accepted keys here: method, budget, formats, format, rules, "
        "usage_floor, prune."
    )
    assert error_of({"experts": {"method": "rules", "rules": [{"format": "int4", "share": 2}]}}) == (
        "recipe r.yaml: unknown key 'experts.rules[0].share'; accepted keys here: share_at_least, share_below, "
        "layers, format."
    )


def test_gptq_section_names_its_accepted_values():
    assert error_of({"gptq": {"grid": "fancy"}}) == (
        "recipe r.yaml: key 'gptq.grid' has value 'fancy'; accepted: 'minmax' or 'searched'."
    )
    assert (
        error_of({"gptq": {"refit": "maybe"}})
        == "recipe r.yaml: key 'gptq.refit' has value 'maybe'; accepted: true or false."
    )
    assert (
        error_of({"gptq": {"colour": 1}})
        == "recipe r.yaml: unknown key 'gptq.colour'; accepted keys here: grid, refit, gpu_math."
    )
    assert error_of({"gptq": {"gpu_math": {"cholesky": "fast"}}}) == (
        "recipe r.yaml: key 'gptq.gpu_math.cholesky' has value 'fast'; accepted: 'auto', 'torch', 'looped' or "
        "'blocked'."
    )


def test_wrong_types_and_values():
    assert error_of({"target": "tgi"}) == (
        "recipe r.yaml: key 'target' has value 'tgi'; accepted: 'vllm', 'sglang', 'transformers', 'llama.cpp', 'vllm-moequant' or "
        "'vllm-cuda'."
    )
    assert error_of({"experts": {"method": "sometimes"}}) == (
        "recipe r.yaml: key 'experts.method' has value 'sometimes'; accepted: 'budget', 'rules' or 'uniform'."
    )
    assert error_of({"experts": {"method": "budget", "budget": {"bits_per_weight": "lots"}}}) == (
        "recipe r.yaml: key 'experts.budget.bits_per_weight' has value 'lots'; accepted: a number."
    )
    assert error_of({"seed": "x"}) == "recipe r.yaml: key 'seed' has value 'x'; accepted: a whole number."
    assert error_of({"calibration": {"samples": 0}}) == (
        "recipe r.yaml: key 'calibration.samples' has value 0; accepted: a number greater than 0."
    )
    assert error_of({"calibration": {"probe_samples": -1}}) == (
        "recipe r.yaml: key 'calibration.probe_samples' has value -1; accepted: a number of at least 0."
    )
    assert error_of({"calibration": {"hessian_prior": -0.5}}) == (
        "recipe r.yaml: key 'calibration.hessian_prior' has value -0.5; accepted: a number of at least 0."
    )
    assert error_of({"calibration": {"hessian_prior": "strong"}}) == (
        "recipe r.yaml: key 'calibration.hessian_prior' has value 'strong'; accepted: a number."
    )
    assert error_of({"calibration": {"probe_samples": 2.5}}) == (
        "recipe r.yaml: key 'calibration.probe_samples' has value 2.5; accepted: a whole number."
    )
    assert error_of({"calibration": {"probe_algorithm": "awq"}}) == (
        "recipe r.yaml: key 'calibration.probe_algorithm' has value 'awq'; accepted: 'auto', 'rtn' or 'gptq'."
    )
    assert error_of({"keep": "router"}) == "recipe r.yaml: key 'keep' has value 'router'; accepted: a list."
    assert error_of({"algorithms": {"int4": "magic"}}) == (
        "recipe r.yaml: key 'algorithms.int4' has value 'magic'; accepted: 'rtn', 'gptq', 'awq' or 'imatrix'."
    )
    assert error_of({"export": {"format": "onnx"}}) == (
        "recipe r.yaml: key 'export.format' has value 'onnx'; accepted: 'compressed-tensors', 'gptq', 'awq', "
        "'fp8-block', 'gpt-oss-mxfp4' or 'gguf'."
    )


def test_negative_and_ambiguous_budgets():
    assert error_of({"experts": {"method": "budget", "budget": {"bits_per_weight": -1}}}) == (
        "recipe r.yaml: key 'experts.budget.bits_per_weight' has value -1; accepted: a number greater than 0."
    )
    assert error_of({"experts": {"method": "budget", "budget": {"gigabytes": 0}}}) == (
        "recipe r.yaml: key 'experts.budget.gigabytes' has value 0; accepted: a number greater than 0."
    )
    assert error_of({"experts": {"method": "budget", "budget": {"bits_per_weight": 4, "gigabytes": 2}}}) == (
        "recipe r.yaml: key 'experts.budget': give exactly one of bits_per_weight or gigabytes "
        "(override the whole budget, e.g. experts.budget={gigabytes: 2})."
    )
    assert error_of({"experts": {"method": "budget"}}) == (
        "recipe r.yaml: key 'experts': method budget needs experts.budget, e.g. {bits_per_weight: 4.5} "
        "or {gigabytes: 12}."
    )


def test_unknown_formats_and_bad_format_params():
    accepted = (
        "accepted: bf16, fp8, int8, int4, int3, int2, mxfp4, mxfp8, nvfp4, q8_0, q6_k, q5_k, q5_1, q5_0, q4_k, "
        "q4_1, q4_0, q3_k, q2_k, iq4_xs, iq3_s, iq3_xxs, iq2_s, iq2_xs, iq2_xxs (or an exact key such as "
        "int4-g64-sym)."
    )
    assert error_of({"experts": {"method": "uniform", "format": "int5"}}) == (
        f"recipe r.yaml: key 'experts.format': 'int5' is not a format; {accepted}"
    )
    assert error_of({"experts": {**BUDGET, "formats": ["fp8", "int9"]}}) == (
        f"recipe r.yaml: key 'experts.formats[1]': 'int9' is not a format; {accepted}"
    )
    assert error_of({"formats": {"int5": {}}}) == (
        "recipe r.yaml: key 'formats': 'int5' is not a format name; accepted: bf16, fp8, int8, int4, int3, int2, "
        "mxfp4, mxfp8, nvfp4, q8_0, q6_k, q5_k, q5_1, q5_0, q4_k, q4_1, q4_0, q3_k, q2_k, iq4_xs, iq3_s, iq3_xxs, "
        "iq2_s, iq2_xs, iq2_xxs."
    )
    assert error_of({"formats": {"int4": {"group_size": 100}}}) == (
        "recipe r.yaml: key 'formats.int4' (int4): int4 group_size 100 is not supported; accepted: 32, 64, 128."
    )
    # the formats module words the reason; the recipe names the key and the entry
    message = error_of({"experts": {**BUDGET, "formats": ["int4-g100-sym"]}})
    assert message.startswith("recipe r.yaml: key 'experts.formats[0]' (int4-g100-sym): ") and "100" in message


def test_rules_need_a_format_and_valid_layers():
    assert error_of({"experts": {"method": "rules", "rules": [{"share_at_least": 2}]}}) == (
        "recipe r.yaml: key 'experts.rules[0].format' is required."
    )
    assert error_of({"experts": {"method": "rules", "rules": [{"layers": "3-1", "format": "int4"}]}}) == (
        "recipe r.yaml: key 'experts.rules[0].layers': '3-1' is not a layer list; accepted: e.g. \"0-3,7\"."
    )
    assert error_of({"experts": {"method": "rules"}}) == (
        "recipe r.yaml: key 'experts': method rules needs a non-empty experts.rules list."
    )
    assert error_of({"experts": {"method": "uniform"}}) == (
        "recipe r.yaml: key 'experts': method uniform needs experts.format, e.g. int4."
    )


def test_keep_entries():
    assert error_of({"keep": ["atention"]}) == (
        "recipe r.yaml: key 'keep': 'atention' is not a keep entry; accepted: router, shared_expert_gate, "
        "shared_experts, attention, dense_mlp, embeddings, lm_head, routed_experts, or a tensor-name pattern "
        "containing '*' or '.'."
    )
    recipe = recipe_from_dict({"keep": ["router", "model.layers.0.*"]})
    assert recipe.keep == ["router", "model.layers.0.*"]


def test_layer_ranges():
    assert parse_layer_ranges("0-3,7") == {0, 1, 2, 3, 7}
    assert parse_layer_ranges(5) == {5}
    assert parse_layer_ranges(" 2 - 4 , 9") == {2, 3, 4, 9}
    for bad in ("a", "1-", "-1", "3-1", ""):
        with pytest.raises(ValueError):
            parse_layer_ranges(bad)


def test_probe_settings_reach_calibration():
    from moequant.pipeline.apply import calibration_settings, resolve_recipe

    settings = calibration_settings(
        resolve_recipe(None, overrides=["calibration.probe_samples=3", "calibration.probe_algorithm=gptq"])
    )
    assert (settings.probe_samples, settings.probe_algorithm) == (3, "gptq")
