"""Fake (meta) implementations of the pt2e_fq ops: shape propagation for
torch.export and torch.compile, with the wrappers' argument checks
(private to pt2e_fq.ops; importing pt2e_fq.ops registers them)."""

from __future__ import annotations

import torch

from ..spec.formats import NVFP4_BLOCK
from ._checks import (
    _LEARNABLE_OP,
    _block_scale_shape,
    _check_affine_args,
    _check_affine_observe_args,
    _check_axis_blocks,
    _check_float_args,
    _check_float_observe_args,
    _check_finite_range_args,
    _check_format_name,
    _check_histogram_args,
    _check_learnable_args,
    _check_nvfp4_args,
)
from .blocks import reduced_shape


def _empty_outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    mask = x.new_empty(((x.numel() + 7) // 8,), dtype=torch.uint8)
    return y, mask


@torch.library.register_fake("pt2e_fq::fake_quantize_affine")
def _fake_quantize_affine_fake(x, block_size, scale, zero_point, quant_min, quant_max, minval=None):
    _check_affine_args(x, block_size, scale, zero_point, quant_min, quant_max, minval)
    return _empty_outputs(x)


@torch.library.register_fake("pt2e_fq::fake_quantize_affine_learnable")
def _fake_quantize_affine_learnable_fake(x, block_size, scale, zero_point, quant_min, quant_max, grad_factor,
                                         minval=None):
    _check_learnable_args(x, block_size, scale, zero_point, quant_min, quant_max, grad_factor, minval)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("pt2e_fq::fake_quantize_affine_learnable_backward")
def _fake_quantize_affine_learnable_backward_fake(grad, x, block_size, scale, zero_point, quant_min, quant_max,
                                                  grad_factor, minval=None):
    _check_learnable_args(x, block_size, scale, zero_point, quant_min, quant_max, grad_factor, minval)
    if grad.shape != x.shape or grad.dtype != x.dtype:
        raise ValueError(
            f"{_LEARNABLE_OP}_backward: grad must have x's shape {tuple(x.shape)} and dtype {x.dtype}, "
            f"got {tuple(grad.shape)} {grad.dtype}"
        )
    per_block = x.new_empty(reduced_shape(x.shape, block_size), dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), per_block, torch.empty_like(per_block)


@torch.library.register_fake("pt2e_fq::ste_grad")
def _ste_grad_fake(grad, mask):
    return torch.empty_like(grad, memory_format=torch.contiguous_format)

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

@torch.library.register_fake("pt2e_fq::fake_quantize_affine_observe")
def _affine_observe_fake(x, block_size, min_val, max_val, scale, offset, nonfinite, quant_min, quant_max, scheme,
                         range_limit, averaging_constant=None):
    _check_affine_observe_args(x, block_size, min_val, max_val, scale, offset, nonfinite, quant_min, quant_max,
                               scheme, range_limit, averaging_constant)
    return _empty_outputs(x)


@torch.library.register_fake("pt2e_fq::fake_quantize_float_observe")
def _float_observe_fake(x, block_size, min_val, max_val, scale, nonfinite, fmt, averaging_constant=None):
    _check_float_observe_args(x, block_size, min_val, max_val, scale, nonfinite, fmt, averaging_constant)
    return _empty_outputs(x)


@torch.library.register_fake("pt2e_fq::block_histogram")
def _block_histogram_fake(x, block_size, lo, hi, bins):
    _check_histogram_args(x, block_size, lo, hi, bins)
    counts = x.new_empty((*reduced_shape(x.shape, block_size), bins), dtype=torch.float64)
    return counts, x.new_empty((), dtype=torch.int64)


@torch.library.register_fake("pt2e_fq::block_finite_range")
def _block_finite_range_fake(x, block_size):
    _check_finite_range_args(x, block_size)
    shape = reduced_shape(x.shape, block_size)
    return x.new_empty(shape, dtype=torch.float32), x.new_empty(shape, dtype=torch.float32)
