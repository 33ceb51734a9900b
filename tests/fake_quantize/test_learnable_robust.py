"""Learnable ranges under values an optimizer or the data can produce: a
scale trained to 0 or below, and NaN / Inf input elements.

References: the pure-torch op (reference.fake_quantize_affine) on the
floor written by hand (fp32 eps), and the learnable op on the same input
with the non-finite elements' upstream gradient set to 0.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import assert_bits_equal
import pt2e_fq as q
from pt2e_fq import reference
from pt2e_fq.fake_quantize import FakeQuantize

EPS = torch.finfo(torch.float32).eps  # the documented floor
BACKWARD = torch.ops.pt2e_fq.fake_quantize_affine_learnable_backward.default


def _learning_point(spec: q.QSpec, x: torch.Tensor) -> FakeQuantize:
    """A learnable point calibrated on x, its observer off (the optimizer's turn)."""
    fq = FakeQuantize(spec)
    fq(x)
    fq.disable_observer()
    return fq


def _converted(fq: FakeQuantize) -> FakeQuantize:
    fq.convert(torch.nn.Sequential(fq), None)  # what convert_pt2e calls; the module freezes
    return fq


def _x(shape=(4, 64), seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("value", [-2.0, -2.5, -3.0, -1e30, -1.0, -1e-3, 0.0, -0.0, EPS / 4])
@pytest.mark.parametrize("scheme", ["symmetric", "asymmetric"])
def test_a_learned_scale_at_or_below_the_floor_reaches_the_op_as_the_floor(value, scheme):
    # Block 1's scale is pushed to `value` (an optimizer step past 0); the op
    # must see fp32 eps there in training and after convert, bit for bit,
    # and the gradient must still reach the Parameter.
    x = _x()
    fq = _learning_point(q.QSpec(q.INT8, q.PerChannel(0), scheme, learnable=True), x)
    with torch.no_grad():
        fq.scale.view(-1)[1] = value
    floored = fq.scale.detach().clone()
    floored.view(-1)[1] = EPS
    zero_point = None if scheme == "symmetric" else fq.zero_point.detach().clamp(-128, 127).round()
    expected, _ = reference.fake_quantize_affine(x, (1, 64), floored, zero_point, -128, 127)

    y = fq(x)
    assert_bits_equal(y.detach(), expected)
    y.square().sum().backward()
    assert torch.isfinite(fq.scale.grad).all() and fq.scale.grad.view(-1)[1] != 0

    converted = _converted(fq)
    assert_bits_equal(converted.scale, floored)
    assert_bits_equal(converted(x), expected)


@settings(max_examples=40, deadline=None)
@given(st.floats(min_value=-(2.0 ** 127), max_value=EPS, width=32))
def test_any_scale_at_or_below_the_floor_is_the_floor_in_training_and_after_convert(value):
    x = _x((2, 16), seed=1)
    fq = _learning_point(q.QSpec(q.INT4, learnable=True), x)
    with torch.no_grad():
        fq.scale.fill_(value)
    expected, _ = reference.fake_quantize_affine(x, (2, 16), torch.full((1, 1), EPS), None, -8, 7)
    assert_bits_equal(fq(x).detach(), expected)
    assert_bits_equal(_converted(fq)(x), expected)


def _with_nonfinite(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x with a NaN, a +Inf and a -Inf in row 0 (one block per row), and the mask of those."""
    x = x.clone()
    x[0, 3], x[0, 10], x[0, 20] = float("nan"), float("inf"), float("-inf")
    return x, ~torch.isfinite(x)


@pytest.mark.parametrize("offset", ["symmetric", "asymmetric", "minval"])
def test_nonfinite_input_elements_contribute_no_gradient(offset):
    # The same gradients as the input whose non-finite elements get no
    # upstream gradient: they add nothing to their block's d scale and d offset.
    x, bad = _with_nonfinite(_x((3, 32), seed=2))
    scale = torch.full((3, 1), 0.05)
    zero_point = torch.tensor([[3.3], [-2.0], [0.4]]) if offset == "asymmetric" else None
    minval = torch.tensor([[-1.5], [-2.0], [-1.0]]) if offset == "minval" else None
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    dx, dscale, doffset = BACKWARD(dy, x, [1, 32], scale, zero_point, -8, 7, None, minval)
    rdx, rdscale, rdoffset = BACKWARD(dy.masked_fill(bad, 0.0), x.masked_fill(bad, 0.0), [1, 32], scale,
                                      zero_point, -8, 7, None, minval)
    assert torch.isfinite(dscale).all() and torch.isfinite(doffset).all()
    assert_bits_equal(dx, rdx.masked_fill(bad, 0.0))
    torch.testing.assert_close(dscale, rdscale, rtol=1e-6, atol=0)
    torch.testing.assert_close(doffset, rdoffset, rtol=1e-6, atol=0)
    # And the float64 reference of the papers' formulas agrees.
    ref = reference.fake_quantize_affine_learnable_grads(x, [1, 32], scale, zero_point, -8, 7, None, dy, minval)
    torch.testing.assert_close(dscale.double(), ref[1], rtol=1e-4, atol=1e-7)
    if offset != "symmetric":  # (with no offset the op's d offset is not a gradient of anything)
        torch.testing.assert_close(doffset.double(), ref[2], rtol=1e-4, atol=1e-7)


def test_one_nan_element_does_not_end_learnable_range_training():
    # A masked row, a padded batch: one NaN in a training batch. The learned
    # scale stays finite and training goes on.
    clean = _x((4, 64), seed=4)
    fq = _learning_point(q.QSpec(q.INT8, q.PerChannel(0), "asymmetric", learnable=True), clean)
    opt = torch.optim.SGD(fq.parameters(), lr=1e-3)
    for step in range(3):
        x = _x((4, 64), seed=5 + step)
        if step == 0:
            x[2, 7] = float("nan")
        opt.zero_grad()
        (fq(x) - x.nan_to_num()).square().nansum().backward()
        opt.step()
        assert torch.isfinite(fq.scale).all(), f"step {step}: the learned scale became {fq.scale.view(-1).tolist()}"
        assert torch.isfinite(fq.zero_point).all()
