"""vLLM's CPU build (0.32, AVX-512) on moequant's compressed-tensors exports of families read through the generic
adapter (moequant/arch/generic.py), each family's tiny random model (tests/families.py, matrices at 4x
transformers' init so that greedy tokens are not near ties) with every routed expert int4 (groups of 128,
symmetric: what vLLM's CPU MoE kernel takes). vLLM's greedy tokens and log-probabilities are scored against
moequant.load() of the same checkpoint (teacher forcing, tests/support/verify_vllm.py's tolerances).

- Hunyuan-MoE (hunyuan_v1_moe): vLLM serves the int4 export and agrees, and the bf16 model.
- GLM-4.5 ... 4.7 (glm4_moe) and ERNIE-4.5-MoE: vLLM runs the bf16 model and agrees with transformers, but
  refuses the quantized export with its own sentence ("No WNA16 MoE backend supports the deployment
  configuration"): its CPU int4 MoE kernels take plain softmax top-k routing only, not these families'
  biased (grouped) routing. The test asserts that refusal, so it says when a vLLM release serves them.
- Not run here: Qwen3.5-MoE (vLLM 0.32's CPU build fails to set it up from a local directory, looking it up
  on the hub), MiniMax-M2 (an assertion inside vLLM's model on this tiny config), Qwen3-Next (vLLM's CPU
  attention takes no head size 32).
Like tests/test_vllm.py this RUNS in CI (it builds the cached vLLM venv when missing) and fails loudly when vLLM
cannot run.
"""

from __future__ import annotations

import pytest
import torch
from families import build_family
from support.verify_vllm import compare_with_moequant, ensure_vllm_env, quantized_moe_kernel_gap, run_vllm
from test_export_models import quantize_experts

from moequant.export.write import export_checkpoint

SERVED = ("hunyuan_v1_moe",)
BF16_ONLY = ("glm4_moe", "ernie4_5_moe")  # vLLM's CPU int4 MoE kernels refuse their routing
PROMPTS = [[11, 523, 87, 1290, 33, 7], [2048, 5, 912, 60, 3001], [400, 401, 402, 17, 2999, 1024, 8]]
# what released checkpoints' config.json state and transformers 5.25 derives (its saved config leaves it out),
# which vLLM 0.32 reads: GLM-4.6's head_dim
AS_RELEASED = {"glm4_moe": {"head_dim": 32}}

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def _as_released(source, family):
    """The saved model with its matrices at 4x their random init (logits far from uniform) and the config keys
    above, in place."""
    import json

    from safetensors.torch import load_file, save_file

    for f in source.glob("*.safetensors"):
        state = load_file(str(f))
        state = {n: (t * 4 if t.dim() >= 2 and t.is_floating_point() else t).contiguous() for n, t in state.items()}
        save_file(state, str(f), metadata={"format": "pt"})
    path = source / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **AS_RELEASED.get(family, {})}, indent=1))
    return source


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    out = {}
    for family in SERVED + BF16_ONLY:
        root = tmp_path_factory.mktemp(family)
        source = _as_released(build_family(family, root / "bf16"), family)
        int4 = quantize_experts(source, lambda L, e, p: "int4-g128-sym")
        out[family] = (source, export_checkpoint(source, int4, root / "w4a16"))
    return out


def test_vllm_cpu_serves_the_generic_families_exports(exports):
    assert not quantized_moe_kernel_gap(), "this test needs vLLM's CPU int4 MoE kernel (AVX-512)"
    ensure_vllm_env()
    checkpoints = [c for pair in exports.values() for c in pair]
    outs = run_vllm(checkpoints, PROMPTS, steps=16, dtype="bfloat16", max_model_len=64)
    served = [c for f in SERVED for c in exports[f]] + [exports[f][0] for f in BF16_ONLY]
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
    for family in BF16_ONLY:  # vLLM parses our quantization_config and picks its MoE method; no kernel takes it
        out = outs[str(exports[family][1].resolve())]
        assert isinstance(out, str) and "No WNA16 MoE backend supports" in out, f"{family}: {str(out)[:300]}"
    # what vLLM served is the export: its int4 experts differ from the bf16 model's
    from moequant.io.loader import load

    source, quantized = exports["hunyuan_v1_moe"]
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert not torch.equal(load(source, torch.float32)(ids).logits, load(quantized, torch.float32)(ids).logits)
