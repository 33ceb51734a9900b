"""Python entry points of the fused fake-quant operators.

Each public function validates its arguments (shapes and dtypes only: reading
values would sync the host with the device) and calls one `torch.ops.pt2e_fq`
operator, so torch.export and torch.compile see exactly one node. This module
also registers the operators' fake (meta) implementations and their autograd
formula: a straight-through estimator through the bit-packed clamp mask, the
only tensor the autograd node saves.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .blocks import check_block_size, check_qparam, reduced_shape

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


def _ste_backward(ctx, grad_y, grad_mask):
    if grad_y is None:  # y did not reach the loss
        return None
    (mask,) = ctx.saved_tensors
    return torch.ops.pt2e_fq.ste_grad(grad_y.contiguous(), mask)


def register_ste_autograd(op_name: str, num_inputs: int) -> None:
    """Registers the STE backward for an op whose first input is x and whose
    outputs are (y, packed mask); the other inputs get no gradient."""

    def backward(ctx, grad_y, grad_mask):
        return (_ste_backward(ctx, grad_y, grad_mask),) + (None,) * (num_inputs - 1)

    torch.library.register_autograd(op_name, backward, setup_context=_save_mask)


register_ste_autograd("pt2e_fq::fake_quantize_affine", num_inputs=7)
