"""moequant.formats: keys, exactness against a float64 reference, edge cases, column quantizer, bytes.

Third-party readers (compressed-tensors, transformers, ml_dtypes) are in test_formats_readers.py.
"""

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import make_weight

from moequant import formats
from moequant.errors import UserError
from moequant.layouts.awq import pack_awq, unpack_awq
from moequant.layouts.deepseek_fp8 import pack_deepseek_fp8
from moequant.layouts.gpt_oss_mxfp4 import pack_gpt_oss_mxfp4, unpack_gpt_oss_mxfp4
from moequant.layouts.gptq import pack_gptq, unpack_gptq

INT_KEYS = [
    "int8-channel",
    "int4-g128-sym",
    "int4-g32-asym",
    "int3-g64-sym",
    "int3-g32-asym",
    "int2-g128-sym",
    "int2-g64-asym",
]
FLOAT_KEYS = ["fp8-channel", "fp8-block128", "fp8-tensor", "mxfp4", "nvfp4"]
QUANT_KEYS = INT_KEYS + FLOAT_KEYS


def shape_for(key, experts=None):
    cols = 200 if key == "fp8-block128" else 256  # ragged 128x128 blocks on purpose
    rows = 136 if key == "fp8-block128" else 48
    return (rows, cols) if experts is None else (experts, rows, cols)


# ---------------------------------------------------------------- specs and keys


def test_every_key_round_trips_and_params_build_the_same_spec():
    keys = formats.all_keys()
    assert len(keys) == len(set(keys)) == 5 + 3 * 3 * 2 + 3  # bf16, fp8 x3, int8; int4/3/2; mxfp4, mxfp8, nvfp4
    for key in keys:
        spec = formats.parse_key(key)
        assert spec.key == key and formats.get_format(key) == spec
    assert formats.get_format("int4", group_size=64, symmetric=False).key == "int4-g64-asym"
    assert formats.get_format("int4").key == "int4-g128-sym"
    assert formats.get_format("fp8", granularity="block").key == "fp8-block128"
    assert formats.get_format("fp8").key == "fp8-channel"
    spec = formats.get_format("int3", group_size=32)
    with pytest.raises(Exception):
        spec.bits = 4  # frozen


@pytest.mark.parametrize(
    "call, needle",
    [
        (lambda: formats.get_format("int5"), "int5"),
        (lambda: formats.get_format("int4", group_size=48), "48"),
        (lambda: formats.get_format("int4", groupsize=128), "groupsize"),
        (lambda: formats.get_format("fp8", granularity="row"), "row"),
        (lambda: formats.get_format("fp8", granularity="block", block_size=64), "64"),
        (lambda: formats.get_format("int8", symmetric=False), "symmetric"),
        (lambda: formats.get_format("mxfp4", group_size=16), "32"),
        (lambda: formats.parse_key("int4-g128"), "int4-g128"),
    ],
)
def test_bad_format_parameters_are_user_errors_naming_the_value(call, needle):
    with pytest.raises(UserError, match=needle):
        call()


def test_bits_per_weight_hand_derived():
    shape = (4096, 4096)
    expected = {
        "bf16": 16,
        "fp8-tensor": 8 + 32 / 4096**2,
        "fp8-channel": 8 + 32 / 4096,
        "fp8-block128": 8 + 32 / 128**2,
        "int8-channel": 8 + 16 / 4096,
        "int4-g128-sym": 4 + 16 / 128,
        "int4-g128-asym": 4 + 16 / 128 + 4 / 128,
        "int3-g64-sym": 3 + 16 / 64,
        "int2-g32-asym": 2 + 16 / 32 + 2 / 32,
        "mxfp4": 4 + 8 / 32,
        "nvfp4": 4 + 8 / 16 + 32 / 4096**2,
    }
    for key, bits in expected.items():
        assert formats.parse_key(key).bits_per_weight(shape) == pytest.approx(bits, rel=1e-12)
        assert formats.nbytes(key, (3,) + shape) == 3 * formats.nbytes(key, shape)


# ---------------------------------------------------------------- float64 reference quantizer


def _reference(w64: np.ndarray, key: str):
    """Independent float64 implementation of each documented scale rule -> (codes as values, dequant).

    Codes are returned as the element value in units of the scale (int level, e4m3 or e2m1 value).
    """
    spec = formats.parse_key(key)
    rows, cols = w64.shape
    if spec.granularity == "group":
        g = spec.group_size
        blocks = w64.reshape(rows, cols // g, g)
    elif spec.granularity == "channel":
        blocks = w64.reshape(rows, 1, cols)
    elif spec.granularity == "tensor":
        blocks = w64.reshape(1, 1, rows * cols)
    else:
        b = 128
        nbo, nbi = -(-rows // b), -(-cols // b)
        padded = np.zeros((nbo * b, nbi * b))
        padded[:rows, :cols] = w64
        amax = np.abs(padded.reshape(nbo, b, nbi, b)).max(axis=(1, 3))
        s = (amax / 448.0).astype(np.float32).astype(np.float64)
        s_full = np.repeat(np.repeat(s, b, 0), b, 1)[:rows, :cols]
        y = np.where(s_full > 0, w64 / np.where(s_full > 0, s_full, 1), 0)
        vals = np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        return vals, vals * s_full
    amax = np.abs(blocks).max(-1, keepdims=True)
    if spec.name == "fp8":
        s = (amax / 448.0).astype(np.float32).astype(np.float64)
        y = np.where(s > 0, blocks / np.where(s > 0, s, 1), 0)
        vals = np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        deq = vals * s
    elif spec.is_int:
        half = 2 ** (spec.bits - 1)
        if spec.symmetric:
            s = (amax.astype(np.float32) / np.float32(half - 0.5)).astype(ml_dtypes.bfloat16).astype(np.float64)
            z = np.zeros_like(s)
        else:
            lo = np.minimum(blocks.min(-1, keepdims=True), 0)
            hi = np.maximum(blocks.max(-1, keepdims=True), 0)
            span = hi.astype(np.float32) - lo.astype(np.float32)
            s = (span / np.float32(2 * half - 1)).astype(ml_dtypes.bfloat16).astype(np.float64)
            z = np.where(s > 0, np.clip(-half + np.round(-lo / np.where(s > 0, s, 1)), -half, half - 1), 0)
        q = np.where(s > 0, np.clip(np.round(blocks / np.where(s > 0, s, 1)) + z, -half, half - 1), z)
        vals, deq = q, (q - z) * s
    elif spec.name == "mxfp4":
        e = np.floor(np.log2(np.where(amax > 0, amax, 1.0)))
        e = e + (amax / 2.0**e >= 1.75) - 2
        s = np.where(amax > 0, 2.0 ** np.clip(e, -127, 127), 2.0**-127)
        vals = (blocks / s).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
        deq = vals * s
    else:  # nvfp4
        gs = np.float32(2688.0 / np.abs(w64).max())
        s_blk = (np.float64(gs) * (amax / 6.0)).astype(np.float32)
        s_blk = np.clip(s_blk, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        eff = (s_blk / np.float64(gs)).astype(np.float32).astype(np.float64)
        vals = (
            np.where(eff > 0, blocks / np.where(eff > 0, eff, 1), 0).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
        )
        deq = vals * eff
    return vals.reshape(rows, cols), deq.reshape(rows, cols)


def _code_values(q):
    """Our codes as element values (int levels, e4m3 / e2m1 values)."""
    spec = q.spec
    if spec.name == "fp8":
        return q.codes.to(torch.float64).numpy()
    if spec.is_fp4:
        return formats.elements.decode_e2m1(q.codes).double().numpy()
    return q.codes.double().numpy()


@pytest.mark.parametrize("kind", ["normal", "student_t"])
@pytest.mark.parametrize("key", QUANT_KEYS)
def test_matches_float64_reference(key, kind):
    w = make_weight(shape_for(key), kind, seed=hash((key, kind)) % 1000)
    q = formats.quantize(w, key)
    ref_vals, ref_deq = _reference(w.double().numpy(), key)
    ours = _code_values(q)
    deq = q.dequantize(torch.float64).numpy()
    # Codes may differ only where float32 division lands within float32 resolution of a rounding tie.
    differ = ours != ref_vals
    assert differ.mean() < 1e-3, "%d codes differ" % differ.sum()
    np.testing.assert_allclose(deq[~differ], ref_deq[~differ], rtol=1e-6, atol=0)
    err, ref_err = np.linalg.norm(deq - w.double().numpy()), np.linalg.norm(ref_deq - w.double().numpy())
    assert err == pytest.approx(ref_err, rel=1e-4)


# ---------------------------------------------------------------- experts, dtypes


@pytest.mark.parametrize("key", QUANT_KEYS + ["bf16"])
def test_stacked_experts_get_their_own_scales(key):
    w = make_weight(shape_for(key, experts=3), "student_t", seed=3)
    w[1] *= 100.0  # one expert on a very different scale
    w[2, :, :32] = 0.0  # and one with zero groups
    q = formats.quantize(w, key)
    singles = formats.stack_experts([formats.quantize(w[e], key) for e in range(3)])
    for field in ("codes", "scales", "zeros", "global_scale"):
        a, b = getattr(q, field), getattr(singles, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert torch.equal(
                a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(torch.uint8) if b.dtype.itemsize == 1 else b
            ), field
    assert torch.equal(q.dequantize(), torch.stack([q.expert(e).dequantize() for e in range(3)]))
    assert q.nbytes == formats.nbytes(key, w.shape) == 3 * formats.nbytes(key, w.shape[1:])


def test_large_stacks_are_quantized_in_expert_chunks_with_identical_results(monkeypatch):
    w = make_weight((5, 32, 128), "student_t", seed=4)
    whole = {key: formats.quantize(w, key) for key in ("int4-g64-asym", "nvfp4", "fp8-block128")}
    monkeypatch.setattr(formats.core, "CHUNK_ELEMENTS", 2 * 32 * 128)  # 2 experts per chunk, 3 chunks
    bad = w.clone()
    bad[3, 0, 0] = float("nan")
    with pytest.raises(UserError, match="big.w1"):
        formats.quantize(bad, "int4-g32-sym", name="big.w1")
    for key, ref in whole.items():
        q = formats.quantize(w, key)
        assert q.shape == ref.shape and torch.equal(q.dequantize(), ref.dequantize()), key
        assert torch.equal(q.scales.float(), ref.scales.float()), key
    g = torch.arange(1.0, 6.0) * 100
    assert torch.equal(formats.quantize(w, "nvfp4", global_scale=g).global_scale, g)


def test_non_contiguous_weights_quantize_like_their_contiguous_copies():
    w = make_weight((2, 256, 192), seed=6)
    for view in (w.transpose(1, 2), w[..., 0::2].transpose(1, 2)[:, :, :128]):  # e.g. gpt-oss gate = [..., 0::2]
        for key in ("int4-g64-asym", "fp8-block128", "mxfp4", "nvfp4", "fp8-tensor"):
            a, b = formats.quantize(view, key), formats.quantize(view.contiguous(), key)
            assert torch.equal(a.dequantize(), b.dequantize()), key
            pa, pb = formats.pack_compressed_tensors(a), formats.pack_compressed_tensors(b)
            as_bits = lambda t: t.view(torch.uint8) if t.dtype.itemsize == 1 else t  # noqa: E731
            assert pa.keys() == pb.keys() and all(torch.equal(as_bits(pa[k]), as_bits(pb[k])) for k in pa), key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_any_float_dtype_in_is_quantized_from_its_float32_value(dtype):
    w = make_weight((16, 128), seed=5, dtype=dtype)
    for key in ["int4-g32-asym", "fp8-block128", "mxfp4", "nvfp4"]:
        a, b = formats.quantize(w, key), formats.quantize(w.to(torch.float32), key)
        assert torch.equal(a.dequantize(), b.dequantize()), key
    assert formats.quantize(w, "bf16").dequantize(torch.bfloat16).equal(w.to(torch.bfloat16))


# ---------------------------------------------------------------- edge cases


@pytest.mark.parametrize("key", QUANT_KEYS)
def test_all_zero_rows_groups_and_tensors_give_exact_zeros(key):
    w = make_weight(shape_for(key), seed=7)
    w[3] = 0.0
    w[:, :32] = 0.0
    for x in (w, torch.zeros_like(w)):
        q = formats.quantize(x, key)
        deq = q.dequantize()
        assert torch.isfinite(deq).all()
        assert torch.isfinite(q.scales.to(torch.float32)).all()
        assert (deq[x == 0] == 0).all()
    assert (formats.quantize(torch.zeros_like(w), key).dequantize() == 0).all()


def test_fp8_saturates_at_448_and_hits_its_maximum_exactly():
    w = torch.tensor([[3.0, -3.0, 1.5, 0.0] * 32])
    q = formats.quantize(w, "fp8-channel")
    assert q.scales.item() == np.float32(3.0 / 448)
    assert q.codes.float()[0, :2].tolist() == [448.0, -448.0]
    cq = formats.column_quantizer("fp8-channel", w)
    params = cq.fit(w)
    big = torch.tensor([[10.0, -1e30, float(3.0)]])  # beyond the fitted range: saturates, no NaN
    assert cq.quantize(big, params).float().tolist() == [[448.0, -448.0, 448.0]]


def test_e2m1_saturates_at_six_and_int_codes_clamp():
    w = torch.full((1, 32), 3.0)
    w[0, 0] = 6.0  # amax 6 -> mxfp4 scale 1 (mantissa 1.5 < 1.75)
    cq = formats.column_quantizer("mxfp4", w)
    p = cq.fit(w)
    assert p.scales.item() == 127
    assert cq.qdq(torch.tensor([[7.0, 100.0, -9.0]]), p).tolist() == [[6.0, 6.0, -6.0]]
    cq = formats.column_quantizer("int4-g32-sym", w)
    p = cq.fit(w)  # s = bf16(6 / 7.5) = 0.80078125
    s = 0.80078125
    assert p.scales.item() == s
    assert cq.quantize(torch.tensor([[6.0, 60.0, -60.0]]), p).tolist() == [[7, 7, -8]]
    assert cq.qdq(torch.tensor([[-6.0]]), p).item() == -7 * s  # -6 / s = -7.49: the rounded-up scale keeps -amax at -7


def test_fp8_subnormal_codes_and_ties_hand_derived():
    # amax 448 -> scale exactly 1, so the weight is the e4m3 quotient itself.
    m = 2.0**-9  # smallest e4m3 subnormal
    vals = [448.0, 3 * m, m / 2, 3 * m / 2, 5 * m / 2, 7 * m, 7.5 * m, 17.0, 19.0]
    expect = [448.0, 3 * m, 0.0, 2 * m, 2 * m, 7 * m, 8 * m, 16.0, 20.0]  # ties to even mantissa
    w = torch.tensor([vals + [0.0] * (128 - len(vals))])
    q = formats.quantize(w, "fp8-channel")
    assert q.scales.item() == 1.0
    assert q.dequantize()[0, : len(vals)].tolist() == expect


def test_e2m1_subnormal_and_ties_hand_derived():
    # amax 4 (mantissa 1.0) -> mxfp4 scale 2^0; the e2m1 grid is 0, .5 (subnormal), 1, 1.5, 2, 3, 4, 6
    vals = [4.0, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, -0.1, 5.0, -0.75]
    expect = [4.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, -0.0, 4.0, -1.0]
    w = torch.tensor([vals + [0.0] * (32 - len(vals))])
    q = formats.quantize(w, "mxfp4")
    assert q.scales.item() == 127
    out = q.dequantize()[0, : len(vals)]
    assert out.tolist() == expect and torch.signbit(out[8])


@pytest.mark.parametrize(
    "key, bad",
    [(key, float("nan")) for key in QUANT_KEYS + ["bf16"]]
    + [(key, float(v)) for key in ("int4-g32-asym", "fp8-block128", "nvfp4", "bf16") for v in ("inf", "-inf")],
)
def test_nan_or_inf_is_a_user_error_naming_the_tensor(key, bad):
    w = make_weight(shape_for(key, experts=2), seed=1)
    w[1, 5, 7] = bad
    with pytest.raises(UserError, match="model.layers.3.mlp.experts.w1"):
        formats.quantize(w, key, name="model.layers.3.mlp.experts.w1")
    if key != "bf16":
        with pytest.raises(UserError, match="experts.w1"):
            formats.column_quantizer(key, w, name="experts.w1")


@pytest.mark.parametrize(
    "key, shape",
    [
        ("int4-g128-sym", (8, 192)),
        ("int3-g32-asym", (8, 48)),
        ("mxfp4", (8, 48)),
        ("nvfp4", (8, 40)),
        ("int2-g64-sym", (2, 8, 96)),
    ],
)
def test_shape_not_divisible_by_the_group_is_a_user_error(key, shape):
    with pytest.raises(UserError, match="w2.*%d input columns" % shape[-1]):
        formats.quantize(torch.ones(shape), key, name="w2")
    with pytest.raises(UserError):
        formats.nbytes(key, shape)


def test_fp8_block_ragged_edges_follow_deepseek():
    w = make_weight((300, 200), "student_t", seed=11)
    q = formats.quantize(w, "fp8-block128")
    assert q.scales.shape == (3, 2) and q.scales.dtype == torch.float32
    corner = w[256:, 128:]
    assert q.scales[2, 1].item() == np.float32(corner.abs().max().double().item() / 448)
    assert formats.nbytes("fp8-block128", w.shape) == 300 * 200 + 4 * 6


def test_bad_weights_are_user_errors():
    with pytest.raises(UserError, match="shape"):
        formats.quantize(torch.ones(4, 4, 4, 4), "fp8")
    with pytest.raises(UserError, match="floating"):
        formats.quantize(torch.ones(4, 32, dtype=torch.int32), "int4-g32-sym")
    with pytest.raises(UserError, match="too wide"):
        formats.quantize(torch.tensor([[3e38, -3e38] * 16]), "int4-g32-asym")
    big = formats.quantize(torch.full((8, 32), 1e6), "int4-g32-sym")  # scale 1.3e5: fine in bf16 ...
    assert big.dequantize()[0, 0].item() == pytest.approx(1e6, rel=0.1)
    with pytest.raises(UserError, match="fp16"):  # ... but GPTQ's fp16 scales cannot hold it
        pack_gptq(big)
    with pytest.raises(UserError, match="nvfp4"):
        formats.quantize(torch.ones(2, 32), "mxfp4", global_scale=1.0)


# ---------------------------------------------------------------- GPTQ column quantizer


def _walk_columns(cq, w, update=None):
    """GPTQ's loop shape: fit at each group start, quantize column by column."""
    codes, params = [], []
    cols = w.shape[-1]
    w = w.clone()
    for start in range(0, cols, cq.group_width):
        stop = min(start + cq.group_width, cols)
        p = cq.fit(w[..., start:stop])
        params.append(p)
        for j in range(start, stop):
            c = cq.quantize(w[..., j : j + 1], p)
            codes.append(c)
            if update is not None:
                err = w[..., j : j + 1] - cq.dequantize(c, p)
                w[..., j + 1 :] += update * err
    return codes, params


@pytest.mark.parametrize("key", QUANT_KEYS)
def test_column_quantizer_reproduces_quantize_on_an_unchanged_weight(key):
    w = make_weight(shape_for(key, experts=2), "student_t", seed=13)
    if key == "fp8-block128":
        w = w[..., :200]
    cq = formats.column_quantizer(key, w)
    spec = formats.parse_key(key)
    expected_width = {"channel": w.shape[-1], "tensor": w.shape[-1]}.get(spec.granularity, spec.group_size)
    assert cq.group_width == expected_width
    codes, params = _walk_columns(cq, w)
    q, ref = cq.assemble(codes, params), formats.quantize(w, key)
    assert torch.equal(q.dequantize(), ref.dequantize())
    for field in ("codes", "scales", "zeros", "global_scale"):
        a, b = getattr(q, field), getattr(ref, field)
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a.float(), b.float()), field
    assert torch.equal(cq.qdq(w[..., :8], params[0]), ref.dequantize()[..., :8])


def test_column_quantizer_keeps_the_scales_it_fitted_while_columns_change():
    w = make_weight((16, 64), seed=17)
    cq = formats.column_quantizer("int4-g32-asym", w)
    codes, params = _walk_columns(cq, w, update=0.3)
    q = cq.assemble(codes, params)
    assert q.scales.shape == (16, 2) and q.zeros.shape == (16, 2)
    # every code decodes with the params of its own group
    deq = q.dequantize()
    for gi, p in enumerate(params):
        sl = slice(32 * gi, 32 * gi + 32)
        assert torch.equal(deq[:, sl], cq.dequantize(q.codes[:, sl], p))


def test_nvfp4_global_scale_is_fixed_from_the_whole_weight():
    w = make_weight((2, 8, 64), seed=19)
    cq = formats.column_quantizer("nvfp4", w)
    assert torch.equal(cq.global_scale, 2688.0 / w.abs().amax(dim=(1, 2)))
    p_small = cq.fit(w[..., :16] * 0.01)  # error-updated columns do not move the global scale
    assert p_small.scales.shape == (2, 8, 1)
    assert torch.equal(cq.global_scale, 2688.0 / w.abs().amax(dim=(1, 2)))
    shared = torch.tensor([100.0, 100.0])
    q = formats.quantize(w, "nvfp4", global_scale=shared)
    assert torch.equal(q.global_scale, shared)


# ---------------------------------------------------------------- bytes and packers

SHAPES = [(64, 256), (3, 32, 128), (136, 128)]


def _layouts(q):
    spec = q.spec
    out = {"compressed-tensors": formats.pack_compressed_tensors(q)}
    if spec.is_int:
        out["gptq-v2"] = pack_gptq(q, version=2)
        if spec.symmetric:
            out["gptq-v1"] = pack_gptq(q, version=1)
        if spec.bits == 4:
            out["awq"] = pack_awq(q)
    if spec.key == "fp8-block128":
        out["deepseek"] = pack_deepseek_fp8(q)
    if spec.name == "mxfp4":
        out["gpt-oss"] = pack_gpt_oss_mxfp4(q)
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_nbytes_equals_the_bytes_every_packer_writes(shape):
    for key in formats.all_keys():
        w = make_weight(shape, seed=23)
        q = formats.quantize(w, key)
        for layout, tensors in _layouts(q).items():
            zeros = layout.split("-v")[0] in ("gptq", "awq")  # they store zero points of symmetric formats too
            assert formats.packed_nbytes(tensors) == formats.nbytes(key, shape, symmetric_zeros=zeros), (key, layout)
            if not zeros or not q.spec.symmetric:
                assert formats.nbytes(key, shape, symmetric_zeros=zeros) == q.nbytes == formats.nbytes(key, shape)


@pytest.mark.parametrize("key", formats.all_keys())
def test_every_layout_unpacks_to_the_same_quantized_tensor(key):
    w = make_weight((2, 32, 256) if key != "fp8-block128" else (2, 136, 200), "student_t", seed=29)
    q = formats.quantize(w, key)
    for layout, tensors in _layouts(q).items():
        if layout == "compressed-tensors":
            back = formats.unpack_compressed_tensors(tensors, key)
        elif layout.startswith("gptq"):
            back = unpack_gptq(tensors, key, q.shape, version=int(layout[-1]))
        elif layout == "awq":
            back = unpack_awq(tensors, key, q.shape)
        elif layout == "gpt-oss":
            back = unpack_gpt_oss_mxfp4(tensors["blocks"], tensors["scales"])
        else:
            back = formats.QuantizedTensor(q.spec, q.shape, tensors["weight"], tensors["weight_scale_inv"])
        assert back.shape == q.shape and torch.equal(back.dequantize(), q.dequantize()), layout
        if key != "bf16":
            assert torch.equal(
                back.codes.view(torch.uint8) if back.codes.dtype.itemsize == 1 else back.codes,
                q.codes.view(torch.uint8) if q.codes.dtype.itemsize == 1 else q.codes,
            ), layout


def test_gptq_v1_refuses_a_zero_point_of_zero():
    w = torch.rand(8, 32) + 0.1  # all positive: min clamps to 0, zero point is the lowest code
    q = formats.quantize(w, "int4-g32-asym")
    assert (q.zeros == -8).all()
    with pytest.raises(UserError, match="zero point of 0"):
        pack_gptq(q)
    # v1 can store an unsigned zero point of 16 (written as 15), which readers add back to 16
    q16 = formats.QuantizedTensor(q.spec, q.shape, q.codes, q.scales, torch.full_like(q.zeros, 8))
    t = pack_gptq(q16)
    assert (formats.unpack_int32(t["qzeros"], 4, 8) == 15).all()
    back = unpack_gptq(t, q.spec, q.shape)
    assert (back.zeros == 8).all() and torch.equal(back.dequantize(), q16.dequantize())
    assert torch.equal(unpack_gptq(pack_gptq(q, version=2), q.spec, q.shape, version=2).dequantize(), q.dequantize())


@pytest.mark.parametrize("byte_path", [True, False])
def test_int_bit_streams_hand_derived(byte_path, monkeypatch):
    # element i occupies bits [i*B, i*B+B) of one little-endian stream per row
    monkeypatch.setattr(formats.packing, "_BYTE_ALIGNED", byte_path)  # byte-run fast path and the generic one
    g = torch.Generator().manual_seed(31)
    for bits in (2, 3, 4, 8):
        n = 70
        u = torch.randint(0, 2**bits, (3, n), generator=g, dtype=torch.int32)
        before = u.clone()
        words = formats.pack_int32(u, bits)
        assert torch.equal(u, before)
        assert words.shape == (3, math.ceil(n * bits / 32)) and words.dtype == torch.int32
        for r in range(3):
            stream = sum(int(u[r, i]) << (i * bits) for i in range(n))
            expect = [(stream >> (32 * k)) & 0xFFFFFFFF for k in range(words.shape[1])]
            assert [int(x) & 0xFFFFFFFF for x in words[r]] == expect
        assert torch.equal(formats.unpack_int32(words, bits, n).int(), u)
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    assert formats.pack_e2m1(codes).tolist() == [[0x21, 0x8F]]
