"""Engines we did not write load the smaller model that pruning leaves (issue 58). llama.cpp runs the F32 GGUF of
each bundled model pruned as the original transformers model runs whose routers never choose the dropped experts.
vLLM's CPU build serves the
bf16 model and the int4 compressed-tensors export of a pruned tiny-qwen3moe, and agrees with moequant.load() of the
same checkpoint (teacher forcing, tests/support/verify_vllm.py's tolerances). moequant.load of the pruned bf16
model is the original model whose routers never choose the dropped experts (tests/test_prune.py), so vLLM's
agreement ties the served model to the original one.

tiny-deepseek-v3 is not run by vLLM 0.32's CPU build, pruned or not: its MLA takes no head size of 160 (the zoo
model's qk_nope + qk_rope). The refusal is asserted for the pruned bf16 and int4 exports and the unpruned model
alike (the int4 export first by its int4 MoE kernels, which take softmax top-k routing only), so a release that
runs it shows; until then the pruned DeepSeek is checked by transformers and llama.cpp.
"""

from __future__ import annotations

import pytest
import torch
from support.verify_vllm import compare_with_moequant, ensure_vllm_env, quantized_moe_kernel_gap, run_vllm
from test_export_models import quantize_experts

from moequant.export.prune import write_pruned_checkpoint
from moequant.export.write import export_checkpoint
from moequant.io.checkpoint import open_checkpoint
from moequant.plan.prune import choose_drops, prune_layout
from moequant.plan.recipe import Prune

PRUNE = {"tiny-qwen3moe": 2, "tiny-deepseek-v3": 2}  # 8 -> 6 experts (DeepSeek: one whole group of two)
PROMPTS = [[11, 523, 87, 1290, 33, 7], [2048, 5, 912, 60, 3001], [400, 401, 402, 17, 2999, 1024, 8]]


# what released checkpoints' config.json states and the zoo's (saved by transformers 5.25) leaves out, which vLLM 0.32
# reads: DeepSeek-V3's routing method (without it vLLM builds no e_score_correction_bias and refuses the tensor)
AS_RELEASED = {"tiny-deepseek-v3": {"topk_method": "noaux_tc"}}


def _as_released(zoo, directory):
    import json
    import shutil

    from moequant.zoo import path as zoo_path

    shutil.copytree(zoo_path(zoo), directory)
    config = directory / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **AS_RELEASED.get(zoo, {})}, indent=1))
    return directory


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    out = {}
    for zoo, count in PRUNE.items():
        root = tmp_path_factory.mktemp(zoo)
        source = open_checkpoint(_as_released(zoo, root / "source"))
        layout = prune_layout(Prune(experts=count), source.adapter)
        g = torch.Generator().manual_seed(0)
        E = source.adapter.num_experts
        fake = {L: {"routing.count": torch.randperm(E, generator=g).double()} for L in source.adapter.moe_layers}
        pruned = write_pruned_checkpoint(source, choose_drops(fake, layout, "frequency"), layout, root / "bf16")
        int4 = quantize_experts(pruned, lambda L, e, p: "int4-g128-sym")
        out[zoo] = (pruned, export_checkpoint(pruned, int4, root / "w4a16"))
        if zoo == "tiny-deepseek-v3":
            out["source"] = source.directory
    return out


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_cpu_serves_pruned_exports(exports):
    """On a CPU where vLLM's CPU build has no int4 fused-MoE kernel (`quantized_moe_kernel_gap`) the pruned bf16 model
    is served and checked, and the int4 export is asserted refused with vLLM's no-kernel sentence."""
    gap = quantized_moe_kernel_gap()
    ensure_vllm_env()
    checkpoints = [*exports["tiny-qwen3moe"], *exports["tiny-deepseek-v3"], exports["source"]]
    outs = run_vllm(checkpoints, PROMPTS, steps=16, dtype="bfloat16", max_model_len=64)
    pruned_bf16, pruned_int4 = exports["tiny-qwen3moe"]
    served = [pruned_bf16] if gap else [pruned_bf16, pruned_int4]
    if gap:
        print(f"NOT CHECKED on this machine: vLLM serving the pruned int4 export. {gap}")
        refused = outs[str(pruned_int4.resolve())]
        assert isinstance(refused, str) and "No WNA16 MoE backend supports" in refused, str(refused)[:300]
    lines, failed = [], []
    for c in served:
        report = compare_with_moequant(c, PROMPTS, outs[str(c.resolve())])
        lines.append(f"{c.parent.name} {c.name}: {report.summary()}")
        if not report.ok:
            failed.append(f"{c.parent.name} {c.name}: {report.summary()}\n  " + "\n  ".join(report.failures[:5]))
        else:
            assert report.steps == len(PROMPTS) * 16
    print("\n".join(lines))
    assert not failed, "\n".join(failed)
    # vLLM 0.32's CPU MLA takes no head size of 160 (tiny-deepseek-v3's qk_nope + qk_rope): the unpruned model is
    # refused with the same sentence, so it is the zoo model's shape, not its pruning; the int4 export is refused
    # before that by its int4 MoE kernels, which take plain softmax top-k routing only (tests/test_vllm_families.py)
    pruned, int4 = exports["tiny-deepseek-v3"]
    for c, says in ((pruned, "Head dimension 160 is not supported by MLA"), (exports["source"], "Head dimension 160"),
                    (int4, "No WNA16 MoE backend supports the deployment configuration")):  # fmt: skip
        refused = outs[str(c.resolve())]
        assert isinstance(refused, str) and says in refused, f"{c}: {str(refused)[:300]}"


GGUF_PRUNE = {"tiny-qwen2moe": 4, "tiny-mixtral": 2, "tiny-qwen3moe": 2, "tiny-deepseek-v3": 2}


@pytest.mark.slow
@pytest.mark.parametrize("zoo", list(GGUF_PRUNE))
def test_llama_cpp_runs_the_pruned_gguf_as_the_original_never_choosing_the_dropped_experts(zoo, tmp_path):
    from support import verify_llamacpp as V
    from test_gguf_archs import _kl, _texts
    from test_prune import _random_drops, routers_never_choosing
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    source = open_checkpoint(f"zoo:{zoo}")
    layout = prune_layout(Prune(experts=GGUF_PRUNE[zoo]), source.adapter)
    drops = _random_drops(source.adapter, layout)
    pruned = write_pruned_checkpoint(source, drops, layout, tmp_path / "bf16")
    f32 = export_checkpoint(pruned, {}, tmp_path / "f32", layout="gguf", target="llama.cpp", gguf_float="f32")
    tok = Tokenizer.from_file(str(source.directory / "tokenizer.json"))
    ids = [tok.encode(t).ids[:64] for t in _texts()[:3]]
    V.ensure_llama_cpp()
    (theirs,) = V.logits([f32 / "model.gguf"], ids)
    original = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32)
    with torch.no_grad():
        full = [original(torch.tensor([s])).logits[0].numpy() for s in ids]
        with routers_never_choosing(original, source.adapter, drops):
            reference = [original(torch.tensor([s])).logits[0].numpy() for s in ids]
    kl, moved = _kl(reference, theirs), _kl(full, reference)
    print(f"{zoo}: llama.cpp vs the original never choosing the dropped experts {kl:.2e}; pruning itself {moved:.2e}")
    assert kl <= 1e-4
    assert moved > 100 * kl


@pytest.mark.parametrize("layout, key", [("gptq", "int4-g32-sym"), ("awq", "int4-g32-asym")])
def test_gptq_and_awq_exports_of_the_pruned_model_hold_its_experts(layout, key, tmp_path):
    """The pruned model goes through the GPTQ and AWQ layouts as any model of its family: the config keeps the
    pruned expert count, and the same codes read back through either layout give compressed-tensors' logits."""
    import json

    from moequant.io.loader import load

    source = open_checkpoint("zoo:tiny-qwen2moe")
    layout_ = prune_layout(Prune(experts=4), source.adapter)
    fake = {L: {"routing.count": torch.arange(16.0).roll(L)} for L in source.adapter.moe_layers}
    pruned = write_pruned_checkpoint(source, choose_drops(fake, layout_, "frequency"), layout_, tmp_path / "bf16")
    codes = quantize_experts(pruned, lambda L, e, p: key)
    assert {e for _, e, _ in codes} == set(range(12))
    ct = export_checkpoint(pruned, codes, tmp_path / "ct", target="transformers")
    out = export_checkpoint(pruned, codes, tmp_path / layout, layout=layout, target="transformers")
    assert json.loads((out / "config.json").read_text())["num_experts"] == 12
    ids = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = load(ct, torch.float32)(ids).logits, load(out, torch.float32)(ids).logits
        bf16 = load(pruned, torch.float32)(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert not torch.allclose(got, bf16, atol=1e-3)  # the codes, not the bf16 weights, were read
