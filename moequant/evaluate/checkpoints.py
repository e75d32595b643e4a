"""`moequant eval`: a quantized checkpoint against its original, read by moequant (streamed) or, for what only
transformers reads, loaded whole; `load_quantized`, the text `moequant eval` prints, and lm-eval scores."""

from __future__ import annotations

import torch

from moequant.errors import UserError
from moequant.evaluate.compare import evaluate, evaluate_streaming


def _is_moequant_checkpoint(directory) -> bool:
    from pathlib import Path

    from moequant.io.checkpoint import EXPORT_INFO

    return (Path(directory) / EXPORT_INFO).exists()


def load_quantized(path, dtype=None, device: str = "cpu"):
    """A quantized checkpoint as a dense transformers model: moequant's loader first (any checkpoint
    moequant wrote, and the compressed-tensors / GPTQ / AWQ / FP8 / MXFP4 layouts it reads), else
    transformers' own loading (e.g. an llm-compressor checkpoint with `Linear` targets, decompressed)."""
    from moequant.io.checkpoint import resolve_model_path

    directory = resolve_model_path(path)  # not opened here: a format moequant cannot read goes to transformers
    directory = directory if directory.is_dir() else directory.parent
    try:
        from moequant.io.loader import load
    except ImportError:  # pragma: no cover - the loader is part of the package
        load = None
    first_error = None
    if load is not None:
        try:
            return load(directory, dtype=dtype, device=device)
        except UserError as e:
            if _is_moequant_checkpoint(directory):
                raise  # moequant wrote it: its loader's word is final
            first_error = e
    from moequant.io.loader import from_pretrained_complete

    try:
        model = from_pretrained_complete(directory, dtype or "auto").to(device)
    except UserError:
        raise
    except Exception as e:
        raise UserError(
            f"cannot load {path} as a quantized model: moequant's loader said "
            f'"{first_error}" and transformers failed with {type(e).__name__}: {e}'
        ) from None
    return model.eval()


def evaluate_checkpoints(
    checkpoint,
    reference,
    dataset: str = "builtin:mix",
    samples: int = 64,
    seq_len: int = 512,
    seed: int = 0,
    batch_size: int = 4,
    device: str | None = None,
    dtype=None,
    lm_eval_tasks: list[str] | None = None,
    progress: bool = True,
) -> dict:
    """`moequant eval CHECKPOINT --reference ORIGINAL`: evaluate on the evaluation split of `dataset`
    (tokenised with the reference's tokenizer). Returns evaluate()'s dict plus `checkpoint`,
    `reference`, `dataset`, `seq_len`, `seed` and, when asked, `lm_eval`.

    Streamed (evaluate_streaming: neither model is loaded whole) whenever moequant reads the
    checkpoint; whole models only for lm-eval tasks, or for a checkpoint only transformers reads.
    A quantized reference (an FP8 / INT4 / MXFP4 source) is its dequantized weights. dtype:
    the compute dtype, by default the reference's config dtype (bf16 for most models)."""
    from moequant.io.checkpoint import model_dtype, open_checkpoint
    from moequant.io.fingerprint import check_checkpoint_in_run
    from moequant.measure.data import load_samples

    check_checkpoint_in_run(checkpoint)  # OUTPUT/checkpoint swapped in from another run: say so, evaluate nothing
    if lm_eval_tasks:
        _require_lm_eval()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    ref_ckpt = open_checkpoint(reference)
    tokenizer = ref_ckpt.tokenizer
    windows = load_samples(dataset, tokenizer, samples, seq_len, split="evaluation", seed=seed)
    q_ckpt = None if lm_eval_tasks else _readable(checkpoint)
    if q_ckpt is not None:
        result = evaluate_streaming(
            ref_ckpt,
            q_ckpt,
            windows,
            batch_size=batch_size,
            device=device,
            dtype=dtype or model_dtype(ref_ckpt.config),
            progress=progress,
        )
    else:
        ref_model = _load_reference(ref_ckpt, dtype, device)
        q_model = load_quantized(checkpoint, dtype=dtype, device=device)
        result = evaluate(ref_model, q_model, windows, batch_size=batch_size, progress=progress)
    result.update(
        {
            "checkpoint": str(checkpoint),
            "reference": str(reference),
            "dataset": dataset,
            "seq_len": seq_len,
            "seed": seed,
        }
    )
    if lm_eval_tasks:
        result["lm_eval"] = {
            "original": run_lm_eval(ref_model, tokenizer, lm_eval_tasks, batch_size),
            "quantized": run_lm_eval(q_model, tokenizer, lm_eval_tasks, batch_size),
        }
    return result


def _readable(checkpoint):
    """The checkpoint opened through moequant's reader, or None when only transformers might read it
    (a format moequant does not read, in a checkpoint moequant did not write)."""
    from moequant.io.checkpoint import open_checkpoint, resolve_model_path
    from moequant.io.loader import gguf_export_file

    if gguf_export_file(checkpoint) is not None:  # a GGUF export: moequant.load reads it whole (gguf-py)
        return None
    try:
        return open_checkpoint(checkpoint)
    except UserError:
        directory = resolve_model_path(checkpoint)
        if _is_moequant_checkpoint(directory if directory.is_dir() else directory.parent):
            raise
        return None


def _load_reference(ref_ckpt, dtype, device):
    from moequant.io.loader import from_pretrained_complete, load

    if ref_ckpt.encodings:  # a quantized source: the reference is its dequantized weights
        return load(ref_ckpt.directory, dtype=dtype, device=device)
    return from_pretrained_complete(ref_ckpt.directory, dtype or "auto").to(device).eval()


def format_quality(q: dict) -> str:
    """Human-readable text of evaluate()'s dict (what `moequant eval` prints)."""
    lines = [
        f"{q['samples']} samples, {q['tokens']} tokens"
        + (f" of {q['dataset']} (evaluation split)" if q.get("dataset") else ""),
        f"perplexity        {q['ppl_original']:.4f} -> {q['ppl_quantized']:.4f}"
        f" ({100 * (q['ppl_quantized'] / q['ppl_original'] - 1):+.2f}%)",
        f"KL per token      mean {q['kl_mean']:.4g}  p90 {q['kl_p90']:.4g}  p99 {q['kl_p99']:.4g}  max {q['kl_max']:.4g}",
        f"top-1 agreement   {q['top1_agreement']:.4f}",
        f"routing agreement {q['routing_agreement']:.4f} (mean over MoE layers; lowest "
        + (f"{min(r['routing_agreement'] for r in q['layers']):.4f}" if q["layers"] else "-")
        + ")",
        f"MoE-block error   {q['moe_output_error']:.4g} on the reference input, "
        f"{q['moe_output_error_accumulated']:.4g} on its own",
    ]
    for d, v in q.get("by_domain", {}).items():
        lines.append(
            f"  {d:<14} ppl {v['ppl_original']:.3f} -> {v['ppl_quantized']:.3f}  KL {v['kl_mean']:.4g}"
            f"  top-1 {v['top1_agreement']:.4f}  routing {v['routing_agreement']:.4f}"
        )
    for name, scores in (q.get("lm_eval") or {}).items():
        lines.append(f"lm-eval {name}: " + ", ".join(f"{t} {s}" for t, s in scores.items()))
    return "\n".join(lines)


def _require_lm_eval():
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(
            "lm-eval tasks were asked for but lm_eval is not installed; install lm-eval "
            "(pip install lm-eval) in the environment that runs moequant, or leave out the tasks."
        ) from None


def run_lm_eval(model, tokenizer, tasks: list[str], batch_size: int = 4) -> dict:
    """Scores of lm-eval `tasks` for an already-loaded model (only when lm_eval is importable)."""
    _require_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    out = simple_evaluate(model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size), tasks=list(tasks))
    return {
        task: {k: v for k, v in scores.items() if isinstance(v, (int, float))}
        for task, scores in out["results"].items()
    }
