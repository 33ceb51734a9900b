"""Where ONNX Runtime's run of an exported file first leaves the program's
values, and whether a correct computation may differ that much there.

When check_onnx finds an output over its end-to-end bound, the first point
whose value leaves torch's in ORT's run of the whole file must have an input
within what a correct computation may differ by (_input_bound: a conv's or
matmul's float rounding derived from its terms, plus the int32 rounding ORT's
optimiser gives its bias; FLOAT_OUTPUT_RTOL after other float ops): then the
differences cascade from a rounding flip there (`Cascade.explained`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch
from torch.utils._pytree import tree_leaves, tree_map

from ..output_diff import abs_diff, output_diff
from . import points
from .points import FLOAT_OUTPUT_RTOL, float_tolerance, numpy_of, output_of, same_bits
from .session import ort_session


@dataclass(frozen=True)
class Cascade:
    """Where ONNX Runtime's run of the whole file first leaves torch's
    values: the first point whose output differs, how many of its elements,
    and how far its input was off (`input_diff`, the largest difference)
    against the bound of what a correct computation of that input may differ
    by (`bound`, how it is derived: see _input_bound). `bound_ratio` is the
    largest difference / bound over the input's elements, and
    `input_tolerance` the bound at that element. Within the bound
    (`explained`), a float-kernel difference moved a value across a
    rounding boundary there: the differences downstream cascade from that
    flip."""

    point: str
    differing: int
    numel: int
    input_diff: float
    input_tolerance: float
    bound_ratio: float = math.nan
    bound: str = "float rounding"

    @property
    def explained(self) -> bool:
        if math.isnan(self.bound_ratio):
            return self.input_diff <= self.input_tolerance
        return self.bound_ratio <= 1

    def __str__(self) -> str:
        if math.isnan(self.bound_ratio):
            off = f"its input off by {self.input_diff:.3g} (bound {self.input_tolerance:.3g}: {self.bound})"
        else:
            off = (f"its input off by up to {self.input_diff:.3g}; nearest its bound, by "
                   f"{self.bound_ratio * self.input_tolerance:.3g} against {self.input_tolerance:.3g} "
                   f"({self.bound_ratio:.3g} of it; the bound: {self.bound})")
        return (f"ORT's run of the whole file first leaves torch's values at point {self.point}: {self.differing} of "
                f"{self.numel} elements differ, {off}")


# The ops a point's input may come from whose float rounding check_onnx's
# cascade diagnostic derives from the computation (see _reduction_bound):
# reductions over K products of (dequantized) values.
_aten = torch.ops.aten


_REDUCTIONS = {_aten.conv1d.default, _aten.conv2d.default, _aten.conv3d.default, _aten.convolution.default,
               _aten.linear.default, _aten.matmul.default, _aten.mm.default, _aten.bmm.default,
               _aten.addmm.default}


# Elementwise ops that move no two values further apart (1-Lipschitz): a
# bound on their input's difference bounds their output's.
_CONTRACTIONS = {_aten.relu.default, _aten.relu_.default, _aten.clamp.default, _aten.clamp_.default,
                 _aten.hardtanh.default, _aten.hardtanh_.default}


_ONNX_CONTRACTIONS = ("Relu", "Clip", "Identity")


def _reduction_bound(node, values) -> Optional[tuple[np.ndarray, str]]:
    """When the point's input is a conv, linear or matmul (through
    contractions only: relu, clamp): per element of the input, the bound of
    float rounding on the difference of two correct fp32 computations of it
    in any summation order, 2 * gamma_(K+1) * (|A| @ |B| + |bias|), gamma_n =
    n u / (1 - n u) (Higham, Accuracy and Stability of Numerical Algorithms,
    3.1), u the unit roundoff of the input's dtype, K the reduction length;
    None otherwise."""
    n = node.args[0]
    while isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target in _CONTRACTIONS:
        n = n.args[0]
    if not (isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target in _REDUCTIONS):
        return None
    value = lambda a: values[a.name] if isinstance(a, torch.fx.Node) else a  # noqa: E731
    args, kwargs = tree_map(value, tuple(n.args)), tree_map(value, dict(n.kwargs))
    tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if not all(t.is_floating_point() for t in tensors):
        return None
    target = n.target
    if target in (_aten.conv1d.default, _aten.conv2d.default, _aten.conv3d.default, _aten.convolution.default):
        w = args[1]
        transposed = target is _aten.convolution.default and args[6]
        k = (w.shape[0] // args[8] if transposed else w.shape[1]) * math.prod(w.shape[2:])
        has_bias = len(args) > 2 and args[2] is not None
    elif target is _aten.linear.default:
        k, has_bias = args[1].shape[-1], len(args) > 2 and args[2] is not None
    elif target is _aten.addmm.default:
        k, has_bias = args[1].shape[-1], True
    else:
        k, has_bias = args[0].shape[-1], False
    absolute = lambda a: a.detach().double().abs() if isinstance(a, torch.Tensor) else a  # noqa: E731
    with torch.no_grad():
        terms = target(*tree_map(absolute, args), **tree_map(absolute, kwargs))
    n_ops = k + has_bias
    u = float(torch.finfo(values[node.args[0].name].dtype).eps) / 2
    gamma = n_ops * u / (1 - n_ops * u)
    return (2 * gamma * terms.cpu().numpy(),
            f"float rounding of a {k}-term {target.__name__.split('.')[0]}, 2 * gamma_{n_ops} * sum|terms|")


def _constants(model) -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    found = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    found[n.output[0]] = numpy_helper.to_array(a.t)
    return found


def _bias_rounding(model, x_name: str, ndim: int) -> Optional[np.ndarray]:
    """ONNX Runtime's optimiser (its WeightBiasQuantization pass, on with
    graph optimisations; BiasQuantization in earlier releases) replaces the
    float bias of a Conv, ConvTranspose or Gemm whose input is a
    DequantizeLinear output per tensor and whose weight is one per tensor or
    per output channel by DequantizeLinear(int32(round(bias / (s_in * s_w))),
    s_in * s_w): the int32 bias of its integer kernels (QLinearConv, QGemm).
    When the point's input `x_name` is such a node's output (through Relu /
    Clip), the difference that rounding makes per output channel, computed
    as ORT does (fp32 Mul, Div, Round half to even, DequantizeLinear),
    shaped to broadcast over the output of `ndim` dims; None otherwise."""
    producers = {out: n for n in model.graph.node for out in n.output}
    node = producers.get(x_name)
    while node is not None and node.op_type in _ONNX_CONTRACTIONS:
        node = producers.get(node.input[0])
    if node is None or node.op_type not in ("Conv", "ConvTranspose", "Gemm") or len(node.input) < 3:
        return None
    consts = _constants(model)
    bias = consts.get(node.input[2]) if node.input[2] else None
    dq = [producers.get(name) for name in node.input[:2]]
    if bias is None or bias.ndim != 1 or any(d is None or d.op_type != "DequantizeLinear" for d in dq):
        return None
    s_in, s_w = consts.get(dq[0].input[1]), consts.get(dq[1].input[1])
    if s_in is None or s_w is None or s_in.size != 1 or s_in.ndim > 1:
        return None
    if s_w.size != 1 or s_w.ndim > 1:
        attrs = {a.name: a.i for a in dq[1].attribute}
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        expected_axis = (1 if trans_b == 0 else 0) if node.op_type == "Gemm" else 0
        # ORT reads block_size 0 (the exporter writes it) as no blocks.
        blocked = attrs.get("block_size", 0) != 0
        if s_w.ndim != 1 or s_w.size != bias.size or blocked or attrs.get("axis", 1) != expected_axis:
            return None
    scale = (s_in.astype(np.float32) * s_w.astype(np.float32)).reshape(-1)
    code = np.round((bias.astype(np.float32) / scale).astype(np.float32))
    rounded = (code.astype(np.float32) * scale).astype(np.float32)
    error = np.abs(rounded.astype(np.float64) - bias.astype(np.float64))
    channel_axis = ndim - 1 if node.op_type == "Gemm" else 1
    shape = [1] * ndim
    shape[channel_axis] = error.size
    return error.reshape(shape) if ndim > channel_axis else None


def _input_bound(node, x_name: Optional[str], model, values, x_expected: np.ndarray,
                 optimized: bool) -> tuple[Union[float, np.ndarray], str]:
    """The bound on |ORT - torch| of a point's input, given that the points
    before it agree bit for bit (its inputs are the same dequantized values
    on both sides), per element or one number, and what it is made of.

    - The input of a conv, linear or matmul (through relu / clamp):
      float rounding of the reduction, derived from the computation
      (_reduction_bound), plus, with ORT's graph optimisations on, the
      rounding of its bias to int32 that ORT's optimiser makes
      (_bias_rounding: the integer kernels' semantics, not float rounding;
      up to half of s_in * s_w per channel);
    - any other: float rounding of the float ops on the way,
      FLOAT_OUTPUT_RTOL of its largest magnitude."""
    reduction = _reduction_bound(node, values)
    if reduction is None or reduction[0].shape != x_expected.shape:
        return float_tolerance(x_expected), f"float rounding: {FLOAT_OUTPUT_RTOL:g} of its largest magnitude"
    bound, how = reduction
    if optimized and x_name:
        bias = _bias_rounding(model, x_name, x_expected.ndim)
        if bias is not None:
            bound = bound + bias
            how += " + ORT's rounding of its bias to int32 at s_in * s_w (WeightBiasQuantization)"
    return bound, how


def _first_divergence(model, pairs, values, feeds: dict, optimized: bool) -> Optional[Cascade]:
    """Runs the whole file once, with ORT's graph optimisations on or off as
    in the run that broke the bound (an optimised session rewrites float ops,
    and only it flips the roundings that follow), with every point's input
    and output as extra outputs, and finds the first point, in graph order,
    whose output differs from torch's. None when none does."""
    from onnx.utils import Extractor

    graph_inputs = [i.name for i in model.graph.input]
    constants = {t.name for t in model.graph.initializer} | set(graph_inputs)
    produced = {v for n in model.graph.node for v in n.output}
    wanted = []
    for _, file_point in pairs:
        for name in (file_point["input"], file_point["output"]):
            if name in produced and name not in constants and name not in wanted:
                wanted.append(name)
    if not wanted:
        return None
    run = Extractor(model).extract_model(graph_inputs, wanted)
    got = dict(zip(wanted, ort_session(run, optimized=optimized).run(wanted, feeds)))
    for node, file_point in pairs:
        if file_point["output"] not in got:
            continue
        out, expected = got[file_point["output"]], numpy_of(values[output_of(node).name])
        if same_bits(out, expected):
            continue
        x_name = file_point["input"]
        differing = output_diff(0, expected, out, None).differing
        if x_name not in got:  # a constant or a graph input: torch's own
            return Cascade(node.name, differing, int(expected.size), 0.0, 0.0, 0.0, "none: torch's own input")
        x_expected = numpy_of(values[node.args[0].name])
        diff = abs_diff(x_expected, got[x_name])
        bound, how = _input_bound(node, x_name, model, values, x_expected, optimized)
        bound = np.broadcast_to(np.asarray(bound, dtype=np.float64), diff.shape)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(diff == 0, 0.0, diff / bound)
        worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape) if ratio.size else ()
        return Cascade(node.name, differing, int(expected.size), float(diff.max()) if diff.size else 0.0,
                       float(bound[worst]) if diff.size else 0.0, float(ratio[worst]) if diff.size else 0.0, how)
    return None


def first_divergence(path: Union[str, os.PathLike], model, inputs, *, optimized: bool = True) -> Optional[Cascade]:
    """Where ONNX Runtime's run of the file at `path` (graph optimisations on
    or off) first leaves the values of `model` (as in check_onnx) on
    `inputs`: the first point whose output differs, with its input's
    difference against the bound of a correct computation (Cascade); None
    when every point agrees. check_onnx runs it over its end-to-end bound."""
    r = points.run(path, model, inputs)
    return _first_divergence(r.model, r.pairs, r.values, r.graph_feeds, optimized)
