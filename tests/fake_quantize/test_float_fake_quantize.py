"""Float formats through pt2e_fq.FakeQuantize: FP8 / FP4 with static or
dynamic scales, MX, NVFP4 with a static or dynamic global scale. Outputs
against pt2e_fq.reference (pure torch, independent of the kernels); the PT2E
flow with one op per point; torch.compile of a converted model."""

from __future__ import annotations

import pytest
import torch
import torchao.quantization.pt2e as tao
from tests.models.simple_quantizer import LinearConvQuantizer
from tests.flow.test_pt2e_flow import batch, calibrated, points
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

import pt2e_fq as q
from pt2e_fq import reference


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def block_amax(x: torch.Tensor, block_size) -> torch.Tensor:
    """max |x| of every block, written as a loop over the blocks."""
    red = [-(-s // b) for s, b in zip(x.shape, block_size)]
    out = torch.empty(red)
    for idx in torch.cartesian_prod(*[torch.arange(r) for r in red]).reshape(-1, len(red)).tolist():
        sl = tuple(slice(i * b, (i + 1) * b) for i, b in zip(idx, block_size))
        out[tuple(idx)] = x[sl].float().abs().max()
    return out


def expected_output(spec: q.QSpec, x: torch.Tensor) -> torch.Tensor:
    """What a FakeQuantize of `spec` that has observed only x must return:
    scales from max |x| by the format definitions, then the reference."""
    fmt = spec.format
    if fmt is q.NVFP4:  # global scale max|x| / (448 * 6), in the kernel for a dynamic point
        g = None if spec.dynamic else x.float().abs().max() / (448.0 * 6.0)
        return reference.fake_quantize_nvfp4(x, g, spec.granularity.axis)[0]
    if fmt.block_scaled:  # MX: the kernel computes every scale
        return reference.fake_quantize_mx(x, fmt.elem_dtype, 32, spec.granularity.axis)[0]
    bs = spec.granularity.block_size(x.shape)
    scale = (block_amax(x, bs) / fmt.fmax).clamp(min=torch.finfo(torch.float32).tiny)
    return reference.fake_quantize_float(x, bs, scale, fmt.elem_dtype)[0]


SPECS = [
    q.QSpec(q.FP8_E4M3),
    q.QSpec(q.FP8_E5M2, q.PerChannel(1)),
    q.QSpec(q.FP4_E2M1, q.PerGroup(5)),  # ragged last group
    q.QSpec(q.FP4_E2M1, q.PerBlock((2, 3, 4))),
    q.QSpec(q.FP8_E4M3, q.PerToken(), dynamic=True),
    q.QSpec(q.FP4_E2M1, q.PerChannel(0), dynamic=True),
    q.QSpec(q.MXFP8_E4M3, q.PerGroup(32), dynamic=True),
    q.QSpec(q.MXFP8_E5M2, q.PerGroup(32, axis=1), dynamic=True),
    q.QSpec(q.MXFP4, q.PerGroup(32), dynamic=True),
    q.QSpec(q.NVFP4, q.PerGroup(16)),
    q.QSpec(q.NVFP4, q.PerGroup(16, axis=1), dynamic=True),
]

# What a point stores besides torchao's switches (and its observer's range).
STORED = {q.NVFP4: {"global_scale"}, q.MXFP8_E4M3: set(), q.MXFP8_E5M2: set(), q.MXFP4: set()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_output_equals_the_reference(spec, dtype):
    x = randn(3, 40, 36, dtype=dtype) * 3
    fq = q.FakeQuantize(spec)
    y = fq(x)
    assert y.dtype == dtype
    assert torch.equal(y, expected_output(spec, x))
    stored = set(fq.calculate_qparams())
    assert stored == (set() if spec.dynamic else STORED.get(spec.format, {"scale"}))
    assert all(t.dtype == torch.float32 for t in fq.calculate_qparams().values())


def test_static_scales_stay_after_calibration_and_dynamic_ones_follow_the_input():
    static = q.FakeQuantize(q.QSpec(q.NVFP4, q.PerGroup(16)))
    dynamic = q.FakeQuantize(q.QSpec(q.NVFP4, q.PerGroup(16), dynamic=True))
    calib, x = randn(4, 32, seed=1), randn(4, 32, seed=2) * 10
    static(calib)
    static.apply(tao.disable_observer)
    g = calib.abs().max() / (448.0 * 6.0)
    assert torch.equal(static(x), reference.fake_quantize_nvfp4(x, g)[0])
    assert torch.equal(dynamic(x), reference.fake_quantize_nvfp4(x)[0])


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[8], SPECS[9]], ids=str)
def test_gradient_is_the_straight_through_estimator_of_the_reference(spec):
    x = (randn(4, 48) * 3).requires_grad_()
    fq = q.FakeQuantize(spec)
    fq(x.detach())  # calibrate a static point on x itself
    fq.apply(tao.disable_observer)
    dy = randn(4, 48, seed=3)
    fq(x).backward(dy)
    if spec.format is q.NVFP4:
        mask = reference.fake_quantize_nvfp4(x.detach(), fq.global_scale)[1]
    elif spec.format.block_scaled:
        mask = reference.fake_quantize_mx(x.detach(), spec.format.elem_dtype)[1]
    else:
        mask = reference.fake_quantize_float(x.detach(), x.shape, fq.scale, spec.format.elem_dtype)[1]
    assert torch.equal(x.grad, torch.where(mask, dy, 0.0))


# ---------------------------------------------------------------------------
# PT2E flow: conv (input 3 x 6 x 6) -> relu -> linear (64 inputs)

FLOAT_CONFIGS = {
    "fp8": (LinearConvQuantizer(
        activation=q.QSpec(q.FP8_E4M3, q.PerToken(), dynamic=True),
        weight=q.QSpec(q.FP8_E5M2, q.PerChannel(0)),
        output=q.QSpec(q.FP4_E2M1, q.PerGroup(16)),
    ), torch.ops.pt2e_fq.fake_quantize_float.default),
    "mx": (LinearConvQuantizer(
        activation=q.QSpec(q.MXFP8_E4M3, q.PerGroup(32), dynamic=True),
        weight=q.QSpec(q.MXFP4, q.PerGroup(32, axis=1), dynamic=True),
    ), torch.ops.pt2e_fq.fake_quantize_mx.default),
    "nvfp4": (LinearConvQuantizer(
        activation=q.QSpec(q.NVFP4, q.PerGroup(16)),
        weight=q.QSpec(q.NVFP4, q.PerGroup(16, axis=1), dynamic=True),
    ), torch.ops.pt2e_fq.fake_quantize_nvfp4.default),
}


@pytest.mark.parametrize("config", list(FLOAT_CONFIGS))
def test_float_ptq_flow_has_one_op_per_point_after_convert_and_reexport(config):
    quantizer, op = FLOAT_CONFIGS[config]
    gm = calibrated(quantizer)
    gm.apply(tao.disable_observer)
    x = batch(100)
    y_prepared = gm(x)
    fqs = points(gm)
    assert len(fqs) == 6  # input, weight, output of conv and of linear

    converted = convert_pt2e(gm)
    assert torch.equal(converted(x), y_prepared)
    ep = torch.export.export(converted, (x,))
    calls = [n.target for n in ep.graph.nodes if n.op == "call_function" and "pt2e_fq" in str(n.target)]
    assert calls == [op] * len(fqs)
    expected = {f"{p}.{b}" for p, m in fqs.items() for b in m.calculate_qparams()}
    assert set(ep.graph_signature.inputs_to_buffers.values()) == expected
    assert torch.equal(ep.module()(x), y_prepared)


def test_compile_fullgraph_of_a_converted_model_with_every_float_op():
    quantizer = LinearConvQuantizer(
        activation=q.QSpec(q.NVFP4, q.PerGroup(16)),
        weight=q.QSpec(q.MXFP4, q.PerGroup(32, axis=1), dynamic=True),
        output=q.QSpec(q.FP8_E4M3, q.PerToken(), dynamic=True),
    )
    converted = convert_pt2e(calibrated(quantizer))
    x = batch(60)
    compiled = torch.compile(converted, fullgraph=True)  # raises on any graph break
    torch.testing.assert_close(compiled(x), converted(x))
