"""Output-aware activation ranges: the (scale, zero point) of every static
per-tensor integer activation point that feeds convs and linears (calib.layers)
chosen among candidate ranges for the smallest output error of the layers
that read it, not the smallest error of the activation itself (what an
observer minimises at best). A ReLU6 network's project conv reads a
tensor whose channels' maxima differ by an order of magnitude: on one
per-tensor grid, the range that serves the large channels rounds the
small ones away, and how much each channel matters is in the weight.

Per point, with X its input (as the prepared model gives it: upstream
points quantizing) on columns sampled from the calibration batches and
Wq a reader's weight as it will be quantized (through its own fake-quant
point, on its calibrated grid), a candidate range r costs

    sum over readers of ||Wq X - Wq Qa_r(X)||^2 / ||Wq X||^2,

the output error the point's rounding and clipping cause, each reader's
relative to its output power (a reader's output scale is arbitrary: q, k
and v of one attention count alike whatever their weights' norms). The
weight's own rounding error is left out: GPTQ, which runs next, rounds the
weights again for the chosen grid (with it in, a 4-bit weight's error
decided the ranges). Qa_r is the point's own op with the qparams of r
(its QSpec: asymmetric or symmetric, ZP or MINVAL: the scheme is kept).
Candidates: the calibrated qparams themselves (so the result is never
worse on the sampled calibration columns), and ranges whose ends are
fractions of the observed range's (the running min / max of the point's
observer, else the calibrated range): `grid` fractions spaced
geometrically from 1/64 to 1, then `grid` as many within one such step
either side of the best. For a symmetric scheme both ends move together;
for an asymmetric one, the upper end with the lower fixed, then the lower
with the best upper, at each of the two resolutions (coordinate descent).

Cost: each candidate is one op call and one matmul per reader on the
sampled columns, so the columns are capped in number (`max_columns`) and
in values (`max_values`: a depthwise conv's column holds every channel's
taps), and a reader with more outputs than inputs is scored through the
triangular factor R of its weight (Wq = QR: ||Wq e|| = ||R e||), an
n x n product instead of o x n.

A point read by anything but a layer's input (an attention matmul, an
add) is left as it is: its other readers' error is not measured. The
chosen qparams are written into the point's buffers and its observer is
switched off, so further calibration or convert keep them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
from torch.utils._pytree import tree_leaves

from ..fake_quantize import FakeQuantize
from ..spec.format_kinds import INTEGER
from ..spec.granularity import PerTensor
from ..spec.schemes import Formulation, Scheme
from . import layers as _layers
from .statistics import column_layout, columns_at

# The coarse candidates' smallest fraction of the observed range.
_SMALLEST_FRACTION = 1 / 64
_SYMMETRIC = (Scheme.SYMMETRIC, Scheme.SYMMETRIC_NARROW, Scheme.SYMMETRIC_NO_CLIP)


@dataclass
class RangeResult:
    """One activation point: the weights of the layers that read it, its
    range (lo, hi) as calibrated and as chosen, and the readers' output
    SQNR (dB; their mean relative error, on the sampled calibration
    columns, round-to-nearest weights) with each."""

    point: str
    consumers: tuple
    calibrated: tuple
    chosen: tuple
    before_db: float
    after_db: float


@dataclass(eq=False)
class _Target:
    node: torch.fx.Node  # the point's call_module
    point: FakeQuantize
    readers: list  # calib.layers.Layer, each reading the point's output as its input
    columns: dict  # reader node -> list of sampled (groups, n, m) input columns, per batch


def _is_searchable(point: FakeQuantize) -> bool:
    spec = point.qspec
    return (spec.kind is INTEGER and not spec.dynamic and not spec.learnable and isinstance(spec.granularity, PerTensor)
            and not point.is_frozen and point.is_calibrated)


def find_targets(gm: torch.fx.GraphModule) -> list[_Target]:
    """The points the search works on (module doc), in graph order."""
    readers = {}
    for layer in _layers.find_layers(gm):
        source = layer.node.args[0]
        if isinstance(source, torch.fx.Node):
            readers.setdefault(source, []).append(layer)
    targets = []
    for node, layers in readers.items():
        if node.op != "call_module":
            continue
        point = gm.get_submodule(node.target)
        if not isinstance(point, FakeQuantize) or not _is_searchable(point):
            continue
        reader_nodes = {layer.node for layer in layers}
        if any(user not in reader_nodes or node in user.args[1:] or node in user.kwargs.values()
               for user in node.users):
            continue  # read elsewhere too (or as a weight): that reader's error is not measured
        targets.append(_Target(node, point, layers, {layer.node: [] for layer in layers}))
    return targets


class _Sampler(torch.fx.Interpreter):
    """Runs the prepared model, keeping each target's input columns, sampled:
    per reader, at most `max_columns` columns and `max_values` values in all,
    spread evenly over the batches."""

    def __init__(self, gm, targets: list[_Target], batches: int, max_columns: int, max_values: int,
                 generator: torch.Generator):
        super().__init__(gm)
        self.targets = {t.node: t for t in targets}
        self.batches = batches
        self.max_columns = max_columns
        self.max_values = max_values
        self.generator = generator

    def run_node(self, n):
        target = self.targets.get(n)
        if target is not None:
            x = self.fetch_args_kwargs_from_env(n)[0][0]
            for layer in target.readers:
                # A grouped conv's column holds all its channels' taps (a 5x5 depthwise conv on 1152
                # channels: 28,800 values, each activation value in up to 25 columns): the value cap
                # keeps its candidates' cost near a dense reader's.
                count, values = column_layout(layer, x)
                columns = min(self.max_columns, max(1, self.max_values // values))
                take = math.ceil(columns / self.batches)
                index = torch.randperm(count, generator=self.generator)[:take] if count > take else torch.arange(count)
                target.columns[layer.node].append(columns_at(layer, x, index))
        return super().run_node(n)


def _calibrated_range(point: FakeQuantize) -> tuple[float, float]:
    """[lo, hi] of the point's stored qparams: what its grid covers."""
    qmin, qmax = point.qspec.quant_range
    q = point.calculate_qparams()
    scale = q["scale"].double().reshape(())
    if point.qspec.formulation is Formulation.MINVAL:
        lo = q["minval"].double().reshape(())
        return lo.item(), (lo + (qmax - qmin) * scale).item()
    zp = q["zero_point"].double().reshape(())
    return ((qmin - zp) * scale).item(), ((qmax - zp) * scale).item()


def _observed_range(point: FakeQuantize, calibrated: tuple) -> tuple[float, float]:
    lo, hi = calibrated
    low, high = getattr(point, "min_val", None), getattr(point, "max_val", None)  # a range observer's
    if low is not None and low.numel() == 1 and bool(low <= high):
        lo, hi = min(lo, low.item()), max(hi, high.item())
    return lo, hi


class _Scorer:
    """Relative output error of the readers for batches of candidate qparams."""

    def __init__(self, gm, target: _Target):
        self.point = target.point
        self.readers = []  # (columns X (g, n, m), Wq X (g, o, m), Wq (g, o, n), ||Wq X||^2)
        for layer in target.readers:
            x = torch.cat(target.columns.pop(layer.node), dim=-1)
            wq = layer.quantize(layer.as_matrix(layer.weight(gm).float()))
            y = wq @ x
            signal = y.double().pow(2).sum().item()
            if wq.shape[-2] > wq.shape[-1]:
                # Wq = QR with Q's columns orthonormal, so ||Wq e|| = ||R e||: a reader with more outputs
                # than inputs (an expand conv, an MLP's up projection) costs each candidate an n x n
                # product instead of an o x n one (R: n x n, upper triangular; fp64 for its digits).
                wq = torch.linalg.qr(wq.double(), mode="r").R.float()
                y = wq @ x
            self.readers.append((x, y, wq, signal))

    def qparams(self, ranges: torch.Tensor) -> dict:
        """The point's qparams for each row (lo, hi) of `ranges`, shape (K,)."""
        return self.point.qspec.kind.qparams_from_range(self.point.qspec, ranges[:, 0], ranges[:, 1])

    def errors(self, qparams: dict) -> torch.Tensor:
        """The summed relative errors (K,) of the candidates' qparams, each of shape (K,)."""
        spec = self.point.qspec
        count = next(iter(qparams.values())).shape[0]
        total = torch.zeros(count, dtype=torch.float64)
        for x, y, wq, signal in self.readers:
            # One op call per candidate on the columns as they are: a batched call needs a copy of
            # the columns per candidate, which costs more than the calls it saves (2-7x on the
            # readers of EfficientNet-Lite0 and MiniLM).
            for i in range(count):
                q = {name: v[i].reshape((1,) * x.dim()) for name, v in qparams.items()}
                xq = spec.kind.fake_quantize(spec, x, tuple(x.shape), q)
                error = (y - wq @ xq).pow(2).sum(dtype=torch.float64)
                total[i] += error / signal if signal > 0 else error
        return total


def _db(relative_error: float, readers: int) -> float:
    return 10 * math.log10(readers / relative_error) if relative_error > 0 else math.inf


def _search(gm, target: _Target, grid: int) -> RangeResult:
    scorer = _Scorer(gm, target)
    point = target.point
    calibrated = _calibrated_range(point)
    lo_ref, hi_ref = _observed_range(point, calibrated)
    # Geometric: the best fraction may be anywhere from 1 to a few percent (an outlier clipped).
    fractions = _SMALLEST_FRACTION ** (1 - torch.arange(grid, dtype=torch.float64) / (grid - 1))
    ratio = _SMALLEST_FRACTION ** (-1 / (grid - 1))  # between neighbouring coarse fractions
    current = {k: v.detach().reshape(1).clone() for k, v in point.calculate_qparams().items()}
    best_error = scorer.errors(current)[0].item()
    before = best_error
    best_qparams, best_range = current, calibrated

    def consider(ranges: torch.Tensor):
        nonlocal best_error, best_qparams, best_range
        qparams = scorer.qparams(ranges.float())
        errors = scorer.errors(qparams)
        i = int(torch.argmin(errors))
        if errors[i].item() < best_error:
            best_error = errors[i].item()
            best_qparams = {k: v[i:i + 1] for k, v in qparams.items()}
            best_range = (ranges[i, 0].item(), ranges[i, 1].item())

    if lo_ref == hi_ref:  # a constant input: every range gives it exactly
        moves = []
    elif point.qspec.scheme in _SYMMETRIC:  # both ends together
        moves = [(True, True)]
    else:  # the upper end, then the lower (coordinate descent)
        moves = [(False, True)] * (hi_ref > 0) + [(True, False)] * (lo_ref < 0)
    for refine in (False, True):
        for vary_lo, vary_hi in moves:
            lo, hi = best_range
            f = fractions
            if refine:  # `grid` fractions within one coarse step either side of the best
                best = hi / hi_ref if vary_hi and hi_ref != 0 else lo / lo_ref
                f = (best * ratio ** torch.linspace(-1, 1, grid, dtype=torch.float64)).clamp(max=1)
            consider(torch.stack([lo_ref * f if vary_lo else torch.full_like(f, lo),
                                  hi_ref * f if vary_hi else torch.full_like(f, hi)], dim=1))
    with torch.no_grad():
        for name, value in best_qparams.items():
            buffer = point.calculate_qparams()[name]
            buffer.copy_(value.reshape(buffer.shape).to(buffer.dtype))
    readers = len(target.readers)
    return RangeResult(str(target.node.target), tuple(layer.weight_name for layer in target.readers), calibrated,
                       _calibrated_range(point), _db(before, readers), _db(best_error, readers))


def search_activation_ranges(prepared: torch.fx.GraphModule, batches: Iterable, *, grid: int = 16,
                             max_columns: int = 2048, max_values: int = 1 << 22,
                             seed: int = 0) -> list[RangeResult]:
    """Chooses the range of every static per-tensor integer activation point
    of `prepared` (calibrated) that only convs and linears with a weight
    point read, for their smallest output error on `batches` (module doc),
    writes its qparams into the point and switches the point's observer
    off; the other points' observers are as they were. The float model is
    not touched (only points' buffers change).

    Args:
        prepared: the calibrated GraphModule of prepare_pt2e.
        batches: calibration batches (tensors or tuples of tensors).
        grid: candidate range ends per stage (module doc).
        max_columns: input columns (a linear's rows, a conv's patches) sampled per reader.
        max_values: input values sampled per reader (columns times the values of a column,
            a grouped conv's groups times its taps): fewer columns where max_columns
            would exceed it.
        seed: the seed of the column sampling.

    Returns:
        One RangeResult per point searched, in graph order.

    Raises:
        TypeError: prepared is not a GraphModule.
        ValueError: grid < 2, max_columns < 1, max_values < 1, or batches empty.
    """
    if not isinstance(prepared, torch.fx.GraphModule):
        raise TypeError(f"search_activation_ranges: prepared must be the GraphModule of prepare_pt2e, got "
                        f"{type(prepared).__name__}")
    if not isinstance(grid, int) or grid < 2:
        raise ValueError(f"search_activation_ranges: grid must be an int >= 2, got {grid!r}")
    if not isinstance(max_columns, int) or max_columns < 1:
        raise ValueError(f"search_activation_ranges: max_columns must be an int >= 1, got {max_columns!r}")
    if not isinstance(max_values, int) or max_values < 1:
        raise ValueError(f"search_activation_ranges: max_values must be an int >= 1, got {max_values!r}")
    inputs = [tree_leaves(b if isinstance(b, tuple) else (b,)) for b in batches]
    if not inputs:
        raise ValueError("search_activation_ranges: batches holds no batch")
    targets = find_targets(prepared)
    if not targets:
        return []
    points = [m for m in prepared.modules() if isinstance(m, FakeQuantize)]
    observing = {id(m): m._observer_on for m in points}
    for m in points:  # sampling must not move the ranges
        m.enable_observer(False)
    try:
        sampler = _Sampler(prepared, targets, len(inputs), max_columns, max_values,
                           torch.Generator().manual_seed(seed))
        with torch.no_grad():
            for batch in inputs:
                sampler.run(*batch)
    finally:
        for m in points:
            m.enable_observer(observing[id(m)])
    results = []
    with torch.no_grad():
        for target in targets:
            results.append(_search(prepared, target, grid))
            target.point.enable_observer(False)  # further calibration would move the chosen range
    return results
