"""HistogramObserver's passes over a batch as compiled operators: each
block's finite range (`block_finite_range`) and its bin counts
(`block_histogram`), one pass over x each. CPU only; on other devices the
observer computes them with ATen ops (ops/blocks.py block_min_max,
observers.py HistogramObserver._count), which are also the ops' reference."""

from __future__ import annotations

from typing import Sequence

import torch

from ._checks import _call, _check_finite_range_args, _check_histogram_args


def block_histogram(
    x: torch.Tensor, block_size: Sequence[int], lo: torch.Tensor, hi: torch.Tensor, bins: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of `block_size`, the count of x's finite values in each of
    `bins` equal bins over [lo, hi].

    A value v of a block is in bin floor((v - lo) / (hi - lo) * bins),
    computed in float64 (exact differences, so a range as wide as fp32's
    bins as any other); v = hi is in the last bin, every value of a
    one-point range in bin 0, values outside the range in the end bins.
    NaN and +-Inf are in no bin, so a block with the empty range (+inf,
    -inf: one that saw no finite value, all its values NaN or +-Inf)
    counts nothing. A range with hi <= lo bins as one of width 1 from lo
    (bin floor((v - lo) * bins), clamped to the end bins): a finite lo >
    hi counts the block's finite values too.

    Args:
        x: float32, bfloat16 or float16 on the CPU.
        block_size: one entry per dimension of x.
        lo, hi: float32, shape ceil(x.shape / block_size): each block's range.
        bins: bins per block, >= 1.

    Returns:
        (counts, nonfinite): float64 counts of shape ceil(x.shape / block_size)
        + (bins,), and the number of NaN / Inf values of x (0-dim int64).

    Raises:
        TypeError, ValueError: an argument of the wrong type, dtype, shape or value.
    """
    return _call(torch.ops.pt2e_fq.block_histogram.default, _check_histogram_args, block_size, (bins,),
                 x, block_size, lo, hi, bins)


def block_finite_range(x: torch.Tensor, block_size: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of `block_size`, the min and max of x's finite values.

    Args:
        x: float32, bfloat16 or float16 on the CPU.
        block_size: one entry per dimension of x.

    Returns:
        (lo, hi): float32 of shape ceil(x.shape / block_size); (+inf, -inf)
        for a block with no finite value.

    Raises:
        TypeError, ValueError: an argument of the wrong type, dtype or shape.
    """
    return _call(torch.ops.pt2e_fq.block_finite_range.default, _check_finite_range_args, block_size, (),
                 x, block_size)
