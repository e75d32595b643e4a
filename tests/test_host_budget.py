"""--max-host-memory means what it says: a host budget that cannot hold one decoder layer's read is refused by
the precheck, in one sentence (exit code 2), before any weight is read and with nothing written."""

from __future__ import annotations

import json
import struct

import pytest
from click.testing import CliRunner
from helpers import header_only_checkpoint

from moequant import memory_budget
from moequant.cli import main
from moequant.errors import UserError
from moequant.io.checkpoint import Checkpoint, open_checkpoint
from moequant.pipeline import precheck

# issue 55's model: a Qwen3-MoE of 8 layers x 64 experts, 1.7 GB in bf16 (here its headers only)
SHAPE = dict(
    num_hidden_layers=8,
    hidden_size=1024,
    moe_intermediate_size=512,
    num_experts=64,
    num_experts_per_tok=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    intermediate_size=2048,
    vocab_size=4096,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import Qwen3MoeConfig

    directory = tmp_path_factory.mktemp("host") / "qwen3-moe-1.7g"
    header_only_checkpoint(directory, Qwen3MoeConfig(**SHAPE))
    return directory


def _layer_bytes_from_headers(directory) -> dict[int, int]:
    """Bytes of each decoder layer's tensors, read from the safetensors headers themselves."""
    out: dict[int, int] = {}
    for shard in directory.glob("*.safetensors"):
        raw = shard.read_bytes()[:8]
        (n,) = struct.unpack("<Q", raw)
        with open(shard, "rb") as f:
            f.seek(8)
            header = json.loads(f.read(n))
        for name, entry in header.items():
            if name.startswith("model.layers."):
                layer = int(name.split(".")[2])
                begin, end = entry["data_offsets"]
                out[layer] = out.get(layer, 0) + end - begin
    return out


def test_a_host_budget_below_one_layers_read_is_refused_before_any_weight_is_read(model, tmp_path, monkeypatch):
    reads = []
    real = Checkpoint._read_stored
    monkeypatch.setattr(
        Checkpoint, "_read_stored", lambda self, name, *rest: reads.append(name) or real(self, name, *rest)
    )
    out = tmp_path / "run"
    args = ["apply", "--recipe", "uniform-int4", "--model", str(model), "--output", str(out)]
    result = CliRunner().invoke(main, [*args, "--max-host-memory", "64MB"])
    message = result.output.strip()
    assert result.exit_code == 2, message
    assert (
        message.startswith("error: --max-host-memory 0.06 GiB cannot hold one layer's read: ") and "\n" not in message
    )
    need = float(message.split(" GiB in all")[0].split("(")[-1])
    layers = _layer_bytes_from_headers(model)
    assert need * 2**30 >= max(layers.values())  # at least the largest layer (8 of them, ~210 MB each)
    assert reads == [] and not out.exists()
    memory_budget.configure()


def test_the_host_need_is_the_largest_layer_as_read_plus_what_the_process_holds(model, monkeypatch):
    ckpt = open_checkpoint(model)
    layers = _layer_bytes_from_headers(model)
    layer, nbytes = precheck.layer_host_bytes(ckpt, "cpu")
    assert nbytes == max(layers.values()) and layers[layer] == nbytes
    # on a GPU the routed experts go to the device one at a time: the layer's other tensors and one expert
    expert = 2 * 1024 * 512
    assert precheck.layer_host_bytes(ckpt, "cuda")[1] == nbytes - 64 * 3 * expert + expert
    monkeypatch.setattr(memory_budget, "rss_bytes", lambda: 500 * 2**20)
    try:
        memory_budget.configure(max_host=500 * 2**20 + nbytes)  # exactly enough
        precheck.check_host_memory(ckpt, "cpu")
        memory_budget.configure(max_host=500 * 2**20 + nbytes - 1)
        with pytest.raises(UserError, match="cannot hold one layer's read"):
            precheck.check_host_memory(ckpt, "cpu")
        precheck.check_host_memory(ckpt, "cuda")  # a GPU run's host read is one expert, not the layer
        memory_budget.configure()
        precheck.check_host_memory(ckpt, "cpu")  # no cap: nothing to refuse
    finally:
        memory_budget.configure()
