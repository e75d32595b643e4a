"""llama.cpp's i-quants (IQ4_XS .. IQ2_XXS) as moequant formats: codes from ggml's own quantizer with our
per-expert imatrix, read by gguf-py as by ggml itself, byte costs from ggml's block sizes, and the
low-bit recipe's budget refusal. llama.cpp is built once into ~/.cache/moequant when missing (these
tests then fail loudly if it cannot be built; they never skip)."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from support import verify_llamacpp as V

from moequant import formats
from moequant.formats.ggml_iq import IQ_TYPES


def _weights(E=2, rows=16, cols=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, rows, cols, generator=g) * torch.rand(E, rows, 1, generator=g)
    w[..., ::37] *= 6
    imp = torch.rand(E, cols, generator=g) ** 4 * 10 + 1e-3  # each expert its own input second moments
    return w, imp


def test_bytes_per_weight_are_ggml_block_sizes():
    for name in IQ_TYPES:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name.upper()]]
        assert formats.nbytes(name, (3, 8, 512)) == 3 * 8 * 512 // block * size
        assert formats.get_format(name).bits_per_weight((8, 512)) == 8 * size / block
    with pytest.raises(Exception, match="not a multiple of the group size 256"):
        formats.nbytes("iq3_s", (4, 128))


@pytest.mark.slow
@pytest.mark.parametrize("name", IQ_TYPES)
def test_codes_are_ggmls_with_each_experts_imatrix(name, llama):
    """Our codes are ggml_quantize_chunk's for each expert with that expert's own imatrix (another expert's
    gives other codes); gguf-py and ggml's dequantize_row decode them to the same values; the imatrix
    lowers the importance-weighted error against none."""
    w, imp = _weights()
    q = formats.quantize_ggml(w, name, importance=imp)
    assert q.codes.shape == (2, 16, formats.nbytes(name, (1, 512)))
    own = V.ggml_quantize([(name, w[e].numpy(), imp[e].numpy()) for e in range(2)])
    swapped = V.ggml_quantize([(name, w[0].numpy(), imp[1].numpy())])[0]
    assert all(np.array_equal(q.codes[e].numpy(), own[e]) for e in range(2))
    assert not np.array_equal(q.codes[0].numpy(), swapped)
    theirs = V.ggml_dequantize([(name, q.codes[e].numpy(), 512) for e in range(2)])
    deq = q.dequantize()
    assert all(np.array_equal(deq[e].numpy(), theirs[e]) for e in range(2))
    flat = formats.quantize_ggml(w, name)  # no imatrix: ones
    err = lambda d: float((imp[:, None, :] * (d - w) ** 2).sum())  # noqa: E731
    assert err(deq) < err(flat.dequantize())


@pytest.fixture(scope="module")
def llama():
    return V.ensure_llama_cpp()


def test_a_budget_the_low_bit_menu_cannot_meet_is_refused_before_calibration(tmp_path):
    """tiny-qwen2moe's down projections are 64 wide: no K or IQ type holds them, so 2 bits per routed weight
    cannot be met; apply refuses in one sentence, exit code 2, before any calibration."""
    out = tmp_path / "run"
    for recipe in ("recipes/gguf-lowbit.yaml", "recipes/gguf-iq.yaml"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "moequant.cli",
                "apply",
                "--recipe",
                recipe,
                "--output",
                str(out),
                "--model",
                "zoo:tiny-qwen2moe",
                "--set",
                "experts.budget.bits_per_weight=2.0",
            ],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 2, proc.stderr
        lines = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith("note:")]
        assert len(lines) == 1 and "below the smallest feasible plan" in lines[0] and "Traceback" not in proc.stderr
        assert not out.exists()


def test_the_smallest_feasible_budget_it_names_is_feasible_with_per_tensor_non_experts():
    """gguf-lowbit's non-experts move between types (non_experts.formats) inside the budget: the refusal's
    "accepted: bits_per_weight >= X" counts them at non_experts.format, so X passes and just below it does not."""
    import re

    from moequant.errors import UserError
    from moequant.io.checkpoint import open_checkpoint
    from moequant.pipeline.apply import resolve_recipe
    from moequant.plan.policy import check_plan
    from moequant.zoo import path as zoo_path

    ckpt = open_checkpoint(zoo_path("tiny-deepseek-v3"))
    recipe = lambda bits: resolve_recipe(
        "recipes/gguf-lowbit.yaml",
        "zoo:tiny-deepseek-v3",
        "runs/x",  # noqa: E731
        [f"experts.budget.bits_per_weight={bits}"],
    )
    with pytest.raises(UserError) as info:
        check_plan(recipe(1.0), ckpt)
    shown = float(re.search(r"bits_per_weight >= ([\d.]+)\.$", str(info.value))[1])
    assert 2.0 < shown < 2.625  # q2_k routed experts, the non-experts at their smallest types
    check_plan(recipe(shown), ckpt)
    with pytest.raises(UserError, match="below the smallest feasible plan"):
        check_plan(recipe(round(shown - 0.002, 4)), ckpt)
