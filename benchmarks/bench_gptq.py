"""GPTQ of all routed experts of one MoE layer: moequant (batched) vs llm-compressor.

Random expert weights at real shapes, one set of calibration tokens and held-out tokens, a
random top-k router. Both tools get the same tokens: each expert's Hessians come from the
tokens routed to it (gate/up read the layer input, down reads act(gate) * up computed with
the original weights). Printed per tool: time (Hessians and the GPTQ solve separately), peak GPU
memory, and the held-out relative output error ||X (W - W_q)^T||^2 / ||X W^T||^2 per projection.

Tools:
  moequant            moequant.algorithms.gptq, all experts of a projection as one batch
                      (gate and up share one factorization), act_order as llm-compressor's default
  moequant-noact      the same without activation ordering (moequant's default)
  moequant-pass       algorithms.gptq.gptq_pass(grid="searched", refit=True), the recipe's default gptq section: act
                      order, the searched grid and the least-squares scale refit, one projection at a time as
                      the pass runs it
  moequant-fp32       moequant with gpu_math update_matmul=fp32 (float32 products throughout, no TF32);
                      with `moequant` in the same run it also prints the fraction of differing codes
  rtn                 round-to-nearest, for scale
  llmc-batched        llm-compressor's GPTQModifier, its default batched_quantization="auto"
  llmc-single         llm-compressor's GPTQModifier with batched_quantization=None: one nn.Linear
                      at a time, as llm-compressor did before 0.14 and as the issue describes
llm-compressor runs through its own modifier lifecycle on a module tree of nn.Linear experts
(on_initialize -> on_calibration_start -> forward hooks accumulate Hessians ->
on_sequential_epoch_end, which observes the weights and quantizes). `--llmc-experts N` runs
llm-compressor on the first N experts only (its time is then scaled by E / N and marked "~");
errors are always compared on the experts each tool actually ran.

Dated results, each with its command: benchmarks/RESULTS.md, section bench_gptq.py.

Usage (CPU, small):  python benchmarks/bench_gptq.py --shape small --llmc-python .dev/llmc-venv/bin/python
GPU, real shapes:    python benchmarks/bench_gptq.py --shape qwen3-30b-a3b --device cuda --tools rtn moequant moequant-fp32 llmc-batched
                     python benchmarks/bench_gptq.py --shape deepseek-v3 --device cuda --tools moequant moequant-fp32 \
                         llmc-batched --llmc-experts 32 --compare-experts 32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# experts, hidden, expert width, top_k, calibration tokens, held-out tokens
SHAPES = {
    "small": (8, 256, 128, 2, 2048, 1024),
    "medium": (32, 512, 256, 4, 8192, 2048),
    "qwen3-30b-a3b": (128, 2048, 768, 8, 65536, 16384),
    "qwen3-235b-a22b": (128, 4096, 1536, 8, 65536, 16384),
    "deepseek-v3": (256, 7168, 2048, 8, 65536, 16384),
}


@dataclass
class Layer:
    gate: torch.Tensor  # [E, I, H] bf16
    up: torch.Tensor  # [E, I, H]
    down: torch.Tensor  # [E, H, I]
    calib: torch.Tensor  # [N, H] bf16
    calib_routes: list  # per expert: token indices
    held: torch.Tensor
    held_routes: list


def make_layer(shape: str, device: str, seed: int = 0) -> Layer:
    """Deterministic layer: same numbers in every process for one (shape, device, torch version)."""
    experts, hidden, width, top_k, n_calib, n_held = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=g, device=device, dtype=torch.float32)

    def weights(e, out, n_in):
        return (randn(e, out, n_in) * 0.02).to(torch.bfloat16)

    gate, up, down = weights(experts, width, hidden), weights(experts, width, hidden), weights(experts, hidden, width)
    # Activations: low-rank correlated part + noise, uneven channel scales, a few outlier channels.
    rank = 64
    basis = randn(rank, hidden) / rank**0.5
    channel = torch.exp(0.5 * randn(hidden))
    channel[:: max(1, hidden // 8)] *= 8.0
    router = randn(hidden, experts) / hidden**0.5
    bias = 0.5 * randn(experts)  # uneven expert popularity, as real routers have

    def tokens(n):
        x = (randn(n, rank) @ basis + 0.3 * randn(n, hidden)) * channel
        top = torch.topk(x @ router + bias, top_k, dim=-1).indices
        routes = [torch.nonzero((top == e).any(dim=-1)).flatten() for e in range(experts)]
        return x.to(torch.bfloat16), routes

    calib, calib_routes = tokens(n_calib)
    held, held_routes = tokens(n_held)
    return Layer(gate, up, down, calib, calib_routes, held, held_routes)


def down_input(layer: Layer, x: torch.Tensor, e: int) -> torch.Tensor:
    """The down projection's input for tokens x of expert e, from the original weights (fp32)."""
    xf = x.float()
    return F.silu(xf @ layer.gate[e].float().T) * (xf @ layer.up[e].float().T)


def relative_errors(layer: Layer, quantized: dict, experts: int) -> dict:
    """Held-out relative output error per projection, over the first `experts` experts."""
    out = {}
    for proj in ("gate", "up", "down"):
        num = den = 0.0
        for e in range(experts):
            x = layer.held[layer.held_routes[e]].float()
            if x.shape[0] == 0:
                continue
            if proj == "down":
                x = down_input(layer, x, e)
            w = getattr(layer, proj)[e].float()
            ref = x @ w.T
            num += float(((x @ quantized[proj][e].float().T - ref) ** 2).sum())
            den += float((ref**2).sum())
        out[proj] = num / den
    return out


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_reset(device):
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return 0


def peak_gib(device, base):
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**30, (torch.cuda.max_memory_allocated() - base) / 2**30
    return None, None


# ---------------------------------------------------------------------------------------------
# moequant


def expert_hessians(x: torch.Tensor, routes: list, fn=None) -> tuple[torch.Tensor, list]:
    """[E, d, d] fp32 Hessians X_e^T X_e / n_e (fn maps an expert's tokens to its projection input)."""
    hs, counts = None, []
    for e, idx in enumerate(routes):
        xe = x[idx].float() if fn is None else fn(x[idx], e)
        if hs is None:
            hs = torch.empty(len(routes), xe.shape[1], xe.shape[1], device=x.device)
        torch.matmul(xe.T, xe, out=hs[e])
        hs[e] /= max(1, xe.shape[0])
        counts.append(int(xe.shape[0]))
    return hs, counts


def run_moequant(layer: Layer, args, act_order: bool, matmul: str | None = None) -> dict:
    """matmul: gptq.gpu_math.update_matmul for this run (None: the library's default)."""
    return _run_moequant(layer, args, act_order, matmul)


_CODES: dict = {}  # (shape key, label) -> codes per projection, for code agreement between runs


def _run_moequant(layer: Layer, args, act_order: bool, matmul) -> dict:
    from moequant.algorithms import gptq
    from moequant.algorithms.gpu_math import GpuMath

    gpu_math = GpuMath() if matmul is None else GpuMath(update_matmul=matmul)
    device = args.device
    experts = layer.gate.shape[0]
    base = peak_reset(device)
    sync(device)
    t0 = time.perf_counter()
    h_in, counts = expert_hessians(layer.calib, layer.calib_routes)
    sync(device)
    t1 = time.perf_counter()
    (q_gate, q_up), report_in = gptq.gptq_shared_hessian(
        [layer.gate, layer.up],
        h_in,
        args.format,
        act_order=act_order,
        tokens=counts,
        min_tokens=1,
        chunk_experts=args.chunk_experts,
        gpu_math=gpu_math,
    )
    del h_in
    sync(device)
    t2 = time.perf_counter()
    h_down, _ = expert_hessians(layer.calib, layer.calib_routes, lambda x, e: down_input(layer, x, e))
    sync(device)
    t3 = time.perf_counter()
    q_down, report_down = gptq.gptq(
        layer.down,
        h_down,
        args.format,
        act_order=act_order,
        tokens=counts,
        chunk_experts=args.chunk_experts,
        gpu_math=gpu_math,
    )
    del h_down
    sync(device)
    t4 = time.perf_counter()
    peak, extra = peak_gib(device, base)
    quantized = {
        "gate": q_gate.dequantize(torch.bfloat16),
        "up": q_up.dequantize(torch.bfloat16),
        "down": q_down.dequantize(torch.bfloat16),
    }
    fallbacks = len(report_in.fallbacks()) + len(report_down.fallbacks())
    # code agreement between the default run and the float32 one (whichever ran second reports it)
    key = (tuple(layer.gate.shape), act_order)
    label = "fp32" if matmul == "fp32" else "default"
    _CODES[key + (label,)] = {"gate": q_gate.codes.cpu(), "up": q_up.codes.cpu(), "down": q_down.codes.cpu()}
    other = _CODES.get(key + ("default" if label == "fp32" else "fp32",))
    agreement = ""
    if other is not None:
        mine = _CODES[key + (label,)]
        agreement = (
            "; codes differing from the "
            + ("default" if label == "fp32" else "fp32")
            + " run "
            + " ".join(
                f"{torch.count_nonzero(mine[p] != other[p]).item() / mine[p].numel():.2e}"
                for p in ("gate", "up", "down")
            )
        )
    phases = " ".join(f"{k} {report_in.seconds[k] + report_down.seconds[k]:.2f}s" for k in report_in.seconds)
    return dict(
        experts_run=experts,
        hessian_s=(t1 - t0) + (t3 - t2),
        gptq_s=(t2 - t1) + (t4 - t3),
        peak_gib=peak,
        extra_gib=extra,
        errors=relative_errors(layer, quantized, experts),
        note=f"{fallbacks} expert fallbacks; {report_in.settings['sweep']} sweep, updates "
        f"{report_in.settings.get('update_matmul')}, Cholesky {report_in.settings.get('cholesky_matmul')}; {phases}"
        + subset_note(layer, quantized, args)
        + agreement,
    )


def run_moequant_pass(layer: Layer, args) -> dict:
    """The quantize pass's GPTQ (gptq_pass_shared: gate and up in one solve, down alone), timed by phase:
    the searched grid (formats.search_triton on CUDA) inside the solve's scales phase, the solve, the refit."""
    from moequant.algorithms import gptq
    from moequant.algorithms.refit import refit_scales_shared

    device = args.device
    base = peak_reset(device)
    sync(device)
    t0 = time.perf_counter()
    h_in, counts = expert_hessians(layer.calib, layer.calib_routes)
    h_down, _ = expert_hessians(layer.calib, layer.calib_routes, lambda x, e: down_input(layer, x, e))
    sync(device)
    t1 = time.perf_counter()
    quantized, grid_s, refit_s = {}, 0.0, 0.0
    for projs, h in ((("gate", "up"), h_in), (("down",), h_down)):
        weights = [getattr(layer, p) for p in projs]
        qs, report = gptq.gptq_shared_hessian(
            weights, h, args.format, act_order=True, static_groups=True, grid="searched"
        )
        grid_s += report.seconds["prepare"]
        sync(device)
        t_refit = time.perf_counter()
        qs = refit_scales_shared(qs, weights, h)
        sync(device)
        refit_s += time.perf_counter() - t_refit
        for p, q in zip(projs, qs):
            quantized[p] = q.dequantize(torch.bfloat16)
    sync(device)
    t2 = time.perf_counter()
    peak, extra = peak_gib(device, base)
    return dict(
        experts_run=layer.gate.shape[0],
        hessian_s=t1 - t0,
        gptq_s=t2 - t1,
        peak_gib=peak,
        extra_gib=extra,
        errors=relative_errors(layer, quantized, layer.gate.shape[0]),
        note=f"searched grid + scale refit, gate/up shared; scales phase (grid) {grid_s:.3f}s, refit {refit_s:.3f}s"
        + subset_note(layer, quantized, args),
    )


def run_rtn(layer: Layer, args) -> dict:
    from moequant.algorithms import rtn

    device = args.device
    base = peak_reset(device)
    sync(device)
    t0 = time.perf_counter()
    quantized = {p: rtn.rtn(getattr(layer, p), args.format).dequantize(torch.bfloat16) for p in ("gate", "up", "down")}
    sync(device)
    peak, extra = peak_gib(device, base)
    return dict(
        experts_run=layer.gate.shape[0],
        hessian_s=0.0,
        gptq_s=time.perf_counter() - t0,
        peak_gib=peak,
        extra_gib=extra,
        errors=relative_errors(layer, quantized, layer.gate.shape[0]),
        note=subset_note(layer, quantized, args).lstrip("; "),
    )


def subset_note(layer, quantized, args) -> str:
    """Errors over the first N experts, to compare with a tool that ran only those."""
    n = args.compare_experts
    if not n or n >= layer.gate.shape[0]:
        return ""
    e = relative_errors(layer, quantized, n)
    return f"; first {n} experts: {e['gate']:.4g} {e['up']:.4g} {e['down']:.4g}"


# ---------------------------------------------------------------------------------------------
# llm-compressor


LLMC_SCHEMES = {
    "int4-g128-sym": "W4A16",
    "mxfp4": "MXFP4A16",
    "nvfp4": "NVFP4A16",
    "int8-channel": "W8A16",
    "fp8-channel": "FP8_DYNAMIC",
}


def run_llmc(layer: Layer, args, batched: bool) -> dict:
    from llmcompressor.core import State
    from llmcompressor.modifiers.gptq import GPTQModifier

    device = args.device
    experts = min(args.llmc_experts or layer.gate.shape[0], layer.gate.shape[0])
    hidden, width = layer.gate.shape[2], layer.gate.shape[1]

    class Expert(torch.nn.Module):
        def __init__(self, e):
            super().__init__()
            self.gate_proj = torch.nn.Linear(hidden, width, bias=False, device=device, dtype=torch.bfloat16)
            self.up_proj = torch.nn.Linear(hidden, width, bias=False, device=device, dtype=torch.bfloat16)
            self.down_proj = torch.nn.Linear(width, hidden, bias=False, device=device, dtype=torch.bfloat16)
            with torch.no_grad():
                self.gate_proj.weight.copy_(layer.gate[e])
                self.up_proj.weight.copy_(layer.up[e])
                self.down_proj.weight.copy_(layer.down[e])

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleList(Expert(e) for e in range(experts))

    model = Experts()
    modifier = GPTQModifier(
        targets="Linear",
        scheme=LLMC_SCHEMES[args.format],
        ignore=[],
        batched_quantization="auto" if batched else None,
        block_size=128,
        dampening_frac=0.01,
    )
    state = State(model=model)
    base = peak_reset(device)
    sync(device)
    t0 = time.perf_counter()
    modifier.on_initialize(state)
    modifier.on_calibration_start(state, None)
    with torch.no_grad():
        for e in range(experts):
            x = layer.calib[layer.calib_routes[e]]
            if x.shape[0] == 0:
                continue
            m = model.experts[e]
            m.gate_proj(x)
            m.up_proj(x)
            m.down_proj(down_input(layer, x, e).to(torch.bfloat16))
    sync(device)
    t1 = time.perf_counter()
    modifier.on_sequential_epoch_end(state, None, modules=list(model.modules()))
    sync(device)
    t2 = time.perf_counter()
    peak, extra = peak_gib(device, base)
    modifier.on_calibration_end(state, None)
    quantized = {
        "gate": torch.stack([model.experts[e].gate_proj.weight.detach() for e in range(experts)]),
        "up": torch.stack([model.experts[e].up_proj.weight.detach() for e in range(experts)]),
        "down": torch.stack([model.experts[e].down_proj.weight.detach() for e in range(experts)]),
    }
    return dict(
        experts_run=experts,
        hessian_s=t1 - t0,
        gptq_s=t2 - t1,
        peak_gib=peak,
        extra_gib=extra,
        errors=relative_errors(layer, quantized, experts),
        note="",
    )


def run_tool(tool: str, layer: Layer, args) -> dict:
    if args.warmup:
        # One-time costs out of the timings, for every tool: library set-up, and Triton compiles,
        # which are per pattern of shapes and strides, hence a warm-up on 2 experts of this layer.
        two = Layer(
            layer.gate[:2],
            layer.up[:2],
            layer.down[:2],
            layer.calib,
            layer.calib_routes[:2],
            layer.held,
            layer.held_routes[:2],
        )
        args.warmup = False
        try:
            run_tool(tool, two, args)
        finally:
            args.warmup = True
        del two
    if tool == "moequant":
        return run_moequant(layer, args, act_order=True)
    if tool == "moequant-noact":
        return run_moequant(layer, args, act_order=False)
    if tool == "moequant-pass":
        return run_moequant_pass(layer, args)
    if tool == "moequant-fp32":
        return run_moequant(layer, args, act_order=True, matmul="fp32")

    if tool == "rtn":
        return run_rtn(layer, args)
    if tool in ("llmc-batched", "llmc-single"):
        return run_llmc(layer, args, batched=tool == "llmc-batched")
    raise SystemExit(f"unknown tool {tool}")


# ---------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs="+", default=["small"], choices=sorted(SHAPES))
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--format",
        default="int4-g128-sym",
        choices=sorted(LLMC_SCHEMES) + ["int4-g32-sym"],
        help="int4-g32-sym: moequant's tools only (no llm-compressor preset scheme)",
    )
    ap.add_argument("--tools", nargs="+", default=["rtn", "moequant", "moequant-noact", "llmc-batched", "llmc-single"])
    ap.add_argument("--llmc-experts", type=int, default=None, help="run llm-compressor on the first N experts only")
    ap.add_argument("--llmc-single-experts", type=int, default=None, help="same, for llmc-single")
    ap.add_argument("--llmc-python", default=None, help="python of a venv with llm-compressor (else in-process)")
    ap.add_argument("--chunk-experts", type=int, default=None)
    ap.add_argument("--compare-experts", type=int, default=None, help="also print errors over the first N experts")
    ap.add_argument("--json-out", default=None, help="also write all results as JSON here")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one tool, JSON to stdout
    ap.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="time each tool's first call too (default: each tool first runs once on the small shape)",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=None,
        metavar="E",
        help="time the phases of GPTQ on the first E experts of each --shape (torch vs fused sweep)",
    )
    ap.add_argument(
        "--profile-refit",
        type=int,
        default=None,
        metavar="E",
        help="time the searched grid and the scale refit's parts on E random experts of each --shape "
        "and --format (kernel launch shapes, solvers; OLD_SEARCH=path of an older search_triton.py to compare)",
    )
    ap.add_argument(
        "--verify",
        action="store_true",
        help="first check on the device: CUDA-graph sweep == eager, batched == one expert at a time (same codes)",
    )
    args = ap.parse_args()
    if args.verify:
        verify(args.device)
    if args.profile_refit:
        for shape in args.shape:
            profile_refit(args.device, shape, args.profile_refit, args.format)
        return
    if args.profile:
        for shape in args.shape:
            profile(args.device, shape, args.profile)
        return

    if args.one:
        layer = make_layer(args.shape[0], args.device)
        print("RESULT " + json.dumps(run_tool(args.one, layer, args)), flush=True)
        return

    torch.backends.cuda.matmul.allow_tf32 = False
    all_rows = []
    for shape in args.shape:
        experts, hidden, width, top_k, n_calib, n_held = SHAPES[shape]
        print(
            f"\n== {shape}: {experts} experts, hidden {hidden}, width {width}, top-{top_k}, "
            f"{n_calib} calibration / {n_held} held-out tokens, {args.format}, device {args.device}",
            flush=True,
        )
        layer = None
        for tool in args.tools:
            sub = tool.startswith("llmc") and args.llmc_python
            n_sub = (
                args.llmc_single_experts if tool == "llmc-single" and args.llmc_single_experts else args.llmc_experts
            )
            if sub:
                cmd = [
                    args.llmc_python,
                    __file__,
                    "--one",
                    tool,
                    "--shape",
                    shape,
                    "--device",
                    args.device,
                    "--format",
                    args.format,
                ] + (["--llmc-experts", str(n_sub)] if n_sub else [])
                proc = subprocess.run(
                    cmd,
                    capture_output=True,
                    text=True,
                    env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                )
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if not lines:
                    print(f"{tool} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}", flush=True)
                    continue
                res = json.loads(lines[-1][7:])
            else:
                if layer is None:
                    layer = make_layer(shape, args.device)
                args.llmc_experts, keep = n_sub, args.llmc_experts
                try:
                    res = run_tool(tool, layer, args)
                finally:
                    args.llmc_experts = keep
            res["tool"], res["shape"] = tool, shape
            scale = experts / res["experts_run"]
            res["layer_s"] = (res["hessian_s"] + res["gptq_s"]) * scale
            res["layer_gptq_s"] = res["gptq_s"] * scale
            res["extrapolated"] = scale != 1
            all_rows.append(res)
            print_row(res, header=len([r for r in all_rows if r["shape"] == shape]) == 1)
        del layer
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print_summary(all_rows)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(all_rows, f, indent=1)


def verify(device):
    """Same codes with and without CUDA graphs, batched and one by one, on this device."""
    from moequant.algorithms import gptq
    from moequant.algorithms.gpu_math import GpuMath

    layer = make_layer("medium" if device.startswith("cuda") else "small", device, seed=1)
    h, counts = expert_hessians(layer.calib, layer.calib_routes)
    for key in ("int4-g128-sym", "int4-g32-asym", "mxfp4", "nvfp4", "fp8-block128", "int8-channel"):
        for act in (False, True):
            t0 = time.perf_counter()
            (a_gate, a_up), _ = gptq.gptq_shared_hessian([layer.gate, layer.up], h, key, act_order=act)
            sync(device)
            t1 = time.perf_counter()
            (b_gate, b_up), _ = gptq.gptq_shared_hessian(
                [layer.gate, layer.up], h, key, act_order=act, gpu_math=GpuMath(cuda_graphs=False)
            )
            sync(device)
            t2 = time.perf_counter()
            one = gptq.gptq(layer.gate[3], h[3], key, act_order=act)[0]
            same_graph = torch.equal(a_gate.codes, b_gate.codes) and torch.equal(a_up.codes, b_up.codes)
            same_one = torch.equal(one.codes, a_gate.codes[3])
            frac_one = (one.codes != a_gate.codes[3]).float().mean().item()
            frac = (a_gate.codes != b_gate.codes).float().mean().item()
            print(
                f"verify {key:14} act_order={act!s:5} graph==eager {same_graph} ({frac:.2e} differ) "
                f"batched==single {same_one} ({frac_one:.2e} differ)  graph {t1 - t0:.2f}s eager {t2 - t1:.2f}s",
                flush=True,
            )
    del layer, h


def profile(device, shape, experts, out_dir=None):
    """Where a GPTQ solve's time goes, for the first `experts` experts of one layer shape: the
    factorization variants alone, then gate+up and down with the torch sweep and with the fused
    Triton sweep (phase times from the report, plus the top CUDA kernels from torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from moequant.algorithms import cholesky, gptq
    from moequant.algorithms.gpu_math import GpuMath

    torch.backends.cuda.matmul.allow_tf32 = False
    layer = make_layer(shape, device)
    routes = layer.calib_routes[:experts]
    h_in, counts = expert_hessians(layer.calib, routes)
    h_down, _ = expert_hessians(layer.calib, routes, lambda x, e: down_input(layer, x, e))
    gate, up, down = layer.gate[:experts], layer.up[:experts], layer.down[:experts]
    n = h_in.shape[-1]

    def timed(fn, repeat=1, warm=True):
        if warm:
            fn()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        sync(device)
        return (time.perf_counter() - t0) / repeat

    print(f"\n== profile {shape}, first {experts} experts, n={n}", flush=True)
    damped = h_in.clone()
    damped.diagonal(dim1=-2, dim2=-1).add_(0.01 * damped.diagonal(dim1=-2, dim2=-1).mean(-1, keepdim=True))
    rows = []
    small = damped[:2, :256, :256]  # library handles and kernels loaded outside the timings
    torch.linalg.cholesky_ex(small), torch.linalg.cholesky_ex(small[0]), cholesky.blocked_cholesky(small.clone(), 128)
    torch.linalg.solve_triangular(small, small, upper=False)
    rows.append(("cholesky_ex batched (cusolver)", timed(lambda: torch.linalg.cholesky_ex(damped), warm=False)))
    rows.append(
        ("cholesky_ex one matrix at a time", timed(lambda: [torch.linalg.cholesky_ex(m) for m in damped], warm=False))
    )
    for nb in (256, 512, 1024):
        rows.append(
            (
                f"blocked cholesky nb={nb} (bmm)",
                timed(lambda: cholesky.blocked_cholesky(damped.clone(), nb), warm=False),
            )
        )
    chol = torch.linalg.cholesky_ex(damped)[0]
    eye = torch.eye(n, device=device).expand(experts, n, n)
    rows.append(
        (
            "solve_triangular(L, I) (old U path)",
            timed(lambda: torch.linalg.solve_triangular(chol, eye, upper=False), warm=False),
        )
    )
    rows.append(("flip [E,n,n] copy", timed(lambda: torch.flip(chol, dims=(-2, -1)))))
    perm = torch.argsort(h_in.diagonal(dim1=-2, dim2=-1), dim=-1, descending=True)
    rows.append(
        (
            "act-order permutation of H, one gather",
            timed(
                lambda: h_in[torch.arange(experts, device=device)[:, None, None], perm[:, :, None], perm[:, None, :]]
            ),
        )
    )
    rows.append(
        (
            "act-order permutation of H, two gathers",
            timed(
                lambda: torch.gather(
                    torch.gather(h_in, 1, perm[:, :, None].expand(-1, -1, n)), 2, perm[:, None, :].expand(-1, n, -1)
                )
            ),
        )
    )
    del perm
    w = torch.cat([gate, up], dim=1).float()
    e_blk = torch.randn(experts, w.shape[1], 128, device=device)
    t_mm = timed(lambda: torch.baddbmm(w[..., 128:], e_blk, chol[:, :128, 128:]))
    flops = 2 * experts * w.shape[1] * 128 * (n - 128)
    rows.append((f"one lazy-update bmm ({flops / t_mm / 1e12:.1f} TFLOP/s fp32)", t_mm))
    for name, t in rows:
        print(f"  {name:48} {t * 1e3:9.1f} ms", flush=True)
    del damped, chol, eye, w, e_blk

    from moequant.algorithms import gptq_triton

    if gptq_triton.triton is not None and device.startswith("cuda"):
        x = torch.cat([gate, up], dim=1).float()
        vn = torch.triu(torch.randn(experts, n, n, device=device)) * 0.01 + torch.eye(n, device=device)
        vd = torch.ones(experts, n, device=device)
        scales = torch.full((experts, x.shape[1], n // 128), 0.002, device=device)
        group_idx = (torch.arange(n, device=device) // 128).to(torch.int32).expand(experts, -1).contiguous()
        codes = torch.empty(x.shape, dtype=torch.int8, device=device)
        loss = torch.zeros(experts, dtype=torch.float64, device=device)
        print("  fused block sweep, one 128-column block of gate+up, per launch shape:", flush=True)
        for tile_rows, warps in ((16, 2), (16, 4), (32, 4), (32, 8), (64, 4), (64, 8)):
            try:
                t = timed(
                    lambda: gptq_triton.sweep_block(
                        x,
                        x.clone(),
                        vn,
                        vd,
                        scales,
                        None,
                        group_idx,
                        codes,
                        loss,
                        128,
                        256,
                        -8,
                        7,
                        None,
                        tile_rows,
                        warps,
                    ),
                    repeat=3,
                )
                print(f"    rows {tile_rows:3} warps {warps}: {t * 1e3:7.3f} ms", flush=True)
            except Exception as err:  # noqa: BLE001 - a launch shape that does not compile is just skipped
                print(f"    rows {tile_rows:3} warps {warps}: failed ({type(err).__name__})", flush=True)
        del x, vn, vd, scales, codes

    for triton in (False, True):
        gpu_math = GpuMath(triton=triton)
        for label, run in (
            (
                "gate+up",
                lambda: gptq.gptq_shared_hessian(
                    [gate, up], h_in, "int4-g128-sym", act_order=True, tokens=counts, gpu_math=gpu_math
                ),
            ),
            (
                "down",
                lambda: gptq.gptq(down, h_down, "int4-g128-sym", act_order=True, tokens=counts, gpu_math=gpu_math),
            ),
        ):
            run()  # warm-up (Triton compile, cuBLAS handles)
            sync(device)
            t0 = time.perf_counter()
            _, report = run()
            sync(device)
            total = time.perf_counter() - t0
            sec = report.seconds
            print(
                f"  {report.settings['sweep']:6} {label:8} total {total:7.3f} s  "
                + "  ".join(f"{k} {v:6.3f}" for k, v in sec.items())
                + f"  rest {total - sum(sec.values()):6.3f}  chunk {report.settings['chunk_experts']}",
                flush=True,
            )
            if label == "gate+up" and device.startswith("cuda"):
                with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                    run()
                    sync(device)
                try:
                    table = prof.key_averages().table(
                        sort_by="device_time_total", row_limit=14, max_name_column_width=70
                    )
                except Exception:  # noqa: BLE001 - older torch names the column cuda_time_total
                    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70)
                print(table, flush=True)


def profile_refit(device, shape, experts, key):
    """The searched grid and the refit's parts on `experts` random experts (gate's and down's shapes):
    grid kernel (and an older one, OLD_SEARCH), normal equations by the Triton kernel per launch shape
    and by the torch split-TF32 products, their error against float64, the batched solvers."""
    import importlib.util

    from triton.testing import do_bench

    from moequant import formats
    from moequant.algorithms import refit, refit_triton
    from moequant.formats import core, search_triton

    spec = formats.parse_key(key)
    _, hidden, width, *_ = SHAPES[shape]
    gs = spec.group_size
    old = None
    if os.environ.get("OLD_SEARCH"):
        load = importlib.util.spec_from_file_location("old_search_triton", os.environ["OLD_SEARCH"])
        old = importlib.util.module_from_spec(load)
        load.loader.exec_module(old)
    g = torch.Generator(device=device).manual_seed(0)
    for proj, rows, cols in (("gate", width, hidden), ("down", hidden, width))[
        : int(os.environ.get("PROFILE_PROJS", 2))
    ]:
        w = (torch.randn(experts, rows, cols, device=device, generator=g) * 0.02).to(torch.bfloat16)
        x = torch.randn(4096, cols, device=device, generator=g) * torch.exp(
            0.5 * torch.randn(cols, device=device, generator=g)
        )
        h = (x.T @ x / 4096).expand(experts, cols, cols).contiguous()
        h += 0.01 * torch.eye(cols, device=device) * torch.rand(experts, 1, 1, device=device, generator=g)
        imp = h.diagonal(dim1=-2, dim2=-1)[:, None, :].unflatten(-1, (-1, gs))
        xg = w.float().unflatten(-1, (-1, gs))
        ms = lambda fn: do_bench(fn, warmup=50, rep=300, return_mode="median")  # noqa: E731
        scale = 256 / experts  # per 256 experts ("per layer" of DeepSeek; Qwen3 has 128: halve)
        print(f"\n== {shape} {proj} [{experts}, {rows}, {cols}] {key}; ms per 256 experts", flush=True)
        t = ms(lambda: core.searched_fit(spec, xg, imp))
        print(f"  grid kernel (this tree)           {t * scale:9.1f}", flush=True)
        if old is not None and spec.symmetric:
            qmax = 2 ** (spec.bits - 1) - 1
            divs = 1.0 / torch.tensor(
                torch.linspace(qmax, 1.6 * qmax, core.SEARCH_STEPS).tolist() + [qmax + 0.5, qmax + 1],
                dtype=torch.float32,
            )  # factors, as searched_fit
            s0, z0 = core._fit(spec, xg, None, None)
            t = ms(lambda: old.searched_fit_triton(spec, xg, imp, s0, z0, divs))
            print(f"  grid kernel (OLD_SEARCH)          {t * scale:9.1f}", flush=True)
            new_s = core.searched_fit(spec, xg, imp)[0]
            print(
                f"  scales differing new vs old       {(new_s != old.searched_fit_triton(spec, xg, imp, s0, z0, divs)[0]).float().mean().item():.2e}"
            )
        default_grid = dict(search_triton.LAUNCH)
        for bm, warps in ((16, 4), (8, 4), (16, 2), (32, 2)):
            search_triton.LAUNCH[gs] = (bm, warps)
            try:
                t = ms(lambda: core.searched_fit(spec, xg, imp))
                print(f"  grid kernel {bm:3} groups {warps} warps  {t * scale:9.1f}", flush=True)
            except Exception as err:  # noqa: BLE001
                print(f"  grid kernel {bm} {warps}: {type(err).__name__}", flush=True)
        search_triton.LAUNCH.clear()
        search_triton.LAUNCH.update(default_grid)
        q = formats.quantize(w, spec)
        groups = cols // gs
        default_launch = dict(refit_triton.LAUNCH)
        c = q.codes if q.zeros is None else q.codes - q.zeros.repeat_interleave(gs, dim=-1)
        t = ms(lambda: refit_triton.hessian_pieces(h, gs))
        print(f"  H pieces                          {t * scale:9.1f}", flush=True)
        pieces = refit_triton.hessian_pieces(h, gs)
        variants = (
            [tuple(int(v) for v in x.split(",")) for x in os.environ["REFIT_LAUNCH"].split(";")]
            if os.environ.get("REFIT_LAUNCH")
            else ((64, 8, 3), (64, 4, 3), (128, 8, 3), (32, 4, 3))
        )
        for launch in variants:
            refit_triton.LAUNCH[gs] = launch
            try:
                t = ms(lambda: refit_triton.normal_equations(c, w, pieces, gs))
                print(f"  normal eq. kernel R, warps, stages {launch}  {t * scale:9.1f}", flush=True)
            except Exception as err:  # noqa: BLE001
                print(f"  normal eq. kernel {launch}: {type(err).__name__} {str(err)[:300]}", flush=True)
        refit_triton.LAUNCH.update(default_launch)
        del pieces
        cf, wf = c.float(), w.float()
        if os.environ.get("PROFILE_TORCH", "1") == "1":
            try:
                t = ms(lambda: refit._normal_equations(cf, wf, h, groups))
                print(f"  normal eq. torch split TF32       {t * scale:9.1f}", flush=True)
            except torch.OutOfMemoryError:
                print("  normal eq. torch split TF32: out of memory", flush=True)
        a, b = refit_triton.normal_equations(c[:2], w[:2], h[:2], gs)
        a64, b64 = refit._normal_equations(c[:2].double(), w[:2].double(), h[:2].double(), groups)
        a32, b32 = refit._normal_equations(cf[:2], wf[:2], h[:2], groups)
        rel = lambda u, v: ((u.double() - v).norm() / v.norm()).item()  # noqa: E731
        print(
            f"  vs float64: kernel A {rel(a, a64):.2e} b {rel(b, b64):.2e}; split TF32 A {rel(a32, a64):.2e} "
            f"b {rel(b32, b64):.2e}",
            flush=True,
        )
        del a64, b64, a32, b32
        a, b = refit_triton.normal_equations(c, w, h, gs)
        t = ms(lambda: refit._solve(a, b, q.scales))
        print(f"  solve + choose (Cholesky)         {t * scale:9.1f}", flush=True)
        damped = a + 1e-9 * torch.eye(groups, device=device)
        t = ms(lambda: torch.cholesky_solve(b.unsqueeze(-1), torch.linalg.cholesky_ex(damped)[0]))
        print(f"  cholesky_ex + cholesky_solve      {t * scale:9.1f}", flush=True)
        for lib in ("magma", "cusolver"):
            try:
                torch.backends.cuda.preferred_linalg_library(lib)
                t = ms(lambda: torch.cholesky_solve(b.unsqueeze(-1), torch.linalg.cholesky_ex(damped)[0]))
                t2 = ms(lambda: torch.linalg.cholesky_ex(damped)[0])
                print(f"  {lib}: cholesky_ex + solve {t * scale:9.1f}  cholesky_ex alone {t2 * scale:9.1f}", flush=True)
            except Exception as err:  # noqa: BLE001
                print(f"  {lib}: {type(err).__name__} {str(err)[:200]}", flush=True)
        torch.backends.cuda.preferred_linalg_library("default")
        from moequant.algorithms.cholesky import blocked_cholesky as _blocked_cholesky

        for nb in (32, 64):
            flat = damped.view(-1, groups, groups)
            t = ms(lambda: torch.cholesky_solve(b.view(-1, groups, 1), _blocked_cholesky(flat.clone(), nb)[0]))
            t2 = ms(lambda: flat.clone())
            print(
                f"  blocked Cholesky nb={nb} + solve (less a clone {t2 * scale:.1f})  {(t - t2) * scale:9.1f}",
                flush=True,
            )
        ref = torch.cholesky_solve(b.unsqueeze(-1), torch.linalg.cholesky_ex(damped)[0])
        alt = torch.cholesky_solve(
            b.view(-1, groups, 1), _blocked_cholesky(damped.view(-1, groups, groups).clone(), 32)[0]
        ).view_as(ref)
        print(f"  blocked vs cusolver solution: {((alt - ref).norm() / ref.norm()).item():.2e}", flush=True)
        del ref, alt
        for lib in ("magma", "cusolver"):
            try:
                torch.backends.cuda.preferred_linalg_library(lib)
                t = ms(lambda: refit._solve(a, b, q.scales))
                print(f"  {lib}: solve + choose (refit._solve) {t * scale:9.1f}", flush=True)
            except Exception as err:  # noqa: BLE001
                print(f"  {lib}: {type(err).__name__} {str(err)[:200]}", flush=True)
        torch.backends.cuda.preferred_linalg_library("default")
        del a, b, damped, h, x, w, xg, imp, q, c, cf, wf
        torch.cuda.empty_cache()


def print_row(r, header):
    if header:
        print(
            f"{'tool':15} {'experts':>7} {'hessian s':>9} {'gptq s':>9} {'layer gptq s':>13} {'peak GiB':>8} "
            f"{'extra GiB':>9} {'err gate':>9} {'err up':>9} {'err down':>9}  note"
        )
    mark = "~" if r["extrapolated"] else " "
    peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
    extra = "-" if r["extra_gib"] is None else f"{r['extra_gib']:.1f}"
    e = r["errors"]
    print(
        f"{r['tool']:15} {r['experts_run']:>7} {r['hessian_s']:9.2f} {r['gptq_s']:9.2f} {mark}{r['layer_gptq_s']:12.2f} "
        f"{peak:>8} {extra:>9} {e['gate']:9.4g} {e['up']:9.4g} {e['down']:9.4g}  {r['note']}",
        flush=True,
    )


def print_summary(rows):
    print("\nspeed-up of moequant's GPTQ solve over llm-compressor's (per whole layer, '~' = extrapolated):")
    for shape in dict.fromkeys(r["shape"] for r in rows):
        mq = [r for r in rows if r["shape"] == shape and r["tool"] == "moequant"]
        for r in rows:
            if r["shape"] == shape and r["tool"].startswith("llmc") and mq:
                mark = "~" if r["extrapolated"] else ""
                print(
                    f"  {shape:15} vs {r['tool']:13} {mark}{r['layer_gptq_s'] / mq[0]['layer_gptq_s']:.1f}x "
                    f"(with Hessians {mark}{r['layer_s'] / mq[0]['layer_s']:.1f}x)"
                )


if __name__ == "__main__":
    main()
