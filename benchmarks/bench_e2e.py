"""End to end on one GPU at a real model's shape: `moequant apply` vs llm-compressor `oneshot`.

A random-weight model is built from a real config (tests/data/configs; Qwen3-30B-A3B by default)
with few decoder layers and a small vocabulary (the bundled tokenizer's 4096 tokens), in bf16.
Every tool gets the same calibration tokens (moequant's calibration split of `builtin:mix`) and
is run in its own subprocess (peak RSS and peak GPU memory are its own), at two layer counts, so
the *marginal* seconds per decoder layer come out without start-up costs:

  moequant-gptq        recipes/uniform-int4.yaml at int4-g128, GPTQ (no calibration pass, no probe)
  moequant-selective   recipes/selective.yaml (budget 5.5 bits over int8 / int4-g128: calibrate, plan,
                       quantize)
  moequant-fp8         recipes/uniform-fp8.yaml (per-channel FP8, round-to-nearest: no forward at all)
  moequant-rtn         recipes/uniform-int4.yaml at int4-g128, round-to-nearest (no forward at all)
  llmc-gptq            llm-compressor 0.14 oneshot + GPTQModifier W4A16 int4-g128 on the routed experts
                       (the same tensors), saved compressed

Printed per tool and layer count: wall seconds of the whole run, moequant's stage seconds (moequant.timing's
account of the apply call: report.json's timings plus the report's own seconds, "other" = the run's seconds
that no stage holds), peak GPU memory (torch.cuda.max_memory_allocated), peak host RSS, bytes
moequant wrote to scratch (stats/ and work/, counted at every write), and the held-out quality:
KL / top-1 of each checkpoint against the original on the same evaluation windows (moequant's
evaluation, run on every checkpoint alike). Then seconds per layer: the least-squares slope of t over the
layer counts, with its RMS residual (`fit_per_layer`), and the same slope per stage: where each added
layer's seconds go (read = disk to host not hidden by the read-ahead, decode = transfer + decode, forward,
statistics, gptq_grid / gptq_refit / gptq = GPTQ's grid search, scale refit and solve, pack_write, ...).

    python benchmarks/bench_e2e.py [--config qwen3-30b-a3b] [--layers 2 3] [--samples 128] [--seq-len 512]
        [--tools moequant-gptq,moequant-selective,moequant-fp8,llmc-gptq] [--json out.json]

Dated results, each with its command: benchmarks/RESULTS.md, section bench_e2e.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from measure import peak_rss_bytes  # benchmarks/measure.py (the script's own directory)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "data" / "configs"
TOOLS = ("moequant-gptq", "moequant-gptq-noprior", "moequant-selective", "moequant-fp8", "moequant-rtn", "llmc-gptq")
RECIPES = {
    "moequant-gptq": ("uniform-int4.yaml", ["formats.int4.group_size=128"]),
    # the same without the Hessian prior (each expert's own routed tokens alone): the prior's A/B at real shapes
    "moequant-gptq-noprior": ("uniform-int4.yaml", ["formats.int4.group_size=128", "calibration.hessian_prior=0"]),
    # the probe is off by default past 2e9 routed-expert parameters (Qwen3-30B-A3B has 29e9): as there
    "moequant-selective": ("selective.yaml", ["formats.int4.group_size=128", "calibration.probe_samples=0"]),
    "moequant-fp8": ("uniform-fp8.yaml", []),
    "moequant-rtn": ("uniform-int4.yaml", ["formats.int4.group_size=128", "algorithms.int4=rtn"]),
}


def build_fp8_block(config_name: str, layers: int, vocab: int, directory: Path, overrides=(), device="cpu") -> int:
    """A random DeepSeek-style FP8-block source (benchmarks/make_sources.py) at the config's real widths,
    `layers` MoE layers (no dense layer, no MTP layer)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_sources import make_deepseek_fp8

    raw = json.loads((CONFIGS / f"{config_name}.json").read_text())
    raw.update(num_hidden_layers=layers, first_k_dense_replace=0, vocab_size=vocab, num_nextn_predict_layers=0)
    raw.update({k: json.loads(v) for k, v in (o.split("=", 1) for o in overrides)})
    make_deepseek_fp8(directory, overrides=raw, config_path=CONFIGS / f"{config_name}.json", device=device)
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def build(config_name: str, layers: int, vocab: int, directory: Path, device: str, overrides=()) -> int:
    """A random-weight bf16 checkpoint of `config_name` with `layers` decoder layers; returns its bytes.
    `overrides`: config `key=value` pairs (JSON values), e.g. to shrink it for a CPU smoke run."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from moequant import zoo

    raw = json.loads((CONFIGS / f"{config_name}.json").read_text())
    raw.update(num_hidden_layers=layers, vocab_size=vocab)
    raw.update({k: json.loads(v) for k, v in (o.split("=", 1) for o in overrides)})
    for key in ("first_k_dense_replace",):  # keep DeepSeek's leading dense layers within the count
        if key in raw:
            raw[key] = min(raw[key], max(layers - 2, 0))
    raw.pop("quantization_config", None)
    model_type = raw.pop("model_type")
    raw.pop("architectures", None)
    config = AutoConfig.for_model(model_type, **raw)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    del model
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the bundled models' 4096-token tokenizer
        shutil.copy(zoo.path("tiny-qwen2moe") / name, directory / name)
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def child_moequant(tool: str, model: str, out: str, samples: int, seq_len: int, eval_samples: int, device: str) -> dict:
    """Runs in the subprocess: one `moequant apply`; counts every byte written under stats/ and work/."""
    import torch

    import moequant.algorithms.awq_layer as awq_layer
    import moequant.io.checkpoint as ck
    import moequant.io.work_files as work_files
    import moequant.measure.calibrate as cal
    import moequant.pipeline.resume as resume
    from moequant import timing
    from moequant.pipeline.apply import apply

    scratch = {"bytes": 0}
    real_save, real_text = cal.save_atomic, ck.atomic_write_text

    def counting_save(tensors, path, metadata):
        real_save(tensors, path, metadata)
        scratch["bytes"] += Path(path).stat().st_size

    def counting_text(path, text, *a, **k):
        real_text(path, text, *a, **k)
        if any(part in ("stats", "work") for part in Path(path).parts):
            scratch["bytes"] += Path(path).stat().st_size

    cal.save_atomic = work_files.save_atomic = awq_layer.save_atomic = counting_save  # stats, work files, AWQ scales
    ck.atomic_write_text = cal.atomic_write_text = resume.atomic_write_text = counting_text
    recipe, extra = RECIPES[tool]
    overrides = [
        f"calibration.samples={samples}",
        f"calibration.seq_len={seq_len}",
        f"evaluate.samples={eval_samples}",
        f"evaluate.seq_len={seq_len}",
        *extra,
    ]
    timing.count_parts(True)  # the evaluation's split below (each part synchronizes the GPU)
    t0 = time.perf_counter()
    apply(
        str(ROOT / "recipes" / recipe),
        model=model,
        output=out,
        overrides=overrides,
        device=device,
        progress=False,
        log=lambda *_: None,
    )
    stages = timing.account()  # report.json's timings, then the report's own seconds and the rest
    seconds = time.perf_counter() - t0
    report = json.loads((Path(out) / "report.json").read_text())
    q = report.get("quality") or {}
    marker = Path(out) / "checkpoint.json"
    layer_seconds = (
        {L: r.get("seconds") for L, r in json.loads(marker.read_text()).get("quantize", {}).items()}
        if marker.exists()
        else {}
    )
    return {
        "seconds": seconds,
        "timings": stages,
        "parts": timing.parts(),  # inside a stage: where the evaluation's seconds go
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
        "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else 0.0,
        "peak_rss_gib": peak_rss_bytes() / 2**30,
        "scratch_bytes": scratch["bytes"],
        "stats_bytes": _dir_bytes(Path(out) / "stats"),
        "kl": q.get("kl_mean"),
        "top1": q.get("top1_agreement"),
        "bits": report["memory"].get("bits_per_weight_experts"),
        "layer_seconds": layer_seconds,
    }


def child_llmc(model: str, out: str, samples: int, seq_len: int, eval_samples: int) -> dict:
    """Runs in the subprocess: llm-compressor's oneshot GPTQ W4A16 g128 of the routed experts."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM

    ids = calibration_ids(model, samples, seq_len)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    t0 = time.perf_counter()
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    scheme = QuantizationScheme(
        targets=[r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
        weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128),
    )
    oneshot(
        model=m,
        dataset=data,
        recipe=GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"]),
        num_calibration_samples=ids.shape[0],
        max_seq_length=ids.shape[1],
        output_dir=out,
        save_compressed=True,
    )
    seconds = time.perf_counter() - t0
    peak_gpu = torch.cuda.max_memory_allocated() / 2**30
    peak_reserved = torch.cuda.max_memory_reserved() / 2**30
    del m
    torch.cuda.empty_cache()
    try:
        quality = evaluate(out, model, eval_samples, seq_len)
    except Exception as error:  # its timing still counts; say why there is no quality
        quality = {"kl": None, "top1": None, "bits": None, "eval_error": f"{type(error).__name__}: {error}"[:300]}
    return {
        "seconds": seconds,
        "timings": {},
        "peak_gpu_gib": peak_gpu,
        "peak_gpu_reserved_gib": peak_reserved,
        "peak_rss_gib": peak_rss_bytes() / 2**30,
        "scratch_bytes": 0,
        "stats_bytes": 0,
        **quality,
    }


def calibration_ids(model: str, samples: int, seq_len: int):
    """The calibration tokens moequant's quantize pass draws for these settings (same seed and split)."""
    import torch

    from moequant.io.checkpoint import load_tokenizer
    from moequant.measure.data import load_samples

    s = load_samples("builtin:mix", load_tokenizer(Path(model)), samples, seq_len, split="calibration", seed=0)
    return torch.stack([x.input_ids for x in s])


def evaluate(checkpoint: str, reference: str, samples: int, seq_len: int) -> dict:
    from moequant.evaluate import evaluate_checkpoints

    q = evaluate_checkpoints(checkpoint, reference, samples=samples, seq_len=seq_len, progress=False)
    return {"kl": q.get("kl_mean"), "top1": q.get("top1_agreement"), "bits": None}


def run_child(*args) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--child", *map(str, args)], capture_output=True, text=True, env=env
    )
    if out.returncode != 0:
        return {"error": out.stderr[-2500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="qwen3-30b-a3b")
    p.add_argument(
        "--layers",
        type=int,
        nargs="+",
        default=(1, 2, 4),
        help="three or more layer counts (seconds per layer: least squares), or one (the quantize pass's "
        "own per-layer seconds)",
    )
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--eval-samples", type=int, default=16)
    p.add_argument("--tools", default=",".join(t for t in TOOLS if t != "moequant-gptq-noprior"))
    p.add_argument("--json", default=None, help="also write the results here, rewritten after every run")
    p.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run each tool once untimed on the first model before the timed runs (default: on a GPU), so "
        "that the machine's first Triton compilation does not land in one layer count's point",
    )
    p.add_argument("--work", default=None, help="directory for models and outputs (default: a temporary one)")
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--source",
        choices=("bf16", "fp8-block"),
        default="bf16",
        help="fp8-block: the model is written as DeepSeek's FP8 128x128 blocks (moequant reads it natively)",
    )
    p.add_argument("--set-config", action="append", default=[], help="config key=value (JSON) for the built model")
    p.add_argument("--keep-models", action="store_true", help="keep each layer count's model after its runs")
    p.add_argument("--child", nargs=7)
    a = p.parse_args()
    if a.child:
        tool, model, out, samples, seq_len, eval_samples, device = a.child
        if tool == "llmc-gptq":
            result = child_llmc(model, out, int(samples), int(seq_len), int(eval_samples))
        else:
            result = child_moequant(tool, model, out, int(samples), int(seq_len), int(eval_samples), device)
        print(json.dumps(result))
        return

    tools = [t for t in a.tools.split(",") if t]
    work = Path(a.work or tempfile.mkdtemp(prefix="bench-e2e-"))
    results: dict = {"config": a.config, "samples": a.samples, "seq_len": a.seq_len, "runs": {}}
    if a.source == "fp8-block" and "llmc-gptq" in tools:
        raise SystemExit(
            "llm-compressor reads no FP8-block source (it needs a bf16 copy); pass --tools without llmc-gptq"
        )
    warmup = a.device != "cpu" if a.warmup is None else a.warmup
    for layers in a.layers:
        model = work / f"{a.config}-{a.source}-{layers}L"
        if not model.exists():
            t0 = time.perf_counter()
            nbytes = (
                build_fp8_block(a.config, layers, a.vocab, model, a.set_config, a.device)
                if a.source == "fp8-block"
                else build(a.config, layers, a.vocab, model, a.device, a.set_config)
            )
            print(f"built {model.name}: {nbytes / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
        results.setdefault("model_bytes", {})[layers] = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        if warmup:
            warmup = False
            for tool in tools:
                r = run_child(tool, model, work / f"warmup-{tool}", a.samples, a.seq_len, a.eval_samples, a.device)
                print(f"{tool:20s} warm-up on {layers}L: {r.get('seconds', 'FAILED')} s (not counted)", flush=True)
                shutil.rmtree(work / f"warmup-{tool}", ignore_errors=True)
        for tool in tools:
            why = disk_shortfall(tool, a.source, model, work)
            if why:  # one sentence instead of a run that fills the disk minutes in
                results["runs"][f"{tool}@{layers}"] = {"error": why}
                print(f"{tool:20s} {layers}L skipped: {why}", flush=True)
                continue
            r = run_child(tool, model, work / f"{tool}-{layers}L", a.samples, a.seq_len, a.eval_samples, a.device)
            results["runs"][f"{tool}@{layers}"] = r
            print(
                f"{tool:20s} {layers}L " + (json.dumps(r) if "error" not in r else "FAILED\n" + r["error"]), flush=True
            )
            shutil.rmtree(work / f"{tool}-{layers}L", ignore_errors=True)
            if a.json:  # a call cut short (a time limit, a machine taken back) keeps the runs it finished
                _write_json(Path(a.json), results)
        if not a.keep_models:  # a DeepSeek-V3 source is 11.6 GB a layer: 1 + 2 + 3 layers fill the H200's disk
            shutil.rmtree(model, ignore_errors=True)
    print_table(results, tools, a.layers)
    if a.json:
        _write_json(Path(a.json), results)


OUTPUT_BITS = {
    "moequant-gptq": 4.25,
    "moequant-gptq-noprior": 4.25,
    "moequant-selective": 5.5,
    "moequant-fp8": 8.1,
    "moequant-rtn": 4.25,
    "llmc-gptq": 4.25,
}
SOURCE_BITS = {"bf16": 16.0, "fp8-block": 8.1}


def disk_shortfall(tool: str, source: str, model: Path, work: Path) -> str | None:
    """Why `tool`'s run on `model` cannot fit the disk beside it (its output is about the source's bytes times
    output bits over source bits, plus 10 %), or None. Every earlier layer count's model and output are
    removed by then (unless --keep-models), so the source and this one output are what the disk must hold."""
    source_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    need = 1.1 * source_bytes * OUTPUT_BITS.get(tool, 16.0) / SOURCE_BITS[source]
    free = shutil.disk_usage(work).free
    if need <= free:
        return None
    return (
        f"its output needs about {need / 1e9:.1f} GB beside the {source_bytes / 1e9:.1f} GB source and the disk "
        f"has {free / 1e9:.1f} GB free; run fewer layers or use a larger disk"
    )


def _write_json(path: Path, results: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=2))
    tmp.replace(path)


def fit_per_layer(points) -> tuple[float, float, float]:
    """Least-squares line through (layers, seconds): (seconds per layer, intercept, RMS residual).
    Three or more layer counts: a two-point slope moved 2x between calls on these machines."""
    n = len(points)
    xs, ys = [float(x) for x, _ in points], [float(y) for _, y in points]
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else float("nan")
    intercept = my - slope * mx
    rms = (sum((y - (intercept + slope * x)) ** 2 for x, y in zip(xs, ys)) / n) ** 0.5
    return slope, intercept, rms


def print_table(results: dict, tools, layer_counts) -> None:
    counts = sorted(set(layer_counts))
    hi = counts[-1]
    runs = results["runs"]
    mb = results["model_bytes"]
    print(
        f"\n{results['config']}, {results['samples']} x {results['seq_len']} calibration tokens; model "
        + " / ".join(f"{mb[n] / 1e9:.2f}" for n in counts)
        + f" GB at {' / '.join(map(str, counts))} layers"
    )
    print(
        f"{'tool':20s} {'s/layer':>8s} {'+-rms':>6s} {'w/o eval':>8s} {'run s':>20s} {'GPU GiB al/res':>13s} {'RSS GiB':>8s} "
        f"{'scratch MB':>11s} {'stats MB':>9s} {'KL':>9s} {'top-1':>6s}  stages (s, {hi} layers)"
    )
    slopes = {}
    for tool in tools:
        done = [(n, runs[f"{tool}@{n}"]) for n in counts if "seconds" in runs.get(f"{tool}@{n}", {})]
        if not done:
            print(f"{tool:20s} failed")
            continue
        b = done[-1][1]
        if len(done) == 1:  # one layer count: the pass's steady per-layer seconds (the last layer's)
            last = b.get("layer_seconds") or {}
            per_layer = no_eval = float(last[max(last, key=int)]) if last else float("nan")
            rms = float("nan")
        else:
            per_layer, _, rms = fit_per_layer([(n, r["seconds"]) for n, r in done])
            no_eval = fit_per_layer([(n, r["seconds"] - r["timings"].get("evaluate", 0)) for n, r in done])[0]
        slopes[tool] = (per_layer, no_eval)
        stages = " ".join(f"{k}={v:.1f}" for k, v in b.get("timings", {}).items())
        kl = f"{b['kl']:.5f}" if b.get("kl") is not None else "-"
        top1 = f"{b['top1']:.3f}" if b.get("top1") is not None else "-"
        run_s = "/".join(f"{r['seconds']:.1f}" for _, r in done)
        gpu = f"{b['peak_gpu_gib']:.1f}/{b.get('peak_gpu_reserved_gib', 0.0):.1f}"  # allocated / reserved
        print(
            f"{tool:20s} {per_layer:8.2f} {rms:6.2f} {no_eval:8.2f} {run_s:>20s} {gpu:>13s} "
            f"{b['peak_rss_gib']:8.1f} {b['scratch_bytes'] / 1e6:11.1f} {b['stats_bytes'] / 1e6:9.2f} {kl:>9s} "
            f"{top1:>6s}  {stages}"
        )
    base = slopes.get("llmc-gptq", (None,))[0]
    if base and len(counts) > 1:
        for tool, (whole, no_eval) in slopes.items():
            if tool != "llmc-gptq":
                print(
                    f"  {tool}: {base / max(whole, 1e-9):.1f}x faster per layer than llm-compressor "
                    f"({base / max(no_eval, 1e-9):.1f}x without moequant's evaluation, which llm-compressor does not run)"
                )
    for key, r in runs.items():
        if r.get("layer_seconds"):
            print(
                f"  {key}: seconds per decoder layer in the quantize pass "
                + ", ".join(f"L{L}={v:.1f}" for L, v in sorted(r["layer_seconds"].items(), key=lambda kv: int(kv[0])))
            )
    print_stages(results, tools, counts)
    for tool in ("moequant-fp8", "moequant-rtn"):  # the model-free plans: GB/s of source through pass + export
        done = [(n, runs[f"{tool}@{n}"]) for n in counts if "timings" in runs.get(f"{tool}@{n}", {})]
        if len(done) > 1:
            work = [(mb[n] / 1e9, pass_seconds(r["timings"])) for n, r in done]
            seconds_per_gb, _, rms = fit_per_layer(work)
            print(
                f"  {tool}: quantize pass + export " + " / ".join(f"{t:.1f}" for _, t in work) + " s: "
                f"{1 / max(seconds_per_gb, 1e-9):.2f} GB/s of source checkpoint per added layer (least squares, "
                f"rms {rms:.2f} s; no forward)"
            )


OUTSIDE_PASS = ("setup", "calibrate", "plan", "evaluate", "report", "other")  # every other stage is the pass's


def pass_seconds(timings: dict) -> float:
    """Seconds of the quantize pass and the export (every stage but set-up, calibration, plan, evaluation,
    report and the rest)."""
    return sum(v for k, v in timings.items() if k not in OUTSIDE_PASS)


def print_stages(results: dict, tools, counts) -> None:
    """Per moequant tool: each stage's seconds at every layer count and its least-squares slope per layer
    (two or more counts; three for a per-layer figure), the stages' sum against the run's seconds, and
    "other"'s share of the run."""
    runs = results["runs"]
    for tool in tools:
        done = [(n, runs[f"{tool}@{n}"]) for n in counts if runs.get(f"{tool}@{n}", {}).get("timings")]
        if not done:
            continue
        names = list(dict.fromkeys(k for _, r in done for k in r["timings"]))
        head = " / ".join(f"{n}L" for n, _ in done)
        print(f"\n{tool}: stage seconds at {head}, and per added layer (least squares)")
        for name in names + ["(sum of stages)", "(run seconds)"]:
            if name == "(sum of stages)":
                values = [sum(r["timings"].values()) for _, r in done]
            elif name == "(run seconds)":
                values = [r["seconds"] for _, r in done]
            else:
                values = [r["timings"].get(name, 0.0) for _, r in done]
            slope = fit_per_layer(list(zip([n for n, _ in done], values)))[0] if len(done) > 1 else float("nan")
            print(f"  {name:18s} {' / '.join(f'{v:7.2f}' for v in values)}   {slope:7.2f} s/layer")
        for name in dict.fromkeys(k for _, r in done for k in r.get("parts", {})):  # inside the stages above
            values = [r.get("parts", {}).get(name, 0.0) for _, r in done]
            slope = fit_per_layer(list(zip([n for n, _ in done], values)))[0] if len(done) > 1 else float("nan")
            print(f"    {name:26s} {' / '.join(f'{v:7.2f}' for v in values)}   {slope:7.2f} s/layer")
        other = [r["timings"].get("other", 0.0) / max(r["seconds"], 1e-9) for _, r in done]
        print("  other's share of the run: " + " / ".join(f"{x:.1%}" for x in other))


if __name__ == "__main__":
    main()
