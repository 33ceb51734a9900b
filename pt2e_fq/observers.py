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

from .ops.blocks import block_min_max, expand_blocks, reduce_blocks

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
            batch = block_min_max(x, block_size)
        if reduce_range is not None:
            batch = reduce_range(*batch)
        return batch if running is None else self.update(running, batch)

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
    running += averaging_constant * (batch - running); the first batch with a
    finite value in a block sets that block, and a batch with none in a block
    leaves it (averaging with its empty range's infinities would make it
    Inf or NaN for good)."""

    averaging_constant: float = 0.01

    def __post_init__(self):
        _check_fraction(self, "averaging_constant")

    def update(self, running, batch):
        lo, hi = batch
        c = self.averaging_constant
        seen, fresh = ~is_empty(lo, hi), is_empty(*running)

        def update(old, new):
            return torch.where(seen, torch.where(fresh, new, old + c * (new - old)), old)

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
    op call per candidate."""

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
    activations in calibration (QAT steps keep a MinMax range: presets.py)."""

    bins: int = 2048
    num_candidates: int = 24
    min_fraction: float = 0.2
    samples_per_bin: int = 2

    keeps_histogram: ClassVar[bool] = True

    def __post_init__(self):
        for name in ("bins", "num_candidates", "samples_per_bin"):
            _check_count(self, name)
        _check_fraction(self, "min_fraction")

    update = MinMaxObserver.update  # the running range is MinMax's

    def _bin_of(self, values: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """The bin of each value in [lo, hi] (broadcast), clamped to the ends;
        every value of an empty or one-point range is in bin 0."""
        width = hi - lo
        pos = (values - lo) / torch.where(width > 0, width, 1.0) * self.bins
        return pos.floor().clamp(0, self.bins - 1).long()

    def accumulate(self, x: torch.Tensor, block_size: Sequence[int], old: Optional[Range], new: Range,
                   histogram: Optional[torch.Tensor], reduce_sum: Optional[Callable] = None) -> torch.Tensor:
        """The histogram (float64, reduced shape + (bins,)) over the range
        `new` of the values so far: `histogram` (over `old`, None before the
        first batch) re-binned, plus x's finite values (counted over every
        rank with `reduce_sum`, an all-reduce SUM: the ranges are already
        the same on every rank)."""
        lo, hi = new
        blocks = lo.numel()
        xf = x.float()
        finite = torch.isfinite(xf)
        lo_x = expand_blocks(lo, x.shape, block_size)
        ids = expand_blocks(torch.arange(blocks, device=x.device).reshape(lo.shape), x.shape, block_size)
        # A non-finite value counts 0 (its bin would be NaN): it is binned at lo.
        index = ids * self.bins + self._bin_of(torch.where(finite, xf, lo_x), lo_x,
                                               expand_blocks(hi, x.shape, block_size))
        counts = torch.zeros(blocks * self.bins, dtype=torch.float64, device=x.device)
        counts.scatter_add_(0, index.reshape(-1), finite.reshape(-1).double())
        if reduce_sum is not None:
            counts = reduce_sum(counts)
        counts = counts.view(*lo.shape, self.bins)
        if histogram is None or histogram.numel() == 0:
            return counts
        olo, ohi = old[0].unsqueeze(-1), old[1].unsqueeze(-1)
        centres = olo + (torch.arange(self.bins, device=x.device) + 0.5) * ((ohi - olo) / self.bins)
        moved = self._bin_of(centres, lo.unsqueeze(-1), hi.unsqueeze(-1))
        return counts.scatter_add_(-1, moved, histogram)

    def search(self, histogram: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
               fake_quantize_rows: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> Range:
        """Per block, the candidate range with the smallest expected squared
        error over the histogram. `fake_quantize_rows(values, lo, hi)`
        fake-quantizes each row of `values` with the qparams of that row's
        range (lo, hi: one per row). Two passes: a coarse grid of fractions
        for lo and hi, then a grid a third as fine around the coarse best."""
        shape, s, n = lo.shape, self.samples_per_bin, self.num_candidates
        lo, hi = lo.reshape(-1, 1), hi.reshape(-1, 1)
        counts = histogram.reshape(-1, self.bins).float()
        offsets = (torch.arange(self.bins * s, device=lo.device) + 0.5) / (self.bins * s)
        values = lo + offsets * (hi - lo)  # (blocks, bins * s): the bins' sample points
        weights = counts.repeat_interleave(s, dim=1).unsqueeze(-1)  # (blocks, bins * s, 1)
        coarse = (n + 2) // 3
        step = (1.0 - self.min_fraction) / max(coarse - 1, 1)
        grid = torch.arange(coarse, device=lo.device) * -step + 1.0  # 1 .. min_fraction
        best_a, best_b = self._best(values, weights, lo, hi, grid.view(1, -1), grid.view(1, -1), fake_quantize_rows)
        fine = torch.arange(-3, 4, device=lo.device) * (step / 3)  # around the coarse best, within the bounds
        around = lambda f: (f + fine.view(1, -1)).clamp(self.min_fraction, 1.0)  # noqa: E731
        best_a, best_b = self._best(values, weights, lo, hi, around(best_a), around(best_b), fake_quantize_rows)
        chosen_lo, chosen_hi = lo * best_a, hi * best_b
        empty = lo > hi  # a block that saw no finite value keeps its empty range
        return (torch.where(empty, lo, chosen_lo).view(shape), torch.where(empty, hi, chosen_hi).view(shape))

    @staticmethod
    def _best(values, weights, lo, hi, fa, fb, fake_quantize_rows):
        """The fractions (a, b), one pair per block from fa x fb (each
        (blocks or 1, k)), whose range [lo * a, hi * b] gives the smallest
        weighted squared error; the first in order on a tie."""
        blocks, m = values.shape
        a = fa.expand(blocks, -1).unsqueeze(2).expand(-1, -1, fb.shape[1]).reshape(blocks, -1)
        b = fb.expand(blocks, -1).unsqueeze(1).expand(-1, fa.shape[1], -1).reshape(blocks, -1)
        k = a.shape[1]
        err = torch.empty(blocks, k, device=values.device)
        rows = max(1, (1 << 22) // m)  # values per op call: about 4M
        for start in range(0, k, rows):
            stop = min(k, start + rows)
            v = values.unsqueeze(1).expand(-1, stop - start, -1).reshape(-1, m)
            q = fake_quantize_rows(v, (lo * a[:, start:stop]).reshape(-1, 1), (hi * b[:, start:stop]).reshape(-1, 1))
            sq = (q.float() - v).square_().view(blocks, stop - start, m)
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
