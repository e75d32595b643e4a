"""The streamed export (moequant.export.streamed: each layer packed and written as the output's shards while
the quantize pass runs) writes the checkpoint `export_checkpoint` writes from the pass's work files —
every tensor bit for bit, the same config and export record — for every safetensors layout, and leaves
no work file of codes behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from support.plain import plain_settings
from tiny import build_tiny

from moequant.arch import adapter_for
from moequant.export.streamed import StreamedExport
from moequant.export.write import export_checkpoint
from moequant.io.checkpoint import INDEX_NAME, open_checkpoint
from moequant.measure.data import Sample
from moequant.pipeline import quantize
from moequant.plan.policy import make_plan
from moequant.plan.recipe import load_recipe

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
N, SEQ, BS = 8, 16, 4

CASES = {  # id: (tiny architecture, recipe, overrides, layout, target)
    "ct-gptq-int4-and-int8-non-experts": (
        "qwen3_moe",
        "uniform-int4.yaml",
        ["formats.int4.group_size=32", "keep=[router,embeddings]", "non_experts.format=int8"],
        "compressed-tensors",
        "vllm",
    ),
    "gptq-layout": ("mixtral", "uniform-int4.yaml", ["export.format=gptq"], "gptq", "vllm"),
    "awq-with-folds": (
        "qwen2_moe",
        "uniform-int4.yaml",
        ["algorithms.int4=awq", "formats.int4.symmetric=false", "export.format=awq", "target=transformers"],
        "awq",
        "transformers",
    ),
    "deepseek-fp8": ("deepseek_v3", "fp8-block.yaml", [], "deepseek-fp8", "vllm"),
    "gpt-oss-fused-mxfp4": (
        "gpt_oss",
        "mxfp4-experts.yaml",
        ["export.format=gpt-oss-mxfp4", "target=transformers"],
        "gpt-oss-mxfp4",
        "transformers",
    ),
}


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only: packing on the GPU"),
        ],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_streamed_export_equals_export_from_work_files(case, device, tmp_path):
    """On a GPU the streamed export packs the codes there; the work-file export packs them on the host."""
    model_type, recipe_file, overrides, layout, target = CASES[case]
    src = build_tiny(model_type, tmp_path / "src")
    recipe = load_recipe(RECIPES / recipe_file, [f"model={src}", *overrides])
    ckpt = open_checkpoint(src)
    plan = make_plan(recipe, ckpt, None)
    samples = [
        Sample(row, "test", "test")
        for row in torch.randint(0, 96, (N, SEQ), generator=torch.Generator().manual_seed(0))
    ]
    settings = plain_settings(samples=N, seq_len=SEQ, batch_size=BS, device=device)
    args = {"layout": layout, "target": target, "int8_activations": "none"}

    quantized, report = quantize.quantize_model(
        src, plan, settings, tmp_path / "work_a", samples=samples, progress=False
    )
    reference = export_checkpoint(src, quantized, tmp_path / "from_work_files", max_shard_bytes=1 << 16, **args)

    streamed = StreamedExport(
        ckpt, adapter_for(ckpt.config), plan, tmp_path / "work_b", max_shard_bytes=1 << 16, **args
    )
    top, streamed_report = quantize.quantize_model(
        src, plan, settings, tmp_path / "work_b", samples=samples, progress=False, export=streamed
    )
    out = streamed.finish(tmp_path / "streamed", top)

    expected, written = _tensors(reference), _tensors(out)
    assert expected.keys() == written.keys()
    for name, tensor in expected.items():
        assert tensor.dtype == written[name].dtype and torch.equal(tensor, written[name]), name
    for fname in ("config.json", "moequant_export.json"):
        assert json.loads((out / fname).read_text()) == json.loads((reference / fname).read_text()), fname
    index = json.loads((out / INDEX_NAME).read_text())  # small shards: an index over many files
    assert index["weight_map"].keys() == expected.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    for L, rep in report.items():
        rep, other = dict(rep), dict(streamed_report[L])
        rep.pop("seconds"), other.pop("seconds")
        assert rep == other, L
    # the streamed pass kept no codes of its own: work/ holds the layers' shards (linked into the output)
    # and the pass's records, never a work file of codes
    leftovers = [p.name for p in (tmp_path / "work_b").glob("layer_*.safetensors")]
    assert leftovers == []


def test_streamed_export_refuses_a_plan_its_layout_cannot_hold_before_the_pass(tmp_path):
    from moequant.errors import UserError

    src = build_tiny("qwen3_moe", tmp_path / "src")
    recipe = load_recipe(RECIPES / "uniform-int4.yaml", [f"model={src}"])
    ckpt = open_checkpoint(src)
    with pytest.raises(UserError, match="fp8-block128 only"):
        StreamedExport(
            ckpt,
            adapter_for(ckpt.config),
            make_plan(recipe, ckpt, None),
            tmp_path / "w",
            layout="deepseek-fp8",
            target="vllm",
        )
    assert not (tmp_path / "w").exists()
