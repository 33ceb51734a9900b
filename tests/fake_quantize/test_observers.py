"""Observers and qparams against hand-computed values.

Expected numbers are written out from torch's observer formulas (the fp32
divisions are spelled as torch.tensor(a) / b so they round as fp32); errors
are measured with pt2e_fq.reference, not with the op.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import pt2e_fq as q
from pt2e_fq import reference
from pt2e_fq.ops.blocks import reduce_blocks


EPS = torch.finfo(torch.float32).eps


def f32(a, b):
    """a / b rounded as fp32, as the qparams code divides."""
    return (torch.tensor(a, dtype=torch.float32) / b).item()


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


# ---------------------------------------------------------------------------
# Block reduction


@pytest.mark.parametrize("block", [(2, 3), (5, 7), (1, 1), (8, 3), (3, 2)])
@pytest.mark.parametrize("reduce, pad", [(torch.amin, float("inf")), (torch.amax, -float("inf")), (torch.sum, 0.0)])
def test_reduce_blocks_matches_a_loop_over_blocks(block, reduce, pad):
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    got = reduce_blocks(x, block, reduce, pad)
    b0, b1 = min(block[0], 5), min(block[1], 7)
    rows, cols = -(-5 // b0), -(-7 // b1)
    expected = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            expected[i, j] = reduce(x[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1], dim=(0, 1))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6 if reduce is torch.sum else 0)


# ---------------------------------------------------------------------------
# qparams from a range, per scheme and formulation


@pytest.mark.parametrize(
    "spec, lo, hi, expected",
    [
        # symmetric: scale = amax / ((qmax - qmin) / 2), zero point = middle code
        (q.QSpec(q.INT8), -2.0, 1.0, dict(scale=f32(2.0, 127.5), zero_point=0)),
        (q.QSpec(q.INT8, scheme="symmetric_narrow"), -2.0, 1.0, dict(scale=f32(2.0, 127.0), zero_point=0)),
        (q.QSpec(q.UINT8), 0.5, 3.0, dict(scale=f32(3.0, 127.5), zero_point=128)),
        (q.QSpec(q.INT4, scheme="symmetric_narrow"), -0.5, 7.0, dict(scale=f32(7.0, 7.0), zero_point=0)),
        # asymmetric: scale = (max(hi,0) - min(lo,0)) / (qmax - qmin); zp = qmin - round(min(lo,0) / scale)
        # -1 / (4/255) = -63.75 -> round -64
        (q.QSpec(q.UINT8, scheme="asymmetric"), -1.0, 3.0, dict(scale=f32(4.0, 255.0), zero_point=64)),
        (q.QSpec(q.INT8, scheme="asymmetric"), -1.0, 3.0, dict(scale=f32(4.0, 255.0), zero_point=-64)),
        (q.QSpec(q.UINT8, scheme="asymmetric"), 1.0, 3.0, dict(scale=f32(3.0, 255.0), zero_point=0)),
        (q.QSpec(q.INT8, scheme="asymmetric"), -3.0, -1.0, dict(scale=f32(3.0, 255.0), zero_point=127)),
        # a constant 0 gets the eps floor, like torch's observers
        (q.QSpec(q.UINT8, scheme="asymmetric"), 0.0, 0.0, dict(scale=EPS, zero_point=0)),
        # MINVAL: [lo, hi] itself onto [qmin, qmax]
        (q.QSpec(q.INT4, scheme="asymmetric", formulation="minval"), 0.5, 2.5,
         dict(scale=f32(2.0, 15.0), minval=0.5)),
        (q.QSpec(q.UINT8, scheme="asymmetric", formulation="minval"), -3.0, -1.0,
         dict(scale=f32(2.0, 255.0), minval=-3.0)),
        # float formats: amax / fmax
        (q.QSpec(q.FP8_E4M3), -3.0, 2.0, dict(scale=f32(3.0, 448.0))),
        (q.QSpec(q.FP4_E2M1), -1.0, 4.5, dict(scale=f32(4.5, 6.0))),
        (q.QSpec(q.NVFP4, q.PerGroup(16)), -1.0, 4.5, dict(global_scale=f32(4.5, 6.0 * 448.0))),
        (q.QSpec(q.MXFP4, q.PerGroup(32), dynamic=True), -1.0, 4.5, dict()),  # the kernel scales
        (q.QSpec(q.NVFP4, q.PerGroup(16), dynamic=True), -1.0, 4.5, dict()),
    ],
    ids=lambda v: str(v) if isinstance(v, q.QSpec) else None,
)
def test_qparams_from_range_hand_computed(spec, lo, hi, expected):
    got = spec.kind.qparams_from_range(spec, t(lo), t(hi))
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert got[name].item() == value, name
    if "zero_point" in got:
        assert got["zero_point"].dtype == torch.int32


def test_qparams_are_per_block():
    spec = q.QSpec(q.INT8, q.PerChannel(0), "asymmetric")
    got = spec.kind.qparams_from_range(spec, t(-1.0, 0.0), t(3.0, 2.0))
    assert got["scale"].tolist() == [f32(4.0, 255.0), f32(2.0, 255.0)]
    assert got["zero_point"].tolist() == [-64, -128]


# ---------------------------------------------------------------------------
# Observers


def _unused(lo, hi):
    raise AssertionError("only a searching observer may fake-quantize")


def test_min_max_keeps_the_running_extremes():
    obs = q.MinMaxObserver()
    r = obs.observe(t(-1.0, 2.0, 0.5, 3.0), (4,), None, _unused)
    assert [v.item() for v in r] == [-1.0, 3.0]
    r = obs.observe(t(-4.0, 1.0, 0.0, 0.0), (4,), r, _unused)
    assert [v.item() for v in r] == [-4.0, 3.0]


def test_moving_average_starts_at_the_first_batch_then_averages():
    obs = q.MovingAverageMinMaxObserver(averaging_constant=0.5)
    r = obs.observe(t(-1.0, 3.0), (2,), None, _unused)
    assert [v.item() for v in r] == [-1.0, 3.0]
    r = obs.observe(t(-4.0, 1.0), (2,), r, _unused)
    assert [v.item() for v in r] == [-2.5, 2.0]  # -1 + 0.5 * (-4 + 1), 3 + 0.5 * (1 - 3)


def test_current_min_max_ignores_history():
    r = q.CurrentMinMaxObserver().observe(t(-4.0, 1.0), (2,), (t(-9.0), t(9.0)), _unused)
    assert [v.item() for v in r] == [-4.0, 1.0]


@pytest.mark.parametrize("obs", [q.MinMaxObserver(), q.MovingAverageMinMaxObserver(), q.CurrentMinMaxObserver()],
                         ids=lambda o: type(o).__name__)
def test_observers_reduce_over_blocks_of_any_granularity(obs):
    x = torch.tensor([[1.0, -2.0, 3.0, 0.0, 7.0], [4.0, 5.0, -6.0, 2.0, -1.0]])
    lo, hi = obs.observe(x, q.PerChannel(0).block_size(x.shape), None, _unused)
    assert lo.tolist() == [[-2.0], [-6.0]] and hi.tolist() == [[7.0], [5.0]]
    lo, hi = obs.observe(x, q.PerGroup(2).block_size(x.shape), None, _unused)  # ragged last group
    assert lo.tolist() == [[-2.0, 0.0, 7.0], [4.0, -6.0, -1.0]]
    assert hi.tolist() == [[1.0, 3.0, 7.0], [5.0, 2.0, -1.0]]
    lo, hi = obs.observe(x, q.PerToken().block_size(x.shape), None, _unused)
    assert lo.tolist() == [[-2.0], [-6.0]]
    lo, hi = obs.observe(x.bfloat16(), q.PerTensor().block_size(x.shape), None, _unused)
    assert (lo.dtype, lo.item(), hi.item()) == (torch.float32, -6.0, 7.0)


def _reference_fake_quantize(spec, x, block_size):
    """(lo, hi) -> x fake-quantized by the reference with the spec's qparams."""
    qmin, qmax = spec.quant_range

    def fq(lo, hi):
        p = spec.kind.qparams_from_range(spec, lo, hi)
        return reference.fake_quantize_affine(x, block_size, p["scale"], p.get("zero_point"), qmin, qmax,
                                              p.get("minval"))[0]

    return fq


def _sq_error(spec, x, block_size, lo, hi):
    return ((_reference_fake_quantize(spec, x, block_size)(lo, hi) - x) ** 2).sum().item()


@pytest.mark.parametrize("scheme, formulation", [("symmetric", "zp"), ("asymmetric", "zp"), ("asymmetric", "minval")])
def test_mse_beats_min_max_on_a_tensor_with_outliers(scheme, formulation):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g)
    x[torch.randperm(4096, generator=g)[:4]] = torch.tensor([12.0, -11.0, 10.5, 13.0])
    spec = q.QSpec(q.INT4, scheme=scheme, formulation=formulation, observer=q.MSEObserver())
    bs = (4096,)
    fq = _reference_fake_quantize(spec, x, bs)
    mse_lo, mse_hi = q.MSEObserver().observe(x, bs, None, fq)
    mm_lo, mm_hi = q.MinMaxObserver().observe(x, bs, None, fq)
    assert mse_hi.item() < mm_hi.item()  # it clipped
    assert _sq_error(spec, x, bs, mse_lo, mse_hi) < 0.5 * _sq_error(spec, x, bs, mm_lo, mm_hi)


def test_mse_keeps_the_full_range_when_clipping_only_hurts_and_searches_per_block():
    """Row 0 holds just -1 and 1: with a narrow symmetric range both are
    exact at the full range, and any clipping adds error. Row 1 has outliers."""
    g = torch.Generator().manual_seed(1)
    x = torch.stack([torch.tensor([-1.0, 1.0]).repeat(256), torch.randn(512, generator=g)])
    x[1, :3] = torch.tensor([12.0, -11.0, 13.0])
    spec = q.QSpec(q.INT4, q.PerChannel(0), "symmetric_narrow", observer=q.MSEObserver())
    bs = spec.granularity.block_size(x.shape)
    lo, hi = q.MSEObserver().observe(x, bs, None, _reference_fake_quantize(spec, x, bs))
    assert (lo[0].item(), hi[0].item()) == (-1.0, 1.0)
    assert hi[1].item() < 13.0


def test_mse_candidates():
    assert q.MSEObserver(num_candidates=5, min_fraction=0.2).fractions() == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    assert q.MSEObserver(num_candidates=1).fractions() == [1.0]
    with pytest.raises(ValueError, match="num_candidates must be an int >= 1"):
        q.MSEObserver(num_candidates=0)
    with pytest.raises(ValueError, match=r"min_fraction must be in \(0, 1\]"):
        q.MSEObserver(min_fraction=0.0)
    with pytest.raises(ValueError, match=r"averaging_constant must be in \(0, 1\]"):
        q.MovingAverageMinMaxObserver(averaging_constant=1.5)


@pytest.mark.parametrize(
    "spec",
    [
        q.QSpec(q.INT8, q.PerChannel(0), "asymmetric", observer=q.MinMaxObserver()),
        q.QSpec(q.INT8, q.PerGroup(3), "asymmetric", "minval", observer=q.MovingAverageMinMaxObserver()),
        q.QSpec(q.INT4, q.PerTensor(), "symmetric_narrow", observer=q.MSEObserver(num_candidates=4)),
        q.QSpec(q.INT8, q.PerToken(), "asymmetric", dynamic=True),
    ],
    ids=str,
)
def test_observe_and_qparams_trace_with_fake_tensors(spec):
    """make_fx in fake mode fails on .item(), on a branch on a tensor value and
    on anything else that needs the data on the host."""
    obs = spec.observer_or_default
    qmin, qmax = spec.quant_range

    def step(x, run_lo, run_hi):
        bs = spec.granularity.block_size(x.shape)

        def fq(lo, hi):
            p = spec.kind.qparams_from_range(spec, lo, hi)
            return q.ops.fake_quantize_affine(x, bs, p["scale"], p.get("zero_point"), qmin, qmax,
                                              minval=p.get("minval"))

        lo, hi = obs.observe(x, bs, (run_lo, run_hi), fq)
        return spec.kind.qparams_from_range(spec, lo, hi)

    x = torch.randn(4, 8)
    red = torch.Size([-(-a // b) for a, b in zip(x.shape, spec.granularity.block_size(x.shape))])
    graph = make_fx(step, tracing_mode="fake")(x, torch.zeros(red), torch.ones(red))
    assert len(graph.graph.nodes) > 3


# ---------------------------------------------------------------------------
# A dynamic point's qparams in fewer ops (FormatKind.current_qparams)


def _nasty(shape, dtype, seed=0):
    """Random values with NaN, +-Inf, -0.0, and one block-sized region with
    no finite value at all (the empty range)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 10
    flat = x.view(-1)
    pick = torch.randperm(flat.numel(), generator=g)
    flat[pick[:3]] = float("nan")
    flat[pick[3:5]] = float("inf")
    flat[pick[5:7]] = -float("inf")
    flat[pick[7:9]] = -0.0
    x[0, :2] = float("nan")  # with block sizes up to 2 on dim 1, a block with no finite value
    return x.to(dtype)


def _abs_max_by_loop(x, block_size):
    """max |x| over the finite values of every block, 0 for a block without one."""
    red = [-(-s // b) for s, b in zip(x.shape, block_size)]
    out = torch.empty(red)
    for idx in torch.cartesian_prod(*[torch.arange(r) for r in red]).reshape(-1, len(red)).tolist():
        block = x[tuple(slice(i * b, (i + 1) * b) for i, b in zip(idx, block_size))].float()
        finite = block[torch.isfinite(block)]
        out[tuple(idx)] = finite.abs().max() if finite.numel() else 0.0
    return out


GRANULARITIES = [q.PerTensor(), q.PerChannel(0), q.PerChannel(1), q.PerToken(), q.PerGroup(2),
                 q.PerGroup(3), q.PerGroup(2, axis=0), q.PerBlock((2, 3, 4))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("gran", GRANULARITIES, ids=repr)
def test_block_abs_max_matches_a_loop_over_blocks(gran, dtype):
    from pt2e_fq.ops.blocks import block_abs_max

    x = _nasty((3, 5, 7), dtype)
    bs = gran.block_size(x.shape)
    got = block_abs_max(x, bs)
    assert got.dtype == torch.float32
    assert torch.equal(got, _abs_max_by_loop(x, bs))
    assert not torch.signbit(got).any()  # +0.0 where a block is all zeros or has no finite value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("gran", GRANULARITIES, ids=repr)
@pytest.mark.parametrize("fmt", [q.FP8_E4M3, q.FP8_E5M2, q.FP4_E2M1], ids=lambda f: f.name)
def test_a_dynamic_float_scale_is_the_observed_ranges_bit_for_bit(fmt, gran, dtype):
    """current_qparams (the dynamic point's shortcut) against the path every
    static point takes: the observer's range, then qparams_from_range; and
    against the format definition, max |finite x| / fmax floored at the
    smallest normal fp32."""
    spec = q.QSpec(fmt, gran, dynamic=True)
    x = _nasty((3, 5, 7), dtype, seed=1)
    bs = gran.block_size(x.shape)
    got = spec.kind.current_qparams(spec, x, bs)
    observed = spec.kind.qparams_from_range(spec, *q.CurrentMinMaxObserver().observe(x, bs, None, _unused), x.dtype)
    assert got.keys() == observed.keys() == {"scale"}
    assert torch.equal(got["scale"], observed["scale"])
    assert torch.equal(got["scale"], (_abs_max_by_loop(x, bs) / fmt.fmax).clamp(min=torch.finfo(torch.float32).tiny))


def test_a_dynamic_fp8_point_exports_one_reduction_and_no_casts():
    """The dynamic scale's ops are traced into every exported program once
    per point (they dominated the export time of fp8 models): |x|, the
    finite mask, one amax, the division and the floor."""
    fq = q.FakeQuantize(q.QSpec(q.FP8_E4M3, q.PerTensor(), dynamic=True))
    ep = torch.export.export(fq, (torch.randn(4, 16),))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    aten = torch.ops.aten
    assert aten.amin.default not in targets and targets.count(aten.amax.default) == 1
    unwanted = {aten.to.dtype, aten._assert_tensor_metadata.default, aten.reshape.default, aten.detach.default}
    assert not unwanted & set(targets)
    x = _nasty((4, 16), torch.float32, seed=2)
    torch.testing.assert_close(ep.module()(x), fq(x), rtol=0, atol=0, equal_nan=True)
