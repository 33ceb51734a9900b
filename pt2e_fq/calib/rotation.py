"""Randomised Hadamard rotation of linears' inputs (QuaRot, Ashkboos et al.,
2024; QuIP#, Tseng et al., 2024), a graph transform run before annotation.

A linear y = x W^T computes the same function as y = (x R)(W R)^T for any
orthogonal R. With R a randomised Hadamard transform, x R spreads each
channel's outliers over all channels of its block, so a per-tensor int8
grid on x R loses far less than one on x (a transformer's GELU outputs and
LayerNorm outputs carry a few channels tens of times larger than the rest);
W R is rotated the same way, which spreads its outlier columns as well.

R here is block diagonal: blocks of `block_size` channels (a power of two),
each the Sylvester Hadamard matrix scaled by 1 / sqrt(block_size) with its
rows' signs flipped by a seeded random +-1 vector (D H; D H (D H)^T = I).
One (block_size, block_size) matrix serves every block of every rotated
tensor, so the rotation is three ops on x (unflatten to blocks, a matmul
with that matrix, flatten) costing block_size multiply-adds per element:
128 is a third of a 384-wide linear's own cost per input element.

The transform (rotate_linear_inputs):
- inserts the three ops once per rotated tensor, right after it; every
  rotated linear reading that tensor (q, k and v after one LayerNorm)
  reads the rotated one, and other readers (a residual add) the original;
- folds R into each rotated linear's weight, in place, computed in float64;
- marks the inserted nodes with `node.meta[ROTATION] = True`, and the
  quantizer leaves them float (quantizers.patterns.match): the fake-quant
  points are those of the linears, on x R and W R.

A linear is rotated when its weight is a parameter read by it alone (a
weight tied to an embedding would change the embedding) and its input
channels are a multiple of block_size; every other linear the caller asks
for is reported with the reason it was left as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.fx import GraphModule, Node

from ..graph import ROTATION_BUFFER
from .layers import LINEAR, _tensor

aten = torch.ops.aten
ROTATION = "pt2e_fq_rotation"  # node.meta key of the inserted nodes
SEED = 0  # the sign vector's seed: the same graph and block size give the same rotation


@dataclass
class RotationReport:
    """What rotate_linear_inputs did: the rotated linears' nodes, and the
    linears it was asked to rotate but left as they were, with why."""

    block_size: int
    rotated: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"input rotation (Hadamard blocks of {self.block_size}): {len(self.rotated)} linear(s) rotated"]
        lines += [f"  left as it was: {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


def check_block_size(where: str, block_size) -> int:
    """block_size as an int, or ValueError / TypeError naming `where`."""
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"{where} must be an int (a power of two >= 2), got {block_size!r}")
    if block_size < 2 or block_size & (block_size - 1):
        raise ValueError(f"{where} must be a power of two >= 2, got {block_size}")
    return block_size


def hadamard_rotation(block_size: int, seed: int = SEED, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """D H: the Sylvester Hadamard matrix of `block_size` (a power of two)
    over sqrt(block_size), its rows' signs flipped by a +-1 vector drawn
    from `seed`. Orthogonal."""
    check_block_size("hadamard_rotation: block_size", block_size)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block_size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    signs = torch.randint(0, 2, (block_size,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return (signs[:, None].to(torch.float64) * h / math.sqrt(block_size)).to(dtype)


def _why_not(gm: GraphModule, linear: Node, block_size: int, readers_of: dict) -> str:
    """Why `linear` cannot be rotated, or ''."""
    x, w = linear.args[0], linear.args[1]
    if not (isinstance(w, Node) and w.op == "get_attr"):
        return "its weight is not a parameter of the model"
    weight = _tensor(gm, w.target)
    if len(w.users) > 1 or readers_of[id(weight)] > 1:
        return "its weight is read elsewhere too (tied weights)"
    if weight.dim() != 2 or weight.shape[1] % block_size:
        return f"its {weight.shape[-1]} input channels are not a multiple of {block_size}"
    val = x.meta.get("val") if isinstance(x, Node) else None
    if not isinstance(val, torch.Tensor) or not val.is_floating_point():
        return "its input is not a float tensor of the graph"
    return ""


def _set_fake_values(value: torch.Tensor, matrix: torch.Tensor, nodes: tuple) -> None:
    """The nodes' meta["val"] (the planner reads shapes and dtypes there),
    computed under the fake mode of `value`, the rotated tensor's."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([value])
    if mode is None:
        return
    with mode:
        fake_matrix = mode.from_tensor(matrix)
        blocks = value.unflatten(-1, (-1, matrix.shape[0]))
        rotated_blocks = blocks @ fake_matrix
        vals = (fake_matrix, blocks, rotated_blocks, rotated_blocks.flatten(-2))
    for node, val in zip(nodes, vals):
        node.meta["val"] = val


def _insert_rotation(gm: GraphModule, x: Node, matrix_name: str, block_size: int, stack) -> Node:
    graph = gm.graph
    with graph.inserting_after(x):
        matrix = graph.get_attr(matrix_name)
    with graph.inserting_after(matrix):
        blocks = graph.call_function(aten.unflatten.int, (x, -1, [-1, block_size]))
    with graph.inserting_after(blocks):
        rotated_blocks = graph.call_function(aten.matmul.default, (blocks, matrix))
    with graph.inserting_after(rotated_blocks):
        rotated = graph.call_function(aten.flatten.using_ints, (rotated_blocks, -2, -1))
    _set_fake_values(x.meta["val"], _tensor(gm, matrix_name), (matrix, blocks, rotated_blocks, rotated))
    for node in (matrix, blocks, rotated_blocks, rotated):
        node.meta[ROTATION] = True
        if stack is not None:
            node.meta["nn_module_stack"] = dict(stack)
    return rotated


def rotate_linear_inputs(gm: GraphModule, block_size: int, wanted: Callable[[Node], bool] = lambda node: True,
                         seed: int = SEED) -> RotationReport:
    """Rotates the inputs of the aten.linear nodes of `gm` for which
    `wanted(node)` is true (module doc), in place; the function of `gm` is
    unchanged up to float rounding.

    Args:
        gm: an exported GraphModule holding its own parameters
            (pt2e_fq.flow.own_tensors: the folded weights are written in place).
        block_size: the Hadamard block, a power of two >= 2.
        wanted: which linears to rotate (the quantizer: those with a quantized input or weight).
        seed: the seed of the sign vector.

    Returns:
        A RotationReport.

    Raises:
        TypeError, ValueError: block_size not a power of two >= 2.
    """
    check_block_size("rotate_linear_inputs: block_size", block_size)
    report = RotationReport(block_size)
    readers_of: dict[int, int] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = _tensor(gm, node.target)
            readers_of[id(value)] = readers_of.get(id(value), 0) + 1
    by_input: dict[Node, list[Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is LINEAR and wanted(node):
            why = _why_not(gm, node, block_size, readers_of)
            if why:
                report.skipped[node.name] = why
            else:
                by_input.setdefault(node.args[0], []).append(node)
    if not by_input:
        return report
    rotations: dict[torch.dtype, str] = {}  # one buffer per input dtype
    r = hadamard_rotation(block_size, seed)  # float64, for folding into the weights
    for x, linears in by_input.items():
        dtype = x.meta["val"].dtype
        if dtype not in rotations:
            name = f"{ROTATION_BUFFER}{len(rotations)}"
            gm.register_buffer(name, hadamard_rotation(block_size, seed, dtype))
            rotations[dtype] = name
        rotated = _insert_rotation(gm, x, rotations[dtype], block_size, linears[0].meta.get("nn_module_stack"))
        for linear in linears:
            linear.replace_input_with(x, rotated)
            weight = _tensor(gm, linear.args[1].target)
            with torch.no_grad():
                folded = (weight.double().unflatten(1, (-1, block_size)) @ r).flatten(1)
                weight.copy_(folded.to(weight.dtype))
            report.rotated.append(linear.name)
    gm.graph.lint()
    gm.recompile()
    return report
