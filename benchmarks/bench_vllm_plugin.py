"""vLLM CPU throughput of a per-expert checkpoint (moequant's vLLM plugin) vs the uniform int4 one.

For each bundled model, `moequant apply` makes two checkpoints from one calibration setting:

  per-expert   budget 5.5 bits per routed-expert weight over int8 (W8A8) / int4, target
               vllm-moequant: formats differ inside a layer, served by moequant.vllm_plugin
  uniform-int4 every routed expert int4 (GPTQ), target vllm: vLLM's own compressed-tensors path

(int4 group 64 for tiny-qwen2moe, 128 for tiny-mixtral: what vLLM's CPU int4 MoE kernel takes.)
Each checkpoint then runs alone in a fresh vLLM CPU process (bfloat16, eager, `--threads` OpenMP
threads, default 1): a warm-up, then `--rounds` timed rounds of greedy decoding, for a batch of
`--batch` prompts and for one prompt, in `--repeats` processes per checkpoint alternating between
the checkpoints; tokens/s = generated tokens / wall seconds of `generate`, the best round (on a
shared machine the least disturbed). Quality is each run's report.json (held-out KL and top-1
against the bf16 model).

    python benchmarks/bench_vllm_plugin.py [--models tiny-qwen2moe,tiny-mixtral] [--batch 8] [--tokens 64]
        [--repeats 2] [--rounds 5] [--threads 1] [--work runs/bench-vllm-plugin] [--json out.json]

Why one thread: this machine has 2 cores shared with other jobs, and with 2 OpenMP threads every
parallel region waits for whichever thread the OS took away, which says more about the other jobs
than about the checkpoint (and hits the per-expert checkpoint, with two kernel calls per MoE layer,
more often). With 2 threads (2026-12-02, same command otherwise) the best batch tok/s of two
processes of the same per-expert checkpoint were 343 and 709 (ratios 0.69 / 0.88); with one thread
the two processes of each checkpoint agree within 0.3-7 % (e.g. 1111 / 1114, 1191 / 1208).

Dated results, each with its command: benchmarks/RESULTS.md, section bench_vllm_plugin.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.verify_vllm import _error_summary, ensure_vllm_env, ensure_vllm_plugin  # noqa: E402

GROUP = {"tiny-qwen2moe": 64, "tiny-mixtral": 128}

# runs inside the vLLM venv: vllm and the standard library only
_WORKER = r"""
import ctypes, json, platform, random, sys, time
if platform.machine() == "x86_64":
    ctypes.CDLL(None).syscall(158, 0x1023, 18)  # AMX tile permission (see tests/support/verify_vllm.py)
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
job = json.loads(open(sys.argv[1]).read())
llm = LLM(model=job["checkpoint"], dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
          max_model_len=job["prompt_len"] + job["tokens"] + 8, seed=0)
rng = random.Random(0)
prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(1, 4096) for _ in range(job["prompt_len"])])
           for _ in range(job["batch"])]
params = SamplingParams(temperature=0.0, max_tokens=job["tokens"], ignore_eos=True, detokenize=False)
llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False))
out = {"batch": [], "single": []}
for _ in range(job["rounds"]):  # several short rounds: on a shared machine the best is the least disturbed
    for name, batch in (("batch", prompts), ("single", prompts[:1])):
        start = time.perf_counter()
        res = llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        out[name].append(sum(len(r.outputs[0].token_ids) for r in res) / seconds)
json.dump({k: max(v) for k, v in out.items()}, open(sys.argv[2], "w"))
"""


def make_checkpoints(model: str, work: Path, samples: int, eval_samples: int) -> dict[str, Path]:
    g = GROUP[model]
    common = [
        "--model",
        f"zoo:{model}",
        "--set",
        f"calibration.samples={samples}",
        "--set",
        f"evaluate.samples={eval_samples}",
        "--set",
        f"formats.int4.group_size={g}",
    ]
    runs = {
        "per-expert": [
            "--recipe",
            "recipes/selective.yaml",
            "--output",
            str(work / f"{model}-per-expert"),
            "--set",
            "target=vllm-moequant",
            "--set",
            "export.int8_activations=dynamic",
        ],
        "uniform-int4": ["--recipe", "recipes/uniform-int4.yaml", "--output", str(work / f"{model}-uniform-int4")],
    }
    out = {}
    for name, args in runs.items():
        subprocess.run([sys.executable, "-m", "moequant.cli", "apply", *args, *common], check=True, cwd=ROOT)
        out[name] = Path(args[args.index("--output") + 1])
    return out


def throughput(
    python: Path, checkpoint: Path, batch: int, tokens: int, rounds: int, threads: int, prompt_len: int = 32
) -> dict:
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "OMP_NUM_THREADS": str(threads),
    }
    env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory(prefix="moequant-bench-vllm-") as tmp:
        job, result, script = Path(tmp) / "job.json", Path(tmp) / "result.json", Path(tmp) / "worker.py"
        script.write_text(_WORKER)
        job.write_text(
            json.dumps(
                {
                    "checkpoint": str((checkpoint / "checkpoint").resolve()),
                    "batch": batch,
                    "tokens": tokens,
                    "prompt_len": prompt_len,
                    "rounds": rounds,
                }
            )
        )
        proc = subprocess.run(
            [str(python), str(script), str(job), str(result)],
            env=env,
            capture_output=True,
            check=False,
            text=True,
            cwd=tmp,
        )
        if proc.returncode != 0 or not result.exists():
            raise RuntimeError(f"vLLM failed on {checkpoint}:\n{_error_summary(proc.stdout + proc.stderr)}")
        return json.loads(result.read_text())


def quality(run: Path) -> dict:
    report = json.loads((run / "report.json").read_text())
    q, plan = report.get("quality") or {}, json.loads((run / "plan.json").read_text())
    counts: dict[str, int] = {}
    for layer in plan["summary"]["layers"].values():
        for key, n in layer["counts"].items():
            counts[key] = counts.get(key, 0) + n
    mixed = sum(len(layer["counts"]) > 1 for layer in plan["summary"]["layers"].values())
    return {
        "kl_mean": q.get("kl_mean"),
        "top1": q.get("top1_agreement"),
        "formats": counts,
        "layers_with_mixed_experts": mixed,
        "routed_bits_per_weight": plan["summary"]["bits_per_weight"]["routed_experts"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny-qwen2moe,tiny-mixtral")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="vLLM processes per checkpoint, alternating")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per process")
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads of each vLLM process")
    parser.add_argument("--samples", type=int, default=16, help="calibration samples")
    parser.add_argument("--eval-samples", type=int, default=8)
    parser.add_argument("--work", default="runs/bench-vllm-plugin")
    parser.add_argument("--json")
    args = parser.parse_args()
    python = ensure_vllm_plugin(ensure_vllm_env())
    results = {}
    for model in args.models.split(","):
        runs = make_checkpoints(model, ROOT / args.work, args.samples, args.eval_samples)
        speed: dict[str, list[dict]] = {name: [] for name in runs}
        for _ in range(args.repeats):  # alternate, so load from other jobs hits both alike
            for name, run in runs.items():
                speed[name].append(throughput(python, run, args.batch, args.tokens, args.rounds, args.threads))
        for name, run in runs.items():
            best = {k: max(s[k] for s in speed[name]) for k in ("batch", "single")}
            results[(model, name)] = {**best, "rounds": speed[name], **quality(run)}
        per_expert, uniform = results[(model, "per-expert")], results[(model, "uniform-int4")]
        results[(model, "ratio")] = {k: per_expert[k] / uniform[k] for k in ("batch", "single")}
    print(
        f"{'model':15} {'checkpoint':13} {'tok/s b=' + str(args.batch):>11} {'tok/s b=1':>10} {'bits':>5} "
        f"{'KL':>9} {'top-1':>6}  formats (layers with mixed experts)"
    )
    for (model, name), r in results.items():
        if name == "ratio":
            print(f"{model:15} {'ratio':13} {r['batch']:11.2f} {r['single']:10.2f}")
            continue
        print(
            f"{model:15} {name:13} {r['batch']:11.1f} {r['single']:10.1f} {r['routed_bits_per_weight']:5.2f} "
            f"{r['kl_mean']:9.5f} {r['top1']:6.3f}  {r['formats']} ({r['layers_with_mixed_experts']})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({f"{m}/{n}": r for (m, n), r in results.items()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
