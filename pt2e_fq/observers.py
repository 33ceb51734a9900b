"""Observers: the per-block range [lo, hi] a fake-quant point quantizes to.

An observer is a small frozen config with one method, `observe`. It reduces
over the blocks of the point's granularity (ops/blocks.py: reduce_blocks), so every
observer works with every granularity, and uses tensor ops only: no
`.item()`, no branch on a tensor value, no host sync. The FakeQuantize module
owns the state (the running range of MinMax and MovingAverageMinMax, in its
`min_val` / `max_val` buffers) and turns the range into qparams (qparams.py).

Non-finite values (NaN, +-Inf) are ignored: one NaN would otherwise make a
block's min and max NaN, and a running range, once NaN, stays NaN for every
later clean batch. A block with no finite value gives the empty range
(+inf, -inf), the reductions' identities, which leaves a running range as it
was; format_kinds turns an empty range into the qparams of [0, 0]. The
module counts the values ignored (`FakeQuantize.nonfinite_count`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional, Sequence

import torch

from .ops.blocks import block_min_max, blocked, reduce_blocks
from .ops.histogram import block_finite_range, block_histogram

Range = tuple[torch.Tensor, torch.Tensor]
# (lo, hi) -> x fake-quantized with the qparams of that range.
FakeQuantizeFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# A batch's per-block range -> the range over every rank's batch
# (_observer_sync.all_reduce_range, bound to a process group).
ReduceRangeFn = Callable[[torch.Tensor, torch.Tensor], Range]


def is_empty(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Per block: True where the range holds no finite value (lo > hi)."""
    return lo > hi


def _check_count(observer, name: str) -> None:
    v = getattr(observer, name)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{type(observer).__name__}: {name} must be an int >= 1, got {v!r}")


def _check_fraction(observer, name: str) -> None:
    v = getattr(observer, name)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 1:
        raise ValueError(f"{type(observer).__name__}: {name} must be in (0, 1], got {v!r}")


class Observer:
    """Base class. `keeps_range`: the module keeps the running range between
    calls, and in a distributed run the batch's range is reduced over the
    ranks before the update (the `reduce_range` of `observe`). `dynamic`:
    the observer computes qparams from the live tensor, for dynamic points."""

    keeps_range: ClassVar[bool] = False
    # The module also keeps a histogram per block over the running range
    # (HistogramObserver: `accumulate` and `search`).
    keeps_histogram: ClassVar[bool] = False
    dynamic: ClassVar[bool] = False
    # Whether the fused observe ops (ops/observe.py) reproduce `observe`
    # (with `fused_averaging_constant`): a subclass with an update of its
    # own stays on the unfused path.
    fusable: ClassVar[bool] = False

    def observe(
        self,
        x: torch.Tensor,
        block_size: Sequence[int],
        running: Optional[Range],
        fake_quantize: FakeQuantizeFn,
    ) -> Range:
        raise NotImplementedError

    def fused_averaging_constant(self) -> Optional[float]:
        """The `averaging_constant` argument with which the fused observe ops
        compute this observer's range bit for bit: None for the running
        min / max (from an empty range for an observer that keeps none).
        Only observers with `fusable` True have one."""
        raise NotImplementedError


class RangeObserver(Observer):
    """An observer that updates a running range with each batch's per-block
    min / max (`update`). With `reduce_range` the batch's range is first
    reduced over the ranks of a distributed run, so the update sees the
    range of all the ranks' batches. An empty x with a running range is a
    batch of empty blocks (a rank with no data still joins the reduction)."""

    keeps_range: ClassVar[bool] = True

    def observe(self, x, block_size, running, fake_quantize, reduce_range: Optional[ReduceRangeFn] = None):
        if x.numel() == 0 and running is not None:
            batch = torch.full_like(running[0], math.inf), torch.full_like(running[1], -math.inf)
        else:
            batch = self._batch_range(x, block_size)
        if reduce_range is not None:
            batch = reduce_range(*batch)
        return batch if running is None else self.update(running, batch)

    def _batch_range(self, x: torch.Tensor, block_size: Sequence[int]) -> Range:
        """The fp32 min / max of each block's finite values (ops/blocks.py:
        block_min_max)."""
        return block_min_max(x, block_size)

    def update(self, running: Range, batch: Range) -> Range:
        raise NotImplementedError


@dataclass(frozen=True)
class MinMaxObserver(RangeObserver):
    """The running minimum and maximum over every batch seen (calibration)."""

    def update(self, running, batch):
        return torch.minimum(running[0], batch[0]), torch.maximum(running[1], batch[1])

    fusable: ClassVar[bool] = True

    def fused_averaging_constant(self):
        return None


@dataclass(frozen=True)
class MovingAverageMinMaxObserver(RangeObserver):
    """An exponential moving average of each batch's min and max (QAT):
    running += averaging_constant * (batch - running) (in an order that
    cannot overflow where batch - running would); the first batch with a
    finite value in a block sets that block, and a batch with none in a block
    leaves it (averaging with its empty range's infinities would make it
    Inf or NaN for good).

    Args:
        averaging_constant: the weight of each batch, in (0, 1].

    Raises:
        ValueError: averaging_constant outside (0, 1].
    """

    averaging_constant: float = 0.01

    def __post_init__(self):
        _check_fraction(self, "averaging_constant")

    def update(self, running, batch):
        lo, hi = batch
        c = self.averaging_constant
        seen, fresh = ~is_empty(lo, hi), is_empty(*running)

        def update(old, new):
            # new - old overflows fp32 only where the two have opposite signs
            # near its limit: then (old - c * old) + c * new, which cannot
            # (csrc/include/pt2e_fq/observe.h moving_average, the fused ops' rounding).
            d = new - old
            average = torch.where(d.abs() <= torch.finfo(d.dtype).max, old + c * d, (old - c * old) + c * new)
            return torch.where(seen, torch.where(fresh, new, average), old)

        return update(running[0], lo), update(running[1], hi)

    fusable: ClassVar[bool] = True

    def fused_averaging_constant(self):
        return self.averaging_constant


@dataclass(frozen=True)
class MSEObserver(Observer):
    """Searches the clipping range that minimises the fake-quant error, per
    block: candidates [lo, hi] * f for `num_candidates` fractions f evenly
    from 1 down to `min_fraction` (clipping toward 0); the smallest sum of
    squared errors wins, the widest range on a tie. Non-finite elements
    count no error (their own error is NaN or Inf whatever the range). It
    looks at the current tensor only, which is right for weights; one fused
    op call per candidate.

    Args:
        num_candidates: how many clipping fractions are tried, >= 1.
        min_fraction: the smallest fraction of the range tried, in (0, 1].

    Raises:
        ValueError: num_candidates < 1 or min_fraction outside (0, 1].
    """

    num_candidates: int = 100
    min_fraction: float = 0.2

    def __post_init__(self):
        _check_count(self, "num_candidates")
        _check_fraction(self, "min_fraction")

    def fractions(self) -> list[float]:
        n = self.num_candidates
        step = (1.0 - self.min_fraction) / max(n - 1, 1)
        return [1.0 - k * step for k in range(n)]

    def observe(self, x, block_size, running, fake_quantize):
        lo, hi = block_min_max(x, block_size)
        xf = x.float()
        finite = torch.isfinite(xf)
        best_lo, best_hi, best_err = lo, hi, None
        for f in self.fractions():
            c_lo, c_hi = lo * f, hi * f
            sq = torch.where(finite, (fake_quantize(c_lo, c_hi).float() - xf).square(), 0.0)
            err = reduce_blocks(sq, block_size, torch.sum, 0.0)
            if best_err is None:
                best_err, best_lo, best_hi = err, c_lo, c_hi
                continue
            better = err < best_err  # strict: a tie keeps the wider range
            best_err = torch.where(better, err, best_err)
            best_lo = torch.where(better, c_lo, best_lo)
            best_hi = torch.where(better, c_hi, best_hi)
        return best_lo, best_hi


# HistogramObserver's work per pass, in values: every temporary it makes
# is a few times this many bytes, whatever the number of blocks. Binning
# makes about 40 bytes of temporaries per value, the search about 12.
_BIN_CHUNK = 1 << 19
_SEARCH_CHUNK = 1 << 21
# The most bins: the histogram is bins float64 per block, 512 KiB at this.
MAX_HISTOGRAM_BINS = 65536


def _blocks_as_rows(x: torch.Tensor, block_size: Sequence[int]) -> torch.Tensor:
    """x as (blocks, block elements), blocks in the reduced shape's order; a
    ragged last block is padded with NaN, which the histogram ignores."""
    n = x.dim()
    rows = blocked(x, block_size, math.nan)
    return rows.permute(*range(0, 2 * n, 2), *range(1, 2 * n, 2)).reshape(math.prod(rows.shape[0::2]), -1)


@dataclass(frozen=True)
class HistogramObserver(RangeObserver):
    """Calibration of static activations that clips outliers: the running
    range is every batch's min / max (as MinMaxObserver), and the module
    keeps a histogram of every value seen, `bins` bins per block over that
    range (re-binned by bin centre when a batch widens it). The qparams come
    from the range that minimises the histogram's expected squared
    fake-quant error: lo and hi scaled toward 0 independently (a skewed
    activation, one long tail, wants only that side clipped) by fractions
    from 1 down to `min_fraction`, `num_candidates` steps each way (a grid
    of a third of them, then one as fine around its best); every bin is
    sampled at `samples_per_bin` evenly spaced points, fake-quantized by
    the point's own op, so the error is the format's, integer or float.
    Ties keep the earlier candidate, the wider range first. The search
    fake-quantizes about ((num_candidates / 3)**2 + 49) * bins *
    samples_per_bin values per block and batch: meant for per-tensor
    activations in calibration (QAT steps keep a MinMax range: presets.py).

    Bin positions and sample points are computed in float64, so a range
    as wide as fp32's (values near +-3e38) bins as any other, and a block
    that has seen no finite value keeps an empty histogram. The work goes
    in passes of a bounded number of values (_BIN_CHUNK, _SEARCH_CHUNK), so the
    memory beside the histogram (bins float64 per block) and a copy of x
    stays the same whatever the number of blocks. `bins` is at most
    MAX_HISTOGRAM_BINS.

    Args:
        bins: histogram bins per block, at most MAX_HISTOGRAM_BINS.
        num_candidates: clipping fractions tried each way.
        min_fraction: the smallest fraction of the range tried, in (0, 1].
        samples_per_bin: points per bin fake-quantized to measure the error.

    Raises:
        ValueError: a count < 1, more than MAX_HISTOGRAM_BINS bins, or min_fraction outside (0, 1].
    """

    bins: int = 2048
    num_candidates: int = 24
    min_fraction: float = 0.2
    samples_per_bin: int = 2

    keeps_histogram: ClassVar[bool] = True

    def __post_init__(self):
        for name in ("bins", "num_candidates", "samples_per_bin"):
            _check_count(self, name)
        if self.bins > MAX_HISTOGRAM_BINS:
            raise ValueError(f"HistogramObserver: bins must be <= {MAX_HISTOGRAM_BINS} (the histogram is bins "
                             f"float64 per block), got {self.bins}")
        _check_fraction(self, "min_fraction")

    update = MinMaxObserver.update  # the running range is MinMax's

    def _batch_range(self, x, block_size):
        """block_min_max, on the CPU in one compiled pass (the same values:
        a minimum and a maximum do not round)."""
        if x.device.type == "cpu":
            return block_finite_range(x, block_size)
        return block_min_max(x, block_size)

    def _bin_of(self, values: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """The bin of each value in [lo, hi] (broadcast), in float64, clamped
        to the ends; every value of an empty or one-point range, and every
        non-finite position, is in bin 0 (the caller counts such values 0)."""
        lo, hi = lo.double(), hi.double()
        width = hi - lo
        pos = (values.double() - lo) / torch.where(width > 0, width, 1.0) * self.bins
        return pos.nan_to_num_(0.0).floor_().clamp_(0, self.bins - 1).long()

    def _count(self, flat: torch.Tensor, per_row: int, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """The binning in ATen ops, off the CPU (on the CPU the compiled
        op ops.histogram.block_histogram, which this defines bit for bit):
        the bin counts (float64, rows * (bins + 1)) of `flat`, `per_row`
        values per row (block), binned over its row's [lo, hi] as _bin_of
        bins them; column 0 of a row counts its non-finite values, column
        1 + b its bin b. Written for few passes over the values: a value of
        a row's running range is at position (v - lo) / width * bins in
        [0, bins] (v - lo and width are exact in float64), so a position of
        bins needs the clamp to bins - 1, one below 0 (a range that does not
        hold the values) the clamp to 0, and a non-finite value is the one
        with a non-finite position."""
        rows = lo.numel()
        counts = torch.zeros(rows * (self.bins + 1), dtype=torch.float64, device=lo.device)
        lo, hi = lo.double(), hi.double()
        width = hi - lo
        width = torch.where(width > 0, width, 1.0)
        one = torch.ones((), dtype=torch.float64, device=lo.device)
        per_tensor = rows == 1
        for start in range(0, flat.numel(), _BIN_CHUNK):
            v = flat[start:start + _BIN_CHUNK]
            if per_tensor:
                row_lo, row_width = lo, width
            else:
                row = torch.arange(start, start + v.numel(), device=v.device) // per_row
                row_lo, row_width = lo[row], width[row]
            # row_lo is float64 and one-dimensional: the subtraction runs in float64, as v.double() - row_lo.
            pos = torch.sub(v, row_lo).div_(row_width).mul_(self.bins)
            # A finite value below lo (only where the given range does not
            # hold the row's values, e.g. lo > hi) is in bin 0, as in the op;
            # pos * 0 is 0 there and NaN for -inf, which stays in no bin.
            pos = torch.where(pos < 0, pos * 0, pos)
            # An empty row's range is (+inf, -inf): every value of it is non-finite, its position NaN or
            # +-inf. Truncation is floor on positions >= 0.
            index = pos.nan_to_num_(-1.0, -1.0, -1.0).clamp_(max=self.bins - 1).long().add_(1)
            if not per_tensor:
                index = index.add_(row * (self.bins + 1))
            counts.scatter_add_(0, index, one.expand(v.numel()))
        return counts

    def accumulate(self, x: torch.Tensor, block_size: Sequence[int], old: Optional[Range], new: Range,
                   histogram: Optional[torch.Tensor], reduce_sum: Optional[Callable] = None,
                   nonfinite: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The histogram (float64, reduced shape + (bins,)) over the range
        `new` of the values so far: `histogram` (over `old`, None before the
        first batch) re-binned, plus x's finite values (counted over every
        rank with `reduce_sum`, an all-reduce SUM: the ranges are already
        the same on every rank). `nonfinite`, an int64 counter, is added x's
        count of NaN and +-Inf values (this rank's), which the binning
        counts anyway."""
        lo, hi = new[0].reshape(-1), new[1].reshape(-1)
        blocks = lo.numel()
        if x.numel() > 0 and x.device.type == "cpu":
            # One pass over x in the compiled op, which computes _count's bins bit for bit.
            counts, bad = block_histogram(x, block_size, new[0], new[1], self.bins)
            if nonfinite is not None:
                nonfinite.add_(bad)
            counts = counts.view(-1)
        elif x.numel() > 0:
            # Elsewhere (CUDA) ATen's ops bin: a few kernels, no host sync. A CUDA kernel
            # of its own would add float64 atomics on one histogram per block (all of a
            # per-tensor point's values on `bins` counters) and needs a GPU to be measured.
            rows = _blocks_as_rows(x, block_size)
            counts = self._count(rows.reshape(-1), rows.shape[1], lo, hi).view(blocks, self.bins + 1)
            if nonfinite is not None:  # less the NaN padding of a ragged last block
                nonfinite.add_(counts[:, 0].sum().long() - (rows.numel() - x.numel()))
            counts = counts[:, 1:].contiguous().view(-1)
        else:
            counts = torch.zeros(blocks * self.bins, dtype=torch.float64, device=lo.device)
        if reduce_sum is not None:
            counts = reduce_sum(counts)
        counts = counts.view(blocks, self.bins)
        if histogram is not None and histogram.numel() > 0:
            old_lo, old_hi = old[0].reshape(-1, 1).double(), old[1].reshape(-1, 1).double()
            old_counts = histogram.reshape(blocks, self.bins)
            step = max(1, _BIN_CHUNK // self.bins)
            centre = (torch.arange(self.bins, device=lo.device, dtype=torch.float64) + 0.5) / self.bins
            for start in range(0, blocks, step):
                b = slice(start, start + step)
                centres = old_lo[b] + centre * (old_hi[b] - old_lo[b])  # NaN for an empty old range: bin 0, count 0
                moved = self._bin_of(centres, lo[b].unsqueeze(-1), hi[b].unsqueeze(-1))
                counts[b].scatter_add_(-1, moved, old_counts[b])
        return counts.view(*new[0].shape, self.bins)

    def search(self, histogram: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
               fake_quantize_rows: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> Range:
        """Per block, the candidate range with the smallest expected squared
        error over the histogram. `fake_quantize_rows(values, lo, hi)`
        fake-quantizes each row of `values` with the qparams of that row's
        range (lo, hi: one per row). Two passes: a coarse grid of fractions
        for lo and hi, then a grid a third as fine around the coarse best.
        Blocks go in groups of at most _SEARCH_CHUNK sample points."""
        shape, s, n = lo.shape, self.samples_per_bin, self.num_candidates
        lo, hi = lo.reshape(-1, 1), hi.reshape(-1, 1)
        empty = lo > hi  # a block that saw no finite value keeps its empty range
        # Sample an empty block over [0, 0]: its weights are all 0, and its result is replaced.
        lo_s, hi_s = torch.where(empty, 0.0, lo).double(), torch.where(empty, 0.0, hi).double()
        histogram = histogram.reshape(-1, self.bins)
        m = self.bins * s
        offsets = (torch.arange(m, device=lo.device, dtype=torch.float64) + 0.5) / m
        coarse = (n + 2) // 3
        step = (1.0 - self.min_fraction) / max(coarse - 1, 1)
        grid = (torch.arange(coarse, device=lo.device) * -step + 1.0).view(1, -1)  # 1 .. min_fraction
        fine = torch.arange(-3, 4, device=lo.device).view(1, -1) * (step / 3)  # around the coarse best
        # Errors are measured in units of a power of two near each block's
        # largest |value| (an exact rescaling: the same comparisons as
        # unscaled), so a range as wide as fp32's does not overflow them.
        amax = torch.maximum(lo_s.abs(), hi_s.abs())
        unit = torch.ldexp(torch.ones_like(amax), -torch.frexp(amax)[1].clamp(min=-126)).float()
        chosen_lo, chosen_hi = torch.empty_like(lo), torch.empty_like(hi)
        group = max(1, _SEARCH_CHUNK // m)
        for start in range(0, lo.shape[0], group):
            b = slice(start, start + group)
            values = (lo_s[b] + offsets * (hi_s[b] - lo_s[b])).float()  # (blocks, bins * s): the bins' sample points
            weights = histogram[b].float().repeat_interleave(s, dim=1).unsqueeze(-1)  # (blocks, bins * s, 1)
            args = (values, weights, unit[b], lo[b], hi[b])
            best_a, best_b = self._best(*args, grid, grid, fake_quantize_rows)
            around = lambda f: (f + fine).clamp(self.min_fraction, 1.0)  # noqa: E731
            best_a, best_b = self._best(*args, around(best_a), around(best_b), fake_quantize_rows)
            chosen_lo[b], chosen_hi[b] = lo[b] * best_a, hi[b] * best_b
        return (torch.where(empty, lo, chosen_lo).view(shape), torch.where(empty, hi, chosen_hi).view(shape))

    @staticmethod
    def _best(values, weights, unit, lo, hi, fa, fb, fake_quantize_rows):
        """The fractions (a, b), one pair per block from fa x fb (each
        (blocks or 1, k)), whose range [lo * a, hi * b] gives the smallest
        weighted squared error (the error times `unit`, a power of two per
        block); the first in order on a tie. At most _SEARCH_CHUNK values
        per op call."""
        blocks, m = values.shape
        a = fa.expand(blocks, -1).unsqueeze(2).expand(-1, -1, fb.shape[1]).reshape(blocks, -1)
        b = fb.expand(blocks, -1).unsqueeze(1).expand(-1, fa.shape[1], -1).reshape(blocks, -1)
        k = a.shape[1]
        err = torch.empty(blocks, k, device=values.device)
        scaled = (values * unit).unsqueeze(1)  # exact: unit is a power of two
        unit = unit.unsqueeze(-1)
        rows = max(1, _SEARCH_CHUNK // (blocks * m))
        for start in range(0, k, rows):
            stop = min(k, start + rows)
            v = values.unsqueeze(1).expand(-1, stop - start, -1).reshape(-1, m)
            q = fake_quantize_rows(v, (lo * a[:, start:stop]).reshape(-1, 1), (hi * b[:, start:stop]).reshape(-1, 1))
            sq = q.float().view(blocks, stop - start, m).mul_(unit).sub_(scaled).square_()
            err[:, start:stop] = torch.bmm(sq, weights).squeeze(-1)
        best = err.argmin(dim=1, keepdim=True)  # the first minimum
        return a.gather(1, best), b.gather(1, best)


@dataclass(frozen=True)
class CurrentMinMaxObserver(Observer):
    """The live tensor's min and max at every call: current scaling for
    dynamic points (per-tensor, per-token or any granularity); on a static
    point it tracks the latest batch (e.g. a weight during QAT)."""

    dynamic: ClassVar[bool] = True

    # The batch's range is the running min / max started from the empty
    # range (+inf, -inf): minimum(+inf, lo) is lo, bit for bit.
    fusable: ClassVar[bool] = True

    def fused_averaging_constant(self):
        return None

    def observe(self, x, block_size, running, fake_quantize):
        return block_min_max(x, block_size)


OBSERVERS = (MinMaxObserver, MovingAverageMinMaxObserver, HistogramObserver, MSEObserver, CurrentMinMaxObserver)
