"""Foundation: adapters against transformers' own models, checkpoint access, inspect, bad input."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tiny import TINY_CONFIGS, build_tiny

from moequant.arch import adapter_for, supported_model_types
from moequant.cli import main
from moequant.errors import UserError
from moequant.io.checkpoint import atomic_directory, open_checkpoint, read_safetensors_header
from moequant.io.shards import ShardWriter

CONFIGS = Path(__file__).parent / "data" / "configs"
PUBLISHED = json.loads((CONFIGS / "published.json").read_text())


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {mt: build_tiny(mt, root / mt) for mt in TINY_CONFIGS}


def run_cli(*args):
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


# ---------------------------------------------------------------- adapters vs transformers


@pytest.mark.parametrize("model_type", list(TINY_CONFIGS))
def test_expected_tensors_equal_what_transformers_writes(tiny_dirs, model_type):
    ckpt = open_checkpoint(tiny_dirs[model_type])
    adapter = adapter_for(ckpt.config)
    expected = {n: tuple(s) for n, (s, _) in adapter.expected_tensors().items()}
    on_disk = {n: tuple(e.shape) for n, e in ckpt.entries.items()}
    assert expected == on_disk
    adapter.check_shapes(ckpt)


@pytest.mark.parametrize("model_type", list(TINY_CONFIGS))
def test_expert_reads_equal_transformers_parameters(tiny_dirs, model_type):
    from transformers import AutoModelForCausalLM

    directory = tiny_dirs[model_type]
    ckpt = open_checkpoint(directory)
    adapter = adapter_for(ckpt.config)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    checked = 0
    for layer in adapter.moe_layers:
        experts = adapter.experts_module(model, layer)
        for proj in adapter.projections:
            stacked = adapter.read_experts(ckpt, layer, proj)
            for e in range(adapter.num_experts):
                ours = adapter.read_expert(ckpt, layer, e, proj)
                theirs = adapter.expert_from_module(experts, e, proj)
                assert ours.shape == adapter.expert_shape(proj)
                assert torch.equal(ours, theirs.detach())
                assert torch.equal(stacked[e], ours)
                checked += 1
    assert checked == len(adapter.moe_layers) * adapter.num_experts * 3


@pytest.mark.parametrize("model_type", list(TINY_CONFIGS))
def test_write_expert_round_trips_through_transformers(tiny_dirs, tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    src = tiny_dirs[model_type]
    ckpt = open_checkpoint(src)
    adapter = adapter_for(ckpt.config)
    layer, expert = adapter.moe_layers[-1], adapter.num_experts - 1
    tensors = {n: ckpt.get(n).clone() for n in ckpt.keys()}
    new = {p: torch.randn(adapter.expert_shape(p)).to(torch.bfloat16) for p in adapter.projections}
    for p, w in new.items():
        adapter.write_expert(tensors, layer, expert, p, w)
    out = tmp_path / "out"
    with atomic_directory(out) as tmp:
        writer = ShardWriter(tmp, max_shard_bytes=20_000)  # force several shards
        for n, t in tensors.items():
            writer.add(n, t)
        shards = writer.finish()
        shutil.copyfile(src / "config.json", tmp / "config.json")
    assert len(shards) > 1 and (out / "model.safetensors.index.json").exists()
    back = open_checkpoint(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    for p, w in new.items():
        assert torch.equal(adapter.read_expert(back, layer, expert, p), w)
        assert torch.equal(adapter.expert_from_module(adapter.experts_module(model, layer), expert, p).detach(), w)
    # the other experts are untouched
    other = 0 if expert else 1
    assert torch.equal(adapter.read_expert(back, layer, other, "down"), adapter.read_expert(ckpt, layer, other, "down"))


def test_shard_writer_threads_write_the_same_files(tmp_path, monkeypatch):
    """Several writing threads (the streamed export's) give the files one thread writes, byte for byte, and the
    tensors read back through safetensors' own reader; a write that fails is raised, not lost."""
    from safetensors.torch import load_file

    import moequant.io.shards as shards_module

    g = torch.Generator().manual_seed(0)
    tensors = {
        f"t{i}": torch.randn(37 + i, 50, generator=g).to(dt) for i, dt in enumerate([torch.bfloat16, torch.float32] * 6)
    }
    tensors["codes"] = torch.randint(0, 255, (333,), generator=g, dtype=torch.uint8)
    monkeypatch.setattr(shards_module, "IN_FLIGHT_BYTES", 20_000)  # the bound on bytes in flight is exercised too
    files = {}
    for threads in (0, 3):
        d = tmp_path / f"threads{threads}"
        d.mkdir()
        writer = ShardWriter(d, max_shard_bytes=30_000, threads=threads)
        for n, t in tensors.items():
            writer.add(n, t)
        assert writer.finish()[0] == "model-00001-of-00003.safetensors"  # several shards
        files[threads] = {p.name: p.read_bytes() for p in sorted(d.iterdir())}
    assert files[0] == files[3]
    back = {}
    for name in files[3]:
        if name.endswith(".safetensors"):
            back.update(load_file(tmp_path / "threads3" / name))
    assert back.keys() == tensors.keys() and all(torch.equal(back[n], t) for n, t in tensors.items())

    def broken(fd, position, tensor, ready=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shards_module, "_write_at", broken)
    (tmp_path / "broken").mkdir()
    writer = ShardWriter(tmp_path / "broken", max_shard_bytes=30_000, threads=2)
    with pytest.raises(OSError, match="No space left"):
        for n, t in tensors.items():
            writer.add(n, t)
        writer.close()


def test_roles_cover_every_tensor_and_routers_are_found(tiny_dirs):
    for model_type, directory in tiny_dirs.items():
        ckpt = open_checkpoint(directory)
        adapter = adapter_for(ckpt.config)
        roles = {adapter.classify(n).role for n in ckpt.keys()}
        assert "other" not in roles, model_type
        assert {"router", "routed_expert", "attention", "embedding", "lm_head", "norm"} <= roles
        if model_type == "qwen2_moe":
            assert {"shared_expert", "shared_expert_gate"} <= roles
        if model_type.startswith("deepseek"):
            assert {"shared_expert", "dense_mlp"} <= roles
            assert adapter.dense_layers == [0]


def test_routing_metadata():
    ds = adapter_for(json.loads((CONFIGS / "deepseek-v3.json").read_text())).routing
    assert (ds.scoring, ds.groups, ds.topk_groups, ds.scaling, ds.correction_bias) == ("sigmoid", 8, 4, 2.5, True)
    mx = adapter_for(json.loads((CONFIGS / "mixtral-8x7b.json").read_text())).routing
    assert (mx.scoring, mx.top_k, mx.normalize_topk) == ("softmax", 2, True)
    go = adapter_for(json.loads((CONFIGS / "gpt-oss-120b.json").read_text())).routing
    assert go.scoring == "softmax_over_topk" and go.router_bias


# ---------------------------------------------------------------- inspect on published configs


def _within(ours: float, published: float, rounding: str = "nearest") -> bool:
    """1 %, or the published figure's own precision when coarser (half a unit of its last digit
    when rounded to nearest, one unit above it when the publisher truncates)."""
    text = repr(published)
    decimals = len(text.split(".")[1]) if "." in text and not text.endswith(".0") else 0
    unit = 10.0**-decimals
    if rounding == "truncated":
        return published - 0.01 * published <= ours < published + max(0.01 * published, unit)
    return abs(ours - published) <= max(0.01 * published, 0.5 * unit)


@pytest.mark.parametrize("name", [k for k in PUBLISHED if not k.startswith("_")])
def test_inspect_matches_published_parameter_counts(name):
    code, out = run_cli("inspect", "--json", str(CONFIGS / f"{name}.json"))
    assert code == 0, out
    acc = json.loads(out)
    assert isinstance(acc["total_params"], int) and isinstance(acc["active_params"], int)
    pub = PUBLISHED[name]
    assert abs(acc["total_params"] / 1e9 / pub["total"] - 1) < 0.01
    key = (
        "active_params_excluding_embedding"
        if pub.get("active_convention") == "excluding_embedding"
        else "active_params"
    )
    assert _within(acc[key] / 1e9, pub["active"], pub.get("active_rounding", "nearest")), (acc[key], pub)


def test_memory_account_identities():
    acc = json.loads(run_cli("inspect", "--json", str(CONFIGS / "mixtral-8x7b.json"))[1])
    v = acc["variants"]
    routed = acc["params_by_role"]["routed_expert"]
    non_routed = acc["total_params"] - routed
    assert v["bf16"]["bytes"] == 2 * acc["total_params"]
    # int8 per-channel: 1 byte per weight + one bf16 (2 B) scale per output row of each expert
    rows = 32 * 8 * (14336 + 14336 + 4096)
    assert v["int8"]["bytes"] == 2 * non_routed + routed + 2 * rows
    # int4 group 128: half a byte per weight + a bf16 scale per group of 128
    assert v["int4-g128"]["bytes"] == 2 * non_routed + routed // 2 + 2 * (routed // 128)
    # mxfp4: 4.25 bits per weight
    assert v["mxfp4"]["bytes"] == 2 * non_routed + routed * 17 // 32
    # per token at bf16: non-routed without the embedding table + 2 of 8 experts
    emb = acc["params_by_role"]["embedding"]
    assert v["bf16"]["bytes_per_token"] == 2 * (non_routed - emb) + 2 * routed * 2 // 8
    assert v["bf16"]["gpus_needed"]["80GB"] == math.ceil(v["bf16"]["bytes"] * 1.2 / 80e9)


def test_tied_embedding_counts_as_read_per_token():
    cfg = json.loads((CONFIGS / "mixtral-8x7b.json").read_text())
    untied = json.loads(run_cli("inspect", "--json", str(CONFIGS / "mixtral-8x7b.json"))[1])
    cfg["tie_word_embeddings"] = True
    from moequant.plan.memory import account

    tied = account(adapter_for(cfg))
    emb = untied["params_by_role"]["embedding"]
    assert tied["total_params"] == untied["total_params"] - emb  # no separate lm_head
    assert tied["active_params_excluding_embedding"] == tied["active_params"]
    assert tied["variants"]["bf16"]["bytes_per_token"] == untied["variants"]["bf16"]["bytes_per_token"]


def test_inspect_on_a_checkpoint_cross_checks_headers(tiny_dirs):
    code, out = run_cli("inspect", "--json", str(tiny_dirs["qwen2_moe"]))
    assert code == 0, out
    acc = json.loads(out)
    assert acc["weights_checked"] and acc["bytes_on_disk"] == 2 * acc["total_params"]
    code, text = run_cli("inspect", str(tiny_dirs["gpt_oss"]))
    assert code == 0 and "active per token" in text


# ---------------------------------------------------------------- bad input


def _expect_user_error(*args, contains: str):
    code, out = run_cli(*args)
    assert code == 2, out
    assert out.startswith("error: ") and contains in out and "Traceback" not in out
    assert len(out.strip().splitlines()) == 1


def test_bad_inputs(tmp_path, tiny_dirs):
    _expect_user_error("inspect", str(tmp_path / "nope"), contains="does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    _expect_user_error("inspect", str(empty), contains="no config.json")
    bad_type = tmp_path / "llama.json"
    bad_type.write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    _expect_user_error("inspect", str(bad_type), contains="mixtral")  # lists the supported ones

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copyfile(tiny_dirs["mixtral"] / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    _expect_user_error("inspect", str(pickled), contains="safetensors only")

    # a shard named in the index but absent
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_dirs["mixtral"], sharded)
    keys = list(read_safetensors_header(sharded / "model.safetensors"))
    index = {"metadata": {}, "weight_map": {k: "model-00001-of-00002.safetensors" for k in keys}}
    index["weight_map"][keys[0]] = "model-00002-of-00002.safetensors"
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    _expect_user_error("inspect", str(sharded), contains="missing")

    # a tensor whose shape disagrees with the config
    wrong = tmp_path / "wrong"
    shutil.copytree(tiny_dirs["qwen3_moe"], wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["moe_intermediate_size"] = 12
    (wrong / "config.json").write_text(json.dumps(cfg))
    _expect_user_error("inspect", str(wrong), contains="config.json implies")

    # a truncated safetensors file
    trunc = tmp_path / "trunc"
    shutil.copytree(tiny_dirs["olmoe"], trunc)
    data = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    _expect_user_error("inspect", str(trunc), contains="model.safetensors")

    _expect_user_error("inspect", "zoo:no-such-model", contains="no-such-model")


def test_unknown_model_type_lists_supported():
    with pytest.raises(UserError) as e:
        adapter_for({"model_type": "llama"})
    for t in supported_model_types():
        assert t in str(e.value)


def test_atomic_directory_leaves_old_output_on_failure(tmp_path):
    out = tmp_path / "out"
    with atomic_directory(out) as d:
        (d / "a.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_directory(out) as d:
            (d / "a.txt").write_text("new, half written")
            raise RuntimeError("crash")
    assert (out / "a.txt").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_console_script_help():
    exe = Path(sys.executable).parent / "moequant"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True).stdout
    assert "inspect" in out
