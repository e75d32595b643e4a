"""Per-layer KL probe: what quantizing one MoE layer's routed experts does to the model's output.

The policy's predicted loss of a layer (usage x calibration's RTN output error, summed over
experts; see policy.py) is measured at the layer's own output. How much of that error survives
to the next-token distribution differs from layer to layer (on the bundled models the predicted
loss grows about 3x with depth relative to the real effect), so a budget plan that adds
predicted losses across layers ranks layers wrongly. The probe measures the real effect once
per layer and turns it into a per-layer scale the policy multiplies that layer's losses by.

For every MoE layer L, on `probe_samples` samples (further samples of the calibration split,
held out from the statistics, when calibrate draws the data; evenly spaced ones of caller-given
samples otherwise):
  1. kl_alone = KL(original || only layer L's routed experts quantized in the probe format);
  2. restore_gain = KL(original || every MoE layer quantized) - KL(original || every MoE layer
     but L quantized): what L costs once the others are quantized too;
  3. kl = (kl_alone + max(restore_gain, 0)) / 2: L's share of the KL, measured at both ends of
     the plans a budget chooses between (KL in float64 over the probe tokens,
     `metrics.token_statistics`, mean per token);
  4. predicted loss = sum over experts e of usage(L, e) * sum_p sensitivity_L[p][format][e]
     (what the policy predicts for layer L in that format, with the default usage floor);
  5. scale = kl / predicted.

Per projection (`projections=True`, what a llama.cpp budget asks: it chooses a type per (layer,
projection)): also kl_alone of each projection p alone quantized. The sensitivities of gate / up
are errors of the expert's intermediate activations and down's of the layer's output, so their sum
weighs the projections in two different spaces; the policy splits the layer's kl between the
projections in proportion to their one-projection KLs instead (plan.context._probe_scales). On
tiny-deepseek-v3 at Q4_K_M's bytes the per-layer scale gave every down_proj q3_k and gate / up
q4_k, where llama.cpp's own mixture gives down the most bits (benchmarks/RESULTS.md, bench_gguf).

Why both ends: the layers' KLs do not add up. On tiny-mixtral (4 layers, int4-g128 GPTQ vs int8;
16 x 128 calibration, 32 x 128 evaluation tokens) the four one-layer int4 KLs sum to 1.2x the
all-layers int4 KL, and the six plans with two int8 layers average 6% above the straight line
between the uniform points. With 8 probe samples (the default then) at 64 x 256 calibration, the
one-layer KLs alone would keep layers 1, 2 at int8 (KL 0.01777, third of the six plans); the
two-sided shares keep layers 0, 1 (0.01734, the best of the six).

Why 32 samples: tiny-mixtral's layer shares differ by less than the noise of 8 x 256 probe
tokens (layer 0's kl: 0.0054 / 0.0061 / 0.0066 on 8 / 16 / 32 samples, the others 0.0055-0.0069).
With int4 symmetric scale signs chosen, 8 samples still picked a worse than average plan and 16 and 32
the best (benchmarks/RESULTS.md, bench_quality.py: the probe's sample count). The probe runs by default only below 2e9 routed-expert parameters
(plan.measurements.PROBE_MAX_EXPERT_PARAMS).

Why held out: GPTQ fits its Hessians' tokens. On tiny-mixtral (16 x 128 calibration tokens) GPTQ
int4 of layers 2 / 3 gave KL 0.0049 / 0.0040 on calibration tokens and 0.0119 / 0.0103 on
evaluation tokens, worse than RTN's 0.0108 / 0.0093 there; on held-out probe tokens 0.0115 /
0.0099, as on the evaluation tokens.

Probe format: the cheapest (fewest bits per weight, scales included) calibrated format with at
least 4 bits per weight that holds the layer's experts (else the cheapest one that does). The
scale is meant for the regime where the budget decisions of every target happen (4-bit vs
8-bit experts) and where KL and the predicted loss are both second order in the weight error;
a 2- or 3-bit probe perturbs tiny models so much that the KL leaves that regime.

Algorithm: the registered algorithm (moequant.algorithms.registry) the quantize pass will give the
probe format, as that algorithm's `probe` says (recipe `probe_algorithm: auto`: GPTQ with the
calibration Hessians where the recipe uses GPTQ, else RTN), or forced rtn / gptq; the same entry's
`quantize` rounds the probed layer and the quantize pass's experts.

Cost and memory: the layers are walked once with the original hidden states, the all-quantized
stream and two perturbed streams per probed layer, so each layer is materialised once (MoE
layers once more with their probed experts) and run on every live stream: O(L^2) layer forwards
on few tokens. When the streams would exceed `max_stream_bytes`, the probed layers are split into
chunks, one walk each.

probe.json (schema "moequant.calib.probe/1"), in the statistics directory:
{"schema", "samples": int, "tokens": int, "usage_floor": float, "algorithm": "rtn" | "gptq",
 "held_out": bool, "kl_all": float,
 "layers": {"L": {"format": key, "kl": float, "kl_alone": float, "kl_all_but_this": float,
                  "restore_gain": float, "predicted_loss": float, "scale": float | null,
                  "projections": {proj: {"kl_alone": float, "predicted_loss": float}}  (projections=True)
                  }}}
scale is null when the predicted loss is 0 (nothing to scale).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from moequant.measure.settings import HessianRule
from moequant.measure.stats import PROBE_SCHEMA, TENSOR_PROBE_SCHEMA, chosen_hessian, layer_file
from moequant.metrics import LOGIT_CHUNK_ELEMENTS, token_statistics

DEFAULT_USAGE_FLOOR = 0.05  # the recipe's default experts.usage_floor
PROJECTIONS = ("gate", "up", "down")
MAX_STREAM_BYTES = 2 * 2**30
# logits per block of the probes' KL on a CPU: 2 MiB float64 temporaries stay in the allocator's heap and the CPU's
# cache; token_statistics' 128 MiB blocks were fresh mappings (page faults: a fifth of the per-tensor probe's
# time was system time) streamed through memory by every elementwise pass (the KL's CPU time -35% on tiny-qwen2moe)
KL_BLOCK_ELEMENTS = 1 << 18


def probe_indices(num_samples: int, probe_samples: int) -> list[int]:
    """Evenly spaced sample indices (every domain of a mixed calibration set gets its share)."""
    k = min(num_samples, probe_samples)
    if k <= 0:
        return []
    if k == num_samples:
        return list(range(num_samples))
    return [round(i * (num_samples - 1) / (k - 1)) if k > 1 else 0 for i in range(k)]


def choose_probe_format(format_keys, shapes) -> str | None:
    """The cheapest format with >= 4 bits per weight that holds every shape (else the cheapest)."""
    from moequant import formats
    from moequant.errors import UserError

    fits = []
    for key in format_keys:
        spec = formats.parse_key(key)
        if not spec.quantized:
            continue
        try:
            bits = sum(formats.nbytes(spec, s) for s in shapes) * 8 / sum(math.prod(s) for s in shapes)
        except UserError:
            continue
        fits.append((bits, key))
    if not fits:
        return None
    at_least_4 = [f for f in fits if f[0] >= 4.0]
    return min(at_least_4 or fits)[1]


def predicted_layer_loss(
    sensitivity: dict,
    routed_count: torch.Tensor,
    tokens: int,
    top_k: int,
    key: str,
    usage_floor: float = DEFAULT_USAGE_FLOOR,
    projections=PROJECTIONS,
) -> float:
    """The policy's predicted loss of one layer with every routed expert in `key` (float64), of
    these projections."""
    counts = routed_count.double()
    usage = torch.clamp(counts / tokens, min=usage_floor * top_k / counts.numel())
    return float(sum((usage * sensitivity[p][key].double()).sum() for p in projections))


def _layer_sensitivity(stats_dir: Path, layer: int) -> tuple[dict, torch.Tensor]:
    """(sensitivity[proj][key], routing.count) of one layer, without reading its Hessians."""
    from safetensors import safe_open

    sens: dict = {}
    with safe_open(str(layer_file(stats_dir, layer)), "pt") as f:
        for name in f.keys():
            if name.startswith("sensitivity."):
                _, proj, key = name.split(".", 2)
                sens.setdefault(proj, {})[key] = f.get_tensor(name)
        count = f.get_tensor("routing.count")
    return sens, count


def shared_layers_refusal(runner) -> str:
    """Why the probe cannot run this model: every probed stream would write into the one container of keys and
    values the model's loop gives its layers per batch (Kolibri-1.1)."""
    return (
        f"the probe cannot run several streams of this {runner.adapter.model_type} model at once: its layers "
        "share keys and values through the model's own loop; set calibration.probe_samples: 0."
    )


def _head(runner, checkpoint):
    """Finished hidden states (LayerRunner.finish) -> logits through the model's lm_head (tied: the embedding)."""
    from moequant.errors import UserError
    from moequant.io.layers import make_head_real

    if runner.shared_between_layers:
        raise UserError(shared_layers_refusal(runner))
    head = make_head_real(runner.model, checkpoint, runner.adapter, runner.device, runner.dtype, copy_tied=True)
    if runner.final_norm is not None:  # the decoder's final norm beside the head, on the device
        runner.final_norm.to(runner.device)

    def logits(h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return head(h.to(runner.device))

    return logits


def _finished(runner, stream: list[torch.Tensor]) -> list[torch.Tensor]:
    """A stream's last-layer hidden states (per batch) through what the decoder does before the head."""
    with torch.no_grad():
        return [runner.finish(b, h) for b, h in enumerate(stream)]


def _kl_sums(runner, head, reference: list[torch.Tensor], streams: dict, advance=None) -> dict:
    """{key: summed KL(reference || stream)} over every token of each stream (per-batch hidden states, as the
    reference), in float64 from the change of the logits (equal to token_statistics' KL to float64 rounding).
    The reference's probabilities are computed once per block of positions for all streams, and each stream's
    logits once (per block): the per-tensor probe compares
    hundreds of streams with one reference, and recomputing the reference (and the top-1 agreement
    token_statistics also returns) for each took 96% of its time on a CPU (py-spy, gguf.yaml on tiny-qwen2moe).
    `advance`: called once per stream and batch (a progress bar's step), spread over the batch's blocks as they
    finish (a batch's blocks of hundreds of streams take tens of seconds on a CPU)."""
    totals = dict.fromkeys(streams, 0.0)
    for b, h_ref in enumerate(reference):
        with torch.no_grad():  # what the decoder does before the head, once per batch of each stream
            rows = runner.finish(b, h_ref).reshape(-1, h_ref.shape[-1])
            finished = {
                key: runner.finish(b, stream[b]).reshape(-1, h_ref.shape[-1]) for key, stream in streams.items()
            }
        z_one = head(rows[:1])
        # a GPU keeps token_statistics' large blocks (few kernel launches); a CPU small ones (its caches)
        step = max(1, (LOGIT_CHUNK_ELEMENTS if z_one.device.type == "cuda" else KL_BLOCK_ELEMENTS) // z_one.shape[-1])
        blocks, advanced = -(-rows.shape[0] // step), 0
        for j, s in enumerate(range(0, rows.shape[0], step)):
            z_ref = head(rows[s : s + step])
            p = torch.softmax(z_ref.double(), dim=-1)
            # tokens the original gives probability 0 (masked logits, -inf) add nothing, not NaN
            live = None if bool(torch.isfinite(z_ref).all()) else p > 0
            for key, rows_q in finished.items():
                # KL(p || q) = log sum_v p_v exp(d_v) - sum_v p_v d_v, d = z_q - z_ref (the logits' change): one
                # exp and one float64 temporary per logit and stream, the sums over the vocabulary as dot products
                # (a log-softmax per stream, the difference of log-probabilities and elementwise sums took most of
                # the per-tensor probe's CPU time)
                d = (head(rows_q[s : s + step]).to(z_ref.device) - z_ref).double()
                if live is not None:
                    d = torch.where(live, d, 0.0)
                mean = torch.linalg.vecdot(p, d)  # row-wise dot products: a third faster than bmm on a CPU
                kl = torch.linalg.vecdot(p, d.exp_()).log_() - mean
                totals[key] += kl.clamp_min(0).sum()  # a tensor: no wait for the device per block
            while advance is not None and advanced < len(streams) * (j + 1) // blocks:
                advance()
                advanced += 1
    return {key: float(total) for key, total in totals.items()}


def probe_algorithm_for(name: str, hessians: bool = True) -> str:
    """The registered algorithm the probe runs (one it runs itself, moequant.algorithms.registry); one
    that reads Hessians falls back to round-to-nearest without them."""
    from moequant.algorithms.registry import ALGORITHMS, probe_algorithms

    runs = probe_algorithms()
    if name not in runs:
        from moequant.errors import UserError

        raise UserError(f"probe algorithm {name!r} is not one the probe runs; accepted: {', '.join(runs)}.")
    return "rtn" if ALGORITHMS[name].hessians and not hessians else name


def auto_probe_algorithm(format_keys, shapes, algorithm_for) -> str:
    """`probe_algorithm: auto`: the registered algorithm that quantizes the probe format
    (`algorithm_for(format name)`: the recipe's choice or the family's default), as the probe measures
    it (its `probe`: GPTQ runs itself; AWQ and imatrix are measured with RTN)."""
    from moequant import formats
    from moequant.algorithms.registry import algorithm

    key = choose_probe_format(format_keys, shapes)
    if key is None:
        return "rtn"
    return algorithm(algorithm_for(formats.parse_key(key).name)).probe


def layer_hessians(stats_dir: Path, layer: int, proj: str, num_experts: int, rule: HessianRule) -> torch.Tensor:
    """[E, d, d]: `stats.chosen_hessian` of every expert, from the statistics when they were
    saved with their Hessians, else from calibration's scratch copy (`.work/hessians_LLL`)."""
    from safetensors import safe_open

    group = "down" if proj == "down" else "gate_up"
    path = layer_file(stats_dir, layer)
    scratch = Path(stats_dir) / ".work" / f"hessians_{layer:03d}.safetensors"
    keys = (f"hessian.{group}", f"hessian_routed.{group}")
    with safe_open(str(path), "pt") as f:
        stats = {k: f.get_tensor(k) for k in f.keys() if k in keys or k == f"input_routed.{group}.tokens"}
    if not all(k in stats for k in keys):
        with safe_open(str(scratch), "pt") as f:
            stats.update({k: f.get_tensor(k) for k in keys})
    return chosen_hessian(stats, group, torch.arange(num_experts), rule)[1]


def _probed_experts(
    adapter,
    checkpoint,
    layer: int,
    key: str,
    name: str,
    stats_dir: Path,
    rule: HessianRule,
    dtype,
    device,
    options: dict | None = None,
) -> dict[str, torch.Tensor]:
    """proj -> [E, out, in] dequantized weights of the layer's routed experts in `key`, rounded by the
    registered algorithm `name` with its `options` ({algorithm name: options}), as the quantize pass."""
    from moequant import formats
    from moequant.algorithms.registry import algorithm

    spec = formats.parse_key(key)
    algo = algorithm(name)
    out = {}
    # as the quantize pass: gate and up (one input) share one Hessian and one solve where the algorithm joins them
    shared = algo.joins_gate_up(spec) and {"gate", "up"} <= set(adapter.projections)
    jobs = [("gate", "up"), ("down",)] if shared else [(p,) for p in adapter.projections]
    for projs in jobs:
        W = [adapter.read_experts(checkpoint, layer, p).float() for p in projs]
        H = layer_hessians(stats_dir, layer, projs[0], adapter.num_experts, rule) if algo.hessians else None
        label = f"layer {layer} {'/'.join(projs)} experts"
        qs, _ = algo.quantize(W, spec, H, (options or {}).get(algo.name), device, label)
        for p, q in zip(projs, qs):
            out[p] = q.dequantize(torch.float32).to(dtype)
    return out


def run_probe(
    checkpoint,
    adapter,
    input_ids: torch.Tensor,
    stats_dir: str | Path,
    format_keys,
    top_k: int | None = None,
    batch_size: int = 8,
    device: str = "cpu",
    usage_floor: float = DEFAULT_USAGE_FLOOR,
    max_stream_bytes: int = MAX_STREAM_BYTES,
    algorithm: str = "rtn",
    hessians: bool = True,
    rule: HessianRule = HessianRule(),
    options: dict | None = None,
    projections: bool = False,
    progress: bool = False,
) -> dict:
    """Probe every MoE layer on `input_ids` [n, seq]; needs the layers' statistics files in
    `stats_dir` (sensitivities, routing counts). `algorithm`: a registered one the probe runs
    (`probe_algorithm_for`), with `options` ({algorithm name: options}, the recipe's sections).
    `projections`: also each projection alone.
    Returns probe.json's dict (not written)."""
    from moequant.io.layers import LayerRunner

    stats_dir = Path(stats_dir)
    top_k = top_k or adapter.top_k
    runner = LayerRunner(checkpoint, adapter, input_ids, batch_size=batch_size, device=device)
    head = _head(runner, checkpoint)
    shapes = [tuple(adapter.expert_shape(p)) for p in adapter.projections]
    probe_key = choose_probe_format(format_keys, shapes)
    moe = [L for L in adapter.moe_layers]
    layers_out: dict[str, dict] = {}
    tokens = int(input_ids.numel())
    if probe_key is None or not moe:
        return {
            "schema": PROBE_SCHEMA,
            "samples": int(input_ids.shape[0]),
            "tokens": tokens,
            "usage_floor": usage_floor,
            "algorithm": None,
            "layers": {},
        }
    algorithm = probe_algorithm_for(algorithm, hessians)
    quantized = lambda L: _probed_experts(
        adapter,
        checkpoint,
        L,
        probe_key,
        algorithm,
        stats_dir,
        rule,
        runner.dtype,
        device,
        options,
    )
    stream_bytes = tokens * adapter.hidden * torch.finfo(runner.dtype).bits // 8
    split = tuple(adapter.projections) if projections else ()
    # live streams: original, everything quantized, two (and one per split projection) of every
    # probed layer, two layer inputs
    per_walk = max(1, (int(max_stream_bytes // max(stream_bytes, 1)) - 4) // (2 + len(split)))
    chunks = [moe[i : i + per_walk] for i in range(0, len(moe), per_walk)]
    kl_alone: dict = {}  # probed layer, or (layer, projection) -> summed KL
    kl_restored: dict[int, float] = {}
    from moequant.progress import StepProgress

    batches = len(runner.embedded)
    steps = sum(_walk_steps(adapter.num_layers, chunk, set(moe), split, batches) for chunk in chunks)
    bar = StepProgress("probing layers", steps, progress)
    for chunk in chunks:
        alone, restored, kl_everything = _walk(runner, adapter, head, chunk, set(moe), quantized, split, bar)
        kl_alone.update(alone)
        kl_restored.update(restored)
    bar.close()
    kl_all = kl_everything / tokens
    for L in moe:
        sens, count = _layer_sensitivity(stats_dir, L)
        layer_tokens = int(count.sum()) // top_k
        predicted = predicted_layer_loss(sens, count, layer_tokens, top_k, probe_key, usage_floor)
        alone_kl, restored_kl = kl_alone[L] / tokens, kl_restored[L] / tokens
        gain = kl_all - restored_kl
        kl = (alone_kl + max(gain, 0.0)) / 2
        layers_out[str(L)] = {
            "format": probe_key,
            "kl": kl,
            "kl_alone": alone_kl,
            "kl_all_but_this": restored_kl,
            "restore_gain": gain,
            "predicted_loss": predicted,
            "scale": kl / predicted if predicted > 0 else None,
        }
        if split:
            layers_out[str(L)]["projections"] = {
                p: {
                    "kl_alone": kl_alone[(L, p)] / tokens,
                    "predicted_loss": predicted_layer_loss(
                        sens, count, layer_tokens, top_k, probe_key, usage_floor, (p,)
                    ),
                }
                for p in split
            }
    return {
        "schema": PROBE_SCHEMA,
        "samples": int(input_ids.shape[0]),
        "tokens": tokens,
        "usage_floor": usage_floor,
        "algorithm": algorithm,
        "kl_all": kl_all,
        "layers": layers_out,
    }


def _walk_steps(num_layers: int, probed_layers: list[int], moe_layers: set[int], split: tuple, batches: int) -> int:
    """The steps `_walk` advances its bar by: each stream's forward through a layer, each MoE layer's quantization,
    each stream's KL per batch (the walk's streams counted as it makes them)."""
    steps = alone = restored = 0
    for L in range(num_layers):
        steps += 1 + alone  # original, the alone streams
        if L in moe_layers:
            probed = L in probed_layers
            restored += probed
            steps += probed + 1 + 1 + restored - probed  # restored[L]; quantize; everything; the other restored
            steps += probed * (1 + len(split))  # alone[L], alone[(L, p)]
            alone += probed * (1 + len(split))
        else:
            steps += 1 + restored  # everything, the restored streams
    return steps + batches * (alone + restored + 1)


def _walk(
    runner, adapter, head, probed_layers: list[int], moe_layers: set[int], quantized, split: tuple, bar
) -> tuple[dict, dict[int, float], float]:
    """One walk over the decoder layers with these streams (per-batch hidden states):
    original (no layer quantized), everything (every MoE layer's experts quantized), and for every
    probed layer P: alone[P] (only P quantized; branches off the original at P), alone[(P, p)] for
    each projection p in `split` (only P's p quantized) and restored[P] (every MoE layer but P
    quantized; branches off `everything` at P).
    Returns the summed KL against the original of every alone and restored stream, and of
    everything. `bar` (moequant.progress.StepProgress) advances by `_walk_steps`."""
    original = everything = runner.embedded
    alone: dict[int, list[torch.Tensor]] = {}
    restored: dict[int, list[torch.Tensor]] = {}

    def run(module, h):
        out = _forward(runner, module, L, h)
        bar.advance()
        return out

    for L in range(adapter.num_layers):
        before, everything_before = original, everything
        with runner.materialized(L) as module:
            original = run(module, original)
            for P in alone:
                alone[P] = run(module, alone[P])
            if L in moe_layers:
                if L in probed_layers:
                    restored[L] = run(module, everything_before)
            else:  # nothing quantized here: every stream takes the original layer
                everything = run(module, everything)
                for P in restored:
                    restored[P] = run(module, restored[P])
        if L in moe_layers:
            experts = quantized(L)
            bar.advance()
            with runner.materialized(L, experts=experts) as module:
                if L in probed_layers:
                    alone[L] = run(module, before)
                everything = run(module, everything_before)
                for P in restored:
                    if P != L:
                        restored[P] = run(module, restored[P])
            for p in split if L in probed_layers else ():
                with runner.materialized(L, experts={p: experts[p]}) as module:
                    alone[(L, p)] = run(module, before)
            del experts
    kl = _kl_sums(
        runner,
        head,
        original,
        {
            **{("alone", P): h for P, h in alone.items()},
            **{("restored", P): h for P, h in restored.items()},
            "everything": everything,
        },
        bar.advance,
    )
    return (
        {P: kl[("alone", P)] for P in alone},
        {P: kl[("restored", P)] for P in restored},
        kl["everything"],
    )


def _forward(runner, module, layer: int, hidden: list[torch.Tensor]) -> list[torch.Tensor]:
    """One materialised layer over every batch of a stream (the runner's captured layer inputs).

    Not `runner.forward`: that one is the calibration pass's per-layer step, which resume and
    its tests count; the probe's O(L^2) stream forwards are a separate phase."""
    out = []
    with torch.no_grad():
        for b, h in enumerate(hidden):
            out.append(runner.run(module, layer, b, h).detach().to("cpu"))
    return out


# ------------------------------------------------------------------------------- per-tensor probe
#
# The per-tensor probe measures what one non-expert weight (attention, shared expert, dense MLP,
# lm_head) costs in each candidate format: KL(original || only that tensor quantized, round to
# nearest as the quantize pass does), on the probe samples. The policy takes these measured KLs as
# the losses of a per-tensor choice (recipe `non_experts.formats`), solved together with the routed
# experts under one byte budget. On tiny-mixtral (16 x 256 evaluation tokens, routed experts as
# the budget chose them) attn_v in q5_0 instead of q8_0 added 0.0061 to a KL of 0.0327, attn_k
# 0.0007, while attn_q in q4_k instead of q5_0 added 0.0013: a fixed format for all attention
# tensors spends its bytes in the wrong places.
#
# tensor_probe.json (schema "moequant.tensor_probe/1"), in the statistics directory:
# {"schema", "samples": int, "tokens": int, "formats": [key], "tensors": {name: {key: kl}}}

TENSOR_ROLES = ("attention", "shared_expert", "dense_mlp", "lm_head")


def _layer_with(runner, layer: int, state: dict, keys: dict, name: str, value: torch.Tensor) -> dict:
    """The entries of decoder layer `layer`'s state dict that differ from `state` once on-disk tensor `name` is
    `value`; which entries one tensor reaches (one, or a slice of a joined parameter) is found on its first call
    and kept in `keys`."""
    device = runner.device if runner.device.type == "cuda" else None
    if name not in keys:
        whole = runner.read_layer(layer, tensors={name: value})
        keys[name] = [k for k, v in whole.items() if not torch.equal(v, state[k])]
        return {k: whole[k].to(runner.device) for k in keys[name]}
    new = runner.adapter.layer_state_dict(
        runner.checkpoint, layer, keys[name], runner.dtype, tensors={name: value}, device=device
    )
    return {k: v.to(runner.device) for k, v in new.items()}


def probed_tensors(checkpoint, adapter) -> list[str]:
    """The 2-D non-expert weights a per-tensor plan may quantize."""
    return [
        n
        for n in checkpoint.keys()
        if adapter.classify(n).role in TENSOR_ROLES and n.endswith("weight") and len(checkpoint.shape(n)) == 2
    ]


def run_tensor_probe(
    checkpoint,
    adapter,
    input_ids: torch.Tensor,
    format_keys,
    batch_size: int = 8,
    device: str = "cpu",
    max_stream_bytes: int = MAX_STREAM_BYTES,
    progress: bool = False,
) -> dict:
    """tensor_probe.json's dict: the KL of every probed tensor alone in every format that holds it.
    progress: a bar with the time left, one step per stream's forward through a layer and per stream's KL of
    a batch (minutes on a CPU for GGUF's types; in a log, a line at least every 10 s)."""
    from moequant import formats
    from moequant.errors import UserError
    from moequant.io.layers import LayerRunner
    from moequant.progress import StepProgress

    runner = LayerRunner(checkpoint, adapter, input_ids, batch_size=batch_size, device=device)
    head = _head(runner, checkpoint)
    tokens = int(input_ids.numel())
    units = []  # (tensor, format key, layer or None for lm_head)
    for name in probed_tensors(checkpoint, adapter):
        for key in format_keys:
            spec = formats.parse_key(key)
            try:
                formats.check_shape(spec, tuple(checkpoint.shape(name)), name)
            except UserError:
                continue  # the format cannot hold it: the policy does not offer it either
            units.append((name, key, adapter.classify(name).layer))

    def dequantized(name, key):
        q = formats.quantize(checkpoint.get(name).float(), formats.parse_key(key), name=name)
        return q.dequantize(torch.float32).to(runner.dtype)

    stream_bytes = tokens * adapter.hidden * torch.finfo(runner.dtype).bits // 8
    per_walk = max(1, int(max_stream_bytes // max(stream_bytes, 1)) - 2)
    layered = [u for u in units if u[2] is not None]
    result: dict[str, dict[str, float]] = {}
    heads = [u for u in units if u[2] is None]
    walks = range(0, len(layered), per_walk)
    n, batches = adapter.num_layers, len(runner.embedded)
    # steps: every stream's forward through a layer, every stream's KL per batch, every lm_head format
    steps = len(walks) * n + sum(n - u[2] + batches for u in layered) + (n + len(heads) if heads else 0)
    bar = StepProgress(f"probing {len(units)} tensor formats", steps, progress)
    for start in walks:  # one walk per chunk of streams
        chunk = layered[start : start + per_walk]
        original, streams = runner.embedded, {}
        for L in range(n):
            before = original
            state = runner.read_layer(L)
            with runner.materialized(L, state=dict(state)) as module:
                original = _forward(runner, module, L, original)
                bar.advance()
                for u in streams:
                    streams[u] = _forward(runner, module, L, streams[u])
                    bar.advance()
                keys: dict[str, list[str]] = {}  # tensor -> the layer's in-memory keys it changes
                for u in (u for u in chunk if u[2] == L):
                    # the layer stays materialised: only what the quantized tensor changes is swapped in and
                    # back (reading and loading the whole layer per probed format was a tenth of the probe)
                    changed = _layer_with(runner, L, state, keys, u[0], dequantized(u[0], u[1]))
                    module.load_state_dict(changed, strict=False, assign=True)
                    streams[u] = _forward(runner, module, L, before)
                    module.load_state_dict({k: state[k] for k in changed}, strict=False, assign=True)
                    bar.advance()
            del state
        for (name, key, _), kl in _kl_sums(runner, head, original, streams, bar.advance).items():
            result.setdefault(name, {})[key] = kl / tokens
    if heads:  # lm_head: the final hidden states, logits through the quantized copy
        final = runner.embedded
        for L in range(n):
            with runner.materialized(L) as module:
                final = _forward(runner, module, L, final)
            bar.advance()
        final = _finished(runner, final)
        for name, key, _ in heads:
            weight = runner.model.lm_head.weight
            with torch.no_grad():
                saved = weight.detach().clone()
                weight.copy_(dequantized(name, key))
                logits_q = [head(h) for h in final]
                weight.copy_(saved)
            total = 0.0
            for h, q in zip(final, logits_q):
                ref = head(h)
                kl, *_ = token_statistics(ref.reshape(-1, ref.shape[-1]), q.reshape(-1, q.shape[-1]))
                total += float(kl.sum())
            result.setdefault(name, {})[key] = total / tokens
            bar.advance()
    bar.close()
    return {
        "schema": TENSOR_PROBE_SCHEMA,
        "samples": int(input_ids.shape[0]),
        "tokens": tokens,
        "formats": list(format_keys),
        "tensors": result,
    }
