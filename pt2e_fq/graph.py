"""The one decoder of pt2e_fq op calls: any call of a fused fake-quant op,
given as values (report's recorded calls, the ONNX translation's arguments)
or as a node of a GraphModule or ExportedProgram, becomes a typed
`OpCall` (format_kinds.py): format, block size per dimension, scale,
zero point or minval, global scale, integer range, block axis.

Every reader of op calls (report, ONNX export and its check, conv-bn
folding) goes through here, so none re-learns an op's arguments.

`as_args`: example inputs as the positional-argument tuple torch.export,
the prepared model and the exporters take (a single tensor is one argument).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from .spec.format_kinds import KINDS, FormatKind, OpCall


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
    schema = op._schema.arguments
    values = {a.name: a.default_value if a.has_default_value() else None for a in schema}
    values.update(zip((a.name for a in schema), args))
    values.update(kwargs or {})
    return kind.decode(op, values)


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
