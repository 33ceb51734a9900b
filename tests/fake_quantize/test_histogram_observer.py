"""HistogramObserver: its histogram against ATen's torch.histc and hand-made
data, its search against a brute-force search of the raw values with the
pure-torch reference, its state in the FakeQuantize module, and the
presets' QAT form (MinMaxObserver on those points)."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pt2e_fq as q
from pt2e_fq import reference
from pt2e_fq.fake_quantize import FakeQuantize
from quantizers import presets

INT8_ACT = q.QSpec(q.INT8, q.PerTensor(), "asymmetric", observer=q.HistogramObserver())


def _reference_rows(spec):
    """fake_quantize_rows for the search, by the pure-torch reference."""
    qmin, qmax = spec.quant_range

    def fq(values, lo, hi):
        p = spec.kind.qparams_from_range(spec, lo, hi)
        return reference.fake_quantize_affine(values, (1, values.shape[1]), p["scale"], p.get("zero_point"),
                                              qmin, qmax, p.get("minval"))[0]

    return fq


def _sq_error(spec, x, lo, hi):
    """The squared fake-quant error of all of x (the raw values) on [lo, hi]."""
    return ((_reference_rows(spec)(x.reshape(1, -1), lo.reshape(1, 1), hi.reshape(1, 1)) - x.reshape(1, -1)) ** 2
            ).sum().item()


# -- the histogram -------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), bins=st.sampled_from([8, 64, 2048]))
def test_one_batch_histogram_is_atens_histc(seed, bins):
    # Values at bin centres: no value sits on an edge, where two rounding
    # orders of (x - lo) / width * bins could disagree.
    g = torch.Generator().manual_seed(seed)
    centres = (torch.randint(0, bins, (1000,), generator=g).float() + 0.5) / bins * 8.0 - 3.0
    x = torch.cat([centres, torch.tensor([-3.0, 5.0])])  # the range [-3, 5]
    obs = q.HistogramObserver(bins=bins)
    lo, hi = obs.observe(x, (x.numel(),), None, None)
    hist = obs.accumulate(x, (x.numel(),), None, (lo, hi), None)
    expected = torch.histc(x, bins=bins, min=-3.0, max=5.0).double()
    assert torch.equal(hist.reshape(-1), expected)


def test_a_wider_batch_rebins_the_histogram_by_bin_centre():
    # Batch 1 fills [0, 1), batch 2 widens the range to [0, 2): each old bin
    # k (centre (k + 0.5) / B) moves to new bin k // 2, exactly the histogram
    # of batch 1 over the new range.
    bins = 16
    obs = q.HistogramObserver(bins=bins)
    first = (torch.arange(bins).float() + 0.5) / bins
    first = torch.cat([first, torch.tensor([0.0, 1.0])]).repeat(3)
    second = torch.tensor([0.1, 1.9, 2.0])
    bs = (first.numel(),)
    r1 = obs.observe(first, bs, None, None)
    h1 = obs.accumulate(first, bs, None, r1, None)
    r2 = obs.observe(second, (3,), r1, None)
    h2 = obs.accumulate(second, (3,), r1, r2, h1)
    assert [v.item() for v in r2] == [0.0, 2.0]
    # Batch 1 over [0, 1]: 3 per bin, 6 in bins 0 and 15 (0.0 and 1.0 there).
    old = torch.full((bins,), 3.0, dtype=torch.float64)
    old[0] = old[-1] = 6.0
    assert torch.equal(h1.reshape(-1), old)
    expected = old.view(bins // 2, 2).sum(1)  # old bins 2j and 2j + 1 -> new bin j
    expected = torch.cat([expected, torch.zeros(bins // 2, dtype=torch.float64)])
    expected += torch.histc(second, bins=bins, min=0.0, max=2.0).double()  # 0.1 -> bin 0; 1.9, 2.0 -> bin 15
    assert torch.equal(h2.reshape(-1), expected)
    assert h2.sum().item() == first.numel() + 3


def test_non_finite_values_are_not_counted_and_blocks_are_separate():
    x = torch.tensor([[1.0, float("nan"), 2.0, float("inf")], [-1.0, -1.0, 3.0, -float("inf")]])
    obs = q.HistogramObserver(bins=4)
    bs = q.PerChannel(0).block_size(x.shape)
    r = obs.observe(x, bs, None, None)
    hist = obs.accumulate(x, bs, None, r, None)
    assert hist.shape == (2, 1, 4)
    assert hist.sum(-1).reshape(-1).tolist() == [2.0, 3.0]
    assert hist[0, 0].tolist() == [1.0, 0.0, 0.0, 1.0]  # 1 and 2 over [1, 2]
    assert hist[1, 0].tolist() == [2.0, 0.0, 0.0, 1.0]  # -1, -1, 3 over [-1, 3]


# -- the search ----------------------------------------------------------------


def _brute_force(spec, x, fractions):
    """The (lo, hi) of the smallest squared error of the raw values over
    lo * a, hi * b for every pair of fractions, by the reference."""
    lo, hi = x.min(), x.max()
    return min(((lo * a, hi * b) for a in fractions for b in fractions), key=lambda r: _sq_error(spec, x, *r))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), tail=st.floats(4.0, 40.0), outliers=st.integers(1, 40))
def test_search_is_as_good_as_a_brute_force_search_of_the_raw_values(seed, tail, outliers):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(20000, generator=g)
    x[:outliers] = torch.rand(outliers, generator=g) * tail  # a one-sided tail
    spec = INT8_ACT
    obs = spec.observer
    lo, hi = obs.observe(x, (x.numel(),), None, None)
    hist = obs.accumulate(x, (x.numel(),), None, (lo, hi), None)
    got = obs.search(hist, lo, hi, _reference_rows(spec))
    fractions = [1.0 - k * 0.8 / 48 for k in range(49)]  # twice as fine as the observer's
    best = _brute_force(spec, x, fractions)
    minmax = _sq_error(spec, x, lo, hi)
    # The histogram's error estimate is not the raw values' error: within 3 %
    # of the best on the raw values, and never worse than the min-max range.
    assert _sq_error(spec, x, *got) <= 1.03 * _sq_error(spec, x, *best)
    assert _sq_error(spec, x, *got) <= minmax


def test_a_one_sided_tail_is_clipped_on_its_side_only():
    # 500k values dense on [-4, 0] and one at 10. Clipping hi to h costs
    # (10 - h)**2 and saves rounding error ((4 + h) / 255)**2 / 12 per value:
    # the sum is smallest at h = 4.5; clipping lo only adds error.
    g = torch.Generator().manual_seed(3)
    x = -4.0 * torch.rand(500000, generator=g)
    x[0], x[1] = 10.0, -4.0
    obs = INT8_ACT.observer
    lo, hi = obs.observe(x, (x.numel(),), None, None)
    hist = obs.accumulate(x, (x.numel(),), None, (lo, hi), None)
    got_lo, got_hi = obs.search(hist, lo, hi, _reference_rows(INT8_ACT))
    assert got_lo.item() == -4.0
    assert 3.5 < got_hi.item() < 5.5


def test_an_outlier_that_costs_more_clipped_than_kept_stays_in_range():
    # One value at 60 among 4095 normals: clipping it to 12 costs 48**2 =
    # 2304, more than the rounding error it saves over 4095 values (about 21).
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g)
    x[0] = 60.0
    obs = INT8_ACT.observer
    lo, hi = obs.observe(x, (x.numel(),), None, None)
    hist = obs.accumulate(x, (x.numel(),), None, (lo, hi), None)
    assert obs.search(hist, lo, hi, _reference_rows(INT8_ACT))[1].item() >= 0.9 * 60.0


def test_histogram_observer_arguments_are_checked():
    for kwargs, message in [({"bins": 0}, "bins must be an int >= 1"),
                            ({"num_candidates": 1.5}, "num_candidates must be an int >= 1"),
                            ({"samples_per_bin": True}, "samples_per_bin must be an int >= 1"),
                            ({"min_fraction": 0.0}, r"min_fraction must be in \(0, 1\]")]:
        with pytest.raises(ValueError, match=message):
            q.HistogramObserver(**kwargs)
    with pytest.raises(ValueError, match="observer must be None or CurrentMinMaxObserver"):
        q.QSpec(q.INT8, q.PerTensor(), dynamic=True, observer=q.HistogramObserver())


# -- in the module -------------------------------------------------------------


def test_the_module_keeps_the_histogram_over_batches_and_drops_it_at_convert_like_the_range():
    g = torch.Generator().manual_seed(5)
    batches = [torch.randn(64, 32, generator=g) * (1 + i) for i in range(3)]
    batches[1][0, 0] = 25.0
    fq = FakeQuantize(INT8_ACT)
    for b in batches:
        fq(b)
    data = torch.cat([b.reshape(-1) for b in batches])
    assert fq.histogram.dtype == torch.float64 and fq.histogram.sum().item() == data.numel()
    assert (fq.min_val.item(), fq.max_val.item()) == (data.min().item(), data.max().item())
    # The qparams are those of a range at least as good as min-max on all the data.
    p = fq.calculate_qparams()
    qmin, qmax = INT8_ACT.quant_range
    y = reference.fake_quantize_affine(data, (data.numel(),), p["scale"].reshape(1), p["zero_point"].reshape(1),
                                       qmin, qmax)[0]
    assert ((y - data) ** 2).sum().item() <= _sq_error(INT8_ACT, data, data.min(), data.max())
    assert "histogram" in fq.state_dict()
    restored = FakeQuantize(INT8_ACT)
    restored.load_state_dict(fq.state_dict())
    assert torch.equal(restored.histogram, fq.histogram)


def test_presets_calibrate_with_the_histogram_and_train_with_min_max():
    for name in ("w8a8", "w4a8"):
        act = presets.get_preset(name).global_config.input_activation
        assert isinstance(act.observer, q.HistogramObserver)
        qat = presets.get_preset(name, qat=True)
        assert type(qat.global_config.input_activation.observer_or_default) is q.MinMaxObserver
        assert qat.global_config.weight == presets.get_preset(name).global_config.weight
        assert isinstance(presets.every_point(name).global_config.output_activation.observer, q.HistogramObserver)
        assert presets.every_point(name, qat=True).global_config.output_activation.observer is None


def test_qat_prepare_takes_the_presets_qat_form_and_warns_on_a_histogram_config():
    from pt2e_fq.cli import pipeline

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    x = torch.randn(4, 8)

    def observers(prepared):
        return {type(m._observer).__name__ for m in prepared.modules()
                if isinstance(m, FakeQuantize) and not m.qspec.dynamic and m._observer.keeps_range}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qat = pipeline.prepare(model, (x,), "w8a8", qat=True)
    assert not [w for w in caught if "HistogramObserver" in str(w.message)]
    assert observers(qat) == {"MinMaxObserver"}
    assert observers(pipeline.prepare(model, (x,), "w8a8")) == {"HistogramObserver"}
    with pytest.warns(UserWarning, match=r"2 point\(s\) calibrate with HistogramObserver"):
        pipeline.prepare(model, (x,), presets.get_preset("w8a8"), qat=True)
