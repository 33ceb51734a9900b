"""QSpec, formats and granularities: hand-written expectations and the errors
for every combination that makes no sense."""

from __future__ import annotations

import pytest
import torch
from torchao.quantization.pt2e import MinMaxObserver as TorchaoMinMaxObserver
from torchao.quantization.pt2e import disable_observer
from torchao.quantization.pt2e.quantizer import QuantizationSpec

import pt2e_fq as q

SHAPE = (4, 6, 10)


@pytest.mark.parametrize(
    "granularity, expected",
    [
        (q.PerTensor(), (4, 6, 10)),
        (q.PerChannel(0), (1, 6, 10)),
        (q.PerChannel(-1), (4, 6, 1)),
        (q.PerGroup(4), (1, 1, 4)),
        (q.PerGroup(32, axis=1), (1, 32, 1)),
        (q.PerBlock((2, 3, 4)), (2, 3, 4)),
        (q.PerToken(), (1, 1, 10)),
    ],
    ids=repr,
)
def test_block_size_of_each_granularity(granularity, expected):
    assert granularity.block_size(SHAPE) == expected


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda: q.PerChannel(3).block_size((2, 2)), ValueError, "axis=3"),
        (lambda: q.PerBlock((1, 2)).block_size(SHAPE), ValueError, "block has 2 entries"),
        (lambda: q.PerBlock((1, 0, 2)), ValueError, "block[1] must be >= 1"),
        (lambda: q.PerGroup(0), ValueError, "group_size must be >= 1"),
        (lambda: q.PerChannel(1.0), TypeError, "axis must be an int"),
    ],
)
def test_granularity_errors_name_the_argument(make, error, words):
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        make()


@pytest.mark.parametrize(
    "fmt, narrow, expected, dtype",
    [
        (q.INT8, False, (-128, 127), torch.int8),
        (q.INT8, True, (-127, 127), torch.int8),
        (q.UINT8, False, (0, 255), torch.uint8),
        (q.INT4, False, (-8, 7), torch.int4),
        (q.UINT4, True, (1, 15), torch.uint4),
        (q.INT16, False, (-32768, 32767), torch.int16),
        (q.IntFormat(12, signed=False), False, (0, 4095), torch.uint16),
    ],
    ids=str,
)
def test_int_format_ranges_and_dtypes(fmt, narrow, expected, dtype):
    assert fmt.quant_range(narrow) == expected
    assert fmt.torch_dtype == dtype


@pytest.mark.parametrize("bits, signed", [(1, True), (17, True), (16, False)])
def test_int_format_outside_the_op_range_is_rejected(bits, signed):
    with pytest.raises(ValueError, match="bits must be 2..16 signed or 2..15 unsigned"):
        q.IntFormat(bits, signed)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(scheme="symmetric", formulation="minval"), "MINVAL needs an integer format and scheme ASYMMETRIC"),
        (dict(format=q.FP8_E4M3, scheme="asymmetric"), "float format FP8_E4M3 has no zero point"),
        (dict(format=q.MXFP4, dynamic=True), r"granularity must be PerGroup\(32, axis\)"),
        (dict(format=q.NVFP4, granularity=q.PerGroup(32), dynamic=True), r"PerGroup\(16, axis\)"),
        (dict(format=q.MXFP8_E4M3, granularity=q.PerGroup(32)), "set dynamic=True"),
        (dict(granularity=q.PerToken()), "PerToken qparams exist only for the live tensor"),
        (dict(dynamic=True, observer=q.MinMaxObserver()), "observer must be None or CurrentMinMaxObserver"),
        (dict(format=q.NVFP4, granularity=q.PerGroup(16), observer=q.HistogramObserver()),
         "NVFP4's block scales come from each block of 16 values, which a histogram does not keep; observer "
         "HistogramObserver cannot choose its global scale: use MinMaxObserver, MovingAverageMinMaxObserver or "
         r"MSEObserver \(or dynamic=True\)"),
        (dict(scheme="sym"), "scheme must be one of SYMMETRIC, SYMMETRIC_NARROW, SYMMETRIC_NO_CLIP, ASYMMETRIC"),
    ],
)
def test_qspec_rejects_combinations_that_make_no_sense(kwargs, words):
    with pytest.raises(ValueError, match=words):
        q.QSpec(**kwargs)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(format=torch.int8), "format must be an IntFormat or a FloatFormat"),
        (dict(granularity="per_tensor"), "granularity must be one of PerTensor"),
        (dict(observer=TorchaoMinMaxObserver), "observer must be None or an instance of MinMaxObserver"),
        (dict(dynamic=1), "dynamic must be a bool"),
    ],
)
def test_qspec_type_errors(kwargs, words):
    with pytest.raises(TypeError, match=words):
        q.QSpec(**kwargs)


def test_qspec_accepts_enum_names_as_strings_and_is_hashable():
    a = q.QSpec(q.INT4, q.PerChannel(0), "ASYMMETRIC", "minval")
    b = q.QSpec(q.INT4, q.PerChannel(0), q.Scheme.ASYMMETRIC, q.Formulation.MINVAL)
    assert a == b and hash(a) == hash(b) and a.scheme is q.Scheme.ASYMMETRIC
    assert len({a, b, q.QSpec()}) == 2


def test_float_formats_are_valid_specs():
    q.QSpec(q.FP8_E4M3, q.PerChannel(0))
    q.QSpec(q.FP8_E5M2, dynamic=True)
    q.QSpec(q.FP4_E2M1, q.PerGroup(16), observer=q.MSEObserver())
    q.QSpec(q.MXFP8_E5M2, q.PerGroup(32), dynamic=True)
    q.QSpec(q.MXFP4, q.PerGroup(32, axis=0), dynamic=True)
    q.QSpec(q.NVFP4, q.PerGroup(16))  # static: the global scale is calibrated
    q.QSpec(q.NVFP4, q.PerGroup(16), dynamic=True)
    # Its global scale from an observer that sees the blocks of 16 themselves.
    for observer in (q.MinMaxObserver(), q.MovingAverageMinMaxObserver(0.5), q.MSEObserver(8)):
        point = q.FakeQuantize(q.QSpec(q.NVFP4, q.PerGroup(16), observer=observer))
        assert point(torch.randn(4, 32)).shape == (4, 32) and point.global_scale.numel() == 1
    # A histogram keeps the values of FP8 elements, which have no blocks: still accepted.
    q.QSpec(q.FP8_E4M3, observer=q.HistogramObserver())


@pytest.mark.parametrize(
    "fmt, granularity, op",
    [
        (q.FP8_E4M3, q.PerTensor(), "fake_quantize_float"),
        (q.FP4_E2M1, q.PerGroup(16), "fake_quantize_float"),
        (q.MXFP4, q.PerGroup(32), "fake_quantize_mx"),
        (q.NVFP4, q.PerGroup(16), "fake_quantize_nvfp4"),
    ],
)
def test_fake_quantize_of_a_float_format_is_one_call_of_its_op(fmt, granularity, op):
    spec = q.QSpec(fmt, granularity, dynamic=fmt.block_scaled)
    fq = spec.to_quantization_spec().observer_or_fake_quant_ctr()
    x = torch.randn(SHAPE)
    fq(x)  # calibrate a static point
    fq.apply(disable_observer)
    ep = torch.export.export(fq, (x,))
    calls = [n.target for n in ep.graph.nodes if n.op == "call_function" and "pt2e_fq" in str(n.target)]
    assert calls == [getattr(torch.ops.pt2e_fq, op).default]


@pytest.mark.parametrize(
    "spec, expected",
    [
        (q.QSpec(), (torch.int8, -128, 127, torch.per_tensor_symmetric, None, False)),
        (q.QSpec(q.UINT8, scheme="asymmetric"), (torch.uint8, 0, 255, torch.per_tensor_affine, None, False)),
        (q.QSpec(q.INT8, q.PerChannel(1), "symmetric_narrow"),
         (torch.int8, -127, 127, torch.per_channel_symmetric, 1, False)),
        (q.QSpec(q.INT8, q.PerChannel(-1)), (torch.int8, -128, 127, torch.per_channel_symmetric, None, False)),
        (q.QSpec(q.INT4, q.PerGroup(32), "asymmetric", "minval"), (torch.int4, -8, 7, None, None, False)),
        # is_dynamic stays False: convert_pt2e would look for its own choose_qparams node
        (q.QSpec(q.INT8, q.PerToken(), "asymmetric", dynamic=True), (torch.int8, -128, 127, None, None, False)),
        (q.QSpec(q.FP8_E4M3, q.PerChannel(0)), (torch.float8_e4m3fn, None, None, None, 0, False)),
    ],
    ids=str,
)
def test_to_quantization_spec_fields(spec, expected):
    qs = spec.to_quantization_spec()
    assert isinstance(qs, QuantizationSpec)
    assert (qs.dtype, qs.quant_min, qs.quant_max, qs.qscheme, qs.ch_axis, qs.is_dynamic) == expected


def test_the_constructor_builds_our_module_the_way_prepare_does():
    """prepare calls ctr.with_args(**spec fields)() (ch_axis only for classes
    named PerChannel...); the module carries the QSpec."""
    spec = q.QSpec(q.INT8, q.PerChannel(0), "asymmetric")
    qs = spec.to_quantization_spec()
    fields = dict(dtype=qs.dtype, quant_min=qs.quant_min, quant_max=qs.quant_max, qscheme=qs.qscheme,
                  is_dynamic=qs.is_dynamic)
    fq = qs.observer_or_fake_quant_ctr.with_args(**fields)()
    assert isinstance(fq, q.FakeQuantize) and fq.qspec == spec
    assert (fq.dtype, fq.quant_min, fq.quant_max, fq.qscheme, fq.ch_axis) == (
        torch.int8, -128, 127, torch.per_channel_affine, 0)


def test_a_standard_field_that_disagrees_with_the_qspec_is_an_error():
    ctr = q.QSpec(q.INT8).to_quantization_spec().observer_or_fake_quant_ctr
    with pytest.raises(ValueError, match=r"quant_min=-127 disagrees with the QSpec .* gives -128"):
        ctr.with_args(quant_min=-127, quant_max=127)()
    with pytest.raises(ValueError, match="is_dynamic=True in the QuantizationSpec breaks convert_pt2e"):
        ctr.with_args(is_dynamic=True)()
    with pytest.raises(TypeError, match="qspec must be a pt2e_fq.QSpec"):
        q.FakeQuantize("int8")
