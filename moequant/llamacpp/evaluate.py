"""A GGUF export scored in llama.cpp: its KL, top-1 agreement and perplexity against the original model in
transformers, on the evaluation split (apply's evaluation when the export is GGUF)."""

from __future__ import annotations

import numpy as np

from moequant.llamacpp.runner import logits


def evaluate_gguf(
    gguf_path,
    reference,
    dataset: str = "builtin:mix",
    samples: int = 32,
    seq_len: int = 256,
    seed: int = 0,
    progress: bool = False,
) -> dict:
    """KL / top-1 / perplexity of llama.cpp running `gguf_path` against transformers running the
    reference (float32), on the evaluation split of `dataset` (evaluate()'s keys, engine llama.cpp).
    progress: a bar with the time left over the reference's windows, then a line for llama.cpp's run."""
    import torch

    from moequant.io.checkpoint import load_tokenizer, open_checkpoint
    from moequant.io.loader import from_pretrained_complete
    from moequant.measure.data import load_samples
    from moequant.progress import StepProgress

    ref_dir = open_checkpoint(reference).directory
    windows = load_samples(dataset, load_tokenizer(ref_dir), samples, seq_len, split="evaluation", seed=seed)
    ids = [w.input_ids.tolist() for w in windows]
    model = from_pretrained_complete(ref_dir, torch.float32).eval()
    bar = StepProgress("evaluating: the original (transformers)", len(ids), progress)
    ref = []
    with torch.no_grad():
        for s in ids:
            ref.append(model(torch.tensor([s])).logits[0].numpy())
            bar.advance()
    bar.close()
    if progress:
        print(f"evaluating: the GGUF in llama.cpp ({len(ids)} windows, in a worker process)")
    got = logits([gguf_path], ids)[0]
    kl = np.concatenate([kl_per_token(r, g) for r, g in zip(ref, got)])

    def nll(all_logits):
        total = 0.0
        for lg, s in zip(all_logits, ids):
            x = lg[:-1].astype(np.float64)
            x = x - x.max(-1, keepdims=True)
            lp = x - np.log(np.exp(x).sum(-1, keepdims=True))
            total -= lp[np.arange(len(s) - 1), s[1:]].sum()
        return total / sum(len(s) - 1 for s in ids)

    top1 = np.concatenate([r.argmax(-1) == g.argmax(-1) for r, g in zip(ref, got)])
    n_ref, n_q = nll(ref), nll(got)
    return {
        "engine": "llama.cpp",
        "samples": len(ids),
        "tokens": int(kl.size),
        "ppl_original": float(np.exp(n_ref)),
        "ppl_quantized": float(np.exp(n_q)),
        "nll_original": float(n_ref),
        "nll_quantized": float(n_q),
        "kl_mean": float(kl.mean()),
        "kl_p90": float(np.quantile(kl, 0.9)),
        "kl_p99": float(np.quantile(kl, 0.99)),
        "kl_max": float(kl.max()),
        "top1_agreement": float(top1.mean()),
        "checkpoint": str(gguf_path),
        "reference": str(reference),
        "dataset": dataset,
        "seq_len": seq_len,
        "seed": seed,
    }


def kl_per_token(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(ref || other) per position, log-softmax in float64."""

    def logsm(x):
        x = x.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = logsm(ref_logits), logsm(logits)
    return (np.exp(lp) * (lp - lq)).sum(-1)
