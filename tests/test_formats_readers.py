"""Our layouts read back by readers we did not write: compressed-tensors, transformers, ml_dtypes, torch.

Each test feeds our packed tensors to the third-party code and demands bit-identical numbers,
and, where the third party also quantizes, that it produces our codes and scales.
"""

import ml_dtypes
import numpy as np
import pytest
import torch
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
from helpers import make_weight
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from moequant import formats
from moequant.formats.elements import decode_e2m1, e8m0_to_float
from moequant.layouts.awq import pack_awq
from moequant.layouts.deepseek_fp8 import pack_deepseek_fp8
from moequant.layouts.gpt_oss_mxfp4 import pack_gpt_oss_mxfp4
from moequant.layouts.gptq import pack_gptq

KINDS = ["normal", "student_t"]


def ct_scheme(preset: str, **weight_overrides) -> QuantizationScheme:
    weights = PRESET_SCHEMES[preset]["weights"].model_copy(update=weight_overrides)
    return QuantizationScheme(targets=["Linear"], weights=weights)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


# ---------------------------------------------------------------- compressed-tensors: integers

INT_CASES = [  # key, preset, overrides
    ("int4-g128-sym", "W4A16", {}),
    ("int4-g32-sym", "W4A16", {"group_size": 32}),
    ("int4-g64-asym", "W4A16_ASYM", {"group_size": 64}),
    ("int3-g128-sym", "W3A16", {}),
    ("int3-g32-asym", "W3A16", {"group_size": 32, "symmetric": False}),
    ("int2-g64-sym", "W2A16", {"group_size": 64}),
    ("int2-g128-asym", "W2A16", {"symmetric": False}),
    ("int8-channel", "W8A16", {"strategy": "channel", "group_size": None}),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("key, preset, overrides", INT_CASES)
def test_compressed_tensors_int_layout_is_bit_exact(key, preset, overrides, kind):
    spec = formats.parse_key(key)
    scheme = ct_scheme(preset, **overrides)
    assert scheme.weights.num_bits == spec.bits and scheme.weights.symmetric == spec.symmetric
    w = make_weight((40, 256), kind, seed=41)
    q = formats.quantize(w, key)
    ours = formats.pack_compressed_tensors(q)
    # compressed-tensors quantizes and packs with our scales / zero points: same words
    state = {"weight": w, "weight_scale": q.scales}
    if q.zeros is not None:
        state["weight_zero_point"] = q.zeros
    theirs = PackedQuantizationCompressor.compress(state, scheme)
    assert torch.equal(theirs["weight_packed"], ours["weight_packed"])
    if q.zeros is not None:
        assert torch.equal(theirs["weight_zero_point"], ours["weight_zero_point"])
    # and decompresses our tensors to our dequantized weight (bf16, the scale dtype)
    out = PackedQuantizationCompressor.decompress(dict(ours), scheme)["weight"]
    assert out.dtype == torch.bfloat16 and torch.equal(out, q.dequantize(torch.bfloat16))
    # its own observer math picks our scales (ours are rounded to bf16)
    view = w.unflatten(-1, (-1, spec.group_size)) if spec.group_size else w.unsqueeze(-2)
    scale, zp = calculate_qparams(view.amin(-1), view.amax(-1), scheme.weights)
    assert torch.equal(scale.reshape(q.scales.shape).bfloat16(), q.scales)
    if q.zeros is not None:  # their zero point comes from the unrounded scale: equal almost everywhere
        assert (zp.reshape(q.zeros.shape).to(torch.int8) != q.zeros).float().mean() < 0.02


def test_compressed_tensors_reads_stacked_experts():
    w = make_weight((3, 16, 128), "student_t", seed=43)
    q = formats.quantize(w, "int4-g32-asym")
    out = PackedQuantizationCompressor.decompress(
        dict(formats.pack_compressed_tensors(q)), ct_scheme("W4A16_ASYM", group_size=32)
    )["weight"]
    assert torch.equal(out, q.dequantize(torch.bfloat16))


# ---------------------------------------------------------------- compressed-tensors: floats


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "key, preset, overrides",
    [("fp8-channel", "FP8_DYNAMIC", {}), ("fp8-tensor", "FP8", {}), ("fp8-block128", "FP8_BLOCK", {})],
)
def test_compressed_tensors_fp8_is_bit_exact(key, preset, overrides, kind):
    scheme = ct_scheme(preset, **overrides)
    w = make_weight((300, 200), kind, seed=47)  # ragged for 128x128 blocks
    q = formats.quantize(w, key)
    ours = formats.pack_compressed_tensors(q)
    theirs = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": ours["weight_scale"]}, scheme)
    assert torch.equal(bits(theirs["weight"]), bits(ours["weight"]))
    out = FloatQuantizationCompressor.decompress(dict(ours), scheme)["weight"]
    assert torch.equal(out, q.dequantize(out.dtype))


@pytest.mark.parametrize("kind", KINDS)
def test_compressed_tensors_nvfp4_is_bit_exact_and_picks_our_scales(kind):
    scheme = ct_scheme("NVFP4A16")
    for w in make_weight((2, 32, 128), kind, seed=53):
        q = formats.quantize(w, "nvfp4")
        ours = formats.pack_compressed_tensors(q)
        gs = generate_gparam(w.amin(), w.amax())
        assert torch.equal(gs, ours["weight_global_scale"])
        view = w.unflatten(-1, (-1, 16))
        scale, _ = calculate_qparams(view.amin(-1), view.amax(-1), scheme.weights, global_scale=gs)
        assert torch.equal(bits(scale.to(torch.float8_e4m3fn)), bits(ours["weight_scale"]))
        theirs = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs}, scheme)
        assert torch.equal(theirs["weight_packed"], ours["weight_packed"])
        out = NVFP4PackedCompressor.decompress(dict(ours), scheme)["weight"]
        assert torch.equal(out, q.dequantize(out.dtype))


@pytest.mark.parametrize("kind", KINDS)
def test_compressed_tensors_mxfp4_is_bit_exact_and_picks_our_scales(kind):
    scheme = ct_scheme("MXFP4A16")
    w = make_weight((32, 256), kind, seed=59)
    w[0, :32] = torch.linspace(-1.75, 1.75, 32)  # amax mantissa exactly 1.75: the rounding-up edge
    w[1, :32] = torch.linspace(-1.7, 1.7, 32)
    q = formats.quantize(w, "mxfp4")
    ours = formats.pack_compressed_tensors(q)
    view = w.unflatten(-1, (-1, 32))
    scale, _ = calculate_qparams(view.amin(-1), view.amax(-1), scheme.weights)
    assert torch.equal(scale, e8m0_to_float(q.scales))
    assert q.scales[0, 0] == 127 - 1 and q.scales[1, 0] == 127 - 2  # 1.75 rounds up to 2^1 -> 2^-1; 1.7 -> 2^-2
    theirs = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    assert torch.equal(theirs["weight_packed"], ours["weight_packed"])
    assert torch.equal(theirs["weight_scale"], ours["weight_scale"])
    out = MXFP4PackedCompressor.decompress(dict(ours), scheme)["weight"]
    assert torch.equal(out, q.dequantize(out.dtype))


@pytest.mark.parametrize(
    "key, preset, overrides",
    [
        ("int4-g128-sym", "W4A16", {}),
        ("int4-g64-asym", "W4A16_ASYM", {"group_size": 64}),
        ("int8-channel", "W8A16", {"strategy": "channel", "group_size": None}),
        ("fp8-block128", "FP8_BLOCK", {}),
        ("fp8-channel", "FP8_DYNAMIC", {}),
        ("fp8-tensor", "FP8", {}),
        ("mxfp4", "MXFP4A16", {}),
        ("nvfp4", "NVFP4A16", {}),
    ],
)
def test_our_config_args_are_compressed_tensors_presets_and_decode_our_tensors(key, preset, overrides):
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs

    ours = QuantizationArgs(**formats.compressed_tensors_weight_args(key))
    theirs = ct_scheme(preset, **overrides).weights
    fields = ("num_bits", "type", "symmetric", "strategy", "group_size", "block_structure", "scale_dtype", "dynamic")
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}
    # the compressor that compressed-tensors registers under our format name decodes our tensors
    q = formats.quantize(make_weight((2, 16, 256), seed=37), key)
    compressor = BaseCompressor.get_value_from_registry(formats.compressed_tensors_format(key))
    scheme = QuantizationScheme(targets=["Linear"], weights=ours)
    for e in range(2):
        out = compressor.decompress(dict(formats.pack_compressed_tensors(q.expert(e))), scheme)["weight"]
        assert torch.equal(out, q.expert(e).dequantize(out.dtype))
    assert formats.compressed_tensors_weight_args("bf16") is None


# ---------------------------------------------------------------- AWQ and GPTQ through compressed-tensors


@pytest.mark.parametrize("key", ["int4-g128-asym", "int4-g32-sym"])
def test_autoawq_converter_reads_our_awq_gemm_tensors(key):
    w = make_weight((24, 256), "student_t", seed=61)
    q = formats.quantize(w, key)
    awq = pack_awq(q)
    spec = q.spec
    conv = AutoAWQConverter(bits=4, group_size=spec.group_size, zero_point=True)
    ct = conv.process({"m.qweight": awq["qweight"], "m.qzeros": awq["qzeros"], "m.scales": awq["scales"]})
    state = {k[2:]: v for k, v in ct.items()}
    out = PackedQuantizationCompressor.decompress(state, ct_scheme("W4A16_ASYM", group_size=spec.group_size))["weight"]
    assert torch.equal(out, q.dequantize(torch.float16))


@pytest.mark.parametrize("key", ["int4-g64-asym", "int3-g32-asym", "int2-g128-asym", "int8-channel"])
def test_gptq_bit_streams_are_the_ones_compressed_tensors_reads(key):
    # GPTQ packs the same dense stream along the input axis (qweight transposed) and the zero points
    # along the output axis; compressed-tensors' unpacker reads them once the orientation is matched.
    w = make_weight((40, 256), seed=67)
    q = formats.quantize(w, key)
    gptq = pack_gptq(q, version=2)
    state = {
        "weight_packed": gptq["qweight"].T.contiguous(),
        "weight_scale": gptq["scales"].T.contiguous(),
        "weight_shape": torch.tensor(q.shape),
    }
    if not q.spec.symmetric:
        state["weight_zero_point"] = gptq["qzeros"].T.contiguous()
        scheme = ct_scheme("W4A16_ASYM", num_bits=q.spec.bits, group_size=q.spec.group_size)
    else:
        scheme = ct_scheme("W8A16", strategy="channel", group_size=None)
    out = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    assert torch.equal(out, q.dequantize(torch.float16))
    assert torch.equal(gptq["g_idx"], torch.arange(256, dtype=torch.int32) // (q.spec.group_size or 256))


def test_gptq_v1_zero_points_are_stored_minus_one():
    w = make_weight((16, 128), seed=71)
    for key in ("int4-g32-sym", "int3-g64-sym"):
        q = formats.quantize(w, key)
        b = q.spec.bits
        z = formats.unpack_int32(pack_gptq(q)["qzeros"], b, 16)
        assert (z == 2 ** (b - 1) - 1).all()  # symmetric: 7 (int4) / 3 (int3), the v1 convention
    q = formats.quantize(w, "int4-g32-asym")
    z = formats.unpack_int32(pack_gptq(q)["qzeros"], 4, 16).T
    assert torch.equal(z.to(torch.int16), q.zeros.to(torch.int16) + 8 - 1)


# ---------------------------------------------------------------- transformers


@pytest.mark.parametrize("kind", KINDS)
def test_transformers_gpt_oss_dequantizer_reads_our_mxfp4(kind):
    w = make_weight((2, 24, 128), kind, seed=73)  # [E, out, in]
    q = formats.quantize(w, "mxfp4")
    t = pack_gpt_oss_mxfp4(q)
    assert t["blocks"].shape == (2, 24, 4, 16) and t["scales"].shape == (2, 24, 4)
    out = convert_moe_packed_tensors(t["blocks"], t["scales"], dtype=torch.float32)
    assert out.shape == (2, 128, 24)  # gpt-oss keeps experts as [E, in, out] in memory
    assert torch.equal(out, q.dequantize().transpose(1, 2))


@pytest.mark.parametrize("kind", KINDS)
def test_transformers_fp8_block_dequantizers_read_our_deepseek_layout(kind):
    w = make_weight((2, 300, 200), kind, seed=79)
    q = formats.quantize(w, "fp8-block128")
    t = pack_deepseek_fp8(q)
    out = _dequantize_fp8_weight(t["weight"].clone(), t["weight_scale_inv"], [128, 128], torch.float32)
    assert torch.equal(out, q.dequantize())
    even = formats.quantize(w[:, :256, :128], "fp8-block128")  # the loader path needs whole blocks
    te = pack_deepseek_fp8(even)
    out = Fp8Dequantize(None)._dequantize_one(te["weight"], te["weight_scale_inv"], output_dtype=torch.float32)
    assert torch.equal(out, even.dequantize())


# ---------------------------------------------------------------- element types: ml_dtypes and torch


@pytest.mark.parametrize("kind", KINDS)
def test_e2m1_codes_match_ml_dtypes(kind):
    w = make_weight((16, 128), kind, seed=83)
    for key in ("mxfp4", "nvfp4"):
        q = formats.quantize(w, key)
        if key == "mxfp4":
            eff = e8m0_to_float(q.scales)
        else:
            eff = q.scales.float() / q.global_scale
        y = (w.unflatten(-1, (-1, q.spec.group_size)) / eff.unsqueeze(-1)).flatten(-2)
        theirs = y.numpy().astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
        assert np.array_equal(theirs, q.codes.numpy())
        assert np.array_equal(
            q.codes.numpy().astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32),
            decode_e2m1(q.codes).numpy(),
        )


def test_e8m0_scales_match_ml_dtypes():
    codes = torch.arange(0, 255, dtype=torch.uint8)
    ours = e8m0_to_float(codes).numpy()
    assert np.array_equal(codes.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32), ours)
    assert np.array_equal(ours.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8), codes.numpy())
    w = make_weight((8, 256), "student_t", seed=89)
    q = formats.quantize(w, "mxfp4")
    assert (q.scales < 255).all()  # 255 is e8m0's NaN


@pytest.mark.parametrize("kind", KINDS)
def test_e4m3_codes_match_torch_and_ml_dtypes(kind):
    w = make_weight((64, 256), kind, seed=97)
    for key in ("fp8-channel", "fp8-tensor", "fp8-block128"):
        q = formats.quantize(w, key)
        assert q.codes.dtype == torch.float8_e4m3fn
        scale = (
            q.scales
            if key != "fp8-block128"
            else q.scales.repeat_interleave(128, 0).repeat_interleave(128, 1)[:64, :256]
        )
        y = (w / scale).clamp(-448, 448)
        theirs = y.numpy().astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        assert np.array_equal(theirs, bits(q.codes).numpy())
        assert torch.equal(q.dequantize(), q.codes.float() * scale)
    # and the nvfp4 block scales are e4m3 by torch's own cast of g * amax / 6
    q = formats.quantize(w, "nvfp4")
    amax = w.unflatten(-1, (-1, 16)).abs().amax(-1)
    assert torch.equal(bits(q.scales), bits((q.global_scale * (amax / 6.0)).to(torch.float8_e4m3fn)))
