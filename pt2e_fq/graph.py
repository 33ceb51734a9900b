"""The one decoder of pt2e_fq op calls: any call of a fused fake-quant op,
given as values (report's recorded calls, the ONNX translation's arguments)
or as a node of a GraphModule or ExportedProgram, becomes a typed
`OpCall` (format_kinds.py): format, block size per dimension, scale,
zero point or minval, global scale, integer range, block axis.

Every reader of op calls (report, ONNX export and its check, conv-bn
folding) goes through here, so none re-learns an op's arguments.

The graph's vocabulary, shared by report, export and quantizers: which
nodes are constants (`is_constant`), a point's name, module path and role
(`point_name`, `point_role`), the weights and their readers
(`weight_readers`, `float_weight_ops`), the
check that no point holds non-finite qparams (`check_finite_qparams`), and
`as_args`: example inputs as the positional-argument tuple torch.export,
the prepared model and the exporters take (a single tensor is one argument).
A lowered program's quantize / dequantize ops (export/lowering/qdq.py) are
read here too: `is_qdq_node` tells every such op, `decode_qdq` turns a call
of one the report reads (QUANTIZE_OPS, DEQUANTIZE_OPS) into the OpCall of
the integer fake-quant op that computes the same grid.
An input rotation's matrix (pt2e_fq.calib.rotation) is no weight: its
buffer's name (`ROTATION_BUFFER`), which survives export, says so.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, Mapping, Optional

import torch

from .fake_quantize import FakeQuantize, NonFiniteQParamsError, nonfinite_entry
from .spec.format_kinds import INTEGER, KINDS, FormatKind, OpCall
from .spec.formats import IntFormat

aten = torch.ops.aten

def _kind(op) -> Optional[FormatKind]:
    for kind in KINDS:
        if op in kind.ops:
            return kind
    return None


def fake_quant_ops() -> tuple:
    """The OpOverloads of the fused fake-quant ops: each format kind's, and
    its learnable op where it has one."""
    return tuple(op for kind in KINDS for op in kind.ops)


def decode(op, args: tuple, kwargs: Optional[Mapping[str, Any]] = None) -> OpCall:
    """The OpCall of `op` (a pt2e_fq OpOverload) called with args / kwargs,
    values of any type; defaults fill what the call left out."""
    kind = _kind(op)
    if kind is None:
        raise ValueError(f"{op} is not a pt2e_fq fake-quant op; known: {', '.join(map(str, fake_quant_ops()))}")
    return kind.decode(op, _by_name(op, args, kwargs))


def _by_name(op, args: tuple, kwargs: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """A call's arguments by schema name; defaults fill what it left out."""
    schema = op._schema.arguments
    values = {a.name: a.default_value if a.has_default_value() else None for a in schema}
    values.update(zip((a.name for a in schema), args))
    values.update(kwargs or {})
    return values


def is_fake_quant_node(node: torch.fx.Node) -> bool:
    """A call of a fused fake-quant op (not ste_grad, its backward)."""
    return node.op == "call_function" and _kind(node.target) is not None


def decode_node(node: torch.fx.Node, constants: Optional[Mapping[str, torch.Tensor]] = None) -> OpCall:
    """The OpCall of a fake-quant node. Its values are the argument nodes,
    or, with `constants` (tensors by node name: get_attr targets of a
    GraphModule, or `program_constants` of an ExportedProgram), the
    tensors of the arguments that are constants."""
    if not is_fake_quant_node(node):
        raise ValueError(f"node {node.name} ({node.target}) is not a pt2e_fq fake-quant op call")

    def resolve(v):
        if constants is not None and isinstance(v, torch.fx.Node):
            key = v.target if v.op == "get_attr" else v.name
            return constants.get(key, v)
        return v

    return decode(node.target, tuple(resolve(a) for a in node.args), {k: resolve(v) for k, v in node.kwargs.items()})


def program_constants(ep: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    """An ExportedProgram's parameters, buffers and constants by placeholder name."""
    sig = ep.graph_signature
    named = {**ep.state_dict, **ep.constants}
    mapping = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
    return {placeholder: named[target] for placeholder, target in mapping.items() if target in named}


def as_args(example_inputs) -> tuple:
    """example_inputs as the positional-argument tuple torch.export takes."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise TypeError(
        f"example_inputs must be a tensor or a tuple of positional arguments, got {type(example_inputs).__name__}"
    )


# -- the graph's vocabulary: constants, weights, points -----------------------------

# The buffers of input rotations (pt2e_fq.calib.rotation) are named ROTATION_BUFFER + an index.
ROTATION_BUFFER = "_input_rotation_"


def is_rotation_matrix(target: str) -> bool:
    """Whether a get_attr target (or a state-dict name) is an input rotation's matrix."""
    return target.rpartition(".")[2].startswith(ROTATION_BUFFER)


def is_constant(node: torch.fx.Node) -> bool:
    """A get_attr, or ops on get_attrs only (the QAT scaled conv weight)."""
    if node.op == "get_attr":
        return True
    return node.op == "call_function" and all(
        is_constant(a) for a in node.all_input_nodes
    ) and bool(node.all_input_nodes)


def weight_readers(gm: torch.fx.GraphModule, is_point) -> dict[str, tuple[tuple, list[torch.fx.Node]]]:
    """{weight: (its shape, its readers)} for every float parameter or
    buffer of `gm` with two or more dimensions (not a bias or norm scale):
    its readers are the first nodes on each of its ways through the graph
    that are points (`is_point(node)`) or compute with more than constants
    (a weight passes through its views, the QAT conv-bn scaling and a
    program's fake-quant call on constants before it meets its op)."""
    found = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or is_rotation_matrix(node.target):
            continue
        value = functools.reduce(getattr, node.target.split("."), gm)
        if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 2):
            continue
        readers, todo = [], list(node.users)
        while todo:
            user = todo.pop(0)
            if is_point(user) or not is_constant(user):
                if user.op != "output" and user not in readers:
                    readers.append(user)
            else:
                todo += list(user.users)
        found[node.target] = (tuple(value.shape), readers)
    return found


def float_weight_ops(gm: torch.fx.GraphModule, is_point) -> list[dict]:
    """The ops that read a weight (see weight_readers) with no point on the
    way: {op (node name), target (the op), module (path), weights [(name, shape)]}."""
    ops: dict[torch.fx.Node, dict] = {}
    for name, (shape, readers) in weight_readers(gm, is_point).items():
        for reader in readers:
            if not is_point(reader):
                entry = ops.setdefault(reader, dict(op=reader.name, target=target_name(reader),
                                                    module=module_path(reader), weights=[]))
                entry["weights"].append((name, shape))
    return list(ops.values())


def float_weights_text(ops: list[dict]) -> str:
    """The warning of float_weight_ops, or "" where there is none."""
    if not ops:
        return ""
    where = "; ".join(f"{o['op']} ({o['target']}) in module '{o['module']}': "
                      + ", ".join(f"{n} {tuple(shape)}" for n, shape in o["weights"]) for o in ops)
    return f"{len(ops)} op(s) with weights stay in float, no fake-quant point on their weights: {where}"


def target_name(node: torch.fx.Node) -> str:
    return getattr(node.target, "_opname", None) or str(node.target)


def module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if stack:
        return list(stack.values())[-1][0]
    if node.op == "get_attr":
        return node.target.rpartition(".")[0]
    return ""


def role(point: torch.fx.Node) -> tuple[str, str]:
    """(module path, role) of a fake-quant call_module node."""
    return point_role(point.args[0], point)


def point_role(src: torch.fx.Node, point: torch.fx.Node, *copies: torch.fx.Node) -> tuple[str, str]:
    """(module path, role) of a point reading `src`, whose fake-quantized
    value is the node `point` (a call_module, getitem 0 of an op call, or a
    dequantize) and its `copies` (the lowering gives each user of a
    dequantize its own)."""
    users = [u for value in (point, *copies) for u in value.users]
    if is_constant(src):
        user = users[0]
        value = next((v for v in (point, *copies) if v in user.args), point)
        # A constant operand is a weight (linear, conv, embedding, matmul), except a bias
        # (argument 2; addmm(bias, x, weight): argument 0).
        bias_arg = 0 if user.target is torch.ops.aten.addmm.default else 2
        kind = "bias" if value in user.args and list(user.args).index(value) == bias_arg else "weight"
        return module_path(user), f"{kind} of {user.name}"
    consumers = [u.name for u in users if u.op != "output"]
    if src.op == "placeholder":
        return (module_path(users[0]) if consumers else ""), f"input of {', '.join(consumers)}"
    text = f"output of {src.name}"
    if consumers:
        text += f", input of {', '.join(consumers)}"
    return module_path(src), text


def point_name(node: torch.fx.Node) -> str:
    """The FakeQuantize module the call was traced from (its path, e.g.
    `activation_post_process_3`, kept in the node's nn_module_stack through
    save and load), else the node's name."""
    for path, type_name in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
        if type_name.endswith(f"{FakeQuantize.__module__}.{FakeQuantize.__qualname__}"):
            return path
    return node.name


def check_finite_qparams(program: torch.export.ExportedProgram, who: str) -> None:
    """Raises NonFiniteQParamsError naming (FakeQuantize path, module and
    role) every fake-quant call of `program` whose constant qparams hold a
    NaN or Inf: such a file would compute NaN (or refuse to run) for every
    input. `who` names the caller in the message (e.g. "save", "to_onnx").
    Computed qparams (dynamic points) are not constants and not checked."""
    constants = program_constants(program)
    found = []
    for node in program.graph.nodes:
        if not is_fake_quant_node(node):
            continue
        call = decode_node(node, constants)
        bad = [e for n, t in call.qparams.items() if isinstance(t, torch.Tensor) for e in [nonfinite_entry(n, t)] if e]
        if bad:
            value = next((u for u in node.users if u.target is operator.getitem and u.args[1] == 0), node)
            module, what = point_role(node.args[0], value)
            found.append(f"{point_name(node)} ({module or 'model'}: {what}) has {', '.join(bad)}")
    if found:
        raise NonFiniteQParamsError(
            f"{who}: {len(found)} fake-quant point(s) have non-finite qparams: {'; '.join(found)}; "
            "recalibrate on data with finite values or set finite qparams before exporting"
        )


# -- the quantize / dequantize representation ---------------------------------------

_qd, _tao = torch.ops.quantized_decomposed, torch.ops.torchao
# The quantize and dequantize ops the lowering writes (export/lowering/qdq.py): an
# activation's pair, a weight's dequantize of integer codes, the per-token chain's
# quantize_affine / dequantize_affine behind torchao's choose_qparams_affine.
QUANTIZE_OPS = (_qd.quantize_per_tensor.default, _qd.quantize_per_channel.default, _tao.quantize_affine.default)
DEQUANTIZE_OPS = (_qd.dequantize_per_tensor.default, _qd.dequantize_per_channel.default,
                  _tao.dequantize_affine.default)
CHOOSE_QPARAMS_OP = _tao.choose_qparams_affine.default


def is_qdq_node(node: torch.fx.Node) -> bool:
    """A call of any PT2E quantize, dequantize or choose-qparams op
    (quantized_decomposed, torchao), read or not."""
    name = getattr(node.target, "__name__", "")
    return (node.op == "call_function" and getattr(node.target, "namespace", None) in ("quantized_decomposed", "torchao")
            and ("quantize" in name or "choose_qparams" in name))


def decode_qdq(op, args: tuple, kwargs: Optional[Mapping[str, Any]] = None) -> OpCall:
    """The OpCall (kind INTEGER) of a call of one of QUANTIZE_OPS or
    DEQUANTIZE_OPS given as tensor values: x is the op's input (a quantize's
    floats, a dequantize's codes), the block size per dimension of x, and
    scale and zero point (None where the call has none) shaped
    ceil(x.shape / block_size), as the fake-quant op takes them; the integer
    range defaults to that of the codes' dtype, as in torchao's ops.

    Raises:
        ValueError: op is not one of those, or its qparams do not fit its input's blocks."""
    if op not in QUANTIZE_OPS + DEQUANTIZE_OPS:
        raise ValueError(f"{op} is not a quantize / dequantize op the report reads")
    values = _by_name(op, args, kwargs)
    x = values["input"]
    shape = tuple(x.shape)
    if op in (_qd.quantize_per_tensor.default, _qd.dequantize_per_tensor.default):
        block, scale, zero_point = shape, values["scale"], values["zero_point"]
    elif op in (_qd.quantize_per_channel.default, _qd.dequantize_per_channel.default):
        axis = values["axis"] % len(shape)
        block = tuple(1 if d == axis else s for d, s in enumerate(shape))
        scale, zero_point = values["scales"], values["zero_points"]
    else:
        block, scale, zero_point = tuple(values["block_size"]), values["scale"], values["zero_point"]
    # The codes' dtype: quantized_decomposed's "dtype", quantize_affine's "output_dtype",
    # dequantize_affine's "input_dtype".
    dtype = values.get("dtype") or (values["input_dtype"] if op in DEQUANTIZE_OPS else values["output_dtype"])
    info = torch.iinfo(dtype)
    qmin = info.min if values["quant_min"] is None else int(values["quant_min"])
    qmax = info.max if values["quant_max"] is None else int(values["quant_max"])
    reduced = [-(-s // min(b, s)) if s else 1 for s, b in zip(shape, block)]

    def shaped(t, dtype):
        t = torch.as_tensor(t, dtype=dtype) if not isinstance(t, torch.Tensor) else t
        if t.numel() != math.prod(reduced):
            raise ValueError(f"{op}: {t.numel()} qparams for blocks {block} of an input of shape {shape}")
        return t.reshape(reduced)

    return OpCall(op, INTEGER, IntFormat.holding(qmin, qmax), x, block, scale=shaped(scale, torch.float32),
                  zero_point=None if zero_point is None else shaped(zero_point, torch.int64),
                  quant_min=qmin, quant_max=qmax)
