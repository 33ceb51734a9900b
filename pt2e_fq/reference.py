"""A pure-torch reference of the fused ops' semantics, written for clarity.

It defines the numerics the kernels must reproduce bit for bit: fp32
arithmetic, IEEE division, round half to even, the clamp mask on the unclamped
q, NaN through, +-Inf saturating. Tests compare the kernels against it.

Bit for bit except inside NaNs: which elements are NaN is semantics, the
sign and payload bits of an output NaN are not. The kernels' NaN bits come
from their fp32 arithmetic and their own narrowing to fp16 / bf16 (on CPU: an
fp32 NaN input passes quieted with its payload, a NaN narrowed to fp16 keeps
its sign, a NaN scale gives the canonical 0x7fc00000); this reference's come
from torch's casts (its FP8 cast returns 0x7ff00000, its fp16 narrowing
0x7fff). Compare NaNs as NaNs (`equal_nan=True`), as the tests do.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .ops.blocks import expand_blocks, reduce_blocks
from .ops.float_cast import cast_float
from .spec.formats import ELEMENTS, NVFP4_BLOCK


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
# Float formats, written from the format definitions: the element cast is
# float_cast.cast_float (torch's own cast for FP8, a nearest-neighbour search
# for E2M1, which torch cannot cast to); MX follows OCP MX v1.0 section 6.3, NVFP4 the
# two-level recipe documented in `pt2e_fq.ops.fake_quantize_nvfp4`.

# torch dtype -> (largest finite value, exponent of the largest power of two
# below it), from the element table.
FLOAT_FORMATS = {e.torch_dtype: (e.fmax, e.emax) for e in ELEMENTS.values() if e.torch_dtype is not None}


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
    # The block count spelled out: reshape cannot infer a -1 when another dimension is 0.
    return t.reshape(*t.shape[:-1], t.shape[-1] // block_size, block_size)


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
    """max|x| / (fmax(E4M3) * fmax(E2M1)), and 1 where that is 0 or Inf (an
    empty x has max|x| = 0); one NaN in x makes it NaN."""
    # A 0 joins the values: max |x| is unchanged, and an empty x has a maximum.
    amax = torch.cat([x.float().abs().reshape(-1), x.new_zeros(1, dtype=torch.float32)]).amax()
    g = amax / (ELEMENTS["e4m3"].fmax * ELEMENTS["e2m1"].fmax)
    return torch.where((g == 0) | torch.isinf(g), torch.ones_like(g), g)


def fake_quantize_nvfp4(x: torch.Tensor, global_scale: Optional[torch.Tensor] = None, axis: int = -1):
    """Returns (y in x's dtype, bool mask, fp32 E4M3 block scales, global scale)."""
    g = nvfp4_global_scale(x) if global_scale is None else global_scale.float().reshape(())
    blocks = _to_blocks(x, NVFP4_BLOCK, axis)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    block_scale = cast_float(amax / ELEMENTS["e2m1"].fmax / g, torch.float8_e4m3fn)
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


# ---------------------------------------------------------------------------
# Learnable ranges (LSQ, Esser et al. 2020; LSQ+, Bhalgat et al. 2020).


def lsq_grad_factors(shape: Sequence[int], block_size: Sequence[int], quant_max: int) -> torch.Tensor:
    """LSQ's default gradient scale of each block's qparams, float64 of the
    reduced shape: 1 / sqrt(n * quant_max) with n the block's own element
    count (a ragged last block has fewer than the others)."""
    counts = reduce_blocks(torch.ones(tuple(shape), dtype=torch.float64), block_size, torch.sum, 0.0)
    return 1.0 / torch.sqrt(counts * quant_max)


def fake_quantize_affine_learnable_grads(
    x: torch.Tensor,
    block_size: Sequence[int],
    scale: torch.Tensor,
    zero_point: Optional[torch.Tensor],
    quant_min: int,
    quant_max: int,
    grad_factor: Optional[float],
    dy: torch.Tensor,
    minval: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, d scale, d offset) in float64: torch autograd through the LSQ /
    LSQ+ forward with round taken straight through, as the papers write it
    (`round_pass`), the clamp's own derivative (1 inside [quant_min,
    quant_max], limits included, 0 outside), and the per-block gradients
    times grad_factor (None: `lsq_grad_factors`, per block). d offset is
    minval's (MINVAL) or the zero point's
    (ZP, the zero point rounded half to even after clamping, straight
    through); scale and offset have the reduced shape.

    Which integer each element rounds to is decided in fp32, as the forward
    computes it (the `fake_quantize_affine` reference's q), so the two agree
    on every rounding decision; everything else is float64.
    """
    shape, f64 = x.shape, torch.float64
    expand = lambda t: expand_blocks(t, shape, block_size)  # noqa: E731
    x64 = x.detach().to(f64).requires_grad_()
    s = scale.detach().to(f64).requires_grad_()
    offset = minval if minval is not None else zero_point
    off = None if offset is None else offset.detach().to(f64).requires_grad_()
    s32 = expand(scale.float())
    if minval is not None:
        int_off, float_off = torch.full(shape, float(quant_min), dtype=f64), expand(off)
        float_off32 = expand(minval.float())
    else:
        float_off, float_off32 = torch.zeros(shape, dtype=f64), torch.zeros_like(s32)
        int_off = torch.zeros(shape, dtype=f64)
        if off is not None:  # round(clamp(zero_point)), straight through
            rounded = zero_point.float().clamp(quant_min, quant_max).round().to(f64)
            int_off = expand(off + (rounded - off).detach())
    # Which integer each element rounds to: the fp32 forward's decision.
    r32 = torch.round((x.float() - float_off32) / s32).to(f64)
    # Round straight through where x is finite. A non-finite x contributes
    # no gradient (the observers ignore it too): its y is a constant 0 here
    # (v from a finite stand-in, r 0, so that no NaN or infinite factor
    # meets the zeros around it in the chain rule).
    finite = torch.isfinite(x64.detach())
    v = (torch.where(finite, x64, 0.0) - float_off) / expand(s)
    r = torch.where(finite, v + (r32 - v).detach(), 0.0)
    y = (torch.clamp(r + int_off, quant_min, quant_max) - int_off) * expand(s) + float_off
    y = torch.where(finite, y, 0.0)
    leaves = [x64, s] + ([off] if off is not None else [])
    grads = torch.autograd.grad(y, leaves, dy.to(f64))
    if grad_factor is None:
        grad_factor = lsq_grad_factors(shape, block_size, quant_max).reshape(grads[1].shape)
    doff = grads[2] * grad_factor if off is not None else torch.zeros_like(grads[1])
    return grads[0], grads[1] * grad_factor, doff
