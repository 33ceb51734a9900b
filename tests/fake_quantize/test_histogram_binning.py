"""HistogramObserver's compiled binning (pt2e_fq.ops.histogram.block_histogram,
the CPU path) against its ATen float64 computation (HistogramObserver._count,
the path off the CPU) bit for bit: any shape, block, dtype and range, NaN /
Inf, empty and one-point blocks, values on bin edges and ranges as wide as
fp32's; and a FakeQuantize module's state after a sequence of widening
batches, the same on either path."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pt2e_fq as q
from pt2e_fq import observers
from pt2e_fq.fake_quantize import FakeQuantize
from pt2e_fq.ops.blocks import block_min_max, expand_blocks, reduced_shape
from pt2e_fq.ops.histogram import block_finite_range, block_histogram

OP = torch.ops.pt2e_fq.block_histogram.default
RANGE_OP = torch.ops.pt2e_fq.block_finite_range.default


def aten_binning(x, block_size, lo, hi, bins):
    """block_histogram's results by the ATen path: _count over the padded
    rows, its non-finite column less the padding."""
    rows = observers._blocks_as_rows(x, block_size)
    obs = q.HistogramObserver(bins=bins)
    counts = obs._count(rows.reshape(-1), rows.shape[1], lo.reshape(-1), hi.reshape(-1)).view(-1, bins + 1)
    nonfinite = counts[:, 0].sum().long() - (rows.numel() - x.numel())
    return counts[:, 1:].contiguous().view(*lo.shape, bins), nonfinite


@st.composite
def cases(draw):
    """x with its block size and a per-block range that holds every finite
    value of its block: the batch's own, or one widened as a later batch
    widens the running range (some blocks one-point, some empty)."""
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 9)) for _ in range(ndim)]
    block = [draw(st.integers(1, s + 2)) for s in shape]  # ragged and whole-dimension blocks too
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    bins = draw(st.sampled_from([1, 2, 3, 7, 64, 2048]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e4, 3e38]))
    big = dtype is not torch.float32
    x = (torch.randn(shape, generator=g) * (min(scale, 6e4) if big else scale)).to(dtype)
    if draw(st.booleans()):  # constant blocks: one-point ranges
        x = torch.where(torch.rand(shape, generator=g) < 0.5, x, torch.ones((), dtype=dtype))
    specials = draw(st.sampled_from([0.0, 0.2, 1.0]))  # 1.0: every block empty
    pick = torch.rand(shape, generator=g)
    nonfinite = torch.tensor([math.nan, math.inf, -math.inf])[torch.randint(0, 3, shape, generator=g)].to(dtype)
    x = torch.where(pick < specials, nonfinite, x)
    if draw(st.integers(0, 3)) == 0:  # integers over [0, w]: many values whose exact position is a bin edge
        w = draw(st.integers(1, 1000))
        x = torch.where(torch.isfinite(x), torch.randint(0, w + 1, shape, generator=g).to(dtype), x)
        x.view(-1)[0], x.view(-1)[-1] = 0.0, float(w)
    lo, hi = block_min_max(x, block)
    widen = draw(st.sampled_from(["none", "edges", "wider"]))
    if widen == "wider":  # the running range of a wider earlier batch
        fmax = torch.finfo(torch.float32).max  # a running range is finite
        lo = torch.minimum(lo, (lo - lo.abs() * torch.rand(lo.shape, generator=g) * 3).clamp(min=-fmax))
        hi = torch.maximum(hi, (hi + hi.abs() * torch.rand(hi.shape, generator=g) * 3).clamp(max=fmax))
    elif widen == "edges":  # values on (or one rounding from) bin edges of a finite range
        lo, hi = lo.clamp(-1e30, 1e30), hi.clamp(-1e30, 1e30)
        k = torch.randint(0, bins + 1, shape, generator=g).double() / bins
        elo, ehi = expand_blocks(lo, shape, block).double(), expand_blocks(hi, shape, block).double()
        edges = (elo + k * (ehi - elo)).to(dtype)
        keep = (elo <= ehi) & torch.isfinite(x)
        x = torch.where(keep & (edges.double() >= elo) & (edges.double() <= ehi), edges, x)
        lo, hi = torch.minimum(lo, block_min_max(x, block)[0]), torch.maximum(hi, block_min_max(x, block)[1])
    return x, block, lo.float(), hi.float(), bins


@settings(max_examples=150, deadline=None)
@given(case=cases())
def test_the_compiled_binning_is_the_aten_float64_binning_bit_for_bit(case):
    x, block, lo, hi, bins = case
    # The range pass too: block_min_max's values (a minimum and a maximum do not round).
    assert all(torch.equal(a, b) for a, b in zip(block_finite_range(x, block), block_min_max(x, block)))
    counts, nonfinite = block_histogram(x, block, lo, hi, bins)
    ref_counts, ref_nonfinite = aten_binning(x, block, lo, hi, bins)
    assert counts.dtype == torch.float64 and counts.shape == (*reduced_shape(x.shape, block), bins)
    assert torch.equal(counts, ref_counts)
    assert nonfinite.dtype == torch.int64 and nonfinite.shape == ()
    assert nonfinite.item() == ref_nonfinite.item() == (~torch.isfinite(x)).sum().item()


@pytest.mark.parametrize("bins", [3, 7, 10, 100, 2048])
def test_every_integer_of_integer_ranges_bins_as_the_aten_binning(bins):
    # Row w holds 0, 1, ..., w over the range [0, w] (NaN after): (v - lo) / width * bins
    # is often an exact integer here, where a reciprocal or a fused multiply would
    # round to the bin below.
    n = 300
    v = torch.arange(n + 1, dtype=torch.float32).expand(n, -1)
    w = torch.arange(1, n + 1, dtype=torch.float32).unsqueeze(1)
    x = torch.where(v <= w, v, math.nan)
    lo, hi = torch.zeros(n, 1), w
    counts, nonfinite = block_histogram(x, (1, n + 1), lo, hi, bins)
    ref_counts, ref_nonfinite = aten_binning(x, (1, n + 1), lo, hi, bins)
    assert torch.equal(counts, ref_counts) and nonfinite.item() == ref_nonfinite.item()


def test_counts_by_hand_and_the_end_bins():
    # Over [-1, 3] in 4 bins: edges -1, 0, 1, 2, 3; 3.0 (= hi) in the last bin.
    x = torch.tensor([-1.0, -0.5, 0.0, 0.99, 1.0, 2.5, 3.0, math.nan, math.inf])
    counts, nonfinite = block_histogram(x, (9,), torch.tensor([-1.0]), torch.tensor([3.0]), 4)
    assert counts.tolist() == [[2.0, 2.0, 1.0, 2.0]] and nonfinite.item() == 2
    # A block that saw no finite value (the empty range +inf, -inf) counts nothing.
    counts, nonfinite = block_histogram(torch.full((2, 3), math.nan), (1, 3), torch.tensor([[0.0], [math.inf]]),
                                        torch.tensor([[0.0], [-math.inf]]), 2)
    assert counts.tolist() == [[[0.0, 0.0]], [[0.0, 0.0]]] and nonfinite.item() == 6


def test_a_range_with_lo_above_hi_bins_with_width_one_from_lo_on_both_paths():
    # hi <= lo: width 1 from lo = 1, 4 bins: bin floor((v - 1) * 4) clamped to [0, 3].
    # -2 .. 1.0 are at or below lo (bin 0), 1.5 at position 2, 2 at 4 -> 3; NaN in no bin.
    x = torch.tensor([-2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, math.nan])
    lo, hi = torch.tensor([1.0]), torch.tensor([-1.0])
    counts, nonfinite = block_histogram(x, (10,), lo, hi, 4)
    assert counts.tolist() == [[7.0, 0.0, 1.0, 1.0]] and nonfinite.item() == 1
    ref_counts, ref_nonfinite = aten_binning(x, (10,), lo, hi, 4)
    assert torch.equal(ref_counts, counts) and ref_nonfinite.item() == 1
    # A value below a finite lo <= hi is in bin 0 on both paths too; -Inf in no bin.
    x = torch.tensor([-5.0, 0.0, 3.0, -math.inf])
    lo, hi = torch.tensor([0.0]), torch.tensor([3.0])
    counts, _ = block_histogram(x, (4,), lo, hi, 3)
    assert counts.tolist() == [[2.0, 0.0, 1.0]]
    assert torch.equal(aten_binning(x, (4,), lo, hi, 3)[0], counts)


def test_many_threads_count_what_one_thread_counts():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 40000, generator=g)
    x[0, :7] = math.nan
    block = (8, 40000)
    lo, hi = block_min_max(x, block)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        many = block_histogram(x, block, lo, hi, 2048)
        torch.set_num_threads(1)
        one = block_histogram(x, block, lo, hi, 2048)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(many[0], one[0]) and many[1].item() == one[1].item() == 7
    assert torch.equal(one[0], aten_binning(x, block, lo, hi, 2048)[0])


def test_opcheck():
    x = torch.randn(4, 6)
    lo, hi = block_min_max(x, (1, 6))
    torch.library.opcheck(OP, (x, [1, 6], lo, hi, 16))
    torch.library.opcheck(RANGE_OP, (x, [1, 6]))


@pytest.mark.parametrize("args, error, message", [
    (dict(lo=torch.zeros(4, 1, dtype=torch.float64)), TypeError, "lo must be a torch.float32 tensor"),
    (dict(hi=torch.zeros(3)), ValueError, r"hi must have shape \(4, 1\)"),
    (dict(bins=0), ValueError, r"bins must be in \[1, 16777216\], got 0"),
    (dict(block_size=[1]), ValueError, "block_size"),
])
def test_bad_arguments_are_named(args, error, message):
    call = dict(x=torch.randn(4, 6), block_size=[1, 6], lo=torch.zeros(4, 1), hi=torch.ones(4, 1), bins=8)
    call.update(args)
    with pytest.raises(error, match=f"pt2e_fq.block_histogram: {message}"):
        block_histogram(**call)
    with pytest.raises((error, RuntimeError), match=f"pt2e_fq.block_histogram: {message}"):
        OP(*call.values())


def test_bad_arguments_of_the_range_pass_are_named():
    with pytest.raises(TypeError, match="pt2e_fq.block_finite_range: x must be float32, bfloat16 or float16"):
        block_finite_range(torch.zeros(3, dtype=torch.int32), [3])
    with pytest.raises(ValueError, match="pt2e_fq.block_finite_range: block_size"):
        block_finite_range(torch.zeros(3), [3, 1])


@pytest.mark.parametrize("granularity", [q.PerTensor(), q.PerChannel(1)])
def test_a_module_calibrates_the_same_on_the_compiled_and_the_aten_passes(granularity, monkeypatch):
    # Batches that widen the range (each re-bins the histogram), with NaN and Inf.
    g = torch.Generator().manual_seed(7)
    batches = [torch.randn(16, 3, 10, generator=g) * s + m for s, m in ((1, 0), (4, 1), (0.5, -2), (9, 3))]
    batches[1][0, 0, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    spec = q.QSpec(q.INT8, granularity, "asymmetric", observer=q.HistogramObserver(bins=256))

    def calibrate():
        fq = FakeQuantize(spec)
        outputs = [fq(b) for b in batches]
        return fq, outputs

    compiled, compiled_out = calibrate()
    monkeypatch.setattr(observers, "block_histogram", aten_binning)
    monkeypatch.setattr(observers, "block_finite_range", block_min_max)
    aten, aten_out = calibrate()
    for name in ("histogram", "min_val", "max_val", "scale", "zero_point"):
        assert torch.equal(getattr(compiled, name), getattr(aten, name)), name
    assert compiled.nonfinite_count == aten.nonfinite_count == 3
    for a, b in zip(compiled_out, aten_out):  # NaN in, NaN out
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
