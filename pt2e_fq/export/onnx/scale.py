"""A dynamic FP8 point's scale as one op while to_onnx traces the model.

The scale of a dynamic scaled-float point, max |finite x| per block / fmax
floored at the smallest normal fp32 (format_kinds._ScaledFloat.current_qparams),
is six ATen ops. to_onnx traces the model twice (torch.export, then
torch.onnx's decomposition), at a cost per node, so inside `fused_scales()`
the scale is traced as one call of `pt2e_fq_onnx::float_scale`, which the
ONNX translation expands into the ONNX ops torch.onnx writes for those six
ATen ops (Abs, Less, Where, ReduceMax, Div, Clip): the same file, in about a
tenth less time on a CNN whose every conv input is a dynamic FP8 point
(efficientnet_b0 fp8: to_onnx 10.6-11.6 -> 9.3-10.1 s CPU, loaded VM).

It applies where x is fp32 and every block spans whole dimensions or single
elements (per-tensor, per-channel, per-token); elsewhere the ATen ops are
traced as before. `save` never uses it: a .pt2 holds ATen ops only.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import numpy as np
import torch
from onnxscript import opset21 as op

from ...ops.blocks import block_abs_max, whole_dims
from ...spec import format_kinds
from ...spec.qparams import FLOAT_SCALE_TINY, float_scale_from_amax
from .layout import constant


@torch.library.custom_op("pt2e_fq_onnx::float_scale", mutates_args=())
def float_scale(x: torch.Tensor, dims: list[int], fmax: float) -> torch.Tensor:
    """float_scale_from_amax(max |finite x| over `dims`, kept as size 1, fmax)."""
    block_size = [s if d in dims else 1 for d, s in enumerate(x.shape)]
    return float_scale_from_amax(block_abs_max(x, block_size), fmax)


@float_scale.register_fake
def _(x, dims, fmax):
    return x.new_empty([1 if d in dims else s for d, s in enumerate(x.shape)], dtype=torch.float32)


def _fused(x: torch.Tensor, block_size, fmax: float) -> Optional[torch.Tensor]:
    if x.dtype != torch.float32:
        return None
    dims = whole_dims(x.shape, block_size)
    return None if dims is None else torch.ops.pt2e_fq_onnx.float_scale(x, dims, float(fmax))


@contextlib.contextmanager
def fused_scales() -> Iterator[None]:
    """Dynamic scaled-float scales trace as pt2e_fq_onnx::float_scale inside."""
    previous = format_kinds.FUSED_FLOAT_SCALE
    format_kinds.FUSED_FLOAT_SCALE = _fused
    try:
        yield
    finally:
        format_kinds.FUSED_FLOAT_SCALE = previous


def translate_float_scale(x, dims, fmax):
    """The ONNX ops torch.onnx writes for the ATen ops of float_scale: Abs,
    Less (|x| < inf), Where, ReduceMax (keepdims), Div, Clip (min only)."""
    a = op.Abs(x)
    a = op.Where(op.Less(a, constant(np.array(math.inf, np.float32))), a, constant(np.array(0.0, np.float32)))
    amax = op.ReduceMax(a, constant(np.array(dims, np.int64)), keepdims=1)
    return op.Clip(op.Div(amax, constant(np.array(fmax, np.float32))), constant(np.array(FLOAT_SCALE_TINY, np.float32)))
