"""Post-training algorithms for low bits, run on a prepared model between
calibration and convert_pt2e:

    prepared = prepare_pt2e(exported, quantizer)
    for batch in calibration_batches:              # observers see data
        prepared(*batch)
    report = pt2e_fq.calib.apply(prepared, calibration_batches)
    converted = convert_pt2e(prepared)
    print(report)                                  # per layer: output SQNR before / after

With `equalization=True`, `apply` first runs calib.equalize (module
calib.equalization): per-input-channel scales moved from a linear's input
into its weight, folded exactly into the op before (a LayerNorm's affine, a previous linear's output channels), the
points whose input changed calibrated again on the batches; the report's
`equalized` lists each group with its output SQNR before / after.

With `activation_ranges=True`, `apply` then runs
calib.search_activation_ranges (module calib.activation_ranges): the
range of each static per-tensor integer activation point that feeds
convs and linears chosen for the smallest output error of those layers;
the report's `ranges` lists each point with its range and its readers'
output SQNR before / after.

`apply` works on every linear and conv2d whose weight has one of our
fake-quant points (any format and granularity: the point's own op is the
quantize function). It collects each layer's input statistics in one pass
over the batches (as the layer sees its input in the prepared model), then
per layer:

- `weight_ranges` (calib.weight_ranges, with weight_ranges=True): the
  clipping range of each block of the weight point searched first, by the
  error GPTQ's output error weighs each column with (calib.gptq's
  residual_power);
- `gptq` (calib.gptq): output-aware rounding of the weight on the point's
  calibrated grid; with act_order=True the columns are rounded by
  decreasing input power, on qparams fixed before the loop (so the groups
  stay contiguous in the exported format);
- `bias_correction` (calib.bias_correction): the mean output error of the
  rounding added to the bias (a layer without bias gets one).

The weight parameters are replaced by their rounded values (new tensors:
the user's float model, which a graph from torch.export shares parameters
with, is not changed) and the weight points' observers are switched off,
so convert keeps the calibrated grid the rounding chose values on. The
application layer's `pipeline.quantize` runs this for the presets whose
row in docs/quantizers.md names it.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Iterable

import torch

from . import layers as _layers
from . import statistics as _statistics
from .activation_bias import correct_activation_bias
from .activation_ranges import RangeResult, search_activation_ranges
from .bias_correction import bias_correction
from .equalization import EqualizeResult, equalize
from . import weight_ranges as _weight_ranges
from .gptq import act_order as act_order_of
from .gptq import gptq, residual_power

__all__ = ["apply", "equalize", "CalibReport", "EqualizeResult", "LayerResult", "RangeResult", "correct_activation_bias",
           "search_activation_ranges"]


@dataclass
class LayerResult:
    """One layer: the output SQNR (dB) of its rounded weight on the
    calibration inputs, with round-to-nearest (`before`) and after the
    algorithms (`after`; with bias correction, its mean error removed)."""

    name: str
    weight: str  # the weight point's QSpec
    before_db: float
    after_db: float


@dataclass
class CalibReport:
    """The layers' results; `seconds` the wall time of apply and
    `cpu_seconds` the CPU time of its threads (on a shared machine the
    wall time also counts other processes' turns); `stage_seconds` the wall
    time of each stage that ran: equalization, activation_ranges, statistics
    (the pass that collects each layer's input moments) and rounding
    (weight_ranges, gptq and bias_correction, layer by layer)."""

    algorithms: tuple
    seconds: float
    cpu_seconds: float
    layers: list = field(default_factory=list)
    equalized: list = field(default_factory=list)  # EqualizeResults, where equalization ran
    ranges: list = field(default_factory=list)  # RangeResults, where the activation range search ran
    stage_seconds: dict = field(default_factory=dict)
    # {layer node name: why} of the layers left as they were (calib.layers.usable_layers)
    skipped: dict = field(default_factory=dict)

    def worst(self, count: int = 5) -> list:
        return sorted(self.layers, key=lambda r: r.after_db)[:count]

    def __str__(self) -> str:
        from tabulate import tabulate

        rows = [(r.name, r.weight, f"{r.before_db:.1f}", f"{r.after_db:.1f}") for r in self.layers]
        stages = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.stage_seconds.items())
        head = (f"calib.apply({', '.join(self.algorithms)}): {len(self.layers)} layers, {self.seconds:.1f} s "
                f"({self.cpu_seconds:.1f} s CPU; {stages})")
        text = head + "\n" + tabulate(rows, headers=("layer", "weight", "SQNR RTN dB", "SQNR after dB"))
        if self.skipped:
            text += "\n" + _layers.skipped_text("calib.apply", self.skipped)
        if self.equalized:
            groups = [(r.producer, ", ".join(r.consumers), r.scale, f"{r.before_db:.1f}", f"{r.after_db:.1f}")
                      for r in self.equalized]
            text += "\n" + tabulate(groups, headers=("equalized: producer", "linears", "scale", "SQNR dB",
                                                      "SQNR after dB"))
        if self.ranges:
            points = [(r.point, ", ".join(r.consumers), f"[{r.calibrated[0]:.3g}, {r.calibrated[1]:.3g}]",
                       f"[{r.chosen[0]:.3g}, {r.chosen[1]:.3g}]", f"{r.before_db:.1f}", f"{r.after_db:.1f}")
                      for r in self.ranges]
            text += "\n" + tabulate(points, headers=("activation point", "read by", "calibrated range",
                                                      "chosen range", "SQNR dB", "SQNR after dB"))
        return text


def _output_sqnr(weight: torch.Tensor, error: torch.Tensor, second_moment: torch.Tensor,
                 noise_moment: torch.Tensor) -> float:
    """10 log10(tr(W H W^T) / tr(E M E^T)), summed over groups: the output
    power over the power of the output error, whose inputs' moment M is H,
    or the covariance where bias correction has removed the mean error."""
    w, e = weight.double(), error.double()
    signal = ((w @ second_moment) * w).sum().item()
    noise = ((e @ noise_moment) * e).sum().item()
    return 10 * math.log10(signal / noise) if noise > 0 else math.inf


def apply(prepared: torch.fx.GraphModule, batches: Iterable, *, gptq_rounding: bool = True,
          correct_bias: bool = True, block: int = 128, damp: float = 0.01,
          equalization: bool = False, activation_ranges: bool = False, weight_ranges: bool = False,
          act_order: bool = False) -> CalibReport:
    """Runs the algorithms on `prepared` (calibrated: its weight points hold
    qparams) with `batches` (tensors or tuples of tensors, as for
    calibration); returns the per-layer report. gptq_rounding=False keeps
    round-to-nearest weights (bias correction alone); equalization=True
    runs calib.equalize first (calib.equalization); activation_ranges=True
    runs calib.search_activation_ranges next (calib.activation_ranges);
    weight_ranges=True searches each weight block's clipping range before
    rounding (calib.weight_ranges); act_order=True rounds the columns by
    decreasing input power (module doc)."""
    if not isinstance(prepared, torch.fx.GraphModule):
        raise TypeError(f"calib.apply: prepared must be the GraphModule of prepare_pt2e, got "
                        f"{type(prepared).__name__}")
    start, cpu_start = time.perf_counter(), time.process_time()
    stage_seconds = {}
    clock = [start]

    def stage_done(name: str) -> None:
        now = time.perf_counter()
        stage_seconds[name], clock[0] = now - clock[0], now

    batches = list(batches)
    equalized = equalize(prepared, batches) if equalization else []
    if equalization:
        stage_done("equalization")
    # After equalisation (which replaces and recalibrates the points whose input it scales) and
    # before the statistics GPTQ and bias correction use: they see each layer's input through its
    # point, so the weights are rounded for the activation grid that convert keeps.
    ranges = search_activation_ranges(prepared, batches) if activation_ranges else []
    if activation_ranges:
        stage_done("activation_ranges")
    found, skipped = _layers.usable_layers(prepared)
    if skipped:
        warnings.warn(_layers.skipped_text("calib.apply", skipped), stacklevel=2)
    points = [m for m in prepared.modules() if hasattr(m, "enable_observer")]
    observing = {id(m): bool(getattr(m, "_observer_on", False)) for m in points}
    for m in points:
        m.enable_observer(False)
    try:
        stats = _statistics.collect(prepared, found, batches)
    except Exception:
        for m in points:
            m.enable_observer(observing[id(m)])
        raise
    stage_done("statistics")
    algorithms = tuple(name for name, on in (("equalization", equalization), ("activation_ranges", activation_ranges),
                                             ("weight_ranges", weight_ranges), ("gptq", gptq_rounding),
                                             ("bias_correction", correct_bias)) if on)
    report = CalibReport(algorithms, 0.0, 0.0, equalized=equalized, ranges=ranges, stage_seconds=stage_seconds,
                         skipped=skipped)
    weight_points = {id(layer.point) for layer in found}
    for layer in found:
        s = stats[layer.node]
        w = layer.as_matrix(layer.weight(prepared).float())
        h = s.second_moment
        nearest = layer.quantize(w)
        order = act_order_of(h) if act_order else None
        bound = None
        if weight_ranges:  # each column's error weighted as GPTQ's output error weighs it, or by H_jj for RTN
            column_weights = residual_power(h, damp, order) if gptq_rounding else h.diagonal(dim1=-2, dim2=-1)
            bound = _weight_ranges.search(layer, w.reshape(layer.weight_shape), column_weights)
        bound = None if bound is None else bound.reshape(w.shape)
        rounded = w if bound is None else w.clamp(-bound, bound)
        if gptq_rounding:
            rounded = gptq(w, h, layer.column_quantizer(order, bound),
                           block=block, damp=damp, order=order)
            if bound is not None:
                rounded = rounded.clamp(-bound, bound)
        # The op once more on the whole weight: MX / NVFP4 block scales as deployed.
        rounded = layer.quantize(rounded)
        after_moment = h
        if correct_bias:
            _layers.add_to_bias(prepared, layer, bias_correction(w, rounded, s.mean))
            after_moment = h - s.mean.unsqueeze(-1) * s.mean.unsqueeze(-2)
        if gptq_rounding or weight_ranges:
            _layers.set_weight(prepared, layer, rounded.reshape(layer.weight_shape))
        report.layers.append(LayerResult(layer.weight_name, str(layer.point.qspec),
                                         _output_sqnr(w, w - nearest, h, h),
                                         _output_sqnr(w, w - rounded, h, after_moment)))
    for m in points:  # weight points stay off: their grid is the one the weights were rounded on
        m.enable_observer(observing[id(m)] and id(m) not in weight_points)
    stage_done("rounding")
    report.seconds = time.perf_counter() - start
    report.cpu_seconds = time.process_time() - cpu_start
    return report
