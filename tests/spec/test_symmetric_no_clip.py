"""Scheme SYMMETRIC_NO_CLIP (pt2e_fq.spec.schemes): its qparams against torchao's
SYMMETRIC_NO_CLIPPING_ERR mapping and hand-computed values, both ends of a
range on codes, and the fused QAT path on it (test_fused_observe.py runs
it bit for bit against the unfused one)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine

import pt2e_fq as q
from quantizers import presets

EPS = torch.finfo(torch.float32).eps


def fake_quantize(spec: q.QSpec, x: torch.Tensor) -> torch.Tensor:
    fq = q.FakeQuantize(spec)
    fq(x)  # observes, computes its qparams
    fq.disable_observer()
    return fq(x)


@pytest.mark.parametrize("lo,hi,scale", [
    (-1.0, 0.5, 1 / 8),  # the negative side is larger: -8 is its code
    (-0.7, 1.4, 0.2),  # the positive side: 7 is its code
    (-0.8, 0.7, 0.1),  # both exactly
    (0.0, 0.0, EPS),  # floored as torch's observers floor
])
def test_scales_by_hand(lo, hi, scale):
    x = torch.tensor([lo, hi])
    fq = q.FakeQuantize(q.QSpec(q.INT4, scheme="symmetric_no_clip", observer=q.CurrentMinMaxObserver()))
    fq(x)
    torch.testing.assert_close(fq.scale, torch.tensor([scale]))
    assert int(fq.zero_point) == 0


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(2, 8), rows=st.integers(1, 5), groups=st.integers(1, 4), seed=st.integers(0, 2**16),
       shift=st.floats(-1, 1))
def test_scales_equal_torchaos(bits, rows, groups, seed, shift):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 8 * groups, generator=g) + shift
    fmt = q.IntFormat(bits, signed=True)
    fq = q.FakeQuantize(q.QSpec(fmt, q.PerGroup(8, 1), "symmetric_no_clip", observer=q.CurrentMinMaxObserver()))
    fq(x)
    qmin, qmax = fmt.quant_range(narrow=False)
    scale, zero_point = choose_qparams_affine(x, MappingType.SYMMETRIC_NO_CLIPPING_ERR, (1, 8), torch.int8, qmin,
                                              qmax, eps=EPS, scale_dtype=torch.float32)
    assert torch.equal(fq.scale.reshape(scale.shape), scale)
    assert torch.equal(fq.zero_point.reshape(zero_point.shape), zero_point)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), shift=st.floats(-1, 1))
def test_both_ends_of_the_range_are_codes(seed, shift):
    """The end that sets the scale comes back to within fp32 rounding, the
    other one lies inside the grid; under SYMMETRIC the largest |value|
    sits on a rounding tie and misses by up to half a step."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(seed)) + shift
    no_clip = fake_quantize(q.QSpec(q.INT4, scheme="symmetric_no_clip", observer=q.CurrentMinMaxObserver()), x)
    lo, hi = x.min(), x.max()
    step = torch.maximum(-lo / 8, hi / 7)
    assert float(no_clip.min()) <= float(lo) + 0.5 * float(step) and float(no_clip.max()) >= float(hi) - 0.5 * float(step)
    end = lo if -lo / 8 > hi / 7 else hi
    torch.testing.assert_close(no_clip[x.argmin() if end is lo else x.argmax()], end, rtol=1e-6, atol=0)


def test_one_largest_value_on_a_tie_under_symmetric():
    """The case it fixes, by hand: [-0.3, 0.75] under SYMMETRIC int4 has
    scale 0.1, so 0.75 is code 7.5, a tie rounded to even (8) and clamped
    to 7: 0.7. SYMMETRIC_NO_CLIP gives scale 0.75 / 7 and 0.75 back."""
    x = torch.tensor([-0.3, 0.75])
    symmetric = fake_quantize(q.QSpec(q.INT4, observer=q.CurrentMinMaxObserver()), x)
    torch.testing.assert_close(symmetric, torch.tensor([-0.3, 0.7]))
    no_clip = fake_quantize(q.QSpec(q.INT4, scheme="symmetric_no_clip", observer=q.CurrentMinMaxObserver()), x)
    torch.testing.assert_close(no_clip, torch.tensor([0.75 / 7 * -3, 0.75]))


def test_the_w4a8_preset_uses_it_for_weights():
    assert presets.get_preset("w4a8").global_config.weight.scheme is q.Scheme.SYMMETRIC_NO_CLIP
