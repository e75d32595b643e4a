"""Calibration statistics on disk and in memory.

Layout of a `stats/` directory:
- `summary.json`: the run's fingerprint (model, data, settings), per-layer token counts, the
  experts with too few real tokens, the formats evaluated for sensitivity;
- `layer_LLL.safetensors` per MoE layer, tensors (E experts, k = top_k, d = input width):
  `routing.count [E]` int64 real top-k hits; `routing.weight_sum [E]` float64 sum of routing
  weights; `routing.rank_count [E, k]` int64 how often the expert was the 1st/2nd/... choice;
  `routing.count.<domain> [E]` per domain;
  `input.<group>.tokens [E]`, `input.<group>.sq_mean [E, d]`, `input.<group>.absmax [E, d]`
  with group `gate_up` (the input gate and up share) or `down`, over the statistic tokens
  (every token when all-experts coverage is on, else the routed ones);
  `hessian_diag.<group> [E, d]` fp32 = diag(XᵀX / n) over the statistic tokens and
  `hessian_routed_diag.<group>`, `input_routed.<group>.tokens` over the real routed tokens only
  (the full `[E, d, d]` Hessians live only inside the layer being processed: at DeepSeek-V3
  shape they would be ~57 GB per layer; `CalibrationSettings.save_hessians` / `calibrate
  --save-hessians` also writes them as `hessian.<group>` / `hessian_routed.<group>`);
  `sensitivity.<proj>.<format_key> [E]` float64 predicted output error (see calibrate.py);
  `saliency.reap [E]` float64 REAP's criterion (mean router weight x output norm over routed tokens, saliency.py);
- `probe.json`: the per-layer KL probe (measured KL of quantizing one layer's routed experts,
  the policy's predicted loss for it, their ratio), when calibration ran it (see probe.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from moequant.errors import UserError
from moequant.io.checkpoint import atomic_write_text
from moequant.measure.settings import HessianRule

GROUP_OF_PROJ = {"gate": "gate_up", "up": "gate_up", "down": "down"}
PROBE_SCHEMA, PROBE_FILE = (
    "moequant.calib.probe/1",
    "probe.json",
)  # written by measure.probe (the schema keeps its first name)
TENSOR_PROBE_SCHEMA, TENSOR_PROBE_FILE = "moequant.tensor_probe/1", "tensor_probe.json"


def layer_file(directory: Path, layer: int) -> Path:
    return Path(directory) / f"layer_{layer:03d}.safetensors"


@dataclass
class LayerStats:
    layer: int
    top_k: int
    tokens: int
    tensors: dict[str, torch.Tensor] = field(repr=False)

    @property
    def num_experts(self) -> int:
        return int(self.tensors["routing.count"].numel())

    @property
    def routed_count(self) -> torch.Tensor:
        return self.tensors["routing.count"]

    @property
    def weight_sum(self) -> torch.Tensor:
        return self.tensors["routing.weight_sum"]

    @property
    def rank_count(self) -> torch.Tensor:
        return self.tensors["routing.rank_count"]

    @property
    def share(self) -> torch.Tensor:
        """Fraction of this layer's top-k slots that went to each expert (sums to 1)."""
        total = max(self.tokens * self.top_k, 1)
        return self.routed_count.double() / total

    def domain_share(self, domain: str) -> torch.Tensor:
        c = self.tensors[f"routing.count.{domain}"].double()
        return c / c.sum().clamp_min(1)

    @property
    def domains(self) -> list[str]:
        return sorted(k.split(".", 2)[2] for k in self.tensors if k.startswith("routing.count."))

    @property
    def sensitivity(self) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {}
        for k, v in self.tensors.items():
            if k.startswith("sensitivity."):
                _, proj, fmt = k.split(".", 2)
                out.setdefault(proj, {})[fmt] = v
        return out

    def hessian(self, proj: str, routed: bool = False) -> torch.Tensor:
        key = ("hessian_routed." if routed else "hessian.") + GROUP_OF_PROJ.get(proj, proj)
        if key not in self.tensors:
            raise UserError(
                f"statistics of layer {self.layer} hold no {key}; calibrate with --save-hessians to keep "
                "the full Hessians (only their diagonals are kept by default)."
            )
        h = self.tensors[key]
        return h.expand(self.num_experts, -1, -1) if h.shape[0] == 1 else h  # shared by all experts

    def input_tokens(self, proj: str, routed: bool = False) -> torch.Tensor:
        return self.tensors[("input_routed." if routed else "input.") + GROUP_OF_PROJ.get(proj, proj) + ".tokens"]


@dataclass
class Stats:
    directory: Path
    summary: dict
    layers: dict[int, LayerStats]
    probe: dict | None = None  # probe.json (per-layer KL probe, see probe.py), when calibration ran it
    tensor_probe: dict | None = None  # tensor_probe.json (per-tensor KL of non-expert weights), when measured

    @property
    def layer_scale(self) -> dict[int, float]:
        """Measured KL / predicted loss per probed MoE layer (layers without a scale left out)."""
        if not self.probe:
            return {}
        return {
            int(L): float(v["scale"]) for L, v in self.probe.get("layers", {}).items() if v.get("scale") is not None
        }


def load_stats(directory: str | Path, with_hessians: bool = True) -> Stats:
    directory = Path(directory)
    summary_path = directory / "summary.json"
    if not summary_path.exists():
        raise UserError(
            f"{directory} holds no calibration statistics (summary.json is missing); run `moequant calibrate` first."
        )
    summary = json.loads(summary_path.read_text())
    layers = {}
    for entry in summary["layers"]:
        L = int(entry["layer"])
        path = layer_file(directory, L)
        if not path.exists():
            raise UserError(f"{path} is missing: the statistics in {directory} are incomplete; run calibrate again.")
        tensors = load_file(str(path))
        if not with_hessians:
            tensors = {k: v for k, v in tensors.items() if not k.startswith("hessian")}
        layers[L] = LayerStats(L, int(summary["top_k"]), int(entry["tokens"]), tensors)
    return Stats(directory, summary, layers, probe=load_probe(directory), tensor_probe=load_tensor_probe(directory))


def chosen_hessian(stats: dict[str, torch.Tensor], group: str, idx, rule: HessianRule = HessianRule()):
    """(own [c] bool, [c, d, d] Hessian) for experts `idx`: each expert's own routed-token Hessian
    when it has at least `rule.min_tokens` routed tokens, else the all-tokens one; an own gate/up Hessian is
    shrunk toward the layer's all-token one by `rule.prior` tokens per input column (calibration.hessian_prior;
    settings.HESSIAN_PRIOR's note says why). The one place this rule lives (sensitivity, the probe's GPTQ and
    the quantize pass all ask here)."""
    routed = stats[f"hessian_routed.{group}"]
    idx = torch.as_tensor(idx, device=routed.device)
    chosen = routed[idx]  # a copy (integer indexing), so the all-tokens rows are written into it in place:
    # one [c, d, d] tensor, where expanding and torch.where made three (12 GB each for 58 DeepSeek-V3 experts)
    tokens = stats[f"input_routed.{group}.tokens"][idx.to(stats[f"input_routed.{group}.tokens"].device)]
    own = tokens.to(chosen.device) >= rule.min_tokens
    fallback = ~own
    if fallback.any():  # the all-tokens Hessian: one for all experts ([1, d, d]) or one each (routing-weighted)
        h_all = stats[f"hessian.{group}"].expand(routed.shape[0], -1, -1)
        chosen[fallback] = h_all[idx[fallback].to(h_all.device)].to(chosen.device)
    prior = rule.prior
    shared = stats.get(f"hessian.{group}")  # gate/up's all-token Hessian is one for the layer: [1, d, d]
    if group == "gate_up" and prior > 0 and shared is not None and shared.shape[0] == 1:
        k = prior * chosen.shape[-1]
        h_all = shared[0].to(chosen.device, chosen.dtype)
        for i, (mine, n) in enumerate(zip(own.tolist(), tokens.tolist())):
            if mine:  # in place: one [c, d, d] tensor, as above
                chosen[i].mul_(n / (n + k)).add_(h_all, alpha=k / (n + k))
    return own, chosen


# The probe files (measure.probe writes them; their schemas are above)


def _write_json(path: Path, data: dict) -> Path:
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")
    return path


def _load_json(path: Path, schema: str) -> dict | None:
    """The file's dict, or None when it is missing or of another schema (probe_samples 0, older runs)."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return data if data.get("schema") == schema else None


def write_probe(stats_dir: str | Path, probe: dict) -> Path:
    return _write_json(Path(stats_dir) / PROBE_FILE, probe)


def load_probe(stats_dir: str | Path) -> dict | None:
    """probe.json's dict, or None when the statistics have no probe."""
    return _load_json(Path(stats_dir) / PROBE_FILE, PROBE_SCHEMA)


def write_tensor_probe(stats_dir: str | Path, probe: dict) -> Path:
    return _write_json(Path(stats_dir) / TENSOR_PROBE_FILE, probe)


def load_tensor_probe(stats_dir: str | Path) -> dict | None:
    """tensor_probe.json's dict, or None when the statistics have no per-tensor probe."""
    return _load_json(Path(stats_dir) / TENSOR_PROBE_FILE, TENSOR_PROBE_SCHEMA)
