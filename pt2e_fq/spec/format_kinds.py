"""Format kinds: what a fake-quant point of each kind of format stores, how
it gets it from an observed range, and which fused op applies it.

One small strategy object per kind, so QSpec, FakeQuantize and every
reader of op calls (report, export) ask the kind instead of branching on
the format:

- INTEGER: affine integer formats (fake_quantize_affine); scale and zero
  point (ZP) or minval (MINVAL) per block of the granularity.
- SCALED_FLOAT: FP8 / FP4 elements with one observed scale per block
  (fake_quantize_float).
- MX: elements in blocks whose E8M0 scales the kernel computes from the
  live tensor (fake_quantize_mx); nothing observed, always dynamic.
- NVFP4: E2M1 in blocks of 16 with E4M3 block scales from the kernel under
  an fp32 global scale, observed per tensor or computed in the kernel
  (fake_quantize_nvfp4).

Each kind also reads its op's call back (`decode`): the typed `OpCall`
record that graph.py builds for any pt2e_fq node or call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .. import ops
from ..ops.blocks import block_abs_max, block_min_max, fp32
from .formats import ELEMENTS, FloatFormat, Format, IntFormat
from .granularity import Granularity, PerGroup, PerTensor
from .qparams import (
    INT_SCALE_EPS,
    asymmetric_qparams,
    float_scale,
    float_scale_from_amax,
    int_range_limit,
    minval_qparams,
    stored_grid_scale,
    stored_scale,
    symmetric_no_clip_qparams,
    symmetric_qparams,
    two_level_global_scale,
)
from .schemes import Formulation, Scheme

# While set (by to_onnx, around its torch.export): fn(x, block_size, fmax)
# -> the dynamic scaled-float scale of x as one op call the ONNX translation
# expands (export/onnx/scale.py), or None where it does not apply. A plain
# module global, not a ContextVar: torch.compile reads a global (and guards
# on it) but breaks the graph at ContextVar.get.
FUSED_FLOAT_SCALE: Optional[Callable] = None

# Bits a stored fp32 qparam (scale, minval, global scale) takes.
_FP32_BITS = 32


@dataclass(frozen=True)
class OpCall:
    """One call of a pt2e_fq op, by meaning. Values are whatever the caller
    holds (tensors, FX nodes, ONNX values): x, the qparams given to the op
    (None where the op has none or the kernel computes them), and the
    constants: the integer range, the block size per dimension of x, the
    block axis of MX / NVFP4 as the op was given it (may be negative)."""

    op: Any
    kind: "FormatKind"
    format: Format
    x: Any
    block_size: tuple
    scale: Any = None
    zero_point: Any = None
    minval: Any = None
    global_scale: Any = None
    quant_min: Optional[int] = None
    quant_max: Optional[int] = None
    axis: Optional[int] = None

    @property
    def qparams(self) -> dict[str, Any]:
        """The qparam values the op was given, by name (None left out)."""
        names = ("scale", "zero_point", "minval", "global_scale")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def applied_scale(self, outputs) -> torch.Tensor:
        """The scale of each block as applied, given the op's outputs."""
        return self.kind.applied_scale(self, outputs)

    def stored_qparams(self, outputs) -> list[tuple[torch.Tensor, float]]:
        """(tensor, bits per element) of each qparam a deployed point stores."""
        return self.kind.stored_qparams(self, outputs)


def _rank(x) -> int:
    """The rank of a tensor, an FX node (its meta value) or an ONNX value."""
    if isinstance(x, torch.fx.Node):
        x = x.meta["val"]
    return len(x.shape)


class FormatKind:
    """Base class; one instance per kind (module constants below)."""

    name: str = ""
    op_name: str = ""
    # The kind's op with learnable qparams, if it has one: same arguments
    # (and grad_factor), same y, y alone.
    learnable_op_name: str = ""

    @property
    def op(self):
        return getattr(torch.ops.pt2e_fq, self.op_name).default

    @property
    def ops(self) -> tuple:
        """Every op whose calls this kind decodes: its op, and its learnable op."""
        names = (self.op_name,) + ((self.learnable_op_name,) if self.learnable_op_name else ())
        return tuple(getattr(torch.ops.pt2e_fq, n).default for n in names)

    def applies_to(self, fmt: Format) -> bool:
        raise NotImplementedError

    def check(self, spec) -> None:
        """Raises ValueError where the QSpec's scheme, formulation,
        granularity or observer do not suit this kind."""

    def quant_range(self, spec) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def range_granularity(self, spec) -> Granularity:
        """The blocks the observer reduces over."""
        return spec.granularity

    def qparam_names(self, spec) -> tuple[str, ...]:
        """The tensors a point stores (static) or computes (dynamic), in the
        order the op takes them."""
        raise NotImplementedError

    def qparams_from_range(
        self, spec, lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> dict[str, torch.Tensor]:
        """The qparams of `spec` for the per-block range [lo, hi], in fp32,
        for inputs of `dtype` (the observed tensor's). A block whose range
        is empty (lo > hi: no finite value observed, see observers.py) gets
        the qparams of [0, 0], which are finite: the op refuses non-finite
        ones, and a NaN input must give NaN outputs, not an error."""
        lo, hi = fp32(lo), fp32(hi)
        empty = lo > hi
        return self._from_range(spec, torch.where(empty, 0.0, lo), torch.where(empty, 0.0, hi), dtype)

    def current_qparams(self, spec, x: torch.Tensor, block_size) -> dict[str, torch.Tensor]:
        """The qparams of a dynamic point (CurrentMinMaxObserver) for x:
        `qparams_from_range` of x's block_min_max. A kind may compute them
        in fewer ops, bit for bit: these ops run at every call and are
        traced into every exported graph, once per dynamic point."""
        return self.qparams_from_range(spec, *block_min_max(x, block_size), x.dtype)

    def _from_range(self, spec, lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def fake_quantize(self, spec, x: torch.Tensor, block_size, qparams: dict) -> torch.Tensor:
        raise NotImplementedError

    # Whether the kind has a fused observe-and-fake-quantize op
    # (`fake_quantize_observe`).
    fuses_observe: bool = False

    def fake_quantize_observe(
        self, spec, x: torch.Tensor, block_size, state: dict, averaging_constant: Optional[float]
    ) -> torch.Tensor:
        """A static point's step with its range observer on, in one op
        (ops/observe.py): updates `state` in place (the running range
        "min_val" / "max_val", the qparams by name, the counter "nonfinite")
        exactly as the observer, `qparams_from_range` and the stored qparams
        would, and returns `fake_quantize` of x on the new qparams.
        `averaging_constant`: the observer's `fused_averaging_constant()`."""
        raise NotImplementedError

    def decode(self, op, values: dict) -> OpCall:
        """The OpCall of this kind's op from its arguments by schema name."""
        raise NotImplementedError

    def applied_scale(self, call: OpCall, outputs):
        return call.scale

    def stored_qparams(self, call: OpCall, outputs) -> list[tuple[torch.Tensor, float]]:
        return [(call.scale, _FP32_BITS)]

    def __repr__(self) -> str:
        return self.name


def _float_symmetric_only(spec) -> None:
    if spec.formulation is Formulation.MINVAL:
        raise ValueError(
            "QSpec: formulation MINVAL needs an integer format and scheme ASYMMETRIC, "
            f"got format {spec.format!r} and scheme {spec.scheme.name}"
        )
    if spec.scheme is not Scheme.SYMMETRIC:
        raise ValueError(
            f"QSpec: float format {spec.format.name} has no zero point; scheme must be SYMMETRIC, "
            f"got {spec.scheme.name}"
        )


# The ZP formulation's qparams per scheme: the formula, and its name in the
# fused observe op (csrc observe.h; a narrow range is only its quant_min).
_ZP_QPARAMS = {
    Scheme.SYMMETRIC: (symmetric_qparams, "symmetric"),
    Scheme.SYMMETRIC_NARROW: (symmetric_qparams, "symmetric"),
    Scheme.SYMMETRIC_NO_CLIP: (symmetric_no_clip_qparams, "symmetric_no_clip"),
    Scheme.ASYMMETRIC: (asymmetric_qparams, "asymmetric"),
}


def floored_learned_scale(scale: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A learned scale as the learnable op takes it: max(scale, fp32 eps)
    rounded to `scale_dtype` (stored_scale) in value, the identity in
    gradient (straight through). The value is the stored scale itself, bit
    for bit, whatever the scale: the detached value plus
    (scale - scale.detach()), which is exactly +0 for a finite scale.
    (The form `scale + (floor - scale).detach()` rounds: for scale <= -2,
    eps - scale rounds to -scale and the sum is 0.) A NaN scale stays NaN."""
    return stored_scale(scale.detach().clamp_min(INT_SCALE_EPS), scale_dtype) + (scale - scale.detach())


class _Integer(FormatKind):
    name, op_name = "integer", "fake_quantize_affine"
    learnable_op_name = "fake_quantize_affine_learnable"

    def applies_to(self, fmt):
        return isinstance(fmt, IntFormat)

    def check(self, spec):
        if spec.formulation is Formulation.MINVAL and spec.scheme is not Scheme.ASYMMETRIC:
            raise ValueError(
                "QSpec: formulation MINVAL needs an integer format and scheme ASYMMETRIC, "
                f"got format {spec.format!r} and scheme {spec.scheme.name}"
            )

    def quant_range(self, spec):
        return spec.format.quant_range(narrow=spec.scheme is Scheme.SYMMETRIC_NARROW)

    def qparam_names(self, spec):
        return ("scale", "minval") if spec.formulation is Formulation.MINVAL else ("scale", "zero_point")

    def _from_range(self, spec, lo, hi, dtype):
        qmin, qmax = self.quant_range(spec)
        limit = int_range_limit(dtype, qmin, qmax, spec.scheme)
        lo, hi = lo.clamp(-limit, limit), hi.clamp(-limit, limit)
        if spec.formulation is Formulation.MINVAL:
            scale, minval = minval_qparams(lo, hi, qmin, qmax)
            scale = stored_grid_scale(scale, spec.scale_dtype, dtype, 0.0, float(qmax - qmin), minval)
            return {"scale": scale, "minval": minval}
        # The zero point comes from the fp32 scale, as torchao's choose_qparams_affine
        # computes it before casting the scale to its scale_dtype.
        scale, zero_point = _ZP_QPARAMS[spec.scheme][0](lo, hi, qmin, qmax)
        scale = stored_grid_scale(scale, spec.scale_dtype, dtype, qmin - zero_point, qmax - zero_point)
        return {"scale": scale, "zero_point": zero_point}

    def fake_quantize(self, spec, x, block_size, qparams):
        qmin, qmax = self.quant_range(spec)
        return ops.fake_quantize_affine(
            x, block_size, qparams["scale"], qparams.get("zero_point"), qmin, qmax, minval=qparams.get("minval")
        )

    fuses_observe = True

    def fake_quantize_observe(self, spec, x, block_size, state, averaging_constant):
        qmin, qmax = self.quant_range(spec)
        if spec.formulation is Formulation.MINVAL:
            scheme, offset = "minval", state["minval"]
        else:
            scheme, offset = _ZP_QPARAMS[spec.scheme][1], state["zero_point"]
        # The op itself: FakeQuantize passes its own, shape-checked state, and
        # the op's C++ checks would still catch a mistake.
        return torch.ops.pt2e_fq.fake_quantize_affine_observe(
            x, list(block_size), state["min_val"], state["max_val"], state["scale"], offset, state["nonfinite"],
            qmin, qmax, scheme, int_range_limit(x.dtype, qmin, qmax, spec.scheme), averaging_constant,
        )[0]

    def learnable_names(self, spec) -> tuple[str, ...]:
        """The qparams a learnable point trains: the scale, and the offset
        where the scheme has one (LSQ+): minval (MINVAL) or a floating zero
        point (ASYMMETRIC ZP). A symmetric zero point stays 0."""
        if spec.formulation is Formulation.MINVAL:
            return ("scale", "minval")
        return ("scale", "zero_point") if spec.scheme is Scheme.ASYMMETRIC else ("scale",)

    def frozen_learned(self, spec, name: str, value: torch.Tensor) -> torch.Tensor:
        """A learned qparam as the learnable op applies it, in a static
        point's dtype: the scale floored at fp32 eps and rounded to the
        spec's scale_dtype (fake_quantize_learnable),
        the zero point rounded half to even after clamping, as int32."""
        value = value.detach()
        if name == "scale":
            return floored_learned_scale(value, spec.scale_dtype)
        if name == "zero_point":
            return self.frozen_learned_zero_point(value, *self.quant_range(spec))
        return value.clone()

    def fake_quantize_learnable(self, spec, x, block_size, qparams):
        """The learnable op on trainable qparams. The scale goes in floored
        at fp32 eps, straight through (floored_learned_scale): an optimizer
        step that drives it to 0 or below gives the op a valid scale, and
        its gradient still reaches the parameter, so the next steps can
        bring it back."""
        qmin, qmax = self.quant_range(spec)
        scale = floored_learned_scale(qparams["scale"], spec.scale_dtype)
        return ops.fake_quantize_affine_learnable(
            x, block_size, scale, qparams.get("zero_point"), qmin, qmax, spec.grad_factor, minval=qparams.get("minval")
        )

    def static_outputs(self, call: OpCall) -> tuple:
        """(y, packed mask) of a learnable op's call (which returns y alone):
        the static op's on the qparams as the learnable op applies them,
        the same y bit for bit."""
        zero_point = call.zero_point
        if zero_point is not None and zero_point.dtype.is_floating_point:
            zero_point = self.frozen_learned_zero_point(zero_point, call.quant_min, call.quant_max)
        detached = lambda t: None if t is None else t.detach()  # noqa: E731
        return self.op(call.x, list(call.block_size), call.scale.detach(), zero_point, call.quant_min,
                       call.quant_max, detached(call.minval))

    @staticmethod
    def frozen_learned_zero_point(zero_point: torch.Tensor, quant_min: int, quant_max: int) -> torch.Tensor:
        """A floating zero point as the learnable op uses it: rounded half to
        even after clamping, as int32."""
        return zero_point.detach().clamp(quant_min, quant_max).round().to(torch.int32)

    def decode(self, op, values):
        qmin, qmax = values["quant_min"], values["quant_max"]
        return OpCall(op, self, IntFormat.holding(qmin, qmax), values["x"], tuple(values["block_size"]),
                      scale=values["scale"], zero_point=values["zero_point"], minval=values.get("minval"),
                      quant_min=qmin, quant_max=qmax)

    def stored_qparams(self, call, outputs):
        stored = [(call.scale, _FP32_BITS)]
        if call.zero_point is not None:
            stored.append((call.zero_point, call.format.bits))  # at the element width
        if call.minval is not None:
            stored.append((call.minval, _FP32_BITS))
        return stored


class _ScaledFloat(FormatKind):
    name, op_name = "scaled float", "fake_quantize_float"

    def applies_to(self, fmt):
        return isinstance(fmt, FloatFormat) and not fmt.block_scaled

    def check(self, spec):
        _float_symmetric_only(spec)

    def qparam_names(self, spec):
        return ("scale",)

    def _from_range(self, spec, lo, hi, dtype):
        return {"scale": float_scale(lo, hi, spec.format.fmax)}

    def current_qparams(self, spec, x, block_size):
        # float_scale(max(|lo|, |hi|)) with the empty range read as [0, 0]
        # is float_scale of the finite values' largest |value|, 0 for none.
        fused = FUSED_FLOAT_SCALE
        scale = None if fused is None else fused(x, block_size, spec.format.fmax)
        if scale is None:
            scale = float_scale_from_amax(block_abs_max(x, block_size), spec.format.fmax)
        return {"scale": scale}

    def fake_quantize(self, spec, x, block_size, qparams):
        return ops.fake_quantize_float(x, block_size, qparams["scale"], spec.format.element.name)

    fuses_observe = True

    def fake_quantize_observe(self, spec, x, block_size, state, averaging_constant):
        return torch.ops.pt2e_fq.fake_quantize_float_observe(  # the op itself: see _Integer's
            x, list(block_size), state["min_val"], state["max_val"], state["scale"], state["nonfinite"],
            spec.format.element.name, averaging_constant,
        )[0]

    def decode(self, op, values):
        return OpCall(op, self, FloatFormat.of(values["fmt"]), values["x"], tuple(values["block_size"]),
                      scale=values["scale"])


class _BlockScaled(FormatKind):
    """Shared by MX and NVFP4: blocks of the format's size along one axis."""

    def applies_to(self, fmt):
        return isinstance(fmt, FloatFormat) and fmt.block_scale == self.block_scale

    def check(self, spec):
        _float_symmetric_only(spec)
        fmt, g = spec.format, spec.granularity
        if not (isinstance(g, PerGroup) and g.group_size == fmt.scale_block):
            raise ValueError(
                f"QSpec: {fmt.name} scales blocks of {fmt.scale_block} along one axis; granularity "
                f"must be PerGroup({fmt.scale_block}, axis), got {g!r}"
            )

    def _call(self, op, fmt, x, block: int, axis: int, **qparams) -> OpCall:
        rank = _rank(x)
        block_size = tuple(block if d == axis % rank else 1 for d in range(rank))
        return OpCall(op, self, fmt, x, block_size, axis=axis, **qparams)


class _MX(_BlockScaled):
    name, op_name, block_scale = "MX", "fake_quantize_mx", "e8m0"

    def check(self, spec):
        super().check(spec)
        if not spec.dynamic or spec.observer is not None:
            raise ValueError(
                f"QSpec: {spec.format.name} computes its block scales from the live tensor in the kernel; "
                f"set dynamic=True and leave observer None, got dynamic={spec.dynamic}, observer={spec.observer!r}"
            )

    def qparam_names(self, spec):
        return ()  # the kernel computes every scale from the live tensor

    def _from_range(self, spec, lo, hi, dtype):
        return {}

    def fake_quantize(self, spec, x, block_size, qparams):
        g = spec.granularity
        return ops.fake_quantize_mx(x, spec.format.element.name, g.group_size, g.axis)

    def decode(self, op, values):
        # The op takes any block size (the record keeps it); the format is the element's MX one.
        fmt = FloatFormat.of(values["elem_fmt"], self.block_scale)
        return self._call(op, fmt, values["x"], values["block_size"], values["axis"])

    def applied_scale(self, call, outputs):
        return outputs[2]

    def stored_qparams(self, call, outputs):
        return [(outputs[2], 8)]  # one E8M0 byte per block


class _NVFP4(_BlockScaled):
    name, op_name, block_scale = "NVFP4", "fake_quantize_nvfp4", "e4m3"

    def check(self, spec):
        super().check(spec)
        # A histogram keeps how many values fall in each bin, not which block
        # of 16 they sit in, and NVFP4's error depends on each block's own
        # amax (its E4M3 scale): the histogram's error would not be the one
        # the format makes, so its search has nothing valid to minimise.
        observer = spec.observer_or_default
        if not spec.dynamic and observer.keeps_histogram:
            raise ValueError(
                f"QSpec: {spec.format.name}'s block scales come from each block of {spec.format.scale_block} "
                f"values, which a histogram does not keep; observer {type(observer).__name__} cannot choose its "
                "global scale: use MinMaxObserver, MovingAverageMinMaxObserver or MSEObserver (or dynamic=True)"
            )

    def range_granularity(self, spec):
        # The only observed qparam is the per-tensor global scale; the block
        # scales come from the kernel.
        return PerTensor()

    def qparam_names(self, spec):
        return () if spec.dynamic else ("global_scale",)

    def _from_range(self, spec, lo, hi, dtype):
        if spec.dynamic:
            return {}
        fmt = spec.format
        return {"global_scale": two_level_global_scale(lo, hi, fmt.block_scale, fmt.element.name)}

    def fake_quantize(self, spec, x, block_size, qparams):
        return ops.fake_quantize_nvfp4(x, qparams.get("global_scale"), spec.granularity.axis)

    def decode(self, op, values):
        fmt = FloatFormat.of("e2m1", self.block_scale)
        return self._call(op, fmt, values["x"], fmt.scale_block, values["axis"],
                          global_scale=values["global_scale"])

    def applied_scale(self, call, outputs):
        return outputs[2] * outputs[3]  # block scale x global scale

    def stored_qparams(self, call, outputs):
        return [(outputs[2], ELEMENTS[self.block_scale].bits), (outputs[3], _FP32_BITS)]


INTEGER = _Integer()
SCALED_FLOAT = _ScaledFloat()
MX = _MX()
NVFP4 = _NVFP4()
KINDS = (INTEGER, SCALED_FLOAT, MX, NVFP4)


def kind_of(fmt: Format) -> FormatKind:
    """The kind of a format."""
    for kind in KINDS:
        if kind.applies_to(fmt):
            return kind
    raise TypeError(f"no format kind handles {fmt!r}")
