"""pt2e_fq.FakeQuantize as a module: numerics against pt2e_fq.reference and
torchao's stock FakeQuantize, STE gradient, torchao's switches, state_dict,
dtype and device moves, freezing."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torchao.quantization.pt2e as tao
from tests.conftest import requires_cuda_kernels
from torch.fx.experimental.proxy_tensor import make_fx

import pt2e_fq as q
from pt2e_fq import reference
from pt2e_fq.ops.blocks import reduce_blocks



def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def expected_output(spec: q.QSpec, x: torch.Tensor) -> torch.Tensor:
    """The reference's output with min-max qparams of x: block range
    (reduce_blocks, tested against a loop), qparams (tested against hand
    values) and reference.fake_quantize_affine (the semantics' definition)."""
    bs = spec.granularity.block_size(x.shape)
    lo = reduce_blocks(x, bs, torch.amin, float("inf"))
    hi = reduce_blocks(x, bs, torch.amax, -float("inf"))
    p = spec.kind.qparams_from_range(spec, lo, hi)
    qmin, qmax = spec.quant_range
    return reference.fake_quantize_affine(x, bs, p["scale"], p.get("zero_point"), qmin, qmax, p.get("minval"))[0]


SPECS = [
    q.QSpec(q.INT8),
    q.QSpec(q.UINT8, q.PerChannel(1), "asymmetric"),
    q.QSpec(q.INT4, q.PerGroup(5), "asymmetric", "minval"),
    q.QSpec(q.INT4, q.PerBlock((2, 3, 4)), "symmetric_narrow"),
    q.QSpec(q.INT8, q.PerToken(), "asymmetric", dynamic=True),
    q.QSpec(q.INT8, dynamic=True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_output_equals_the_reference_with_min_max_qparams(spec, dtype):
    x = randn(3, 5, 12, dtype=dtype)
    fq = q.FakeQuantize(spec)
    y = fq(x)
    assert y.dtype == dtype
    assert torch.equal(y, expected_output(spec, x))
    if not spec.dynamic:  # the stored qparams have the reduced shape, fp32 / int32
        red = tuple(-(-s // b) for s, b in zip(x.shape, spec.granularity.block_size(x.shape)))
        assert all(t.shape == red for t in fq.calculate_qparams().values())
        assert fq.scale.dtype == torch.float32


def test_dynamic_points_follow_every_input_and_store_nothing():
    fq = q.FakeQuantize(q.QSpec(q.INT8, q.PerToken(), "asymmetric", dynamic=True))
    for shape in [(2, 7, 16), (5, 16), (1, 3, 2, 16)]:
        x = randn(*shape, seed=len(shape))
        assert torch.equal(fq(x), expected_output(fq.qspec, x))
    assert set(fq.state_dict()) == {"fake_quant_enabled", "observer_enabled"}
    assert fq.calculate_qparams() == {}


# ---------------------------------------------------------------------------
# Parity with torchao's stock FakeQuantize


def _tie_positions(x, scale, zero_point, axis=None):
    """Where ATen's round(x * (1/scale)) and our round(x / scale) differ: the
    documented tie rule difference (DESIGN.md)."""
    if axis is not None:
        shape = [1] * x.dim()
        shape[axis] = -1
        scale = scale.reshape(shape)
    return torch.round(x * (1.0 / scale)) != torch.round(x / scale)


STOCK = [
    ("per-tensor symmetric int8", q.QSpec(q.INT8),
     dict(observer=tao.MinMaxObserver, dtype=torch.qint8, qscheme=torch.per_tensor_symmetric), None),
    ("per-tensor affine uint8", q.QSpec(q.UINT8, scheme="asymmetric"),
     dict(observer=tao.MinMaxObserver, dtype=torch.quint8, qscheme=torch.per_tensor_affine), None),
    ("per-channel symmetric int8", q.QSpec(q.INT8, q.PerChannel(0)),
     dict(observer=tao.PerChannelMinMaxObserver, dtype=torch.qint8, qscheme=torch.per_channel_symmetric,
          ch_axis=0), 0),
    ("per-channel affine int8 axis 1", q.QSpec(q.INT8, q.PerChannel(1), "asymmetric"),
     dict(observer=tao.PerChannelMinMaxObserver, dtype=torch.qint8, qscheme=torch.per_channel_affine,
          ch_axis=1), 1),
    ("moving-average per-tensor affine int8",
     q.QSpec(q.INT8, scheme="asymmetric", observer=q.MovingAverageMinMaxObserver(0.25)),
     dict(observer=tao.MovingAverageMinMaxObserver, averaging_constant=0.25, dtype=torch.qint8,
          qscheme=torch.per_tensor_affine), None),
]


@pytest.mark.parametrize("name, spec, stock_kwargs, axis", STOCK, ids=[s[0] for s in STOCK])
def test_int8_matches_torchao_stock_fake_quantize_except_on_ties(name, spec, stock_kwargs, axis):
    qmin, qmax = spec.quant_range
    stock = tao.FakeQuantize(quant_min=qmin, quant_max=qmax, **stock_kwargs)
    ours = q.FakeQuantize(spec)
    for step in range(3):
        x = randn(16, 24, 5, seed=step) * (1 + step)
        y_stock, y_ours = stock(x), ours(x)
        zp = ours.zero_point.reshape(-1).to(torch.int32)
        assert torch.equal(ours.scale.reshape(-1), stock.scale)
        assert torch.equal(zp, stock.zero_point.to(torch.int32))
        ties = _tie_positions(x, stock.scale, stock.zero_point, axis)
        assert ties.sum() < 0.01 * x.numel()
        assert torch.equal(y_ours[~ties], y_stock[~ties])


# ---------------------------------------------------------------------------
# Gradient


@pytest.mark.parametrize("spec", [q.QSpec(q.INT8, q.PerChannel(0), "asymmetric"),
                                  q.QSpec(q.INT4, q.PerGroup(4), "asymmetric", "minval")], ids=str)
def test_gradient_is_the_straight_through_estimator(spec):
    fq = q.FakeQuantize(spec)
    fq(randn(6, 10, seed=1) * 0.5)  # calibrate on a narrower range: some of x clamps
    fq.disable_observer()
    x = randn(6, 10, seed=2).requires_grad_()
    dy = randn(6, 10, seed=3)
    fq(x).backward(dy)
    qmin, qmax = spec.quant_range
    p = fq.calculate_qparams()
    _, mask = reference.fake_quantize_affine(x.detach(), spec.granularity.block_size(x.shape), p["scale"],
                                             p.get("zero_point"), qmin, qmax, p.get("minval"))
    assert 0 < mask.sum() < mask.numel()
    assert torch.equal(x.grad, torch.where(mask, dy, torch.zeros_like(dy)))


# ---------------------------------------------------------------------------
# torchao's switches, no tensor-valued branch


def _calibrated(spec=q.QSpec(q.INT8, scheme="asymmetric"), x=None):
    fq = q.FakeQuantize(spec)
    fq(randn(4, 8) if x is None else x)
    return fq


def test_torchao_switches_through_model_apply():
    model = nn.Sequential(_calibrated())
    fq = model[0]
    scale = fq.scale.clone()
    model.apply(tao.disable_observer)
    assert fq.observer_enabled.tolist() == [0]
    wide = randn(4, 8, seed=5) * 10
    y = model(wide)
    assert torch.equal(fq.scale, scale)  # no update
    assert not torch.equal(y, wide)
    model.apply(tao.disable_fake_quant)
    assert fq.fake_quant_enabled.tolist() == [0] and torch.equal(model(wide), wide)
    model.apply(tao.enable_fake_quant)
    model.apply(tao.enable_observer)
    y = model(wide)
    assert fq.max_val.item() == max(randn(4, 8).max().item(), wide.max().item())  # it observed again
    assert fq.scale.item() > scale.item()
    p = fq.calculate_qparams()
    assert torch.equal(y, reference.fake_quantize_affine(wide, (4, 8), p["scale"], p["zero_point"], -128, 127)[0])


def test_observer_off_forward_traces_to_one_op_without_data_dependence():
    fq = _calibrated()
    fq.disable_observer()
    graph = make_fx(fq, tracing_mode="fake", _allow_non_fake_inputs=True)(randn(4, 8))
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.pt2e_fq.fake_quantize_affine.default) == 1
    ep = torch.export.export(fq, (randn(4, 8),))
    ops = [n for n in ep.graph.nodes if n.op == "call_function" and "pt2e_fq" in str(n.target)]
    assert len(ops) == 1


def test_uncalibrated_point_with_observer_off_refuses_to_run():
    fq = q.FakeQuantize(q.QSpec())
    fq.disable_observer()
    with pytest.raises(q.UncalibratedError, match="has no qparams yet"):
        fq(randn(2, 3))
    fq.disable_fake_quant()
    assert torch.equal(fq(randn(2, 3)), randn(2, 3))


def test_a_new_input_shape_that_changes_the_qparams_shape_is_an_error():
    fq = _calibrated(q.QSpec(q.INT8, q.PerBlock((2, 4))), randn(4, 8))
    with pytest.raises(ValueError, match=r"shape \(4, 16\)\) gives qparams of shape \(2, 4\).*calibrated with shape \(2, 2\)"):
        fq(randn(4, 16))
    # Every step checks (eager mode remembers the last good shape): after a
    # good step the bad shape still fails (observer off: the op's own check);
    # a loaded state_dict sets the shape checked against.
    fq(randn(4, 8))
    for observer, message in ((True, "calibrated with shape"), (False, r"scale must have shape \(2, 4\)")):
        fq.enable_observer(observer)
        with pytest.raises(ValueError, match=message):
            fq(randn(4, 16))
    fq.enable_observer(True)
    loaded = q.FakeQuantize(q.QSpec(q.INT8, q.PerBlock((2, 4))))
    loaded.load_state_dict(_calibrated(q.QSpec(q.INT8, q.PerBlock((2, 4))), randn(4, 16)).state_dict())
    loaded(randn(4, 16))
    with pytest.raises(ValueError, match=r"calibrated with shape \(2, 4\)"):
        loaded(randn(4, 8))


@pytest.mark.parametrize("observer", [q.MinMaxObserver(), q.HistogramObserver(bins=16), q.MSEObserver(4)],
                         ids=lambda o: type(o).__name__)
def test_a_per_tensor_point_takes_inputs_of_any_rank(observer):
    """One scale whatever the shape: a point calibrated on a 4-D tensor
    takes 3-D, 1-D and 2-D ones (a point shared by both inputs of a
    broadcasting add), observing them (unfused and fused) and with the
    observer off; its qparams keep their first shape."""
    fq = q.FakeQuantize(q.QSpec(q.INT8, q.PerTensor(), "asymmetric", observer=observer))
    xs = [randn(2, 3, 4, 4, seed=1), randn(3, 1, 1, seed=2) * 4, randn(5, seed=3) * 2, randn(2, 3, 4, 4, seed=4)]
    for x in xs:
        fq(x)
    assert fq.scale.shape == (1, 1, 1, 1)
    if isinstance(observer, q.MinMaxObserver):
        # The running range of every batch, by hand (torch's asymmetric formula).
        lo, hi = min(float(x.min()) for x in xs), max(float(x.max()) for x in xs)
        scale = (torch.tensor(hi, dtype=torch.float32) - torch.tensor(lo, dtype=torch.float32)) / 255
        assert torch.equal(fq.scale.reshape(()), scale)
        assert int(fq.zero_point) == int(-128 - torch.round(torch.tensor(lo, dtype=torch.float32) / scale))
    fq.disable_observer()
    x = randn(6, 7, seed=5)
    expected, _ = reference.fake_quantize_affine(x, (6, 7), fq.scale.reshape(1, 1), fq.zero_point.reshape(1, 1),
                                                 -128, 127)
    assert torch.equal(fq(x), expected)


def test_a_per_channel_point_takes_another_rank_with_the_same_channels_and_refuses_others():
    fq = q.FakeQuantize(q.QSpec(q.INT8, q.PerChannel(-1)))
    fq(randn(2, 3, 8))  # qparams (1, 1, 8)
    fq(randn(5, 8, seed=1) * 3)  # (1, 8): the same 8 channels
    assert fq.scale.shape == (1, 1, 8)
    with pytest.raises(ValueError, match=r"gives qparams of shape \(1, 1, 6\), but the point was calibrated with "
                                         r"shape \(1, 1, 8\)"):
        fq(randn(2, 3, 6))
    channel_one = q.FakeQuantize(q.QSpec(q.INT8, q.PerChannel(1)))
    channel_one(randn(2, 4, 3))  # (1, 4, 1)
    with pytest.raises(ValueError, match=r"gives qparams of shape \(1, 2, 1, 1\)"):
        channel_one(randn(1, 2, 4, 3))  # axis 1 now has 2 channels


# ---------------------------------------------------------------------------
# dtypes, devices, state_dict, freezing


def test_casting_the_model_keeps_qparams_fp32_and_exact():
    model = nn.Sequential(_calibrated(q.QSpec(q.INT8, q.PerChannel(0), "asymmetric"), randn(4, 8) * 3))
    scale = model[0].scale.clone()
    model.to(torch.bfloat16)
    assert model[0].scale.dtype == torch.float32 and torch.equal(model[0].scale, scale)
    assert model[0].zero_point.dtype == torch.int32 and model[0].min_val.dtype == torch.float32
    model[0].disable_observer()
    x = randn(4, 8, seed=7, dtype=torch.bfloat16) * 3
    p = model[0].calculate_qparams()
    expected = reference.fake_quantize_affine(x, (1, 8), p["scale"], p["zero_point"], -128, 127)[0]
    assert torch.equal(model(x), expected) and model(x).dtype == torch.bfloat16
    model.to("meta")  # a device move (no GPU here): buffers follow, dtypes stay
    assert model[0].scale.device.type == "meta" and model[0].scale.dtype == torch.float32


@requires_cuda_kernels
def test_a_module_moved_to_cuda_gives_the_cpu_result():
    fq = _calibrated(q.QSpec(q.INT8, q.PerChannel(0), "asymmetric"), randn(4, 8) * 3)
    fq.disable_observer()
    x = randn(4, 8, seed=4) * 3
    expected = fq(x)
    fq.to("cuda")
    assert fq.scale.device.type == "cuda"
    assert torch.equal(fq(x.cuda()).cpu(), expected)


def test_state_dict_round_trip_of_a_prepared_module():
    spec = q.QSpec(q.INT8, q.PerChannel(0), "asymmetric", observer=q.MovingAverageMinMaxObserver(0.5))
    a = _calibrated(spec, randn(4, 8))
    a(randn(4, 8, seed=1) * 2)
    a.disable_observer()
    b = q.FakeQuantize(spec)
    assert not b.is_calibrated
    b.load_state_dict(a.state_dict())
    for name, value in a.state_dict().items():
        assert torch.equal(b.state_dict()[name], value), name
    x = randn(4, 8, seed=9) * 3
    assert torch.equal(b(x), a(x))
    assert torch.equal(b.scale, a.scale)  # the loaded switch turned b's observer off too
    b.enable_observer()
    b(x)  # and the loaded running range goes on averaging
    assert torch.equal(b.max_val, a.max_val + 0.5 * (x.amax(dim=1, keepdim=True) - a.max_val))
    b.load_state_dict(q.FakeQuantize(spec).state_dict())  # an uncalibrated state empties it again
    assert not b.is_calibrated


def test_convert_freezes_the_module_and_drops_prepare_state():
    model = nn.Module()
    model.fq = _calibrated()
    x = randn(4, 8, seed=3) * 4
    before = model.fq(x)  # observes x too
    model.fq.convert(model, None)
    assert set(model.state_dict()) == {"fq.scale", "fq.zero_point"}
    assert model.fq.is_frozen and "frozen" in repr(model.fq)
    scale = model.fq.scale.clone()
    model.fq(x * 3)
    assert torch.equal(model.fq.scale, scale)  # frozen: no observation
    assert torch.equal(model.fq(x), before)
    model.apply(tao.disable_observer)  # harmless
    with pytest.raises(RuntimeError, match="converted; its observer is off for good"):
        model.apply(tao.enable_observer)
    model.apply(tao.disable_fake_quant)  # still a switch, for debugging
    assert torch.equal(model.fq(x), x)


def test_convert_lists_every_uncalibrated_point_by_module_path():
    model = nn.Module()
    model.block = nn.Module()
    model.block.act = q.FakeQuantize(q.QSpec())
    model.weight = q.FakeQuantize(q.QSpec(q.INT4, q.PerChannel(0)))
    model.ok = _calibrated()
    model.dyn = q.FakeQuantize(q.QSpec(q.INT8, q.PerToken(), dynamic=True))  # nothing to calibrate
    with pytest.raises(q.UncalibratedError) as err:
        model.ok.convert(model, None)
    text = str(err.value)
    assert "2 fake-quant point(s) never saw data" in text
    assert "  block.act: INT8 PerTensor() symmetric MinMaxObserver" in text
    assert "  weight: INT4 PerChannel(axis=0) symmetric MinMaxObserver" in text
    assert "ok:" not in text and "dyn:" not in text
