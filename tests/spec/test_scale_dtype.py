"""QSpec.scale_dtype: a point whose deployed scale is stored in bfloat16
(ExecuTorch's XNNPACK stores int4 group scales so) computes the fp32 scale,
rounds it to bfloat16 and applies that, on every path (observer on or off,
static, dynamic, learnable, exported), in config files and in the report;
checked against bfloat16 rounding done on the bits and against the pure-torch
reference op."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pt2e_fq as q
from pt2e_fq import reference
from pt2e_fq.ops.blocks import expand_blocks
from pt2e_fq.spec.qparams import stored_scale


def bf16_round(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> nearest bfloat16 (ties to even), on the bit pattern (finite values)."""
    u = t.float().numpy().view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return torch.from_numpy(rounded.view(np.float32).copy()).reshape(t.shape)


def _group_weight(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 64, generator=g) * torch.exp(torch.randn(8, 1, generator=g))


def _symmetric_int4_scale(w: torch.Tensor) -> torch.Tensor:
    """Hand formula: amax per group of 32 / 7.5, in float64, then fp32."""
    amax = w.double().reshape(8, 2, 32).abs().amax(-1)
    return (amax / 7.5).float().clamp(min=2.0 ** -23)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(2.0 ** -23, 2.0 ** 100, width=32, allow_subnormal=False), min_size=1, max_size=16))
def test_stored_scale_is_the_nearest_bfloat16(values):
    scale = torch.tensor(values, dtype=torch.float32)
    rounded = stored_scale(scale, torch.bfloat16)
    assert rounded.dtype == torch.float32
    assert torch.equal(rounded, bf16_round(scale))
    assert (rounded >= 2.0 ** -23).all()  # the floor is a bfloat16 value
    assert stored_scale(scale, torch.float32) is scale


def test_the_qspec_field_checks_and_names():
    spec = q.QSpec(q.INT4, q.PerGroup(32, 1), scale_dtype="bfloat16")
    assert spec.scale_dtype is torch.bfloat16 and spec == q.QSpec(q.INT4, q.PerGroup(32, 1), scale_dtype=torch.bfloat16)
    assert str(spec).endswith("bfloat16 scales") and "scales" not in str(q.QSpec(q.INT4))
    with pytest.raises(ValueError, match="scale_dtype must be one of float32, bfloat16"):
        q.QSpec(q.INT4, scale_dtype=torch.float16)
    with pytest.raises(TypeError, match="scale_dtype must be a torch.dtype or its name, got 16"):
        q.QSpec(q.INT4, scale_dtype=16)
    with pytest.raises(ValueError, match="applies to integer formats' scales; FP8_E4M3"):
        q.QSpec(q.FP8_E4M3, scale_dtype=torch.bfloat16)


def test_a_static_weight_applies_the_rounded_scale_with_the_observer_on_and_off():
    w = _group_weight()
    point = q.FakeQuantize(q.QSpec(q.INT4, q.PerGroup(32, 1), "symmetric", observer=q.CurrentMinMaxObserver(),
                                   scale_dtype=torch.bfloat16))
    expected_scale = bf16_round(_symmetric_int4_scale(w))
    expected, _ = reference.fake_quantize_affine(w, (1, 32), expected_scale, torch.zeros(8, 2, dtype=torch.int32),
                                                 -8, 7)
    # First call: the unfused observe; second: state sized, where an fp32 point takes the fused op.
    for _ in range(2):
        assert torch.equal(point(w), expected)
        assert torch.equal(point.scale, expected_scale)
    point.disable_observer()
    assert torch.equal(point(w), expected)
    # The fp32 point applies another scale: the rounding is what changes y.
    fp32 = q.FakeQuantize(q.QSpec(q.INT4, q.PerGroup(32, 1), "symmetric", observer=q.CurrentMinMaxObserver()))
    fp32(w)
    assert torch.equal(fp32(w), reference.fake_quantize_affine(w, (1, 32), _symmetric_int4_scale(w),
                                                               torch.zeros(8, 2, dtype=torch.int32), -8, 7)[0])
    assert not torch.equal(fp32(w), expected)


def test_an_asymmetric_zero_point_comes_from_the_fp32_scale():
    # As torchao's choose_qparams_affine: the zero point first, then the scale's cast.
    g = torch.Generator().manual_seed(1)
    x = torch.rand(64, 40, generator=g) * 3 - torch.rand(64, 1, generator=g)
    point = q.FakeQuantize(q.QSpec(q.INT8, q.PerChannel(0), "asymmetric", scale_dtype="bfloat16"))
    point(x)
    lo, hi = x.double().amin(1, keepdim=True).clamp(max=0), x.double().amax(1, keepdim=True).clamp(min=0)
    fp32_scale = ((hi - lo) / 255).float()
    assert torch.equal(point.zero_point, (-128 - torch.round(lo.float() / fp32_scale)).int())
    assert torch.equal(point.scale, bf16_round(fp32_scale))


def bf16_below(t: torch.Tensor) -> torch.Tensor:
    """The bfloat16 value just below each positive bfloat16 value of t (fp32), on the bit pattern."""
    u = t.float().numpy().view(np.uint32)
    return torch.from_numpy((u - np.uint32(0x10000)).view(np.float32).copy()).reshape(t.shape)


def test_a_rounded_scale_that_would_put_the_grid_past_fp16_steps_down():
    # fp16 int8 symmetric over +-65504: the range is clamped to 65504 * 255 / 256 = 65248.125,
    # the fp32 scale is 65248.125 / 127.5 = 511.75, whose nearest bfloat16 is 512 (bfloat16's
    # step is 2 below 512); -128 * 512 = -65536 is -Inf in fp16. 510 is the bfloat16 value below.
    x = torch.tensor([65504.0, -65504.0, 1.0], dtype=torch.float16)
    point = q.FakeQuantize(q.QSpec(q.INT8, q.PerTensor(), "symmetric", scale_dtype=torch.bfloat16))
    y = point(x)
    assert float(point.scale) == 510.0 and int(point.zero_point) == 0
    # 65504 / 510 = 128.4 -> clamped to 127: 64770, which fp16 rounds to 64768; -128 * 510 = -65280.
    assert torch.equal(y, torch.tensor([64768.0, -65280.0, 0.0], dtype=torch.float16))


@settings(max_examples=150, deadline=None)
@given(bits=st.integers(2, 8), signed=st.booleans(),
       scheme=st.sampled_from(["symmetric", "symmetric_narrow", "symmetric_no_clip", "asymmetric", "minval"]),
       dtype=st.sampled_from([torch.float16, torch.bfloat16]),
       fractions=st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=6),
       ends=st.lists(st.floats(0.9, 1.0), min_size=2, max_size=2))
def test_a_bfloat16_scale_is_the_nearest_unless_that_puts_the_grid_past_the_dtype(bits, signed, scheme, dtype,
                                                                                  fractions, ends):
    """Ranges near the input dtype's max: the stored scale is the fp32
    point's scale rounded to the nearest bfloat16, or, where that puts an
    end of the grid past the dtype's range, the bfloat16 value just below;
    every grid point is finite."""
    if scheme == "minval":
        dtype = torch.float16  # bf16's max lies beyond the fp32 cap, where MINVAL's fp32 intermediate can round past fp32
    top = torch.finfo(dtype).max
    x = torch.tensor([f * top for f in fractions] + [-ends[0] * top, ends[1] * top]).to(dtype)
    fmt = q.IntFormat(bits, signed)

    def point(scale_dtype):
        args = ("asymmetric", "minval") if scheme == "minval" else (scheme,)
        p = q.FakeQuantize(q.QSpec(fmt, q.PerTensor(), *args, scale_dtype=scale_dtype))
        return p, p(x)

    fp32, _ = point(torch.float32)
    bf16, y = point(torch.bfloat16)
    qmin, qmax = bf16.quant_min, bf16.quant_max

    def grid_ends(scale):
        if scheme == "minval":
            return bf16.minval, (qmax - qmin) * scale + bf16.minval
        zp = int(bf16.zero_point)
        return (qmin - zp) * scale, (qmax - zp) * scale

    nearest = bf16_round(fp32.scale)
    finite = all(torch.isfinite(e.to(dtype)).all() for e in grid_ends(nearest))
    expected = nearest if finite else bf16_below(nearest)
    assert torch.equal(bf16.scale, expected), (fp32.scale, bf16.scale)
    assert all(torch.isfinite(e.to(dtype)).all() for e in grid_ends(bf16.scale))
    assert torch.isfinite(y).all()


def test_a_dynamic_point_rounds_its_scales_eager_no_grad_and_exported():
    spec = q.QSpec(q.INT8, q.PerToken(), "asymmetric", dynamic=True, scale_dtype=torch.bfloat16)
    point = q.FakeQuantize(spec)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(2, 5, 48, generator=g) * 3).requires_grad_()
    lo, hi = x.detach().amin(-1, keepdim=True).clamp(max=0), x.detach().amax(-1, keepdim=True).clamp(min=0)
    fp32_scale = ((hi.double() - lo.double()) / 255).float()
    zero_point = (-128 - torch.round(lo / fp32_scale)).clamp(-128, 127)
    expected, _ = reference.fake_quantize_affine(x.detach(), (1, 1, 48), bf16_round(fp32_scale), zero_point, -128, 127)
    assert torch.equal(point(x), expected)  # an eager training step (gradients on)
    with torch.no_grad():
        assert torch.equal(point(x), expected)
    assert torch.equal(torch.export.export(point, (x.detach(),)).module()(x.detach()), expected)


def test_a_learnable_scale_trains_in_fp32_and_applies_and_freezes_rounded():
    w = _group_weight(3)
    point = q.FakeQuantize(q.QSpec(q.INT4, q.PerGroup(32, 1), "symmetric", learnable=True, scale_dtype="bfloat16"))
    point(w)
    assert torch.equal(point.scale.detach(), bf16_round(_symmetric_int4_scale(w)))
    point.disable_observer()
    with torch.no_grad():
        point.scale.mul_(1.0 + 2.0 ** -12)  # an optimizer step: off the bfloat16 grid, kept in fp32
    learned = point.scale.detach().clone()
    assert not torch.equal(learned, bf16_round(learned))
    y = point(w)
    applied = bf16_round(learned)
    assert torch.equal(y, reference.fake_quantize_affine(w, (1, 32), applied, None, -8, 7)[0])
    # Straight through: the parameter gets the learnable op's gradient at the applied scale.
    y.sum().backward()
    _, d_scale, _ = reference.fake_quantize_affine_learnable_grads(w, (1, 32), applied, None, -8, 7, None,
                                                                    torch.ones_like(w))
    torch.testing.assert_close(point.scale.grad.double(), d_scale, rtol=1e-5, atol=1e-9)
    point.convert(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()), None)
    assert torch.equal(point.scale, applied) and not isinstance(point.scale, torch.nn.Parameter)


def test_the_config_file_round_trips_the_field(tmp_path):
    from quantizers import QuantizerConfig
    from quantizers.qspec_dict import ConfigError, qspec_from_dict, qspec_to_dict

    spec = q.QSpec(q.INT4, q.PerGroup(32, 1), scale_dtype=torch.bfloat16)
    assert qspec_to_dict(spec)["scale_dtype"] == "bfloat16"
    assert qspec_to_dict(q.QSpec(q.INT4))["scale_dtype"] == "float32"
    from quantizers import OpConfig

    config = QuantizerConfig(OpConfig(weight=spec))
    config.save(tmp_path / "c.yaml")
    assert "scale_dtype: bfloat16" in (tmp_path / "c.yaml").read_text()
    assert QuantizerConfig.load(tmp_path / "c.yaml").global_config.weight == spec
    with pytest.raises(ConfigError, match="global.weight: QSpec: scale_dtype must be one of float32, bfloat16"):
        qspec_from_dict("global.weight", {"format": "int4", "scale_dtype": "float16"})


def test_the_report_shows_the_scale_dtype_and_counts_two_bytes_per_scale():
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from quantizers import FakeQuantQuantizer, OpConfig, QuantizerConfig

    model = torch.nn.Sequential(torch.nn.Linear(64, 16)).eval()
    x = torch.randn(3, 64)
    reports = {}
    for dtype in (torch.float32, torch.bfloat16):
        spec = q.QSpec(q.INT4, q.PerGroup(32, 1), scale_dtype=dtype)
        prepared = prepare_pt2e(torch.export.export(model, (x,)).module(), FakeQuantQuantizer(
            QuantizerConfig(OpConfig(weight=spec))))
        prepared(x)
        reports[dtype] = q.report(convert_pt2e(prepared), (x,), file=None)
    (row,) = reports[torch.bfloat16].rows
    assert row["format"] == "INT4 symmetric, bfloat16 scales"
    # 16 x 2 scales: 2 bytes each instead of 4.
    assert reports[torch.float32].quantized_weight_bytes - reports[torch.bfloat16].quantized_weight_bytes == 32 * 2


def test_the_lowering_refuses_a_dynamic_point_with_rounded_scales_and_onnx_runtime_agrees():
    onnxruntime = pytest.importorskip("onnxruntime", reason="ONNX Runtime (the onnx extra) is not installed")
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from pt2e_fq.export import UnsupportedPointError, to_onnx, to_qdq
    from quantizers import FakeQuantQuantizer, OpConfig, QuantizerConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 16)).eval()
    x = torch.randn(3, 64) * 4
    act = q.QSpec(q.INT8, q.PerToken(), "asymmetric", dynamic=True, scale_dtype=torch.bfloat16)
    prepared = prepare_pt2e(torch.export.export(model, (x,)).module(), FakeQuantQuantizer(
        QuantizerConfig(OpConfig(input_activation=act, weight=q.QSpec(q.INT8, q.PerChannel(0),
                                                                      scale_dtype="bfloat16")))))
    prepared(x)
    converted = convert_pt2e(prepared)
    # XNNPACK and torchao's per-token chain compute fp32 scales: lowering it would change the numerics.
    with pytest.raises(UnsupportedPointError, match="scales are rounded to bfloat16 in the graph"):
        to_qdq(converted, (x,), target="xnnpack")
    # ONNX computes the point's qparams in the graph, the cast to bfloat16 and back included; the
    # weight's rounded scales are fp32 initialisers, exactly.
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        to_onnx(converted, (x,), f"{folder}/m.onnx")
        session = onnxruntime.InferenceSession(f"{folder}/m.onnx")
        (y,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    # The quantized operands agree exactly; the fp32 matmul after them may sum in another order in
    # ONNX Runtime (seen: 1 ulp, about 1e-6 relative). Scales left unrounded would differ by up to
    # 2^-9 relative (bfloat16's step), hundreds of times the tolerance.
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(y), converted(x), rtol=1e-5, atol=1e-5)
