"""moequant.report: bytes from the files themselves, the report.json contract, and the HTML in Chromium."""

from __future__ import annotations

import json
import math
import os
import re
import select
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny import build_tiny, tiny_config

from moequant import formats
from moequant.arch import adapter_for
from moequant.export.write import export_checkpoint
from moequant.io.checkpoint import open_checkpoint
from moequant.plan.memory import checkpoint_bytes, gpus_needed, memory_account
from moequant.report import build_report

# ---------------------------------------------------------------- independent byte counting


def _file_tensors(directory) -> dict[str, tuple[int, int]]:
    """name -> (bytes, elements) read straight from every safetensors file, checked against its size."""
    sizes = {
        "BOOL": 1,
        "U8": 1,
        "I8": 1,
        "F8_E4M3": 1,
        "F8_E5M2": 1,
        "F8_E8M0": 1,
        "I16": 2,
        "F16": 2,
        "BF16": 2,
        "I32": 4,
        "F32": 4,
        "I64": 8,
        "F64": 8,
    }
    out = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        header.pop("__metadata__", None)
        data = 0
        for name, t in header.items():
            begin, end = t["data_offsets"]
            out[name] = (end - begin, math.prod(t["shape"]) if t["shape"] else 1)
            data += end - begin
            assert end - begin == out[name][1] * sizes[t["dtype"]]
        assert data == path.stat().st_size - 8 - n  # every byte of the file is a header or a tensor
    return out


ROLE_PATTERNS = [  # the tensor naming of Qwen2-MoE / gpt-oss, written out independently of the adapters
    ("routed_expert", r"\.mlp\.experts\."),
    ("shared_expert_gate", r"\.mlp\.shared_expert_gate\."),
    ("shared_expert", r"\.mlp\.shared_expert\."),
    ("router", r"\.mlp\.(gate|router)\."),
    ("attention", r"\.self_attn\."),
    ("norm", r"norm\.weight$"),
    ("embedding", r"^model\.embed_tokens\."),
    ("lm_head", r"^lm_head\."),
]


def _role_of(name: str) -> str:
    for role, pattern in ROLE_PATTERNS:
        if re.search(pattern, name):
            return role
    return "other"


# tensors that record a layout (a shape, an identity column order), not weights: a role's bytes
# leave them out (they are the weights' own bytes, what the plan counts), the total keeps them
METADATA = re.compile(r"\.(weight_shape|g_idx)$")


def _bytes_by_role(directory) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, (nbytes, _) in _file_tensors(directory).items():
        if not METADATA.search(name):
            out[_role_of(name)] = out.get(_role_of(name), 0) + nbytes
    return out


def _metadata_bytes(directory) -> int:
    return sum(n for name, (n, _) in _file_tensors(directory).items() if METADATA.search(name))


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny Qwen2-MoE (routed + shared experts) and an export with int8 / fp8 experts mixed per expert."""
    root = tmp_path_factory.mktemp("qwen")
    src = build_tiny("qwen2_moe", root / "orig")
    ckpt = open_checkpoint(src)
    ad = adapter_for(ckpt.config)
    fmt = {
        (L, e): ("fp8-channel" if (L + e) % 3 == 0 else "int8-channel")
        for L in ad.moe_layers
        for e in range(ad.num_experts)
    }
    quantized = {
        (L, e, p): formats.quantize(ad.read_expert(ckpt, L, e, p).float(), formats.parse_key(fmt[(L, e)]))
        for (L, e) in fmt
        for p in ad.projections
    }
    out = export_checkpoint(src, quantized, root / "runs" / "mixed" / "checkpoint", target="transformers")
    return {"src": src, "ckpt": out, "adapter": ad, "formats": fmt, "root": root}


def test_bytes_by_role_from_file_headers(qwen):
    for directory in (qwen["src"], qwen["ckpt"]):
        expected = _bytes_by_role(directory)
        got = checkpoint_bytes(directory)
        assert got["by_role"] == expected
        assert got["total"] == sum(b for b, _ in _file_tensors(directory).values())
        assert got["layout_metadata"] == _metadata_bytes(directory)
    assert checkpoint_bytes(qwen["ckpt"])["layout_metadata"] > 0  # compressed-tensors' weight_shape
    orig, quant = _bytes_by_role(qwen["src"]), _bytes_by_role(qwen["ckpt"])
    assert quant["routed_expert"] < orig["routed_expert"] / 1.5
    assert {r: b for r, b in quant.items() if r != "routed_expert"} == {
        r: b for r, b in orig.items() if r != "routed_expert"
    }
    # per expert: the export's own tensors of that expert's three modules
    got = checkpoint_bytes(qwen["ckpt"])["experts"]
    files = _file_tensors(qwen["ckpt"])
    for (L, e), b in got.items():
        assert b == sum(
            n for name, (n, _) in files.items() if f"layers.{L}.mlp.experts.{e}." in name and not METADATA.search(name)
        )


@pytest.mark.parametrize(
    "layout,key", [("gptq", "int8-channel"), ("awq", "int4-g32-asym"), ("deepseek-fp8", "fp8-block128")]
)
def test_other_layouts_bytes_by_role(qwen, tmp_path, layout, key):
    ad, src = qwen["adapter"], qwen["src"]
    ckpt = open_checkpoint(src)
    spec = formats.parse_key(key)
    projs = ("gate", "up") if layout == "awq" else ad.projections  # down has 16 columns: no int4 group fits
    quantized = {
        (L, e, p): formats.quantize(ad.read_expert(ckpt, L, e, p).float(), spec)
        for L in ad.moe_layers
        for e in range(ad.num_experts)
        for p in projs
    }
    out = export_checkpoint(src, quantized, tmp_path / layout, layout=layout, target="transformers")
    got = checkpoint_bytes(out)
    assert got["by_role"] == _bytes_by_role(out)
    assert "other" not in got["by_role"]
    assert got["by_role"]["routed_expert"] < _bytes_by_role(src)["routed_expert"]


def test_fused_gpt_oss_mxfp4_bytes_by_role(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("gpt_oss")
    cfg.intermediate_size = 64  # mxfp4 groups 32 input columns: the down projection needs a multiple
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "orig")
    ckpt = open_checkpoint(tmp_path / "orig")
    ad = adapter_for(ckpt.config)
    spec = formats.parse_key("mxfp4")
    quantized = {
        (L, e, p): formats.quantize(ad.read_expert(ckpt, L, e, p).float(), spec)
        for L in ad.moe_layers
        for e in range(ad.num_experts)
        for p in ad.projections
    }
    out = export_checkpoint(tmp_path / "orig", quantized, tmp_path / "q", layout="gpt-oss-mxfp4")
    assert any(n.endswith("_blocks") for n in _file_tensors(out))
    for directory in (tmp_path / "orig", out):
        assert checkpoint_bytes(directory)["by_role"] == _bytes_by_role(directory)
    mem = memory_account(tmp_path / "orig", out)
    routed = [(n, b) for n, b in _file_tensors(out).items() if ".mlp.experts." in n]
    matrices = [(n, b) for n, b in routed if not n.endswith("_bias")]  # what the budget counts
    weights = sum(
        e for n, (_, e) in _file_tensors(tmp_path / "orig").items() if ".mlp.experts." in n and not n.endswith("_bias")
    )
    assert mem["routed_expert_matrices"] == {
        "weights": weights,
        "bytes_original": 2 * weights,
        "bytes_quantized": sum(b for _, (b, _) in matrices),
    }
    assert mem["by_role"]["routed_expert"]["bytes_quantized"] == sum(b for _, (b, _) in routed)  # biases too
    assert mem["bits_per_weight_experts"] == 8 * sum(b for _, (b, _) in matrices) / weights == 4.25  # biases stay bf16


def test_memory_account_numbers(qwen):
    ad = qwen["adapter"]
    mem = memory_account(qwen["src"], qwen["ckpt"])
    orig_files, quant_files = _file_tensors(qwen["src"]), _file_tensors(qwen["ckpt"])
    weights = sum(e for _, e in orig_files.values())
    assert mem["weights"] == weights
    assert mem["bytes_original"] == sum(b for b, _ in orig_files.values())
    assert mem["bytes_quantized"] == sum(b for b, _ in quant_files.values())
    assert mem["bits_per_weight_original"] == pytest.approx(16.0)
    assert mem["layout_metadata_bytes"] == _metadata_bytes(qwen["ckpt"]) > 0
    assert mem["bits_per_weight"] == pytest.approx(
        8 * (mem["bytes_quantized"] - mem["layout_metadata_bytes"]) / weights
    )
    routed_w = sum(e for n, (_, e) in orig_files.items() if _role_of(n) == "routed_expert")
    q_roles = _bytes_by_role(qwen["ckpt"])
    assert mem["bits_per_weight_experts"] == pytest.approx(8 * q_roles["routed_expert"] / routed_w)
    assert 8 < mem["bits_per_weight_experts"] < 10  # int8 / fp8 codes plus per-channel scales
    for role, v in mem["by_role"].items():
        assert v["bytes_quantized"] == q_roles[role]

    # bytes per decoded token, uniform use: all but embedding and routed experts, plus k/E of them
    k, E = ad.top_k, ad.num_experts
    for key, roles in (("original", _bytes_by_role(qwen["src"])), ("quantized", q_roles)):
        expected = sum(roles.values()) - roles["embedding"] - roles["routed_expert"] + roles["routed_expert"] * k / E
        assert mem["bytes_per_token"][key] == round(expected)
    # with routing shares: each expert's bytes weighted by top_k * share
    shares = {L: [1.0] + [0.0] * (E - 1) for L in ad.moe_layers}  # only expert 0 is ever used
    skewed = memory_account(qwen["src"], qwen["ckpt"], shares)
    expert0 = sum(
        b for n, (b, _) in quant_files.items() if re.search(r"\.mlp\.experts\.0\.", n) and not METADATA.search(n)
    )
    fixed = sum(q_roles.values()) - q_roles["embedding"] - q_roles["routed_expert"]
    assert skewed["bytes_per_token"]["quantized"] == round(fixed + k * expert0)

    assert gpus_needed(100e9) == {"24GB": 5, "80GB": 2, "141GB": 1}  # 120 GB with headroom
    assert gpus_needed(20e9) == {"24GB": 1, "80GB": 1, "141GB": 1}  # exactly 24 GB fits one
    assert gpus_needed(20e9 + 1)["24GB"] == 2
    assert mem["gpus_needed"]["original"] == gpus_needed(mem["bytes_original"])


# ---------------------------------------------------------------- report.json


def _fake_stats(directory: Path, ad, domains=("code", "prose"), tokens=100) -> Path:
    """A stats/ directory in the documented layout, with routing counts and sensitivities chosen here."""
    directory.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    E, k = ad.num_experts, ad.top_k
    layers = []
    for L in ad.moe_layers:
        per_domain = {}
        for d in domains:
            c = torch.randint(1, 20, (E,), generator=g).double()
            per_domain[d] = (c / c.sum() * tokens * k / len(domains)).round().long()
        per_domain[domains[0]][0] += (-int(sum(per_domain.values()).sum())) % k  # real counts sum to tokens * k
        count = sum(per_domain.values())
        t = {
            "routing.count": count,
            "routing.weight_sum": count.double(),
            "routing.rank_count": torch.zeros(E, k, dtype=torch.int64),
        }
        t.update({f"routing.count.{d}": c for d, c in per_domain.items()})
        for p in ad.projections:
            for key in ("int8-channel", "fp8-channel"):
                t[f"sensitivity.{p}.{key}"] = torch.rand(E, generator=g, dtype=torch.float64)
        save_file(t, str(directory / f"layer_{L:03d}.safetensors"))
        layers.append({"layer": L, "tokens": int(count.sum()) // k})
    (directory / "summary.json").write_text(json.dumps({"top_k": k, "layers": layers, "domains": list(domains)}))
    return directory


def _plan(qwen) -> dict:
    tensors = [
        {
            "name": f"e{L}.{e}.{p}",
            "role": "routed_expert",
            "layer": L,
            "expert": e,
            "proj": p,
            "format": f,
            "predicted_loss": 0.001 * (e + 1),
        }
        for (L, e), f in qwen["formats"].items()
        for p in qwen["adapter"].projections
    ]
    return {
        "schema": "moequant.plan/1",
        "target": "transformers",
        "method": "budget",
        "tensors": tensors,
        "summary": {
            "bits_per_weight": {"overall": 12.0, "routed_experts": 8.5},
            "predicted_loss": 1.0,
            "per_expert_alternative": {"predicted_loss": 0.5, "routed_bytes": 30000, "candidates": [], "counts": {}},
            "uniform_alternatives": [{"format": "int8-channel", "routed_bytes": 31000, "predicted_loss": 2.0}],
        },
        "notes": ["a note from the policy"],
    }


@pytest.fixture(scope="module")
def quality(qwen):
    from transformers import AutoModelForCausalLM

    from moequant.evaluate import evaluate
    from moequant.io.loader import load

    ref = AutoModelForCausalLM.from_pretrained(str(qwen["src"]), dtype=torch.float32).eval()
    q = load(qwen["ckpt"], dtype=torch.float32)
    return evaluate(ref, q, torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(0)), batch_size=4)


DOCUMENTED_KEYS = [
    "model",
    "recipe",
    "target",
    "memory.bytes_original",
    "memory.bytes_quantized",
    "memory.bits_per_weight",
    "memory.bits_per_weight_experts",
    "memory.by_role",
    "quality.ppl_original",
    "quality.ppl_quantized",
    "quality.kl_mean",
    "quality.kl_p99",
    "quality.top1_agreement",
    "quality.routing_agreement",
    "experts",
    "timings",
    "memory.bytes_per_token.original",
    "memory.bytes_per_token.quantized",
    "memory.gpus_needed.original.24GB",
    "memory.gpus_needed.quantized.141GB",
]


def _strict_json(path):
    def refuse(token):
        raise ValueError(f"non-standard JSON constant {token}")

    return json.loads(Path(path).read_text(), parse_constant=refuse)


def test_report_json_contract(qwen, quality, tmp_path):
    ad = qwen["adapter"]
    stats = _fake_stats(tmp_path / "stats", ad)
    out = tmp_path / "run"
    recipe = {"name": "selective", "experts": {"budget": {"bits_per_weight": 8.5}}}
    report = build_report(
        model=str(qwen["src"]),
        checkpoint=qwen["ckpt"],
        recipe=recipe,
        plan=_plan(qwen),
        quality=quality,
        stats=stats,
        timings={"calibrate": 1.5, "evaluate": 2},
        output_dir=out,
    )
    data = _strict_json(out / "report.json")
    assert data == json.loads(json.dumps(report))
    for dotted in DOCUMENTED_KEYS:
        node = data
        for part in dotted.split("."):
            assert part in node, f"report.json lacks {dotted}"
            node = node[part]
    assert data["recipe"] == recipe and data["target"] == "transformers"
    assert data["timings"] == {"calibrate": 1.5, "evaluate": 2.0}
    for key in ("ppl_original", "ppl_quantized", "kl_mean", "kl_p99", "top1_agreement", "routing_agreement"):
        assert data["quality"][key] == pytest.approx(quality[key])
    assert data["memory"]["bytes_quantized"] == sum(b for b, _ in _file_tensors(qwen["ckpt"]).values())

    rows = {(r["layer"], r["expert"]): r for r in data["experts"]}
    assert len(rows) == len(ad.moe_layers) * ad.num_experts
    raw = {L: json.loads(json.dumps(None)) for L in ad.moe_layers}
    from safetensors.torch import load_file

    measured = {(r["layer"], r["expert"]): r for r in quality["experts"]}
    for L in ad.moe_layers:
        raw[L] = load_file(str(stats / f"layer_{L:03d}.safetensors"))
        count = raw[L]["routing.count"].double()
        for e in range(ad.num_experts):
            row = rows[(L, e)]
            assert {"layer", "expert", "share", "format", "error"} <= row.keys()
            assert row["share"] == pytest.approx(float(count[e] / count.sum()))
            for d in ("code", "prose"):
                c = raw[L][f"routing.count.{d}"].double()
                assert row["share_by_domain"][d] == pytest.approx(float(c[e] / c.sum()))
            fmt = qwen["formats"][(L, e)]
            assert row["format"] == fmt
            assert row["predicted_error"] == pytest.approx(
                sum(float(raw[L][f"sensitivity.{p}.{fmt}"][e]) for p in ad.projections)
            )
            assert row["predicted_loss"] == pytest.approx(3 * 0.001 * (e + 1))
            assert row["error"] == measured[(L, e)]["error"]
    md = (out / "report.md").read_text()
    assert "## Memory" in md and "## Quality" in md and "a note from the policy" in md
    assert "## Plan vs alternatives" in md and "uniform int8-channel" in md
    assert data["plan"]["per_expert_alternative"]["predicted_loss"] == 0.5

    # without a plan, formats come from what the export recorded in the checkpoint
    bare = build_report(model=str(qwen["src"]), checkpoint=qwen["ckpt"])
    assert {(r["layer"], r["expert"]): r["format"] for r in bare["experts"]} == qwen["formats"]
    assert bare["quality"] is None and bare["target"] is None


# ---------------------------------------------------------------- report.html in headless Chromium


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (fds 3 / 4, NUL-framed JSON)."""

    def __init__(self, binary: str, profile: Path):
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        # in the child the protocol reads fd 3 and writes fd 4; pass_fds keeps those two open after wire()
        def wire():
            a, b = os.dup(to_child_r), os.dup(from_child_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [
                binary,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--remote-debugging-pipe",
                "--no-first-run",
                f"--user-data-dir={profile}",
                "--disable-extensions",
                "about:blank",
            ],
            preexec_fn=wire,
            pass_fds=(3, 4),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict] = []

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._from_child], [], [], max(left, 0))
            if not ready:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._from_child, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 60) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        for ev in self.events:
            if ev.get("method") == method:
                return ev
        while True:
            ev = self._read(deadline)
            self.events.append(ev)
            if ev.get("method") == method:
                return ev

    def close(self):
        try:
            self.send("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self._to_child)
        os.close(self._from_child)


def render_page(html_path: Path, profile: Path) -> dict:
    """Load a page; return its images, console/exception/log errors and a full-page PNG screenshot."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    assert binary, (
        "Chromium is required for the report rendering test and is not installed: "
        "run `apt-get install -y chromium` (Debian package `chromium`)."
    )
    browser = Chromium(binary, profile)
    try:
        target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            browser.send(f"{domain}.enable", session=session)
        browser.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": 1200, "height": 900, "deviceScaleFactor": 1, "mobile": False},
            session=session,
        )
        browser.send("Page.navigate", {"url": html_path.resolve().as_uri()}, session=session)
        browser.wait_event("Page.loadEventFired")
        images = browser.send(
            "Runtime.evaluate",
            {
                "returnByValue": True,
                "expression": """
            Array.from(document.images).map(i => {
                const r = i.getBoundingClientRect();
                return {figure: i.closest('figure') && i.closest('figure').id, complete: i.complete,
                        width: i.naturalWidth, height: i.naturalHeight,
                        x: r.left + window.scrollX, y: r.top + window.scrollY, w: r.width, h: r.height};
            })""",
            },
            session=session,
        )["result"]["value"]
        metrics = browser.send("Page.getLayoutMetrics", session=session)["cssContentSize"]
        shot = browser.send(
            "Page.captureScreenshot",
            {
                "format": "png",
                "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": metrics["width"], "height": metrics["height"], "scale": 1},
            },
            session=session,
        )["data"]
        errors = [
            ev
            for ev in browser.events
            if (ev.get("method") == "Runtime.consoleAPICalled" and ev["params"]["type"] in ("error", "assert"))
            or ev.get("method") == "Runtime.exceptionThrown"
            or (ev.get("method") == "Log.entryAdded" and ev["params"]["entry"]["level"] == "error")
        ]
        return {"images": images, "errors": errors, "screenshot": shot}
    finally:
        browser.close()


def test_report_html_renders_every_plot_in_chromium(qwen, quality, tmp_path):
    import base64
    import io

    from PIL import Image

    ad = qwen["adapter"]
    stats = _fake_stats(tmp_path / "stats", ad)
    runs = tmp_path / "runs"
    # a neighbour run (the unquantized model against itself) so the Pareto plot has two points
    build_report(
        model=str(qwen["src"]), checkpoint=qwen["src"], quality={**quality, "kl_mean": 0.0}, output_dir=runs / "bf16"
    )
    out = runs / "mixed"
    build_report(
        model=str(qwen["src"]),
        checkpoint=qwen["ckpt"],
        plan=_plan(qwen),
        quality=quality,
        stats=stats,
        timings={"evaluate": 1.0},
        output_dir=out,
    )
    html_text = (out / "report.html").read_text()
    assert "<script" not in html_text and "http" not in html_text  # self-contained, nothing fetched

    page = render_page(out / "report.html", tmp_path / "profile")
    assert page["errors"] == []
    figures = {i["figure"] for i in page["images"]}
    assert figures == {
        "plot-routing-share",
        "plot-format-map",
        "plot-error-vs-share",
        "plot-memory-by-role",
        "plot-pareto",
    }
    shot = Image.open(io.BytesIO(base64.b64decode(page["screenshot"]))).convert("L")
    for img in page["images"]:
        assert img["complete"] and img["width"] > 100 and img["height"] > 100, img
        region = shot.crop((int(img["x"]), int(img["y"]), int(img["x"] + img["w"]), int(img["y"] + img["h"])))
        hist = region.histogram()
        dark = sum(hist[:200]) / max(sum(hist), 1)
        assert dark > 0.02, f"{img['figure']} looks blank in the screenshot ({dark:.3%} non-white pixels)"
    hist = shot.histogram()
    assert sum(1 for h in hist if h) > 50  # many grey levels: text, tables and plots, not a blank page
