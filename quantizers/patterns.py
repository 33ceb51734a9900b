"""Op patterns: which tensors of an exported (aten) graph node an op config
quantizes.

`match(node)` recognises the ops that take an op config and says which of
their arguments play which role (input activation, weight, bias) and where
their output is quantized: after a following activation (and, in the QAT
graph, a batch norm between a conv and that activation), never in between,
so conv-bn-relu and linear-gelu are each quantized as one unit.
QuantizerConfig's fuse_activations narrows which activations join a unit
(ACTIVATIONS names them): a runtime that fuses only some (XNNPACK: ReLU and
clamps) needs the op's own output quantized before any other.

A conv2d whose output (after an optional batch norm) flows only into a
residual add, conv -> [bn] -> add(., other) -> [activation], is one more
unit (`residual_add`): with QuantizerConfig's fuse_conv_add it is quantized
as torchao's X86InductorQuantizer does (no point on the conv's output, the
add's other input and its output after the activation quantized), which
Inductor runs as one int8 oneDNN call (qconv2d_pointwise.binary).

Two more kinds of ops take no config of their own:
- PASS_THROUGH ops only move or select values (view, reshape, flatten,
  permute, transpose, max pooling, ...): their output lies on their input's
  quantization grid, so it needs no fake-quant of its own.
- AVERAGING_POOLS compute averages, which fall between grid points: their
  output is quantized again with their input's fake-quant module (shared
  qparams).

Every table holds each op's in-place twin too (`out += identity` is
aten.add_, `ReLU(inplace=True)` aten.relu_, `Hardswish(inplace=True)`
aten.hardswish_): a model's choice of in-place or out-of-place code does not
change how it is quantized. A cast to the dtype the tensor already has
(HF RMSNorm's `.to(input_dtype)` in a float32 model) and a dropout of an
eval-mode export (train=False: the identity) are pass-throughs too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.fx import Node

from pt2e_fq.calib.layers import is_layer
from pt2e_fq.eval_mode import DROPOUTS  # a pass-through where train is False (an eval-mode export)

aten = torch.ops.aten

# Roles an argument can play; they name the fields of an OpConfig.
INPUT, WEIGHT, BIAS = "input_activation", "weight", "bias"


def _inplace_twin(op):
    """aten.add_.Tensor for aten.add.Tensor: the in-place overload taking
    the same arguments, or None."""
    packet = getattr(aten, op.overloadpacket.__name__ + "_", None)
    if packet is None:
        return None
    types = [a.type for a in op._schema.arguments]
    # Overload names differ (transpose.int, transpose_.default): match by argument types.
    return next((getattr(packet, o) for o in packet.overloads()
                 if [a.type for a in getattr(packet, o)._schema.arguments] == types), None)


def _with_inplace(ops):
    return tuple(ops) + tuple(t for t in map(_inplace_twin, ops) if t is not None)


# op type name -> aten ops of the (pre-dispatch) exported graph.
_WEIGHTED_OPS = {
    "linear": (aten.linear.default,),
    "conv1d": (aten.conv1d.default, aten.conv1d.padding),
    "conv2d": (aten.conv2d.default, aten.conv2d.padding),
    "conv3d": (aten.conv3d.default, aten.conv3d.padding),
    "conv_transpose1d": (aten.conv_transpose1d.default,),
    "conv_transpose2d": (aten.conv_transpose2d.input,),
}
_MATMUL_OPS = {"matmul": (aten.matmul.default,), "bmm": (aten.bmm.default,), "mm": (aten.mm.default,)}
# Linears written otherwise: addmm(bias, x, weight (in, out)), as transformers'
# Conv1D (GPT-2) computes them, and a two-operand einsum with a 2-D parameter.
_LINEAR_FORMS = {"addmm": (aten.addmm.default,), "einsum": (aten.einsum.default,)}
_BINARY_OPS = {"add": _with_inplace((aten.add.Tensor,)), "mul": _with_inplace((aten.mul.Tensor,))}
_CONCAT_OPS = {"cat": (aten.cat.default,), "stack": (aten.stack.default,)}
_EMBEDDING_OPS = {"embedding": (aten.embedding.default,)}

_TABLES = (_WEIGHTED_OPS, _MATMUL_OPS, _LINEAR_FORMS, _EMBEDDING_OPS, _BINARY_OPS, _CONCAT_OPS)
OP_TYPES = tuple(name for table in _TABLES for name in table)
_OP_TYPE_OF = {
    op: name
    for table in _TABLES
    for name, ops in table.items()
    for op in ops
}

# The op types that compute with a weight (an embedding looks rows up).
COMPUTING_OP_TYPES = (*_WEIGHTED_OPS, *_MATMUL_OPS, *_LINEAR_FORMS)


def op_type(node: Node) -> Optional[str]:
    """The op type (one of OP_TYPES) of a call_function node, or None."""
    return _OP_TYPE_OF.get(node.target) if node.op == "call_function" else None


# Conv weights are stored (out, in/groups, ...), conv_transpose weights
# (in, out/groups, ...): weight granularity axes 0 and 1 are swapped for them.
_TRANSPOSED_WEIGHT_OPS = ("conv_transpose1d", "conv_transpose2d")
CONV_OPS = ("conv1d", "conv2d", "conv3d", *_TRANSPOSED_WEIGHT_OPS)

# Activations that can be quantized together with the op before them (the
# op's output point after the activation), by the names
# QuantizerConfig.fuse_activations takes; by default all of them.
ACTIVATIONS = {
    name: frozenset(_with_inplace((getattr(aten, name).default,)))
    for name in ("relu", "relu6", "hardtanh", "gelu", "silu", "hardswish", "sigmoid", "tanh", "leaky_relu", "elu")
}
_ACTIVATIONS = frozenset().union(*ACTIVATIONS.values())
_BATCH_NORMS = {aten.batch_norm.default, aten._native_batch_norm_legit_no_training.default}

# Views (their output may alias their input) and the pass-through ops that copy.
_VIEWS = set(_with_inplace((
    aten.view.default, aten.reshape.default, aten.flatten.using_ints, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default,
)))
PASS_THROUGH = _VIEWS | {
    aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool3d.default,
    aten.clone.default, aten.contiguous.default,
}
# Casts: a pass-through when the dtype does not change (is_no_op_cast).
_CASTS = {aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.type_as.default, aten._to_copy.default}
AVERAGING_POOLS = {
    aten.avg_pool1d.default, aten.avg_pool2d.default, aten.avg_pool3d.default,
    aten.adaptive_avg_pool1d.default, aten.adaptive_avg_pool2d.default, aten.adaptive_avg_pool3d.default,
}

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclass
class OpMatch:
    """One op that takes an op config.

    inputs: (argument, role) in the op's argument order.
    shared_inputs: every input shares one set of qparams (cat, stack).
    output: the node whose output carries the op's output_activation (the end
        of a fused op -> [batch_norm] -> [activation] chain), or None.
    inner: the nodes between the op and `output`, quantized by neither.
    weight_transposed: the weight is stored (in, out, ...) rather than the
        (out, in, ...) of linear and conv weights that configs are written in
        (conv_transpose, addmm, a parameter on the right of a matmul).
    """

    op_type: str
    node: Node
    inputs: list[tuple[Node, str]]
    shared_inputs: bool = False
    output: Optional[Node] = None
    inner: list[Node] = field(default_factory=list)
    weight_transposed: bool = False


def is_float_tensor(node) -> bool:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return isinstance(val, torch.Tensor) and val.dtype in _FLOAT_DTYPES


def _is_param(node: Node) -> bool:
    return node.op == "get_attr"


# Ops that only lay a tensor out anew (same elements, other strides or shape):
# a parameter seen through them (`x @ W.t()`, `torch.mm(x, W.T)`) is still
# that parameter's values.
_LAYOUT_OPS = _VIEWS | {
    aten.expand.default, aten._unsafe_view.default, aten.squeeze.default, aten.alias.default,
    aten.detach.default, aten.clone.default, aten.contiguous.default, aten.numpy_T.default,
    aten.mT.default, aten.adjoint.default, aten.swapaxes.default, aten.movedim.int,
}


def param_through_layout(node) -> Optional[Node]:
    """The parameter (get_attr) whose elements `node` holds, laid out anew
    by layout ops only (t, transpose, permute, view, reshape, expand,
    squeeze, unsqueeze, clone, a no-op cast, ...) and neither broadcast nor
    cut (the same number of elements); None otherwise."""
    if not isinstance(node, Node):
        return None
    source = node
    while not _is_param(source):
        if source.op != "call_function" or not source.args or not isinstance(source.args[0], Node) \
                or not (source.target in _LAYOUT_OPS or is_no_op_cast(source)):
            return None
        source = source.args[0]
    val, src = node.meta.get("val"), source.meta.get("val")
    if not (isinstance(val, torch.Tensor) and isinstance(src, torch.Tensor)) or val.numel() != src.numel():
        return None
    return source


def is_no_op_cast(node: Node) -> bool:
    """A cast whose output has its input's dtype and device: the same values."""
    if node.op != "call_function" or node.target not in _CASTS or not isinstance(node.args[0], Node):
        return False
    src, out = node.args[0].meta.get("val"), node.meta.get("val")
    return (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)
            and src.dtype == out.dtype and src.device == out.device)


def passes_grid(node: Node) -> bool:
    """The node's output holds its first argument's values, moved or
    selected (PASS_THROUGH, a no-op cast, an eval-mode dropout)."""
    return node.op == "call_function" and (node.target in PASS_THROUGH or is_no_op_cast(node)
                                           or (node.target in DROPOUTS and node.args[2] is False))


def _is_inplace(node: Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and bool(schema.arguments) and schema.arguments[0].alias_info is not None \
        and schema.arguments[0].alias_info.is_write


def _aliases(node: Node) -> bool:
    """The node's output is a view of its first argument (a view op, or an
    in-place op, which returns the tensor it wrote)."""
    return node.op == "call_function" and isinstance(node.args[0] if node.args else None, Node) \
        and (node.target in _VIEWS or _is_inplace(node))


def _read_after(tensor: Node, node: Node) -> bool:
    """Whether a node after `node` reads the storage of `tensor`: through
    `tensor` itself, the tensor it is a view of, or any view of either."""
    while _aliases(tensor):
        tensor = tensor.args[0]
    aliases, todo = set(), [tensor]
    while todo:
        t = todo.pop()
        aliases.add(t)
        # Not through `node`: what reads its output reads the new value, as it should.
        todo += [u for u in t.users if u is not node and u not in aliases and _aliases(u) and u.args[0] is t]
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return any(u is not node and u not in aliases and order[u] > order[node] for t in aliases for u in t.users)


def activation_ops(names) -> frozenset:
    """The aten ops (in-place twins included) of ACTIVATIONS' `names`."""
    return frozenset().union(*(ACTIVATIONS[n] for n in names))


def _fused_output(node: Node, allow_batch_norm: bool, activations: frozenset) -> tuple[Node, list[Node]]:
    """The end of node -> [batch_norm] -> [activation], each link the only
    user of the one before (the activation one of `activations`), and the
    nodes before the end."""
    chain = [node]
    for kinds in ((_BATCH_NORMS,) if allow_batch_norm else ()) + (activations,):
        users = list(chain[-1].users)
        if len(users) == 1 and users[0].op == "call_function" and users[0].target in kinds:
            chain.append(users[0])
    return chain[-1], chain[:-1]


def _is_matmul_weight(node) -> bool:
    """A matmul operand that is a weight: a parameter, or (as in `x @ W.t()`)
    a 2-D relayout of one. The point sits on the operand itself, whose
    layout the matmul fixes whatever the view: on the right its columns are
    the output channels (stored (in, out), as `x @ W`), on the left its rows
    (stored (out, in)), so the config's (out, in) axes map onto it as for a
    parameter. A relayout to three or more dimensions (a weight split into
    heads for bmm) has no such axes: it stays an activation, and the plan
    warns about it."""
    if not isinstance(node, Node):
        return False
    if _is_param(node):
        return True
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 2 and param_through_layout(node) is not None


def _einsum_linear(node: Node) -> Optional[tuple[Node, Node, bool]]:
    """(input, weight, weight_transposed) of an einsum that is a linear: two
    operands, one a 2-D parameter sharing one index with the input, the
    input's last (`...bi,oi->...bo`, or `io` for a weight stored (in, out)),
    summed over, and keeping its other index in the output; else None."""
    equation, operands = node.args[0].replace(" ", ""), node.args[1]
    if "->" not in equation or len(operands) != 2:
        return None
    terms, out = equation.split("->")
    terms = terms.split(",")
    params = [i for i, a in enumerate(operands) if isinstance(a, Node) and _is_matmul_weight(a)]
    if len(params) != 1 or len(terms[params[0]]) != 2:
        return None
    w_term, x_term = terms[params[0]], terms[1 - params[0]]
    summed = [c for c in w_term if c in x_term and c not in out]
    kept = [c for c in w_term if c not in x_term and c in out]
    if len(summed) != 1 or len(kept) != 1 or not x_term.endswith(summed[0]):
        return None
    return operands[1 - params[0]], operands[params[0]], w_term.index(kept[0]) == 1


def match(node: Node, activations: frozenset = _ACTIVATIONS) -> Optional[OpMatch]:
    """The OpMatch of a node whose op takes an op config, else None; an
    activation among `activations` (aten ops, activation_ops) right after
    it is quantized with it."""
    if not is_layer(node, _OP_TYPE_OF):
        return None  # (an input rotation's linear stays float: pt2e_fq.calib.rotation)
    op_type = _OP_TYPE_OF[node.target]
    args = node.args
    transposed = op_type in _TRANSPOSED_WEIGHT_OPS
    if op_type in _WEIGHTED_OPS:
        inputs = [(args[0], INPUT), (args[1], WEIGHT)]
        if len(args) > 2 and isinstance(args[2], Node):
            inputs.append((args[2], BIAS))
    elif op_type in _MATMUL_OPS:
        inputs = [(a, WEIGHT if _is_matmul_weight(a) else INPUT) for a in args[:2]]
        # x @ W: a 2-D weight on the right is stored (in, out).
        transposed = _is_matmul_weight(args[1]) and not _is_matmul_weight(args[0]) \
            and len(args[1].meta["val"].shape) == 2
    elif op_type == "addmm":
        if not (isinstance(args[2], Node) and _is_matmul_weight(args[2])):
            return None  # a product of two activations plus a tensor: no weight, left in float
        inputs, transposed = [(args[0], BIAS), (args[1], INPUT), (args[2], WEIGHT)], True
    elif op_type == "einsum":
        linear = _einsum_linear(node)
        if linear is None:
            return None
        x, w, transposed = linear
        inputs = [(x, INPUT), (w, WEIGHT)]
    elif op_type in _EMBEDDING_OPS:
        return OpMatch(op_type, node, [(args[0], WEIGHT)])  # weight only: the indices are integers
    elif op_type in _BINARY_OPS:
        inputs = [(a, INPUT) for a in args[:2] if isinstance(a, Node)]
        if len(inputs) < 2:
            return None  # a tensor and a scalar (x * 0.5): left in float
        if _is_inplace(node) and _read_after(args[0], node):
            # A fake-quant point on that edge would take the mutation (its
            # output is a new tensor), and the later readers would see the
            # value before it: left in float, as the model computes it.
            return None
    else:  # cat, stack: shared qparams, so the output is on the inputs' grid
        inputs = [(a, INPUT) for a in args[0]]
        if not all(is_float_tensor(a) for a, _ in inputs):
            return None
        return OpMatch(op_type, node, inputs, shared_inputs=True)
    if not all(is_float_tensor(a) for a, _ in inputs):
        return None
    end, inner = _fused_output(node, allow_batch_norm=op_type in CONV_OPS, activations=activations)
    return OpMatch(op_type, node, inputs, output=end, inner=inner, weight_transposed=transposed)


def residual_add(m: OpMatch) -> Optional[Node]:
    """The add of a conv2d unit conv -> [batch_norm] -> add(., other): the
    conv's fused output (no activation in between) has that add as its only
    reader, the add is one `match` quantizes (two float tensors, alpha 1, not
    an in-place add whose input is read later) and its other operand is
    another tensor of the same shape (Inductor fuses no broadcast). None
    otherwise."""
    if m.op_type != "conv2d" or m.output is None or m.output.target in _ACTIVATIONS:
        return None
    users = list(m.output.users)
    if len(users) != 1 or users[0].op != "call_function" or users[0].target not in _BINARY_OPS["add"]:
        return None
    add = users[0]
    if add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2 or match(add) is None:
        return None
    other = add.args[1] if add.args[0] is m.output else add.args[0]
    if other is m.output:  # conv + the same conv
        return None
    return add if tuple(other.meta["val"].shape) == tuple(m.output.meta["val"].shape) else None
