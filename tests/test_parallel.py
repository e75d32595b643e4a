"""Expert-parallel `moequant apply` over torch.distributed (gloo on the CPU), on the bundled models.

The references are one-process runs of the same command with one CPU thread, as each torchrun rank
has (torchrun sets OMP_NUM_THREADS=1): float32 sums depend on the thread count, and with it equal the
expert-parallel runs must give the one-process run's files exactly — statistics, plan.json, report.json
(routing shares included) and the checkpoint's tensors (the same int4 GPTQ and int8 RTN codes).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from moequant.cli import main
from moequant.parallel import expert_range

ROOT = Path(__file__).resolve().parent.parent
# 512 calibration tokens: enough that some experts get their own routed-token Hessian (>= 64 tokens), some not
FAST = [
    "calibration.samples=8",
    "calibration.seq_len=64",
    "calibration.dataset=builtin:stdlib-prose",
    "calibration.probe_samples=0",
    "evaluate.samples=2",
    "evaluate.seq_len=32",
    "evaluate.dataset=builtin:stdlib-prose",
]


pytestmark = pytest.mark.slow


def apply_args(model: str, out: Path, recipe: str = "selective.yaml", extra=()) -> list[str]:
    """By default the selective recipe: calibration, a budget plan of int4 GPTQ and int8 RTN experts, quantize,
    export."""
    args = ["apply", "--recipe", str(ROOT / "recipes" / recipe), "--model", model, "--output", str(out)]
    for s in [*FAST, *extra]:
        args += ["--set", s]
    return args


def rank_env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MOEQUANT_COLLECTIVE_TIMEOUT": "60", "PYTHONPATH": str(ROOT), **extra}


def one_process(model: str, out: Path, *recipe) -> Path:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each torchrun rank
    try:
        result = CliRunner().invoke(main, apply_args(model, out, *recipe), catch_exceptions=False)
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    assert not torch.distributed.is_initialized()  # a one-process run makes no process group
    return out


def torchrun(ranks: int, model: str, out: Path, *recipe) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "-m",
        "moequant",
        *apply_args(model, out, *recipe),
    ]
    done = subprocess.run(cmd, check=False, cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done


def tensors(directory: Path, by_file: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of a directory's safetensors files, keyed file:name, or by name alone (`by_file` False: a
    checkpoint, whose expert-parallel export writes each rank's experts of a layer as shards of their own —
    the same tensors in other files)."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        for k, v in load_file(str(path)).items():
            key = f"{path.name}:{k}" if by_file else k
            assert key not in out, f"{key} is written twice"
            out[key] = v
    return out


def same_tensors(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ (dtype, shape or any bit); [] when the two sets are identical."""
    assert a.keys() == b.keys()
    return [
        k
        for k in a
        if a[k].dtype != b[k].dtype
        or a[k].shape != b[k].shape
        or not torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
    ]


def run_json(out: Path, name: str) -> dict:
    """A run's JSON file with its own directory's path replaced (it differs per run) and no timings."""
    data = json.loads((out / name).read_text().replace(str(out), "OUT"))
    data.pop("timings", None)
    for key in [k for k in (data.get("quality") or {}) if "seconds" in k]:
        data["quality"].pop(key)
    return data


def assert_same_run(ref: Path, out: Path, ranks: int) -> None:
    written = tensors(ref / "checkpoint", by_file=False)
    assert written and same_tensors(written, tensors(out / "checkpoint", by_file=False)) == []
    assert tensors(ref / "stats") and same_tensors(tensors(ref / "stats"), tensors(out / "stats")) == []
    assert run_json(out, "stats/summary.json") == run_json(ref, "stats/summary.json")
    plan = run_json(ref, "plan.json")
    assert run_json(out, "plan.json") == plan
    algorithms = {(t["format"], t["algorithm"]) for t in plan["tensors"] if t["role"] == "routed_expert"}
    assert {("int4-g32-sym", "gptq"), ("int8-channel", "rtn")} <= algorithms  # both algorithms are compared
    report, theirs = run_json(ref, "report.json"), run_json(out, "report.json")
    assert (report.pop("ranks"), theirs.pop("ranks")) == (1, ranks)
    shares = [r["share"] for r in report["experts"]]
    assert all(s is not None for s in shares) and len(set(shares)) > 1
    assert [r["share"] for r in theirs["experts"]] == shares
    assert theirs == report
    assert f"expert-parallel over {ranks} ranks" in (out / "report.md").read_text()
    # the quantize pass's own report (GPTQ damping and Hessian fallbacks per expert), merged from the ranks
    ours, one = (json.loads((d / "checkpoint.json").read_text())["quantize"] for d in (out, ref))
    for layer in one.values():
        layer.pop("seconds")
    for layer in ours.values():
        layer.pop("seconds")
    assert ours == one
    fallbacks = [
        e
        for layer in one.values()
        for k, v in layer.items()
        if k.endswith(":int4-g32-sym")
        for e in v["gptq"]["fallbacks"]
    ]
    experts = [
        e for layer in one.values() for k, v in layer.items() if k.endswith(":int4-g32-sym") for e in v["experts"]
    ]
    assert 0 < len(fallbacks) < len(experts)  # both Hessians (own routed tokens, all tokens) are compared


def test_expert_slices_are_contiguous_and_cover_every_expert():
    for experts, size in [(8, 3), (16, 2), (128, 8), (5, 5)]:
        slices = [expert_range(experts, r, size) for r in range(size)]
        assert [e for s in slices for e in s] == list(range(experts))
        assert max(map(len, slices)) - min(map(len, slices)) <= 1 and min(map(len, slices)) >= 1


def test_three_ranks_equal_one_process(tmp_path):
    """tiny-mixtral (8 experts): uneven slices of 2, 3 and 3 experts."""
    ref = one_process("zoo:tiny-mixtral", tmp_path / "ref")
    out = tmp_path / "ep3"
    torchrun(3, "zoo:tiny-mixtral", out)
    assert_same_run(ref, out, 3)


def test_two_ranks_of_fused_gpt_oss_experts_equal_one_process(tmp_path):
    """gpt-oss stores all of a layer's experts as one tensor: each rank's quantized experts are gathered to
    rank 0, which packs and writes the layer's fused tensors (the streamed export); the checkpoint is the
    one process's, tensor for tensor."""
    from tiny import build_tiny_with_tokenizer

    model = str(build_tiny_with_tokenizer("gpt_oss", tmp_path / "gpt-oss"))
    recipe = ("mxfp4-experts.yaml", ["export.format=gpt-oss-mxfp4", "target=transformers"])
    ref = one_process(model, tmp_path / "ref", *recipe)
    out = tmp_path / "ep2"
    torchrun(2, model, out, *recipe)
    written = tensors(ref / "checkpoint", by_file=False)
    assert any(name.endswith("_blocks") for name in written)  # the fused MXFP4 layout was written
    assert same_tensors(written, tensors(out / "checkpoint", by_file=False)) == []
    assert not (out / "work").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_killed_mid_layer_then_rerun_equal_one_process(tmp_path):
    """tiny-qwen2moe (16 experts and a shared expert; 8 experts per rank). Two ranks started as torchrun
    starts them (its environment) but without its agent, which would stop the survivor itself: their
    calibration completes, then rank 1 is SIGKILLed once quantize layer 0 is finished; rank 0 ends with
    one sentence (exit code 1) at its next collective instead of waiting; the rerun (torchrun, 2 ranks)
    reuses the statistics, continues at the recorded layer and gives the one-process run's files."""
    ref = one_process("zoo:tiny-qwen2moe", tmp_path / "ref")
    out, port = tmp_path / "killed", _free_port()
    procs, logs = [], []
    for rank in range(2):
        logs.append(tmp_path / f"rank{rank}.err")
        env = rank_env(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        with open(logs[-1], "w") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "moequant", *apply_args("zoo:tiny-qwen2moe", out)],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
            )
    try:
        deadline = time.monotonic() + 300
        while not (out / "work" / "layer_000.json").exists():
            assert procs[0].poll() is None and procs[1].poll() is None, logs[0].read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.01)
        procs[1].kill()
        procs[0].wait(timeout=120)  # not a hang: the lost peer is noticed, or the collective times out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    err = logs[0].read_text()
    assert procs[0].returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: rank 0 of 2: ") and "another rank has stopped" in last, err[-3000:]
    assert "Traceback" not in err
    assert not (out / "checkpoint").exists()
    start = json.loads((out / "work" / "progress.json").read_text())["next_layer"]
    assert 1 <= start < 4  # layer 0 (at least) finished on both ranks and is not redone
    done = torchrun(2, "zoo:tiny-qwen2moe", out)
    assert f"{4 - start}/{4 - start}" in done.stdout  # the pass ran the remaining layers only
    assert_same_run(ref, out, 2)


def test_more_ranks_than_experts_is_one_sentence(tmp_path, monkeypatch):
    """Refused before the rendezvous (so one process with torchrun's environment shows it) and before
    anything is written."""
    monkeypatch.setenv("WORLD_SIZE", "9")
    monkeypatch.setenv("RANK", "0")
    out = tmp_path / "run"
    result = CliRunner().invoke(main, apply_args("zoo:tiny-mixtral", out))
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1] == (
        "error: 9 processes were started but the model has 8 routed experts per MoE layer; every process needs at "
        "least one expert: start at most 8 (torchrun --nproc-per-node 8)."
    )
    assert not out.exists() and not torch.distributed.is_initialized()


def test_awq_under_torchrun_is_one_sentence_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    out = tmp_path / "run"
    args = ["apply", "--recipe", str(ROOT / "recipes" / "uniform-int4-awq.yaml"), "--output", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1].startswith("error: algorithm awq runs in one process only")
    assert not out.exists() and not torch.distributed.is_initialized()
