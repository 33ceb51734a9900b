"""HistogramObserver on what calibration data can hold: batches with no
finite value, ranges as wide as fp32's, points with thousands of blocks;
and its `bins` bound.

References: a point that saw only the finite batches (what ignoring the
others means), histograms counted by hand, and an address-space limit
(RLIMIT_AS) in a fresh process for the memory bound."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import pt2e_fq as q
from pt2e_fq.cli import pipeline
from pt2e_fq.fake_quantize import FakeQuantize
from pt2e_fq.observers import MAX_HISTOGRAM_BINS, HistogramObserver
from quantizers import QuantizerConfig
from quantizers.qspec_dict import ConfigError

ROOT = Path(__file__).resolve().parents[2]
FMAX = torch.finfo(torch.float32).max


def _spec(granularity=q.PerTensor(), **observer) -> q.QSpec:
    return q.QSpec(q.INT8, granularity, "asymmetric", observer=HistogramObserver(**observer))


def _finite(seed=0, shape=(4, 32)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("granularity", [q.PerTensor(), q.PerChannel(0)], ids=["per_tensor", "per_channel"])
@pytest.mark.parametrize("first", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_batches_with_no_finite_value_are_ignored_and_counted(granularity, first):
    point, clean = FakeQuantize(_spec(granularity, bins=64)), FakeQuantize(_spec(granularity, bins=64))
    y = point(torch.full((4, 32), first))
    assert torch.equal(y.isnan(), torch.full((4, 32), math.isnan(first)))  # NaN stays NaN; +-Inf saturates
    for seed in (1, 2):
        point(_finite(seed))
        clean(_finite(seed))
    assert point.nonfinite_count == 4 * 32
    for name in ("scale", "zero_point", "min_val", "max_val", "histogram"):
        assert torch.equal(getattr(point, name), getattr(clean, name)), name


def test_the_w8a8_preset_calibrates_past_a_first_batch_of_nan():
    # A padded or masked first batch: NaN everywhere at the model's input.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    batches = [_finite(s, (8, 16)) for s in (1, 2)]
    prepared = pipeline.prepare(model, (batches[0],), "w8a8")
    clean = pipeline.prepare(model, (batches[0],), "w8a8")
    assert any(m.qspec.observer_or_default.keeps_histogram for m in prepared.modules() if isinstance(m, FakeQuantize))
    pipeline.calibrate(prepared, [torch.full((8, 16), math.nan), *batches], progress=False)
    pipeline.calibrate(clean, batches, progress=False)
    x = _finite(3, (8, 16))
    assert torch.equal(pipeline.convert(prepared)(x), pipeline.convert(clean)(x))


def test_a_range_as_wide_as_fp32_bins_by_hand():
    # Positions in float64: (0 - lo) / (hi - lo) * 4 = 2 exactly, where fp32
    # overflows hi - lo to Inf and every position to NaN.
    obs = HistogramObserver(bins=4)
    x = torch.tensor([-FMAX, -FMAX / 2, 0.0, FMAX])
    r = obs.observe(x, (4,), None, None)
    hist = obs.accumulate(x, (4,), None, r, None)
    assert hist.reshape(-1).tolist() == [1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("wide", [3e38, FMAX], ids=["3e38", "fp32_max"])
def test_a_range_as_wide_as_fp32_calibrates_as_min_max_does(wide):
    # MinMaxObserver takes such a range (its qparams are clamped to what the
    # op can represent); the histogram point must too, with finite qparams
    # that keep 0 and the values' order.
    x = torch.tensor([[-wide, -1.0, 0.0, 1.0, wide]] * 4)
    hist = FakeQuantize(_spec(bins=256))
    minmax = FakeQuantize(q.QSpec(q.INT8, q.PerTensor(), "asymmetric"))
    minmax(x)
    y = hist(x)
    assert torch.isfinite(hist.scale).all() and hist.scale.item() > 0
    assert torch.isfinite(minmax.scale).all()
    assert torch.isfinite(y).all() and y[0, 2] == 0 and y[0, 0] < 0 < y[0, 4]


def test_bins_are_at_most_65536():
    assert MAX_HISTOGRAM_BINS == 65536
    HistogramObserver(bins=65536)
    with pytest.raises(ValueError, match=r"^HistogramObserver: bins must be <= 65536 .*, got 1000000000$"):
        HistogramObserver(bins=10**9)


def test_a_config_with_too_many_bins_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^global.input_activation.observer: HistogramObserver: bins must be <= 65536"):
        QuantizerConfig.from_dict({"global": {"input_activation": {
            "format": "int8", "observer": {"type": "histogram", "bins": 10**9}}}})


# The memory bound: a 4096-channel point in a fresh process whose address
# space is capped at what it holds after a warm-up (libraries, thread
# pools, allocator state) plus 256 MiB + 16x the input's bytes. malloc's
# mmap threshold is fixed so that freed large blocks go back to the system
# (its sliding threshold would keep them in the heap and count them again).
_MEMORY_SCRIPT = textwrap.dedent("""
    import resource, sys
    import torch
    torch.set_num_threads(1)
    import pt2e_fq as q
    from pt2e_fq.observers import MAX_HISTOGRAM_BINS, HistogramObserver

    spec = q.QSpec(q.INT8, q.PerChannel(0), "asymmetric",
                   observer=HistogramObserver(bins=128, num_candidates=3, samples_per_bin=1))

    def calibrate(channels):
        point = q.FakeQuantize(spec)
        x = torch.randn(channels, 16, generator=torch.Generator().manual_seed(0))
        point(x)
        point(x * 2)  # a wider batch: the histogram is re-binned
        return x

    calibrate(4)  # every code path once
    x = torch.randn(4096, 16)
    with open("/proc/self/status") as f:
        used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    cap = used + 256 * 2**20 + 16 * x.numel() * x.element_size()
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    calibrate(4096)
    print("ok")
""")


def test_a_4096_channel_point_calibrates_within_256_mib_plus_16x_its_input():
    env = dict(os.environ, PYTHONPATH=str(ROOT), MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_groups_count_each_blocks_finite_values_as_histc_and_the_rest_as_nonfinite(dtype):
    # Groups of 7 along 20 values: the last group has 6 values and one NaN of
    # padding, which is neither binned nor counted as the input's. Values sit
    # at bin centres of each block's range (no value on an edge), so ATen's
    # histc over the block's finite values is the reference.
    bins, g = 16, torch.Generator().manual_seed(5)
    x = ((torch.randint(0, bins, (3, 20), generator=g).float() + 0.5) / bins * 4.0 - 2.0)
    x[:, [0, 7, 14]], x[:, [6, 13, 18]] = -2.0, 2.0  # every group's range is [-2, 2]
    x[0, 3], x[1, 15], x[2, 19] = math.nan, math.inf, -math.inf
    x = x.to(dtype)
    point = FakeQuantize(_spec(q.PerGroup(7, 1), bins=bins))
    point(x)
    assert point.nonfinite_count == 3
    hist = point.histogram.reshape(3, 3, bins)
    for r in range(3):
        for b in range(3):
            block = x[r, 7 * b:7 * b + 7].float()
            block = block[torch.isfinite(block)]
            assert torch.equal(hist[r, b], torch.histc(block, bins=bins, min=-2.0, max=2.0).double()), (r, b)
