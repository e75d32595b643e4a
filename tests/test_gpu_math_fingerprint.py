"""The recipe's GPU-math switches (`gptq.gpu_math`: update_matmul, cholesky_matmul, cholesky, triton, cuda_graphs):
validated as recipe keys, recorded in the run fingerprint only when set away from their defaults (so a recipe that
leaves them alone has the fingerprint and plan.json it had before), read by the GPTQ code from the recipe, and the
environment variables that chose them before refused in one sentence."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import make_layer

from moequant.algorithms import cholesky, gptq_triton, refit_triton
from moequant.algorithms.gpu_math import GpuMath
from moequant.algorithms.registry import algorithm
from moequant.cli import main
from moequant.formats import parse_key, search_triton
from moequant.io.checkpoint import open_checkpoint
from moequant.pipeline.apply import calibration_settings, resolve_recipe, run_fingerprint
from moequant.plan.policy import make_plan
from moequant.plan.recipe import recipe_to_dict

MODEL = "zoo:tiny-qwen2moe"
RECIPE = "recipes/uniform-int4.yaml"
SPEC = parse_key("int4-g32-sym")
AWAY = [  # each switch away from its default
    ("update_matmul", "fp32"),
    ("cholesky_matmul", "fp32"),
    ("cholesky", "looped"),
    ("triton", False),
    ("cuda_graphs", False),
]


def _fingerprint(*overrides):
    """(run fingerprint, the calibration settings' fingerprint fields, the recipe as plan.json holds it)."""
    recipe = resolve_recipe(RECIPE, MODEL, "runs/unused", list(overrides))
    ckpt = open_checkpoint(recipe.model)
    settings = calibration_settings(recipe, ckpt=ckpt)
    return run_fingerprint(recipe, ckpt, settings, make_plan(recipe, ckpt)), settings, recipe_to_dict(recipe)


def _set(key, value) -> str:
    return f"gptq.gpu_math.{key}={str(value).lower()}"


def test_defaults_leave_fingerprint_and_recipe_record_as_before():
    plain, settings, recipe = _fingerprint()
    assert settings.fingerprint_fields()["gpu_math"] == {}
    assert recipe["gptq"] == {"grid": "searched", "refit": True}  # no gpu_math entry: plan.json as before
    spelled_out = [_set(k, v) for k, v in GpuMath().model_dump().items()]  # every default, written out
    assert _fingerprint(*spelled_out)[0] == plain


@pytest.mark.parametrize("key, value", AWAY)
def test_each_switch_set_away_changes_the_run_fingerprint(key, value):
    plain, plain_settings, _ = _fingerprint()
    fingerprint, settings, recipe = _fingerprint(_set(key, value))
    assert fingerprint != plain
    fields, before = settings.fingerprint_fields(), plain_settings.fingerprint_fields()
    assert fields["gpu_math"] == {key: value}
    assert {k: v for k, v in fields.items() if k != "gpu_math"} == {k: v for k, v in before.items() if k != "gpu_math"}
    assert recipe["gptq"]["gpu_math"] == {key: value}
    # what the quantize pass and the probe hand to GPTQ
    assert getattr(settings.algorithm_options["gptq"].gpu_math, key) == value


def _plan_cli(tmp_path, *sets):
    out = tmp_path / "run"
    args = ["plan", "--recipe", RECIPE, "--model", MODEL, "--output", str(out)]
    for s in sets:
        args += ["--set", s]
    result = CliRunner().invoke(main, args)
    return result, out


@pytest.mark.parametrize(
    "setting, sentence",
    [
        (
            "gptq.gpu_math.cholesky=fast",
            "key 'gptq.gpu_math.cholesky' has value 'fast'; accepted: 'auto', 'torch', 'looped' or 'blocked'.",
        ),
        ("gptq.gpu_math.triton=maybe", "key 'gptq.gpu_math.triton' has value 'maybe'; accepted: true or false."),
        ("gptq.gpu_math.update_matmul=bf16", "key 'gptq.gpu_math.update_matmul' has value 'bf16'; accepted: 'tf32'"),
        ("gptq.gpu_math.tf32=true", "unknown key 'gptq.gpu_math.tf32'; accepted keys here: update_matmul,"),
    ],
)
def test_bad_value_refused_in_one_sentence(tmp_path, setting, sentence):
    result, out = _plan_cli(tmp_path, setting)
    assert result.exit_code == 2
    assert result.output.startswith(f"error: --set {setting} (on recipe {RECIPE}): ")
    assert sentence in result.output and result.output.count("\n") == 1
    assert not out.exists()  # nothing written


@pytest.mark.parametrize(
    "variable, key",
    [
        ("MOEQUANT_GPTQ_MATMUL", "update_matmul"),
        ("MOEQUANT_GPTQ_CHOLESKY_MATMUL", "cholesky_matmul"),
        ("MOEQUANT_CHOLESKY", "cholesky"),
        ("MOEQUANT_TRITON", "triton"),
        ("MOEQUANT_CUDA_GRAPHS", "cuda_graphs"),
    ],
)
def test_old_environment_variable_refused_naming_its_recipe_key(tmp_path, monkeypatch, variable, key):
    monkeypatch.setenv(variable, "1")  # even a value that was the default: it is no longer read
    result, out = _plan_cli(tmp_path)
    assert result.exit_code == 2
    assert result.output == (
        f"error: the environment variable {variable} is no longer read: unset it and set the recipe key "
        f"gptq.gpu_math.{key} instead (e.g. --set gptq.gpu_math.{key}=...).\n"
    )
    assert not out.exists()


def _spd(n, count, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 2 * n, n, generator=g, dtype=torch.float64)
    return x.mT @ x / (2 * n) + 0.1 * torch.eye(n, dtype=torch.float64)


@pytest.mark.parametrize("how", ["auto", "torch", "looped", "blocked"])
def test_cholesky_choice_runs_its_routine_and_matches_float64(monkeypatch, how):
    """On the CPU too the choice decides the routine: torch's batched call, one call per matrix, or the blocked
    factorization (order 640 > its 512-column panels: two panels); each factor matches numpy's float64 one and a
    matrix that is not positive definite is reported where it fails."""
    a = _spd(640, 3, seed=1)
    a[2, 300, 300] = -1.0  # not positive definite from column 301 on
    exact = np.linalg.cholesky(a[:2].numpy())
    ran = set()
    real_ex, real_blocked = torch.linalg.cholesky_ex, cholesky.blocked_cholesky

    def recorded_ex(m, *args, **kwargs):
        if m.shape[-1] == 640:  # a whole matrix (the blocked one factors 512- and 128-column panels)
            ran.add("batched" if m.dim() == 3 else "single")
        return real_ex(m, *args, **kwargs)

    def recorded_blocked(*args, **kwargs):
        ran.add("blocked")
        return real_blocked(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, "cholesky_ex", recorded_ex)
    monkeypatch.setattr(cholesky, "blocked_cholesky", recorded_blocked)
    factor, info = cholesky.cholesky_ex(a.float().clone(), how=how)
    assert ran == {"auto": {"batched"}, "torch": {"batched"}, "looped": {"single"}, "blocked": {"blocked"}}[how]
    assert info.tolist()[:2] == [0, 0] and info.tolist()[2] == 301
    err = np.abs(factor[:2].double().numpy() - exact).max() / np.abs(exact).max()
    assert err < 1e-5, err


def test_gptq_reads_the_recipe_cholesky_choice(monkeypatch):
    """The recipe's gptq.gpu_math.cholesky reaches GPTQ's factorization through the registered algorithm (as
    the quantize pass and the probe call it), and every routine gives the float64 solve's codes."""
    w, h, _ = make_layer(experts=2, out=16, n_in=64, tokens=400, seed=3)
    seen = []
    real = cholesky.cholesky_ex

    def recorded(a, tf32=False, how="auto"):
        seen.append(how)
        return real(a, tf32, how)

    monkeypatch.setattr(cholesky, "cholesky_ex", recorded)
    gptq = algorithm("gptq")
    exact, _ = gptq.quantize([w.double()], SPEC, h.double(), None, "cpu", "test")
    for how in ("torch", "looped", "blocked"):
        options = resolve_recipe(RECIPE, MODEL, None, [_set("cholesky", how)]).gptq
        seen.clear()
        (q,), _ = gptq.quantize([w], SPEC, h, options, "cpu", "test")
        assert seen and set(seen) == {how}
        differ = (q.codes != exact[0].codes).float().mean().item()
        assert differ < 2e-2, (how, differ)  # float32 against float64: a rare code at a rounding boundary


@pytest.mark.parametrize("triton", [True, False])
def test_triton_switch_decides_whether_the_kernels_are_considered(monkeypatch, triton):
    """gpu_math.triton=false keeps GPTQ's sweep, its refit and its searched grid from even asking whether
    their Triton kernel applies (each `usable` check is recorded here and answers no)."""
    asked = set()

    def recorder(name):
        def usable(*args, **kwargs):
            asked.add(name)
            return False

        return usable

    monkeypatch.setattr(gptq_triton, "usable", recorder("sweep"))
    monkeypatch.setattr(refit_triton, "usable", recorder("refit"))
    monkeypatch.setattr(search_triton, "usable", recorder("grid"))
    w, h, _ = make_layer(experts=2, out=16, n_in=64, tokens=400, seed=4)
    options = resolve_recipe(RECIPE, MODEL, None, [_set("triton", triton)]).gptq
    assert (options.grid, options.refit) == ("searched", True)
    algorithm("gptq").quantize([w], SPEC, h, options, "cpu", "test")
    assert asked == ({"sweep", "refit", "grid"} if triton else set())
