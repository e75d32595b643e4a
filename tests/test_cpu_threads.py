"""The command line makes OpenMP's idle threads sleep (OMP_WAIT_POLICY=PASSIVE) before torch loads OpenMP: on a
CPU shared with other work a spinning thread holds the core that the thread it waits for needs
(benchmarks/RESULTS.md, bench_gguf 2026-12-06: a layer forward 13x, a ggml quantization 200x slower at load 10 on
2 cores)."""

import os
import subprocess
import sys

# the policy in the environment at the moment torch is first imported (OpenMP reads it once, when it loads)
WATCH = """
import os, sys
seen = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("OMP_WAIT_POLICY"))
sys.meta_path.insert(0, Watch())
import moequant.cli, torch
print(seen[0])
"""


def _policy_when_torch_loads(env: dict) -> str:
    return subprocess.run([sys.executable, "-c", WATCH], env=env, capture_output=True, text=True, check=True).stdout


def test_cli_sets_passive_wait_before_torch_loads_and_keeps_a_users_choice():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert _policy_when_torch_loads(env).strip() == "PASSIVE"
    assert _policy_when_torch_loads({**env, "OMP_WAIT_POLICY": "ACTIVE"}).strip() == "ACTIVE"
