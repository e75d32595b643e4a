"""moequant.evaluate against independent float64 computations on tiny random MoE models."""

from __future__ import annotations

import copy
import json
import math
import shutil
import string
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny import build_tiny

from moequant.arch import adapter_for
from moequant.errors import UserError
from moequant.evaluate import evaluate, evaluate_checkpoints, format_quality, load_quantized
from moequant.metrics import token_statistics


def _load(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    return build_tiny("mixtral", tmp_path_factory.mktemp("mixtral") / "model")


@pytest.fixture(scope="module")
def sharp_reference(mixtral_dir):
    """A tiny Mixtral whose next-token distributions are far from uniform (so KL is not ~0)."""
    model = _load(mixtral_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    return model


def _perturbed(model, fn):
    other = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        fn(other)
    return other


def _samples(lengths_domains, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [SimpleNamespace(input_ids=torch.randint(0, 96, (n,), generator=g), domain=d) for n, d in lengths_domains]


def _block_inputs(model, layers, ids):
    """Each MoE block's input for a batch, via plain forward pre-hooks (test-side capture)."""
    seen = {}
    handles = [
        model.model.layers[L].mlp.register_forward_pre_hook(
            lambda m, args, L=L: seen.__setitem__(L, args[0].detach().reshape(-1, args[0].shape[-1]))
        )
        for L in layers
    ]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()
    return seen


def _topk_sets(x, router_weight, k):
    """Top-k expert ids from router logits computed by hand (softmax is monotonic)."""
    logits = x.double() @ router_weight.double().t()
    return logits.topk(k, dim=-1).indices.sort(-1).values


def test_perplexity_kl_top1_match_float64_reference(sharp_reference):
    ref = sharp_reference
    q = _perturbed(
        ref, lambda m: [p.add_(torch.randn_like(p) * 0.05) for n, p in m.named_parameters() if "experts" in n]
    )
    samples = _samples([(12, "code"), (12, "prose"), (12, "code"), (9, "prose"), (12, "code"), (9, "code")])
    got = evaluate(ref, q, samples, batch_size=2)

    # the reference computation: one window at a time, float64 log-softmax written out
    nll_r, nll_q, kls, top1 = [], [], [], []
    per_dom = {}
    with torch.no_grad():
        for s in samples:
            a = ref(input_ids=s.input_ids[None]).logits[0].double()
            b = q(input_ids=s.input_ids[None]).logits[0].double()
            lp = a - torch.logsumexp(a, -1, keepdim=True)
            lq = b - torch.logsumexp(b, -1, keepdim=True)
            tgt = s.input_ids[1:]
            r_nll = (-lp[:-1].gather(1, tgt[:, None])[:, 0]).tolist()
            q_nll = (-lq[:-1].gather(1, tgt[:, None])[:, 0]).tolist()
            kl = (lp.exp() * (lp - lq)).sum(-1).tolist()
            t1 = (a.argmax(-1) == b.argmax(-1)).tolist()
            nll_r += r_nll
            nll_q += q_nll
            kls += kl
            top1 += t1
            d = per_dom.setdefault(s.domain, {"r": [], "q": [], "kl": [], "t1": []})
            d["r"] += r_nll
            d["q"] += q_nll
            d["kl"] += kl
            d["t1"] += t1

    assert got["tokens"] == len(kls) == sum(len(s.input_ids) for s in samples)
    assert got["ppl_original"] == pytest.approx(math.exp(np.mean(nll_r)), rel=1e-6)
    assert got["ppl_quantized"] == pytest.approx(math.exp(np.mean(nll_q)), rel=1e-6)
    assert got["kl_mean"] == pytest.approx(np.mean(kls), rel=1e-4)
    assert got["kl_p90"] == pytest.approx(np.quantile(kls, 0.9), rel=1e-4)
    assert got["kl_p99"] == pytest.approx(np.quantile(kls, 0.99), rel=1e-4)
    assert got["kl_max"] == pytest.approx(max(kls), rel=1e-4)
    assert got["top1_agreement"] == pytest.approx(np.mean(top1))
    assert 0.01 < got["kl_mean"] and got["top1_agreement"] < 1  # the comparison is not trivial
    assert sorted(got["by_domain"]) == ["code", "prose"]
    for dom, d in per_dom.items():
        g = got["by_domain"][dom]
        assert g["tokens"] == len(d["kl"])
        assert g["ppl_original"] == pytest.approx(math.exp(np.mean(d["r"])), rel=1e-6)
        assert g["ppl_quantized"] == pytest.approx(math.exp(np.mean(d["q"])), rel=1e-6)
        assert g["kl_mean"] == pytest.approx(np.mean(d["kl"]), rel=1e-4)
        assert g["top1_agreement"] == pytest.approx(np.mean(d["t1"]))
    json.dumps(got)  # plain data


def test_model_against_itself_agrees_perfectly(sharp_reference):
    same = copy.deepcopy(sharp_reference)
    ids = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(3))
    got = evaluate(sharp_reference, same, ids, batch_size=2)
    assert got["kl_mean"] == 0.0 and got["kl_p99"] == 0.0
    assert got["top1_agreement"] == 1.0
    assert got["ppl_original"] == got["ppl_quantized"]
    assert got["routing_agreement"] == 1.0
    assert [r["routing_agreement"] for r in got["layers"]] == [1.0, 1.0, 1.0]
    assert all(r["moe_output_error"] == 0.0 and r["moe_output_error_accumulated"] == 0.0 for r in got["layers"])
    assert all(r["error"] in (0.0, None) for r in got["experts"])
    assert got["by_domain"] == {}


def test_perturbed_router_lowers_routing_agreement_of_its_layer_only(sharp_reference):
    ref = sharp_reference
    q = _perturbed(
        ref, lambda m: m.model.layers[1].mlp.gate.weight.add_(torch.randn_like(m.model.layers[1].mlp.gate.weight))
    )
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(4))
    got = evaluate(ref, q, ids, batch_size=3)
    by_layer = {r["layer"]: r for r in got["layers"]}
    assert by_layer[0]["routing_agreement"] == 1.0  # nothing before layer 1's router differs
    assert by_layer[1]["routing_agreement"] < 1.0
    assert got["routing_agreement"] < 1.0

    # layer 1 by hand: top-k sets from each model's own block input and router weight
    x_ref = _block_inputs(ref, [1], ids)[1]
    x_q = _block_inputs(q, [1], ids)[1]
    k = ref.config.num_experts_per_tok
    same = (
        _topk_sets(x_ref, ref.model.layers[1].mlp.gate.weight, k)
        == _topk_sets(x_q, q.model.layers[1].mlp.gate.weight, k)
    ).all(-1)
    assert by_layer[1]["routing_agreement"] == pytest.approx(same.double().mean().item())
    # the router is not part of the block's input: layer 0's block is untouched
    assert by_layer[0]["moe_output_error"] == 0.0


@pytest.mark.parametrize("grouped", [False, True])
def test_perturbed_expert_shows_in_its_row_and_block_errors(sharp_reference, grouped):
    ref = sharp_reference
    E, k = ref.config.num_local_experts, ref.config.num_experts_per_tok

    def bump(m):
        w = m.model.layers[0].mlp.experts.gate_up_proj
        w[2].add_(torch.randn_like(w[2]) * 0.05)

    q = _perturbed(ref, bump)
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(5))
    got = evaluate(ref, q, ids, batch_size=4, grouped=grouped)
    rows = {(r["layer"], r["expert"]): r for r in got["experts"]}
    assert len(rows) == 3 * E
    assert rows[(0, 2)]["error"] > 0
    assert all(r["error"] in (0.0, None) for key, r in rows.items() if key != (0, 2))
    for L in (0, 1, 2):
        layer_rows = [rows[(L, e)] for e in range(E)]
        assert sum(r["tokens"] for r in layer_rows) == ids.numel() * k
        assert sum(r["share"] for r in layer_rows) == pytest.approx(1.0)
    by_layer = {r["layer"]: r for r in got["layers"]}
    # layer 0 sees the same input in both models; later layers' blocks are unchanged on the reference input
    assert by_layer[0]["moe_output_error"] > 0
    assert by_layer[0]["moe_output_error"] == pytest.approx(by_layer[0]["moe_output_error_accumulated"], rel=1e-9)
    assert by_layer[1]["moe_output_error"] == 0.0 and by_layer[2]["moe_output_error"] == 0.0
    assert by_layer[1]["moe_output_error_accumulated"] > 0

    # expert (0, 2)'s relative error by hand, on the tokens the reference router sends to it
    x = _block_inputs(ref, [0], ids)[0].double()
    routed = (_topk_sets(x, ref.model.layers[0].mlp.gate.weight, k) == 2).any(-1)
    assert rows[(0, 2)]["tokens"] == int(routed.sum())
    I = ref.config.intermediate_size

    def expert_out(model):
        ex = model.model.layers[0].mlp.experts
        gu, down = ex.gate_up_proj[2].double(), ex.down_proj[2].double()
        g, u = x[routed] @ gu[:I].t(), x[routed] @ gu[I:].t()
        return (torch.nn.functional.silu(g) * u) @ down.t()

    y_ref, y_q = expert_out(ref), expert_out(q)
    expected = ((y_q - y_ref).norm() / y_ref.norm()).item()
    assert rows[(0, 2)]["error"] == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_grouped_expert_errors_equal_the_per_expert_loop_and_transformers_experts(tmp_path, model_type):
    """expert_output_errors grouped (every token-expert pair through the experts module at once) and one
    expert at a time both give the sums of transformers' experts module run on one expert's tokens at a
    time. Skewed routing: a hot expert, one that gets no token, tokens whose k choices are in any order;
    gpt-oss has expert biases and interleaved gate/up."""
    from moequant.evaluate import expert_output_errors

    ref = _load(build_tiny(model_type, tmp_path / "m"))
    q = _perturbed(
        ref, lambda m: [p.add_(torch.randn_like(p) * 0.05) for n, p in m.named_parameters() if "experts." in n]
    )
    ad = adapter_for(ref.config.to_dict())
    L, E, k = ad.moe_layers[0], ad.num_experts, ad.top_k
    g = torch.Generator().manual_seed(8)
    x = torch.randn(30, ad.hidden, generator=g)
    xq = x + 0.01 * torch.randn(x.shape, generator=g)  # the quantized block's own norm may change its input
    scores = torch.randn(30, E, generator=g)
    scores[:, 0] += 3  # expert 0 is hot
    scores[:, E - 1] = float("-inf")  # expert E-1 gets no token
    r_idx = scores.topk(k, dim=-1).indices.flip(-1)

    def by_transformers(model, inputs):  # expert e alone on its tokens: top-1 index e, weight 1
        experts = model.model.layers[L].mlp.experts
        outs = {}
        for e in range(E):
            tok = (r_idx == e).any(-1)
            n = int(tok.sum())
            outs[e] = experts(inputs[tok], torch.full((n, 1), e), torch.ones(n, 1)).double()
        return outs

    with torch.no_grad():
        y_ref, y_q = by_transformers(ref, x), by_transformers(q, xq)
        expected_err = torch.tensor([float(((y_q[e] - y_ref[e]) ** 2).sum()) for e in range(E)], dtype=torch.float64)
        expected_ref = torch.tensor([float((y_ref[e] ** 2).sum()) for e in range(E)], dtype=torch.float64)
        ref_experts, q_experts = ad.experts_module(ref, L), ad.experts_module(q, L)
        for grouped in (True, False):
            err, ref_sq = expert_output_errors(ad, ref_experts, q_experts, x, xq, r_idx, grouped)
            assert err.dtype == ref_sq.dtype == torch.float64 and err.shape == (E,)
            assert err[E - 1] == 0 and ref_sq[E - 1] == 0 and (err[: E - 1] > 0).all()
            assert torch.allclose(err, expected_err, rtol=1e-5, atol=0), (grouped, err, expected_err)
            assert torch.allclose(ref_sq, expected_ref, rtol=1e-5, atol=0), (grouped, ref_sq, expected_ref)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_other_architectures(tmp_path, model_type):
    ref = _load(build_tiny(model_type, tmp_path / "m"))
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(6))
    same = evaluate(ref, copy.deepcopy(ref), ids)
    assert same["kl_mean"] == 0.0 and same["routing_agreement"] == 1.0 and same["moe_output_error"] == 0.0
    q = _perturbed(
        ref, lambda m: [p.add_(torch.randn_like(p) * 0.05) for n, p in m.named_parameters() if "experts." in n]
    )
    got = evaluate(ref, q, ids)
    assert got["kl_mean"] > 0 and got["moe_output_error"] > 0
    assert any(r["error"] for r in got["experts"])
    assert len(got["layers"]) == len({r["layer"] for r in got["experts"]})


def test_bad_inputs(sharp_reference, tmp_path):
    ids = torch.randint(0, 96, (2, 8))
    with pytest.raises(UserError, match="batch_size"):
        evaluate(sharp_reference, sharp_reference, ids, batch_size=0)
    with pytest.raises(UserError, match="at least 2"):
        evaluate(sharp_reference, sharp_reference, [torch.tensor([5])])
    other = _load(build_tiny("qwen2_moe", tmp_path / "q"))
    with pytest.raises(UserError, match="MoE structure"):
        evaluate(sharp_reference, other, ids)


# ---------------------------------------------------------------- checkpoints on disk


def _char_tokenizer(directory):
    """A character-level tokenizer that fits the tiny models' 96-token vocabulary."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"][:94]
    vocab = {"<unk>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(str(directory))


def test_evaluate_checkpoints_moequant_and_foreign_compressed_tensors(tmp_path):
    from moequant import formats
    from moequant.arch import adapter_for
    from moequant.export.write import export_checkpoint
    from moequant.io.checkpoint import EXPORT_INFO, open_checkpoint

    src = build_tiny("mixtral", tmp_path / "orig")
    _char_tokenizer(src)
    ckpt = open_checkpoint(src)
    ad = adapter_for(ckpt.config)
    spec = formats.parse_key("int8-channel")
    quantized = {
        (L, e, p): formats.quantize(ad.read_expert(ckpt, L, e, p).float(), spec)
        for L in ad.moe_layers
        for e in range(ad.num_experts)
        for p in ad.projections
    }
    ours = export_checkpoint(src, quantized, tmp_path / "ours", target="vllm")

    # the same weights as a tool that targets "Linear" with an ignore list would write them
    foreign = tmp_path / "foreign"
    shutil.copytree(ours, foreign)
    (foreign / EXPORT_INFO).unlink()
    cfg = json.loads((foreign / "config.json").read_text())
    qc = cfg["quantization_config"]
    (group,) = qc["config_groups"].values()
    group["targets"] = ["Linear"]
    qc["ignore"] = ["lm_head"] + [
        f"model.layers.{L}.{m}"
        for L in range(3)
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "block_sparse_moe.gate",
        )
    ]
    (foreign / "config.json").write_text(json.dumps(cfg))

    kwargs = dict(dataset="builtin:stdlib-code", samples=3, seq_len=24, seed=0, dtype=torch.float32, progress=False)
    a = evaluate_checkpoints(ours, src, **kwargs)
    b = evaluate_checkpoints(foreign, src, **kwargs)
    for r in (a, b):
        assert r["samples"] == 3 and r["tokens"] == 72
        assert r["kl_mean"] > 0 and 0 < r["moe_output_error"] < 0.05
        assert r["by_domain"].keys() == {"code"}
        assert r["dataset"] == "builtin:stdlib-code"
    # one set of int8 weights under two spellings of the targets (exact names / Linear + ignore): moequant's
    # reader (moequant.io.dequant) reads both and keeps the dequantized values exactly (transformers' own
    # compressed-tensors path, the fallback for what it cannot read, would decompress into bf16 first)
    expected = quantized[(0, 1, "down")].dequantize(dtype=torch.float32)
    assert torch.equal(load_quantized(ours, dtype=torch.float32).model.layers[0].mlp.experts.down_proj[1], expected)
    assert torch.equal(load_quantized(foreign, dtype=torch.float32).model.layers[0].mlp.experts.down_proj[1], expected)
    assert b["ppl_quantized"] == pytest.approx(a["ppl_quantized"], rel=1e-9)
    text = format_quality(a)
    assert "3 samples, 72 tokens of builtin:stdlib-code" in text and f"{a['ppl_original']:.4f}" in text


def test_lm_eval_tasks_need_lm_eval(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as when it is not installed
    with pytest.raises(UserError, match="lm_eval is not installed"):
        evaluate_checkpoints(tmp_path, tmp_path, lm_eval_tasks=["hellaswag"])


def test_token_statistics_with_masked_logits():
    """Vocabulary entries masked to -inf in both models (padding) contribute nothing to KL."""
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(5, 11, generator=g), torch.randn(5, 11, generator=g)
    a[:, 8:] = b[:, 8:] = float("-inf")
    kl, same, nll_a, nll_b = token_statistics(a, b, torch.tensor([0, 3, -100, 7, 1]))
    pa, pb = torch.softmax(a[:, :8].double(), -1), torch.softmax(b[:, :8].double(), -1)
    assert torch.allclose(kl, (pa * (pa.log() - pb.log())).sum(-1), rtol=1e-12, atol=0)
    assert torch.equal(same, a.argmax(-1) == b.argmax(-1))
    assert torch.isnan(nll_a[2]) and nll_a[1].item() == pytest.approx(-pa[1, 3].log().item(), rel=1e-12)
    assert nll_b[3].item() == pytest.approx(-pb[3, 7].log().item(), rel=1e-12)


def test_a_checkpoint_under_other_tensor_names_is_refused_not_randomly_filled(tmp_path):
    """transformers fills tensors a checkpoint lacks with random values and goes on (llm-compressor
    0.14 writes Mixtral experts as block_sparse_moe.experts.N.gate_proj, which loads that way):
    moequant's loaders refuse such a checkpoint with one sentence, and `moequant eval` exits 2."""
    from click.testing import CliRunner
    from safetensors.torch import load_file, save_file
    from tiny import build_tiny_with_tokenizer

    import moequant
    from moequant.cli import main

    src = build_tiny_with_tokenizer("mixtral", tmp_path / "orig")
    renamed = tmp_path / "renamed"
    shutil.copytree(src, renamed)
    tensors = load_file(str(renamed / "model.safetensors"))
    names = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
    moved = {}
    for name, t in tensors.items():
        for old, new in names.items():
            name = name.replace(old, new)
        moved[name] = t
    assert moved.keys() != tensors.keys()
    save_file(moved, str(renamed / "model.safetensors"), metadata={"format": "pt"})
    moequant.load(src)  # the original loads
    with pytest.raises(UserError, match="lacks .* tensors the mixtral model needs"):
        moequant.load(renamed)
    with pytest.raises(UserError, match="lacks"):
        load_quantized(renamed)
    result = CliRunner().invoke(
        main,
        [
            "eval",
            str(renamed),
            "--reference",
            str(src),
            "--samples",
            "1",
            "--seq-len",
            "16",
            "--dataset",
            "builtin:stdlib-code",
        ],
    )
    assert result.exit_code == 2 and "lacks" in result.output, result.output


def _close(a, b, path="", rel=1e-5):
    """Recursive comparison of two evaluate() dicts: integers and None exactly, floats within `rel`."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            if k != "seconds":
                _close(a[k], b[k], f"{path}.{k}", rel)
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]", rel)
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or b == pytest.approx(a, rel=rel, abs=1e-12), (path, a, b)
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize(
    "zoo",
    [
        "zoo:tiny-qwen2moe",
        "zoo:tiny-mixtral",
        *(pytest.param(z, marks=pytest.mark.slow) for z in ("zoo:tiny-qwen3moe", "zoo:tiny-deepseek-v3")),
    ],
)
def test_streamed_evaluation_equals_the_whole_model_evaluation(zoo, tmp_path, monkeypatch):
    """evaluate_streaming (two checkpoints, one decoder layer of each in memory) gives evaluate()'s
    numbers on the two loaded models: every metric, per layer, per expert and per domain."""
    from moequant import formats
    from moequant.arch import adapter_for
    from moequant.evaluate import capture, compare, evaluate_streaming
    from moequant.export.write import export_checkpoint
    from moequant.io.checkpoint import load_tokenizer, open_checkpoint
    from moequant.io.layers import LayerRunner
    from moequant.io.loader import load
    from moequant.measure.data import load_samples

    src = open_checkpoint(zoo)
    ad = adapter_for(src.config)
    keys = ("int4-g32-sym", "int8-channel")  # a per-expert mix, read through the dequantizing reader
    quantized = {
        (L, e, p): formats.quantize(ad.read_expert(src, L, e, p).float(), keys[(L + e) % 2])
        for L in ad.moe_layers
        for e in range(ad.num_experts)
        for p in ad.projections
    }
    out = export_checkpoint(src.directory, quantized, tmp_path / "q", target="transformers")
    windows = load_samples("builtin:mix", load_tokenizer(src.directory), 5, 48, split="evaluation", seed=0)
    windows += [SimpleNamespace(input_ids=w.input_ids[:20], domain=w.domain) for w in windows[:2]]  # two lengths
    whole = evaluate(load(src.directory, torch.float32), load(out, torch.float32), windows, batch_size=2)
    streamed = evaluate_streaming(src.directory, out, windows, batch_size=2, dtype=torch.float32)
    assert len(whole["by_domain"]) >= 2 and whole["kl_mean"] > 0
    assert any(r["error"] is not None for r in whole["experts"])
    _close(whole, streamed)
    # the per-expert errors as a GPU computes them (all pairs through the experts' grouped kernel), forced on
    # the CPU: the same sums in another order of float32 additions, which a small y_q - y_ref magnifies (~1e-5)
    calls, errors_grouped = [], capture._errors_grouped

    def counted(*args):
        calls.append(args)
        return errors_grouped(*args)

    monkeypatch.setattr(capture, "_errors_grouped", counted)
    grouped = evaluate_streaming(src.directory, out, windows, batch_size=2, dtype=torch.float32, grouped=True)
    assert calls  # the grouped path ran
    _close({**whole, "experts": None}, {**grouped, "experts": None})
    _close(whole["experts"], grouped["experts"], ".experts", rel=2e-4)
    # the next layer read (and, on a GPU, decoded) on a thread while this one computes, its routed experts by
    # several threads straight into the layer's stacks, forced on the CPU: the same numbers to the bit (the states
    # are the ones materialized would read itself)
    read_ahead, threads, expert_threads = compare._layers_read_ahead, set(), set()
    real_read, real_experts = LayerRunner.read_layer, type(src.adapter).read_experts

    def forced(runs, adapter, ahead=None):
        for L, states in read_ahead(runs, adapter, ahead=True):
            assert all(s is not None for s in states)
            threads.add(threading.current_thread().name)
            yield L, states

    def on_which_thread(self, layer, *args, **kwargs):
        threads.add(threading.current_thread().name)
        return real_read(self, layer, *args, **kwargs)

    def experts_on_which_thread(self, *args, **kwargs):
        expert_threads.add(threading.current_thread().name)
        return real_experts(self, *args, **kwargs)

    monkeypatch.setattr(compare, "_layers_read_ahead", forced)
    monkeypatch.setattr(LayerRunner, "read_layer", on_which_thread)
    monkeypatch.setattr(type(src.adapter), "read_experts", experts_on_which_thread)
    ahead = evaluate_streaming(src.directory, out, windows, batch_size=2, dtype=torch.float32, grouped=False)
    assert any(name.startswith("moequant-eval-read") for name in threads)
    assert any(name.startswith("moequant-eval-read-experts") for name in expert_threads)
    assert {k: v for k, v in ahead.items() if "seconds" not in k} == {
        k: v for k, v in streamed.items() if "seconds" not in k
    }
