"""Number formats a quantization point can simulate.

Integer formats are affine (`IntFormat`: bits and signedness; the integer
range follows from the scheme). Float formats (`FloatFormat`) have a fixed
element grid: FP8 and FP4 with a scale from an observer, MX and NVFP4 with
block scales the kernel computes from the live tensor.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Union

import torch

# The fused integer op clamps to a range inside int16.
_OP_MIN, _OP_MAX = -(2**15), 2**15 - 1


@dataclass(frozen=True)
class IntFormat:
    """A `bits`-wide signed or unsigned integer."""

    bits: int
    signed: bool = True

    def __post_init__(self):
        if not isinstance(self.bits, int) or isinstance(self.bits, bool):
            raise TypeError(f"IntFormat: bits must be an int, got {type(self.bits).__name__}")
        if not isinstance(self.signed, bool):
            raise TypeError(f"IntFormat: signed must be a bool, got {type(self.signed).__name__}")
        qmin, qmax = self.quant_range(narrow=False)
        if self.bits < 2 or qmin < _OP_MIN or qmax > _OP_MAX:
            raise ValueError(
                "IntFormat: bits must be 2..16 signed or 2..15 unsigned (the op's range is "
                f"int16), got bits={self.bits}, signed={self.signed}"
            )

    @property
    def name(self) -> str:
        return f"{'' if self.signed else 'u'}int{self.bits}"

    def quant_range(self, narrow: bool) -> tuple[int, int]:
        """(quant_min, quant_max); narrow range drops the lowest code, so a
        symmetric range is exactly +-(2**(bits-1) - 1) around the zero point."""
        if self.signed:
            qmin, qmax = -(2 ** (self.bits - 1)), 2 ** (self.bits - 1) - 1
        else:
            qmin, qmax = 0, 2**self.bits - 1
        return (qmin + 1, qmax) if narrow else (qmin, qmax)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype that names this format in a torchao QuantizationSpec
        (torch has int1..int8 and uint1..uint8; wider formats use a 16-bit
        container with a narrower quant range)."""
        prefix = "int" if self.signed else "uint"
        bits = self.bits if self.bits <= 8 else 16
        return getattr(torch, f"{prefix}{bits}")

    def __repr__(self) -> str:
        return self.name.upper()


class FloatFormat(enum.Enum):
    """Float element formats: (element dtype, largest finite value, block size
    of in-kernel scales or None when the scale comes from an observer)."""

    FP8_E4M3 = (torch.float8_e4m3fn, 448.0, None)
    FP8_E5M2 = (torch.float8_e5m2, 57344.0, None)
    FP4_E2M1 = (torch.float4_e2m1fn_x2, 6.0, None)
    MXFP8_E4M3 = (torch.float8_e4m3fn, 448.0, 32)
    MXFP8_E5M2 = (torch.float8_e5m2, 57344.0, 32)
    MXFP4 = (torch.float4_e2m1fn_x2, 6.0, 32)
    NVFP4 = (torch.float4_e2m1fn_x2, 6.0, 16)

    def __init__(self, elem_dtype: torch.dtype, fmax: float, scale_block: Optional[int]):
        self.elem_dtype = elem_dtype
        self.fmax = fmax
        self.scale_block = scale_block

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.elem_dtype

    @property
    def block_scaled(self) -> bool:
        """True for MX and NVFP4: the kernel computes one scale per block."""
        return self.scale_block is not None

    def __repr__(self) -> str:
        return self.name


Format = Union[IntFormat, FloatFormat]

INT4 = IntFormat(4)
UINT4 = IntFormat(4, signed=False)
INT8 = IntFormat(8)
UINT8 = IntFormat(8, signed=False)
INT16 = IntFormat(16)
FP8_E4M3 = FloatFormat.FP8_E4M3
FP8_E5M2 = FloatFormat.FP8_E5M2
FP4_E2M1 = FloatFormat.FP4_E2M1
MXFP8_E4M3 = FloatFormat.MXFP8_E4M3
MXFP8_E5M2 = FloatFormat.MXFP8_E5M2
MXFP4 = FloatFormat.MXFP4
NVFP4 = FloatFormat.NVFP4
