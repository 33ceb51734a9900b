"""Observers: the per-block range [lo, hi] a fake-quant point quantizes to.

An observer is a small frozen config with one method, `observe`. It reduces
over the blocks of the point's granularity (blocks.reduce_blocks), so every
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
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .blocks import reduce_blocks

Range = tuple[torch.Tensor, torch.Tensor]
# (lo, hi) -> x fake-quantized with the qparams of that range.
FakeQuantizeFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# A batch's per-block range -> the range over every rank's batch
# (observer_sync.all_reduce_range, bound to a process group).
ReduceRangeFn = Callable[[torch.Tensor, torch.Tensor], Range]


def fp32(t: torch.Tensor) -> torch.Tensor:
    """t as float32. `t.float()` of an fp32 tensor is t itself in eager mode,
    but torch.export records it (a cast and a metadata assertion), and a
    dynamic point's qparam ops are traced into every exported graph."""
    return t if t.dtype == torch.float32 else t.float()


def block_min_max(x: torch.Tensor, block_size: Sequence[int]) -> Range:
    """The fp32 minimum and maximum of the finite values of every block;
    (+inf, -inf) for a block with none (see the module docstring)."""
    finite = torch.isfinite(x)
    lo = reduce_blocks(torch.where(finite, x, math.inf), block_size, torch.amin, math.inf)
    hi = reduce_blocks(torch.where(finite, x, -math.inf), block_size, torch.amax, -math.inf)
    return fp32(lo), fp32(hi)


def block_abs_max(x: torch.Tensor, block_size: Sequence[int]) -> torch.Tensor:
    """The fp32 maximum |value| of the finite values of every block, 0 for a
    block with none: max(|lo|, |hi|) of block_min_max with an empty range
    read as [0, 0], bit for bit (|x| is exact, and a maximum does not round),
    in half the ops. Every value reduced is >= +0, so neither the order of the
    reduction nor a padding 0 can change the result; blocks that span whole
    dimensions (per-tensor, per-channel, per-token) are reduced over those
    dimensions in place, without a reshape. Sizes are compared only where
    statically known, so a dynamic batch gets no guard."""
    a = x.abs()
    a = torch.where(a < math.inf, a, 0.0)  # |x| < inf: x is finite (False for NaN); fewer ops than isfinite
    whole = [d for d, (s, b) in enumerate(zip(a.shape, block_size)) if statically_known_true(b >= s)]
    ones = [d for d, b in enumerate(block_size) if statically_known_true(b == 1)]
    if whole and len(set(whole) | set(ones)) == a.dim() and a.numel() > 0:
        return fp32(torch.amax(a, dim=whole, keepdim=True))
    return fp32(reduce_blocks(a, block_size, torch.amax, 0.0))


def is_empty(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Per block: True where the range holds no finite value (lo > hi)."""
    return lo > hi


class Observer:
    """Base class. `keeps_range`: the module keeps the running range between
    calls, and in a distributed run the batch's range is reduced over the
    ranks before the update (the `reduce_range` of `observe`). `dynamic`:
    the observer computes qparams from the live tensor, for dynamic points."""

    keeps_range: ClassVar[bool] = False
    dynamic: ClassVar[bool] = False
    # Whether the fused observe ops (observe_ops.py) reproduce `observe`
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
        c = self.averaging_constant
        if not isinstance(c, (int, float)) or isinstance(c, bool) or not 0 < c <= 1:
            raise ValueError(f"MovingAverageMinMaxObserver: averaging_constant must be in (0, 1], got {c!r}")

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
        n, f = self.num_candidates, self.min_fraction
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"MSEObserver: num_candidates must be an int >= 1, got {n!r}")
        if not isinstance(f, (int, float)) or isinstance(f, bool) or not 0 < f <= 1:
            raise ValueError(f"MSEObserver: min_fraction must be in (0, 1], got {f!r}")

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


OBSERVERS = (MinMaxObserver, MovingAverageMinMaxObserver, MSEObserver, CurrentMinMaxObserver)
