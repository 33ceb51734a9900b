"""Per-point quantization report of a prepared or converted model, or of a
saved program.

`report(model, example_inputs)` runs a copy of the model once (observers
off) and records every pt2e_fq op call with its arguments and outputs, so
each row shows what the point really applied to these inputs, dynamic points
included: one row per fake-quant point with its module path, role (input /
weight / output of which op), format, granularity, scale and zero-point
ranges, the share of elements clipped (from the op's clamp mask), the SQNR
of the fake-quantized tensor against its float input (over its finite
elements) and how many NaN / Inf values the point's observer ignored while
calibrating. A summary compares the float and quantized weight bytes (a
tensor several points read, tied weights, counts its float bytes once and
each point's quantized copy); above
it, a warning names every op that reads a weight (a parameter of two or more
dimensions) with no fake-quant point on it: weights that stayed float.

A program (`pt2e_fq.load(path)`, any ExportedProgram) has op calls where a
model has FakeQuantize modules: each call is a point, named after the FakeQuantize
module it was traced from, and its format and granularity are read from the
call's arguments (quant range, element format, block size). By default it
runs on the example inputs saved with it. A program does not record the
precision a scale is stored in (QSpec.scale_dtype: a model's report counts
bfloat16 scales at 2 bytes), so its weight bytes count fp32 scales.

A lowered program (export/lowering/qdq.py: quantize / dequantize ops instead
of fake-quant calls) has a point per quantize -> dequantize pair (an
activation; a per-token chain behind choose_qparams_affine is dynamic), and
per dequantize of integer codes (a weight stored quantized): its row has the
name of the FakeQuantize module it was lowered from where its dequantize
kept it, the integer range and the scheme (symmetric where the constant zero
points are all 0; a dynamic chain's from choose_qparams_affine), the codes'
dtype where it is wider than the range, and the granularity from the op's
axis or block size. An activation's clipped share is the fake-quant op's
clamp mask on the same grid, its SQNR that of the runtime's dequantized
values. A weight's float values are not in the file: no clipped share or
SQNR ("n/a"), and its float bytes are those of its dequantized tensor; the
weight bytes are counted as for a fake-quant point (codes at the range's
width), which is what a runtime packs, not what the file stores (int8 codes,
int64 zero points). The weights a lowering stored as floats are read as
float weights, named in the float-weights warning. A q/dq op the report does
not read (another op, a quantize no dequantize reads, ...) is named in a
warning with why.
"""

from __future__ import annotations

import copy
import math
import operator
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
from tabulate import tabulate
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from .fake_quantize import FakeQuantize
from .graph import (
    CHOOSE_QPARAMS_OP,
    DEQUANTIZE_OPS,
    QUANTIZE_OPS,
    as_args,
    decode,
    decode_node,
    decode_qdq,
    float_weight_ops,
    float_weights_text,
    is_constant,
    is_fake_quant_node,
    is_qdq_node,
    point_name,
    point_role,
    role,
)
from .ops import fake_quantize_affine_with_mask, unpack_mask
from .spec.format_kinds import INTEGER, SCALED_FLOAT, OpCall
from .spec.formats import IntFormat
from .spec.granularity import PerBlock, PerChannel, PerGroup, PerTensor, PerToken
from .spec.schemes import Formulation


def _storage(t) -> Optional[tuple[int, int]]:
    """(address, bytes) of the storage a tensor views: what tells that two
    points read the same weight (tied weights, or views of one tensor)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    storage = t.untyped_storage()
    return (storage.data_ptr(), storage.nbytes()) if storage.data_ptr() else None


def _copy(value):
    """A copy of every tensor in `value`: a later in-place op of the model
    (`out += x`, `relu_`) would change what was recorded by reference."""
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, value)


class _OpCalls(TorchDispatchMode):
    """Records the last pt2e_fq op call made while each point runs."""

    def __init__(self):
        super().__init__()
        self.current: Optional[str] = None
        self.calls: dict[str, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.current is not None and func.namespace == "pt2e_fq":
            self.calls[self.current] = (func, args, _copy(out))
        return out


class _Recorder(torch.fx.Interpreter):
    """Runs a graph node by node, keeping the call of each node that
    `wanted` selects: (op, argument values in schema order, outputs)."""

    def __init__(self, gm, wanted):
        super().__init__(gm)
        self.wanted = wanted
        self.recorded: dict[torch.fx.Node, tuple] = {}
        self.storages: dict = {}

    def run_node(self, n):
        out = super().run_node(n)
        if n.op == "call_function" and self.wanted(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            schema = n.target._schema.arguments
            values = {**dict(zip([a.name for a in schema], args)), **kwargs}
            filled = [values.get(a.name, a.default_value if a.has_default_value() else None) for a in schema]
            self.recorded[n] = (n.target, _copy(filled), _copy(out))
            self.storages[n] = _storage(args[0] if args else None)
        return out


class _Run(_Recorder):
    """Runs the graph node by node, telling `calls` which point runs (a
    module shared by several points runs once per node) and keeping each
    point's input, and the calls of q/dq ops (a converted model's
    quantized_decomposed ops, or a lowered program's module)."""

    def __init__(self, gm, points: set, calls: _OpCalls):
        super().__init__(gm, is_qdq_node)
        self.points, self.calls, self.inputs = points, calls, {}

    def call_module(self, target, args, kwargs):
        if target not in self.points:
            return super().call_module(target, args, kwargs)
        self.inputs[target] = _copy(args[0])
        self.storages[target] = _storage(args[0])
        self.calls.current = target
        try:
            return super().call_module(target, args, kwargs)
        finally:
            self.calls.current = None


def _bytes(t: Optional[torch.Tensor], bits: float) -> float:
    return 0 if t is None else t.numel() * bits / 8


def _range(t: Optional[torch.Tensor]):
    if t is None or t.numel() == 0:
        return None
    t = t.detach().float()
    return (t.min().item(), t.max().item())


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of y against the reference x, in dB
    (inf where they are equal), over the elements where x is finite."""
    # Over the finite inputs: a NaN / Inf element has no quantization error to measure.
    finite = torch.isfinite(x)
    x64 = x[finite].double()
    err = x64 - y[finite].double()
    noise = float((err * err).sum())
    if noise == 0:
        return math.inf
    return 10 * math.log10(float((x64 * x64).sum()) / noise)


# What the clipped and SQNR columns of a weight held as integer codes say.
_CODES_ONLY = "n/a"


@dataclass
class Report:
    """rows: one dict per fake-quant point (keys: point, module, role, format,
    granularity, scale, zero_point, minval ((min, max) or None), clipped
    (fraction), sqnr_db; clipped and sqnr_db are None for a point that did not
    run, e.g. with fake quant disabled, or whose codes_only is True: a weight
    a q/dq program holds as integer codes; nonfinite: the NaN / Inf values its
    observer ignored, None where unknown: a dynamic point, a program); weight bytes
    of all parameters in float, and with the quantized weights at their
    format's width plus their qparams; how many weight / bias points ran;
    float_weight_ops: the ops reading a weight with no fake-quant point on
    its way (an LSTM, an op no config pattern covers, or one whose config
    leaves its weight float: a report cannot tell), as float_weight_ops
    gives them; a warning line above the summary names them; unread_qdq:
    the quantize / dequantize ops no row stands for, also named there."""

    rows: list[dict] = field(default_factory=list)
    float_weight_bytes: int = 0
    quantized_weight_bytes: float = 0.0
    quantized_weights: int = 0
    float_weight_ops: list[dict] = field(default_factory=list)
    # The quantize / dequantize ops the report cannot read as points, "node (op): why" each: a
    # table that left them out would understate what the program quantizes.
    unread_qdq: list[str] = field(default_factory=list)
    # Per weight storage read by a point: the float bytes already taken off, so that a tensor
    # that several points read (tied weights, views) is taken off at most once.
    _replaced: dict = field(default_factory=dict, repr=False, compare=False)

    def add(self, point: str, module_and_role: tuple[str, str], fmt: str, granularity: str, bits: float,
            call: Optional[tuple[OpCall, tuple]], x: Optional[torch.Tensor], nonfinite: Optional[int] = None,
            scale_bits: Optional[int] = None, storage: Optional[tuple[int, int]] = None) -> None:
        """One row, from the point's decoded op call and its outputs (y,
        packed clamp mask) on its input x; call None: the point did not run.
        x None (with call): a weight a q/dq program holds as integer codes,
        whose float values are gone: no clipped share or SQNR, and its
        float bytes are y's (the dequantized weight), counted in
        float_weight_bytes here. scale_bits: the width the point stores its
        scale at (QSpec.scale_dtype), where known; None: fp32, all an op
        call tells. storage: (address, bytes) of the storage x views in the
        model, where known: a weight's float bytes are taken off once per
        storage, each point's quantized copy added."""
        module, what = module_and_role
        row = dict(point=point, module=module, role=what, format=fmt, granularity=granularity,
                   scale=None, zero_point=None, minval=None, clipped=None, sqnr_db=None, nonfinite=nonfinite,
                   codes_only=call is not None and x is None)
        if call is not None:
            op_call, out = call
            y, packed = out[0].detach(), out[1]
            qparam_bytes = sum(_bytes(t, scale_bits if scale_bits and t is op_call.scale else b)
                               for t, b in op_call.stored_qparams(out))
            row.update(scale=_range(op_call.applied_scale(out)), zero_point=_range(op_call.zero_point),
                       minval=_range(op_call.minval))
            if x is not None:
                x = x.detach()
                row["clipped"] = 1.0 - unpack_mask(packed, x.shape).float().mean().item() if x.numel() else 0.0
                row["sqnr_db"] = sqnr_db(x, y)
            if what.startswith(("weight", "bias")):
                self.quantized_weights += 1
                if x is None:
                    x = y
                    self.float_weight_bytes += x.numel() * x.element_size()
                    self.quantized_weight_bytes += x.numel() * x.element_size()
                float_bytes = x.numel() * x.element_size()
                if storage is not None:
                    done = self._replaced.get(storage, 0)
                    float_bytes = min(float_bytes, storage[1] - done)
                    self._replaced[storage] = done + float_bytes
                self.quantized_weight_bytes += _bytes(x, bits) + qparam_bytes - float_bytes
        self.rows.append(row)

    def table(self) -> str:
        def fmt_range(r, digits=4):
            return "" if r is None else f"[{r[0]:.{digits}g}, {r[1]:.{digits}g}]"

        def measured(r, key, text, not_run=""):
            if r["codes_only"]:
                return _CODES_ONLY
            return not_run if r[key] is None else text(r[key])

        body = [
            [
                r["point"], r["module"], r["role"], r["format"], r["granularity"],
                fmt_range(r["scale"]),
                fmt_range(r["zero_point"], 6) if r["minval"] is None else "minval " + fmt_range(r["minval"]),
                measured(r, "clipped", lambda v: f"{100 * v:.2f}%", "not run"),
                measured(r, "sqnr_db", lambda v: f"{v:.1f}"),
                "" if r["nonfinite"] is None else f"{r['nonfinite']:,}",
            ]
            for r in self.rows
        ]
        headers = ["point", "module", "role", "format", "granularity", "scale", "zero point", "clipped", "SQNR dB",
                   "NaN/Inf ignored"]
        lines = [tabulate(body, headers=headers)]
        codes_only = sum(r["codes_only"] for r in self.rows)
        if codes_only:
            lines.append(f"note: {_CODES_ONLY}: {codes_only} weight(s) held as integer codes, without the float "
                         "values to measure clipping or SQNR against")
        if self.unread_qdq:
            lines.append(f"warning: {len(self.unread_qdq)} quantize / dequantize op(s) not read as points: "
                         + "; ".join(self.unread_qdq))
        # Not for a model without points: the summary says that nothing is quantized.
        warning = float_weights_text(self.float_weight_ops) if self.rows else ""
        if warning:
            lines.append(f"warning: {warning}")
        return "\n".join(lines + [self.summary()])

    def summary(self) -> str:
        """The weights line; it says so where nothing is quantized (a
        share of the float bytes only where some weight is)."""
        float_bytes = f"{self.float_weight_bytes:,} bytes in float"
        if not self.rows and self.unread_qdq:
            return f"no point read (weights: {float_bytes}); the quantize / dequantize ops above are not read"
        if not self.rows:
            return (f"no fake-quant points: nothing is quantized (weights: {float_bytes}); report a model from "
                    "prepare_pt2e / convert_pt2e, or a program saved from one")
        if not self.quantized_weights:
            return f"weights: {float_bytes}, none quantized (activations only)"
        text = f"weights: {float_bytes}, {self.quantized_weight_bytes:,.0f} bytes quantized"
        if self.float_weight_bytes:  # weights may be constants, not parameters: then no share
            text += f" ({100 * self.quantized_weight_bytes / self.float_weight_bytes:.1f}%)"
        return text


def report(model, example_inputs=None, *, file=sys.stdout) -> Report:
    """Runs a copy of `model` (a prepared or converted GraphModule) on
    example_inputs with every observer off, or a program (an ExportedProgram,
    e.g. from pt2e_fq.load; example_inputs default to the ones saved with
    it), and reports each fake-quant point, and each quantize / dequantize
    point of a lowered program (see the module docstring). Prints the table
    to `file` (None: silent).

    Args:
        model: a prepared or converted GraphModule, or an ExportedProgram.
        example_inputs: a tensor or a tuple of positional arguments (optional for a program).
        file: where the table is printed; None prints nothing.

    Returns:
        The Report: one row per point (role, format, qparams, clipped share, SQNR) and the weight bytes.

    Raises:
        TypeError: model is neither a GraphModule nor an ExportedProgram, or a GraphModule comes without
            example_inputs.
    """
    if isinstance(model, torch.export.ExportedProgram):
        return _report_program(model, example_inputs, file)
    if not isinstance(model, torch.fx.GraphModule):
        raise TypeError(
            "report: model must be the torch.fx.GraphModule from prepare_pt2e / prepare_qat_pt2e / "
            f"convert_pt2e, or an ExportedProgram, got {type(model).__name__}"
        )
    if example_inputs is None:
        raise TypeError("report: example_inputs are needed to run a GraphModule")
    args = as_args(example_inputs)
    model = copy.deepcopy(model)  # the run must not touch the user's model (BN statistics, observers)
    nodes = [n for n in model.graph.nodes if n.op == "call_module" and isinstance(model.get_submodule(n.target), FakeQuantize)]
    calls = _OpCalls()
    for node in nodes:
        model.get_submodule(node.target).disable_observer()
    run = _Run(model, {n.target for n in nodes}, calls)
    with torch.no_grad(), calls:
        run.run(*tree_leaves(args))

    result = _weights(model, set(nodes).__contains__)
    for node in nodes:
        name, m = node.target, model.get_submodule(node.target)
        spec = m.qspec
        x = run.inputs.get(name)
        call = calls.calls.get(name) if x is not None else None
        result.add(name, role(node), _format(spec), repr(spec.granularity) + (" dynamic" if spec.dynamic else ""),
                   spec.format.bits, None if call is None else _decoded(*call), x, m.nonfinite_count,
                   spec.scale_dtype.itemsize * 8, run.storages.get(name))
    _QdqPoints(model.graph).add_rows(result, run.recorded)
    if file is not None:
        print(result.table(), file=file)
    return result


def _report_program(program: torch.export.ExportedProgram, example_inputs, file) -> Report:
    if example_inputs is None:
        if program.example_inputs is None:
            raise ValueError("report: this program was saved without example inputs; pass example_inputs")
        args, kwargs = program.example_inputs
        if kwargs:
            raise ValueError("report: the program's example inputs have keyword arguments; pass example_inputs")
    else:
        args = as_args(example_inputs)
    gm = program.module()
    run = _Recorder(gm, lambda n: getattr(n.target, "namespace", None) == "pt2e_fq" or is_qdq_node(n))
    with torch.no_grad():
        run.run(*tree_leaves(args))
    result = _weights(gm, is_fake_quant_node)
    for node, call in run.recorded.items():
        if is_qdq_node(node):
            continue
        op_call, out = _decoded(*call)
        fmt_text, granularity = _describe(op_call, node)
        value = next((u for u in node.users if u.target is operator.getitem and u.args[1] == 0), node)
        result.add(point_name(node), point_role(node.args[0], value), fmt_text, granularity, op_call.format.bits,
                   (op_call, out), call[1][0], storage=run.storages.get(node))
    _QdqPoints(gm.graph).add_rows(result, run.recorded)
    if file is not None:
        print(result.table(), file=file)
    return result


def _decoded(func, op_args, out) -> tuple[OpCall, tuple]:
    """The OpCall of a recorded pt2e_fq op call and its outputs (y, packed
    clamp mask)."""
    op_call = decode(func, op_args)
    if isinstance(out, torch.Tensor):  # a learnable op: y alone; its mask is the static op's
        out = op_call.kind.static_outputs(op_call)
    return op_call, out


def _weights(gm: torch.fx.GraphModule, is_point) -> Report:
    """A Report holding the graph's float weight bytes and the ops that read
    a weight with no point on its way. The float bytes are the parameters'
    and those of the float buffers such ops read as weights (the weights a
    lowering stored as their fake-quantized floats are buffers); the
    quantize / dequantize ops are points: they read only qparams or the
    weight they quantize."""
    result = Report(float_weight_ops=float_weight_ops(gm, lambda n: is_point(n) or is_qdq_node(n)))
    params, buffers = dict(gm.named_parameters()), dict(gm.named_buffers())
    read_buffers = {name for op in result.float_weight_ops for name, _ in op["weights"]
                    if name in buffers and name not in params}
    result.float_weight_bytes = sum(t.numel() * t.element_size()
                                    for t in [*params.values(), *(buffers[n] for n in sorted(read_buffers))])
    result.quantized_weight_bytes = float(result.float_weight_bytes)
    return result


class _QdqPoints:
    """The points of a graph's quantize / dequantize ops (QUANTIZE_OPS,
    DEQUANTIZE_OPS): a quantize with the dequantizes that read its codes
    (an activation, or a weight quantized in the graph), or the
    dequantizes of one set of constant codes (a weight stored quantized;
    the lowering gives each reader its own copy). Every other q/dq op is
    unread, with why: the report names it rather than leave it out."""

    def __init__(self, graph: torch.fx.Graph):
        self.points: list[tuple[Optional[torch.fx.Node], list[torch.fx.Node]]] = []
        self.unread: dict[torch.fx.Node, str] = {}
        self.choosers: dict[torch.fx.Node, torch.fx.Node] = {}  # a dynamic quantize's choose_qparams_affine
        by_codes: dict[str, list] = {}
        read = set()
        for n in graph.nodes:
            if n.op != "call_function":
                continue
            if n.target in QUANTIZE_OPS:
                dqs = [u for u in n.users if u.target in DEQUANTIZE_OPS and u.args[0] is n]
                if dqs:
                    self.points.append((n, dqs))
                    read.update((n, *dqs))
                    for a in n.all_input_nodes:
                        if a.target is operator.getitem and a.args[0].target == CHOOSE_QPARAMS_OP:
                            self.choosers[n] = a.args[0]
                            read.add(a.args[0])
            elif n.target in DEQUANTIZE_OPS and is_constant(n.args[0]):
                key = repr((n.target, n.args, sorted(n.kwargs.items())))
                if key not in by_codes:
                    by_codes[key] = []
                    self.points.append((None, by_codes[key]))
                by_codes[key].append(n)
                read.add(n)
        for n in graph.nodes:
            if is_qdq_node(n) and n not in read:
                self.unread[n] = _unread_reason(n)

    def add_rows(self, result: Report, recorded: dict) -> None:
        """A row in `result` per point, from the calls `recorded` in the run
        ({node: (op, argument values in schema order, output)}); a point whose
        call cannot be read goes to result.unread_qdq with the other unread ops."""
        for q, dqs in self.points:
            try:
                self._add_row(result, q, dqs, recorded)
            except (TypeError, ValueError, RuntimeError) as e:
                result.unread_qdq.append(f"{(q or dqs[0]).name} ({(q or dqs[0]).target}): {e}")
        result.unread_qdq += [f"{n.name} ({n.target}): {why}" for n, why in self.unread.items()]

    def _add_row(self, result: Report, q: Optional[torch.fx.Node], dqs: list, recorded: dict) -> None:
        first = q if q is not None else dqs[0]
        op, values, _ = recorded[first]
        call = decode_qdq(op, values)
        qmin, qmax = call.quant_min, call.quant_max
        x, packed = None, None
        if q is not None:  # the clamp mask of the same grid: the share of x outside the range
            x = call.x
            packed = fake_quantize_affine_with_mask(x, call.block_size, call.scale, call.zero_point, qmin, qmax)[1]
        dynamic = any(not is_constant(a) for a in first.all_input_nodes[1:])
        if q in self.choosers:
            scheme = f" {self.choosers[q].args[1].lower()}"
        elif dynamic:
            scheme = ""  # zero points computed in the graph, by no op that says how
        else:
            scheme = " symmetric" if call.zero_point is None or not call.zero_point.any() else " asymmetric"
        codes = str((recorded[q][2] if q is not None else call.x).dtype).removeprefix("torch.")
        text = f"{call.format!r} [{qmin}, {qmax}]{scheme}" + ("" if codes == call.format.name else f", {codes} codes")
        y = recorded[dqs[0]][2]
        src = first.args[0]
        # A pair the lowering repeats after a view, or a point after it, re-quantizes the value of
        # the op before the pair it reads: the role names that op, as the fake-quant report does.
        while src.target in DEQUANTIZE_OPS and src.args[0].target in QUANTIZE_OPS:
            src = src.args[0].args[0]
        result.add(point_name(dqs[0]), point_role(src, *dqs), text,
                   _granularity(call.x.shape, call.block_size, dynamic), call.format.bits, (call, (y, packed)), x)


def _unread_reason(node: torch.fx.Node) -> str:
    if node.target in QUANTIZE_OPS:
        return "no dequantize reads its codes"
    if node.target in DEQUANTIZE_OPS:
        return "it reads codes computed in the graph, not by a quantize the report reads"
    if node.target == CHOOSE_QPARAMS_OP:
        return "its qparams feed no quantize the report reads"
    return "an op the report does not read"


def _describe(call: OpCall, node: torch.fx.Node) -> tuple[str, str]:
    """(format text, granularity text) of an op call; a point whose scale is
    computed (in the kernel, or in the graph rather than a constant) is
    dynamic."""
    x, fmt = call.x, call.format
    if call.kind is INTEGER:
        text = f"{fmt!r} [{call.quant_min}, {call.quant_max}]" + ("" if call.minval is None else " minval")
    else:
        text = fmt.name
    if call.kind in (INTEGER, SCALED_FLOAT):
        scale = decode_node(node).scale
        dynamic = isinstance(scale, torch.fx.Node) and not is_constant(scale)
        return text, _granularity(x.shape, call.block_size, dynamic)
    dynamic = call.global_scale is None  # MX has none: its scales always come from the kernel
    granularity = PerGroup(call.block_size[call.axis], call.axis)
    return text, repr(granularity) + (" dynamic" if dynamic else "")


def _granularity(shape, block_size, dynamic: bool = False) -> str:
    """The granularity a block size gives a tensor of `shape`, as the
    granularity class would print it, with " dynamic" for qparams computed
    in the graph. A dynamic point with one block per row of the last
    dimension is per token (a static one is per channel, as a weight's
    rows are)."""
    shape, block = list(shape), [min(b, s) for b, s in zip(block_size, shape)]
    if dynamic:
        if len(shape) >= 2 and block[-1] == shape[-1] and all(b == 1 for b in block[:-1]):
            return repr(PerToken()) + " dynamic"
        return _granularity(shape, block_size) + " dynamic"
    if block == shape:
        return repr(PerTensor())
    partial = [d for d in range(len(shape)) if block[d] != shape[d]]
    if all(block[d] == 1 for d in partial) and len(partial) == 1:
        return repr(PerChannel(partial[0]))
    grouped = [d for d in range(len(shape)) if block[d] != 1]
    if len(grouped) == 1 and all(block[d] == 1 for d in range(len(shape)) if d != grouped[0]):
        return repr(PerGroup(block[grouped[0]], grouped[0]))
    return repr(PerBlock(tuple(block_size)))


def _format(spec) -> str:
    fmt = spec.format
    text = repr(fmt) if isinstance(fmt, IntFormat) else fmt.name
    if isinstance(fmt, IntFormat):
        text += f" {spec.scheme.value}"
        if spec.formulation is Formulation.MINVAL:
            text += " minval"
        if spec.scale_dtype != torch.float32:
            text += f", {str(spec.scale_dtype).removeprefix('torch.')} scales"
    return text
