"""Weight range search: per block of a weight point, the clipping range that
minimises the layer's output error, before GPTQ rounds on it.

A block's min-max range puts its largest value exactly on the grid and
spends the rest of the grid on the tail; at 4 bits, a range clipped a
little gives the bulk of the block finer steps, and its output error
(the rounding error of each input column weighted by that column's share of
the output error: its input power, or, before GPTQ, the part of it that
the columns rounded later cannot take over) is often lower.
Per block, every candidate range [lo * a, hi * b] of a grid of shrink
factors is tried with the weight point's own op, and the one of least
error wins (1.0 is on the grid, and a tie keeps the wider range, so a block
never gets worse than min-max on this measure). Symmetric schemes shrink
both ends by one factor; the asymmetric ones (ZP or MINVAL) search both ends.

- Integer and scaled-float points (static qparams per block): the chosen
  range's qparams are stored in the point (`qparams_from_range`), so GPTQ,
  convert and export use them.
- NVFP4: the kernel computes each block's E4M3 scale from the block's
  largest |value|, so a block's range is chosen by clamping its values:
  the search returns the bound (per element) that the weight is clamped to
  before the op, and the clamped block's scale is then the kernel's own.
- MX and dynamic points: no search (their scales follow the live values).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..ops.blocks import block_abs_max, block_min_max, expand_blocks, reduce_blocks
from ..spec.format_kinds import INTEGER, NVFP4, SCALED_FLOAT
from ..spec.schemes import Formulation, Scheme
from .layers import Layer

# Shrink factors tried: 1.0 (min-max) down to 1 - (steps - 1) * step; one
# factor for both ends of a symmetric range, every pair of factors (a coarser
# grid: steps^2 candidates) for the two ends of an asymmetric one.
SYMMETRIC_GRID, ASYMMETRIC_GRID = (16, 0.025), (8, 0.05)


def shrink_factors(steps: int, step: float) -> torch.Tensor:
    """The grid of shrink factors, 1.0 first."""
    return 1.0 - step * torch.arange(steps, dtype=torch.float32)


def searchable(layer: Layer) -> bool:
    """Whether the layer's weight point has a range to search."""
    spec = layer.point.qspec
    return not spec.dynamic and (spec.kind in (INTEGER, SCALED_FLOAT) or spec.kind is NVFP4)


def column_importance(layer: Layer, d: torch.Tensor) -> torch.Tensor:
    """The per-column weights d (groups, n) spread over the weight's shape."""
    d = d.float()
    rows = layer.weight_shape[0] // d.shape[0]
    return d[:, None, :].expand(d.shape[0], rows, d.shape[1]).reshape(layer.weight_shape)


def _pairs(symmetric: bool, factors: torch.Tensor) -> list[tuple[float, float]]:
    f = factors.tolist()
    return [(a, a) for a in f] if symmetric else [(a, b) for a in f for b in f]


def search(layer: Layer, weight: torch.Tensor, column_weights: torch.Tensor,
           factors: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Chooses the range of every block of `layer`'s weight point for
    `weight` (the weight's shape): the least sum over the block of
    column_weights[column] * error^2, column_weights (groups, n) one per
    column of the layer's matrix (calib.layers): diag(H) for
    round-to-nearest, gptq.residual_power(H) before GPTQ. `factors`: the
    shrink factors (default: the grids above). An integer or scaled-float point gets the chosen
    qparams stored; returns None. NVFP4: returns the per-element bound
    |w| <= bound that the weight is to be clamped to before the op
    (layers.Layer.column_quantizer's `bound`). Other points: None,
    unchanged."""
    if not searchable(layer):
        return None
    spec, point = layer.point.qspec, layer.point
    w = weight.detach().float()
    importance = column_importance(layer, column_weights)
    if spec.kind is NVFP4:
        return _search_nvfp4(layer, w, importance, shrink_factors(*SYMMETRIC_GRID) if factors is None else factors)
    block = spec.granularity.block_size(tuple(w.shape))
    lo, hi = block_min_max(w, block)
    # A symmetric grid has one scale to shrink (no-clip's is set by the end it binds at).
    symmetric = spec.scheme is not Scheme.ASYMMETRIC and spec.formulation is not Formulation.MINVAL
    if factors is None:
        factors = shrink_factors(*(SYMMETRIC_GRID if symmetric else ASYMMETRIC_GRID))
    best_err, best = None, None
    with torch.no_grad():
        for a, b in _pairs(symmetric, factors):
            qparams = spec.kind.qparams_from_range(spec, lo * a, hi * b, w.dtype)
            q = spec.kind.fake_quantize(spec, w, block, qparams)
            err = reduce_blocks(importance * (q - w).square(), block, torch.sum, 0.0)
            if best_err is None:
                best_err, best = err, qparams
                continue
            better = err < best_err  # strict: a tie keeps the wider range
            best_err = torch.where(better, err, best_err)
            best = {name: torch.where(better, value, best[name]) for name, value in qparams.items()}
    for name, value in best.items():
        point._store(name, value)
    return None


def _search_nvfp4(layer: Layer, w: torch.Tensor, importance: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    spec = layer.point.qspec
    block = spec.granularity.block_size(tuple(w.shape))
    amax = block_abs_max(w, block)
    best_err, best = None, None
    with torch.no_grad():
        for f in factors.tolist():
            bound = expand_blocks(amax * f, w.shape, block)
            q = layer.point(torch.maximum(torch.minimum(w, bound), -bound))
            err = reduce_blocks(importance * (q - w).square(), block, torch.sum, 0.0)
            if best_err is None:
                best_err, best = err, amax * f
                continue
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, amax * f, best)
    return expand_blocks(best, w.shape, block)
