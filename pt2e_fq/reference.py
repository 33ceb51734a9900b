"""A pure-torch reference of the fused ops' semantics, written for clarity.

It defines the numerics the kernels must reproduce bit for bit: fp32
arithmetic, IEEE division, round half to even, the clamp mask on the unclamped
q, NaN through, +-Inf saturating. Tests compare the kernels against it.
"""

from __future__ import annotations

import math
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


# ---------------------------------------------------------------------------
# Float formats, written from the format definitions: FP8 rounding is torch's
# own cast; E2M1 (which torch cannot cast to) is a nearest-neighbour search
# over its eight magnitudes; MX follows OCP MX v1.0 section 6.3, NVFP4 the
# two-level recipe documented in `pt2e_fq.ops.fake_quantize_nvfp4`.

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# dtype -> (largest finite value, exponent of the largest power of two below it)
FLOAT_FORMATS = {
    torch.float8_e4m3fn: (448.0, 8),
    torch.float8_e5m2: (57344.0, 15),
    torch.float4_e2m1fn_x2: (6.0, 2),
}


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


def cast_float(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating round-to-nearest-even cast of fp32 v to dtype and back."""
    fmax = FLOAT_FORMATS[dtype][0]
    v = torch.clamp(v, -fmax, fmax)  # keeps NaN
    if dtype == torch.float4_e2m1fn_x2:
        return round_e2m1(v)
    return v.to(dtype).float()


def _fake_quantize_scaled(x32: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    """(y, mask) of cast(clamp(x / scale)) * scale, everything in fp32."""
    fmax = FLOAT_FORMATS[dtype][0]
    v = x32 / scale
    return cast_float(v, dtype) * scale, v.abs() <= fmax


def fake_quantize_float(
    x: torch.Tensor, block_size: Sequence[int], scale: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (y in x's dtype, bool mask of x's shape)."""
    s = expand_blocks(scale.float(), x.shape, block_size)
    y, mask = _fake_quantize_scaled(x.float(), s, dtype)
    return y.to(x.dtype), mask


def _to_blocks(x: torch.Tensor, block_size: int, axis: int) -> torch.Tensor:
    """x (fp32) with `axis` moved last, zero-padded to whole blocks and split:
    shape [..., nblocks, block_size]. Zero padding leaves max |x| alone."""
    t = x.float().movedim(axis, -1)
    pad = (-t.shape[-1]) % block_size
    t = torch.nn.functional.pad(t, (0, pad))
    return t.reshape(*t.shape[:-1], -1, block_size)


def _from_blocks(t: torch.Tensor, like: torch.Tensor, axis: int) -> torch.Tensor:
    n = like.shape[axis]
    return t.flatten(-2)[..., :n].movedim(-1, axis)


def mx_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """OCP MX v1.0: 2^(floor(log2(amax)) - emax_elem), clamped to E8M0's
    exponents [-127, 127]; NaN amax gives a NaN scale."""
    emax = FLOAT_FORMATS[dtype][1]
    mantissa, exponent = torch.frexp(amax.double())  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    floor_log2 = (exponent - 1).double()
    floor_log2 = torch.where(amax == 0, -math.inf, floor_log2)
    floor_log2 = torch.where(torch.isinf(amax), math.inf, floor_log2)
    shared = torch.clamp(floor_log2 - emax, -127, 127)
    scale = torch.pow(torch.tensor(2.0, dtype=torch.float64), shared).float()
    return torch.where(torch.isnan(amax), amax, scale)


def fake_quantize_mx(x: torch.Tensor, dtype: torch.dtype, block_size: int = 32, axis: int = -1):
    """Returns (y in x's dtype, bool mask, fp32 block scales)."""
    blocks = _to_blocks(x, block_size, axis)
    scale = mx_scale(blocks.abs().amax(dim=-1, keepdim=True), dtype)
    y, mask = _fake_quantize_scaled(blocks, scale, dtype)
    return (
        _from_blocks(y, x, axis).to(x.dtype),
        _from_blocks(mask, x, axis),
        scale.squeeze(-1).movedim(-1, axis),
    )


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """max|x| / (448 * 6), and 1 where that is 0 or Inf."""
    g = x.float().abs().amax() / (448.0 * 6.0)
    return torch.where((g == 0) | torch.isinf(g), torch.ones_like(g), g)


def fake_quantize_nvfp4(x: torch.Tensor, global_scale: Optional[torch.Tensor] = None, axis: int = -1):
    """Returns (y in x's dtype, bool mask, fp32 E4M3 block scales, global scale)."""
    g = nvfp4_global_scale(x) if global_scale is None else global_scale.float().reshape(())
    blocks = _to_blocks(x, 16, axis)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    block_scale = cast_float(amax / 6.0 / g, torch.float8_e4m3fn)
    scale = block_scale * g
    flush = scale == 0  # nothing representable: the block becomes 0, nothing clamped
    y, mask = _fake_quantize_scaled(blocks, torch.where(flush, 1.0, scale), torch.float4_e2m1fn_x2)
    y = torch.where(flush, y * 0.0, y)
    mask = mask | flush
    return (
        _from_blocks(y, x, axis).to(x.dtype),
        _from_blocks(mask, x, axis),
        block_scale.squeeze(-1).movedim(-1, axis),
        g,
    )
