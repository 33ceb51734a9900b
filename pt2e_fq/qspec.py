"""QSpec: everything that describes one fake-quant point.

A small frozen (hashable, comparable) dataclass: format, granularity, scheme,
formulation, observer, static or dynamic. `to_quantization_spec()` gives the
torchao QuantizationSpec a Quantizer annotates nodes with; its constructor
builds our FakeQuantize with this QSpec baked in.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .formats import INT8, FloatFormat, Format, IntFormat
from .granularity import GRANULARITIES, Granularity, PerChannel, PerGroup, PerTensor, PerToken
from .observers import OBSERVERS, CurrentMinMaxObserver, MinMaxObserver, Observer


class Scheme(enum.Enum):
    SYMMETRIC = "symmetric"
    # The lowest integer code is unused, so the range is +-(2**(bits-1) - 1).
    SYMMETRIC_NARROW = "symmetric_narrow"
    ASYMMETRIC = "asymmetric"


class Formulation(enum.Enum):
    # q = round(x / scale) + zero_point (integer zero point; 0 exact).
    ZP = "zp"
    # q = round((x - minval) / scale) + quant_min (float offset; the range exact).
    MINVAL = "minval"


def _as_enum(enum_cls, name: str, value):
    if isinstance(value, enum_cls):
        return value
    allowed = ", ".join(m.name for m in enum_cls)
    if isinstance(value, str):
        for m in enum_cls:
            if value.lower() in (m.value, m.name.lower()):
                return m
    raise ValueError(f"QSpec: {name} must be one of {allowed} (or its lowercase name), got {value!r}")


@dataclass(frozen=True)
class QSpec:
    """One fake-quant point.

    format: an IntFormat (INT8, UINT8, INT4, IntFormat(bits, signed)) or a
        FloatFormat (FP8_E4M3, FP8_E5M2, FP4_E2M1, MXFP8_E4M3, MXFP8_E5M2,
        MXFP4, NVFP4).
    granularity: PerTensor(), PerChannel(axis), PerGroup(size, axis),
        PerBlock(block), PerToken(). MX formats need PerGroup(32, axis),
        NVFP4 PerGroup(16, axis).
    scheme: SYMMETRIC, SYMMETRIC_NARROW or ASYMMETRIC (integer formats);
        float formats are SYMMETRIC.
    formulation: ZP or MINVAL (MINVAL: integer, ASYMMETRIC only).
    observer: how the range is found; None picks MinMaxObserver() for a
        static point and CurrentMinMaxObserver() for a dynamic one.
    dynamic: qparams from the live tensor at every call (no stored state).
    """

    format: Format = INT8
    granularity: Granularity = PerTensor()
    scheme: Union[Scheme, str] = Scheme.SYMMETRIC
    formulation: Union[Formulation, str] = Formulation.ZP
    observer: Optional[Observer] = None
    dynamic: bool = False

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        set_("scheme", _as_enum(Scheme, "scheme", self.scheme))
        set_("formulation", _as_enum(Formulation, "formulation", self.formulation))
        if not isinstance(self.format, (IntFormat, FloatFormat)):
            raise TypeError(f"QSpec: format must be an IntFormat or a FloatFormat, got {self.format!r}")
        if not isinstance(self.granularity, GRANULARITIES):
            names = ", ".join(g.__name__ for g in GRANULARITIES)
            raise TypeError(f"QSpec: granularity must be one of {names} (an instance), got {self.granularity!r}")
        if not isinstance(self.dynamic, bool):
            raise TypeError(f"QSpec: dynamic must be a bool, got {self.dynamic!r}")
        if self.observer is not None and not isinstance(self.observer, OBSERVERS):
            names = ", ".join(o.__name__ for o in OBSERVERS)
            raise TypeError(f"QSpec: observer must be None or an instance of {names}, got {self.observer!r}")
        self._check_format_rules()
        self._check_observer_rules()

    def _check_format_rules(self) -> None:
        fmt = self.format
        if self.formulation is Formulation.MINVAL and not (
            isinstance(fmt, IntFormat) and self.scheme is Scheme.ASYMMETRIC
        ):
            raise ValueError(
                "QSpec: formulation MINVAL needs an integer format and scheme ASYMMETRIC, "
                f"got format {fmt!r} and scheme {self.scheme.name}"
            )
        if isinstance(fmt, IntFormat):
            return
        if self.scheme is not Scheme.SYMMETRIC:
            raise ValueError(
                f"QSpec: float format {fmt.name} has no zero point; scheme must be SYMMETRIC, "
                f"got {self.scheme.name}"
            )
        if fmt.block_scaled:
            g = self.granularity
            if not (isinstance(g, PerGroup) and g.group_size == fmt.scale_block):
                raise ValueError(
                    f"QSpec: {fmt.name} scales blocks of {fmt.scale_block} along one axis; granularity "
                    f"must be PerGroup({fmt.scale_block}, axis), got {g!r}"
                )

    def _check_observer_rules(self) -> None:
        fmt, obs = self.format, self.observer
        if isinstance(self.granularity, PerToken) and not self.dynamic:
            raise ValueError(
                "QSpec: PerToken qparams exist only for the live tensor, so it needs dynamic=True "
                "(for one scale per weight row use PerChannel(0))"
            )
        if self.dynamic and obs is not None and not obs.dynamic:
            raise ValueError(
                f"QSpec: a dynamic point computes qparams from the live tensor; observer must be "
                f"None or CurrentMinMaxObserver(), got {obs!r}"
            )
        if isinstance(fmt, FloatFormat) and fmt.block_scaled and fmt is not FloatFormat.NVFP4:
            if not self.dynamic or obs is not None:
                raise ValueError(
                    f"QSpec: {fmt.name} computes its block scales from the live tensor in the kernel; "
                    f"set dynamic=True and leave observer None, got dynamic={self.dynamic}, observer={obs!r}"
                )

    # -- derived values ----------------------------------------------------

    @property
    def observer_or_default(self) -> Observer:
        if self.observer is not None:
            return self.observer
        return CurrentMinMaxObserver() if self.dynamic else MinMaxObserver()

    @property
    def range_granularity(self) -> Granularity:
        """The blocks the observer reduces over: the point's granularity,
        except NVFP4, whose only observed qparam is a per-tensor global scale
        (its block scales come from the kernel)."""
        return PerTensor() if self.format is FloatFormat.NVFP4 else self.granularity

    @property
    def quant_range(self) -> tuple[Optional[int], Optional[int]]:
        """(quant_min, quant_max) of an integer format; (None, None) for floats."""
        if isinstance(self.format, FloatFormat):
            return None, None
        return self.format.quant_range(narrow=self.scheme is Scheme.SYMMETRIC_NARROW)

    @property
    def torch_qscheme(self) -> Optional[torch.qscheme]:
        """torch's name for per-tensor / per-channel integer schemes (None
        otherwise); torchao compares it when deciding to share observers."""
        if isinstance(self.format, FloatFormat) or self.formulation is Formulation.MINVAL:
            return None
        sym = self.scheme is not Scheme.ASYMMETRIC
        if isinstance(self.granularity, PerTensor):
            return torch.per_tensor_symmetric if sym else torch.per_tensor_affine
        if isinstance(self.granularity, PerChannel):
            return torch.per_channel_symmetric if sym else torch.per_channel_affine
        return None

    @property
    def ch_axis(self) -> Optional[int]:
        # torchao's QuantizationSpec rejects a negative ch_axis.
        g = self.granularity
        return g.axis if isinstance(g, PerChannel) and g.axis >= 0 else None

    def to_quantization_spec(self):
        """The torchao QuantizationSpec for a Quantizer's annotations. Its
        standard fields describe this spec as far as torchao can; the
        constructor carries the QSpec itself."""
        from torchao.quantization.pt2e.quantizer import QuantizationSpec

        from .fake_quantize import FakeQuantize

        qmin, qmax = self.quant_range
        return QuantizationSpec(
            dtype=self.format.torch_dtype,
            observer_or_fake_quant_ctr=FakeQuantize.with_args(qspec=self),
            quant_min=qmin,
            quant_max=qmax,
            qscheme=self.torch_qscheme,
            ch_axis=self.ch_axis,
            # Always False: with is_dynamic=True convert_pt2e looks for the
            # choose_qparams node of its own rewrite and fails on ours. The
            # module reads QSpec.dynamic.
            is_dynamic=False,
        )

    def __str__(self) -> str:
        fmt = self.format.name if isinstance(self.format, FloatFormat) else repr(self.format)
        parts = [fmt, repr(self.granularity), self.scheme.value]
        if self.formulation is Formulation.MINVAL:
            parts.append("minval")
        parts.append("dynamic" if self.dynamic else type(self.observer_or_default).__name__)
        return " ".join(parts)
