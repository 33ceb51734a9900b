"""The fused observe-and-fake-quantize ops (ops/observe.py) against the
unfused path they replace (observers.py, format_kinds.qparams_from_range,
the stored buffers, then fake_quantize_affine / fake_quantize_float): a
FakeQuantize forced onto the unfused path is the reference, bit for bit on
y, the mask, the gradient and every buffer, step after step. Plus which
points fuse, argument errors, opcheck and torch.compile."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tests.models.simple_quantizer import ConvLinear, LinearConvQuantizer
from torch.utils._python_dispatch import TorchDispatchMode
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_qat_pt2e

import pt2e_fq as q
from tests.conftest import DEVICES, FLOAT_DTYPES, assert_bits_equal
from pt2e_fq.ops import observe as observe_ops
from pt2e_fq.ops.blocks import reduce_blocks, reduced_shape

AFFINE_OBSERVE = torch.ops.pt2e_fq.fake_quantize_affine_observe.default
FLOAT_OBSERVE = torch.ops.pt2e_fq.fake_quantize_float_observe.default
FUSED = (AFFINE_OBSERVE, FLOAT_OBSERVE)
STATIC = (torch.ops.pt2e_fq.fake_quantize_affine.default, torch.ops.pt2e_fq.fake_quantize_float.default)


class Calls(TorchDispatchMode):
    """Records (op, outputs) of every pt2e_fq op run under it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "pt2e_fq":
            self.calls.append((func, out))
        return out

    def last(self, ops):
        found = [out for func, out in self.calls if func in ops]
        return found[-1] if found else None


def unfused(fq: q.FakeQuantize) -> q.FakeQuantize:
    """A copy of fq that always takes the unfused path: the reference."""
    ref = copy.deepcopy(fq)
    ref._fuses_observe = lambda sync_group: False
    return ref


STATE = ("min_val", "max_val", "scale", "zero_point", "minval", "nonfinite")


def step(fq, x):
    """One forward + backward; (y, dx, packed mask, the op that made y)."""
    x = x.clone().requires_grad_(True)
    with Calls() as calls:
        y = fq(x)
    fused = calls.last(FUSED)
    out = fused if fused is not None else calls.last(STATIC)
    y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(y.device, y.dtype))
    return y.detach(), x.grad, out[1], fused is not None


def assert_same_steps(spec, xs, device="cpu"):
    """Runs xs through a fused point and its unfused copy on `device`; every
    step after the first (which sizes the state) must take the fused op and
    agree bit for bit. (On CUDA both sides divide by a Python float as ATen's
    CUDA kernels do, times the reciprocal.)"""
    fq = q.FakeQuantize(spec).to(device)
    ref = unfused(fq)
    for i, x in enumerate(xs):
        x = x.to(device)
        try:
            y_ref, dx_ref, mask_ref, ref_fused = step(ref, x)
        except ValueError as e:  # a range that overflows fp32 gives an Inf scale, refused by the op
            with pytest.raises(ValueError) as fused_error:
                step(fq, x)
            # The same check, by the fused op's name.
            assert str(fused_error.value).split(": ", 1)[1] == str(e).split(": ", 1)[1]
            y = None
        else:
            y, dx, mask, took_fused = step(fq, x)
            assert took_fused == (i > 0) and not ref_fused
            assert_bits_equal(y, y_ref)
            assert_bits_equal(dx, dx_ref)
            assert torch.equal(mask, mask_ref)
        for name in STATE:
            a, b = fq._state(name), ref._state(name)
            if b is None:
                assert a is None
                continue
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert_bits_equal(a, b)
        if y is None:
            return


# ---------------------------------------------------------------------------
# Bit for bit against the unfused path


def int_specs():
    schemes = st.sampled_from([("symmetric", "zp"), ("symmetric_narrow", "zp"), ("symmetric_no_clip", "zp"),
                               ("asymmetric", "zp"), ("asymmetric", "minval")])

    @st.composite
    def build(draw):
        signed = draw(st.booleans())
        bits = draw(st.integers(2, 16 if signed else 15))
        scheme, formulation = draw(schemes)
        return dict(format=q.IntFormat(bits, signed), scheme=scheme, formulation=formulation)

    return build()


FLOAT_SPECS = st.sampled_from([dict(format=f) for f in (q.FP8_E4M3, q.FP8_E5M2, q.FP4_E2M1)])
OBSERVERS = st.sampled_from(
    [q.MinMaxObserver(), q.CurrentMinMaxObserver()]
    + [q.MovingAverageMinMaxObserver(c) for c in (0.01, 1 / 3, 0.5, 1.0)]
)


@st.composite
def shapes_and_granularity(draw):
    shape = draw(st.lists(st.integers(1, 9), min_size=1, max_size=3))
    kind = draw(st.sampled_from(["tensor", "channel", "group", "block"]))
    axis = draw(st.integers(0, len(shape) - 1))
    if kind == "tensor":
        return shape, q.PerTensor()
    if kind == "channel":
        return shape, q.PerChannel(axis)
    if kind == "group":  # ragged last group when the size does not divide
        return shape, q.PerGroup(draw(st.integers(1, 5)), axis)
    return shape, q.PerBlock(tuple(draw(st.integers(1, s + 1)) for s in shape))


@st.composite
def batch(draw, shape, dtype):
    """x of shape: random at a drawn magnitude, constant, or near the
    dtype's largest value; with NaN / Inf sprinkled in or not."""
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["random", "random", "positive", "constant", "huge", "nonfinite"]))
    magnitude = draw(st.sampled_from([1e-3, 1.0, 37.0, 1e4]))
    x = torch.randn(shape, generator=g) * magnitude
    if kind == "positive":
        x = x.abs() + magnitude
    elif kind == "constant":
        x = torch.full(shape, draw(st.sampled_from([0.0, -2.5, 3.0])))
    elif kind == "huge":
        x = torch.randn(shape, generator=g).sign() * torch.finfo(dtype).max * 0.9
    x = x.to(dtype)
    if kind == "nonfinite" or draw(st.booleans()):
        special = torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype)
        where = torch.rand(shape, generator=g) < draw(st.sampled_from([0.2, 1.0]))
        pick = torch.randint(0, 3, shape, generator=g)
        x = torch.where(where, special[pick], x)
    return x


@st.composite
def specs_and_batches(draw):
    shape, granularity = draw(shapes_and_granularity())
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    fields = draw(st.one_of(int_specs(), FLOAT_SPECS))
    spec = q.QSpec(granularity=granularity, observer=draw(OBSERVERS), **fields)
    return spec, [draw(batch(shape, dtype)) for _ in range(draw(st.integers(2, 4)))]


# A moving average from one fp32 extreme towards the other: new - old
# overflows fp32 (found by hypothesis; the range went Inf, then NaN).
OPPOSITE_EXTREMES = (
    q.QSpec(q.IntFormat(2, True), scheme="asymmetric", observer=q.MovingAverageMinMaxObserver(0.01)),
    [torch.tensor([-3.06e38]), torch.tensor([3.06e38]), torch.tensor([0.0015])],
)


@settings(max_examples=150, deadline=None)
@given(case=specs_and_batches())
@example(case=OPPOSITE_EXTREMES)
def test_fused_steps_match_the_unfused_path_bit_for_bit(case):
    assert_same_steps(*case)


def test_a_moving_average_between_opposite_fp32_extremes_stays_finite():
    """(1 - c) * old + c * new by hand, in float64: the observer's fp32
    range stays within one fp32 step of it, where new - old overflows fp32."""
    spec, xs = OPPOSITE_EXTREMES
    fq = q.FakeQuantize(spec)
    c = torch.tensor(0.01, dtype=torch.float32).double()  # the constant as the fp32 ops round it
    expected = None
    for x in xs:
        fq(x)
        value = x.double()
        expected = value if expected is None else (1 - c) * expected + c * value
        for name in ("min_val", "max_val"):
            got = fq._state(name).double()
            assert torch.isfinite(got).all(), f"{name} {got} after batch {x}"
            assert torch.allclose(got, expected, rtol=2**-22, atol=0), f"{name} {got}, expected {expected}"
    assert torch.isfinite(fq._state("scale")).all()
    assert_same_steps(*OPPOSITE_EXTREMES)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("fields", [
    dict(format=q.INT8), dict(format=q.UINT8, scheme="asymmetric"), dict(format=q.INT4, scheme="symmetric_narrow"),
    dict(format=q.INT4, scheme="symmetric_no_clip"), dict(format=q.INT16, scheme="asymmetric", formulation="minval"), dict(format=q.FP8_E4M3),
    dict(format=q.FP4_E2M1),
], ids=lambda f: f"{f['format']!r}-{f.get('scheme', '')}-{f.get('formulation', '')}")
@pytest.mark.parametrize("granularity", [q.PerTensor(), q.PerChannel(1), q.PerGroup(24, 1)], ids=repr)
@pytest.mark.parametrize("device", DEVICES)
def test_qat_steps_on_larger_inputs_match(dtype, fields, granularity, device):
    # Large enough for several threads and for blocks of >= 16 along a row
    # (the CPU kernel's other code path); the last group of 24 is ragged.
    g = torch.Generator().manual_seed(1)
    xs = [(torch.randn(33, 200, generator=g) * s + s).to(dtype) for s in (1.0, 3.0, 0.5, 7.0)]
    xs[2][5, 7] = math.nan
    spec = q.QSpec(granularity=granularity, observer=q.MovingAverageMinMaxObserver(0.1), **fields)
    assert_same_steps(spec, xs, device)


def test_a_block_that_stays_empty_keeps_qparams_of_zero_then_takes_its_first_finite_range():
    x1 = torch.tensor([[math.nan, math.inf], [1.0, -2.0]])
    x2 = torch.tensor([[3.0, -1.0], [math.nan, 4.0]])
    for observer in (q.MinMaxObserver(), q.MovingAverageMinMaxObserver(0.25), q.CurrentMinMaxObserver()):
        assert_same_steps(q.QSpec(q.INT8, q.PerChannel(0), "asymmetric", observer=observer), [x1, x1, x2, x2])


def signed_zeros_batch(dtype):
    """3 x 200: row 0 of both signs, row 1 >= 0, row 2 <= 0, each with +0 and
    -0 at random positions (so zero is the minimum of row 1's blocks and the
    maximum of row 2's), NaN / Inf sprinkled in, and a run of 40 NaN that
    leaves a block of 32 empty: blocks long enough for several vector lanes
    and iterations of the kernels' loops."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 200, generator=g)
    x[1], x[2] = x[1].abs(), -x[2].abs()
    pick = torch.rand(3, 200, generator=g)
    x = torch.where(pick < 0.15, -0.0, torch.where(pick < 0.3, 0.0, x))
    special = torch.tensor([math.nan, math.inf, -math.inf])
    x = torch.where(torch.rand(3, 200, generator=g) < 0.1, special[torch.randint(0, 3, (3, 200), generator=g)], x)
    x[0, :40] = math.nan
    return x.to(dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("block_size", [[3, 200], [1, 200], [1, 32], [1, 5]], ids=str)
def test_the_batch_range_puts_minus_zero_below_plus_zero_and_counts_the_nonfinite_values(dtype, block_size):
    # torch.amin / amax return either zero of a block holding both, depending
    # on positions; the op orders -0 below +0. Expected: torch.amin / amax
    # of the finite values, the zero's sign then set from the block's zeros.
    x = signed_zeros_batch(dtype)
    shape = reduced_shape(x.shape, block_size)
    args = affine_args(x=x, block_size=block_size, **state(shape))
    args["min_val"].fill_(math.inf)  # a fresh range: the running range becomes the batch's
    args["max_val"].fill_(-math.inf)
    AFFINE_OBSERVE(*args.values())

    xf = x.float()
    finite = xf.isfinite()
    def per_block(t, reduce, pad):
        return reduce_blocks(t, block_size, reduce, pad)
    lo = per_block(torch.where(finite, xf, math.inf), torch.amin, math.inf)
    hi = per_block(torch.where(finite, xf, -math.inf), torch.amax, -math.inf)
    zero = finite & (xf == 0)
    has_minus_zero = per_block((zero & xf.signbit()).float(), torch.amax, 0.0) > 0
    has_plus_zero = per_block((zero & ~xf.signbit()).float(), torch.amax, 0.0) > 0
    lo = torch.where(lo == 0, torch.where(has_minus_zero, -0.0, 0.0), lo)
    hi = torch.where(hi == 0, torch.where(has_plus_zero, 0.0, -0.0), hi)
    if block_size[0] == 1:  # blocks of one row: zero is the min of row 1's, the max of row 2's
        assert bool((lo[1] == 0).any() and (hi[2] == 0).any())
    assert_bits_equal(args["min_val"], lo)
    assert_bits_equal(args["max_val"], hi)
    assert int(args["nonfinite"]) == int((~finite).sum())


# ---------------------------------------------------------------------------
# Which points fuse


def fused_calls(fq, xs):
    with Calls() as calls:
        for x in xs:
            fq(x)
    return sum(func in FUSED for func, _ in calls.calls)


XS = [torch.randn(4, 8, generator=torch.Generator().manual_seed(s)) for s in range(3)]


@pytest.mark.parametrize("spec", [
    q.QSpec(q.INT8, observer=q.MSEObserver(num_candidates=4)),
    q.QSpec(q.INT8, learnable=True),
    q.QSpec(q.MXFP8_E4M3, q.PerGroup(32), dynamic=True),
], ids=str)
def test_points_without_a_fused_op_stay_unfused(spec):
    assert fused_calls(q.FakeQuantize(spec), XS) == 0


def test_the_fused_op_runs_from_the_second_observation_while_observer_and_fake_quant_are_on():
    fq = q.FakeQuantize(q.QSpec(q.INT8))
    assert fused_calls(fq, XS) == 2  # the first call sizes the state on the unfused path
    fq.disable_fake_quant()
    assert fused_calls(fq, XS) == 0  # observing only: unfused
    fq.enable_fake_quant()
    fq.disable_observer()
    assert fused_calls(fq, XS) == 0  # the static op alone
    assert not fq._fuses_observe(sync_group=object())  # a distributed run all-reduces first


# ---------------------------------------------------------------------------
# The ops themselves: errors, opcheck, compile


def state(shape=(2, 3), dtype_offset=torch.int32):
    return dict(min_val=torch.full(shape, -1.0), max_val=torch.full(shape, 1.0), scale=torch.ones(shape),
                offset=torch.zeros(shape, dtype=dtype_offset), nonfinite=torch.zeros((), dtype=torch.int64))


def affine_args(**change):
    args = dict(x=torch.randn(2, 6), block_size=[1, 2], **state(), quant_min=-128, quant_max=127,
                scheme="asymmetric", range_limit=1e30, averaging_constant=None)
    args.update(change)
    return args


@pytest.mark.parametrize("change,error,message", [
    (dict(x=torch.zeros(2, 6, dtype=torch.int32)), TypeError, "x must be float32"),
    (dict(block_size=[1]), ValueError, "block_size needs one entry per dimension"),
    (dict(min_val=torch.zeros(3, 2)), ValueError, "min_val must have shape (2, 3)"),
    (dict(max_val=torch.zeros(2, 3, dtype=torch.float64)), TypeError, "max_val must be a torch.float32"),
    (dict(scale=torch.zeros(2, 3, dtype=torch.float16)), TypeError, "scale must be a torch.float32"),
    (dict(offset=torch.zeros(2, 3)), TypeError, "offset (zero_point) must be a torch.int32"),
    (dict(scheme="minval"), TypeError, "offset (minval) must be a torch.float32"),
    (dict(scheme="affine"), ValueError, "scheme must be one of 'symmetric', 'symmetric_no_clip', 'asymmetric', 'minval'"),
    (dict(nonfinite=torch.zeros(2, dtype=torch.int64)), TypeError, "nonfinite must be a one-element int64"),
    (dict(quant_min=5, quant_max=5), ValueError, "quant_min < quant_max"),
    (dict(range_limit=math.inf), ValueError, "range_limit must be finite and > 0"),
    (dict(averaging_constant=0.0), ValueError, "averaging_constant must be in (0, 1]"),
    (dict(averaging_constant=1.5), ValueError, "averaging_constant must be in (0, 1]"),
])
@pytest.mark.parametrize("entry", ["wrapper", "torch.ops"])
def test_bad_arguments_name_the_argument(change, error, message, entry):
    args = affine_args(**change)
    call = observe_ops.fake_quantize_affine_observe if entry == "wrapper" else AFFINE_OBSERVE
    # The C++ checks raise the same error types (TORCH_CHECK_TYPE / _VALUE).
    with pytest.raises(error, match=None) as info:
        call(*args.values())
    assert message in str(info.value)


def test_float_observe_rejects_an_unknown_format():
    s = state()
    del s["offset"]
    for call in (observe_ops.fake_quantize_float_observe, FLOAT_OBSERVE):
        with pytest.raises(ValueError, match="fmt must be one of 'e4m3', 'e5m2', 'e2m1'"):
            call(torch.randn(2, 6), [1, 2], *s.values(), "e3m4")


def test_state_versions_count_the_update_and_the_gradient_and_tangent_go_straight_through():
    # The C++ Autograd kernel bumps the version of every tensor the schema
    # marks written (autograd refuses a saved tensor changed since), and
    # differentiates x alone: dx and the forward-mode tangent are dy / t
    # where the returned mask is set (checked against the mask unpacked by
    # hand from its bits, and against fake_quantize_affine on the new qparams).
    args = affine_args(x=torch.randn(2, 6, generator=torch.Generator().manual_seed(3)) * 3, averaging_constant=0.01)
    written = {n: args[n] for n in ("min_val", "max_val", "scale", "offset", "nonfinite")}
    before = {n: t._version for n, t in written.items()}
    x = args["x"].clone().requires_grad_()
    y, mask = AFFINE_OBSERVE(*{**args, "x": x}.values())
    assert all(t._version > before[n] for n, t in written.items())
    def bits(mask):
        return torch.tensor([(int(mask[i // 8]) >> (i % 8)) & 1 for i in range(12)], dtype=torch.bool).reshape(2, 6)

    y_ref, mask_ref = torch.ops.pt2e_fq.fake_quantize_affine(
        args["x"], [1, 2], written["scale"], written["offset"], -128, 127, None)
    assert torch.equal(y.detach(), y_ref) and torch.equal(mask, mask_ref)
    dy = torch.randn(2, 6)
    y.backward(dy)
    assert 0 < int(bits(mask).sum()) < 12  # some values clamp, some do not
    assert torch.equal(x.grad, torch.where(bits(mask), dy, 0.0))
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(args["x"], dy)
        y_dual, mask_dual = AFFINE_OBSERVE(*{**args, "x": dual}.values())
        tangent = torch.autograd.forward_ad.unpack_dual(y_dual).tangent
    assert torch.equal(tangent, torch.where(bits(mask_dual), dy, 0.0))


@pytest.mark.parametrize("averaging_constant", [None, 0.25])
def test_opcheck(averaging_constant):
    x = torch.randn(4, 6, requires_grad=True)
    for scheme, zp_dtype in (("symmetric", torch.int32), ("asymmetric", torch.int32), ("minval", torch.float32)):
        args = (x, [1, 3], *state((4, 2), zp_dtype).values(), -8, 7, scheme, 1e30, averaging_constant)
        torch.library.opcheck(AFFINE_OBSERVE, args)
    s = state((4, 2))
    del s["offset"]
    torch.library.opcheck(FLOAT_OBSERVE, (x, [1, 3], *s.values(), "e4m3", averaging_constant))


def _qat_model():
    quantizer = LinearConvQuantizer(
        activation=q.QSpec(q.INT8, scheme="asymmetric", observer=q.MovingAverageMinMaxObserver(0.1)),
        weight=q.QSpec(q.INT8, q.PerChannel(0), "symmetric_narrow"),
        output=q.QSpec(q.FP8_E4M3),
    )
    torch.manual_seed(0)
    example = torch.randn(2, 3, 6, 6)
    gm = torch.export.export(ConvLinear().train(), (example,)).module()
    gm = prepare_qat_pt2e(gm, quantizer)
    gm(example)  # the first observation sizes the state (unfused)
    return gm


def test_compile_fullgraph_of_a_qat_step_with_observers_on_matches_eager():
    gm = _qat_model()
    eager = copy.deepcopy(gm)
    captured = []

    def backend(graph_module, example_inputs):
        captured.append(graph_module)
        return torch._dynamo.backends.debugging.aot_eager(graph_module, example_inputs)

    compiled = torch.compile(gm, fullgraph=True, backend=backend)
    for s in range(1, 4):
        x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(s))
        compiled(x).square().sum().backward()
        eager(x).square().sum().backward()
    assert len(captured) == 1
    # Dynamo records the op packets (torch.ops.pt2e_fq.name); their .default is the overload.
    targets = [getattr(n.target, "default", None) for n in captured[0].graph.nodes if n.op == "call_function"]
    fqs = [m for m in gm.modules() if isinstance(m, q.FakeQuantize)]
    n_float = sum(isinstance(m.qspec.format, q.FloatFormat) for m in fqs)
    assert n_float > 0 and len(fqs) - n_float > 0
    assert targets.count(AFFINE_OBSERVE) == len(fqs) - n_float and targets.count(FLOAT_OBSERVE) == n_float
    for (name, a), (_, b) in zip(gm.named_buffers(), eager.named_buffers()):
        assert_bits_equal(a, b)
    for (name, a), (_, b) in zip(gm.named_parameters(), eager.named_parameters()):
        assert_bits_equal(a.grad, b.grad)


def test_an_exported_converted_qat_model_has_one_static_op_per_point_and_no_observe_op():
    gm = _qat_model()
    gm(torch.randn(2, 3, 6, 6))  # a fused step
    converted = convert_pt2e(gm)
    ep = torch.export.export(converted, (torch.randn(2, 3, 6, 6),))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert not any(t in FUSED for t in targets)
    assert sum(t in STATIC for t in targets) == 6
