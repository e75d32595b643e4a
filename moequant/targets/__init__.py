"""Serving targets, one file per engine: what it loads (formats per routed / non-routed tensor, the unit its
routed experts share a format in, layouts, fused modules, kernel facts with the version they were read from)
and how it refuses. base.py: the Target class; registry.py: the targets by name, which every caller asks.

vllm.py, sglang.py, transformers.py, llama_cpp.py, vllm_moequant.py (moequant's vLLM plugin), vllm_cuda.py.
A new engine is one file whose Target is passed to `register`; every stage asks it `Target.check`."""

from moequant.targets.base import UNITS, Target  # noqa: F401
from moequant.targets.llama_cpp import LlamaCpp
from moequant.targets.registry import TARGETS, get_target, register  # noqa: F401
from moequant.targets.sglang import Sglang
from moequant.targets.transformers import Transformers
from moequant.targets.vllm import Vllm
from moequant.targets.vllm_cuda import VllmCuda
from moequant.targets.vllm_moequant import VllmMoequant

ANY_MIX = "transformers"  # the target that loads any per-expert mix (moequant.load): plans compare with it

for _target in (Vllm, Sglang, Transformers, LlamaCpp, VllmMoequant, VllmCuda):  # in the order messages list them
    register(_target())
