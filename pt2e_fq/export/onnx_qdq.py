"""ONNX QuantizeLinear / DequantizeLinear for the pt2e_fq operators: the
custom translation table that torch.onnx.export(dynamo=True) calls for each
fake-quant node.

Integer points (`fake_quantize_affine`) become, with opset-21 ops:

    weight (x, scale and zero point constant):
        integer initializer q -> DequantizeLinear
    activation:
        [x - minval] -> QuantizeLinear -> [Clip] -> DequantizeLinear [-> clamp] [+ minval]

- dtype: the smallest of int4, uint4, int8, uint8, int16, uint16 that holds
  [quant_min, quant_max]. A narrower range (symmetric narrow, odd widths) is
  clamped: by an integer Clip between Q and DQ for int8 / uint8, and for the
  other types (ONNX has no int4 Clip; ONNX Runtime has no int16 Clip kernel)
  by Max / Min on the dequantized values against DQ(quant_min) and
  DQ(quant_max), which is the same thing (DQ is monotonic).
- layout (from the scale's shape and block_size): per-tensor (scalar scale),
  per-axis (1-D scale, `axis`), or blocked (`axis`, `block_size`; the scale has
  x's rank). ONNX blocks along one axis only: a constant scale blocked along
  more axes is expanded along all but the last; a computed (dynamic) scale
  must not need that.
- MINVAL: q = round((x - minval) / scale) + quant_min, y = DQ(q) + minval,
  with zero point quant_min. minval is expanded to x's shape by a
  DequantizeLinear of ones (in minval's layout), which is exact.
- x in bfloat16 / float16 is cast to float32 and back: the op computes in fp32.

Constants are recognised by name: at translation time torch.onnx hands over
values named after the program's placeholders, and `translation_table` gets
the program's parameters, buffers and constants under those names. The
integer weight is computed here with torch's IEEE division and round half to
even, as the kernel does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import ml_dtypes
import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset21 as op

from ..blocks import reduced_shape
from ..reference import expand_blocks


@dataclass(frozen=True)
class IntType:
    onnx: ir.DataType
    numpy: type
    min: int
    max: int


# ONNX integer types a QuantizeLinear can produce in opset 21, narrowest first.
_INT_TYPES = (
    IntType(ir.DataType.INT4, ml_dtypes.int4, -8, 7),
    IntType(ir.DataType.UINT4, ml_dtypes.uint4, 0, 15),
    IntType(ir.DataType.INT8, np.int8, -128, 127),
    IntType(ir.DataType.UINT8, np.uint8, 0, 255),
    IntType(ir.DataType.INT16, np.int16, -(2**15), 2**15 - 1),
    IntType(ir.DataType.UINT16, np.uint16, 0, 2**16 - 1),
)
_INT8 = _INT_TYPES[2]
_CLIP_TYPES = (ir.DataType.INT8, ir.DataType.UINT8)  # integer Clip that ONNX Runtime runs


def int_type(quant_min: int, quant_max: int) -> IntType:
    """The narrowest ONNX integer type that holds [quant_min, quant_max]."""
    for t in _INT_TYPES:
        if t.min <= quant_min and quant_max <= t.max:
            return t
    raise ValueError(f"to_onnx: no ONNX integer type holds [{quant_min}, {quant_max}]")


@dataclass(frozen=True)
class Layout:
    """How ONNX Q/DQ apply a scale: kind 'tensor', 'axis' or 'block'."""

    kind: str
    axis: Optional[int] = None
    block: Optional[int] = None
    expand: tuple[int, ...] = ()  # dims along which the scale must be repeated

    @property
    def attributes(self) -> dict:
        if self.kind == "tensor":
            return {}
        if self.kind == "axis":
            return {"axis": self.axis}
        return {"axis": self.axis, "block_size": self.block}


def _static(dim) -> Optional[int]:
    """A dimension or block entry as an int, None when symbolic."""
    return dim if isinstance(dim, int) else None


def layout(x_shape: Sequence, scale_shape: Sequence, block_size: Sequence) -> Layout:
    """The ONNX layout of a scale of `scale_shape` = ceil(x_shape / block_size)
    (entries are None where symbolic)."""
    dims = range(len(scale_shape))
    varying = [d for d in dims if scale_shape[d] != 1]
    per_element = [d for d in varying if block_size[d] == 1]
    blocked = [d for d in varying if block_size[d] != 1]
    if not varying:
        return Layout("tensor")
    if len(varying) == 1 and not blocked:
        return Layout("axis", axis=varying[0])
    if blocked:  # along the last blocked dim
        axis, block = blocked[-1], block_size[blocked[-1]]
    else:  # per-token-like: one scale per row of a whole (static) dim
        whole = [d for d in dims if scale_shape[d] == 1 and x_shape[d] is not None]
        axis = whole[-1] if whole else len(scale_shape) - 1
        block = x_shape[axis] if whole else 1
    if block is None:
        raise NotImplementedError(f"to_onnx: blocked quantization needs a static block size along axis {axis}")
    # ONNX wants the scale at x's size on every other dim.
    expand = tuple(d for d in dims if d != axis and d not in per_element and x_shape[d] != 1)
    return Layout("block", axis=axis, block=block, expand=expand)


def _qparam_in_layout(t: torch.Tensor, x_shape, block_size, lay: Layout) -> torch.Tensor:
    """A constant per-block tensor (reduced shape) in the ONNX layout."""
    if lay.kind == "tensor":
        return t.reshape(())
    if lay.kind == "axis":
        return t.reshape(-1)
    if None in x_shape or None in block_size:
        raise NotImplementedError(f"to_onnx: a blocked scale needs static shapes, got x of shape {x_shape}")
    red = reduced_shape(x_shape, block_size)
    shape = [s if d in lay.expand else r for d, (s, r) in enumerate(zip(x_shape, red))]
    block = [b if d in lay.expand else 1 for d, b in enumerate(block_size)]
    return expand_blocks(t, shape, block)


def _constant(array: np.ndarray):
    return op.Constant(value=ir.tensor(np.array(array, copy=True, order="C")))


def quantize(x: torch.Tensor, block_size, scale, zero_point, quant_min: int, quant_max: int, minval=None):
    """The integer codes the op rounds x to (fp32, IEEE division, round half to
    even, clamped), as a float tensor of x's shape."""
    shape = x.shape
    s = expand_blocks(scale.float(), shape, block_size)
    if minval is not None:
        q = torch.round((x.float() - expand_blocks(minval.float(), shape, block_size)) / s) + quant_min
    else:
        zp = 0.0 if zero_point is None else expand_blocks(zero_point.float(), shape, block_size)
        q = torch.round(x.float() / s) + zp
    return q.clamp(quant_min, quant_max)


class _Point:
    """One fake_quantize_affine node being translated: its constants, ONNX
    integer type and layout."""

    def __init__(self, constants: Mapping[str, torch.Tensor], x, block_size, scale, quant_min, quant_max):
        self.constants = constants
        self.x_shape = [_static(d) for d in x.shape]
        self.block_size = [_static(b) for b in block_size]
        self.layout = layout(self.x_shape, [_static(d) for d in scale.shape], self.block_size)
        self.itype = int_type(quant_min, quant_max)
        self.scale_shape: Optional[tuple] = None  # static shape of the scale in layout, when constant
        self.scale = self.qparam(scale)

    def const(self, value) -> Optional[torch.Tensor]:
        return None if value is None else self.constants.get(value.name)

    def qparam(self, value, dtype=np.float32):
        """A qparam (scale, zero point, minval) in the ONNX layout."""
        lay = self.layout
        t = self.const(value)
        if t is not None:
            t = _qparam_in_layout(t.detach(), self.x_shape, self.block_size, lay).cpu().numpy().astype(dtype)
            self.scale_shape = self.scale_shape or t.shape
            return _constant(t)
        if lay.expand:
            raise NotImplementedError(
                f"to_onnx: a computed (dynamic) qparam of shape {list(value.shape)} for x of shape "
                f"{self.x_shape} would need repeating along dims {list(lay.expand)}; ONNX blocks along "
                "one axis only"
            )
        if lay.kind != "block":
            value = op.Reshape(value, _constant(np.array([] if lay.kind == "tensor" else [-1], np.int64)))
        if dtype is not np.float32:
            value = op.Cast(value, to=ir.DataType.from_numpy(np.dtype(dtype)))
        return value

    def filled(self, value: int, itype: IntType):
        """A tensor of the scale's (layout) shape full of `value`."""
        if self.scale_shape is not None:
            return _constant(np.full(self.scale_shape, value, itype.numpy))
        return op.Expand(_constant(np.array(value, itype.numpy)), op.Shape(self.scale))

    def dequantize(self, q, zero_point):
        return op.DequantizeLinear(q, self.scale, zero_point, **self.layout.attributes)

    def at_x_shape(self, minval, x_shape):
        """minval (per block) repeated to x's shape: DQ(ones) in minval's
        layout, which is exactly minval."""
        m = self.qparam(minval)
        ones = op.ConstantOfShape(x_shape, value=ir.tensor(np.array([1], np.int8)))
        return op.DequantizeLinear(ones, m, self.filled(0, _INT8), **self.layout.attributes)


def translation_table(constants: Mapping[str, torch.Tensor], points: list) -> dict[Callable, Callable]:
    """{pt2e_fq op: onnxscript translation}; `constants` maps the program's
    placeholder names to their tensors (parameters, buffers, constants).
    Each translation appends to `points` its (input, output) ONNX values,
    input None where x was a constant folded into the file."""

    def fake_quantize_affine(x, block_size, scale, zero_point, quant_min, quant_max, minval=None):
        p = _Point(constants, x, block_size, scale, quant_min, quant_max)
        it = p.itype
        if minval is not None:
            zp = p.filled(quant_min, it)
        elif zero_point is None:
            zp = p.filled(0, it)
        else:
            zp = p.qparam(zero_point, it.numpy)
        dtype = x.dtype
        if all(s is not None for s in p.x_shape):
            x_shape = _constant(np.array(p.x_shape, np.int64))
        else:
            x_shape = op.Shape(x)
        m = p.at_x_shape(minval, x_shape) if minval is not None else None
        consts = [p.const(v) for v in (x, scale, zero_point, minval) if v is not None]
        folded = all(c is not None for c in consts)
        if folded:  # a weight: store the integers
            q = quantize(p.const(x).detach(), p.block_size, p.const(scale), p.const(zero_point),
                         quant_min, quant_max, p.const(minval))
            y = p.dequantize(_constant(q.cpu().numpy().astype(it.numpy)), zp)
        else:
            xf = x if dtype == ir.DataType.FLOAT else op.Cast(x, to=ir.DataType.FLOAT)
            if m is not None:
                xf = op.Sub(xf, m)
            q = op.QuantizeLinear(xf, p.scale, zp, **p.layout.attributes)
            narrow = (quant_min, quant_max) != (it.min, it.max)
            if narrow and it.onnx in _CLIP_TYPES:
                q = op.Clip(q, _constant(np.array(quant_min, it.numpy)), _constant(np.array(quant_max, it.numpy)))
            y = p.dequantize(q, zp)
            if narrow and it.onnx not in _CLIP_TYPES:
                lo, hi = (p.dequantize(p.filled(v, it), zp) for v in (quant_min, quant_max))
                y = op.Max(op.Min(y, hi), lo)
        if m is not None:
            y = op.Add(y, m)
        if dtype != ir.DataType.FLOAT:
            y = op.Cast(y, to=dtype)
        points.append((None if folded else x, y))
        return y, _constant(np.zeros(0, np.uint8))  # the clamp mask is not carried (see to_onnx)

    return {torch.ops.pt2e_fq.fake_quantize_affine.default: fake_quantize_affine}
