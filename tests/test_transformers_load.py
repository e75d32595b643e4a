"""Plain transformers (`AutoModelForCausalLM.from_pretrained`, the installed 5.x) on our compressed-tensors
exports: a checkpoint whose routed experts share one format loads with moequant.load's weights (logits
KL <= 1e-4); one whose routed experts have several formats (the selective plan's int8 / int4 layers) is
refused loudly, with the sentence pointing to moequant.load / vLLM, never loaded silently wrong."""

from __future__ import annotations

import logging

import pytest
import torch
from test_export_models import quantize_experts

from moequant.export.write import export_checkpoint
from moequant.io.loader import load
from moequant.layouts.compressed_tensors import TRANSFORMERS_REFUSAL
from moequant.zoo import path as zoo_path

TOKENS = torch.randint(1, 1000, (2, 32), generator=torch.Generator().manual_seed(0))


def plain_transformers(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


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


def test_routed_experts_in_several_formats_are_refused_loudly(tmp_path, capfd, caplog):
    source = zoo_path("tiny-qwen2moe")
    # the selective plan's shape: one format per layer, int4 and int8 layers
    experts = quantize_experts(source, lambda L, e, p: ["int4-g32-sym", "int8-channel"][L % 2])
    out = export_checkpoint(source, experts, tmp_path / "mixed")
    assert kl_to_moequant(out, load(out, torch.float32)) == 0  # moequant.load reads it
    with caplog.at_level(logging.WARNING), pytest.raises(Exception):  # noqa: B017 - transformers' own error type
        plain_transformers(out)
    said = capfd.readouterr().err + caplog.text
    assert TRANSFORMERS_REFUSAL in said, said[-2000:]
    assert "moequant.load" in TRANSFORMERS_REFUSAL and "vLLM" in TRANSFORMERS_REFUSAL
    unmatched = {line.split("Could not match", 1)[1] for line in said.splitlines() if "Could not match" in line}
    assert len(unmatched) == 1 and TRANSFORMERS_REFUSAL in unmatched.pop()  # the refusal alone, no expert's name
