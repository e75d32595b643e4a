"""`moequant.load` and `moequant eval` of a GGUF export (issue 57): every weight is gguf-py's dequantization of
the file, put back under the transformers model's names (llama.cpp's row order of q / k undone for Mixtral's
`llama` graph), checked against gguf-py read here and against the source's own weights."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from moequant import formats
from moequant.arch import adapter_for
from moequant.export.write import export_checkpoint
from moequant.io.checkpoint import open_checkpoint
from moequant.io.loader import load
from moequant.zoo import path as zoo_path

TYPES = {"gate": "q4_0", "up": "q5_0", "down": "q8_0"}  # 32-blocks: every bundled expert width holds them


def _export(model: str, out):
    source = zoo_path(model)
    ckpt = open_checkpoint(source)
    ad = adapter_for(ckpt.config)
    quantized = {}
    for L in ad.moe_layers:
        for p in ad.projections:
            q = formats.quantize_ggml(ad.read_experts(ckpt, L, p).float(), TYPES[p])
            quantized.update({(L, e, p): q.expert(e) for e in range(ad.num_experts)})
    return source, ad, export_checkpoint(source, quantized, out, layout="gguf", target="llama.cpp")


def _gguf_py(path) -> dict[str, torch.Tensor]:
    reader = gguf.GGUFReader(str(path))
    return {
        t.name: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        for t in reader.tensors
    }


@pytest.mark.parametrize("model", ["tiny-qwen2moe", "tiny-mixtral"])
def test_moequant_load_of_a_gguf_export_is_gguf_py_s_dequantization(model, tmp_path):
    source, ad, out = _export(model, tmp_path / "gguf")
    theirs = _gguf_py(out / "model.gguf")
    loaded = load(out, dtype=torch.float32)
    state = loaded.state_dict()
    i = ad.expert_intermediate
    for L in ad.moe_layers:
        experts = ad.experts_module(loaded, L)
        assert torch.equal(experts.gate_up_proj[:, :i], theirs[f"blk.{L}.ffn_gate_exps.weight"])
        assert torch.equal(experts.gate_up_proj[:, i:], theirs[f"blk.{L}.ffn_up_exps.weight"])
        assert torch.equal(experts.down_proj, theirs[f"blk.{L}.ffn_down_exps.weight"])
    # every other weight is stored in bf16 or F32: the source's own (as moequant.load reads the source), rounded
    # at most once to bf16, whatever order llama.cpp keeps its rows in (Mixtral's q / k: rope pairs interleaved)
    original = load(source, dtype=torch.float32).state_dict()
    others = [k for k in original if ".experts." not in k]
    assert set(state) == set(original) and len(others) > 10
    for name in others:
        assert torch.allclose(state[name], original[name], rtol=2**-8, atol=0), name


def test_moequant_eval_reads_a_gguf_export_and_an_old_one_is_one_sentence(tmp_path):
    from moequant.cli import main

    _, _, out = _export("tiny-qwen2moe", tmp_path / "gguf")
    args = ["--reference", "zoo:tiny-qwen2moe", "--samples", "2", "--seq-len", "32", "--json"]
    result = CliRunner().invoke(main, ["eval", str(out), *args])
    assert result.exit_code == 0, result.output
    quality = json.loads(result.stdout)
    assert 0 < quality["kl_mean"] < 0.1 and quality["tokens"] == 64
    info = json.loads((out / "moequant_export.json").read_text())
    del info["config"]  # as GGUF exports were written before the config was recorded
    (out / "moequant_export.json").write_text(json.dumps(info))
    result = CliRunner().invoke(main, ["eval", str(out), *args])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "has no model config next to it" in result.output and "moequant apply" in result.output
