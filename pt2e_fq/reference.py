"""A pure-torch reference of the fused ops' semantics, written for clarity.

It defines the numerics the kernels must reproduce bit for bit: fp32
arithmetic, IEEE division, round half to even, the clamp mask on the unclamped
q, NaN through, +-Inf saturating. Tests compare the kernels against it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .blocks import reduced_shape


def expand_blocks(t: torch.Tensor, shape: Sequence[int], block_size: Sequence[int]) -> torch.Tensor:
    """Repeats each per-block value over its block: reduced shape -> shape."""
    t = t.reshape(reduced_shape(shape, block_size))
    for d, (s, b) in enumerate(zip(shape, block_size)):
        t = t.repeat_interleave(b, dim=d).narrow(d, 0, s)
    return t


def fake_quantize_affine(
    x: torch.Tensor,
    block_size: Sequence[int],
    scale: torch.Tensor,
    zero_point: Optional[torch.Tensor],
    quant_min: int,
    quant_max: int,
    minval: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (y in x's dtype, bool mask of x's shape)."""
    shape = x.shape
    s = expand_blocks(scale.float(), shape, block_size)
    if minval is None:
        int_offset = (
            torch.zeros_like(s) if zero_point is None else expand_blocks(zero_point.float(), shape, block_size)
        )
        float_offset = torch.zeros_like(s)
    else:
        int_offset = torch.full_like(s, float(quant_min))
        float_offset = expand_blocks(minval.float(), shape, block_size)
    q = torch.round((x.float() - float_offset) / s) + int_offset  # torch.round: half to even
    mask = (q >= quant_min) & (q <= quant_max)
    clamped = torch.where(q < quant_min, float(quant_min), torch.where(q > quant_max, float(quant_max), q))
    y = (clamped - int_offset) * s + float_offset
    return y.to(x.dtype), mask


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Packs a bool mask into bytes, element i at bit i % 8 of byte i // 8."""
    flat = mask.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    flat = torch.cat([flat, flat.new_zeros(pad)]).reshape(-1, 8)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int32)
    return (flat.int() * weights).sum(dim=1).to(torch.uint8)
