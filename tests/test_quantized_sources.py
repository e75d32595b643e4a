"""Quantized sources (issue 20): DeepSeek FP8-block, compressed-tensors INT4 and gpt-oss MXFP4
checkpoints read natively, dequantized per tensor on the fly, never upcast to disk.

The sources come from benchmarks/make_sources.py. Independent references: torch float8 arithmetic
written out here (FP8-block), compressed-tensors' own dequantizer (INT4), transformers' MXFP4
dequantizing loader (gpt-oss), and runs of the whole pipeline on a float32 copy of the
dequantized weights, which a bf16 model of the same weights would be.
"""

from __future__ import annotations

import glob
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from benchmarks.make_sources import make_deepseek_fp8, make_gpt_oss_mxfp4, make_qwen_int4
from moequant.cli import main
from moequant.errors import UserError
from moequant.formats import unpack_e2m1, unpack_int32
from moequant.io.checkpoint import copy_aux_files, open_checkpoint

SMALL = [
    "calibration.samples=8",
    "calibration.seq_len=64",
    "calibration.probe_samples=0",
    "evaluate.samples=4",
    "evaluate.seq_len=64",
]
# per source: the recipe and its overrides (gpt-oss's fused experts export only in its own MXFP4 layout)
RECIPES = {
    "deepseek": ("recipes/uniform-int4.yaml", []),
    "qwen": ("recipes/uniform-int4.yaml", []),
    "gpt_oss": ("recipes/mxfp4-experts.yaml", ["algorithms.mxfp4=gptq", "export.format=gpt-oss-mxfp4"]),
}
MAKERS = {"deepseek": make_deepseek_fp8, "qwen": make_qwen_int4, "gpt_oss": make_gpt_oss_mxfp4}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    return {kind: make(root / kind) for kind, make in MAKERS.items()}


def float32_copy(source: Path, directory: Path) -> Path:
    """The dequantized logical model as a plain float32 checkpoint (the same reader, save_file)."""
    ckpt = open_checkpoint(source)
    tensors = {}
    for name in ckpt.keys():
        t = ckpt.get(name)
        tensors[name] = t.float() if t.is_floating_point() else t
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in ckpt.config.items() if k != "quantization_config"}
    (directory / "config.json").write_text(json.dumps(config))
    copy_aux_files(source, directory)
    return directory


@pytest.fixture(scope="module")
def copies(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("copies")
    return {kind: float32_copy(path, root / kind) for kind, path in sources.items()}


def _stored(path) -> dict:
    out = {}
    for f in sorted(glob.glob(str(Path(path) / "*.safetensors"))):
        out.update(load_file(f))
    return out


# ----------------------------------------------------------------------------- the reader


def test_fp8_block_source_decodes_as_float8_times_its_block_scales(sources):
    """Every FP8 weight = float8_e4m3fn code (torch's own decoding) times the fp32 scale of its
    128x128 block, ragged edges included; the view lists no scale tensor."""
    ckpt = open_checkpoint(sources["deepseek"])
    stored = _stored(sources["deepseek"])
    fp8 = [n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn]
    assert len(fp8) == len(ckpt.encodings) > 50
    assert any(stored[n].shape[-1] % 128 for n in fp8) and any(stored[n].shape[-1] > 128 for n in fp8)
    for name in fp8:
        codes, s = stored[name].double(), stored[name + "_scale_inv"].double()
        rows, cols = codes.shape
        assert s.shape == ((rows + 127) // 128, (cols + 127) // 128)
        expected = codes * s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
        got = ckpt.get(name)
        # the exact product (float64) rounded once to float32: what a float32 multiply gives
        assert got.dtype == torch.float32 and torch.equal(got, expected.float()), name
        assert ckpt.shape(name) == (rows, cols) and name + "_scale_inv" not in ckpt
    # the MTP layer (num_nextn_predict_layers: 1) is part of the logical model
    assert ckpt.config["num_nextn_predict_layers"] == 1
    assert f"model.layers.{ckpt.config['num_hidden_layers']}.eh_proj.weight" in ckpt.encodings


def test_int4_compressed_tensors_source_equals_compressed_tensors_own_decompression(sources):
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    path = sources["qwen"]
    ckpt = open_checkpoint(path)
    assert {e.description for e in ckpt.encodings.values()} == {"pack-quantized int4-g32-sym"}
    assert all(ckpt.encodings[n] for n in ckpt.keys() if ".mlp.experts." in n)
    theirs = CompressedTensorsDequantizer(str(path), dtype=torch.float32).validate(_stored(path))
    assert set(theirs) == set(ckpt.keys())
    for name in ckpt.keys():
        # compressed-tensors multiplies in the scale's dtype (bf16); ours is the exact float32 product
        assert torch.equal(ckpt.get(name).to(torch.bfloat16), theirs[name].to(torch.bfloat16)), name
        assert ckpt.shape(name) == tuple(theirs[name].shape)


def test_mxfp4_source_loads_as_transformers_dequantizes_it(sources):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    import moequant

    path = sources["gpt_oss"]
    theirs = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, quantization_config=Mxfp4Config(dequantize=True)
    )
    ours = dict(moequant.load(path).named_parameters())
    params = dict(theirs.named_parameters())
    assert ours.keys() == params.keys()
    for name, p in params.items():
        assert torch.equal(ours[name], p), name
    ckpt = open_checkpoint(path)
    assert ckpt.shape("model.layers.0.mlp.experts.gate_up_proj") == (4, 64, 128)  # [E, in, 2 * out], as in memory


# ----------------------------------------------------------------------------- the pipeline


def _apply(kind, model, out):
    recipe, extra = RECIPES[kind]
    args = ["apply", "--recipe", recipe, "--model", str(model), "--output", str(out)]
    for s in SMALL + extra:
        args += ["--set", s]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


def _codes(checkpoint) -> dict[str, torch.Tensor]:
    """The integer / e2m1 codes of every quantized tensor of an export, unpacked."""
    ckpt = open_checkpoint(checkpoint, decode=False)
    out = {}
    for name in ckpt.keys():
        if name.endswith(".weight_packed"):
            shape = ckpt.get(name[: -len("packed")] + "shape").tolist()
            out[name] = unpack_int32(ckpt.get(name), 4, shape[-1])
        elif name.endswith("_blocks"):
            out[name] = unpack_e2m1(ckpt.get(name))
    return out


@pytest.mark.parametrize("kind", ["deepseek", "qwen", "gpt_oss"])
def test_apply_from_the_quantized_source_equals_a_run_from_its_float32_copy(kind, sources, copies, tmp_path):
    a = _apply(kind, sources[kind], tmp_path / "source")
    b = _apply(kind, copies[kind], tmp_path / "copy")
    plan_a, plan_b = (json.loads((r / "plan.json").read_text()) for r in (a, b))
    key = lambda t: (t["name"], t.get("expert"), t.get("proj"), t["format"], t.get("algorithm"))  # noqa: E731
    assert sorted(map(key, plan_a["tensors"])) == sorted(map(key, plan_b["tensors"]))
    codes_a, codes_b = _codes(a / "checkpoint"), _codes(b / "checkpoint")
    assert codes_a.keys() == codes_b.keys() and codes_a
    equal = sum(int((codes_a[n] == codes_b[n]).sum()) for n in codes_a)
    total = sum(codes_a[n].numel() for n in codes_a)
    assert equal / total >= 0.999, equal / total

    # the quality reference is the source as served: its dequantized weights
    qa, qb = (json.loads((r / "report.json").read_text())["quality"] for r in (a, b))
    assert qa["ppl_original"] == pytest.approx(qb["ppl_original"], rel=1e-6)
    assert qa["kl_mean"] == pytest.approx(qb["kl_mean"], rel=1e-3, abs=1e-7)

    # kept tensors are written dense (bf16), the output's quantization_config describes the output only
    config = json.loads((a / "checkpoint" / "config.json").read_text())
    source_qc = open_checkpoint(sources[kind]).config["quantization_config"]
    assert config["quantization_config"]["quant_method"] in ("compressed-tensors", "mxfp4")
    assert "weight_block_size" not in config["quantization_config"] or source_qc["quant_method"] != "fp8"
    out = open_checkpoint(a / "checkpoint", decode=False)
    src = open_checkpoint(sources[kind])
    for name in src.encodings:
        if name in out.stored:  # not re-quantized by the recipe
            assert out.stored[name].dtype == "BF16", name
            assert torch.equal(out.get(name), src.get(name).to(torch.bfloat16)), name
    if kind == "deepseek":  # the MTP layer is carried through, dequantized to bf16
        mtp = f"model.layers.{src.config['num_hidden_layers']}."
        carried = [n for n in src.keys() if n.startswith(mtp)]
        assert carried and all(n in out.stored for n in carried)
        assert any(n in src.encodings for n in carried)
        import moequant

        moequant.load(a / "checkpoint")  # loadable


def test_an_fp8_block_export_carries_the_mtp_layer_unchanged(sources, tmp_path):
    """DeepSeek's MTP layer (no transformers module, no adapter role): written in the source's own
    FP8 codes and scales when the output is FP8-block, and listed as FP8 (not in modules_to_not_convert)."""
    out = tmp_path / "fp8"
    args = ["apply", "--recipe", "recipes/fp8-block.yaml", "--model", str(sources["deepseek"]), "--output", str(out)]
    result = CliRunner().invoke(main, args + [a for s in SMALL for a in ("--set", s)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    src = open_checkpoint(sources["deepseek"], decode=False)
    exported = open_checkpoint(out / "checkpoint", decode=False)
    mtp = f"model.layers.{src.config['num_hidden_layers']}."
    fp8 = [n for n in src.keys() if n.startswith(mtp) and src.dtype(n) == "F8_E4M3"]
    assert fp8
    for name in fp8 + [n[: -len("weight")] + "weight_scale_inv" for n in fp8]:
        assert torch.equal(exported.get(name).view(torch.uint8), src.get(name).view(torch.uint8)), name
    qc = exported.config["quantization_config"]
    assert qc["quant_method"] == "fp8" and not any(
        m.startswith(mtp) and m + ".weight" in fp8 for m in qc["modules_to_not_convert"]
    )
    assert f"{mtp}shared_head.head" in qc["modules_to_not_convert"]  # a bf16 Linear, as in the source


def test_eval_reference_of_a_quantized_source_is_its_dequantized_weights(sources, copies, tmp_path):
    from moequant.evaluate import evaluate_checkpoints

    # int8 per channel, so the checkpoint differs from the source (GPTQ on the searched grid gives an
    # int4-g32 source back exactly in its own format)
    args = [
        "apply",
        "--recipe",
        "recipes/uniform-int4.yaml",
        "--model",
        str(copies["qwen"]),
        "--output",
        str(tmp_path / "run"),
    ]
    result = CliRunner().invoke(
        main, args + [a for s in SMALL + ["experts.format=int8"] for a in ("--set", s)], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    run = tmp_path / "run"
    kwargs = dict(dataset="builtin:stdlib-code", samples=2, seq_len=32, dtype=torch.float32, progress=False)
    from_source = evaluate_checkpoints(run / "checkpoint", sources["qwen"], **kwargs)
    from_copy = evaluate_checkpoints(run / "checkpoint", copies["qwen"], **kwargs)
    for key in ("ppl_original", "ppl_quantized", "kl_mean", "kl_max", "top1_agreement", "moe_output_error"):
        assert from_source[key] == pytest.approx(from_copy[key], rel=1e-9, abs=1e-12), key
    assert from_source["kl_mean"] > 0


@pytest.mark.parametrize("kind", ["deepseek", "qwen", "gpt_oss"])
def test_inspect_counts_parameters_not_scales_and_the_real_bytes(kind, sources, copies):
    from moequant.plan.memory import inspect_model

    a, b = inspect_model(str(sources[kind])), inspect_model(str(copies[kind]))
    assert a["params_on_disk"] == b["params_on_disk"] and a["total_params"] == b["total_params"]
    on_disk = 0
    for f in glob.glob(str(sources[kind] / "*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
        on_disk += Path(f).stat().st_size - 8 - n
    assert a["bytes_on_disk"] == on_disk < b["bytes_on_disk"] / 3  # float32 copy: 4 bytes a weight
    assert a["tensors_on_disk"] > b["tensors_on_disk"] and a["source_formats"]
    result = CliRunner().invoke(main, ["inspect", str(sources[kind])])
    assert result.exit_code == 0 and "stored quantized:" in result.output, result.output


# ----------------------------------------------------------------------------- bad input


def _broken_copy(source: Path, directory: Path, edit) -> Path:
    shutil.copytree(source, directory)
    (shard,) = directory.glob("*.safetensors")
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return directory


def _refused(model, tmp_path, *message):
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main,
        [
            "apply",
            "--recipe",
            "recipes/uniform-int4.yaml",
            "--model",
            str(model),
            "--output",
            str(out),
            *[a for s in SMALL for a in ("--set", s)],
        ],
    )
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]  # beside progress bars
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    line = errors[0]
    for part in message:
        assert part in line, line
    assert not out.exists()
    return line


def test_a_truncated_fp8_shard_is_refused_naming_its_tensor(sources, tmp_path):
    bad = tmp_path / "truncated"
    shutil.copytree(sources["deepseek"], bad)
    (shard,) = bad.glob("*.safetensors")
    with open(shard, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    _refused(bad, tmp_path, repr(last))


def test_fp8_scales_of_the_wrong_shape_are_refused_naming_the_tensor(sources, tmp_path):
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"

    def edit(t):
        assert t[name].shape == (2, 1)  # [ceil(160/128), ceil(64/128)]
        t[name] = t[name][:1]

    bad = _broken_copy(sources["deepseek"], tmp_path / "shape", edit)
    _refused(bad, tmp_path, repr(name), "[1, 1]", "[2, 1]")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_scales_are_refused_naming_the_tensor(value, sources, tmp_path):
    name = "model.layers.0.self_attn.kv_b_proj.weight_scale_inv"

    def edit(t):
        t[name][0, 0] = value

    bad = _broken_copy(sources["deepseek"], tmp_path / "nan", edit)
    _refused(bad, tmp_path, repr(name), "1 NaN or infinite scales")
    with pytest.raises(UserError, match="NaN or infinite scales"):
        open_checkpoint(bad).get(name[: -len("_scale_inv")])


def test_int4_scales_of_the_wrong_shape_and_nan_scales_are_refused(sources, tmp_path):
    name = "model.layers.2.mlp.experts.5.up_proj.weight_scale"

    def narrow(t):
        t[name] = t[name][:, :1].contiguous()

    _refused(_broken_copy(sources["qwen"], tmp_path / "shape", narrow), tmp_path, repr(name))

    def nan(t):
        t[name][3, 1] = float("nan")

    with pytest.raises(UserError, match=rf"{name}.*NaN or infinite scales"):
        open_checkpoint(_broken_copy(sources["qwen"], tmp_path / "nan", nan)).get(name[: -len("_scale")])


def test_nan_mxfp4_scales_are_refused(sources, tmp_path):
    name = "model.layers.1.mlp.experts.down_proj_scales"

    def edit(t):
        t[name][0, 0, 0] = 255  # e8m0's NaN

    bad = _broken_copy(sources["gpt_oss"], tmp_path / "nan", edit)
    with pytest.raises(UserError, match=rf"{name}.*1 NaN or infinite scales"):
        open_checkpoint(bad).get("model.layers.1.mlp.experts.down_proj")


@pytest.mark.parametrize(
    "qc, message",
    [
        (
            {"quant_method": "bitsandbytes", "load_in_4bit": True},
            "quant_method 'bitsandbytes', a source format moequant cannot read",
        ),
        ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size [64, 64] is not a source format"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "sparse-24-bitmask",
                "config_groups": {
                    "g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}
                },
            },
            "compressed-tensors format 'sparse-24-bitmask'",
        ),
        (
            {"quant_method": "compressed-tensors", "config_groups": [{"targets": "Linear"}]},
            "quantization_config is malformed",
        ),
    ],
)
def test_a_source_format_we_cannot_read_is_one_sentence_naming_it(qc, message, sources, tmp_path):
    bad = tmp_path / "other"
    shutil.copytree(sources["deepseek"], bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"] = qc
    (bad / "config.json").write_text(json.dumps(config))
    _refused(bad, tmp_path, message)
    result = CliRunner().invoke(main, ["inspect", str(bad)])
    assert result.exit_code == 2 and message in result.output


def test_an_fp8_tensor_without_scales_is_refused(sources, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    bad = _broken_copy(sources["deepseek"], tmp_path / "noscale", lambda t: t.pop(name))
    _refused(bad, tmp_path, repr(name[: -len("_scale_inv")]), "gives it no scale")


def test_reading_the_source_never_writes_a_dense_copy(sources, tmp_path, monkeypatch):
    """moequant.load and the layer reads build the model in memory: no safetensors file is written."""
    import safetensors.torch

    import moequant

    def refuse(*args, **kwargs):
        raise AssertionError("a dense copy was written")

    monkeypatch.setattr(safetensors.torch, "save_file", refuse)
    monkeypatch.setattr("moequant.io.checkpoint.save_file", refuse)
    model = moequant.load(sources["deepseek"], dtype=torch.float32)
    ckpt = open_checkpoint(sources["deepseek"])
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert torch.equal(model.model.layers[1].mlp.experts.down_proj[3], ckpt.get(name))
    with safe_open(str(next(sources["deepseek"].glob("*.safetensors"))), "pt") as f:
        assert f.get_tensor(name).dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_experts_read_onto_a_device_equal_the_host_decode(kind, sources):
    """read_experts with a device sends the stored bytes there and decodes there (the GPU path): the same
    float32 values as the host's decode, and in a compute dtype exactly their rounding, and so every other tensor; on CUDA when
    present, else through the same path on the CPU device."""
    from moequant.arch import adapter_for

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ckpt = open_checkpoint(sources[kind])
    adapter = adapter_for(ckpt.config)
    layer = adapter.moe_layers[-1]
    for proj in adapter.projections:
        host = adapter.read_experts(ckpt, layer, proj)
        there = adapter.read_experts(ckpt, layer, proj, device=device)
        assert there.device.type == device and torch.equal(there.cpu(), host)
        some = range(1, 3)
        half = adapter.read_experts(ckpt, layer, proj, some, device=device, dtype=torch.bfloat16)
        assert half.dtype == torch.bfloat16 and torch.equal(half.cpu(), host[1:3].to(torch.bfloat16))
    for name in ckpt.keys():  # every tensor, decoded or as stored (on CUDA read through page-locked memory)
        assert torch.equal(ckpt.get(name, device).cpu(), ckpt.get(name)), name
