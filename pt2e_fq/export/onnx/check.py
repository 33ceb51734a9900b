"""Checks an exported ONNX file in ONNX Runtime (CPU) against the torch model.

Two comparisons:

- every quantization point, bit for bit: the point's Q/DQ subgraph is cut out
  of the file (by the names torch.onnx gives values: those of the program's
  nodes) and run on the very tensor the torch point received; its output must
  equal the torch op's. This is the exporter's promise, independent of the
  float ops around the points (ORT's and torch's conv, matmul, layer norm or
  gelu differ in the last bits, and such a difference can move a value
  across a rounding boundary of the next point);
- the outputs, end to end, with graph optimisations off and on (QDQ fusion
  into integer kernels): a quantized output agrees on average (RMS
  difference at most one quantization step: a float-kernel difference that
  moves a value across a rounding boundary flips it by a step, and in a deep
  net such flips cascade into a few elements some steps off); a float output
  within float rounding (in a weight-only file past it, no further from the
  program's float64 run than FLOAT64_ERROR_FACTOR times torch's float32 run;
  with optimisations on, after ORT's fused integer kernels: an SQNR floor,
  FUSED_FLOAT_OUTPUT_MIN_SQNR_DB). Each output's
  statistics (output_diff.OutputDiff) come back in the OnnxCheck.

Over that bound, the first point whose value leaves torch's in ORT's run of
the whole file must have an input within what a correct computation may
differ by (_input_bound: a conv's or matmul's float rounding derived from
its terms, plus the int32 rounding ORT's optimiser gives its bias;
FLOAT_OUTPUT_RTOL after other float ops): then the differences cascade from
a rounding flip there, and the check passes, saying so.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch
from tabulate import tabulate
from torch.utils._pytree import tree_leaves, tree_map

from ...graph import as_args, decode_node, is_fake_quant_node, program_constants
from .export import POINTS_METADATA, require_onnx
from ..output_diff import HEADERS, abs_diff, output_diff
from ..program import exported_program

# ONNX Runtime CPU optimizer passes with known bugs on QDQ graphs (1.32):
# ReluQuantRewrite drops a Relu before an fp8 QuantizeLinear with zero point 0;
# MatMulAddFusion fails on int8 activations into a 3-D Linear with bias;
# QDQS8ToU8Transformer turns to uint8 the zero point of a QuantizeLinear that
# QDQPropagationTransformer inserted after a Reshape with output_dtype=INT8,
# and the session fails to load (int8 activations through flatten / view).
ORT_DISABLED_OPTIMIZERS = ("ReluQuantRewrite", "MatMulAddFusion", "QDQS8ToU8Transformer")
# ORT fuses DequantizeLinear (8-bit blocked weights) -> MatMul into
# MatMulNBits, which by default (accuracy level 4) quantizes its activations
# to int8 on the fly: not the model's numerics. Level 0 computes in fp32.
ORT_SESSION_CONFIG = {"session.qdq_matmulnbits_accuracy_level": "0"}
# An output that no constant-scale DequantizeLinear produces (a float output,
# weight-only models) may differ by the rounding of the float ops: this share
# of its largest magnitude.
FLOAT_OUTPUT_RTOL = 1e-5
# A float output of a file that quantizes no activations (a weight-only
# preset) comes out of every float op of the net in a row, and each
# runtime's float32 rounding is amplified layer by layer (EfficientNet-B0,
# 81 convolutions: ORT 1.7e-4 of the largest magnitude from torch, each
# about 1e-4 from exact arithmetic). Past FLOAT_OUTPUT_RTOL the bound is then
# ORT no further from the float64 run of the same program than this many
# times torch's float32 run is: two float32 implementations of the same
# arithmetic, neither more than a small factor less accurate than the other.
FLOAT64_ERROR_FACTOR = 4.0
# With graph optimisations on, ORT computes a float output after quantized
# activations in fused integer kernels (MatMulIntegerToFloat, QLinear*),
# whose accumulation and rescaling differ from torch's float op on the
# dequantized values by more than float rounding (measured: 1e-3 of the
# largest magnitude, 60 dB). The bound: the difference adds no more noise
# than one more 8-bit quantization of a full-range signal would
# (6.02 dB x 8 bits): SQNR of ORT against torch at least this.
FUSED_FLOAT_OUTPUT_MIN_SQNR_DB = 48.0
# The end-to-end bound of a quantized output: RMS of ORT - torch in its
# quantization steps (plus the fp32 rounding of the dequantized values).
END_TO_END_MAX_RMS_STEPS = 1 + 1e-3


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


@dataclass(frozen=True)
class OnnxCheck:
    """What check_onnx measured: how many points it compared bit for bit;
    per output, ORT against torch with graph optimisations off and on
    (`unoptimized`, `optimized`: OutputDiff per output); the largest
    |ORT - torch| of each, and the largest quantization step of the outputs
    (`tolerance`, the unit of the bound; for float outputs their rounding
    tolerance). str() is a table."""

    points: int
    max_abs_diff_unoptimized: float
    max_abs_diff_optimized: float
    tolerance: float
    unoptimized: tuple = ()
    optimized: tuple = ()
    cascade: Optional[Cascade] = None

    @property
    def max_steps(self) -> Optional[float]:
        """The largest difference in steps of any quantized output, either mode."""
        steps = [d.max_steps for d in self.unoptimized + self.optimized if d.max_steps is not None]
        return max(steps) if steps else None

    @property
    def min_sqnr_db(self) -> float:
        return min((d.sqnr_db for d in self.unoptimized + self.optimized), default=math.inf)

    def __str__(self) -> str:
        rows = [("off" if mode == "unoptimized" else "on",) + d.row()
                for mode in ("unoptimized", "optimized") for d in getattr(self, mode)]
        text = (f"{self.points} points bit-exact in ONNX Runtime on torch's inputs; outputs end to end:\n"
                + tabulate(rows, headers=("ORT optimisations",) + HEADERS))
        if self.cascade is not None:
            text += f"\nOver the bound, explained: {self.cascade}; the differences cascade from there."
        return text


def ort_session(model_or_path, optimized: bool = True):
    """An ONNX Runtime CPU session of an exported file (or onnx.ModelProto)
    with the settings check_onnx verifies: ORT_DISABLED_OPTIMIZERS off,
    ORT_SESSION_CONFIG set; graph optimisations on unless optimized=False.
    Deploy with these settings."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    for key, value in ORT_SESSION_CONFIG.items():
        so.add_session_config_entry(key, value)
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimized else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    source = model_or_path.SerializeToString() if hasattr(model_or_path, "SerializeToString") else os.fspath(
        model_or_path)
    return ort.InferenceSession(
        source, so, providers=["CPUExecutionProvider"], disabled_optimizers=list(ORT_DISABLED_OPTIMIZERS)
    )


def _output_steps(model) -> list[Optional[float]]:
    """Per graph output: the largest scale of the DequantizeLinear that
    produces it (its quantization step), None when no DequantizeLinear with a
    constant scale does."""
    from onnx import numpy_helper

    producers = {out: n for n in model.graph.node for out in n.output}
    consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    steps = []
    for out in model.graph.output:
        node = producers.get(out.name)
        # Cast back to bf16 / fp16, Add of minval and the Min / Max clamp keep the DQ's step.
        while node is not None and node.op_type in ("Cast", "Add", "Max", "Min") and node.input[0] in producers:
            node = producers[node.input[0]]
        scale = consts.get(node.input[1]) if node is not None and node.op_type == "DequantizeLinear" else None
        steps.append(float(np.max(scale)) if scale is not None else None)
    return steps


def _quantizes_activations(model) -> bool:
    """Whether the file quantizes an activation (a QuantizeLinear of a value
    that is not an initializer): only then can ORT fuse integer kernels
    with float outputs. Weight-only files keep the strict float bound."""
    constants = {t.name for t in model.graph.initializer}
    constants |= {out for n in model.graph.node if n.op_type == "Constant" for out in n.output}
    return any(n.op_type == "QuantizeLinear" and n.input[0] not in constants for n in model.graph.node)


def _numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        raise TypeError(
            "check_onnx: ONNX Runtime's Python API exchanges no bfloat16 arrays (numpy has no bfloat16); "
            "check the model in float32 or float16"
        )
    return t.detach().cpu().numpy()


def _float_tolerance(expected: np.ndarray) -> float:
    finite = np.abs(expected[np.isfinite(expected)])
    return FLOAT_OUTPUT_RTOL * float(finite.max()) if finite.size else 0.0


def _node_values(ep: torch.export.ExportedProgram, args) -> dict[str, torch.Tensor]:
    """Every node's value in a run of the program, by node name, and the
    program's parameters, buffers and constants by placeholder name (a
    dynamic point may read one directly: a position embedding)."""
    values = dict(program_constants(ep))

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            result = super().run_node(node)
            # A copy: a later in-place op (`out += x`, relu_) would change
            # the recorded tensor under the point that read it.
            values[node.name] = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, result)
            return result

    module = ep.module()
    with torch.no_grad():
        Recorder(module).run(*tree_leaves(args))
    # The module's placeholders are the program's user inputs in order, but
    # FX renames one that shadows a Python builtin (nn.Sequential's `input`
    # becomes `input_1`): give their values the program's names too.
    placeholders = [n.name for n in module.graph.nodes if n.op == "placeholder"]
    for program_name, module_name in zip(ep.graph_signature.user_inputs, placeholders):
        values[program_name] = values[module_name]
    return values


def _float64_outputs(ep: torch.export.ExportedProgram, args) -> list[np.ndarray]:
    """The program's outputs computed in float64: every float op on float64
    values, the fake-quant ops (float32 kernels) on their inputs rounded to
    float32, their outputs taken back to float64 (in a weight-only program
    they read constants only: the same codes as the float32 run)."""

    def widen(v):
        return v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v

    def narrow(v):
        return v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.float64 else v

    class Float64(torch.fx.Interpreter):
        def call_function(self, target, args, kwargs):
            if getattr(target, "namespace", None) == "pt2e_fq":
                return tree_map(widen, target(*tree_map(narrow, args), **tree_map(narrow, kwargs)))
            return target(*tree_map(widen, args), **tree_map(widen, kwargs))

    with torch.no_grad():
        out = Float64(ep.module()).run(*tree_map(widen, tree_leaves(args)))
    return [_numpy(v) for v in tree_leaves(out)]


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _check_points(model, ep, values, graph_feeds: dict) -> list:
    """Runs each point's Q/DQ subgraph of `model` (located by the file's
    POINTS_METADATA) on the torch point's input and compares bit for bit;
    returns the (program node, file entry) of every point, in graph order.

    The file's points pair with the program's in graph order (to_onnx
    records them as it translates the program's nodes in order), not by
    name: the exporter decomposes the program first and renames its nodes.
    Its optimizer merges identical subgraphs (CSE: two norms' weights that
    are both all ones give the same codes and scales), so a point whose
    output is gone from the file must give, in torch, the bits of a point
    that was checked."""
    from onnx.utils import Extractor

    metadata = {p.key: p.value for p in model.metadata_props}.get(POINTS_METADATA)
    if metadata is None:
        raise AssertionError(f"check_onnx: the file has no {POINTS_METADATA!r} metadata; export it with to_onnx")
    file_points = json.loads(metadata)
    nodes = [node for node in ep.graph.nodes if is_fake_quant_node(node)]
    if not nodes:
        suspect = (f"the file has {len(file_points)} point(s): pass the converted model it was exported "
                   "from, not the float model" if file_points else
                   "neither has the file: export and check a converted model (pipeline.convert)")
        raise AssertionError(f"check_onnx: the model has no fake-quant point, so nothing would be checked; {suspect}")
    if len(nodes) != len(file_points):
        raise AssertionError(
            f"check_onnx: the file has {len(file_points)} points, the model {len(nodes)}; check the file against "
            "the model it was exported from"
        )
    file_values = {v for n in model.graph.node for v in n.output} | {v.name for v in model.graph.input} | {
        t.name for t in model.graph.initializer}
    extractor = Extractor(model)
    checked, merged = [], []
    pairs = list(zip(nodes, file_points))
    for node, file_point in pairs:
        expected = _numpy(values[_output_of(node).name])
        x_name, y_name = file_point["input"], file_point["output"]
        if y_name not in file_values:
            merged.append((node, expected))
            continue
        # The graph's inputs come along: a point of a dynamic batch reads its
        # size from them (Shape of the model's input) for its qparams' layout.
        feeds = {**graph_feeds, **({x_name: _numpy(values[node.args[0].name])} if x_name else {})}
        point = extractor.extract_model(list(feeds), [y_name])
        (got,) = ort_session(point, optimized=False).run(None, feeds)
        if not _same_bits(got, expected):
            if x_name:  # an input of the run (a weight point reads a constant of the file)
                _explain_nan(node, x_name, y_name, values[node.args[0].name], got, expected)
            raise AssertionError(
                f"check_onnx: point {node.name} ({x_name} -> {y_name} in the file) differs from torch in ONNX "
                f"Runtime on the same input: {int((got != expected).sum())} of {got.size} elements, max |diff| "
                f"{output_diff(0, expected, got, None).max_abs_diff:g}; it must be bit-exact"
            )
        checked.append(expected)
    for node, expected in merged:
        if not any(_same_bits(expected, c) for c in checked):
            raise AssertionError(
                f"check_onnx: point {node.name} is not in the file, and no point of the file gives its values "
                "(its subgraph was merged away by the exporter's optimizer only if an identical one remains)"
            )
    return pairs


def _output_of(node) -> torch.fx.Node:
    (y,) = [u for u in node.users if u.args[1] == 0]
    return y


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
        return _float_tolerance(x_expected), f"float rounding: {FLOAT_OUTPUT_RTOL:g} of its largest magnitude"
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
        out, expected = got[file_point["output"]], _numpy(values[_output_of(node).name])
        if _same_bits(out, expected):
            continue
        x_name = file_point["input"]
        differing = output_diff(0, expected, out, None).differing
        if x_name not in got:  # a constant or a graph input: torch's own
            return Cascade(node.name, differing, int(expected.size), 0.0, 0.0, 0.0, "none: torch's own input")
        x_expected = _numpy(values[node.args[0].name])
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
    require_onnx()
    import onnx

    args = as_args(inputs)
    ep = exported_program(model, args)
    values = _node_values(ep, args)
    onnx_model = onnx.shape_inference.infer_shapes(onnx.load(os.fspath(path)))
    graph_feeds = {i.name: _numpy(a) for i, a in zip(onnx_model.graph.input, tree_leaves(args))}
    pairs = _check_points(onnx_model, ep, values, graph_feeds)
    return _first_divergence(onnx_model, pairs, values, graph_feeds, optimized)


def _explain_nan(node, x_name, y_name, x: torch.Tensor, got: np.ndarray, expected: np.ndarray) -> None:
    """Raises the precise AssertionError when a point differs only where its
    input is NaN and torch gives NaN: an integer QuantizeLinear has no NaN
    code (ONNX leaves the conversion undefined; ONNX Runtime 1.32 CPU gives
    the lowest code, as for -Inf), so the file turns NaN into a finite value."""
    x = _numpy(x)
    if got.shape != expected.shape or x.shape != expected.shape:
        return
    differs = ~((got == expected) | (np.isnan(got) & np.isnan(expected)))
    nan_in = np.isnan(x)
    if not differs.any() or not (nan_in[differs].all() and np.isnan(expected[differs]).all()):
        return
    fmt = decode_node(node).format
    finite = np.unique(got[differs])
    raise AssertionError(
        f"check_onnx: point {node.name} ({x_name} -> {y_name}) gets {int(nan_in.sum())} NaN input element(s): "
        f"torch gives NaN, ONNX Runtime {', '.join(f'{v:g}' for v in finite[:4])} (QuantizeLinear to {fmt!r} "
        "has no NaN code; ONNX Runtime uses the lowest, as for -Inf); every other element is bit-exact. "
        "The ONNX file turns NaN inputs into finite values (docs/export.md, 'Non-finite values'): check it "
        "with finite inputs"
    )


def check_onnx(path: Union[str, os.PathLike], model, inputs, *, atol: Optional[float] = None) -> OnnxCheck:
    """Checks the ONNX file at `path`, exported by to_onnx from `model` (a
    converted model or an ExportedProgram, its QAT conv-bn folded as to_onnx
    does by default), in ONNX Runtime on CPU with `inputs`:

    - every fake-quant point, run on the input the torch point receives, is
      bit for bit the torch op's output (the strict check: the export's
      promise);
    - end to end, with graph optimisations off and on (ORT_DISABLED_OPTIMIZERS
      off, ORT_SESSION_CONFIG set), each quantized output's RMS difference
      from torch is at most one quantization step (the scale of the
      DequantizeLinear producing it; single elements may be further off
      where float-kernel differences flip roundings that cascade), a float
      output within FLOAT_OUTPUT_RTOL of its largest magnitude (in a file
      that quantizes no activation, past that, no further from the
      program's float64 run than FLOAT64_ERROR_FACTOR times torch's float32
      run: a deep net amplifies both runtimes' rounding), except with
      optimisations on in a file that quantizes activations, where ORT's
      fused integer kernels compute it: there its SQNR against torch is at
      least FUSED_FLOAT_OUTPUT_MIN_SQNR_DB. `atol`,
      where given, bounds the largest difference of every output instead.

    Raises AssertionError on a mismatch; returns the measured OnnxCheck
    (print it for the table of every output).
    """
    require_onnx()
    import onnx

    args = as_args(inputs)
    ep = exported_program(model, args)
    values = _node_values(ep, args)
    onnx_model = onnx.shape_inference.infer_shapes(onnx.load(os.fspath(path)))
    feeds_values = [_numpy(a) for a in tree_leaves(args)]
    graph_feeds = {i.name: v for i, v in zip(onnx_model.graph.input, feeds_values)}
    pairs = _check_points(onnx_model, ep, values, graph_feeds)

    output_node = next(n for n in ep.graph.nodes if n.op == "output")
    expected = [_numpy(values[n.name]) for n in tree_leaves(output_node.args[0])]
    steps = _output_steps(onnx_model)
    fused = _quantizes_activations(onnx_model)
    diffs, violations, exact = {}, [], None
    for optimized in (False, True):
        sess = ort_session(path, optimized)
        got = sess.run(None, {i.name: v for i, v in zip(sess.get_inputs(), feeds_values)})
        diffs[optimized] = []
        for k, (g, e, step) in enumerate(zip(got, expected, steps)):
            if g.shape != e.shape or g.dtype != e.dtype:
                raise AssertionError(f"check_onnx: output {k}: ORT gives {g.dtype}{g.shape}, torch {e.dtype}{e.shape}")
            d = output_diff(k, e, g, step)
            diffs[optimized].append(d)
            mode = f"with ORT graph optimisations {'on' if optimized else 'off'}"
            if atol is not None:
                if not d.max_abs_diff <= atol:
                    violations.append((optimized, f"output {k} differs from torch by {d.max_abs_diff:g} {mode}, "
                                                  f"more than atol ({atol:g})"))
            elif step is None and optimized and fused:
                if not d.sqnr_db >= FUSED_FLOAT_OUTPUT_MIN_SQNR_DB:
                    violations.append((optimized,
                        f"float output {k} differs from torch {mode} with an SQNR of {d.sqnr_db:.1f} dB, below "
                        f"{FUSED_FLOAT_OUTPUT_MIN_SQNR_DB:g} dB (FUSED_FLOAT_OUTPUT_MIN_SQNR_DB: ORT's integer "
                        f"kernels may add the noise of one 8-bit quantization); largest difference "
                        f"{d.max_abs_diff:g}"))
            elif step is None:
                if d.max_abs_diff <= _float_tolerance(e):
                    continue
                why = (f"float output {k} differs from torch by {d.max_abs_diff:g} {mode}, more than float "
                       f"rounding ({_float_tolerance(e):g}: FLOAT_OUTPUT_RTOL of its largest magnitude); "
                       f"SQNR {d.sqnr_db:.1f} dB")
                if not fused:  # weight-only: measured against float64 (FLOAT64_ERROR_FACTOR)
                    if exact is None:
                        exact = _float64_outputs(ep, args)
                    ort_error, torch_error = (float(np.abs(x.astype(np.float64) - exact[k]).max()) for x in (g, e))
                    if ort_error <= FLOAT64_ERROR_FACTOR * torch_error:
                        continue
                    why += (f"; from the float64 run ORT is {ort_error:g} off, torch {torch_error:g}: more than "
                            f"FLOAT64_ERROR_FACTOR ({FLOAT64_ERROR_FACTOR:g}) times torch's own rounding")
                violations.append((optimized, why))
            elif not d.rms_steps <= END_TO_END_MAX_RMS_STEPS:
                violations.append((optimized,
                    f"output {k} differs from torch {mode} by {d.rms_steps:.3g} quantization steps RMS (the bound "
                    f"is 1 step of {step:g}); {d.differing} of {d.numel} elements differ, the largest by "
                    f"{d.max_steps:.3g} steps, SQNR {d.sqnr_db:.1f} dB"))
    cascade = None
    if violations:
        broken_optimized, first_violation = violations[0]
        cascade = _first_divergence(onnx_model, pairs, values, graph_feeds, broken_optimized)
        if cascade is None or not cascade.explained:
            why = ("no point's rounding flipped on the way: a float op of the file differs from torch"
                   if cascade is None else f"{cascade}; over that bound, so the float ops before it differ "
                   "from torch")
            raise AssertionError(f"check_onnx: {first_violation}; {why}")
    tolerance = max((s if s is not None else _float_tolerance(e) for s, e in zip(steps, expected)), default=0.0)
    return OnnxCheck(len(pairs), max((d.max_abs_diff for d in diffs[False]), default=0.0),
                     max((d.max_abs_diff for d in diffs[True]), default=0.0), float(tolerance),
                     tuple(diffs[False]), tuple(diffs[True]), cascade)
