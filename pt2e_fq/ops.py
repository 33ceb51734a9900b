"""Python entry points of the fused fake-quant operators.

Each public function validates its arguments (shapes and dtypes only: reading
values would sync the host with the device) and calls one `torch.ops.pt2e_fq`
operator, so torch.export and torch.compile see exactly one node. This module
also registers the operators' fake (meta) implementations and their autograd
formula: a straight-through estimator through the bit-packed clamp mask, the
only tensor the autograd node saves.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .blocks import check_block_size, check_qparam, reduced_shape
from .formats import ELEMENTS, MX_BLOCK, NVFP4_BLOCK, element

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT16_MIN, _INT16_MAX = -(2**15), 2**15 - 1


def _check_x(op: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: x must be float32, bfloat16 or float16, got {x.dtype}")


def _check_affine_args(x, block_size, scale, zero_point, quant_min, quant_max, minval) -> None:
    op = "pt2e_fq.fake_quantize_affine"
    _check_x(op, x)
    check_block_size(op, x, block_size)
    for name, v in (("quant_min", quant_min), ("quant_max", quant_max)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{op}: {name} must be an int, got {type(v).__name__}")
    if not (_INT16_MIN <= quant_min <= quant_max <= _INT16_MAX):
        raise ValueError(
            f"{op}: need {_INT16_MIN} <= quant_min <= quant_max <= {_INT16_MAX}, "
            f"got quant_min={quant_min}, quant_max={quant_max}"
        )
    expected = reduced_shape(x.shape, block_size)
    check_qparam(op, "scale", scale, x, expected)
    if not scale.dtype.is_floating_point:
        raise TypeError(f"{op}: scale must be a floating-point tensor, got {scale.dtype}")
    if zero_point is not None:
        if minval is not None:
            raise ValueError(
                f"{op}: give zero_point (ZP formulation) or minval (MINVAL formulation), not both"
            )
        check_qparam(op, "zero_point", zero_point, x, expected)
        if zero_point.dtype.is_floating_point or zero_point.dtype.is_complex or zero_point.dtype == torch.bool:
            raise TypeError(f"{op}: zero_point must have an integer dtype, got {zero_point.dtype}")
    if minval is not None:
        check_qparam(op, "minval", minval, x, expected)
        if not minval.dtype.is_floating_point:
            raise TypeError(f"{op}: minval must be a floating-point tensor, got {minval.dtype}")


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
    (uint8, ceil(numel / 8) bytes; see `unpack_mask`)."""
    block_size = list(block_size)
    _check_affine_args(x, block_size, scale, zero_point, quant_min, quant_max, minval)
    return torch.ops.pt2e_fq.fake_quantize_affine(
        x, block_size, scale, zero_point, quant_min, quant_max, minval
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
    """
    return fake_quantize_affine_with_mask(
        x, block_size, scale, zero_point, quant_min, quant_max, minval=minval
    )[0]


def unpack_mask(mask: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The bool clamp mask of the given shape from its bit-packed form."""
    numel = 1
    for s in shape:
        numel *= s
    bits = torch.arange(8, device=mask.device, dtype=torch.uint8)
    flat = ((mask.unsqueeze(-1) >> bits) & 1).reshape(-1)[:numel]
    return flat.bool().reshape(tuple(shape))


# ---------------------------------------------------------------------------
# Fake implementations (shape propagation for torch.export / torch.compile)


def _empty_outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    mask = x.new_empty(((x.numel() + 7) // 8,), dtype=torch.uint8)
    return y, mask


@torch.library.register_fake("pt2e_fq::fake_quantize_affine")
def _fake_quantize_affine_fake(x, block_size, scale, zero_point, quant_min, quant_max, minval=None):
    _check_affine_args(x, block_size, scale, zero_point, quant_min, quant_max, minval)
    return _empty_outputs(x)


@torch.library.register_fake("pt2e_fq::ste_grad")
def _ste_grad_fake(grad, mask):
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


# ---------------------------------------------------------------------------
# Autograd: a straight-through estimator through the packed mask.


def _save_mask(ctx, inputs, output):
    # The mask output never gets a gradient; without this, autograd fills a
    # zero tensor of its size for grad_mask on every backward.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(output[1])
    # Outputs after the mask (block scales) are statistics of x, not a
    # function to differentiate: mark them so, rather than return a wrong 0.
    ctx.mark_non_differentiable(*output[2:])


def _ste_backward(ctx, grad_y):
    if grad_y is None:  # y did not reach the loss
        return None
    (mask,) = ctx.saved_tensors
    return torch.ops.pt2e_fq.ste_grad(grad_y.contiguous(), mask)


def register_ste_autograd(op_name: str, num_inputs: int) -> None:
    """Registers the STE backward for an op whose first input is x and whose
    outputs are (y, packed mask, *extra) with non-differentiable extras (block
    scales); the other inputs get no gradient."""

    def backward(ctx, grad_y, *grad_others):
        return (_ste_backward(ctx, grad_y),) + (None,) * (num_inputs - 1)

    torch.library.register_autograd(op_name, backward, setup_context=_save_mask)


register_ste_autograd("pt2e_fq::fake_quantize_affine", num_inputs=7)


def _save_ste_mask(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _ste_grad_backward(ctx, grad_dx):
    # ste_grad is linear in its gradient (a select by the mask), so its own
    # gradient is the same select: this makes the STE twice differentiable,
    # as ATen's fake-quant backward is (d/dx sum(d(y^2)/dx) = 2 * mask).
    return _ste_backward(ctx, grad_dx), None


torch.library.register_autograd("pt2e_fq::ste_grad", _ste_grad_backward, setup_context=_save_ste_mask)


# ---------------------------------------------------------------------------
# Float formats: FP8 E4M3 / E5M2 and FP4 E2M1 with static scales, and the
# block-scaled MX and NVFP4 formats whose scales the kernel computes.

def _elem_format(op: str, what: str, value) -> str:
    """The element name the operators take, from a name or a torch dtype."""
    return element(op, what, value).name


def _check_format_name(op: str, what: str, name: str) -> None:
    if name not in ELEMENTS:
        raise ValueError(f"{op}: {what} must be one of {tuple(ELEMENTS)}, got {name!r}")


def _check_int(op: str, what: str, v) -> None:
    if not isinstance(v, (int, torch.SymInt)) or isinstance(v, bool):
        raise TypeError(f"{op}: {what} must be an int, got {type(v).__name__}")


def _check_axis_blocks(op: str, x: torch.Tensor, block_size: int, axis: int) -> None:
    _check_x(op, x)
    _check_int(op, "block_size", block_size)
    _check_int(op, "axis", axis)
    if block_size < 1:
        raise ValueError(f"{op}: block_size must be >= 1, got {block_size}")
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least one dimension, got a 0-dim tensor")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(
            f"{op}: axis must be in [{-x.dim()}, {x.dim()}) for x of shape {tuple(x.shape)}, got {axis}"
        )


def _block_scale_shape(x: torch.Tensor, block_size: int, axis: int) -> list:
    shape = list(x.shape)
    shape[axis] = -(-shape[axis] // block_size)
    return shape


def _check_float_args(x, block_size, scale, fmt) -> None:
    op = "pt2e_fq.fake_quantize_float"
    _check_x(op, x)
    check_block_size(op, x, block_size)
    _check_format_name(op, "fmt", fmt)
    check_qparam(op, "scale", scale, x, reduced_shape(x.shape, block_size))
    if not scale.dtype.is_floating_point:
        raise TypeError(f"{op}: scale must be a floating-point tensor, got {scale.dtype}")


def _check_nvfp4_args(x, global_scale, axis) -> None:
    op = "pt2e_fq.fake_quantize_nvfp4"
    _check_axis_blocks(op, x, NVFP4_BLOCK, axis)
    if global_scale is not None:
        check_qparam(op, "global_scale", global_scale, x, ())
        if not global_scale.dtype.is_floating_point:
            raise TypeError(f"{op}: global_scale must be a floating-point tensor, got {global_scale.dtype}")


def fake_quantize_float_with_mask(
    x: torch.Tensor, block_size: Sequence[int], scale: torch.Tensor, dtype: Union[torch.dtype, str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like `fake_quantize_float`, and also returns the bit-packed clamp mask."""
    block_size = list(block_size)
    fmt = _elem_format("pt2e_fq.fake_quantize_float", "dtype", dtype)
    _check_float_args(x, block_size, scale, fmt)
    return torch.ops.pt2e_fq.fake_quantize_float(x, block_size, scale, fmt)


def fake_quantize_float(
    x: torch.Tensor, block_size: Sequence[int], scale: torch.Tensor, dtype: Union[torch.dtype, str]
) -> torch.Tensor:
    """FP8 / FP4 fake quantization with static scales in one fused op
    (differentiable).

        y = cast_rne(clamp(x / scale, -fmax, fmax)) * scale

    dtype is an element of `pt2e_fq.formats.ELEMENTS`, by name or torch
    dtype: "e4m3" (torch.float8_e4m3fn), "e5m2" (torch.float8_e5m2) or
    "e2m1" (torch.float4_e2m1fn_x2: 0, 0.5, 1, 1.5, 2, 3, 4, 6). The
    cast rounds to nearest, ties to even, with the format's subnormals.
    `block_size` and scale are as in `fake_quantize_affine` (per-tensor,
    per-channel, per-block; ragged last block). The gradient is dy where
    |x / scale| <= fmax and 0 elsewhere. NaN gives NaN; +-Inf gives
    +-fmax * scale.
    """
    return fake_quantize_float_with_mask(x, block_size, scale, dtype)[0]


def fake_quantize_mx_with_scales(
    x: torch.Tensor, elem_dtype: Union[torch.dtype, str], block_size: int = MX_BLOCK, axis: int = -1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like `fake_quantize_mx`, and also returns the block scales: fp32
    powers of two (exact E8M0 values, NaN for a block with a NaN) of x's
    shape with `axis` cut to ceil(size / block_size)."""
    op = "pt2e_fq.fake_quantize_mx"
    fmt = _elem_format(op, "elem_dtype", elem_dtype)
    _check_axis_blocks(op, x, block_size, axis)
    y, _, scales = torch.ops.pt2e_fq.fake_quantize_mx(x, fmt, block_size, axis)
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
    """
    return fake_quantize_mx_with_scales(x, elem_dtype, block_size, axis)[0]


def fake_quantize_nvfp4_with_scales(
    x: torch.Tensor, global_scale: Optional[torch.Tensor] = None, axis: int = -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Like `fake_quantize_nvfp4`, and also returns the E4M3 block scales (as
    fp32, x's shape with `axis` cut to ceil(size / 16)) and the fp32 global
    scale used (a 0-dim tensor)."""
    _check_nvfp4_args(x, global_scale, axis)
    y, _, block_scales, used_global = torch.ops.pt2e_fq.fake_quantize_nvfp4(x, global_scale, axis)
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
    """
    return fake_quantize_nvfp4_with_scales(x, global_scale, axis)[0]


@torch.library.register_fake("pt2e_fq::fake_quantize_float")
def _fake_quantize_float_fake(x, block_size, scale, fmt):
    _check_float_args(x, block_size, scale, fmt)
    return _empty_outputs(x)


@torch.library.register_fake("pt2e_fq::fake_quantize_mx")
def _fake_quantize_mx_fake(x, elem_fmt, block_size, axis):
    op = "pt2e_fq.fake_quantize_mx"
    _check_format_name(op, "elem_fmt", elem_fmt)
    _check_axis_blocks(op, x, block_size, axis)
    scales = x.new_empty(_block_scale_shape(x, block_size, axis), dtype=torch.float32)
    return _empty_outputs(x) + (scales,)


@torch.library.register_fake("pt2e_fq::fake_quantize_nvfp4")
def _fake_quantize_nvfp4_fake(x, global_scale, axis):
    _check_nvfp4_args(x, global_scale, axis)
    scales = x.new_empty(_block_scale_shape(x, NVFP4_BLOCK, axis), dtype=torch.float32)
    return _empty_outputs(x) + (scales, x.new_empty((), dtype=torch.float32))


register_ste_autograd("pt2e_fq::fake_quantize_float", num_inputs=4)
register_ste_autograd("pt2e_fq::fake_quantize_mx", num_inputs=4)
register_ste_autograd("pt2e_fq::fake_quantize_nvfp4", num_inputs=3)
