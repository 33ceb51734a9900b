"""Python entry points of the fused fake-quant operators.

Each public function calls one `torch.ops.pt2e_fq` operator, so
torch.export and torch.compile see exactly one node; where the op fails,
its argument check (_checks.py: shapes and dtypes only, reading values would
sync the host with the device) says which argument is wrong. The fake
implementations are in _fake.py; autograd is C++
(csrc/common/ste_autograd.cpp: dx through the bit-packed clamp mask, the
only tensor the node saves; learnable_autograd.cpp: the LSQ backward).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ..spec.formats import MX_BLOCK
from ._checks import (
    _call,
    _check_affine_args,
    _check_axis_blocks,
    _check_float_args,
    _check_learnable_args,
    _check_nvfp4_args,
    _elem_format,
)

# The ops, looked up once (a torch.ops attribute chain costs ~0.3 us a call).
_OP_AFFINE = torch.ops.pt2e_fq.fake_quantize_affine.default
_OP_AFFINE_LEARNABLE = torch.ops.pt2e_fq.fake_quantize_affine_learnable.default
_OP_FLOAT = torch.ops.pt2e_fq.fake_quantize_float.default
_OP_MX = torch.ops.pt2e_fq.fake_quantize_mx.default
_OP_NVFP4 = torch.ops.pt2e_fq.fake_quantize_nvfp4.default


def fake_quantize_affine_with_mask(
    x: torch.Tensor,
    block_size: Sequence[int],
    scale: torch.Tensor,
    zero_point: Optional[torch.Tensor],
    quant_min: int,
    quant_max: int,
    *,
    minval: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like `fake_quantize_affine`, and also returns the bit-packed clamp mask
    (uint8, ceil(numel / 8) bytes; see `unpack_mask`).

    Args:
        x: float32, bfloat16 or float16 tensor.
        block_size: one entry per dimension of x (x.shape: per tensor; 1 on an axis: per channel).
        scale: floating, shape ceil(x.shape / block_size) (size-1 dimensions may be left out).
        zero_point: integer (or floating) tensor shaped as scale, or None for 0.
        quant_min: the lowest integer code (inside int16).
        quant_max: the highest integer code, >= quant_min.
        minval: the MINVAL formulation's float offset, shaped as scale (zero_point None).

    Returns:
        (y, mask): y as fake_quantize_affine gives it; mask uint8 of ceil(numel / 8) bytes.

    Raises:
        TypeError: a dtype is not allowed (x floating, scale floating, zero_point integer).
        ValueError: a shape, block_size, range, device or (on CPU) a value is wrong: the message names the argument.
    """
    return _call(
        _OP_AFFINE, _check_affine_args, block_size, (quant_min, quant_max),
        x, block_size, scale, zero_point, quant_min, quant_max, minval,
    )


def fake_quantize_affine(
    x: torch.Tensor,
    block_size: Sequence[int],
    scale: torch.Tensor,
    zero_point: Optional[torch.Tensor],
    quant_min: int,
    quant_max: int,
    *,
    minval: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Integer affine fake quantization in one fused op (differentiable).

    ZP formulation (minval=None):
        q = round_half_even(x / scale) + zero_point
        y = (clamp(q, quant_min, quant_max) - zero_point) * scale
    MINVAL formulation (zero_point=None, minval given):
        q = round_half_even((x - minval) / scale) + quant_min
        y = (clamp(q, quant_min, quant_max) - quant_min) * scale + minval

    `block_size` has one entry per dimension of x; scale, zero_point and minval
    have shape ceil(x.shape / block_size). zero_point=None means 0. The
    division is IEEE `x / scale` (as ONNX QuantizeLinear), computed in fp32; y
    has x's dtype. The gradient is `dy` where quant_min <= q <= quant_max and
    0 elsewhere. NaN gives NaN; +-Inf saturates to the clamp limits.

    Args:
        x: float32, bfloat16 or float16 tensor.
        block_size: one entry per dimension of x (x.shape: per tensor; 1 on an axis: per channel).
        scale: floating, shape ceil(x.shape / block_size) (size-1 dimensions may be left out).
        zero_point: integer (or floating) tensor shaped as scale, or None for 0.
        quant_min: the lowest integer code (inside int16).
        quant_max: the highest integer code, >= quant_min.
        minval: the MINVAL formulation's float offset, shaped as scale (zero_point None).

    Returns:
        y, x's shape and dtype.

    Raises:
        TypeError: a dtype is not allowed (x floating, scale floating, zero_point integer).
        ValueError: a shape, block_size, range, device or (on CPU) a value is wrong: the message names the argument.
    """
    return fake_quantize_affine_with_mask(
        x, block_size, scale, zero_point, quant_min, quant_max, minval=minval
    )[0]


def unpack_mask(mask: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The bool clamp mask of the given shape (x's shape: ints >= 0) from its
    bit-packed form, which must hold at least one bit per element.

    Args:
        mask: the 1-D uint8 packed mask an op returned (element i is bit i % 8 of byte i // 8).
        shape: x's shape.

    Returns:
        A bool tensor of `shape`: True where the element was inside the range.

    Raises:
        TypeError: mask is not a 1-D uint8 tensor, or shape not a sequence of ints.
        ValueError: a negative size, or too few bytes for shape.
    """
    op = "pt2e_fq.unpack_mask"
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.uint8 or mask.dim() != 1:
        what = (
            f"a {mask.dim()}-dim {mask.dtype} tensor" if isinstance(mask, torch.Tensor) else type(mask).__name__
        )
        raise TypeError(f"{op}: mask must be a 1-D uint8 tensor (the packed mask), got {what}")
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise TypeError(f"{op}: shape must be a sequence of ints (x's shape), got {type(shape).__name__}")
    numel = 1
    for d, s in enumerate(shape):
        if not isinstance(s, (int, torch.SymInt)) or isinstance(s, bool):
            raise TypeError(f"{op}: shape[{d}] must be an int, got {type(s).__name__}")
        if s < 0:
            raise ValueError(f"{op}: shape[{d}] must be >= 0 (x's shape, no -1), got {s}")
        numel *= s
    # Traced sizes (SymInt) come with the op's own mask, which always fits:
    # comparing them would add a shape guard to an exported program.
    if not isinstance(numel, torch.SymInt) and 8 * mask.numel() < numel:
        raise ValueError(
            f"{op}: mask has {mask.numel()} bytes, too few for shape {tuple(shape)}: "
            f"needs ceil({numel} / 8) = {(numel + 7) // 8}"
        )
    # Element i is bit i % 8 of byte i // 8. Indexed, not sliced from all the
    # bits: a slice [:numel] of 8 * mask.numel() bits makes torch.export guard
    # on their relation, which it cannot prove for a dynamic batch.
    i = torch.arange(numel, device=mask.device)
    flat = (mask[i // 8] >> (i % 8).to(torch.uint8)) & 1
    return flat.bool().reshape(tuple(shape))



def fake_quantize_affine_learnable(
    x: torch.Tensor,
    block_size: Sequence[int],
    scale: torch.Tensor,
    zero_point: Optional[torch.Tensor],
    quant_min: int,
    quant_max: int,
    grad_factor: Optional[float] = None,
    *,
    minval: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """`fake_quantize_affine` with learnable ranges (LSQ / LSQ+) in one fused
    op: y is the same bits, and the backward gives, besides the
    straight-through dx, per block (rounding taken straight through):

        d scale  = grad_factor * sum(dy * (round(v) - v))        inside the range,
                                  + sum(dy * (q_limit - offset)) outside it
        d minval = grad_factor * sum(dy outside the range)        (MINVAL, LSQ+)
        d zero_point = -grad_factor * scale * sum(dy outside)      (a floating zero point)

    with v = (x - minval) / scale, q_limit the clamp limit that q passed and
    offset the integer offset (zero point, or quant_min for MINVAL). A
    floating zero_point is used as round_half_even(clamp(zero_point,
    quant_min, quant_max)); an integer one gets no gradient. grad_factor
    None (the default) is the LSQ paper's per block,
    1 / sqrt(block_numel * quant_max) with block_numel that block's own
    element count (a ragged last block has fewer), computed by the kernel;
    a float applies to every block as given. The sums are fp32 in an order
    fixed by the sizes (the same bits for any thread count). A NaN or +-Inf
    in x contributes no gradient (dx 0, nothing to its block's sums), as the
    observers ignore it.

    Args:
        x: float32, bfloat16 or float16 tensor.
        block_size: one entry per dimension of x (x.shape: per tensor; 1 on an axis: per channel).
        scale: floating, shape ceil(x.shape / block_size) (size-1 dimensions may be left out).
        zero_point: integer (or floating) tensor shaped as scale, or None for 0.
        quant_min: the lowest integer code (inside int16).
        quant_max: the highest integer code, >= quant_min.
        grad_factor: the gradient scale; None for LSQ's 1 / sqrt(block_numel * quant_max).
        minval: the MINVAL formulation's float offset, shaped as scale (zero_point None).

    Returns:
        y, bit for bit fake_quantize_affine's.

    Raises:
        TypeError: a dtype is not allowed (x floating, scale floating, zero_point integer).
        ValueError: a shape, block_size, range, device or (on CPU) a value is wrong: the message names the argument.
        ValueError: grad_factor is not finite and > 0, or None with quant_max < 1.
    """
    if type(grad_factor) is int:  # the op takes a float
        grad_factor = float(grad_factor)
    if grad_factor is not None and type(grad_factor) is not float:  # e.g. a bool, which the op would take as 1.0
        _check_learnable_args(x, block_size, scale, zero_point, quant_min, quant_max, grad_factor, minval)
    return _call(
        _OP_AFFINE_LEARNABLE, _check_learnable_args,
        block_size, (quant_min, quant_max), x, block_size, scale, zero_point, quant_min, quant_max, grad_factor,
        minval,
    )



# ---------------------------------------------------------------------------
# Float formats: FP8 E4M3 / E5M2 and FP4 E2M1 with static scales, and the
# block-scaled MX and NVFP4 formats whose scales the kernel computes.



def fake_quantize_float_with_mask(
    x: torch.Tensor, block_size: Sequence[int], scale: torch.Tensor, dtype: Union[torch.dtype, str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like `fake_quantize_float`, and also returns the bit-packed clamp mask.

    Args:
        x: float32, bfloat16 or float16 tensor.
        block_size: one entry per dimension of x, as in fake_quantize_affine.
        scale: floating, shape ceil(x.shape / block_size).
        dtype: the element: "e4m3", "e5m2", "e2m1" or its torch dtype.

    Returns:
        (y, mask): y as fake_quantize_float gives it and the packed clamp mask.

    Raises:
        TypeError: x or scale is not floating.
        ValueError: an unknown element, a wrong block_size or scale shape, or (on CPU) a scale not finite and > 0.
    """
    fmt = _elem_format("pt2e_fq.fake_quantize_float", "dtype", dtype)
    return _call(
        _OP_FLOAT, _check_float_args, block_size, (), x, block_size, scale, fmt
    )


def fake_quantize_float(
    x: torch.Tensor, block_size: Sequence[int], scale: torch.Tensor, dtype: Union[torch.dtype, str]
) -> torch.Tensor:
    """FP8 / FP4 fake quantization with static scales in one fused op
    (differentiable).

        y = cast_rne(clamp(x / scale, -fmax, fmax)) * scale

    dtype is an element of `pt2e_fq.spec.formats.ELEMENTS`, by name or torch
    dtype: "e4m3" (torch.float8_e4m3fn), "e5m2" (torch.float8_e5m2) or
    "e2m1" (torch.float4_e2m1fn_x2: 0, 0.5, 1, 1.5, 2, 3, 4, 6). The
    cast rounds to nearest, ties to even, with the format's subnormals.
    `block_size` and scale are as in `fake_quantize_affine` (per-tensor,
    per-channel, per-block; ragged last block). The gradient is dy where
    |x / scale| <= fmax and 0 elsewhere. NaN gives NaN; +-Inf gives
    +-fmax * scale.

    Args:
        x: float32, bfloat16 or float16 tensor.
        block_size: one entry per dimension of x, as in fake_quantize_affine.
        scale: floating, shape ceil(x.shape / block_size).
        dtype: the element: "e4m3", "e5m2", "e2m1" or its torch dtype.

    Returns:
        y, x's shape and dtype.

    Raises:
        TypeError: x or scale is not floating.
        ValueError: an unknown element, a wrong block_size or scale shape, or (on CPU) a scale not finite and > 0.
    """
    return fake_quantize_float_with_mask(x, block_size, scale, dtype)[0]


def fake_quantize_mx_with_scales(
    x: torch.Tensor, elem_dtype: Union[torch.dtype, str], block_size: int = MX_BLOCK, axis: int = -1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like `fake_quantize_mx`, and also returns the block scales: fp32
    powers of two (exact E8M0 values, NaN for a block with a NaN) of x's
    shape with `axis` cut to ceil(size / block_size).

    Args:
        x: float32, bfloat16 or float16 tensor.
        elem_dtype: "e4m3", "e5m2" (MXFP8) or "e2m1" (MXFP4), or the torch dtype.
        block_size: elements per scale along axis (32 in the MX specification).
        axis: the dimension the blocks run along.

    Returns:
        (y, scales): y as fake_quantize_mx gives it and the fp32 E8M0 block scales.

    Raises:
        TypeError: x is not floating.
        ValueError: an unknown element, block_size < 1, or axis out of range.
    """
    op = "pt2e_fq.fake_quantize_mx"
    fmt = _elem_format(op, "elem_dtype", elem_dtype)
    y, _, scales = _call(
        _OP_MX, lambda x, fmt, b, a: _check_axis_blocks(op, x, b, a),
        block_size, (axis,), x, fmt, block_size, axis,
    )
    return y, scales


def fake_quantize_mx(
    x: torch.Tensor, elem_dtype: Union[torch.dtype, str], block_size: int = MX_BLOCK, axis: int = -1
) -> torch.Tensor:
    """MX fake quantization (OCP Microscaling v1.0) in one fused op
    (differentiable): MXFP8 with elem_dtype "e4m3" or "e5m2" (or their
    torch dtypes), MXFP4 with "e2m1" (torch.float4_e2m1fn_x2).

    Per block of `block_size` consecutive elements along `axis` (the last
    block may be shorter), the kernel computes the E8M0 scale
        X = 2^clamp(floor(log2(max |x|)) - emax_elem, -127, 127)
    (emax_elem: the element's `emax`) and returns cast_rne(clamp(x / X, -fmax, fmax)) * X.
    A block with a NaN is all NaN. The gradient is dy where |x / X| <= fmax.

    Args:
        x: float32, bfloat16 or float16 tensor.
        elem_dtype: "e4m3", "e5m2" (MXFP8) or "e2m1" (MXFP4), or the torch dtype.
        block_size: elements per scale along axis (32 in the MX specification).
        axis: the dimension the blocks run along.

    Returns:
        y, x's shape and dtype.

    Raises:
        TypeError: x is not floating.
        ValueError: an unknown element, block_size < 1, or axis out of range.
    """
    return fake_quantize_mx_with_scales(x, elem_dtype, block_size, axis)[0]


def fake_quantize_nvfp4_with_scales(
    x: torch.Tensor, global_scale: Optional[torch.Tensor] = None, axis: int = -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Like `fake_quantize_nvfp4`, and also returns the E4M3 block scales (as
    fp32, x's shape with `axis` cut to ceil(size / 16)) and the fp32 global
    scale used (a 0-dim tensor).

    Args:
        x: float32, bfloat16 or float16 tensor.
        global_scale: a 0-dim (or one-element) floating tensor, finite and > 0; None to compute it from x.
        axis: the dimension the blocks of 16 run along.

    Returns:
        (y, block_scales, global_scale): y as fake_quantize_nvfp4 gives it, the E4M3 block scales as fp32, the global scale used.

    Raises:
        TypeError: x or global_scale is not floating.
        ValueError: axis out of range, or (on CPU) a global_scale not finite and > 0.
    """
    y, _, block_scales, used_global = _call(
        _OP_NVFP4, _check_nvfp4_args, (), (axis,), x, global_scale, axis
    )
    return y, block_scales, used_global


def fake_quantize_nvfp4(
    x: torch.Tensor, global_scale: Optional[torch.Tensor] = None, axis: int = -1
) -> torch.Tensor:
    """NVFP4 fake quantization in one fused op (differentiable): E2M1
    elements in blocks of 16 along `axis`, an E4M3 scale per block under an
    fp32 global scale g:

        g   = global_scale, or max|x| / (448 * 6) computed in the kernel
              (1 when that is 0 or Inf)
        s_b = e4m3_rne_sat(max_block|x| / 6 / g)
        y   = cast_e2m1(clamp(x / (s_b * g), -6, 6)) * (s_b * g)

    A block whose scale s_b * g is 0 becomes 0 with gradient dy. global_scale
    must be finite and > 0. The gradient is dy where |x / (s_b * g)| <= 6.

    Args:
        x: float32, bfloat16 or float16 tensor.
        global_scale: a 0-dim (or one-element) floating tensor, finite and > 0; None to compute it from x.
        axis: the dimension the blocks of 16 run along.

    Returns:
        y, x's shape and dtype.

    Raises:
        TypeError: x or global_scale is not floating.
        ValueError: axis out of range, or (on CPU) a global_scale not finite and > 0.
    """
    return fake_quantize_nvfp4_with_scales(x, global_scale, axis)[0]
