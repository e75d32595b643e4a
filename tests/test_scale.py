"""The real-scale pipeline's memory and work bounds, measured on the CPU (not timings).

- A random Qwen3-MoE of >= 1 GB quantized end to end by `moequant apply` (report included), in a
  subprocess whose peak RSS is its own: peak RSS stays within a fixed overhead + a few decoder layers,
  no term growing with the model (the export streams the codes); stats/ is not written (a uniform recipe
  calibrates nothing) and scratch stays below the model's size.
- An all-RTN recipe runs no forward at all (no LayerRunner is built) and writes exactly the codes of
  round-to-nearest applied to the checkpoint's own weights (an independent computation).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(
    hidden_size=1024,
    moe_intermediate_size=512,
    num_experts=64,
    num_experts_per_tok=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    intermediate_size=2048,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    norm_topk_prob=True,
)


pytestmark = pytest.mark.slow


def _build(directory: Path, layers: int) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    from moequant import zoo

    config = AutoConfig.for_model("qwen3_moe", num_hidden_layers=layers, vocab_size=4096, **SHAPE)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((zoo.path("tiny-qwen2moe") / name).read_bytes())
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("scale") / "qwen3-moe-1g"
    nbytes = _build(directory, 6)
    assert nbytes >= 1e9
    return directory, nbytes


def test_a_1gb_moe_end_to_end_in_bounded_memory(big_model, tmp_path):
    directory, nbytes = big_model
    out = tmp_path / "run"
    code = (
        "import json; from moequant.pipeline.apply import apply; "
        f"apply({str(ROOT / 'recipes/uniform-int8.yaml')!r}, model={str(directory)!r}, output={str(out)!r}, "
        "overrides=['evaluate.samples=2', 'evaluate.seq_len=64'], progress=False, log=lambda *a: None); "
        "status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines()); "
        "print(json.dumps({k: int(status[k].split()[0]) * 1024 for k in ('VmHWM', 'RssAnon', 'RssFile')}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    # VmHWM: this process's own peak. Not ru_maxrss: Linux folds the parent's peak into it at exec (fs/exec.c
    # exec_mmap), so a child of a large pytest process would report pytest's memory
    rss = measured["VmHWM"]
    layer_bytes = nbytes / 6
    report = json.loads((out / "report.json").read_text())
    assert report["quality"]["kl_mean"] < 0.01 and report["memory"]["bits_per_weight_experts"] < 8.2
    assert not (out / "stats").exists() and not (out / "work").exists()
    # what the pipeline holds: imports + skeleton (~0.6 GB) and allocator slack, one decoder layer as a
    # float32 working copy and its dequantized copy (the next layer read ahead in the checkpoint's dtype
    # meanwhile). The export streams the codes from work/ tensor by tensor: no term grows with the model.
    bound = 1.5e9 + 2 * 2 * layer_bytes
    print(
        f"peak RSS {rss / 1e9:.2f} GB for a {nbytes / 1e9:.2f} GB model (bound {bound / 1e9:.2f} GB); "
        f"(at the end: RssAnon {measured['RssAnon'] / 1e9:.2f} GB, RssFile {measured['RssFile'] / 1e9:.2f} GB)"
    )
    assert rss < bound


def test_round_to_nearest_plans_run_no_forward_and_write_rtn_codes(big_model, tmp_path, monkeypatch):
    from moequant import formats
    from moequant.arch import adapter_for
    from moequant.io import layers
    from moequant.io.checkpoint import open_checkpoint
    from moequant.io.loader import dequantized_state_dict
    from moequant.pipeline.apply import apply

    directory, _ = big_model

    def no_forward(*args, **kwargs):
        raise AssertionError("an all-RTN plan built a LayerRunner for the quantize pass")

    import moequant.pipeline.quantize as quantize

    monkeypatch.setattr(quantize, "LayerRunner", no_forward)
    monkeypatch.setattr(layers, "LayerRunner", layers.LayerRunner)  # evaluation still runs layer by layer
    apply(
        str(ROOT / "recipes/uniform-int8.yaml"),
        model=str(directory),
        output=str(tmp_path / "run"),
        overrides=["evaluate.samples=2", "evaluate.seq_len=32"],
        progress=False,
        log=lambda *a: None,
    )
    ckpt = open_checkpoint(directory)
    adapter = adapter_for(ckpt.config)
    written = dequantized_state_dict(tmp_path / "run" / "checkpoint", torch.float32)
    L = adapter.moe_layers[-1]
    for e in (0, adapter.num_experts - 1):
        for proj in adapter.projections:
            name = adapter.expert_tensor_name(L, e, proj)
            w = ckpt.get(name).float()
            expected = formats.quantize(w, formats.parse_key("int8-channel")).dequantize(torch.float32)
            assert torch.equal(written[name], expected), name
