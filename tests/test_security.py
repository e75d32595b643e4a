"""Hostile checkpoints: files that escape the checkpoint directory, safetensors headers that lie,
code that a config or tokenizer asks to run, and pickles — none is followed, executed or unpickled.

Every refusal is one `UserError` sentence naming the file; a lying header never makes us
allocate what it claims. The safetensors library itself is the independent reader the
accepted cases are checked against.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import struct
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file
from tiny import build_tiny_with_tokenizer

from moequant.cli import main
from moequant.errors import UserError
from moequant.io.checkpoint import copy_aux_files, open_checkpoint, read_safetensors_header


def one_sentence(message: str) -> bool:
    return message.endswith(".") and "\n" not in message and len(message) < 400


@contextmanager
def no_hang(seconds: int = 20):
    """Turn a hang (a FIFO opened for reading blocks forever) into a test failure."""

    def fail(*_):
        raise AssertionError(f"hung for {seconds} s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def small_checkpoint(directory: Path, shards: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """config.json plus the given shard files (name -> tensors) and an index when there are several."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    shards = shards or {"model.safetensors": {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3)}}
    for name, tensors in shards.items():
        save_file(tensors, str(directory / name))
    return directory


def write_index(directory: Path, weight_map: dict) -> None:
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# ----------------------------------------------------------------------------- escaping the directory


def test_index_shard_names_that_escape_the_directory_are_refused(tmp_path):
    outside = tmp_path / "outside.safetensors"
    save_file({"a": torch.zeros(2)}, str(outside))
    ckpt = small_checkpoint(tmp_path / "ckpt", {"model-1.safetensors": {"b": torch.ones(2)}})
    for shard in ("../outside.safetensors", str(outside), "sub/../../outside.safetensors"):
        write_index(ckpt, {"a": shard, "b": "model-1.safetensors"})
        with pytest.raises(UserError) as error:
            open_checkpoint(ckpt)
        assert repr(shard) in str(error.value) and one_sentence(str(error.value)), str(error.value)
    # a shard in a subdirectory of the checkpoint is fine
    (ckpt / "sub").mkdir()
    save_file({"a": torch.full((2,), 7.0)}, str(ckpt / "sub" / "part.safetensors"))
    write_index(ckpt, {"a": "sub/part.safetensors", "b": "model-1.safetensors"})
    assert torch.equal(open_checkpoint(ckpt).get("a"), torch.full((2,), 7.0))


@pytest.mark.parametrize("layout", ["index", "single", "loose"])
def test_symlinks_pointing_outside_are_refused(tmp_path, layout):
    secret = tmp_path / "elsewhere" / "secret.safetensors"
    secret.parent.mkdir()
    save_file({"a": torch.zeros(2)}, str(secret))
    ckpt = small_checkpoint(tmp_path / "ckpt", {"inside.safetensors": {"b": torch.ones(2)}})
    name = {"index": "model-2.safetensors", "single": "model.safetensors", "loose": "zz.safetensors"}[layout]
    (ckpt / name).symlink_to(secret)
    if layout == "index":
        write_index(ckpt, {"a": name, "b": "inside.safetensors"})
    if layout == "single":
        (ckpt / "inside.safetensors").unlink()
    with pytest.raises(UserError, match="points outside") as error:
        open_checkpoint(ckpt)
    assert repr(name) in str(error.value) and one_sentence(str(error.value))


def test_symlinked_config_outside_is_refused_and_inside_links_are_fine(tmp_path):
    ckpt = small_checkpoint(tmp_path / "ckpt")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").symlink_to(tmp_path / "config.json")
    with pytest.raises(UserError, match="'config.json' points outside"):
        open_checkpoint(ckpt)
    # links that stay inside the directory are followed
    (ckpt / "config.json").unlink()
    (ckpt / "real-config.json").write_text(json.dumps({"model_type": "mixtral"}))
    (ckpt / "config.json").symlink_to("real-config.json")
    (ckpt / "weights").mkdir()
    (ckpt / "model.safetensors").rename(ckpt / "weights" / "w.safetensors")
    (ckpt / "model.safetensors").symlink_to("weights/w.safetensors")
    assert open_checkpoint(ckpt).get("a").tolist() == [[0, 1, 2], [3, 4, 5]]


def test_hub_cache_snapshot_links_into_its_blobs_are_followed(tmp_path):
    """huggingface_hub stores files once in `blobs/` and links them from `snapshots/REV/`."""
    repo = tmp_path / "models--org--name"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    save_file({"w": torch.arange(4, dtype=torch.bfloat16)}, str(blobs / "aa11"))
    (blobs / "bb22").write_text(json.dumps({"model_type": "mixtral"}))
    (snap / "model.safetensors").symlink_to("../../blobs/aa11")
    (snap / "config.json").symlink_to("../../blobs/bb22")
    ckpt = open_checkpoint(snap)
    with safe_open(str(snap / "model.safetensors"), "pt") as f:
        assert torch.equal(ckpt.get("w"), f.get_tensor("w"))
    # … but not anywhere else in the cache
    other = tmp_path / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    save_file({"w": torch.zeros(1)}, str(other / "cc33"))
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(other / "cc33")
    with pytest.raises(UserError, match="points outside"):
        open_checkpoint(snap)


def test_fifo_or_directory_as_a_weights_file_is_refused_without_blocking(tmp_path):
    ckpt = small_checkpoint(tmp_path / "ckpt")
    (ckpt / "model.safetensors").unlink()
    os.mkfifo(ckpt / "model.safetensors")
    with no_hang(), pytest.raises(UserError, match="not a regular file"):
        open_checkpoint(ckpt)
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors").mkdir()
    with no_hang(), pytest.raises(UserError, match="not a regular file"):
        open_checkpoint(ckpt)


def test_aux_files_linking_outside_are_never_copied_into_an_output(tmp_path):
    source = small_checkpoint(tmp_path / "ckpt")
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")
    (source / "generation_config.json").write_text("{}")
    (source / "chat_template.jinja").symlink_to(secret)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(UserError, match="'chat_template.jinja' points outside"):
        copy_aux_files(source, out)
    assert "PRIVATE KEY" not in "".join(p.read_text() for p in out.iterdir())


# ----------------------------------------------------------------------------- lying headers


def raw_safetensors(path: Path, header, data: bytes = b"", header_len: int | None = None) -> Path:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(body) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + body + data)
    return path


LIES = {
    "offsets past the end": ({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
    "offsets backwards": ({"t": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}, b"\0" * 8),
    "negative offset": ({"t": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}, b"\0" * 8),
    "overlapping tensors": (
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        },
        b"\0" * 12,
    ),
    "wrong dtype size": ({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 8),
    "shape product overflowing 64 bits": (
        {"t": {"dtype": "U8", "shape": [2**40, 2**40, 2**40], "data_offsets": [0, 8]}},
        b"\0" * 8,
    ),
    "negative dimension": ({"t": {"dtype": "U8", "shape": [-8], "data_offsets": [0, 8]}}, b"\0" * 8),
    "unknown dtype": ({"t": {"dtype": "Q4_K", "shape": [8], "data_offsets": [0, 8]}}, b"\0" * 8),
    "shape as a string": ({"t": {"dtype": "U8", "shape": "8", "data_offsets": [0, 8]}}, b"\0" * 8),
    "float offsets": ({"t": {"dtype": "U8", "shape": [8], "data_offsets": [0.0, 8.5]}}, b"\0" * 8),
    "boolean dimension": ({"t": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, b"\0"),
    "three offsets": ({"t": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 1]}}, b"\0"),
    "entry not an object": ({"t": [1, 2, 3]}, b""),
    "header a list": ([1, 2], b""),
    "header not JSON": (b"{not json", b""),
    "header not UTF-8": (b'{"\xff": 1}', b""),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_lying_headers_give_one_sentence_naming_the_file(tmp_path, lie):
    header, data = LIES[lie]
    path = raw_safetensors(tmp_path / "x.safetensors", header, data)
    with pytest.raises(UserError) as error:
        read_safetensors_header(path)
    assert str(path) in str(error.value) and one_sentence(str(error.value)), str(error.value)
    # the safetensors library refuses them too (it is the reader serving engines use)
    with pytest.raises(Exception):
        with safe_open(str(path), "pt") as f:
            for k in f.keys():
                f.get_tensor(k)


@pytest.mark.parametrize("claimed", [2**64 - 1, 2**63, 99 * 1024**2, 10**12])
def test_gigantic_header_length_is_refused_without_allocating_it(tmp_path, claimed):
    path = raw_safetensors(tmp_path / "x.safetensors", {"t": {}}, b"\0" * 64, header_len=claimed)
    tracemalloc.start()
    try:
        with pytest.raises(UserError, match="corrupt safetensors header"):
            read_safetensors_header(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024**2, peak


def test_truncated_after_open_is_an_error_not_garbage(tmp_path):
    ckpt = small_checkpoint(tmp_path / "ckpt", {"model.safetensors": {"a": torch.ones(1000)}})
    opened = open_checkpoint(ckpt)
    size = (ckpt / "model.safetensors").stat().st_size
    with open(ckpt / "model.safetensors", "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(UserError, match="truncated"):
        opened.get("a")


def test_an_honest_header_reads_what_the_safetensors_library_reads(tmp_path):
    tensors = {
        "bf": torch.randn(3, 5).to(torch.bfloat16),
        "i8": torch.randint(-128, 127, (7,), dtype=torch.int8),
        "f8": torch.randn(4, 4).to(torch.float8_e4m3fn),
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(2.5),
    }
    ckpt = small_checkpoint(tmp_path / "ckpt", {"model.safetensors": tensors})
    opened = open_checkpoint(ckpt)
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        for name in tensors:
            ours, theirs = opened.get(name), f.get_tensor(name)
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
            assert torch.equal(ours.reshape(-1).view(torch.uint8), theirs.reshape(-1).view(torch.uint8))


# ----------------------------------------------------------------------------- code and pickles


class _Payload:
    """Unpickling this runs `Path(marker).write_text(...)`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "unpickled"))


EVIL_CODE = "from pathlib import Path\nPath({marker!r}).write_text('executed {name}')\n"


def plant_code(directory: Path, marker: Path) -> None:
    """auto_map entries in config.json and tokenizer_config.json pointing at modules that write
    `marker` on import, and a pickle that writes it when loaded."""
    for module in ("configuration_evil", "modeling_evil", "tokenization_evil"):
        (directory / f"{module}.py").write_text(EVIL_CODE.format(marker=str(marker), name=module))
    config = json.loads((directory / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "configuration_evil.EvilConfig",
        "AutoModelForCausalLM": "modeling_evil.EvilModel",
    }
    (directory / "config.json").write_text(json.dumps(config))
    tok = directory / "tokenizer_config.json"
    if tok.exists():
        tconf = json.loads(tok.read_text())
        tconf["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
        tok.write_text(json.dumps(tconf))
    for name in ("pytorch_model.bin", "training_args.bin", "optimizer.pt"):
        (directory / name).write_bytes(pickle.dumps(_Payload(marker)))


def test_pickle_only_checkpoint_is_refused_and_never_unpickled(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    marker = tmp_path / "marker"
    (ckpt / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(marker)))
    pickle.loads(pickle.dumps(_Payload(tmp_path / "self-check")))  # the payload does work when unpickled
    assert (tmp_path / "self-check").read_text() == "unpickled"
    with pytest.raises(UserError, match="pickle"):
        open_checkpoint(ckpt)
    result = CliRunner().invoke(main, ["calibrate", "--model", str(ckpt), "--output", str(tmp_path / "s")])
    assert result.exit_code == 2 and "safetensors only" in result.output
    assert not marker.exists()


@pytest.fixture(scope="module")
def hostile_model(tmp_path_factory):
    """The tiny model with its tokenizer, plus auto_map code and pickles that leave a marker."""
    root = tmp_path_factory.mktemp("hostile")
    model = build_tiny_with_tokenizer("qwen2_moe", root / "model")
    plant_code(model, root / "marker")
    return model, root / "marker"


def test_apply_on_a_checkpoint_with_auto_map_and_pickles_runs_no_code(hostile_model, tmp_path, monkeypatch):
    """The whole pipeline (calibrate, quantize, export, evaluate with transformers, report) on a
    checkpoint whose config and tokenizer name custom code: none runs, no pickle is loaded, and the
    written checkpoint neither carries the code nor points to it."""
    model, marker = hostile_model

    def refuse(*args, **kwargs):
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", refuse)
    out = tmp_path / "run"
    args = ["apply", "--recipe", "recipes/selective.yaml", "--model", str(model), "--output", str(out)]
    for s in (
        "calibration.samples=2",
        "calibration.seq_len=32",
        "calibration.dataset=builtin:stdlib-prose",
        "evaluate.samples=2",
        "evaluate.seq_len=32",
        "evaluate.dataset=builtin:stdlib-prose",
    ):
        args += ["--set", s]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert not marker.exists(), marker.read_text()
    written = {p.name for p in (out / "checkpoint").iterdir()}
    assert not {n for n in written if n.endswith((".py", ".bin", ".pt", ".pkl"))}, written
    assert "auto_map" not in json.loads((out / "checkpoint" / "config.json").read_text())


def test_unknown_architecture_with_auto_map_is_refused_before_any_code(tmp_path):
    model = tmp_path / "model"
    small_checkpoint(model)
    config = {"model_type": "evil_moe", "architectures": ["EvilForCausalLM"]}
    (model / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "marker"
    plant_code(model, marker)
    for command in (
        ["inspect", str(model)],
        ["calibrate", "--model", str(model), "--output", str(tmp_path / "s")],
        ["apply", "--model", str(model), "--output", str(tmp_path / "o")],
    ):
        result = CliRunner().invoke(main, command, input="y\n")
        assert result.exit_code == 2 and "evil_moe" in result.output, (command, result.output)
    assert not marker.exists()


def test_eval_of_an_unknown_architecture_never_offers_to_run_its_code(hostile_model, tmp_path):
    """`moequant eval` on a checkpoint moequant cannot read falls back to transformers; with an
    unknown model_type and an auto_map, transformers asks on stdin whether to run the code unless
    trust_remote_code=False is passed. Answering 'y' must not run it."""
    reference, _ = hostile_model
    candidate = tmp_path / "candidate"
    shutil.copytree(reference, candidate)
    config = json.loads((candidate / "config.json").read_text())
    config["model_type"] = "evil_moe"
    (candidate / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "marker"
    plant_code(candidate, marker)
    result = CliRunner().invoke(
        main,
        [
            "eval",
            str(candidate),
            "--reference",
            str(reference),
            "--samples",
            "2",
            "--seq-len",
            "32",
            "--dataset",
            "builtin:stdlib-prose",
        ],
        input="y\n",
    )
    assert result.exit_code == 2, result.output
    assert not marker.exists(), marker.read_text()
