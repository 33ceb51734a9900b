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
    as_args,
    decode,
    decode_node,
    float_weight_ops,
    float_weights_text,
    is_constant,
    is_fake_quant_node,
    point_name,
    point_role,
    role,
)
from .ops import unpack_mask
from .spec.format_kinds import INTEGER, SCALED_FLOAT, OpCall
from .spec.formats import IntFormat
from .spec.granularity import PerBlock, PerChannel, PerGroup, PerTensor
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


class _Run(torch.fx.Interpreter):
    """Runs the graph node by node, telling `calls` which point runs (a
    module shared by several points runs once per node) and keeping each
    point's input."""

    def __init__(self, gm, points: set, calls: _OpCalls):
        super().__init__(gm)
        self.points, self.calls, self.inputs, self.storages = points, calls, {}, {}

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


@dataclass
class Report:
    """rows: one dict per fake-quant point (keys: point, module, role, format,
    granularity, scale, zero_point, minval ((min, max) or None), clipped
    (fraction), sqnr_db; clipped and sqnr_db are None for a point that did not
    run, e.g. with fake quant disabled; nonfinite: the NaN / Inf values its
    observer ignored, None where unknown: a dynamic point, a program); weight bytes
    of all parameters in float, and with the quantized weights at their
    format's width plus their qparams; how many weight / bias points ran;
    float_weight_ops: the ops reading a weight with no fake-quant point on
    its way (an LSTM, an op no config pattern covers, or one whose config
    leaves its weight float: a report cannot tell), as float_weight_ops
    gives them; a warning line above the summary names them."""

    rows: list[dict] = field(default_factory=list)
    float_weight_bytes: int = 0
    quantized_weight_bytes: float = 0.0
    quantized_weights: int = 0
    float_weight_ops: list[dict] = field(default_factory=list)
    # The quantize / dequantize ops of a lowered program (to_qdq, to_executorch), which has no
    # fake-quant points for a report to read: its summary must not say that nothing is quantized.
    qdq_ops: int = 0
    # Per weight storage read by a point: the float bytes already taken off, so that a tensor
    # that several points read (tied weights, views) is taken off at most once.
    _replaced: dict = field(default_factory=dict, repr=False, compare=False)

    def add(self, point: str, module_and_role: tuple[str, str], fmt: str, granularity: str, bits: float,
            call: Optional[tuple], x: Optional[torch.Tensor], nonfinite: Optional[int] = None,
            scale_bits: Optional[int] = None, storage: Optional[tuple[int, int]] = None) -> None:
        """One row, from the point's op call (op, arguments, outputs) on its
        input x; call None: the point did not run. scale_bits: the width
        the point stores its scale at (QSpec.scale_dtype), where known;
        None: fp32, all an op call tells. storage: (address, bytes) of the
        storage x views in the model, where known: a weight's float bytes
        are taken off once per storage, each point's quantized copy added."""
        module, what = module_and_role
        row = dict(point=point, module=module, role=what, format=fmt, granularity=granularity,
                   scale=None, zero_point=None, minval=None, clipped=None, sqnr_db=None, nonfinite=nonfinite)
        if call is not None:
            func, op_args, out = call
            op_call = decode(func, op_args)
            if isinstance(out, torch.Tensor):  # a learnable op: y alone; its mask is the static op's
                out = op_call.kind.static_outputs(op_call)
            x, y, packed = x.detach(), out[0].detach(), out[1]
            qparam_bytes = sum(_bytes(t, scale_bits if scale_bits and t is op_call.scale else b)
                               for t, b in op_call.stored_qparams(out))
            row.update(scale=_range(op_call.applied_scale(out)), zero_point=_range(op_call.zero_point),
                       minval=_range(op_call.minval))
            row["clipped"] = 1.0 - unpack_mask(packed, x.shape).float().mean().item() if x.numel() else 0.0
            row["sqnr_db"] = sqnr_db(x, y)
            if what.startswith(("weight", "bias")):
                self.quantized_weights += 1
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

        body = [
            [
                r["point"], r["module"], r["role"], r["format"], r["granularity"],
                fmt_range(r["scale"]),
                fmt_range(r["zero_point"], 6) if r["minval"] is None else "minval " + fmt_range(r["minval"]),
                "not run" if r["clipped"] is None else f"{100 * r['clipped']:.2f}%",
                "" if r["sqnr_db"] is None else f"{r['sqnr_db']:.1f}",
                "" if r["nonfinite"] is None else f"{r['nonfinite']:,}",
            ]
            for r in self.rows
        ]
        headers = ["point", "module", "role", "format", "granularity", "scale", "zero point", "clipped", "SQNR dB",
                   "NaN/Inf ignored"]
        # Not for a model without points: the summary says that nothing is quantized.
        warning = float_weights_text(self.float_weight_ops) if self.rows else ""
        return tabulate(body, headers=headers) + (f"\nwarning: {warning}" if warning else "") + "\n" + self.summary()

    def summary(self) -> str:
        """The weights line; it says so where nothing is quantized (a
        share of the float bytes only where some weight is)."""
        float_bytes = f"{self.float_weight_bytes:,} bytes in float"
        if not self.rows and self.qdq_ops:
            return (f"a lowered q/dq program ({self.qdq_ops} quantize / dequantize ops; weights: {float_bytes}, "
                    "the quantized ones as integer constants): report reads fake-quant points, which lowering "
                    "replaced, so it lists none; report the program saved before lowering (pt2e_fq.save of the "
                    "converted model, `pt2e-fq quantize --out` without --target)")
        if not self.rows:
            return (f"no fake-quant points: nothing is quantized (weights: {float_bytes}); report a model from "
                    "prepare_pt2e / convert_pt2e, or a program saved from one")
        if not self.quantized_weights:
            return f"weights: {float_bytes}, none quantized (activations only)"
        text = f"weights: {float_bytes}, {self.quantized_weight_bytes:,.0f} bytes quantized"
        if self.float_weight_bytes:  # weights may be constants, not parameters: then no share
            text += f" ({100 * self.quantized_weight_bytes / self.float_weight_bytes:.1f}%)"
        return text


def _qdq_ops(gm: torch.fx.GraphModule) -> int:
    """How many PT2E quantize / dequantize ops (quantized_decomposed, torchao) the graph calls."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function"
               and getattr(n.target, "namespace", None) in ("quantized_decomposed", "torchao")
               and "quantize" in getattr(n.target, "__name__", ""))


def report(model, example_inputs=None, *, file=sys.stdout) -> Report:
    """Runs a copy of `model` (a prepared or converted GraphModule) on
    example_inputs with every observer off, or a program (an ExportedProgram,
    e.g. from pt2e_fq.load; example_inputs default to the ones saved with
    it), and reports each fake-quant point (see the module docstring).
    Prints the table to `file` (None: silent).

    Args:
        model: a prepared or converted GraphModule, or an ExportedProgram.
        example_inputs: a tensor or a tuple of positional arguments (optional for a program).
        file: where the table is printed; None prints nothing.

    Returns:
        The Report: one row per fake-quant point (role, format, qparams, clipped share, SQNR) and the weight bytes.

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

    result = Report(float_weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()))
    result.quantized_weight_bytes = float(result.float_weight_bytes)
    result.float_weight_ops = float_weight_ops(model, set(nodes).__contains__)
    result.qdq_ops = _qdq_ops(model)
    for node in nodes:
        name, m = node.target, model.get_submodule(node.target)
        spec = m.qspec
        x = run.inputs.get(name)
        call = calls.calls.get(name) if x is not None else None
        result.add(name, role(node), _format(spec), repr(spec.granularity) + (" dynamic" if spec.dynamic else ""),
                   spec.format.bits, call, x, m.nonfinite_count, spec.scale_dtype.itemsize * 8, run.storages.get(name))
    if file is not None:
        print(result.table(), file=file)
    return result


class _ProgramRun(torch.fx.Interpreter):
    """Runs a program's module node by node, keeping every pt2e_fq op call:
    (op, argument values in schema order, outputs)."""

    def __init__(self, gm):
        super().__init__(gm)
        self.calls: dict[torch.fx.Node, tuple] = {}
        self.storages: dict[torch.fx.Node, Optional[tuple[int, int]]] = {}

    def run_node(self, n):
        out = super().run_node(n)
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "pt2e_fq":
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            values = {**dict(zip([a.name for a in n.target._schema.arguments], args)), **kwargs}
            self.calls[n] = (n.target, _copy([values.get(a.name) for a in n.target._schema.arguments]), _copy(out))
            self.storages[n] = _storage(args[0] if args else None)
        return out


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
    run = _ProgramRun(gm)
    with torch.no_grad():
        run.run(*tree_leaves(args))
    result = Report(float_weight_bytes=sum(p.numel() * p.element_size() for p in gm.parameters()))
    result.quantized_weight_bytes = float(result.float_weight_bytes)
    result.float_weight_ops = float_weight_ops(gm, is_fake_quant_node)
    result.qdq_ops = _qdq_ops(gm)
    for node, call in run.calls.items():
        func, op_args, out = call
        op_call = decode(func, op_args)
        fmt_text, granularity = _describe(op_call, node)
        value = next((u for u in node.users if u.target is operator.getitem and u.args[1] == 0), node)
        result.add(point_name(node), point_role(node.args[0], value), fmt_text, granularity, op_call.format.bits, call,
                   op_args[0], storage=run.storages.get(node))
    if file is not None:
        print(result.table(), file=file)
    return result


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
        return text, _granularity(x.shape, call.block_size) + (" dynamic" if dynamic else "")
    dynamic = call.global_scale is None  # MX has none: its scales always come from the kernel
    granularity = PerGroup(call.block_size[call.axis], call.axis)
    return text, repr(granularity) + (" dynamic" if dynamic else "")


def _granularity(shape, block_size) -> str:
    """The granularity a block size gives a tensor of `shape`, as the
    granularity class would print it."""
    shape, block = list(shape), [min(b, s) for b, s in zip(block_size, shape)]
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
