"""Per-point quantization report of a prepared or converted model.

`report(model, example_inputs)` runs a copy of the model once (observers
off) and records every pt2e_fq op call with its arguments and outputs, so
each row shows what the point really applied to these inputs, dynamic points
included: one row per fake-quant point with its module path, role (input /
weight / output of which op), format, granularity, scale and zero-point
ranges, the share of elements clipped (from the op's clamp mask) and the SQNR
of the fake-quantized tensor against its float input. A summary compares the
float and quantized weight bytes.
"""

from __future__ import annotations

import copy
import math
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
from tabulate import tabulate
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .fake_quantize import FakeQuantize
from .formats import FloatFormat, IntFormat
from .ops import unpack_mask
from .qspec import Formulation


class _OpCalls(TorchDispatchMode):
    """Records the last pt2e_fq op call made while each point runs."""

    def __init__(self):
        super().__init__()
        self.current: Optional[str] = None
        self.calls: dict[str, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.current is not None and func.namespace == "pt2e_fq":
            self.calls[self.current] = (func, args, out)
        return out


class _Run(torch.fx.Interpreter):
    """Runs the graph node by node, telling `calls` which point runs (a
    module shared by several points runs once per node) and keeping each
    point's input."""

    def __init__(self, gm, points: set, calls: _OpCalls):
        super().__init__(gm)
        self.points, self.calls, self.inputs = points, calls, {}

    def call_module(self, target, args, kwargs):
        if target not in self.points:
            return super().call_module(target, args, kwargs)
        self.inputs[target] = args[0].detach()
        self.calls.current = target
        try:
            return super().call_module(target, args, kwargs)
        finally:
            self.calls.current = None


def _qparams(func, args, out, elem_bits: float) -> tuple[dict[str, Optional[torch.Tensor]], float]:
    """The qparams an op call applied (scale, zero_point, minval; None where
    it has none) and the bytes they take stored: fp32 scales and minvals,
    zero points at the element width, MX's E8M0 and NVFP4's E4M3 block scales
    one byte each (NVFP4's element scale is block scale x global scale)."""
    if func == torch.ops.pt2e_fq.fake_quantize_mx.default:
        return {"scale": out[2], "zero_point": None, "minval": None}, out[2].numel()
    if func == torch.ops.pt2e_fq.fake_quantize_nvfp4.default:
        return {"scale": out[2] * out[3], "zero_point": None, "minval": None}, out[2].numel() + 4
    values = dict(zip([a.name for a in func._schema.arguments], args))
    qp = {k: values.get(k) for k in ("scale", "zero_point", "minval")}
    return qp, _bytes(qp["scale"], 32) + _bytes(qp["zero_point"], elem_bits) + _bytes(qp["minval"], 32)


def _is_constant(node: torch.fx.Node) -> bool:
    """A get_attr, or ops on get_attrs only (the QAT scaled conv weight)."""
    if node.op == "get_attr":
        return True
    return node.op == "call_function" and all(
        _is_constant(a) for a in node.all_input_nodes
    ) and bool(node.all_input_nodes)


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if stack:
        return list(stack.values())[-1][0]
    if node.op == "get_attr":
        return node.target.rpartition(".")[0]
    return ""


def role(point: torch.fx.Node) -> tuple[str, str]:
    """(module path, role) of a fake-quant call_module node."""
    src = point.args[0]
    users = list(point.users)
    if _is_constant(src):
        user = users[0]
        # A constant operand is a weight (linear, conv, embedding, matmul), except a bias (argument 2).
        kind = "bias" if point in user.args and list(user.args).index(point) == 2 else "weight"
        return _module_path(user), f"{kind} of {user.name}"
    consumers = [u.name for u in users if u.op != "output"]
    if src.op == "placeholder":
        return (_module_path(users[0]) if consumers else ""), f"input of {', '.join(consumers)}"
    text = f"output of {src.name}"
    if consumers:
        text += f", input of {', '.join(consumers)}"
    return _module_path(src), text


def _bits(fmt) -> float:
    """Storage bits per element (scales counted apart)."""
    if isinstance(fmt, IntFormat):
        return fmt.bits
    return 4 if fmt.elem_dtype == torch.float4_e2m1fn_x2 else 8


def _bytes(t: Optional[torch.Tensor], bits: float) -> float:
    return 0 if t is None else t.numel() * bits / 8


def _range(t: Optional[torch.Tensor]):
    if t is None or t.numel() == 0:
        return None
    t = t.detach().float()
    return (t.min().item(), t.max().item())


def _sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x64, err = x.double(), (x.double() - y.double())
    noise = float((err * err).sum())
    if noise == 0:
        return math.inf
    return 10 * math.log10(float((x64 * x64).sum()) / noise)


@dataclass
class Report:
    """rows: one dict per fake-quant point (keys: point, module, role, format,
    granularity, scale, zero_point, minval ((min, max) or None), clipped
    (fraction), sqnr_db; clipped and sqnr_db are None for a point that did not
    run, e.g. with fake quant disabled); weight bytes
    of all parameters in float, and with the quantized weights at their
    format's width plus their qparams."""

    rows: list[dict] = field(default_factory=list)
    float_weight_bytes: int = 0
    quantized_weight_bytes: float = 0.0

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
            ]
            for r in self.rows
        ]
        headers = ["point", "module", "role", "format", "granularity", "scale", "zero point", "clipped", "SQNR dB"]
        ratio = self.quantized_weight_bytes / self.float_weight_bytes if self.float_weight_bytes else float("nan")
        summary = (
            f"weights: {self.float_weight_bytes:,} bytes in float, {self.quantized_weight_bytes:,.0f} bytes "
            f"quantized ({100 * ratio:.1f}%)"
        )
        return tabulate(body, headers=headers) + "\n" + summary


def report(model: torch.fx.GraphModule, example_inputs, *, file=sys.stdout) -> Report:
    """Runs a copy of `model` (a prepared or converted GraphModule) on
    example_inputs with every observer off, and reports each fake-quant point
    (see the module docstring). Prints the table to `file` (None: silent)."""
    if not isinstance(model, torch.fx.GraphModule):
        raise TypeError(
            "report: model must be the torch.fx.GraphModule from prepare_pt2e / prepare_qat_pt2e / "
            f"convert_pt2e, got {type(model).__name__}"
        )
    from .export.program import as_args

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
    for node in nodes:
        name, m = node.target, model.get_submodule(node.target)
        module_path, point_role = role(node)
        spec = m.qspec
        row = dict(point=name, module=module_path, role=point_role, format=_format(spec),
                   granularity=repr(spec.granularity) + (" dynamic" if spec.dynamic else ""),
                   scale=None, zero_point=None, minval=None, clipped=None, sqnr_db=None)
        x = run.inputs.get(name)
        if name in calls.calls and x is not None:
            func, op_args, out = calls.calls[name]
            y, packed = out[0], out[1]
            bits = _bits(spec.format)
            qp, qparam_bytes = _qparams(func, op_args, out, bits)
            row.update(scale=_range(qp["scale"]), zero_point=_range(qp["zero_point"]), minval=_range(qp["minval"]))
            row["clipped"] = 1.0 - unpack_mask(packed, x.shape).float().mean().item() if x.numel() else 0.0
            row["sqnr_db"] = _sqnr_db(x, y)
            if point_role.startswith(("weight", "bias")):
                result.quantized_weight_bytes += _bytes(x, bits) + qparam_bytes - x.numel() * x.element_size()
        result.rows.append(row)
    if file is not None:
        print(result.table(), file=file)
    return result


def _format(spec) -> str:
    fmt = spec.format
    text = fmt.name if isinstance(fmt, FloatFormat) else repr(fmt)
    if isinstance(fmt, IntFormat):
        text += f" {spec.scheme.value}"
        if spec.formulation is Formulation.MINVAL:
            text += " minval"
    return text
