"""Expert pruning (issue 58): saliency from the calibration pass, the recipe's `experts.prune`, the pruned export."""

from __future__ import annotations

import pytest
import torch
from support.plain import plain_settings
from tiny import build_tiny

from moequant.measure.calibrate import LayerCollector, calibrate
from moequant.measure.data import Sample
from moequant.measure.stats import load_stats

SEQ, N, BS = 24, 6, 3


def _samples(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Sample(torch.randint(0, 96, (SEQ,), generator=g), "code", "test") for _ in range(N)]


def reap_reference(directory, samples):
    """REAP's criterion in float64 from the unmodified transformers model: per MoE layer, the mean over each
    expert's routed tokens of router weight x ||expert output||, the output computed from the fused weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64, experts_implementation="eager")
    seen, hooks = {}, []
    for L, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        if not hasattr(mlp, "experts"):
            continue
        seen[L] = {"route": [], "x": []}
        hooks.append(mlp.gate.register_forward_hook(lambda m, a, out, L=L: seen[L]["route"].append(out[1:])))
        hooks.append(mlp.experts.register_forward_pre_hook(lambda m, a, L=L: seen[L]["x"].append(a[0])))
    ids = torch.stack([s.input_ids for s in samples])
    with torch.no_grad():
        for batch in torch.split(ids, BS):
            model(input_ids=batch)
    for h in hooks:
        h.remove()
    out = {}
    for L, got in seen.items():
        experts = model.model.layers[L].mlp.experts
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in got["x"]])
        weights = torch.cat([w.reshape(-1, w.shape[-1]) for w, _ in got["route"]]).double()
        indices = torch.cat([i.reshape(-1, i.shape[-1]) for _, i in got["route"]])
        scores = torch.zeros(experts.num_experts, dtype=torch.float64)
        for e in range(experts.num_experts):
            tok, slot = (indices == e).nonzero(as_tuple=True)
            if tok.numel():
                gate, up = (x[tok] @ experts.gate_up_proj[e].T).chunk(2, dim=-1)
                y = (experts.act_fn(gate) * up) @ experts.down_proj[e].T
                scores[e] = (weights[tok, slot] * y.norm(dim=-1)).mean()
        out[L] = scores
    return out


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("grouped", [False, True])
def test_reap_saliency_matches_a_float64_computation(tmp_path, monkeypatch, model_type, grouped):
    directory = build_tiny(model_type, tmp_path / "model", seed=3)
    # grouped: several experts' padded rows at once (the path accelerators take), here on the CPU
    monkeypatch.setattr(LayerCollector, "_grouped", lambda self, dev: grouped)
    samples = _samples()
    settings = plain_settings(samples=N, seq_len=SEQ, batch_size=BS, formats=("int8-channel",), probe_samples=0)
    stats = load_stats(calibrate(str(directory), tmp_path / "stats", settings, samples=samples, progress=False))
    reference = reap_reference(directory, samples)
    assert sorted(stats.layers) == sorted(reference)
    for L, expected in reference.items():
        got = stats.layers[L].tensors["saliency.reap"]
        assert got.dtype == torch.float64 and got.shape == expected.shape
        assert (expected > 0).sum() >= 2  # several experts were routed to: the comparison means something
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-9)
