"""FakeQuantize: the module prepare_pt2e / prepare_qat_pt2e insert at every
quantization point.

A torchao FakeQuantizeBase whose forward observes (when its observer is on)
and then calls one fused pt2e_fq op. It never branches on a tensor value: the
on/off switches are Python flags kept in step with torchao's buffers by the
enable/disable methods (a branch on `observer_enabled[0]` would break
torch.export and split torch.compile graphs). `convert()` leaves the node in
the graph and freezes the module: observers off for good, observer state and
switch buffers dropped, so a re-exported program sees only the qparams.
"""

from __future__ import annotations

import math
import sys
from typing import Optional

import torch
from torchao.quantization.pt2e import FakeQuantizeBase
from torchao.quantization.pt2e.quantizer import QuantizationSpec

from . import _observer_sync
from .eval_mode import check_eval_mode
from .ops.blocks import reduced_shape
from .spec.formats import IntFormat
from .spec.granularity import PerChannel, PerTensor
from .observers import CurrentMinMaxObserver
from .spec.qspec import QSpec
from .spec.schemes import Formulation, Scheme

# Buffers that only matter before convert: the observers' running range, the
# count of non-finite values they ignored and torchao's on/off switches
# (every buffer becomes an exported program input).
_PREPARE_ONLY_BUFFERS = ("min_val", "max_val", "histogram", "nonfinite", "fake_quant_enabled", "observer_enabled")


class UncalibratedError(RuntimeError):
    """convert_pt2e met fake-quant points that never computed qparams."""


class NonFiniteQParamsError(ValueError):
    """A point to be converted or exported holds a NaN or Inf qparam (or saw
    no finite value in a block of its range)."""


def _without_leading_ones(shape) -> tuple:
    """shape less its leading size-1 dimensions: blocks in the same layout
    whatever the rank of the tensor they were reduced from."""
    shape = tuple(shape)
    start = next((i for i, n in enumerate(shape) if n != 1), len(shape))
    return shape[start:]


def _torch_qscheme(spec: QSpec) -> Optional[torch.qscheme]:
    """torch's name for a per-tensor / per-channel integer scheme (None
    otherwise); torchao compares it when deciding to share observers."""
    if not isinstance(spec.format, IntFormat) or spec.formulation is Formulation.MINVAL:
        return None
    sym = spec.scheme is not Scheme.ASYMMETRIC
    if isinstance(spec.granularity, PerTensor):
        return torch.per_tensor_symmetric if sym else torch.per_tensor_affine
    if isinstance(spec.granularity, PerChannel):
        return torch.per_channel_symmetric if sym else torch.per_channel_affine
    return None


def _ch_axis(spec: QSpec) -> Optional[int]:
    # torchao's QuantizationSpec rejects a negative ch_axis.
    g = spec.granularity
    return g.axis if isinstance(g, PerChannel) and g.axis >= 0 else None


def to_quantization_spec(spec: QSpec) -> QuantizationSpec:
    """The torchao QuantizationSpec for a Quantizer's annotations. Its
    standard fields describe the QSpec as far as torchao can; the
    constructor carries the QSpec itself."""
    qmin, qmax = spec.quant_range
    return QuantizationSpec(
        dtype=spec.format.torch_dtype,
        observer_or_fake_quant_ctr=FakeQuantize.with_args(qspec=spec),
        quant_min=qmin,
        quant_max=qmax,
        qscheme=_torch_qscheme(spec),
        ch_axis=_ch_axis(spec),
        # Always False: with is_dynamic=True convert_pt2e looks for the
        # choose_qparams node of its own rewrite and fails on ours. The
        # module reads QSpec.dynamic.
        is_dynamic=False,
    )


# The public call stays `qspec.to_quantization_spec()`. It is bound here, not
# written in qspec.py, so that QSpec, a value type, imports neither torchao
# nor this module (the package imports this module, so the method is always there).
QSpec.to_quantization_spec = to_quantization_spec


class FakeQuantize(FakeQuantizeBase):
    """Fake quantization of one point, configured by a QSpec.

    Build it through `QSpec.to_quantization_spec()` (torchao's prepare passes
    the QuantizationSpec's standard fields, which must agree with the QSpec),
    or directly as `FakeQuantize(qspec)`.

    Buffers of a static point: the qparams (`scale` and `zero_point` or
    `minval`; shape ceil(x.shape / block_size), same rank as x, fp32 / int32,
    created at the first observation) and, while prepared, the running range
    `min_val` / `max_val` of MinMax, MovingAverageMinMax and Histogram
    observers (and HistogramObserver's `histogram`, float64, the qparams'
    shape + (bins,)), the
    count `nonfinite` of NaN / Inf input values the observer ignored (int64,
    not saved in the state_dict: a diagnostic, see `nonfinite_count`) plus
    torchao's `fake_quant_enabled` / `observer_enabled`. A dynamic point
    stores no qparams. Qparams stay fp32 when the model is cast to bf16.

    A learnable point (QSpec(learnable=True)) holds the qparams it trains
    (`format_kinds` INTEGER `learnable_names`) as Parameters instead, named
    `<module path>.scale` and so on: the observer sets them while it is on,
    the optimizer while it is off; convert turns them into the buffers above.

    Args:
        qspec: the point's configuration.
        dtype, quant_min, quant_max, qscheme, ch_axis, is_dynamic: the standard fields torchao's prepare
            passes; each, where given, must agree with qspec.

    Raises:
        TypeError: qspec is not a QSpec.
        ValueError: a standard field disagrees with qspec.
    """

    def __init__(
        self,
        qspec: QSpec,
        *,
        dtype: Optional[torch.dtype] = None,
        quant_min: Optional[int] = None,
        quant_max: Optional[int] = None,
        qscheme: Optional[torch.qscheme] = None,
        ch_axis: Optional[int] = None,
        is_dynamic: Optional[bool] = None,
    ):
        super().__init__()
        if not isinstance(qspec, QSpec):
            raise TypeError(f"FakeQuantize: qspec must be a pt2e_fq.QSpec, got {type(qspec).__name__}")
        qmin, qmax = qspec.quant_range
        # What torchao knows about this point: its QuantizationSpec's fields.
        self.dtype = qspec.format.torch_dtype
        self.quant_min, self.quant_max = qmin, qmax
        self.qscheme = _torch_qscheme(qspec)
        self.ch_axis = _ch_axis(qspec)
        self.is_dynamic = qspec.dynamic
        if is_dynamic:
            raise ValueError(
                "FakeQuantize: is_dynamic=True in the QuantizationSpec breaks convert_pt2e (it looks for "
                "its own choose_qparams node); set QSpec(dynamic=True) and use QSpec.to_quantization_spec()"
            )
        given = dict(dtype=dtype, quant_min=quant_min, quant_max=quant_max, qscheme=qscheme, ch_axis=ch_axis)
        for name, value in given.items():
            if value is not None and value != getattr(self, name):
                raise ValueError(
                    f"FakeQuantize: {name}={value!r} disagrees with the QSpec ({qspec}), which gives "
                    f"{getattr(self, name)!r}; change the QSpec and use QSpec.to_quantization_spec()"
                )
        self.qspec = qspec
        self._kind = qspec.kind
        self._qparam_names = self._kind.qparam_names(qspec)  # what the op takes besides x
        self._observer = qspec.observer_or_default
        self._observer_on = True
        self._fake_quant_on = True
        self._frozen = False
        self._nonfinite_at_convert: Optional[int] = None
        self._shape_checked: Optional[torch.Size] = None  # see _check_stored_shape
        # Learnable qparams are Parameters from the start (empty until the
        # first observation sizes them), so an optimizer built right after
        # prepare already holds them; a trained zero point is fp32.
        self._learned = self._kind.learnable_names(qspec) if qspec.learnable else ()
        if not qspec.dynamic:
            for name in self._qparam_names:
                if name in self._learned:
                    self.register_parameter(name, torch.nn.Parameter(torch.empty(0)))
                    continue
                dt = torch.int32 if name == "zero_point" else torch.float32
                self.register_buffer(name, torch.empty(0, dtype=dt))
            if self._observer.keeps_range:
                self.register_buffer("min_val", torch.empty(0))
                self.register_buffer("max_val", torch.empty(0))
            if self._observer.keeps_histogram:
                self.register_buffer("histogram", torch.empty(0, dtype=torch.float64))
            # On the device, added to at every observation: counting must not sync.
            self.register_buffer("nonfinite", torch.zeros((), dtype=torch.int64), persistent=False)

    # -- state -------------------------------------------------------------

    @property
    def is_frozen(self) -> bool:
        """True after convert: the observer is off for good."""
        return self._frozen

    @property
    def is_calibrated(self) -> bool:
        """True when the point has qparams to apply (always, for dynamic)."""
        return all(self._state(n).numel() > 0 for n in self._qparam_buffer_names())

    @property
    def nonfinite_count(self) -> Optional[int]:
        """How many NaN / Inf input values the observer has ignored (kept
        through convert); None for a dynamic point, which keeps no state.
        Reading it syncs with the device: not for the training loop."""
        if self.qspec.dynamic:
            return None
        return self._nonfinite_at_convert if self._frozen else int(self.nonfinite)

    def _qparam_buffer_names(self) -> tuple[str, ...]:
        return () if self.qspec.dynamic else self._qparam_names

    def _state(self, name: str) -> Optional[torch.Tensor]:
        """A stored tensor by name: a buffer, or a learnable qparam's Parameter."""
        t = self._buffers.get(name)
        return self._parameters.get(name) if t is None else t

    @property
    def is_learning(self) -> bool:
        """True while the optimizer trains the qparams: a learnable point,
        calibrated, observer off, not converted."""
        return bool(self._learned) and not self._frozen and not self._observer_on

    def calculate_qparams(self, **kwargs) -> dict[str, torch.Tensor]:
        """The stored qparams by name (empty for a dynamic point)."""
        return {n: self._state(n) for n in self._qparam_buffer_names()}

    def applied_qparams(self) -> dict[str, torch.Tensor]:
        """The qparams by name as the point's op applies them, in a static
        point's dtypes, detached: the stored ones, and a learnable point's
        trained ones as its learnable op uses them (the scale floored at fp32
        eps, a floating zero point clamped and rounded to int32), so the
        static op on these gives the learnable op's output bit for bit."""
        learning = self._learned and not self._frozen
        return {n: self._kind.frozen_learned(self.qspec, n, t) if learning and n in self._learned else t.detach()
                for n, t in self.calculate_qparams().items()}

    def _check_stored_shape(self, input_shape) -> None:
        """Stored state (qparams, running range) has one shape, fixed by the
        first observation; an input that needs another is an error. Shapes
        that differ by leading size-1 dimensions only are the same blocks
        (a per-tensor point's (1, 1, 1, 1) and (1, 1, 1); the op takes such a
        qparam for any rank of x), so an input of another rank is taken. In eager
        mode the shape last found good is remembered (the check costs more
        than the fused step on a small tensor); what sizes the state anew
        (`_store`, a state_dict load) forgets it."""
        compiling = torch.compiler.is_compiling()  # traced once, costs nothing at run time
        if not compiling and input_shape == self._shape_checked:
            return
        shape = reduced_shape(input_shape, self.qspec.range_granularity.block_size(input_shape))
        for name in self._qparam_buffer_names() + ("min_val", "max_val"):
            buf = self._state(name)
            if buf is not None and buf.numel() > 0 and _without_leading_ones(buf.shape) != _without_leading_ones(shape):
                raise ValueError(
                    f"FakeQuantize({self.qspec}): this input (shape {tuple(input_shape)}) gives "
                    f"qparams of shape {tuple(shape)}, but the point was calibrated with shape "
                    f"{tuple(buf.shape)}; inputs of varying shape need a granularity whose qparams do not "
                    "depend on the shape (PerTensor, PerChannel) or a dynamic point"
                )
        if not compiling:
            self._shape_checked = input_shape

    def _store(self, name: str, value: torch.Tensor) -> None:
        current = self._state(name)
        self._shape_checked = None
        if name in self._parameters:
            # The observer sets a learnable qparam (no graph): the Parameter
            # object stays, so optimizers that hold it see the new value.
            with torch.no_grad():
                if current.numel() == 0:
                    current.data = value.to(current.dtype)
                else:
                    current.copy_(value)
        elif current.numel() == 0:  # first observation: the shape is known now
            setattr(self, name, value.to(current.dtype))
        else:
            # In place: same storage for compile, DDP and optimizers. A value
            # of another rank (an input of another rank, _check_stored_shape)
            # differs by leading size-1 dimensions only: the same elements.
            current.copy_(value if value.shape == current.shape else value.reshape(current.shape))

    # -- forward -----------------------------------------------------------

    def _fake_quantize(self, x: torch.Tensor, qparams: dict) -> torch.Tensor:
        block_size = self.qspec.granularity.block_size(x.shape)
        if self._learned and not self._frozen:
            return self._kind.fake_quantize_learnable(self.qspec, x, block_size, qparams)
        return self._kind.fake_quantize(self.qspec, x, block_size, qparams)

    def _range_and_qparams(self, x: torch.Tensor, running, sync_group=None):
        """Observes x (detached: observers need no graph) and returns the new
        range and its qparams; with `sync_group`, a range observer's batch
        range is all-reduced over that group first (pt2e_fq.distributed)."""
        x = x.detach()
        block_size = self.qspec.range_granularity.block_size(x.shape)

        def fake_quantize_range(lo, hi):  # for observers that search the range
            return self._fake_quantize(x, self._kind.qparams_from_range(self.qspec, lo, hi, x.dtype))

        if sync_group is None:
            lo, hi = self._observer.observe(x, block_size, running, fake_quantize_range)
        else:
            def reduce_range(lo, hi):
                return _observer_sync.all_reduce_range(lo, hi, sync_group)

            lo, hi = self._observer.observe(x, block_size, running, fake_quantize_range, reduce_range)
        if self._observer.keeps_histogram:
            return (lo, hi), self._kind.qparams_from_range(
                self.qspec, *self._histogram_range(x, block_size, running, (lo, hi), sync_group), x.dtype)
        return (lo, hi), self._kind.qparams_from_range(self.qspec, lo, hi, x.dtype)

    def _histogram_range(self, x, block_size, old, new, sync_group):
        """HistogramObserver: adds x to the stored histogram (over the new
        running range `new`) and returns the range its search picks."""
        reduce_sum = None if sync_group is None else (lambda t: _observer_sync.all_reduce_sum(t, sync_group))
        histogram = self._observer.accumulate(x, block_size, old, new, self.histogram, reduce_sum, self.nonfinite)
        self._store("histogram", histogram)

        def fake_quantize_rows(values, lo, hi):
            qparams = self._kind.qparams_from_range(self.qspec, lo, hi, x.dtype)
            return self._kind.fake_quantize(self.qspec, values.to(x.dtype), (1, values.shape[1]), qparams)

        return self._observer.search(histogram, *new, fake_quantize_rows)

    def _dynamic_qparams(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """A dynamic point's qparams for x: with the default observer
        (CurrentMinMaxObserver) the kind's `current_qparams`, the same values
        as observing in fewer ops (they are traced into every exported graph)."""
        if type(self._observer) is not CurrentMinMaxObserver:
            return self._range_and_qparams(x, None)[1]
        if not torch.compiler.is_exporting():
            # The op gives the scale no gradient; detached, autograd keeps none of
            # these ops' tensors. An exported graph needs no detach node.
            x = x.detach()
        return self._kind.current_qparams(self.qspec, x, self.qspec.range_granularity.block_size(x.shape))

    def _sync_group(self):
        """The process group this point's observer all-reduces over, or None:
        only observers that keep a running range synchronise (MSE and
        CurrentMinMax see the current tensor, meant for weights, identical
        on every rank)."""
        return _observer_sync.sync_group() if self._observer.keeps_range else None

    def _observe(self, x: torch.Tensor, sync_group=None) -> None:
        keeps_range = self._observer.keeps_range
        running = (self.min_val, self.max_val) if keeps_range and self.min_val.numel() > 0 else None
        if sync_group is not None and not torch.compiler.is_compiling():
            # Before anything a rank could raise alone: the ranks' batch
            # ranges must have one shape for the all-reduce (an empty x
            # joins with the running range's). Eager only: reading the
            # gathered shapes breaks a torch.compile graph at every point,
            # and compiling the pieces costs minutes.
            shape = (running[0].shape if x.numel() == 0 and running is not None
                     else reduced_shape(x.shape, self.qspec.range_granularity.block_size(x.shape)))
            _observer_sync.check_shapes_agree(shape, x.device, sync_group, self._describe)
        if x.numel() > 0:  # an empty x (a rank joining the others' reduction) has no shape to check
            self._check_stored_shape(x.shape)
        (lo, hi), qparams = self._range_and_qparams(x, running, sync_group)
        if keeps_range:
            self._store("min_val", lo)
            self._store("max_val", hi)
        for name, value in qparams.items():
            self._store(name, value)
        if not self._observer.keeps_histogram:  # a histogram's binning counts them (_histogram_range)
            # |x| < inf is False exactly for NaN and +-Inf, in fewer passes than isfinite.
            self.nonfinite.add_(x.numel() - torch.count_nonzero(x.abs() < math.inf))

    def _describe(self) -> str:
        """The point for an error message raised in forward: its QSpec and
        the name the calling module holds it under (the prepared model's
        `activation_post_process_3`), found by walking up the Python stack
        to the first module that holds it as a child. Error path only."""
        frame = sys._getframe(1)
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module) and owner is not self:
                name = next((n for n, m in owner.named_children() if m is self), None)
                if name is not None:
                    return f"FakeQuantize({self.qspec}) '{name}'"
            frame = frame.f_back
        return f"FakeQuantize({self.qspec})"

    def _fuses_observe(self, sync_group) -> bool:
        """Whether this step (observer on) runs as one fused observe-and-
        fake-quantize op: fake quant on, a static point that is not
        learnable (its qparams get gradients the fused op does not give),
        fp32 scales (the fused op computes them in the kernel; a
        QSpec.scale_dtype rounding is an op of its own), an observer and
        format kind with a fused op, state sized by an
        earlier observation, and no distributed sync (the batch range must
        be all-reduced before the update). The other steps take the
        unfused path, the fused op's reference. Shape tests only."""
        return (
            self._fake_quant_on
            and sync_group is None
            and self._kind.fuses_observe
            and self._observer.fusable
            and not self.qspec.dynamic
            and not self._learned
            and self.qspec.scale_dtype == torch.float32
            and all(self._state(n).numel() > 0 for n in self._qparam_names + self._range_names())
        )

    def _range_names(self) -> tuple[str, ...]:
        return ("min_val", "max_val") if self._observer.keeps_range else ()

    def _fake_quantize_observe(self, x: torch.Tensor) -> torch.Tensor:
        state = {n: self._state(n) for n in self._qparam_names + self._range_names() + ("nonfinite",)}
        if not self._observer.keeps_range:
            # The op folds the batch's range into an empty one: that is the
            # batch's range (CurrentMinMaxObserver), in scratch tensors.
            scale = state["scale"]
            state["min_val"] = torch.full_like(scale, math.inf)
            state["max_val"] = torch.full_like(scale, -math.inf)
        block_size = self.qspec.granularity.block_size(x.shape)
        return self._kind.fake_quantize_observe(
            self.qspec, x, block_size, state, self._observer.fused_averaging_constant()
        )

    def _fuses_current(self, x: torch.Tensor) -> bool:
        """Whether a dynamic point's step runs as one fused op
        (`_fake_quantize_current`): an integer format with the default
        observer and fp32 scales (see _fuses_observe), in an eager step
        with gradients on (training, where the step's cost counts). Everywhere else the unfused ops, the fused
        op's reference, with the same bits: an exported program computes
        the qparams in ATen ops that a lowering reads (to_qdq), Inductor
        fuses them, and the report (under no_grad) reads the static op's
        call."""
        return (
            isinstance(self.qspec.format, IntFormat)
            and type(self._observer) is CurrentMinMaxObserver
            and self.qspec.scale_dtype == torch.float32
            and x.numel() > 0
            and torch.is_grad_enabled()
            and not (torch.compiler.is_compiling() or torch.compiler.is_exporting())
        )

    def _fake_quantize_current(self, x: torch.Tensor) -> torch.Tensor:
        """A dynamic integer point's qparams for x and its fake
        quantization in one op: the fused observe op on scratch state (an
        empty running range, so the range is x's), bit for bit
        `current_qparams` then the op."""
        block_size = self.qspec.range_granularity.block_size(x.shape)
        shape = reduced_shape(x.shape, block_size)
        state = {
            "min_val": torch.full(shape, math.inf, device=x.device),
            "max_val": torch.full(shape, -math.inf, device=x.device),
            "scale": torch.empty(shape, device=x.device),
            "nonfinite": torch.zeros((), dtype=torch.int64, device=x.device),
        }
        offset = "minval" if self.qspec.formulation is Formulation.MINVAL else "zero_point"
        state[offset] = torch.empty(shape, dtype=torch.float32 if offset == "minval" else torch.int32,
                                    device=x.device)
        return self._kind.fake_quantize_observe(self.qspec, x, block_size, state, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qspec.dynamic:
            if not self._fake_quant_on:
                return x
            if self._fuses_current(x):
                return self._fake_quantize_current(x)
            # (MX formats need nothing: the kernel scales every block itself.)
            qparams = self._dynamic_qparams(x) if self._qparam_names else {}
            return self._fake_quantize(x, qparams)
        sync_group = self._sync_group() if self._observer_on else None
        if x.numel() == 0:
            # Empty in, empty out, as the float model (a shape test, not a
            # value one): no element reads a qparam, so neither an uncalibrated
            # point nor qparams of another shape (per-channel on the empty
            # axis) is an error, and observing nothing leaves the state as it
            # was (an empty range would calibrate a fresh point on nothing).
            # In a distributed run the other ranks wait for this one in the
            # all-reduce: it joins with empty blocks and takes their range.
            if sync_group is not None:
                self._observe(x, sync_group)
            return x.clone()
        if self._observer_on:
            if self._fuses_observe(sync_group):
                self._check_stored_shape(x.shape)
                return self._fake_quantize_observe(x)
            self._observe(x, sync_group)
        if not self._fake_quant_on:
            return x
        if not self.is_calibrated:
            raise UncalibratedError(
                f"FakeQuantize({self.qspec}) has no qparams yet: run it with the observer enabled "
                "(calibrate) or load a calibrated state_dict first"
            )
        return self._fake_quantize(x, self.calculate_qparams())

    # -- switches (torchao's enable_observer / disable_fake_quant ... call these)

    def enable_observer(self, enabled: bool = True) -> None:
        if self._frozen:
            if enabled:
                raise RuntimeError(f"FakeQuantize({self.qspec}) was converted; its observer is off for good")
            return
        super().enable_observer(enabled)
        self._observer_on = bool(enabled)

    def enable_fake_quant(self, enabled: bool = True) -> None:
        if not self._frozen:  # a frozen module has no switch buffers
            super().enable_fake_quant(enabled)
        self._fake_quant_on = bool(enabled)

    # -- convert -----------------------------------------------------------

    def convert(self, model: torch.fx.GraphModule, observer_node: torch.fx.Node) -> None:
        """convert_pt2e calls this for every point instead of rewriting it into
        q/dq ops. The node stays; the module freezes.

        Args:
            model: the GraphModule torchao's convert_pt2e converts.
            observer_node: this module's call_module node (kept).

        Raises:
            UncalibratedError: a point never saw data.
            NonFiniteQParamsError: a point's qparams are NaN or infinite.
            ValueError: torchao's eval switch left the model different from its float model
                (pt2e_fq.eval_mode.check_eval_mode names what and the function to call).
        """
        if not any(isinstance(m, FakeQuantize) and m.is_frozen for m in model.modules()):
            # The first point converted checks every point (a sync per qparam
            # tensor); those after it were checked with it.
            check_calibrated(model)
            check_finite(model)
            check_eval_mode(model, "convert_pt2e")
        if "nonfinite" in self._buffers:  # once, at convert: the report still shows it after
            self._nonfinite_at_convert = int(self.nonfinite)
        # Learned qparams become buffers as the op applied them, in a static
        # point's dtypes, so the converted point is a static one in every respect.
        for name in self._learned:
            self.register_buffer(name, self._kind.frozen_learned(self.qspec, name, self._parameters.pop(name)))
        self._frozen = True
        self._observer_on = False
        for name in _PREPARE_ONLY_BUFFERS:
            self._buffers.pop(name, None)

    # -- state_dict, dtype casts ---------------------------------------------

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        self._shape_checked = None
        # Buffers sized at the first observation start empty: take the saved
        # shape (either side empty), as torch's observers do.
        for name, buf in self._buffers.items():
            saved = state_dict.get(prefix + name)
            if saved is not None and saved.shape != buf.shape and 0 in (saved.numel(), buf.numel()):
                self._buffers[name] = torch.empty(saved.shape, dtype=buf.dtype, device=buf.device)
        for name, param in self._parameters.items():  # learnable qparams: the same, keeping the Parameter
            saved = state_dict.get(prefix + name)
            if saved is not None and saved.shape != param.shape and 0 in (saved.numel(), param.numel()):
                param.data = torch.empty(saved.shape, dtype=param.dtype, device=param.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        # The Python flags follow the loaded switches (reading them here, at
        # load time, is the one place a value crosses to the host).
        if "observer_enabled" in self._buffers:
            self._observer_on = bool(self.observer_enabled[0])
        if "fake_quant_enabled" in self._buffers:
            self._fake_quant_on = bool(self.fake_quant_enabled[0])

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) must not round the qparams: the op computes
        # in fp32, so buffers keep their dtype and only follow device moves.
        def keep_dtype(t):
            moved = fn(t)
            return moved if moved.dtype == t.dtype else t.to(device=moved.device)

        return super()._apply(keep_dtype, recurse)

    def extra_repr(self) -> str:
        observer = "frozen" if self._frozen else ("on" if self._observer_on else "off")
        return (
            f"{self.qspec}, observer={observer}, fake_quant={'on' if self._fake_quant_on else 'off'}, "
            f"calibrated={self.is_calibrated}"
        )


def _where(model: torch.nn.Module):
    """path -> " between 'src' and [users]": where each point sits in the
    graph of `model` ("" for a module with no graph)."""
    graph = getattr(model, "graph", None)
    nodes = {n.target: n for n in graph.nodes if n.op == "call_module"} if graph is not None else {}

    def where(path: str) -> str:
        node = nodes.get(path)
        if node is None:
            return ""
        src = node.args[0].name if node.args and isinstance(node.args[0], torch.fx.Node) else "?"
        return f" between '{src}' and {sorted(u.name for u in node.users)}"

    return where


def nonfinite_entry(name: str, t: torch.Tensor) -> Optional[str]:
    """`name[i] = v` for the first NaN / Inf element of t (flat index), or
    None when every element is finite. Syncs: for checks, not hot paths."""
    bad = torch.nonzero(~torch.isfinite(t.detach().reshape(-1)))
    if bad.numel() == 0:
        return None
    i = int(bad[0, 0])
    return f"{name}[{i}] = {t.reshape(-1)[i].item()}"


def check_finite(model: torch.nn.Module) -> None:
    """Raises NonFiniteQParamsError naming every FakeQuantize in `model`
    with a NaN / Inf qparam or a block of its running range that never saw
    a finite value (min_val = +inf), with the graph nodes it sits between."""
    where = _where(model)
    found = []
    for path, m in model.named_modules():
        if not isinstance(m, FakeQuantize):
            continue
        names = m._qparam_buffer_names() + ("min_val", "max_val")
        bad = [e for n in names if m._state(n) is not None for e in [nonfinite_entry(n, m._state(n))] if e]
        if bad:
            found.append(f"{path}{where(path)} has {', '.join(bad)}")
    if found:
        raise NonFiniteQParamsError(
            f"convert_pt2e: {len(found)} fake-quant point(s) have non-finite qparams or saw no finite value: "
            f"{'; '.join(found)}; calibrate on data with finite values (NaN / Inf ones are ignored) or load "
            "finite qparams"
        )


def check_calibrated(model: torch.nn.Module) -> None:
    """Raises UncalibratedError listing, by module path, every FakeQuantize in
    `model` without qparams, with the graph nodes it sits between."""
    missing = [(path, m) for path, m in model.named_modules() if isinstance(m, FakeQuantize) and not m.is_calibrated]
    if not missing:
        return
    where = _where(model)
    lines = [f"  {path}: {m.qspec}{where(path)}" for path, m in missing]
    raise UncalibratedError(
        f"{len(missing)} fake-quant point(s) never saw data; calibrate the prepared model (or load a "
        "calibrated state_dict) before convert_pt2e:\n" + "\n".join(lines)
    )
