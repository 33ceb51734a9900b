"""Why the fp8 preset sits below w8a8 on the model zoo and where it does not
(the goal "fp8 at least as good as w8a8", tests/flow/test_model_suite.py's
FP8_BELOW_W8A8): the two activation points of the presets on one tensor.

FP8 E4M3 keeps 3 mantissa bits: a value in the binade [2**e, 2**(e+1)) of
the scaled tensor rounds on a grid of step 2**(e-3), wherever the tensor's
range lies. On a Gaussian tensor that is about 31.5 dB, computed here by
integrating the step over the density (no pt2e_fq code), against about 40
dB for int8 over a calibrated range. With a few outlier channels (trained
transformers have them) int8's one grid is set by the outliers and the
other channels keep almost nothing, while fp8 keeps its 31.5 dB on every
channel."""

from __future__ import annotations

import math

import pytest
import torch

import pt2e_fq as q

E4M3_MAX, E4M3_MANTISSA_BITS, E4M3_MIN_NORMAL_EXPONENT = 448.0, 3, -6


def _sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return 10 * math.log10(float(x.pow(2).sum() / (x - y).pow(2).sum()))


def _e4m3_gaussian_sqnr_db(sigma: float, scale: float) -> float:
    """The SQNR of E4M3 rounding (scale: the tensor's per-tensor scale) of
    N(0, sigma^2), from the grid's step in each binade integrated over the
    density: E[x^2] / E[step(x)^2 / 12]."""
    x = torch.linspace(1e-9, 12 * sigma, 4_000_001, dtype=torch.float64)
    density = torch.exp(-0.5 * (x / sigma) ** 2)
    exponent = torch.floor(torch.log2(x / scale)).clamp(min=E4M3_MIN_NORMAL_EXPONENT)  # subnormals: the lowest step
    step = scale * torch.exp2(exponent - E4M3_MANTISSA_BITS)
    return 10 * math.log10(float((x**2 * density).sum() / (step**2 / 12 * density).sum()))


def _int8_activation(x: torch.Tensor) -> torch.Tensor:
    """The presets' static int8 activation point (w8a8), calibrated on x."""
    point = q.FakeQuantize(q.QSpec(q.INT8, q.PerTensor(), "asymmetric", observer=q.HistogramObserver()))
    point(x)
    point.disable_observer()
    return point(x)


def _fp8_activation(x: torch.Tensor) -> torch.Tensor:
    """The fp8 preset's activation point: E4M3 per tensor, dynamic."""
    return q.FakeQuantize(q.QSpec(q.FP8_E4M3, q.PerTensor(), dynamic=True))(x)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_on_a_gaussian_tensor_fp8_keeps_its_mantissa_and_int8_keeps_more(seed):
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(seed))
    fp8, int8 = _sqnr_db(x, _fp8_activation(x)), _sqnr_db(x, _int8_activation(x))
    expected = _e4m3_gaussian_sqnr_db(1.0, float(x.abs().max()) / E4M3_MAX)
    assert 30.5 < expected < 32.5  # about 31.5 dB whatever the range
    assert fp8 == pytest.approx(expected, abs=0.2)
    # The zoo's gap (fp8 9 to 11 dB below w8a8 end to end) is this one.
    assert int8 - fp8 >= 8.0, (int8, fp8)


def test_with_outlier_channels_int8_loses_the_other_channels_and_fp8_does_not():
    """Two channels of 64 a hundred times the others: int8's step is set by
    them (about 2 * 100 * 4.5 / 255 = 3.5 where the others are of size 1)."""
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0))
    x[:, :2] *= 100.0
    fp8, int8 = _fp8_activation(x), _int8_activation(x)
    others_fp8, others_int8 = _sqnr_db(x[:, 2:], fp8[:, 2:]), _sqnr_db(x[:, 2:], int8[:, 2:])
    assert others_fp8 > 30.0 and others_int8 < 10.0, (others_fp8, others_int8)
    assert _sqnr_db(x, fp8) > _sqnr_db(x, int8)
