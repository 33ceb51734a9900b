"""Number formats a quantization point can simulate.

Integer formats are affine (`IntFormat`: bits and signedness; the integer
range follows from the scheme). Float formats (`FloatFormat`) have a fixed
element grid (`ELEMENTS`, the one table of element facts): FP8 and FP4 with
a scale from an observer, MX and NVFP4 with block scales the kernel computes
from the live tensor. How each kind of format is observed and applied:
format_kinds.py.
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
    """A `bits`-wide signed or unsigned integer.

    Args:
        bits: 2..16 signed, 2..15 unsigned (the op computes in int16's range).
        signed: signed (True) or unsigned.

    Raises:
        TypeError: bits is not an int, or signed not a bool.
        ValueError: bits out of that range.
    """

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

    @classmethod
    def holding(cls, quant_min: int, quant_max: int) -> "IntFormat":
        """The narrowest integer format whose range holds [quant_min, quant_max]."""
        signed = quant_min < 0
        for bits in range(2, 17):
            lo, hi = cls(bits, signed).quant_range(narrow=False)
            if lo <= quant_min and quant_max <= hi:
                return cls(bits, signed)
        raise ValueError(f"no integer format holds [{quant_min}, {quant_max}]")

    def __repr__(self) -> str:
        return self.name.upper()


@dataclass(frozen=True)
class Element:
    """A float element format: the name the fused ops take ("e4m3"), its torch
    dtype (None where torch has none), its largest finite value, the exponent
    of the largest power of two not above it, and its width in bits."""

    name: str
    torch_dtype: Optional[torch.dtype]
    fmax: float
    emax: int
    bits: int


# The one table of float elements: everything else derives from it (the C++
# kernels have their own, in csrc/include/pt2e_fq/float_formats.h). The ops
# take the name: a ScalarType argument of torch.float4_e2m1fn_x2 breaks
# torch.export.save, and a future element (FP6) may have no torch dtype.
ELEMENTS = {
    e.name: e
    for e in (
        Element("e4m3", torch.float8_e4m3fn, 448.0, 8, 8),
        Element("e5m2", torch.float8_e5m2, 57344.0, 15, 8),
        Element("e2m1", torch.float4_e2m1fn_x2, 6.0, 2, 4),
    )
}
_BY_DTYPE = {e.torch_dtype: e for e in ELEMENTS.values() if e.torch_dtype is not None}


def element(op: str, what: str, value) -> Element:
    """The element a public op argument names: its name ("e4m3") or its torch
    dtype (torch.float8_e4m3fn)."""
    allowed = ", ".join(f"{e.name!r} / {e.torch_dtype}" if e.torch_dtype else repr(e.name) for e in ELEMENTS.values())
    if isinstance(value, str) and value in ELEMENTS:
        return ELEMENTS[value]
    if isinstance(value, torch.dtype) and value in _BY_DTYPE:
        return _BY_DTYPE[value]
    if not isinstance(value, (str, torch.dtype)):
        raise TypeError(f"{op}: {what} must be an element name or a torch.dtype, one of {allowed}; got {value!r}")
    raise ValueError(f"{op}: {what} must be one of {allowed}; got {value!r}")


# Block sizes of the block-scaled formats (OCP MX v1.0; NVIDIA NVFP4).
MX_BLOCK = 32
NVFP4_BLOCK = 16


class FloatFormat(enum.Enum):
    """Float formats: (element, block size of in-kernel scales or None when
    the scale comes from an observer, element of those block scales: E8M0
    for MX, E4M3 under an fp32 global scale for NVFP4)."""

    FP8_E4M3 = ("e4m3", None, None)
    FP8_E5M2 = ("e5m2", None, None)
    FP4_E2M1 = ("e2m1", None, None)
    MXFP8_E4M3 = ("e4m3", MX_BLOCK, "e8m0")
    MXFP8_E5M2 = ("e5m2", MX_BLOCK, "e8m0")
    MXFP4 = ("e2m1", MX_BLOCK, "e8m0")
    NVFP4 = ("e2m1", NVFP4_BLOCK, "e4m3")

    def __init__(self, element_name: str, scale_block: Optional[int], block_scale: Optional[str]):
        self.element = ELEMENTS[element_name]
        self.scale_block = scale_block
        self.block_scale = block_scale

    @property
    def elem_dtype(self) -> Optional[torch.dtype]:
        return self.element.torch_dtype

    @property
    def torch_dtype(self) -> Optional[torch.dtype]:
        return self.element.torch_dtype

    @property
    def fmax(self) -> float:
        return self.element.fmax

    @property
    def bits(self) -> int:
        return self.element.bits

    @property
    def block_scaled(self) -> bool:
        """True for MX and NVFP4: the kernel computes one scale per block."""
        return self.scale_block is not None

    @classmethod
    def of(cls, element_name: str, block_scale: Optional[str] = None) -> "FloatFormat":
        """The format of an element with no block scales (block_scale None),
        E8M0 block scales (MX) or E4M3 ones (NVFP4)."""
        for fmt in cls:
            if fmt.element.name == element_name and fmt.block_scale == block_scale:
                return fmt
        raise ValueError(f"no float format has element {element_name!r} with block scales {block_scale!r}")

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
