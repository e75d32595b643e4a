"""The bundled zoo models: offline loading, shapes, size, the card's perplexity and routing claims.

Perplexity and routing are recomputed here with their own code (transformers' loss, the router
weights applied to the router's input), not with the card builder's functions.
"""

import hashlib
import json
import math
import platform

import pytest
import torch
from safetensors import safe_open

from moequant import zoo
from moequant.errors import UserError
from moequant.measure import data

MODELS = ["tiny-qwen2moe", "tiny-mixtral", "tiny-qwen3moe", "tiny-deepseek-v3"]
WIDE = ["tiny-qwen3moe", "tiny-deepseek-v3"]  # every expert / dense MLP width a multiple of 256


def test_names_and_paths():
    assert set(MODELS) <= set(zoo.names())
    assert zoo.DEFAULT_MODEL == "tiny-qwen2moe"
    assert zoo.path("zoo:tiny-mixtral") == zoo.path("tiny-mixtral")
    assert (zoo.path("tiny-qwen2moe") / "model.safetensors").is_file()
    with pytest.raises(
        UserError,
        match=r"zoo model 'nope' does not exist; available: zoo:tiny-deepseek-v3, "
        r"zoo:tiny-mixtral, zoo:tiny-qwen2moe, zoo:tiny-qwen3moe",
    ):
        zoo.path("zoo:nope")


def test_sizes_stay_small():
    """The narrow models under 12 MB, the wide ones under 16 MiB each (one file the trainer's GPU
    machine can hand back; the suite loads each of them many times)."""
    total = 0
    for name in zoo.names():
        weights = zoo.path(name) / "model.safetensors"
        assert weights.stat().st_size <= (16 * 2**20 if name in WIDE else 12_000_000), name
        total += sum(f.stat().st_size for f in zoo.path(name).rglob("*") if f.is_file())
    assert total <= 60_000_000


def test_one_tokenizer_for_every_model():
    """The wide models reuse the zoo's tokenizer (train.py corpus --tokenizer), so they are comparable."""
    from transformers import AutoTokenizer

    text = "def f(x):\n    return x ** 2  # Thou art the Linux kernel.\n"
    reference = AutoTokenizer.from_pretrained(zoo.path("tiny-qwen2moe"))
    vocab = reference.get_vocab()
    for name in MODELS[1:]:
        tokenizer = AutoTokenizer.from_pretrained(zoo.path(name))
        assert tokenizer.get_vocab() == vocab, name
        assert tokenizer(text).input_ids == reference(text).input_ids, name
        assert tokenizer.eos_token == reference.eos_token == "<|endoftext|>"


def _keys_and_dtypes(name):
    with safe_open(zoo.path(name) / "model.safetensors", "pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}


def test_qwen2moe_shape_on_disk():
    config = json.loads((zoo.path("tiny-qwen2moe") / "config.json").read_text())
    assert config["model_type"] == "qwen2_moe"
    assert config["num_experts"] >= 16 and 2 <= config["num_experts_per_tok"] <= 4
    keys = _keys_and_dtypes("tiny-qwen2moe")
    assert set(keys.values()) == {"BF16"}
    layer0 = [k for k in keys if k.startswith("model.layers.0.mlp.")]
    assert sum(k.endswith("gate_proj.weight") and ".experts." in k for k in layer0) == config["num_experts"]
    assert "model.layers.0.mlp.shared_expert.up_proj.weight" in keys
    assert "model.layers.0.mlp.shared_expert_gate.weight" in keys
    assert "model.layers.0.mlp.gate.weight" in keys


def test_mixtral_shape_on_disk():
    config = json.loads((zoo.path("tiny-mixtral") / "config.json").read_text())
    assert config["model_type"] == "mixtral"
    assert config["num_local_experts"] == 8 and config["num_experts_per_tok"] == 2
    keys = _keys_and_dtypes("tiny-mixtral")
    assert set(keys.values()) == {"BF16"}
    experts = {
        k.split(".experts.")[1].split(".")[0] for k in keys if k.startswith("model.layers.0.") and ".experts." in k
    }
    assert experts == {str(e) for e in range(8)}
    assert not any("shared" in k for k in keys)


def test_qwen3moe_shape_on_disk():
    config = json.loads((zoo.path("tiny-qwen3moe") / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["architectures"] == ["Qwen3MoeForCausalLM"]
    num_experts = config.get("num_experts") or config["num_local_experts"]  # transformers 5.24 writes the latter
    assert num_experts >= 8 and config["num_experts_per_tok"] >= 4 and config["num_hidden_layers"] == 4
    assert config["moe_intermediate_size"] % 256 == 0 and config["hidden_size"] % 256 == 0
    assert config["mlp_only_layers"] == [] and config["decoder_sparse_step"] == 1
    keys = _keys_and_dtypes("tiny-qwen3moe")
    assert set(keys.values()) == {"BF16"}
    for L in range(config["num_hidden_layers"]):
        experts = {
            k.split(".experts.")[1].split(".")[0] for k in keys if k.startswith(f"model.layers.{L}.mlp.experts.")
        }
        assert experts == {str(e) for e in range(num_experts)}
        assert (
            f"model.layers.{L}.self_attn.q_norm.weight" in keys and f"model.layers.{L}.self_attn.k_norm.weight" in keys
        )
    assert not any("shared" in k for k in keys)


def test_deepseek_v3_shape_on_disk():
    """MLA, a leading dense layer, a shared expert, grouped sigmoid routing with a trained bias."""
    config = json.loads((zoo.path("tiny-deepseek-v3") / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["first_k_dense_replace"] == 1 and config["num_hidden_layers"] == 4
    assert config["n_shared_experts"] == 1 and 1 < config["n_group"] and config["topk_group"] < config["n_group"]
    assert config["n_routed_experts"] % config["n_group"] == 0
    for width in ("moe_intermediate_size", "intermediate_size", "hidden_size"):
        assert config[width] % 256 == 0, width
    keys = _keys_and_dtypes("tiny-deepseek-v3")
    assert "model.layers.0.mlp.gate_proj.weight" in keys and not any(
        k.startswith("model.layers.0.mlp.experts.") for k in keys
    )
    for L in range(1, 4):
        p = f"model.layers.{L}.mlp."
        experts = {k.split(".experts.")[1].split(".")[0] for k in keys if k.startswith(p + "experts.")}
        assert experts == {str(e) for e in range(config["n_routed_experts"])}
        assert p + "shared_experts.down_proj.weight" in keys
        for t in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "kv_a_layernorm"):
            assert f"model.layers.{L}.self_attn.{t}.weight" in keys, t
        assert keys[p + "gate.e_score_correction_bias"] == "F32"
        with safe_open(zoo.path("tiny-deepseek-v3") / "model.safetensors", "pt") as f:
            bias = f.get_tensor(p + "gate.e_score_correction_bias")
        # trained (DeepSeek-V3's bias update, 1e-3 a step), not the zeros it starts from: what matters
        # for selection is the spread between experts
        assert bias.abs().max() > 0.01 and bias.max() - bias.min() > 0.005, bias


# the wide models' loads and forward passes run with the slow tests (the shape tests above are fast)
@pytest.fixture(
    scope="module", params=[m if m not in WIDE else pytest.param(m, marks=pytest.mark.slow) for m in MODELS]
)
def loaded(request):
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    old = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    try:
        folder = zoo.path(request.param)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    card = json.loads((folder / "card.json").read_text())
    return request.param, tokenizer, model, card


def test_loads_offline_and_generates(loaded):
    name, tokenizer, model, _ = loaded
    prompt = "import os\n\ndef "
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 12 or out[0, -1] == tokenizer.eos_token_id
    text = tokenizer.decode(out[0])
    assert text.startswith(prompt)
    # greedy decoding agrees with a hand-rolled argmax loop over full forwards
    x = ids
    for _ in range(4):
        with torch.no_grad():
            x = torch.cat([x, model(input_ids=x).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(x[0], out[0, : x.shape[1]])


def _eval_samples(tokenizer, card, source):
    setup = {k: card["evaluation"][source][k] for k in ("n_samples", "seq_len", "seed")}
    return data.load_samples(f"builtin:{source}", tokenizer, split="evaluation", **setup)


def _routers(model):
    hidden = model.config.hidden_size
    return {
        int(n.split("layers.")[1].split(".")[0]): m
        for n, m in model.named_modules()
        if n.endswith(".gate")
        and getattr(m, "weight", None) is not None
        and m.weight.shape[1] == hidden
        and m.weight.shape[0] > 1
    }


def select_experts(x, router, config) -> torch.Tensor:
    """The experts each row of `x` is routed to, in float64, from the published rules: softmax
    top-k (Qwen, Mixtral: the order-preserving softmax needs no computing), or DeepSeek-V3's
    sigmoid scores plus e_score_correction_bias, groups ranked by their two best, top-k inside the
    best topk_group groups."""
    logits = x.reshape(-1, router.weight.shape[1]).double() @ router.weight.double().T
    k = config.num_experts_per_tok
    if not hasattr(router, "e_score_correction_bias"):
        return logits.topk(k, dim=-1).indices
    scores = logits.sigmoid() + router.e_score_correction_bias.double()
    groups = scores.reshape(len(scores), config.n_group, -1)
    best = groups.topk(2, dim=-1).values.sum(-1).topk(config.topk_group, dim=-1).indices
    keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best, True)
    return groups.masked_fill(~keep[..., None], float("-inf")).reshape(len(scores), -1).topk(k, dim=-1).indices


@pytest.fixture(scope="module")
def measured(loaded):
    """Per stdlib source: perplexity from transformers' own loss, and routing shares per layer
    from each router's weight applied (in float64) to the router's input, in one batched pass."""
    name, tokenizer, model, card = loaded
    results = {}
    for source in ("stdlib-code", "stdlib-prose"):
        samples = _eval_samples(tokenizer, card, source)
        x = torch.stack([s.input_ids for s in samples])
        digest = hashlib.sha256(x.numpy().astype("<i8").tobytes()).hexdigest()
        setup = card["evaluation_setup"]
        assert digest == card["evaluation"][source]["samples_sha256"], (
            f"the {source} evaluation samples differ from those of the card, which were cut from the standard "
            f"library of Python {setup['python']}; this machine runs Python {platform.python_version()}"
        )
        counts, agreement = {}, {}

        def hook(layer):
            def record(module, inputs, outputs):
                chosen = select_experts(inputs[0], module, model.config)
                # the model's own choice (its output) is the same set of experts, token by token
                ours, theirs = chosen.sort(-1).values, outputs[2].reshape(chosen.shape).sort(-1).values
                agreement[layer] = float((ours == theirs).all(-1).double().mean())
                counts[layer] = torch.bincount(chosen.reshape(-1), minlength=module.weight.shape[0]).double()

            return record

        handles = [m.register_forward_hook(hook(layer)) for layer, m in _routers(model).items()]
        try:
            with torch.no_grad():
                loss = model(input_ids=x, labels=x).loss  # mean over equal-length samples = card's mean
        finally:
            for h in handles:
                h.remove()
        assert min(agreement.values()) >= 0.999, agreement
        results[source] = {"perplexity": math.exp(float(loss)), "share": {l: c / c.sum() for l, c in counts.items()}}
    return name, card, results


@pytest.mark.parametrize("source", ["stdlib-code", "stdlib-prose"])
def test_card_perplexity_reproduced_within_2_percent(measured, source):
    _, card, results = measured
    perplexity = results[source]["perplexity"]
    claimed = card["evaluation"][source]["perplexity"]
    assert abs(perplexity / claimed - 1) <= 0.02, (perplexity, claimed)
    assert perplexity < card["vocab_size"] / 50  # it has learned something


def test_experts_specialise_by_domain(measured, loaded):
    _, card, results = measured
    code, prose = results["stdlib-code"]["share"], results["stdlib-prose"]["share"]
    config = loaded[2].config
    assert len(code) == config.num_hidden_layers - getattr(config, "first_k_dense_replace", 0)
    tv = {layer: 0.5 * float((code[layer] - prose[layer]).abs().sum()) for layer in code}
    # top-2 models: 0.2; tiny-qwen3moe sends every token to half of its experts (top-4 of 8), which
    # flattens the shares: 0.1 (its card: 0.14 in layer 3), still ten times the sampling noise of 24 x 256 tokens
    assert max(tv.values()) >= (0.1 if config.num_experts_per_tok >= 4 else 0.2), tv
    # the card's routing tables say the same
    for layer in code:
        card_code = torch.tensor(card["routing_share"]["stdlib-code"][str(layer)], dtype=torch.float64)
        assert torch.allclose(card_code, code[layer], atol=0.02)


def test_some_experts_are_rarely_used(measured):
    """The cards promise cold experts: some expert gets under a quarter of its even share of code.
    Not tiny-deepseek-v3: its bias update balances the load as DeepSeek-V3's does, so there every
    expert of every layer gets at least a quarter of its even share."""
    name, _, results = measured
    share = results["stdlib-code"]["share"]
    if name == "tiny-deepseek-v3":
        assert all(float(s.min()) >= 0.25 / s.numel() for s in share.values()), share
    else:
        assert any(float(s.min()) < 0.25 / s.numel() for s in share.values())
