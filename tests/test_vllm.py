"""vLLM's CPU build loads moequant's exports and agrees with moequant.load().

This test RUNS in CI: it builds the cached vLLM venv when it is missing (~3 min, ~3.5 GB, once;
`python -m moequant.verify_vllm --install-only` does the same ahead of time) and fails loudly
when vLLM cannot be installed or run. All checkpoints go through one vLLM worker process.
Control: vLLM's outputs for the W4A16 export, scored against moequant.load() of the same
weights with the experts rotated by one (what a name-mapping bug in a reader would do), must
fail the same check, so the tolerances are shown to separate a correct read from a misread one.
"""

from __future__ import annotations

import pytest
import torch

from moequant.algorithms.gptq import gptq
from moequant.arch import adapter_for
from moequant.checkpoint import open_checkpoint
from moequant.export import export_checkpoint
from moequant.verify_vllm import compare_with_moequant, default_prompts, engine_dtype, ensure_vllm_env, run_vllm
from test_export_models import VOCAB, build_model, quantize_experts

MODELS = ("mixtral", "qwen2_moe")


def gptq_experts(source, key: str, seed: int = 0) -> dict:
    """GPTQ all routed experts with Hessians of random (correlated) activations."""
    ckpt = open_checkpoint(source)
    ad = adapter_for(ckpt.config)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in ad.moe_layers:
        for proj in ad.projections:
            w = ad.read_experts(ckpt, layer, proj).float()
            x = torch.randn(w.shape[0], 512, w.shape[-1], generator=gen) @ (
                torch.eye(w.shape[-1]) + 0.3 * torch.randn(w.shape[-1], w.shape[-1], generator=gen) / w.shape[-1] ** 0.5)
            q, report = gptq(w, x.transpose(1, 2) @ x / x.shape[1], key)
            assert set(report.method) == {"gptq"}
            for e in range(w.shape[0]):
                out[(layer, e, proj)] = q.expert(e)
    return out


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    good, broken = [], []
    for kind in MODELS:
        src = build_model(kind, root / kind)
        int4 = gptq_experts(src, "int4-g128-sym")
        int8 = quantize_experts(src, lambda L, e, p: "int8-channel")
        mix = {k: (int4 if k[0] == 0 else int8)[k] for k in int4}
        good += [
            export_checkpoint(src, int4, root / f"{kind}-w4a16"),
            export_checkpoint(src, int8, root / f"{kind}-w8a8", int8_activations="dynamic"),
            export_checkpoint(src, mix, root / f"{kind}-mix", int8_activations="dynamic"),
            export_checkpoint(src, int4, root / f"{kind}-gptq", layout="gptq"),
        ]
        rotated = {(L, (e + 1) % 4, p): q for (L, e, p), q in int4.items()}  # a name-mapping bug
        broken.append(export_checkpoint(src, rotated, root / f"{kind}-broken"))
    return good, broken


def test_vllm_cpu_loads_our_exports_and_agrees_with_moequant_load(exports):
    good, broken = exports
    ensure_vllm_env()  # builds it when missing; raises (never skips) when it cannot
    prompts = default_prompts(VOCAB, n=3, length=8)
    checkpoints = good
    outs = run_vllm(checkpoints, prompts, steps=32, dtype=[engine_dtype(c) for c in checkpoints],
                    max_model_len=64)
    lines, failed = [], []
    for c in good:
        report = compare_with_moequant(c, prompts, outs[str(c.resolve())])
        lines.append(report.summary())
        if not report.ok:
            failed.append(f"{report.summary()}\n  " + "\n  ".join(report.failures[:5]))
        assert report.steps == 3 * 32
    print("\n".join(lines))
    assert not failed, "\n".join(failed)
    for kind, misread in zip(MODELS, broken):
        w4a16 = next(c for c in good if c.name == f"{kind}-w4a16")
        report = compare_with_moequant(misread, prompts, outs[str(w4a16.resolve())])
        print("control:", report.summary())
        assert not report.ok, f"a misread of the experts passed the vLLM check: {report.summary()}"
