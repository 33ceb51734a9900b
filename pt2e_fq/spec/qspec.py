"""QSpec: everything that describes one fake-quant point.

A small frozen (hashable, comparable) value: format, granularity, scheme,
formulation, observer, static or dynamic. What a format's kind allows and
implies is the kind's (format_kinds.py). The bridge to torchao
(`QSpec.to_quantization_spec()`, the QuantizationSpec a Quantizer annotates
nodes with) lives next to FakeQuantize, which it constructs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .format_kinds import INTEGER, FormatKind, kind_of
from .formats import INT8, FloatFormat, Format, IntFormat
from .granularity import GRANULARITIES, Granularity, PerTensor, PerToken
from ..observers import OBSERVERS, CurrentMinMaxObserver, MinMaxObserver, Observer
from .qparams import SCALE_DTYPES
from .schemes import Formulation, Scheme


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

    Args:
        format: an IntFormat (INT8, UINT8, INT4, IntFormat(bits, signed)) or a
            FloatFormat (FP8_E4M3, FP8_E5M2, FP4_E2M1, MXFP8_E4M3, MXFP8_E5M2,
            MXFP4, NVFP4).
        granularity: PerTensor(), PerChannel(axis), PerGroup(size, axis),
            PerBlock(block), PerToken(). MX formats need PerGroup(32, axis),
            NVFP4 PerGroup(16, axis).
        scheme: SYMMETRIC, SYMMETRIC_NARROW, SYMMETRIC_NO_CLIP or ASYMMETRIC
            (integer formats; pt2e_fq.spec.schemes); float formats are SYMMETRIC.
        formulation: ZP or MINVAL (MINVAL: integer, ASYMMETRIC only).
        observer: how the range is found; None picks MinMaxObserver() for a
            static point and CurrentMinMaxObserver() for a dynamic one.
        dynamic: qparams from the live tensor at every call (no stored state).
        learnable: learned ranges (LSQ / LSQ+; integer formats, static points):
            the observer sets the qparams while it is on, as for a static
            point; they are nn.Parameters that the optimizer trains when it is
            off (scale; a floating zero point under ASYMMETRIC ZP; minval under
            MINVAL). convert freezes them into buffers.
        grad_factor: the learnable qparams' gradient scale; None: LSQ's
            1 / sqrt(block_numel * quant_max) per block, block_numel that
            block's own element count (a ragged last block has fewer).
        scale_dtype: the precision the deployed scale is stored in (integer
            formats): torch.float32, or torch.bfloat16 as ExecuTorch's
            XNNPACK stores int4 group scales (torchao's `scale_precision`).
            The scale is computed in fp32, then rounded to scale_dtype (to
            the nearest value, or the one below where the nearest would put
            the grid past the input dtype's range) and kept as fp32 values,
            so training sees the scale the runtime applies
            (qparams.stored_grid_scale); an asymmetric zero point comes
            from the fp32 scale, as in torchao. A learnable scale trains in
            fp32 (a bfloat16 parameter would lose the optimizer's small
            steps) and the op applies it rounded, straight through; convert
            stores the rounded value. The name of a dtype ("bfloat16") is
            taken too.

    Raises:
        TypeError: a field of the wrong type (format, granularity, observer, flags).
        ValueError: a combination the backend cannot run (MINVAL without ASYMMETRIC, an MX format without
            its block, learnable on a float format or a dynamic point, ...): the message names the field.
    """

    format: Format = INT8
    granularity: Granularity = PerTensor()
    scheme: Union[Scheme, str] = Scheme.SYMMETRIC
    formulation: Union[Formulation, str] = Formulation.ZP
    observer: Optional[Observer] = None
    dynamic: bool = False
    learnable: bool = False
    grad_factor: Optional[float] = None
    scale_dtype: torch.dtype = torch.float32

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
        self.kind.check(self)
        self._check_scale_dtype()
        self._check_observer_rules()
        self._check_learnable_rules()

    def _check_scale_dtype(self) -> None:
        names = {str(d).removeprefix("torch."): d for d in SCALE_DTYPES}
        if not isinstance(self.scale_dtype, (torch.dtype, str)):
            raise TypeError(f"QSpec: scale_dtype must be a torch.dtype or its name, got {self.scale_dtype!r}")
        dtype = names.get(self.scale_dtype) if isinstance(self.scale_dtype, str) else self.scale_dtype
        if dtype not in SCALE_DTYPES:
            raise ValueError(f"QSpec: scale_dtype must be one of {', '.join(names)} (a torch.dtype or its name), "
                             f"got {self.scale_dtype!r}")
        object.__setattr__(self, "scale_dtype", dtype)
        if dtype != torch.float32 and self.kind is not INTEGER:
            raise ValueError(f"QSpec: scale_dtype {str(dtype).removeprefix('torch.')} applies to integer "
                             f"formats' scales; {self.format.name} keeps scale_dtype float32")

    def _check_learnable_rules(self) -> None:
        if not isinstance(self.learnable, bool):
            raise TypeError(f"QSpec: learnable must be a bool, got {self.learnable!r}")
        if self.grad_factor is not None:
            if not self.learnable:
                raise ValueError("QSpec: grad_factor applies to learnable ranges only; set learnable=True or drop it")
            g = self.grad_factor
            if not isinstance(g, (int, float)) or isinstance(g, bool) or not (math.isfinite(g) and g > 0):
                raise ValueError(f"QSpec: grad_factor must be a finite float > 0 (or None for LSQ's), got {g!r}")
        if not self.learnable:
            return
        if not isinstance(self.format, IntFormat):
            raise ValueError(
                f"QSpec: learnable ranges need an integer format (LSQ / LSQ+ learn an affine grid), got {self.format.name}"
            )
        if self.dynamic:
            raise ValueError("QSpec: a dynamic point computes its qparams from every input; learnable needs a static one")
        if self.grad_factor is None and self.quant_range[1] < 1:
            raise ValueError(
                f"QSpec: LSQ's default grad_factor 1 / sqrt(block_numel * quant_max) needs quant_max >= 1, got "
                f"{self.quant_range[1]}; give grad_factor"
            )

    def _check_observer_rules(self) -> None:
        obs = self.observer
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

    # -- derived values ----------------------------------------------------

    @property
    def kind(self) -> FormatKind:
        """The format's kind: what the point stores and which op applies it."""
        return kind_of(self.format)

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
        return self.kind.range_granularity(self)

    @property
    def quant_range(self) -> tuple[Optional[int], Optional[int]]:
        """(quant_min, quant_max) of an integer format; (None, None) for floats."""
        return self.kind.quant_range(self)

    def __str__(self) -> str:
        fmt = self.format.name if isinstance(self.format, FloatFormat) else repr(self.format)
        parts = [fmt, repr(self.granularity), self.scheme.value]
        if self.formulation is Formulation.MINVAL:
            parts.append("minval")
        parts.append("dynamic" if self.dynamic else type(self.observer_or_default).__name__)
        if self.learnable:
            parts.append("learnable" + ("" if self.grad_factor is None else f"(grad_factor={self.grad_factor:g})"))
        if self.scale_dtype != torch.float32:
            parts.append(f"{str(self.scale_dtype).removeprefix('torch.')} scales")
        return " ".join(parts)
