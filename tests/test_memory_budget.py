"""The run's one memory budget (moequant.memory_budget): sizes, chunks that never change results, and the
precheck that refuses a layer the GPU budget cannot hold before any weight is read."""

from __future__ import annotations

import time

import pytest
import torch
from click.testing import CliRunner
from helpers import header_only_checkpoint, make_layer

from moequant import memory_budget
from moequant.algorithms import gptq
from moequant.cli import main
from moequant.errors import UserError


@pytest.mark.parametrize(
    "text, want",
    [("60GiB", 60 * 2**30), ("512MiB", 512 * 2**20), ("1.5T", int(1.5 * 2**40)), ("123", 123), ("2 GB", 2 * 2**30)],
)
def test_memory_sizes_are_read_as_written(text, want):
    assert memory_budget.parse_bytes(text, "--max-gpu-memory") == want


@pytest.mark.parametrize("text", ["lots", "60 GiBs", "-1G", ""])
def test_a_malformed_memory_size_is_one_sentence(text):
    with pytest.raises(UserError, match="is not a memory size; write it like 60GiB"):
        memory_budget.parse_bytes(text, "--max-gpu-memory")


def test_gptq_batches_sized_by_a_small_budget_give_the_same_codes(monkeypatch):
    """A budget that fits one expert at a time (GPTQ's batches come from moequant.memory_budget) changes
    nothing: every expert's solve is its own."""
    w, h, _ = make_layer(experts=5, out=24, n_in=64, tokens=300, seed=4)
    whole, rep_whole = gptq.gptq_pass(w, h, "int4-g32-sym", grid="searched", refit=True)
    monkeypatch.setattr(memory_budget, "temporary_bytes", lambda device: 1)
    small, rep_small = gptq.gptq_pass(w, h, "int4-g32-sym", grid="searched", refit=True)
    assert rep_small.settings["chunk_experts"] == 1 and rep_whole.settings["chunk_experts"] == 5
    assert torch.equal(whole.codes, small.codes) and torch.equal(whole.scales, small.scales)


def test_the_host_cap_bounds_what_a_chunk_may_take():
    try:
        memory_budget.configure(max_host="1GiB")
        assert memory_budget.device_free_bytes("cpu") == 0  # this process alone holds more than 1 GiB - margin
        assert memory_budget.temporary_bytes("cpu") == 2**26  # the floor: one small chunk still runs
    finally:
        memory_budget.configure()


def test_a_deepseek_v3_layer_under_a_small_gpu_budget_is_refused_before_reading_weights(tmp_path, monkeypatch):
    from transformers import DeepseekV3Config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the budget is checked, not the GPU's presence

    model = tmp_path / "deepseek-v3-shape"
    header_only_checkpoint(model, DeepseekV3Config(num_hidden_layers=4, first_k_dense_replace=3))
    out = tmp_path / "run"
    t0 = time.perf_counter()
    result = CliRunner().invoke(
        main,
        [
            "apply",
            "--recipe",
            "uniform-int4",
            "--model",
            str(model),
            "--output",
            str(out),
            "--device",
            "cuda",
            "--max-gpu-memory",
            "16GiB",
        ],
    )
    assert time.perf_counter() - t0 < 10  # headers only: ~13 GB of (sparse) weights are never read
    message = result.output.strip()
    assert result.exit_code == 2, message
    assert message.startswith("error: layer 3 of ") and "\n" not in message, message
    need = float(message.split("needs at least ")[1].split(" GiB")[0])
    # 256 experts x 3 x 7168 x 2048 bf16 weights, twice, are 42 GiB on their own
    assert need > 2 * 2 * 256 * 3 * 7168 * 2048 / 2**30
    assert "more than --max-gpu-memory 16.0 GiB" in message
    assert not out.exists()
    # the same run under a budget that holds the layer gets past the check (to the missing tokenizer)
    result = CliRunner().invoke(
        main,
        [
            "apply",
            "--recipe",
            "uniform-int4",
            "--model",
            str(model),
            "--output",
            str(out),
            "--device",
            "cuda",
            "--max-gpu-memory",
            "120GiB",
        ],
    )
    assert result.exit_code == 2 and "needs at least" not in result.output, result.output
    assert not out.exists()
    from moequant import memory_budget as b

    assert b.gpu_limit_bytes() == 120 * 2**30
    CliRunner().invoke(main, ["apply", "--recipe", "uniform-int4", "--model", str(model), "--output", str(out)])
    assert b.gpu_limit_bytes() is None  # each invocation sets its own caps


def test_a_cuda_out_of_memory_is_one_sentence_and_exit_2(monkeypatch, tmp_path):
    """An OOM the budget did not foresee (raised here where the pass would raise it) is reported as one
    sentence, exit 2, never a traceback."""
    from moequant.pipeline import apply as apply_module

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(apply_module, "apply", oom)
    result = CliRunner().invoke(main, ["apply", "--recipe", "uniform-int4", "--output", str(tmp_path / "run")])
    message = result.output.strip()
    assert result.exit_code == 2 and "\n" not in message and "Traceback" not in message, message
    assert message.startswith("error: the GPU ran out of memory (CUDA out of memory. Tried to allocate 20.00 GiB)")


def test_a_read_ahead_s_reservation_is_left_free_until_released(monkeypatch):
    """The next layer's read-ahead allocates on another thread while this layer sizes its chunks: its bytes
    are reserved from the moment it is submitted (the DeepSeek-V3 two-layer runs ran out of memory when
    chunks took what the read-ahead was about to fill), and given back once, however often released."""
    # a card whose default share (GPU_DEFAULT_SHARE of 150 GiB) is above what is free: free memory bounds
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * 2**30, 150 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    free = memory_budget.device_free_bytes("cuda")
    assert free == 100 * 2**30 - memory_budget.MARGIN_BYTES
    release = memory_budget.reserve_gpu(30 * 2**30)
    assert memory_budget.device_free_bytes("cuda") == free - 30 * 2**30
    assert memory_budget.temporary_bytes("cuda") == int(0.85 * (free - 30 * 2**30))
    release()
    release()
    assert memory_budget.device_free_bytes("cuda") == free


def test_without_a_cap_a_run_takes_a_share_of_an_80_gb_card_and_reserves_at_most_60_gib(monkeypatch):
    """Issue 55 item 3: by default the budget allocates at most GPU_DEFAULT_SHARE of the card even where more is
    free, and the allocator's reserved bound (`bound_allocator` hands it to torch) stays under 60 GiB on an 80 GB
    card; an explicit --max-gpu-memory replaces the share, and the reserved bound never exceeds the card."""
    total = 80 * 10**9  # an "80 GB" card (an H100 80GB HBM3 reports about 79.2 GiB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - 2**30, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2**30)
    assert memory_budget.device_free_bytes("cuda") == int(0.70 * total) - 2**30 - memory_budget.MARGIN_BYTES
    assert memory_budget.gpu_cap(None, total) < memory_budget.reserved_cap(None, total) <= 60 * 2**30
    try:
        memory_budget.configure(max_gpu="70GiB")
        assert memory_budget.device_free_bytes("cuda") == 70 * 2**30 - 2**30 - memory_budget.MARGIN_BYTES
        assert memory_budget.reserved_cap(memory_budget.gpu_limit_bytes(), total) == total
    finally:
        memory_budget.configure()
