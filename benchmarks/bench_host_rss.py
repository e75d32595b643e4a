"""Peak host memory of a CPU-only `moequant apply` at a size where it matters (issue 55, item 7).

A random Qwen3-MoE of 8 decoder layers x 64 experts (hidden 1024, expert width 512: 1.7 GB in bf16, the
shape tests/test_scale.py uses at 6 layers) is built once into --work, then `moequant apply --recipe
uniform-int4` (GPTQ, the recipe's own calibration and evaluation settings unless --set overrides them) runs
on the CPU in a subprocess whose peak resident size (VmHWM) is its own. Printed: the peak, the bound the
issue sets (2.5 GB plus four decoder layers' bf16 bytes), the model's bytes and where the run's seconds
went (moequant.timing's account). Not a timed test: the seconds are for reading, the peak is the number.

    python benchmarks/bench_host_rss.py [--layers 8] [--work DIR] [--set calibration.samples=64 ...]

Dated results: benchmarks/RESULTS.md, section bench_host_rss.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(
    hidden_size=1024,
    moe_intermediate_size=512,
    num_experts=64,
    num_experts_per_tok=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    intermediate_size=2048,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    norm_topk_prob=True,
    vocab_size=4096,
)


def build(directory: Path, layers: int) -> int:
    """The random bf16 model (reused when `directory` holds it); returns its safetensors bytes."""
    if not (directory / "config.json").exists():
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from moequant import zoo

        config = AutoConfig.for_model("qwen3_moe", num_hidden_layers=layers, **SHAPE)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(directory)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (directory / name).write_bytes((zoo.path("tiny-qwen2moe") / name).read_bytes())
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


CHILD = """
import json, os, sys, threading, time
from moequant import timing
from moequant.pipeline.apply import apply
model, out, overrides = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
# where the peak is: the resident size sampled every 20 ms, each sample given to the innermost stage open
# on the run's thread (moequant.timing's names) at that moment
page, names, by_stage, done = os.sysconf("SC_PAGE_SIZE"), [], {{}}, threading.Event()
real_stage = timing.stage

class named:
    def __init__(self, name, *a, **k):
        self.name, self.inner = name, real_stage(name, *a, **k)
    def __enter__(self):
        if timing.active():
            names.append(self.name)
        return self.inner.__enter__()
    def __exit__(self, *exc):
        if timing.active() and names:
            names.pop()
        return self.inner.__exit__(*exc)

timing.stage = named

def sample():
    with open("/proc/self/statm") as f:
        while not done.wait(0.02):
            f.seek(0)
            rss = int(f.read().split()[1]) * page
            key = names[-1] if names else "(no stage)"
            by_stage[key] = max(by_stage.get(key, 0), rss)

threading.Thread(target=sample, daemon=True).start()
apply({recipe!r}, model=model, output=out, overrides=overrides, progress=False, log=lambda *a: None)
done.set()
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
print(json.dumps({{"peak_rss": int(status["VmHWM"].split()[0]) * 1024, "timings": timing.account(), "by_stage": by_stage}}))
"""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--work", default=None, help="directory for the model and the run (default: a temporary one)")
    p.add_argument("--set", action="append", default=[], help="recipe override key=value, as `moequant apply --set`")
    a = p.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="bench-host-rss-"))
    model = work / f"qwen3-moe-{a.layers}L"
    nbytes = build(model, a.layers)
    layer_bytes = nbytes / a.layers
    out = work / "run"
    code = CHILD.format(recipe=str(ROOT / "recipes" / "uniform-int4.yaml"))
    done = subprocess.run(
        [sys.executable, "-c", code, str(model), str(out), json.dumps(a.set)], capture_output=True, text=True, cwd=ROOT
    )
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    r = json.loads(done.stdout.strip().splitlines()[-1])
    bound = 2.5e9 + 4 * layer_bytes
    q = json.loads((out / "report.json").read_text()).get("quality") or {}
    print(
        f"uniform-int4 on the CPU, {a.layers} layers x 64 experts, {nbytes / 1e9:.2f} GB model "
        f"({layer_bytes / 1e9:.3f} GB a layer), overrides {a.set or 'none'}: peak RSS {r['peak_rss'] / 1e9:.2f} GB, "
        f"bound {bound / 1e9:.2f} GB (2.5 GB + four layers) -> {'within' if r['peak_rss'] <= bound else 'OVER'}; "
        f"KL {q.get('kl_mean', float('nan')):.5f}"
    )
    t = r["timings"]
    print("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(t.items(), key=lambda kv: -kv[1]) if v >= 0.05))
    peaks = sorted(r["by_stage"].items(), key=lambda kv: -kv[1])
    print("peak RSS (GB) by the stage open when it was sampled: " + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in peaks))


if __name__ == "__main__":
    main()
