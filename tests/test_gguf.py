"""GGUF export and ggml block types, checked by independent readers: gguf-py's dequantizers and
reader, and llama.cpp itself (llama-cpp-python, built once into ~/.cache/moequant when missing:
~16 min on 2 cores; this file then fails loudly if it cannot be built, it never skips)."""

from __future__ import annotations

import itertools

import gguf
import numpy as np
import pytest
import torch
from support import verify_llamacpp as V

from moequant import formats
from moequant.arch import adapter_for
from moequant.errors import UserError
from moequant.export.write import export_checkpoint
from moequant.formats import ggml
from moequant.io.checkpoint import open_checkpoint
from moequant.zoo import path as zoo_path

MODELS = ("tiny-qwen2moe", "tiny-mixtral", "tiny-qwen3moe", "tiny-deepseek-v3")


pytestmark = pytest.mark.slow


def _weights(rows=48, cols=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g)
    w[:, ::37] *= 6  # outliers, as real weights have
    imp = torch.rand(cols, generator=g) ** 4 * 10 + 1e-3  # uneven input second moments
    return w, imp


@pytest.mark.parametrize("name", ggml.GGML_TYPES)
def test_blocks_read_back_identically_by_gguf_py(name):
    w, imp = _weights()
    for importance in (None, imp):
        q = formats.quantize_ggml(w, name, importance=importance)
        t = gguf.GGMLQuantizationType[name.upper()]
        assert q.codes.shape == (48, 512 // gguf.GGML_QUANT_SIZES[t][0] * gguf.GGML_QUANT_SIZES[t][1])
        assert q.nbytes == q.codes.numel() == formats.nbytes(name, w.shape)
        theirs = torch.from_numpy(np.asarray(gguf.quants.dequantize(q.codes.numpy(), t), dtype=np.float32))
        assert torch.equal(q.dequantize(torch.float32), theirs.reshape(w.shape))


def test_blocks_read_back_identically_by_llama_cpp(llama):
    """ggml's own dequantize_row_<type> (llama.cpp's libggml-base) gives our values bit for bit."""
    w, imp = _weights(rows=16)
    qs = {name: formats.quantize_ggml(w, name, importance=imp) for name in ggml.GGML_TYPES}
    theirs = V.ggml_dequantize([(name, q.codes.numpy(), w.shape[1]) for name, q in qs.items()])
    for (name, q), t in zip(qs.items(), theirs):
        assert np.array_equal(q.dequantize().numpy(), t), name


@pytest.mark.parametrize("name", ggml.GGML_TYPES)
def test_weighted_search_lowers_the_weighted_error(name):
    """Importance weights shift error onto unimportant columns; the search beats gguf-py's plain
    quantizer (round-to-nearest of the absmax scale) where gguf-py has one."""
    w, imp = _weights(seed=1)
    err = lambda q: float((imp * (q.dequantize() - w) ** 2).sum())  # noqa: E731
    plain, weighted = formats.quantize_ggml(w, name), formats.quantize_ggml(w, name, importance=imp)
    assert err(weighted) < err(plain)
    t = gguf.GGMLQuantizationType[name.upper()]
    try:
        ref = gguf.quants.quantize(w.numpy(), t)
    except NotImplementedError:  # gguf-py quantizes none of the K types
        return
    ref_w = torch.from_numpy(np.asarray(gguf.quants.dequantize(ref, t), dtype=np.float32)).reshape(w.shape)
    assert err(weighted) < float((imp * (ref_w - w) ** 2).sum())
    assert float(((plain.dequantize() - w) ** 2).sum()) <= float(((ref_w - w) ** 2).sum())


def test_bytes_per_weight_are_ggml_block_sizes():
    for name in ggml.GGML_TYPES:
        t = gguf.GGMLQuantizationType[name.upper()]
        block, size = gguf.GGML_QUANT_SIZES[t]
        assert formats.get_format(name).bits_per_weight((8, 512)) == 8 * size / block
        assert formats.nbytes(name, (3, 8, 512)) == 3 * 8 * 512 // block * size
    assert formats.get_format("q4_k").bits_per_weight((1, 256)) == 4.5  # 144 bytes per 256 weights


def test_a_type_that_cannot_hold_a_dimension_is_refused():
    with pytest.raises(UserError, match="not a multiple of the group size 256 of format q4_k"):
        formats.quantize(torch.randn(4, 64), "q4_k")
    with pytest.raises(UserError, match="not a multiple"):
        formats.nbytes("q6_k", (4, 128))


def _reference_model(source, dequantized: dict, tmp, replaced: dict | None = None):
    """transformers model of `source` with the dequantized expert weights (and `replaced` {name: tensor}), float32."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    ckpt = open_checkpoint(source)
    ad = adapter_for(ckpt.config)
    kept = {ad.expert_tensor_name(L, e, p): w for (L, e, p), w in dequantized.items()} | dict(replaced or {})
    tmp.mkdir(parents=True)
    shutil.copy(source / "config.json", tmp / "config.json")
    save_file(
        {n: (kept[n] if n in kept else ckpt.get(n)).to(torch.float32).contiguous() for n in ckpt.keys()},
        str(tmp / "model.safetensors"),
    )
    return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()


def _texts(n=4, chars=1500):
    """Text of the kind the bundled models were trained on (builtin:mix: stdlib code and docstrings)."""
    from moequant.measure.data import _stdlib_code, _stdlib_prose

    docs = [d.read() for d in _stdlib_code()[:n]] + [d.read() for d in _stdlib_prose()[:n]]
    return [d[:chars] for d in docs if d.strip()]


def _hf_logits(model, ids):
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0].numpy() for s in ids]


@pytest.fixture(scope="module")
def llama():
    return V.ensure_llama_cpp()


def _plan_types(source):
    """Per (layer, proj) one ggml type: K types where the row length allows, 32-blocks elsewhere."""
    ckpt = open_checkpoint(source)
    ad = adapter_for(ckpt.config)
    cycle_k, cycle_32 = (
        itertools.cycle(["q4_k", "q6_k", "q3_k", "q5_k", "q2_k"]),
        itertools.cycle(["q5_0", "q4_0", "q8_0", "q4_1", "q5_1"]),
    )
    return {
        (L, p): next(cycle_k) if ad.expert_shape(p)[1] % 256 == 0 else next(cycle_32)
        for L in ad.moe_layers
        for p in ad.projections
    }


@pytest.mark.parametrize("model", MODELS)
def test_llama_cpp_runs_our_gguf(model, llama, tmp_path):
    """F32 export: llama.cpp tokenizes like transformers and its logits match tightly; an export with
    one ggml type per (layer, projection) (all ten types across the models) reads back with
    those types and llama.cpp's logits match transformers running our own dequantized weights."""
    source = zoo_path(model)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    texts = _texts()
    ids = [tok.encode(t).ids for t in texts]
    f32 = export_checkpoint(source, {}, tmp_path / "f32", layout="gguf", target="llama.cpp", gguf_float="f32")
    assert V.tokenize(f32 / "model.gguf", texts) == ids

    ckpt = open_checkpoint(source)
    ad = adapter_for(ckpt.config)
    types = _plan_types(source)
    quantized, deq = {}, {}
    for (L, p), name in types.items():
        W = ad.read_experts(ckpt, L, p).float()
        imp = torch.rand(W.shape[-1], generator=torch.Generator().manual_seed(L)) + 0.5
        q = formats.quantize_ggml(W, name, importance=imp)
        for e in range(W.shape[0]):
            quantized[(L, e, p)] = q.expert(e)
            deq[(L, e, p)] = q.expert(e).dequantize()
    qdir = export_checkpoint(source, quantized, tmp_path / "q", layout="gguf", target="llama.cpp", gguf_float="f32")
    reader = gguf.GGUFReader(qdir / "model.gguf")
    got = {t.name: t.tensor_type.name.lower() for t in reader.tensors}
    for (L, p), name in types.items():
        assert got[f"blk.{L}.ffn_{p}_exps.weight"] == name
        t = next(t for t in reader.tensors if t.name == f"blk.{L}.ffn_{p}_exps.weight")
        assert int(t.n_bytes) == formats.nbytes(name, (ad.num_experts, *ad.expert_shape(p)))
    assert "output.weight" in got

    short = [s[:96] for s in ids]
    base = _hf_logits(_reference_model(source, {}, tmp_path / "r0"), short)
    ours = _hf_logits(_reference_model(source, deq, tmp_path / "r1"), short)
    ll_f32, ll_q = V.logits([f32 / "model.gguf", qdir / "model.gguf"], short)
    kl_f32 = np.concatenate([V.kl_per_token(r, g) for r, g in zip(base, ll_f32)])
    kl_same = np.concatenate([V.kl_per_token(r, g) for r, g in zip(ours, ll_q)])
    kl_quant = np.concatenate([V.kl_per_token(r, g) for r, g in zip(base, ours)])
    print(
        f"{model}: KL f32 {kl_f32.mean():.2e}, llama.cpp vs ours {kl_same.mean():.2e}, quantization {kl_quant.mean():.2e}"
    )
    assert kl_f32.mean() < 1e-5
    assert kl_quant.mean() > 1e-3  # the quantization is visible ...
    # ... and llama.cpp runs our blocks as we decode them (what remains is its 8-bit activations in quantized matmuls)
    assert kl_same.mean() < kl_quant.mean() / 20


def test_gguf_refusals_write_nothing(tmp_path):
    source = zoo_path("tiny-qwen2moe")
    ckpt = open_checkpoint(source)
    ad = adapter_for(ckpt.config)
    W = ad.read_experts(ckpt, 0, "gate").float()
    mixed = {(0, e, "gate"): formats.quantize(W[e], "q4_k" if e else "q6_k") for e in range(ad.num_experts)}
    with pytest.raises(UserError, match="one ggml type"):
        export_checkpoint(source, mixed, tmp_path / "a", layout="gguf", target="llama.cpp")
    assert not (tmp_path / "a").exists()
    int4 = {(0, 0, "gate"): formats.quantize(W[0], "int4")}
    with pytest.raises(UserError, match="ggml block types"):
        export_checkpoint(source, int4, tmp_path / "b", layout="gguf", target="llama.cpp")
    assert not (tmp_path / "b").exists()


SMALL_RUN = ["calibration.samples=8", "calibration.seq_len=64", "evaluate.samples=4", "evaluate.seq_len=64"]


def test_apply_writes_the_planned_gguf_and_llama_cpp_evaluates_it(llama, tmp_path):
    """`moequant apply --recipe recipes/gguf.yaml`: the solver's per-(layer, projection) types are the
    GGUF's, llama.cpp computes the report's KL, and the byte account is the file's."""
    import json

    from moequant.pipeline.apply import apply

    out = tmp_path / "run"
    apply(
        "recipes/gguf.yaml",
        output=str(out),
        progress=False,
        log=lambda *_: None,
        overrides=[*SMALL_RUN, "calibration.probe_samples=4"],
    )
    plan = json.loads((out / "plan.json").read_text())
    planned = {}
    for t in plan["tensors"]:
        if t["role"] == "routed_expert":
            planned.setdefault(f"blk.{t['layer']}.ffn_{t['proj']}_exps.weight", set()).add(t["format"])
    reader = gguf.GGUFReader(out / "checkpoint" / "model.gguf")
    types = {t.name: t.tensor_type.name.lower() for t in reader.tensors}
    assert all(len(v) == 1 and types[k] == next(iter(v)) for k, v in planned.items())
    assert len(set(types[k] for k in planned)) > 1  # the budget mixes types
    report = json.loads((out / "report.json").read_text())
    assert report["quality"]["engine"] == "llama.cpp" and 0 < report["quality"]["kl_mean"] < 0.1
    assert report["memory"]["bytes_quantized"] == sum(int(t.n_bytes) for t in reader.tensors)


def test_a_plan_whose_routed_experts_are_all_imatrix_collects_their_statistics(llama, tmp_path):
    """No routed expert needs GPTQ, every one imatrix: the quantize pass still runs the layers to collect the
    experts' input statistics (it stopped before the first layer and failed on 2026-12-04), and the
    importance they give changes the codes against round-to-nearest of the same type."""
    import json

    from moequant.pipeline.apply import apply

    def run(algorithm):
        out = tmp_path / algorithm
        apply(
            "recipes/gguf.yaml",
            output=str(out),
            progress=False,
            log=lambda *_: None,
            overrides=[
                "experts={method: uniform, format: q4_0}",
                f"algorithms={{q4_0: {algorithm}}}",
                "non_experts={format: bf16}",
                *SMALL_RUN,
            ],
        )
        plan = json.loads((out / "plan.json").read_text())
        routed = [t for t in plan["tensors"] if t["role"] == "routed_expert"]
        assert {(t["format"], t["algorithm"]) for t in routed} == {("q4_0", algorithm)}
        report = json.loads((out / "report.json").read_text())
        assert report["quality"]["engine"] == "llama.cpp" and 0 < report["quality"]["kl_mean"] < 0.1
        reader = gguf.GGUFReader(out / "checkpoint" / "model.gguf")
        return {t.name: np.array(t.data) for t in reader.tensors if "_exps" in t.name}

    imatrix, rtn = run("imatrix"), run("rtn")
    assert imatrix.keys() == rtn.keys() and imatrix
    assert all(not np.array_equal(imatrix[k], rtn[k]) for k in imatrix)


def test_cli_refuses_a_malformed_gguf_request(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "bad"
    for extra in (
        ["--set", "target=vllm"],
        ["--set", "experts.formats=[q4_k, int4]", "--set", "experts.method=uniform", "--set", "experts.format=int4"],
    ):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "moequant.cli",
                "apply",
                "--recipe",
                "recipes/gguf.yaml",
                "--output",
                str(out),
                *extra,
            ],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
        assert not out.exists() or not (out / "checkpoint").exists()


def test_imatrix_from_our_statistics_is_accepted_by_llama_model_quantize(llama, tmp_path):
    """`moequant calibrate --imatrix`: llama.cpp's GGUF imatrix layout (in_sum2 {n_in, n_expert} = Σx²,
    counts {1, n_expert}, every expert covered), which llama_model_quantize takes (and checks: a
    truncated one is refused) and which changes the Q4_K_M it writes."""
    import subprocess
    import sys

    from moequant.measure.stats import load_stats

    stats_dir, imat = tmp_path / "run" / "stats", tmp_path / "imatrix.gguf"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "moequant.cli",
            "calibrate",
            "--model",
            "zoo:tiny-qwen2moe",
            "--samples",
            "8",
            "--seq-len",
            "64",
            "--formats",
            "q4_k",
            "--output",
            str(tmp_path / "run"),
            "--imatrix",
            str(imat),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    stats = load_stats(stats_dir, with_hessians=False)
    reader = gguf.GGUFReader(imat)
    t = {x.name: x for x in reader.tensors}
    ls = stats.layers[2]
    E = ls.num_experts
    sums = t["blk.2.ffn_down_exps.weight.in_sum2"]
    assert [int(s) for s in sums.shape] == [ls.tensors["input.down.sq_mean"].shape[1], E]
    expected = (ls.tensors["input.down.sq_mean"].double() * ls.tensors["input.down.tokens"].double()[:, None]).float()
    assert np.allclose(np.asarray(sums.data).reshape(E, -1), expected.numpy(), rtol=1e-6)
    counts = np.asarray(t["blk.2.ffn_down_exps.weight.counts"].data).reshape(-1)
    assert (counts > 0).all() and np.array_equal(counts, ls.tensors["input.down.tokens"].float().numpy())

    src = export_checkpoint(zoo_path("tiny-qwen2moe"), {}, tmp_path / "bf16", layout="gguf", target="llama.cpp")
    with_imat = V.quantize(src / "model.gguf", tmp_path / "a.gguf", "Q4_K_M", imatrix=imat)
    without = V.quantize(src / "model.gguf", tmp_path / "b.gguf", "Q4_K_M")
    assert with_imat == {"rc": 0, "imatrix_entries": len(reader.tensors) // 2} and without["rc"] == 0
    a, b = gguf.GGUFReader(tmp_path / "a.gguf"), gguf.GGUFReader(tmp_path / "b.gguf")
    name = "blk.2.ffn_gate_exps.weight"
    ta, tb = (next(x for x in r.tensors if x.name == name) for r in (a, b))
    assert ta.tensor_type == tb.tensor_type and not np.array_equal(np.asarray(ta.data), np.asarray(tb.data))

    # control: an imatrix of the wrong width for one tensor is refused by llama.cpp
    bad = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(bad), "imatrix")
    w.add_type("imatrix")
    w.add_tensor(name + ".in_sum2", np.ones((E, 100), dtype=np.float32))
    w.add_tensor(name + ".counts", np.ones((E, 1), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()  # noqa: E702
    assert V.quantize(src / "model.gguf", tmp_path / "c.gguf", "Q4_K_M", imatrix=bad)["rc"] != 0


def test_token_embedding_and_output_types(llama, tmp_path):
    """export.gguf_token_embd / gguf_output (llama.cpp's --token-embedding-type / --output-tensor-type)."""
    source = zoo_path("tiny-mixtral")
    out = export_checkpoint(
        source,
        {},
        tmp_path / "a",
        layout="gguf",
        target="llama.cpp",
        gguf_types={"token_embd.weight": "q4_k", "output.weight": "q6_k"},
    )
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out / "model.gguf").tensors}
    assert types["token_embd.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    from tokenizers import Tokenizer

    text = _texts(1)[:2]
    assert V.tokenize(out / "model.gguf", text) == [
        Tokenizer.from_file(str(source / "tokenizer.json")).encode(t).ids for t in text
    ]
    with pytest.raises(UserError, match="unknown format"):
        export_checkpoint(
            source, {}, tmp_path / "b", layout="gguf", target="llama.cpp", gguf_types={"output.weight": "q7_k"}
        )
    assert not (tmp_path / "b").exists()


def _correlated(E=3, rows=32, n=512, tokens=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(E, rows, n, generator=g)
    mix = torch.eye(n) + 0.5 * torch.randn(n, n, generator=g) / n**0.5
    X = (torch.randn(E, tokens, n, generator=g) @ mix) * (torch.rand(n, generator=g) * 2)
    return W, X.transpose(1, 2) @ X / tokens


@pytest.mark.parametrize("name", ggml.GGML_TYPES)
def test_gptq_on_the_ggml_grid(name):
    """GPTQ with fixed block scales: valid blocks (gguf-py reads them as we do), less output error
    tr(dW H dW^T) than the imatrix-weighted round-to-nearest it starts from, and with a diagonal H
    (no error to spread) exactly that round-to-nearest."""
    W, H = _correlated()
    imp = torch.diagonal(H, dim1=-2, dim2=-1)
    rtn = formats.quantize_ggml(W, name, importance=imp)
    gq = formats.quantize_ggml(W, name, hessian=H)
    t = gguf.GGMLQuantizationType[name.upper()]
    theirs = torch.from_numpy(np.asarray(gguf.quants.dequantize(gq.codes.numpy(), t), dtype=np.float32))
    assert torch.equal(gq.dequantize(), theirs.reshape(W.shape))
    err = lambda q: float(torch.einsum("eoi,eij,eoj->", q.dequantize() - W, H, q.dequantize() - W))  # noqa: E731
    assert err(gq) < 0.97 * err(rtn)
    diagonal = formats.quantize_ggml(W, name, hessian=torch.diag_embed(imp))
    assert torch.equal(diagonal.codes, rtn.codes)


def test_quantized_attention_of_a_llama_graph_is_rope_permuted_as_packed_rows(llama, tmp_path):
    """Mixtral's q / k rows are reordered for llama.cpp's rope: quantized ones are reordered as packed rows
    (each row's blocks are its own), and llama.cpp runs them as transformers runs our dequantization."""
    source = zoo_path("tiny-mixtral")
    ckpt = open_checkpoint(source)
    quantized, others = {}, {}
    for name in ckpt.keys():
        if ".self_attn." in name and name.endswith("_proj.weight"):
            q = formats.quantize_ggml(ckpt.get(name).float(), "q4_0")
            quantized[name], others[name] = q, q.dequantize()
    out = export_checkpoint(source, quantized, tmp_path / "q", layout="gguf", target="llama.cpp", gguf_float="f32")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    ids = [tok.encode(t).ids[:96] for t in _texts()]
    ours = _hf_logits(_reference_model(source, {}, tmp_path / "r", replaced=others), ids)
    base = _hf_logits(_reference_model(source, {}, tmp_path / "r0"), ids)
    got = V.logits([out / "model.gguf"], ids)[0]
    kl_same = np.concatenate([V.kl_per_token(r, g) for r, g in zip(ours, got)]).mean()
    kl_quant = np.concatenate([V.kl_per_token(r, g) for r, g in zip(base, ours)]).mean()
    print(f"tiny-mixtral q4_0 attention: llama.cpp vs ours {kl_same:.2e}, quantization {kl_quant:.2e}")
    assert kl_same < kl_quant / 5 and kl_same < 1e-2
