"""Quantization parameters from an observed range: the formulas, per scheme
and formulation (which one a point uses: format_kinds.py).

Inputs are the per-block range (lo, hi) as fp32 tensors of the reduced shape;
outputs are tensors of the same shape, computed with tensor ops only (no host
sync). The integer formulas are torch's observers' (`_calculate_qparams`), so
results agree with torchao's stock observers.
"""

from __future__ import annotations

from typing import Optional

import torch

from .formats import ELEMENTS
from .schemes import Scheme

# torch's observers floor integer scales at fp32 eps; a constant tensor then
# gets a tiny but valid scale instead of 0.
INT_SCALE_EPS = torch.finfo(torch.float32).eps
# The precisions a scale may be stored in (QSpec.scale_dtype): fp32, and
# bfloat16, in which ExecuTorch's XNNPACK delegate stores the per-group
# scales of int4 weights (executorch backends/xnnpack/operators/
# node_visitor.py, NodeVisitor.get_quant_params: `scale.to(torch.bfloat16)`
# for per_channel_group), as torchao's `scale_precision` /
# `weight_scale_dtype` model it.
SCALE_DTYPES = (torch.float32, torch.bfloat16)

# Float formats have range to spare: floor only at the smallest normal fp32.
FLOAT_SCALE_TINY = torch.finfo(torch.float32).tiny


def grid_reach(scheme: Scheme, quant_min: int, quant_max: int) -> float:
    """How far a scheme's grid can reach past its range: the largest
    |grid end| over the range's largest |value|, at most. The symmetric
    schemes put the zero point on the middle code, zp = (quant_min +
    quant_max + 1) // 2, and the range's amax on `per_amax` codes, so their
    farthest end is max(zp - quant_min, quant_max - zp) / per_amax * amax:
    full-range SYMMETRIC puts amax on (n / 2) codes, n = quant_max - quant_min, and
    reaches quant_min * scale = -amax * (n + 1) / n; SYMMETRIC_NARROW reaches
    amax itself; SYMMETRIC_NO_CLIP puts hi on the fewer codes of its side,
    so its longer side reaches (zp - quant_min) / (quant_max - zp) * amax
    (int8 128/127, int4 8/7, int2 2). ASYMMETRIC (both formulations) ends
    within half a step of its range, a step being at most 2 * amax / n:
    (n + 1) / n."""
    n = quant_max - quant_min
    if scheme is Scheme.ASYMMETRIC:
        return (n + 1) / n
    middle = (quant_min + quant_max + 1) // 2
    below, above = middle - quant_min, quant_max - middle
    per_amax = min(below, above) if scheme is Scheme.SYMMETRIC_NO_CLIP else n / 2
    return max(below, above) / per_amax


def int_range_limit(dtype: torch.dtype, quant_min: int, quant_max: int, scheme: Scheme) -> float:
    """The largest |value| an integer point's range may reach for inputs of
    `dtype`; observed ranges are clamped to it. A range up to the dtype's
    largest finite value would put grid points beyond it (grid_reach), and
    values inside the range would dequantize to +-Inf (fp16 int8 symmetric:
    -65504 -> -Inf). Dividing the dtype's max by the scheme's reach keeps
    every grid point finite, so values beyond the range saturate at a finite
    grid end. Capping at half the fp32 max keeps hi - lo, and so the scale,
    finite. An asymmetric range's grid spans hi - lo, which MINVAL's
    dequantization computes in fp32 as (q - quant_min) * scale before it
    adds minval: that cap divided by the grid's reach keeps the product
    finite too (half the fp32 max alone let (quant_max - quant_min) * scale
    round past the fp32 max). A symmetric grid's products reach at most
    twice the range's amax."""
    reach = grid_reach(scheme, quant_min, quant_max)
    fp32_cap = torch.finfo(torch.float32).max / 2 / (reach if scheme is Scheme.ASYMMETRIC else 1)
    return min(torch.finfo(dtype).max / reach, fp32_cap)


def stored_scale(scale: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """`scale` as a runtime that stores it in `scale_dtype` reads it back:
    rounded to the nearest `scale_dtype` value (ties to even), held as fp32
    (every bfloat16 value is an fp32 one). The identity for fp32. A scale
    floored at INT_SCALE_EPS (2**-23, a bfloat16 value) stays at or above
    it: rounding to nearest is monotone."""
    return scale if scale_dtype == torch.float32 else scale.to(scale_dtype).to(torch.float32)


def stored_grid_scale(scale: torch.Tensor, scale_dtype: torch.dtype, dtype: torch.dtype, low,
                      high, offset: Optional[torch.Tensor] = None) -> torch.Tensor:
    """stored_scale of `scale`, kept where the grid stays finite in `dtype`
    (the input's). The grid's ends are low * s + offset and high * s +
    offset, as the op dequantizes them in fp32 (low, high: the lowest and
    highest code less the integer offset; offset: MINVAL's minval).
    Rounding to nearest can take the scale up by half a scale_dtype step,
    which takes an end that int_range_limit left near the dtype's max past
    it (fp16 int8 symmetric: 511.75 rounds to 512 and -128 * 512 to -Inf).
    Such a block takes the scale_dtype value just below, which is at most
    `scale`, whose grid the range limit keeps finite. The value rounded is
    chosen before the one cast to scale_dtype and back, so a traced graph
    still ends in that cast."""
    if scale_dtype == torch.float32:
        return scale
    rounded = stored_scale(scale, scale_dtype)

    def finite(code) -> torch.Tensor:
        end = code * rounded if offset is None else code * rounded + offset
        return torch.isfinite(end.to(dtype))

    past = (rounded > scale) & ~(finite(low) & finite(high))
    # r * (1 - eps / 2) is the scale_dtype value just below a positive r:
    # exact in fp32 (8 significant bits times 8 for bfloat16), it lies
    # between half a step and a step below r (exactly the step below a
    # power of two, where the step halves), so rounding to nearest gives it.
    below = rounded * (1 - torch.finfo(scale_dtype).eps / 2)
    return stored_scale(torch.where(past, below, scale), scale_dtype)


def symmetric_qparams(lo, hi, quant_min: int, quant_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scale = max(|lo|, |hi|) / ((quant_max - quant_min) / 2); the zero point
    is the middle code: 0 for a signed range, 2**(bits-1) for an unsigned one."""
    amax = torch.maximum(-lo.clamp(max=0), hi.clamp(min=0))
    scale = (amax / ((quant_max - quant_min) / 2)).clamp(min=INT_SCALE_EPS)
    zero_point = torch.full_like(scale, (quant_min + quant_max + 1) // 2, dtype=torch.int32)
    return scale, zero_point


def symmetric_no_clip_qparams(lo, hi, quant_min: int, quant_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The middle code as the zero point, and the smallest scale that puts
    both ends of the range on codes: scale = max(-lo / (zp - quant_min),
    hi / (quant_max - zp)) (torchao's SYMMETRIC_NO_CLIPPING_ERR)."""
    middle = (quant_min + quant_max + 1) // 2
    below = -lo.clamp(max=0) / float(middle - quant_min)
    above = hi.clamp(min=0) / float(quant_max - middle)
    scale = torch.maximum(below, above).clamp(min=INT_SCALE_EPS)
    return scale, torch.full_like(scale, middle, dtype=torch.int32)


def asymmetric_qparams(lo, hi, quant_min: int, quant_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The range widened to include 0 maps onto [quant_min, quant_max]; the
    integer zero point makes 0 exactly representable."""
    min_neg, max_pos = lo.clamp(max=0), hi.clamp(min=0)
    scale = ((max_pos - min_neg) / float(quant_max - quant_min)).clamp(min=INT_SCALE_EPS)
    zero_point = quant_min - torch.round(min_neg / scale).to(torch.int32)
    return scale, zero_point.clamp(quant_min, quant_max)


def minval_qparams(lo, hi, quant_min: int, quant_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MINVAL formulation: [lo, hi] itself maps onto [quant_min, quant_max]
    (0 need not be representable); returns (scale, minval)."""
    scale = ((hi - lo) / float(quant_max - quant_min)).clamp(min=INT_SCALE_EPS)
    return scale, lo.clone()


def float_scale(lo, hi, fmax: float) -> torch.Tensor:
    """Float formats: the block's amax maps to the format's largest value."""
    return float_scale_from_amax(torch.maximum(lo.abs(), hi.abs()), fmax)


def float_scale_from_amax(amax, fmax: float) -> torch.Tensor:
    """float_scale of a range whose largest |value| is amax (>= 0)."""
    return (amax / fmax).clamp(min=FLOAT_SCALE_TINY)


def two_level_global_scale(lo, hi, block_scale_element: str, element: str) -> torch.Tensor:
    """NVFP4's global scale: its per-block scales are `block_scale_element`
    values under it, so the range's amax maps to the product of the two
    largest values (block scale x element)."""
    return float_scale(lo, hi, ELEMENTS[block_scale_element].fmax * ELEMENTS[element].fmax)
