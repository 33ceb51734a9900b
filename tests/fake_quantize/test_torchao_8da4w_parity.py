"""The -dyn presets' points against torchao's 8da4w / 8da8w fake quantization
(torchao.quantization.qat's IntxFakeQuantizer, with the configs torchao's
QATConfig derives from Int8DynamicActivationIntxWeightConfig), and their
per-token qparams against quantized_decomposed.choose_qparams_per_token_asymmetric,
the op an ExecuTorch program computes them with.

Equal bit for bit (qparams and outputs), apart from two documented
differences (docs/quantizers.md, "The dynamic-activation presets"), each
bounded here:
- rounding ties: we divide x / scale (DESIGN), torchao multiplies
  x * (1 / scale); an element may land one code apart, and only where
  x / scale is within a few ulps of a half-integer. Under SYMMETRIC int4
  weights a group's extreme value sits on such a tie (amax / (amax / 7.5)
  is 7.5): at -amax we round to -8, torchao's product often to -7;
- the scale's floor: ours 2**-23 (torch's observers', and ExecuTorch's
  choose_qparams_per_token_asymmetric's), torchao's QAT 2**-126: a block
  whose range is under (quant_max - quant_min) * 2**-23 differs, by under
  2**-23 per element.

With bfloat16 group scales on both sides (get_preset("w4a8-dyn",
target="xnnpack"), torchao's `scale_precision=torch.bfloat16`) the scales
are equal bit for bit; torchao then computes 1 / scale in bfloat16, so its
x * (1 / scale) is off x / scale by up to 2**-8 relative: the ties widen to
that, still one code apart at most (|x / scale| <= 8 for int4).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from pt2e_fq import FakeQuantize
from pt2e_fq.ops.blocks import block_min_max
from quantizers import presets
from torchao.quantization import Int8DynamicActivationIntxWeightConfig, MappingType, PerAxis, PerGroup
from torchao.quantization.qat.fake_quantize_config import IntxFakeQuantizeConfig, _infer_fake_quantize_configs
from torchao.quantization.qat.fake_quantizer import IntxFakeQuantizer

SCALE_FLOOR = 2.0 ** -23
# Near a rounding tie: x / scale (float64) within this of a half-integer, relative to |x / scale|.
TIE_WIDTH = 2.0 ** -20


def _torchao(weight_dtype, granularity):
    """torchao's (activation, weight) fake quantizers of its 8daXw QAT."""
    base = Int8DynamicActivationIntxWeightConfig(weight_dtype=weight_dtype, weight_granularity=granularity,
                                                 weight_mapping_type=MappingType.SYMMETRIC)
    act, weight = _infer_fake_quantize_configs(base)
    return IntxFakeQuantizer(act), IntxFakeQuantizer(weight)


TORCHAO = {"w4a8-dyn": _torchao(torch.int4, PerGroup(32)), "w8a8-dyn": _torchao(torch.int8, PerAxis(0))}


def _ours(preset):
    config = presets.get_preset(preset, qat=True).global_config
    return FakeQuantize(config.input_activation), FakeQuantize(config.weight)


def _expand(qparam, x, block_size):
    for d, b in enumerate(block_size):
        qparam = qparam.repeat_interleave(b, dim=d)
    return qparam.reshape(x.shape)


def assert_equal_but_bounded(x, ours, theirs, scale, block_size, qmin, qmax, tie_width=TIE_WIDTH):
    """`ours` == `theirs` bit for bit, except one code apart at rounding ties
    (x / scale within tie_width of a half-integer, relative), and within
    2**-23 in blocks under the scale floor."""
    lo, hi = block_min_max(x, block_size)
    floored = _expand((hi.clamp(min=0) - lo.clamp(max=0)) < (qmax - qmin) * SCALE_FLOOR, x, block_size)
    s = _expand(scale, x, block_size)
    diff = (ours - theirs).abs()
    assert (diff[floored] < SCALE_FLOOR).all()
    t = x.double() / s.double()
    near_tie = ((t - t.floor() - 0.5).abs() <= tie_width * t.abs().clamp(min=1))
    # One step, up to the rounding of the two products (q - zp) * scale.
    one_code = (diff.double() - s.double()).abs() <= 2.0 ** -22 * torch.maximum(ours.abs(), theirs.abs()).double()
    off = (diff > 0) & ~floored
    assert (near_tie & one_code)[off].all(), (x[off & ~near_tie], ours[off], theirs[off])


def _row(draw, cols, g):
    kind = draw(st.sampled_from(["normal", "drawn", "constant", "zeros", "positive", "negative", "ties", "tiny",
                                 "huge", "outlier"]))
    if kind == "drawn":
        values = draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=cols, max_size=cols))
        return torch.tensor(values, dtype=torch.float32)
    r = torch.randn(cols, generator=g)
    if kind == "constant":
        return torch.full((cols,), float(r[0]))
    if kind == "zeros":
        return torch.zeros(cols)
    if kind == "positive":
        return r.abs() + 0.5
    if kind == "negative":
        return -r.abs() - 0.5
    if kind == "ties":  # half-way between the codes of the asymmetric int8 grid of [-1.3, 2.1]
        step = 3.4 / 255
        k = torch.randint(-90, 150, (cols,), generator=g).float()
        row = (k + 0.5) * step
        row[0], row[-1] = -1.3, 2.1
        return row
    if kind == "tiny":
        return r * 1e-7
    if kind == "huge":
        return r * 1e30
    r[int(torch.randint(cols, (1,), generator=g))] *= 1000.0  # "outlier"
    return r


@st.composite
def matrices(draw, max_rows=6, cols=st.integers(1, 80)):
    rows, cols = draw(st.integers(1, max_rows)), draw(cols)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    return torch.stack([_row(draw, cols, g) for _ in range(rows)])


@pytest.mark.parametrize("preset", presets.DYNAMIC_ACTIVATION_PRESETS)
@settings(max_examples=100, deadline=None)
# torchao's per-token fake quantizer fails on (2, rows, 1): its qparams lose their shape.
@given(x=matrices(cols=st.integers(2, 80)), leading=st.sampled_from([(), (2,)]))
def test_per_token_activations_equal_torchao(preset, x, leading):
    x = x.expand(*leading, *x.shape).clone()
    ours, theirs = _ours(preset)[0], TORCHAO[preset][0]
    y, y_ref = ours(x), theirs(x)
    spec = ours.qspec
    block_size = spec.granularity.block_size(x.shape)
    qparams = spec.kind.current_qparams(spec, x, block_size)
    lo, hi = block_min_max(x, block_size)
    exact = (hi.clamp(min=0) - lo.clamp(max=0)) >= 255 * SCALE_FLOOR
    # torchao's qparams have the per-token shape without the last dim's 1.
    assert torch.equal(qparams["scale"][exact], theirs.scale.reshape(qparams["scale"].shape)[exact])
    assert torch.equal(qparams["zero_point"][exact], theirs.zero_point.reshape(qparams["scale"].shape)[exact])
    assert_equal_but_bounded(x, y, y_ref, qparams["scale"], block_size, -128, 127)


@pytest.mark.parametrize("preset", presets.DYNAMIC_ACTIVATION_PRESETS)
@settings(max_examples=100, deadline=None)
@given(w=matrices(max_rows=8, cols=st.sampled_from([32, 64, 96])))
def test_weights_equal_torchao(preset, w):
    ours, theirs = _ours(preset)[1], TORCHAO[preset][1]
    y, y_ref = ours(w), theirs(w)
    spec = ours.qspec
    block_size = spec.granularity.block_size(w.shape)
    qmin, qmax = spec.quant_range
    lo, hi = block_min_max(w, block_size)
    exact = torch.maximum(-lo, hi) >= (qmax - qmin) / 2 * SCALE_FLOOR
    assert torch.equal(ours.scale[exact], theirs.scale.reshape(ours.scale.shape)[exact])
    assert (ours.zero_point == 0).all() and (theirs.zero_point == 0).all()
    assert_equal_but_bounded(w, y, y_ref, ours.scale, block_size, qmin, qmax)


@settings(max_examples=100, deadline=None)
@given(w=matrices(max_rows=8, cols=st.sampled_from([32, 64, 96])))
def test_int4_weights_with_bfloat16_scales_equal_torchaos_scale_precision(w):
    spec = presets.get_preset("w4a8-dyn", target="xnnpack", qat=True).global_config.weight
    assert spec.scale_dtype is torch.bfloat16
    ours = FakeQuantize(spec)
    theirs = IntxFakeQuantizer(IntxFakeQuantizeConfig(torch.int4, PerGroup(32), MappingType.SYMMETRIC,
                                                      scale_precision=torch.bfloat16))
    y, y_ref = ours(w), theirs(w)
    block_size = spec.granularity.block_size(w.shape)
    lo, hi = block_min_max(w, block_size)
    exact = torch.maximum(-lo, hi) >= 15 / 2 * SCALE_FLOOR
    assert theirs.scale.dtype == torch.bfloat16
    assert torch.equal(ours.scale[exact], theirs.scale.float().reshape(ours.scale.shape)[exact])
    # torchao's bfloat16 reciprocal: x * (1 / scale) within 2**-8 of x / scale, relative.
    assert_equal_but_bounded(w, y, y_ref, ours.scale, block_size, -8, 7, tie_width=2.0 ** -8 + TIE_WIDTH)


def test_the_int4_groups_extreme_is_the_tie_hand_computed():
    # A group whose largest magnitude is negative: -amax / (amax / 7.5) is -7.5 exactly in
    # our division and rounds half to even to -8; torchao's product gives -7.4999995 -> -7.
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = -0.0905720591545105, 0.05
    ours, theirs = _ours("w4a8-dyn")[1], TORCHAO["w4a8-dyn"][1]
    scale = 0.0905720591545105 / 7.5
    assert float(ours(w)[0, 0]) == pytest.approx(-8 * scale, rel=1e-6)
    assert float(theirs(w)[0, 0]) == pytest.approx(-7 * scale, rel=1e-6)


@settings(max_examples=100, deadline=None)
@given(x=matrices())
def test_per_token_qparams_equal_executorchs_choose_qparams(x):
    # quantized_decomposed.choose_qparams_per_token_asymmetric picks its zero point from the
    # min or the max end (qmin - min / scale or qmax - max / scale: equal in exact arithmetic),
    # clamps, then rounds: one code apart only where that value is within float error of a .5.
    # A token under the scale floor (its range under 255 steps of 2**-23, a token of zeros
    # too) no longer spans the grid: there the two ends give different offsets (a token of
    # zeros: quant_max there, quant_min here), each of which holds the whole token.
    spec = presets.get_preset("w4a8-dyn").global_config.input_activation
    qparams = spec.kind.current_qparams(spec, x, spec.granularity.block_size(x.shape))
    scale, zero_point = torch.ops.quantized_decomposed.choose_qparams_per_token_asymmetric(x, torch.int8)
    assert torch.equal(qparams["scale"].double(), scale)
    lo = x.amin(-1, keepdim=True).clamp(max=0).double()
    from_min = -128 - lo / scale
    near_tie = (from_min - from_min.floor() - 0.5).abs() < 1e-4
    zeros = (x == 0).all(-1, keepdim=True)
    assert (zero_point[zeros] == 127).all() and (qparams["zero_point"][zeros] == -128).all()
    spanned = (x.amax(-1, keepdim=True).clamp(min=0).double() - lo) >= 255 * SCALE_FLOOR
    off = (qparams["zero_point"].long() != zero_point) & spanned
    assert ((qparams["zero_point"].long() - zero_point)[spanned].abs() <= 1).all()
    assert near_tie[off].all()


class _Ops(TorchDispatchMode):
    """The ops a forward dispatches, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("preset", presets.DYNAMIC_ACTIVATION_PRESETS)
def test_an_eager_per_token_step_is_one_fused_op_and_equals_the_exported_ops(preset):
    point = _ours(preset)[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 48, generator=g) * torch.rand(2, 5, 1, generator=g) * 10
    x[0, 0, 3], x[1, 2, 0], x[1, 3] = float("nan"), float("inf"), 0.0  # non-finite values, a token of zeros
    with _Ops() as seen:
        y = point(x)
    # Besides the op, only the scratch state's allocations (an empty running range, qparams).
    assert [n for n in seen.names if n.startswith("pt2e_fq::")] == ["pt2e_fq::fake_quantize_affine_observe"]
    assert {n for n in seen.names if not n.startswith("pt2e_fq::")} <= {"aten::full", "aten::empty.memory_format",
                                                                         "aten::zeros"}
    # Without gradients (inference, the report) the unfused ops: the qparams in ATen ops, the static op.
    with torch.no_grad(), _Ops() as seen:
        y_no_grad = point(x)
    assert [n for n in seen.names if n.startswith("pt2e_fq::")] == ["pt2e_fq::fake_quantize_affine"]
    assert torch.equal(y.isnan(), y_no_grad.isnan()) and torch.equal(y.nan_to_num(), y_no_grad.nan_to_num())
    # An exported program keeps the unfused ops (the qparams in ATen ops, then the op): the same bits.
    program = torch.export.export(point, (x,))
    y_exported = program.module()(x)
    assert torch.equal(y.isnan(), y_exported.isnan()) and torch.equal(y.nan_to_num(), y_exported.nan_to_num())
