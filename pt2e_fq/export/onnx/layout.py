"""Where a pt2e_fq op's qparams go in ONNX QuantizeLinear / DequantizeLinear.

- `QType`: the ONNX element type of a point: the narrowest integer type
  holding its range, or FP8 E4M3FN / E5M2.
- `layout`: per-tensor (scalar scale), per-axis (1-D scale, `axis`) or
  blocked (`axis`, `block_size`, a scale of x's rank), from the scale's shape
  and the op's block_size. ONNX blocks along one axis only: a constant scale
  blocked along more axes is repeated along all but the last; a computed
  (dynamic) scale must not need that.
- `PointTranslation`: one op being translated. It recognises constants by
  name (at translation time torch.onnx hands over values named after the
  program's placeholders, without data), puts qparams in the layout and
  builds Q / DQ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import ml_dtypes
import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset21 as op

from ...ops.blocks import expand_blocks, reduced_shape


@dataclass(frozen=True)
class QType:
    """An ONNX element type of QuantizeLinear's output. min / max: the range
    of an integer type (None for FP8)."""

    onnx: ir.DataType
    numpy: type
    min: Optional[int] = None
    max: Optional[int] = None


# ONNX integer types a QuantizeLinear can produce in opset 21, narrowest first.
_INT_TYPES = (
    QType(ir.DataType.INT4, ml_dtypes.int4, -8, 7),
    QType(ir.DataType.UINT4, ml_dtypes.uint4, 0, 15),
    QType(ir.DataType.INT8, np.int8, -128, 127),
    QType(ir.DataType.UINT8, np.uint8, 0, 255),
    QType(ir.DataType.INT16, np.int16, -(2**15), 2**15 - 1),
    QType(ir.DataType.UINT16, np.uint16, 0, 2**16 - 1),
)
INT8 = _INT_TYPES[2]
FP8 = {
    "e4m3": QType(ir.DataType.FLOAT8E4M3FN, ml_dtypes.float8_e4m3fn),
    "e5m2": QType(ir.DataType.FLOAT8E5M2, ml_dtypes.float8_e5m2),
}


def int_type(quant_min: int, quant_max: int) -> QType:
    """The narrowest ONNX integer type that holds [quant_min, quant_max]."""
    for t in _INT_TYPES:
        if t.min <= quant_min and quant_max <= t.max:
            return t
    raise ValueError(f"to_onnx: no ONNX integer type holds [{quant_min}, {quant_max}]")


def numpy_array(t: torch.Tensor, qtype: QType) -> np.ndarray:
    """A torch tensor of codes (integers as floats, or FP8) as qtype's numpy array."""
    t = t.detach().cpu()
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8).numpy().view(qtype.numpy)
    return t.numpy().astype(qtype.numpy)


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


def constant(array: np.ndarray):
    # np.array, not np.ascontiguousarray: that makes a 0-d array 1-d.
    return op.Constant(value=ir.tensor(np.array(array, copy=True, order="C")))


class PointTranslation:
    """One pt2e_fq op being translated: x's static shape, the op's
    block_size, the layout of its scale, and constants by name."""

    def __init__(self, constants: Mapping[str, torch.Tensor], x, block_size: Sequence, scale_shape: Sequence):
        self.constants = constants
        self.x_shape = [_static(d) for d in x.shape]
        self.block_size = [_static(b) for b in block_size]
        self.layout = layout(self.x_shape, [_static(d) for d in scale_shape], self.block_size)
        self.scale_shape: Optional[tuple] = None  # the scale's static shape in the layout, once known
        self.scale = None

    def const(self, value) -> Optional[torch.Tensor]:
        return None if value is None else self.constants.get(value.name)

    def set_scale(self, scale) -> None:
        """The scale (an ONNX value or a constant torch tensor) in the layout."""
        self.scale = self.qparam(scale)

    def _in_layout(self, t: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        if lay.kind == "tensor":
            return t.reshape(())
        if lay.kind == "axis":
            return t.reshape(-1)
        if None in self.x_shape or None in self.block_size:
            raise NotImplementedError(f"to_onnx: a blocked scale needs static shapes, got x of shape {self.x_shape}")
        red = reduced_shape(self.x_shape, self.block_size)
        shape = [s if d in lay.expand else r for d, (s, r) in enumerate(zip(self.x_shape, red))]
        block = [b if d in lay.expand else 1 for d, b in enumerate(self.block_size)]
        return expand_blocks(t, shape, block)

    def qparam(self, value, qtype: Optional[QType] = None):
        """A qparam (an ONNX value, constant or computed, or a torch tensor)
        in the layout, as float32 or as qtype."""
        t = value if isinstance(value, torch.Tensor) else self.const(value)
        if t is not None:
            t = self._in_layout(t.detach().float())
            array = numpy_array(t, qtype) if qtype is not None else t.cpu().numpy()
            if self.scale_shape is None:
                self.scale_shape = array.shape
            return constant(array)
        lay = self.layout
        if lay.expand:
            raise NotImplementedError(
                f"to_onnx: a computed (dynamic) qparam of shape {list(value.shape)} for x of shape "
                f"{self.x_shape} would need repeating along dims {list(lay.expand)}; ONNX blocks along "
                "one axis only"
            )
        if lay.kind != "block":
            value = op.Reshape(value, constant(np.array([] if lay.kind == "tensor" else [-1], np.int64)))
        if qtype is not None:
            value = op.Cast(value, to=qtype.onnx)
        return value

    def filled(self, value, qtype: QType):
        """A tensor of the scale's (layout) shape full of `value`."""
        if self.scale_shape is not None:
            return constant(np.full(self.scale_shape, value, qtype.numpy))
        if qtype.min is None:
            # ONNX's Expand takes FP8 but ONNX Runtime's has no FP8 kernel
            # (the session refuses the file): expand in float32, then cast.
            return op.Cast(op.Expand(constant(np.array(value, np.float32)), op.Shape(self.scale)), to=qtype.onnx)
        return op.Expand(constant(np.array(value, qtype.numpy)), op.Shape(self.scale))

    def quantize(self, x, zero_point):
        return op.QuantizeLinear(x, self.scale, zero_point, **self.layout.attributes)

    def dequantize(self, q, zero_point):
        return op.DequantizeLinear(q, self.scale, zero_point, **self.layout.attributes)

    def x_shape_value(self, x):
        """x's shape as an ONNX value (a constant when static)."""
        if None in self.x_shape:
            return op.Shape(x)
        return constant(np.array(self.x_shape, np.int64))

    def at_x_shape(self, per_block, x_shape):
        """A per-block tensor (minval) repeated to x's shape: DQ(ones) in the
        layout, which is exactly the tensor."""
        t = self.qparam(per_block)
        ones = op.ConstantOfShape(x_shape, value=ir.tensor(np.array([1], np.int8)))
        return op.DequantizeLinear(ones, t, self.filled(0, INT8), **self.layout.attributes)
