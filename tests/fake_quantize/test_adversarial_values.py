"""Adversarial values through the fake-quant modules, observers, report and
export checks: NaN, +-Inf, fp16's largest value, empty batches.

Expected values come from hand-computed qparams (torch's observer formulas
on the finite values) applied with pt2e_fq.reference, never from the module
under test.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.models.quantized import batch, fake_quant_nodes, ptq
from torch.fx.experimental.proxy_tensor import make_fx
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

import pt2e_fq as q
from pt2e_fq import reference
from pt2e_fq.fake_quantize import NonFiniteQParamsError
from pt2e_fq.graph import check_finite_qparams

NAN, INF = float("nan"), float("inf")


def f32(*values):
    return torch.tensor(values, dtype=torch.float32)


def hand_asymmetric(lo: float, hi: float, qmin: int = -128, qmax: int = 127):
    """torch's affine qparams of [lo, hi] (widened to include 0), in fp32."""
    min_neg, max_pos = f32(min(lo, 0.0)), f32(max(hi, 0.0))
    scale = ((max_pos - min_neg) / float(qmax - qmin)).clamp(min=torch.finfo(torch.float32).eps)
    zero_point = (qmin - torch.round(min_neg / scale)).clamp(qmin, qmax).to(torch.int32)
    return scale, zero_point


def with_nonfinite(values: list[float], positions: list[int], kinds: list[float]) -> torch.Tensor:
    x = f32(*values)
    for p, v in zip(positions, kinds):
        x[p % x.numel()] = v
    return x


# ---------------------------------------------------------------------------
# Item 14: dynamic points take NaN / Inf inputs; nothing poisons a point's state


def test_dynamic_fp8_preset_point_ignores_nonfinite_values_for_its_scale():
    spec = q.QSpec(q.FP8_E4M3, q.PerTensor(), dynamic=True)  # the fp8 preset's activations
    x = f32(1.5, NAN, -3.0, INF, 0.25, -INF)
    y = q.FakeQuantize(spec)(x)
    scale = f32(3.0) / 448.0  # amax of the finite values / fmax(E4M3)
    expected, _ = reference.fake_quantize_float(x, [6], scale, torch.float8_e4m3fn)
    torch.testing.assert_close(y, expected, rtol=0, atol=0, equal_nan=True)
    assert math.isnan(y[1]) and y[3] == 3.0 and y[5] == -3.0  # NaN through, +-Inf saturates


def test_dynamic_per_token_int8_point_ignores_nonfinite_values_per_token():
    spec = q.QSpec(q.INT8, q.PerToken(), "asymmetric", dynamic=True)
    x = torch.stack([f32(0.5, NAN, 2.0, -1.0), f32(INF, 1.0, -4.0, 3.0), f32(1.0, 2.0, 3.0, 4.0)])
    y = q.FakeQuantize(spec)(x)
    for row, (lo, hi) in enumerate([(-1.0, 2.0), (-4.0, 3.0), (1.0, 4.0)]):
        scale, zp = hand_asymmetric(lo, hi)
        expected, _ = reference.fake_quantize_affine(x[row], [4], scale, zp, -128, 127)
        torch.testing.assert_close(y[row], expected, rtol=0, atol=0, equal_nan=True)


def test_a_token_with_no_finite_value_gives_nan_and_leaves_the_others_alone():
    spec = q.QSpec(q.INT8, q.PerToken(), dynamic=True)
    x = torch.stack([f32(NAN, NAN), f32(-1.0, 0.5)])
    y = q.FakeQuantize(spec)(x)
    assert torch.isnan(y[0]).all()
    scale = f32(1.0) / 127.5
    expected, _ = reference.fake_quantize_affine(x[1], [2], scale, torch.zeros(1, dtype=torch.int32), -128, 127)
    torch.testing.assert_close(y[1], expected, rtol=0, atol=0)


@pytest.mark.parametrize("observer", [q.MinMaxObserver(), q.MovingAverageMinMaxObserver(0.5)])
def test_a_nonfinite_calibration_batch_does_not_poison_later_clean_batches(observer):
    fq = q.FakeQuantize(q.QSpec(q.INT8, q.PerTensor(), "asymmetric", observer=observer))
    fq.disable_fake_quant()  # the issue's setup: calibration with fake quant off
    fq(f32(NAN, INF, -INF))  # nothing finite: the range stays empty
    fq(f32(-1.0, NAN, 2.0))
    fq(f32(-3.0, 1.0, 0.5))
    if isinstance(observer, q.MinMaxObserver):
        lo, hi = -3.0, 2.0
    else:  # the first finite batch sets the range, then running += 0.5 * (batch - running)
        lo, hi = -1.0 + 0.5 * (-3.0 - -1.0), 2.0 + 0.5 * (1.0 - 2.0)
    assert (fq.min_val.item(), fq.max_val.item()) == (lo, hi)
    scale, zp = hand_asymmetric(lo, hi)
    assert torch.equal(fq.scale.reshape(1), scale.reshape(1)) and torch.equal(fq.zero_point.reshape(1), zp.reshape(1))


def test_moving_average_keeps_a_block_that_a_batch_leaves_without_finite_values():
    fq = q.FakeQuantize(q.QSpec(q.INT8, q.PerChannel(0), observer=q.MovingAverageMinMaxObserver(0.5)))
    fq(torch.stack([f32(-1.0, 1.0), f32(-2.0, 2.0)]))
    fq(torch.stack([f32(NAN, INF), f32(-4.0, 4.0)]))
    assert fq.min_val.flatten().tolist() == [-1.0, -3.0] and fq.max_val.flatten().tolist() == [1.0, 3.0]


def test_mse_observer_ignores_nonfinite_values():
    # With the NaN / Inf elements removed the tensor is what the observer must see.
    clean = torch.linspace(-2.0, 3.0, 64)
    dirty = clean.clone()
    dirty[[5, 17, 40]] = torch.tensor([NAN, INF, -INF])
    keep = torch.isfinite(dirty)
    spec = q.QSpec(q.INT8, q.PerTensor(), observer=q.MSEObserver(num_candidates=20))
    a, b = q.FakeQuantize(spec), q.FakeQuantize(spec)
    a(dirty)
    b(dirty[keep])
    assert torch.isfinite(a.scale).all()
    assert torch.equal(a.scale, b.scale) and torch.equal(a.zero_point, b.zero_point)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=24),
    positions=st.lists(st.integers(0, 1000), max_size=6),
    kinds=st.lists(st.sampled_from([NAN, INF, -INF]), min_size=6, max_size=6),
)
def test_min_max_range_is_the_range_of_the_finite_values(values, positions, kinds):
    x = with_nonfinite(values, positions, kinds)
    fq = q.FakeQuantize(q.QSpec(q.INT8, q.PerTensor(), "asymmetric"))
    y = fq(x)
    finite = x[torch.isfinite(x)]
    if finite.numel():
        assert (fq.min_val.item(), fq.max_val.item()) == (finite.min().item(), finite.max().item())
        scale, zp = hand_asymmetric(finite.min().item(), finite.max().item())
        expected, _ = reference.fake_quantize_affine(x, [x.numel()], scale, zp, -128, 127)
        torch.testing.assert_close(y, expected, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(y).eq(torch.isnan(x)).all()  # NaN exactly where the input is NaN


# ---------------------------------------------------------------------------
# Item 7: values inside the calibrated range stay finite in fp16 / bf16


@pytest.mark.parametrize("scheme", ["asymmetric", "symmetric", "symmetric_narrow"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("low", [-100.0, -1.0, 0.0, None])
def test_the_dtype_max_inside_the_calibrated_range_stays_finite(scheme, dtype, low):
    top = torch.finfo(dtype).max
    low = -top if low is None else low
    x = torch.tensor([low, 1.0, top], dtype=dtype)
    fq = q.FakeQuantize(q.QSpec(q.INT8, q.PerTensor(), scheme))
    y = fq(x)
    assert torch.isfinite(y).all(), (y, fq.scale, fq.zero_point)
    # the grid's two ends, as the reference dequantizes them, are finite in the dtype
    ends = torch.tensor([-1e38, 1e38], dtype=torch.float32)
    qmin, qmax = fq.quant_min, fq.quant_max
    grid, _ = reference.fake_quantize_affine(ends.to(dtype), [2], fq.scale, fq.zero_point, qmin, qmax)
    assert torch.isfinite(grid).all()
    # The top value stays near the top; the range is capped at half the fp32
    # max (bf16's max is above it) so that hi - lo stays finite in fp32.
    assert y[-1] >= 0.99 * min(top, torch.finfo(torch.float32).max / 2)


def test_the_fp16_grid_keeps_the_issue_example_in_range():
    # [-100, 65504] with torch's asymmetric qparams puts the top code at
    # (127 + 128) * 257.27 = 65604: +Inf in fp16 before the fix.
    x = torch.tensor([-100.0, 65504.0], dtype=torch.float16)
    y = q.FakeQuantize(q.QSpec(q.INT8, q.PerTensor(), "asymmetric"))(x)
    assert torch.isfinite(y).all() and y[1] > 65000


@pytest.mark.parametrize("fmt,scheme,dtype,x,scale,y", [
    # int4 [-8, 7], zero point 0: hi = 60000 sets scale hi / 7 and the grid's
    # low end -8 / 7 * hi. The range is clamped to 65504 * 7 / 8 = 57316, so
    # scale 8188 and the low end -8 * 8188 = -65504 exactly.
    (q.INT4, "symmetric_no_clip", torch.float16, [60000.0, -65000.0, 1000.0], 8188.0, [57316.0, -65504.0, 0.0]),
    # int8: the clamp is 65504 * 127 / 128 = 64992.25, scale 511.75 =
    # 64992.25 / 127; -Inf saturates at -128 * 511.75 = -65504.
    (q.INT8, "symmetric_no_clip", torch.float16, [65504.0, 1.0, -INF], 511.75, [64992.25, 0.0, -65504.0]),
    # int2 [-2, 1]: the low end is twice the range's hi; the clamp is half
    # bf16's max (exact), the scale that, and the low end bf16's max.
    (q.IntFormat(2), "symmetric_no_clip", torch.bfloat16, [3.3895313892515355e38, -3.3895313892515355e38],
     1.6947656946257677e38, [1.6947656946257677e38, -3.3895313892515355e38]),
    # uint4 [0, 15], zero point 8: 8 codes below it, 7 above; the clamp is
    # 65504 * 7 / 8 = 57316 on both sides, the scale 57316 / 7.
    (q.UINT4, "symmetric_no_clip", torch.float16, [-65504.0, 100.0, 65504.0], 8188.0, [-65504.0, 0.0, 57316.0]),
    # symmetric narrow [-127, 127] reaches amax itself: no clamp below the max.
    (q.INT8, "symmetric_narrow", torch.float16, [65504.0, -65504.0, 1.0], 65504.0 / 127, [65504.0, -65504.0, 0.0]),
])
@pytest.mark.parametrize("observer", [q.MinMaxObserver(), q.HistogramObserver(bins=64)], ids=lambda o: type(o).__name__)
def test_the_grid_ends_stay_finite_by_hand(fmt, scheme, dtype, x, scale, y, observer):
    x = torch.tensor(x, dtype=dtype)
    fq = q.FakeQuantize(q.QSpec(fmt, q.PerTensor(), scheme, observer=observer))
    for _ in range(2):  # the first call observes unfused, the second (MinMax) in the fused op
        out = fq(x)
        torch.testing.assert_close(fq.scale.reshape(()), torch.tensor(scale), rtol=2**-23, atol=0)
        assert torch.equal(out, torch.tensor(y, dtype=torch.float64).to(torch.float32).to(dtype)), out


SCHEMES = ["symmetric", "symmetric_narrow", "symmetric_no_clip", "asymmetric", "minval"]


@settings(max_examples=150, deadline=None)
@given(
    bits=st.integers(2, 15), signed=st.booleans(), scheme=st.sampled_from(SCHEMES),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    observer=st.sampled_from(["minmax", "moving"]),
    fractions=st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=6),
    extremes=st.lists(st.sampled_from([-1.0, 1.0, -INF, INF]), min_size=1, max_size=3),
)
def test_every_scheme_keeps_every_grid_point_finite(bits, signed, scheme, dtype, observer, fractions, extremes):
    """Inputs up to the dtype's largest value and +-Inf: every finite input
    comes out finite, and +-Inf saturates at the grid's finite ends, whose
    values are the hand formula (code - zero point) * scale, or MINVAL's
    (code - qmin) * scale + minval, in fp32 rounded to the dtype. Two calls:
    the second runs the fused observe op."""
    top = torch.finfo(dtype).max
    x = torch.tensor([f * top for f in fractions + extremes], dtype=torch.float32).to(dtype)
    fmt = q.IntFormat(bits, signed)
    observer = q.MinMaxObserver() if observer == "minmax" else q.MovingAverageMinMaxObserver(0.5)
    spec = (q.QSpec(fmt, q.PerTensor(), "asymmetric", "minval", observer=observer) if scheme == "minval"
            else q.QSpec(fmt, q.PerTensor(), scheme, observer=observer))
    fq = q.FakeQuantize(spec)
    for _ in range(2):
        y = fq(x)
        qmin, qmax = fq.quant_min, fq.quant_max
        s = fq.scale.reshape(())
        if scheme == "minval":
            m = fq.minval.reshape(())
            low, high = m, (qmax - qmin) * s + m
        else:
            zp = int(fq.zero_point)
            low, high = (qmin - zp) * s, (qmax - zp) * s
        low, high = low.to(dtype), high.to(dtype)
        assert torch.isfinite(low) and torch.isfinite(high), (low, high, fq.scale)
        finite = torch.isfinite(x)
        assert torch.isfinite(y[finite]).all(), (x, y, fq.scale)
        assert torch.equal(y[x == INF], high.expand_as(y[x == INF]))
        assert torch.equal(y[x == -INF], low.expand_as(y[x == -INF]))


# ---------------------------------------------------------------------------
# Item 5: observers count the NaN / Inf they ignore (shown in the report); a
# point with non-finite qparams is never converted nor exported


INT8_ACT = q.QSpec(q.INT8, q.PerTensor(), "asymmetric")
INT8_W = q.QSpec(q.INT8, q.PerChannel(0), "symmetric_narrow")


def _input_point(gm) -> str:
    """The fake-quant module reading the graph's input."""
    return next(n.target for n in fake_quant_nodes(gm) if n.args[0].op == "placeholder")


def _with_nonfinite_input(seed: int) -> tuple[torch.Tensor, int]:
    x = batch(seed)
    flat = x.view(-1)
    flat[[3, 50, 77]] = torch.tensor([NAN, INF, -INF])
    flat[100:105] = NAN
    return x, 8


def test_observers_count_what_they_ignore_and_the_report_shows_it_before_and_after_convert():
    gm = ptq(INT8_ACT, INT8_W, convert=False)
    point = _input_point(gm)
    x, n = _with_nonfinite_input(11)
    gm(x)
    fq = gm.get_submodule(point)
    assert fq.nonfinite_count == n
    # the range is that of every finite value seen: ptq's batches 1..4 and batch 11's finite ones
    seen = torch.cat([batch(s).flatten() for s in range(1, 5)] + [x[torch.isfinite(x)]])
    assert (fq.min_val.item(), fq.max_val.item()) == (seen.min().item(), seen.max().item())
    rows = {r["point"]: r for r in q.report(gm, (batch(12),), file=None).rows}
    assert rows[point]["nonfinite"] == n
    weight = next(r for r in rows.values() if r["role"].startswith("weight"))
    assert weight["nonfinite"] == 0
    converted = convert_pt2e(gm)
    out = io.StringIO()
    rows = {r["point"]: r for r in q.report(converted, (batch(12),), file=out).rows}
    assert rows[point]["nonfinite"] == n
    assert "NaN/Inf ignored" in out.getvalue()


def test_counting_stays_on_the_device():
    # A host sync (.item(), a branch on a value) cannot be traced with fake tensors.
    fq = q.FakeQuantize(INT8_ACT)
    fq(f32(1.0, 2.0))
    graph = make_fx(fq, tracing_mode="fake", _allow_non_fake_inputs=True)(f32(NAN, 1.0, 3.0))
    # The second observation is the fused observe op, which counts in place
    # on x's device (its schema writes `nonfinite`); the unfused path adds.
    counters = (torch.ops.aten.add_.Tensor, torch.ops.pt2e_fq.fake_quantize_affine_observe.default)
    assert any(n.target in counters for n in graph.graph.nodes)


def test_convert_refuses_a_point_with_a_nan_scale_and_names_it():
    gm = ptq(INT8_ACT, INT8_W, convert=False)
    point = _input_point(gm)
    gm.get_submodule(point).scale.fill_(NAN)  # e.g. from a state_dict saved before the observer fix
    with pytest.raises(NonFiniteQParamsError) as err:
        convert_pt2e(gm)
    text = str(err.value)
    assert "\n" not in text
    assert f"1 fake-quant point(s) have non-finite qparams" in text
    assert f"{point} between 'x' and " in text and "scale[0] = nan" in text


def test_convert_refuses_a_point_that_saw_no_finite_value():
    gm = ptq(INT8_ACT, INT8_W, convert=False)
    point = _input_point(gm)
    fresh = q.FakeQuantize(INT8_ACT)
    fresh(torch.full((2, 3, 6, 6), NAN))
    gm.get_submodule(point).load_state_dict(fresh.state_dict())
    with pytest.raises(NonFiniteQParamsError, match=rf"{point} between .* has min_val\[0\] = inf, max_val\[0\] = -inf"):
        convert_pt2e(gm)


def _converted_with_nan_scale():
    gm = ptq(INT8_ACT, INT8_W)
    point = _input_point(gm)
    gm.get_submodule(point).scale.fill_(NAN)  # changed after convert
    return gm, point


def test_the_export_check_names_a_program_point_with_a_nan_scale():
    gm, point = _converted_with_nan_scale()
    ep = torch.export.export(gm, (batch(0),))
    with pytest.raises(NonFiniteQParamsError) as err:
        check_finite_qparams(ep, "save")
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("save: 1 fake-quant point(s) have non-finite qparams: ")
    assert f"{point} (" in text and "input of conv2d" in text and "scale[0] = nan" in text
    gm.get_submodule(point).scale.fill_(0.5)
    check_finite_qparams(torch.export.export(gm, (batch(0),)), "save")  # finite: passes


# ---------------------------------------------------------------------------
# Item 13 (FakeQuantize): an empty batch gives an empty output and changes nothing

EMPTY_SPECS = [
    q.QSpec(q.INT8, q.PerTensor(), "asymmetric"),
    q.QSpec(q.INT8, q.PerChannel(0), observer=q.MovingAverageMinMaxObserver(0.5)),
    q.QSpec(q.INT8, q.PerChannel(1), observer=q.MSEObserver(num_candidates=4)),
    q.QSpec(q.INT4, q.PerGroup(2, 1), "asymmetric", "minval"),
    q.QSpec(q.FP8_E4M3, q.PerTensor()),
    q.QSpec(q.NVFP4, q.PerGroup(16, 1)),
]


def _state(fq):
    return {k: v.clone() for k, v in fq._buffers.items()}


@pytest.mark.parametrize("spec", EMPTY_SPECS, ids=str)
@pytest.mark.parametrize("calibrated", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_empty_batch_gives_an_empty_output_and_leaves_the_point_alone(spec, calibrated, dtype):
    fq = q.FakeQuantize(spec)
    if calibrated:
        fq(torch.randn(4, 32, generator=torch.Generator().manual_seed(0)).to(dtype))
    before = _state(fq)
    for shape in [(0, 32), (4, 0)]:
        x = torch.empty(shape, dtype=dtype, requires_grad=True)
        y = fq(x)
        assert y.shape == x.shape and y.dtype == dtype
        y.sum().backward()
        assert x.grad.shape == x.shape
    after = _state(fq)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before), "an empty batch changed the state"
    assert fq.is_calibrated == calibrated


def test_an_empty_batch_through_a_converted_point():
    model = torch.nn.Module()
    model.fq = q.FakeQuantize(q.QSpec(q.INT8, q.PerChannel(0)))
    model.fq(torch.randn(4, 8))
    model.fq.convert(model, None)
    assert model.fq(torch.empty(0, 8)).shape == (0, 8)


# ---------------------------------------------------------------------------
# The reference on empty and NaN inputs, against the ops


@pytest.mark.parametrize("shape, axis", [((0, 32), -1), ((0, 32), 0), ((4, 0), -1), ((4, 0), 0), ((0,), 0),
                                         ((3, 0, 5), -1), ((3, 0, 5), 0)])
def test_the_reference_takes_the_empty_block_scaled_inputs_the_ops_take(shape, axis):
    x = torch.empty(shape)
    mx = torch.ops.pt2e_fq.fake_quantize_mx(x, "e4m3", 32, axis)
    ref = reference.fake_quantize_mx(x, torch.float8_e4m3fn, 32, axis)
    assert ref[0].shape == mx[0].shape and ref[2].shape == mx[2].shape
    nv = torch.ops.pt2e_fq.fake_quantize_nvfp4(x, None, axis)
    ref = reference.fake_quantize_nvfp4(x, None, axis)
    assert ref[0].shape == nv[0].shape and ref[2].shape == nv[2].shape
    assert ref[3].item() == nv[3].item() == 1.0  # max|x| of nothing is 0: the global scale is 1


def _nan_inputs(dtype):
    # NaNs with both signs and a payload, +-Inf, finite values
    bits = torch.tensor([0x7FC00000, 0xFFC00000, 0x7FC12345, 0x7F812345], dtype=torch.int64).to(torch.int32)
    nans = bits.view(torch.float32)
    values = torch.cat([nans, f32(INF, -INF, 0.3, -1.7, 5.0, 0.0)])
    return values.repeat(4)[:34].to(dtype)  # 34: MX blocks of 32 with a ragged last one


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_reference_and_the_ops_agree_on_every_value_and_on_where_nan_is(dtype):
    x = _nan_inputs(dtype)
    s, z = f32(0.05), torch.zeros(1, dtype=torch.int32)
    pairs = [
        (torch.ops.pt2e_fq.fake_quantize_affine(x, [34], s, z, -128, 127, None)[0],
         reference.fake_quantize_affine(x, [34], s, z, -128, 127)[0]),
        (torch.ops.pt2e_fq.fake_quantize_float(x, [34], s, "e4m3")[0],
         reference.fake_quantize_float(x, [34], s, torch.float8_e4m3fn)[0]),
        (torch.ops.pt2e_fq.fake_quantize_mx(x, "e4m3", 32, -1)[0],
         reference.fake_quantize_mx(x, torch.float8_e4m3fn, 32, -1)[0]),
        (torch.ops.pt2e_fq.fake_quantize_nvfp4(x, f32(0.01), -1)[0],
         reference.fake_quantize_nvfp4(x, f32(0.01), -1)[0]),
    ]
    for op, ref in pairs:
        torch.testing.assert_close(op, ref, rtol=0, atol=0, equal_nan=True)


def test_nvfp4_with_a_computed_global_scale_turns_one_nan_into_an_all_nan_tensor():
    # Documented (docs/export.md, "Non-finite values"): max|x| is NaN, so is the global scale.
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    x[0, 3] = NAN
    assert torch.isnan(reference.nvfp4_global_scale(x))
    dynamic = q.FakeQuantize(q.QSpec(q.NVFP4, q.PerGroup(16, -1), dynamic=True))(x)
    assert torch.isnan(dynamic).all()
    # A static point's observer ignores the NaN: only its block of 16 is NaN.
    fq = q.FakeQuantize(q.QSpec(q.NVFP4, q.PerGroup(16, -1)))
    y = fq(x)
    g = x[torch.isfinite(x)].abs().max() / (448.0 * 6.0)
    assert torch.equal(fq.global_scale.reshape(()), g)
    expected, *_ = reference.fake_quantize_nvfp4(x, g)
    torch.testing.assert_close(y, expected, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(y[0, :16]).all() and not torch.isnan(y[0, 16:]).any() and not torch.isnan(y[1]).any()


# ---------------------------------------------------------------------------
# Item 6: the ONNX file turns a NaN input of an integer point into a finite value


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x)


def _onnx_file(tmp_path, preset):
    pytest.importorskip("onnxruntime")
    from pt2e_fq.cli import pipeline
    from pt2e_fq.export import to_onnx

    torch.manual_seed(0)
    x = torch.randn(2, 8)
    converted = pipeline.quantize(_Linear().eval(), (x,), preset, calibration=[torch.randn(2, 8) for _ in range(3)],
                                  progress=False)
    path = tmp_path / f"{preset}.onnx"
    to_onnx(converted, (x,), path)
    return converted, path


def test_onnx_runtime_gives_the_lowest_code_for_nan_and_check_onnx_says_so(tmp_path):
    from pt2e_fq.export import check_onnx
    from pt2e_fq.export.onnx.session import ort_session

    converted, path = _onnx_file(tmp_path, "w8a8")
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    x[0, 1] = NAN
    # The input point's Q/DQ in ONNX Runtime: NaN becomes (qmin - zp) * scale, as -Inf does.
    fq = next(m for n, m in converted.named_modules() if isinstance(m, q.FakeQuantize) and m.qspec.scheme.value == "asymmetric")
    lowest = ((fq.quant_min - fq.zero_point.float()) * fq.scale).item()
    with pytest.raises(AssertionError) as err:
        check_onnx(path, converted, (x,))
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("check_onnx: point fake_quantize_affine")
    assert f"gets 1 NaN input element(s): torch gives NaN, ONNX Runtime {lowest:g} (QuantizeLinear to INT8 " in text
    assert "every other element is bit-exact" in text and "docs/export.md, 'Non-finite values'" in text
    session = ort_session(path, optimized=False)
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    assert torch.isfinite(torch.from_numpy(out)).all() and torch.isnan(converted(x)[0]).all()


def test_an_fp8_onnx_file_keeps_nan_and_check_onnx_passes(tmp_path):
    from pt2e_fq.export import check_onnx

    converted, path = _onnx_file(tmp_path, "fp8")
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    x[0, 1] = NAN
    assert check_onnx(path, converted, (x,)).points > 0


@pytest.mark.parametrize("exporter", ["save", "to_onnx"])
def test_save_and_to_onnx_refuse_a_point_with_a_nan_scale_before_writing(tmp_path, exporter):
    gm, point = _converted_with_nan_scale()
    path = tmp_path / ("m.pt2" if exporter == "save" else "m.onnx")
    if exporter == "save":
        write = lambda: q.save(gm, (batch(0),), path)  # noqa: E731
    else:
        pytest.importorskip("onnxruntime")
        from pt2e_fq.export import to_onnx

        write = lambda: to_onnx(gm, (batch(0),), path)  # noqa: E731
    with pytest.raises(NonFiniteQParamsError, match=rf"^{exporter}: 1 fake-quant point\(s\) have non-finite qparams: "
                                                      rf"{point} \(.*input of conv2d\) has scale\[0\] = nan"):
        write()
    assert not path.exists()
