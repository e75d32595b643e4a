"""The environment switches that change GPU math (MOEQUANT_GPTQ_MATMUL, _GPTQ_CHOLESKY_MATMUL, _CHOLESKY, _TRITON,
_CUDA_GRAPHS) are part of what a run is: the calibration settings' fingerprint (and so the run fingerprint of
plan.json, the checkpoint and the report) records those set away from their defaults; at their defaults, or
unset, it records none."""

from __future__ import annotations

import pytest

from moequant.algorithms.gpu_math import GPU_MATH_SWITCHES
from moequant.measure.settings import CalibrationSettings


@pytest.fixture
def clean_env(monkeypatch):
    for name in GPU_MATH_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults_record_no_switch(clean_env):
    plain = CalibrationSettings().fingerprint_fields()
    assert plain["gpu_math"] == {}
    for name, value in [("MOEQUANT_GPTQ_MATMUL", "TF32"), ("MOEQUANT_TRITON", "1"), ("MOEQUANT_CHOLESKY", "auto")]:
        clean_env.setenv(name, value)  # what each reader takes as its default
    assert CalibrationSettings().fingerprint_fields() == plain


@pytest.mark.parametrize(
    "name, value",
    [
        ("MOEQUANT_GPTQ_MATMUL", "fp32"),
        ("MOEQUANT_GPTQ_CHOLESKY_MATMUL", "fp32"),
        ("MOEQUANT_CHOLESKY", "looped"),
        ("MOEQUANT_TRITON", "0"),
        ("MOEQUANT_CUDA_GRAPHS", "0"),
    ],
)
def test_each_switch_set_otherwise_enters_the_fingerprint(clean_env, name, value):
    plain = CalibrationSettings().fingerprint_fields()
    clean_env.setenv(name, value)
    fields = CalibrationSettings().fingerprint_fields()
    assert fields["gpu_math"] == {name: value} and {k: v for k, v in fields.items() if k != "gpu_math"} == {
        k: v for k, v in plain.items() if k != "gpu_math"
    }
