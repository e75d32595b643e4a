"""MXFP8, the format added through the registry alone (moequant/formats/mxfp8.py), checked against
independent readers: ml_dtypes' e4m3 and float64 powers of two, compressed-tensors' own MX scale rule,
its MXFP8A16 preset and its mxfp8-quantized compressor."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from moequant import formats
from moequant.errors import UserError
from moequant.targets import get_target


def _weight(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[-1])  # groups of very different ranges
    w[..., 0, :32] = 0.0  # an all-zero group
    return w


def test_mxfp8_is_registered_with_its_byte_cost():
    spec = formats.get_format("mxfp8")
    assert spec.key == "mxfp8" and formats.parse_key("mxfp8") == spec and "mxfp8" in formats.all_keys()
    assert formats.nbytes(spec, (4, 64, 256)) == 4 * (64 * 256 + 64 * 256 // 32)  # 1 byte per code, 1 per 32
    assert spec.bits_per_weight((64, 256)) == 8.25
    with pytest.raises(UserError, match="group_size"):
        formats.get_format("mxfp8", group_size=16)


def test_mxfp8_codes_and_values_match_a_float64_reference():
    w = _weight((2, 8, 128), seed=1)
    q = formats.quantize(w, "mxfp8")
    assert q.codes.dtype == torch.float8_e4m3fn and q.scales.dtype == torch.uint8 and q.scales.shape == (2, 8, 4)
    scale = np.exp2(q.scales.numpy().astype(np.float64) - 127.0)  # e8m0 -> 2^(code - 127), in float64
    scale = np.repeat(scale, 32, axis=-1)
    x = w.double().numpy()
    # ml_dtypes rounds to the nearest e4m3 (ties to even); saturate first as the format does
    ref_codes = np.clip(x / scale, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    ours = q.codes.view(torch.uint8).numpy()
    assert np.array_equal(ours, ref_codes.view(np.uint8))
    back = ref_codes.astype(np.float64) * scale
    assert np.array_equal(q.dequantize(torch.float64).numpy(), back)
    # scale rule: amax / scale lands in [224, 448), so nothing clips; all-zero groups decode to zeros
    amax = np.abs(x).reshape(2, 8, 4, 32).max(-1)
    ratio = amax / scale[..., ::32]
    assert np.all((ratio[amax > 0] >= 224) & (ratio[amax > 0] < 448))
    assert np.all(back[:, 0, :32] == 0.0)
    rel = np.square(back - x).sum() / np.square(x).sum()
    assert rel < 2e-3  # e4m3's 3 mantissa bits: ~1e-3 relative MSE


def test_mxfp8_scales_equal_compressed_tensors_mx_rule():
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

    w = _weight((16, 256), seed=2)
    w[1, 32:64] = torch.linspace(-1.75 * 2.0**-3, 1.75 * 2.0**-3, 32)  # mantissa exactly 1.75: the bump
    q = formats.quantize(w, "mxfp8")
    amax = w.abs().reshape(16, 8, 32).amax(-1)
    theirs = generate_mx_scales(amax, num_bits=8)
    nonzero = amax > 0
    assert torch.equal(q.scales[nonzero].to(torch.float32), theirs[nonzero].to(torch.float32))


def test_mxfp8_config_is_the_compressed_tensors_preset_and_its_compressor_decodes_our_tensors():
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

    ours = QuantizationArgs(**formats.compressed_tensors_weight_args("mxfp8"))
    theirs = preset_name_to_scheme("MXFP8A16", ["Linear"]).weights
    fields = ("num_bits", "type", "symmetric", "strategy", "group_size", "scale_dtype", "dynamic")
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}
    compressor = BaseCompressor.get_value_from_registry(formats.compressed_tensors_format("mxfp8"))
    q = formats.quantize(_weight((2, 16, 256), seed=3), "mxfp8")
    scheme = QuantizationScheme(targets=["Linear"], weights=ours)
    for e in range(2):
        out = compressor.decompress(dict(formats.pack_compressed_tensors(q.expert(e))), scheme)["weight"]
        assert torch.equal(out.to(torch.float32), q.expert(e).dequantize(torch.float32))


def test_mxfp8_serving_rules():
    spec = formats.get_format("mxfp8")
    assert get_target("vllm").refuses(spec, routed=True) is None
    assert get_target("transformers").refuses(spec, routed=True) is None
    assert get_target("llama.cpp").refuses(spec, routed=False) and get_target("vllm-moequant").refuses(
        spec, routed=True
    )


def test_an_mxfp8_export_reads_back_through_compressed_tensors_and_moequant_load(tmp_path):
    import glob

    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from safetensors.torch import load_file
    from test_export_models import build_model, quantize_experts

    from moequant.arch import adapter_for
    from moequant.export.write import export_checkpoint
    from moequant.io.checkpoint import open_checkpoint
    from moequant.io.loader import dequantized_state_dict

    src = build_model("qwen2_moe", tmp_path / "src")
    experts = quantize_experts(src, lambda L, e, p: "mxfp8")  # one format per layer: what vLLM loads
    out = export_checkpoint(src, experts, tmp_path / "ct", target="vllm")
    config = open_checkpoint(out).config["quantization_config"]
    assert {g["format"] for g in config["config_groups"].values()} == {"mxfp8-quantized"}
    stored = {}
    for f in sorted(glob.glob(str(out / "*.safetensors"))):
        stored.update(load_file(f))
    theirs = CompressedTensorsDequantizer(str(out), dtype=torch.float32).validate(stored)
    ours = dequantized_state_dict(out, torch.float32)
    ad = adapter_for(open_checkpoint(src).config)
    for key, q in experts.items():
        name = ad.expert_tensor_name(*key)
        want = q.dequantize(torch.float32)
        assert torch.equal(ours[name], want), key
        assert torch.equal(theirs[name].to(torch.float32), want), key
