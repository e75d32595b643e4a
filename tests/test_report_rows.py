"""Rows of report.md that a GGUF run showed unclearly: per-projection types, a tied lm_head's bytes, and the
byte unit (kB) the plan, inspect and the report share."""

from __future__ import annotations

from moequant.arch import adapter_for
from moequant.io.checkpoint import open_checkpoint
from moequant.plan.memory import format_bytes
from moequant.report import _expert_formats
from moequant.report.views import _summary_tables


def tensor(layer, expert, proj, key):
    return {"role": "routed_expert", "layer": layer, "expert": expert, "proj": proj, "format": key}


def test_projections_of_different_types_are_named():
    adapter = adapter_for(open_checkpoint("zoo:tiny-qwen2moe").config)
    plan = {
        "tensors": [
            tensor(0, 0, "gate", "q4_k"),
            tensor(0, 0, "up", "q4_k"),
            tensor(0, 0, "down", "q5_0"),
            tensor(0, 1, "gate", "int4"),
            tensor(0, 1, "up", "int4"),
            tensor(0, 1, "down", "int4"),
        ]
    }
    assert _expert_formats(plan, None, adapter) == {(0, 0): "gate+up:q4_k down:q5_0", (0, 1): "int4"}


def test_a_tied_lm_head_written_out_says_it_is_a_copy():
    memory = {
        "bytes_original": 10,
        "bytes_quantized": 10,
        "bits_per_weight_original": 16.0,
        "bits_per_weight": 16.0,
        "bits_per_weight_experts_original": 16.0,
        "bits_per_weight_experts": 16.0,
        "layout_metadata_bytes": 0,
        "bytes_per_token": {"original": 1, "quantized": 1},
        "gpus_needed": {"original": {}, "quantized": {}},
        "gpu_sizes_gb": [],
        "kv_headroom": 0.1,
        "by_role": {
            "embedding": {"weights": 360448, "bytes_original": 720896, "bytes_quantized": 720896},
            "lm_head": {"weights": 0, "bytes_original": 0, "bytes_quantized": 720896},
        },
    }
    (_, header, rows), *_ = [t for t in _summary_tables({"memory": memory, "experts": []}) if t[0] == "Bytes by role"]
    row = dict(zip(header, next(r for r in rows if r[0] == "lm_head")))
    assert row == {
        "role": "lm_head",
        "weights": "0 (tied: a copy of the embeddings)",
        "original": "0 B",
        "quantized": "720.90 kB",
        "bits/weight": "–",
    }


def test_one_byte_unit_everywhere():
    assert format_bytes(720896) == "720.90 kB"
    assert format_bytes(999) == "999 B" and format_bytes(2.5e9) == "2.50 GB"
