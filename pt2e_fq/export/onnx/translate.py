"""ONNX QuantizeLinear / DequantizeLinear for the pt2e_fq operators: the
custom translation table torch.onnx.export(dynamo=True) calls for each
fake-quant node (opset 21). Where the qparams go: layout.py.

    weight (x and qparams constant): stored codes -> DequantizeLinear
    activation: QuantizeLinear -> DequantizeLinear (computed scales: MX)

The codes of a weight are computed here as the kernel computes them (fp32,
IEEE division; round half to even for integers, the saturating
round-to-nearest-even cast for FP8), so the file holds integers or FP8 and
no float copy.

fake_quantize_affine (integer formats):
- type: the narrowest of int4, uint4, int8, uint8, int16, uint16 holding
  [quant_min, quant_max]. A narrower range (symmetric narrow, odd widths) is
  clamped by an integer Clip between Q and DQ for int8 / uint8; for the other
  types (ONNX has no int4 Clip; ONNX Runtime has no int16 Clip kernel) by
  Min / Max of the dequantized values against DQ(quant_max) / DQ(quant_min),
  the same thing since DQ is monotonic.
- MINVAL: q = round((x - minval) / scale) + quant_min, y = DQ(q) + minval,
  zero point quant_min; minval is repeated to x's shape by a DequantizeLinear
  of ones in its layout (exact), so per-group minvals stay small.

fake_quantize_float (FP8 E4M3FN / E5M2, static scales): Q / DQ to FP8 with
saturation, as the kernel's saturating cast.

fake_quantize_mx (MXFP8): a weight is stored as FP8 codes with its E8M0 block
scales as fp32 powers of two (ONNX Runtime rejects a FLOAT8E8M0 scale); an
activation's scales are computed in the graph exactly as the kernel does:
X = 2^(floor(log2(max |block|)) - emax_elem) clamped to [2^-127, 2^127],
floor(log2) by Log, Floor and Pow, corrected by one where Log rounded across
a power of two.

E2M1 (FP4_E2M1, MXFP4, NVFP4) elements are refused by to_onnx before export
(E2M1_UNSUPPORTED says why).

x in bfloat16 / float16 is cast to float32 and back: the ops compute in fp32.
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset21 as op

from ... import ops
from ...ops.blocks import expand_blocks
from ...ops.float_cast import cast_float
from ...spec.format_kinds import OpCall
from ...graph import decode
from .layout import FP8, PointTranslation, constant, int_type, numpy_array

pt2e_fq_ops = torch.ops.pt2e_fq
_CLIP_TYPES = (ir.DataType.INT8, ir.DataType.UINT8)  # integer Clip that ONNX Runtime runs
E2M1_UNSUPPORTED = (
    "E2M1 (FP4) elements: ONNX represents them as FLOAT4E2M1 from opset 23 (Q / DQ with block "
    "scales; NVFP4 as a DequantizeLinear of its E4M3 block scales by the global scale, then of the "
    "elements), but ONNX Runtime's CPU provider implements neither QuantizeLinear nor "
    "DequantizeLinear for FLOAT4E2M1, so such a file could not run or be checked; use FP8, MXFP8 "
    "or an integer format for ONNX"
)


def quantize_int(x: torch.Tensor, block_size, scale, zero_point, quant_min: int, quant_max: int, minval=None):
    """The integer codes fake_quantize_affine rounds x to, clamped, as a
    float tensor of x's shape."""
    shape = x.shape
    s = expand_blocks(scale.float(), shape, block_size)
    if minval is not None:
        q = torch.round((x.float() - expand_blocks(minval.float(), shape, block_size)) / s) + quant_min
    else:
        zp = 0.0 if zero_point is None else expand_blocks(zero_point.float(), shape, block_size)
        q = torch.round(x.float() / s) + zp
    return q.clamp(quant_min, quant_max)


def _float32(x):
    return x if x.dtype == ir.DataType.FLOAT else op.Cast(x, to=ir.DataType.FLOAT)


def _as_dtype(y, dtype: ir.DataType):
    return y if dtype == ir.DataType.FLOAT else op.Cast(y, to=dtype)


# Only y is carried: to_onnx refuses a graph that uses another output (the mask).
_NO_MASK = np.zeros(0, np.uint8)


def _affine(constants: Mapping[str, torch.Tensor], points: list) -> Callable:
    # The signature is the op's schema: torch.onnx matches the two.
    def fake_quantize_affine(x, block_size, scale, zero_point, quant_min, quant_max, minval=None):
        call = decode(pt2e_fq_ops.fake_quantize_affine.default,
                      (x, block_size, scale, zero_point, quant_min, quant_max, minval))
        return _translate_affine(call, constants, points)

    return fake_quantize_affine


def _translate_affine(call: OpCall, constants, points: list):
    x, scale, zero_point, minval = call.x, call.scale, call.zero_point, call.minval
    quant_min, quant_max = call.quant_min, call.quant_max
    p = PointTranslation(constants, x, call.block_size, scale.shape)
    p.set_scale(scale)
    qt = int_type(quant_min, quant_max)
    if minval is not None:
        zp = p.filled(quant_min, qt)
    elif zero_point is None:
        zp = p.filled(0, qt)
    else:
        zp = p.qparam(zero_point, qt)
    m = p.at_x_shape(minval, p.x_shape_value(x)) if minval is not None else None
    folded = all(p.const(v) is not None for v in (x, scale, zero_point, minval) if v is not None)
    if folded:  # a weight: store the integers
        q = quantize_int(p.const(x), p.block_size, p.const(scale), p.const(zero_point), quant_min, quant_max,
                         p.const(minval))
        y = p.dequantize(constant(numpy_array(q, qt)), zp)
    else:
        xf = _float32(x)
        q = p.quantize(xf if m is None else op.Sub(xf, m), zp)
        narrow = (quant_min, quant_max) != (qt.min, qt.max)
        if narrow and qt.onnx in _CLIP_TYPES:
            q = op.Clip(q, constant(np.array(quant_min, qt.numpy)), constant(np.array(quant_max, qt.numpy)))
        y = p.dequantize(q, zp)
        if narrow and qt.onnx not in _CLIP_TYPES:
            lo, hi = (p.dequantize(p.filled(v, qt), zp) for v in (quant_min, quant_max))
            y = op.Max(op.Min(y, hi), lo)
    if m is not None:
        y = op.Add(y, m)
    y = _as_dtype(y, x.dtype)
    _record(points, None if folded else x, y)
    return y, constant(_NO_MASK)


def _float(constants: Mapping[str, torch.Tensor], points: list) -> Callable:
    def fake_quantize_float(x, block_size, scale, fmt):
        call = decode(pt2e_fq_ops.fake_quantize_float.default, (x, block_size, scale, fmt))
        return _translate_float(call, constants, points)

    return fake_quantize_float


def _translate_float(call: OpCall, constants, points: list):
    x, scale, elem = call.x, call.scale, call.format.element
    qt = FP8[elem.name]
    p = PointTranslation(constants, x, call.block_size, scale.shape)
    p.set_scale(scale)
    zp = p.filled(0, qt)
    folded = p.const(x) is not None and p.const(scale) is not None
    if folded:
        s = expand_blocks(p.const(scale).float(), p.const(x).shape, p.block_size)
        q = cast_float(p.const(x).float() / s, elem.name).to(elem.torch_dtype)
        y = p.dequantize(constant(numpy_array(q, qt)), zp)
    else:
        y = p.dequantize(p.quantize(_float32(x), zp), zp)
    y = _as_dtype(y, x.dtype)
    _record(points, None if folded else x, y)
    return y, constant(_NO_MASK)


def _mx_scales(xf, p: PointTranslation, axis: int, block: int, emax: int):
    """The E8M0 block scales of x (fp32, x's shape with `axis` cut to
    ceil(size / block)), computed as the kernel does."""
    size = p.x_shape[axis]
    if size is None:
        raise NotImplementedError(f"to_onnx: MX blocks need a static size along axis {axis}")
    nblocks = -(-size // block)
    a = op.Abs(xf)
    if nblocks * block != size:  # zero-pad the last block: max |x| is unchanged
        pads = [0] * (2 * len(p.x_shape))
        pads[len(p.x_shape) + axis] = nblocks * block - size
        a = op.Pad(a, constant(np.array(pads, np.int64)))
    if None in p.x_shape:  # a symbolic dim: the block shape from x's shape at run time
        shape = op.Shape(a)
        split = op.Concat(
            op.Slice(shape, constant(np.array([0], np.int64)), constant(np.array([axis], np.int64))),
            constant(np.array([nblocks, block], np.int64)),
            op.Slice(shape, constant(np.array([axis + 1], np.int64)), constant(np.array([len(p.x_shape)], np.int64))),
            axis=0,
        )
    else:  # what the exporter's constant folding would make of the above, without the work
        split = constant(np.array(p.x_shape[:axis] + [nblocks, block] + p.x_shape[axis + 1:], np.int64))
    blocks = op.Reshape(a, split)
    within = constant(np.array([axis + 1], np.int64))
    amax = op.ReduceMax(blocks, within, keepdims=0)
    # ORT's ReduceMax gives NaN only when the NaN comes first; the kernel's amax
    # (and so the whole block) is NaN wherever it is.
    has_nan = op.Greater(op.ReduceMax(op.Cast(op.IsNaN(blocks), to=ir.DataType.FLOAT), within, keepdims=0),
                         constant(np.array(0.0, np.float32)))
    # 2^floor(log2(amax)): Log is not exact near powers of two; one correction each way makes it so.
    two = constant(np.array(2.0, np.float32))
    pow2 = op.Pow(two, op.Floor(op.Div(op.Log(amax), constant(np.array(np.log(2.0), np.float32)))))
    pow2 = op.Where(op.Greater(pow2, amax), op.Div(pow2, two), pow2)
    pow2 = op.Where(op.LessOrEqual(op.Mul(pow2, two), amax), op.Mul(pow2, two), pow2)
    scale = op.Mul(pow2, constant(np.array(2.0**-emax, np.float32)))  # exact: a power of two >= 2^-149
    scale = op.Min(op.Max(scale, constant(np.array(2.0**-127, np.float32))), constant(np.array(2.0**127, np.float32)))
    return op.Where(has_nan, constant(np.array(np.nan, np.float32)), scale)  # a block with NaN is all NaN


def _mx(constants: Mapping[str, torch.Tensor], points: list) -> Callable:
    def fake_quantize_mx(x, elem_fmt, block_size, axis):
        call = decode(pt2e_fq_ops.fake_quantize_mx.default, (x, elem_fmt, block_size, axis))
        return _translate_mx(call, constants, points)

    return fake_quantize_mx


def _translate_mx(call: OpCall, constants, points: list):
    x, axis, elem = call.x, call.axis % len(call.x.shape), call.format.element
    block = call.block_size[axis]
    qt = FP8[elem.name]
    scale_shape = [(-(-s // block) if d == axis else s) if isinstance(s, int) else s for d, s in enumerate(x.shape)]
    p = PointTranslation(constants, x, call.block_size, scale_shape)
    xc = p.const(x)
    if xc is not None:  # a weight: FP8 codes and the block scales the kernel computes
        _, scales = ops.fake_quantize_mx_with_scales(xc.detach(), elem.name, block, axis)
        p.set_scale(scales)
        s = expand_blocks(scales, xc.shape, call.block_size)
        q = cast_float(xc.float() / s, elem.name).to(elem.torch_dtype)
        y = p.dequantize(constant(numpy_array(q, qt)), p.filled(0, qt))
    else:
        xf = _float32(x)
        p.set_scale(_mx_scales(xf, p, axis, block, elem.emax))
        zp = p.filled(0, qt)
        y = p.dequantize(p.quantize(xf, zp), zp)
    y = _as_dtype(y, x.dtype)
    _record(points, None if xc is not None else x, y)
    return y, constant(_NO_MASK), constant(np.zeros(0, np.float32))  # only y is carried


def _record(points: list, x, y) -> None:
    """Appends a point's (input, the input's consumers, output). The exporter's
    optimizer may remove the node that produced x (an Identity: the clone of
    an eval-mode Dropout) and hand its consumers x's source instead; the
    consumers, taken now, then name the value the point reads in the file."""
    points.append((x, () if x is None else tuple(x.uses()), y))


def translation_table(constants: Mapping[str, torch.Tensor], points: list) -> dict[Callable, Callable]:
    """{pt2e_fq op: onnxscript translation}; `constants` maps the program's
    placeholder names to their tensors (parameters, buffers, constants).
    Each translation appends to `points` its (input, input's consumers,
    output) ONNX values, input None where x was a constant stored as codes."""
    from .scale import translate_float_scale

    return {
        torch.ops.pt2e_fq_onnx.float_scale.default: translate_float_scale,
        pt2e_fq_ops.fake_quantize_affine.default: _affine(constants, points),
        pt2e_fq_ops.fake_quantize_float.default: _float(constants, points),
        pt2e_fq_ops.fake_quantize_mx.default: _mx(constants, points),
    }
