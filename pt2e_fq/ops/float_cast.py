"""The saturating round-to-nearest-even cast to a float element and back,
in pure torch: the definition the kernels reproduce, which the reference and
the ONNX export (to store a weight's codes) share.

FP8 rounding is torch's own cast; E2M1 (which torch cannot cast to) is a
nearest-neighbour search over its eight magnitudes.
"""

from __future__ import annotations

from typing import Union

import torch

from ..spec.formats import element

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """The nearest E2M1 value to each |v| <= 6, ties to the even code (the
    grid index is the code, so even index = mantissa bit 0); sign kept."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64)
    a = v.double().abs().contiguous()
    hi = torch.searchsorted(grid, a).clamp(1, len(E2M1_GRID) - 1)
    lo = hi - 1
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    mag = torch.where(pick_hi, grid[hi], grid[lo])
    mag = torch.where(torch.isnan(a), a, mag)
    return torch.copysign(mag, v.double()).float()


def cast_float(v: torch.Tensor, elem: Union[torch.dtype, str]) -> torch.Tensor:
    """Saturating round-to-nearest-even cast of fp32 v to the element (a name
    or torch dtype) and back to fp32."""
    e = element("cast_float", "elem", elem)
    v = torch.clamp(v, -e.fmax, e.fmax)  # keeps NaN
    if e.name == "e2m1":
        return round_e2m1(v)
    return v.to(e.torch_dtype).float()
