"""Randomised Hadamard rotation of the inputs of linears and convolutions
(QuaRot, Ashkboos et al., 2024; QuIP#, Tseng et al., 2024), a graph
transform run before annotation.

A linear y = x W^T computes the same function as y = (x R)(W R)^T for any
orthogonal R. With R a randomised Hadamard transform, x R spreads each
channel's outliers over all channels of its block, so a per-tensor int8
grid on x R loses far less than one on x (a transformer's GELU outputs and
LayerNorm outputs carry a few channels tens of times larger than the rest);
W R is rotated the same way, which spreads its outlier columns as well. A
convolution with groups 1 is a linear over its input channels at every
kernel tap, so the same holds with R applied over the input's channel
dimension and over dimension 1 of the weight (out, in, *kernel); zero
padding rotates to zero padding.

R here is block diagonal: blocks of b channels, each the Sylvester Hadamard
matrix of b scaled by 1 / sqrt(b) with its rows' signs flipped by a seeded
random +-1 vector (D H; D H (D H)^T = I). b is the largest power of two
that divides the tensor's channels, at most `block_size`: 128 for a
384-wide transformer, 8 to 128 for the 16- to 1280-wide convolutions of a
mobile CNN. One (b, b) matrix serves every block of every rotated tensor
of that b, so the rotation is three ops on x (unflatten to blocks, a
linear with that matrix, stored transposed as a linear's weight, flatten)
costing b multiply-adds per element: 128 is a third of a 384-wide
linear's own cost per input element. A convolution's input has its
channels moved last before and back after (two permutes). A linear rather
than a matmul because backends take it as one: ExecuTorch's XNNPACK
partitioner delegates it as an fp32 fully-connected op, where it left a
matmul's decomposition (an expand and a batched matmul, or an mm) to
ExecuTorch's portable kernels.

The transform (rotate_inputs):
- inserts the ops once per rotated tensor, right after it; every rotated
  layer reading that tensor (q, k and v after one LayerNorm) reads the
  rotated one, and other readers (a residual add) the original;
- folds R into each rotated layer's weight, in place, computed in float64;
- marks the inserted nodes with `node.meta[ROTATION] = True`, for which
  calib.layers.is_layer is False: the quantizer leaves them float
  (quantizers.patterns.match), so the fake-quant points are those of the
  layers, on x R and W R, and no PTQ algorithm scales or rerounds R.

A layer is rotated when its weight is a parameter read by it alone (a
weight tied to an embedding would change the embedding), its input
channels are even and, for a convolution, its groups
are 1 (a depthwise conv mixes no channels, so it cannot absorb R); every
other layer the caller asks for is reported with the reason it was left as
it was.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.fx import GraphModule, Node

from ..graph import ROTATION_BUFFER
from .layers import LINEAR, ROTATION, _tensor, conv_groups, is_layer, tensor_readers

aten = torch.ops.aten
SEED = 0  # the sign vector's seed: the same graph and block size give the same rotation


@dataclass
class RotationReport:
    """What rotate_inputs did: the rotated layers' nodes, and the layers it
    was asked to rotate but left as they were, with why."""

    block_size: int
    rotated: dict[str, int] = field(default_factory=dict)  # layer -> its block
    skipped: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        counts = Counter(self.rotated.values())
        blocks = ", ".join(f"{counts[b]} in blocks of {b}" for b in sorted(counts, reverse=True))
        lines = [f"input rotation (Hadamard blocks of at most {self.block_size}): "
                 f"{len(self.rotated)} layer(s) rotated" + (f" ({blocks})" if blocks else "")]
        by_reason: dict[str, list[str]] = {}  # one line per reason: a CNN has a depthwise conv per block
        for name, why in self.skipped.items():
            by_reason.setdefault(why, []).append(name)
        lines += [f"  left as it was ({why}): {', '.join(names)}" for why, names in by_reason.items()]
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


# The layers whose inputs can be rotated: aten op -> the input's channel
# dimension, counted from the end (a convolution's input is (N, C, *spatial)
# or (C, *spatial)). A convolution with groups 1 is a linear over its input
# channels at each kernel tap, so the same fold applies along its weight's
# dimension 1; a grouped one (a depthwise conv) mixes no channels and cannot
# absorb R.
CHANNEL_DIM = {
    LINEAR: -1,
    aten.conv1d.default: -2, aten.conv1d.padding: -2,
    aten.conv2d.default: -3, aten.conv2d.padding: -3,
    aten.conv3d.default: -4, aten.conv3d.padding: -4,
}


def block_of(channels: int, block_size: int) -> int:
    """The largest power of two that divides `channels`, at most `block_size`."""
    return min(block_size, channels & -channels)


def _why_not(gm: GraphModule, layer: Node, readers_of: dict) -> str:
    """Why `layer` cannot be rotated, or ''."""
    x, w = layer.args[0], layer.args[1]
    if layer.target is not LINEAR and conv_groups(layer) != 1:
        return "it is a grouped convolution (it mixes no channels across groups)"
    if not (isinstance(w, Node) and w.op == "get_attr"):
        return "its weight is not a parameter of the model"
    weight = _tensor(gm, w.target)
    if len(w.users) > 1 or readers_of[id(weight)] > 1:
        return "its weight is read elsewhere too (tied weights)"
    if weight.shape[1] % 2:
        return f"its {weight.shape[1]} input channels are odd (no Hadamard block divides them)"
    val = x.meta.get("val") if isinstance(x, Node) else None
    if not isinstance(val, torch.Tensor) or not val.is_floating_point():
        return "its input is not a float tensor of the graph"
    return ""


def _rotation_steps(rank: int, channel_dim: int, block_size: int) -> list:
    """(aten op, arguments after the tensor) that rotate the channels of a
    tensor of `rank` dimensions in blocks; None stands for the matrix. The
    channels are moved last and back when they are not last already."""
    steps = [(aten.unflatten.int, (-1, [-1, block_size])), (aten.linear.default, (None,)),
             (aten.flatten.using_ints, (-2, -1))]
    if channel_dim == -1:
        return steps
    c = rank + channel_dim
    to_last = [d for d in range(rank) if d != c] + [c]
    back = sorted(range(rank), key=to_last.__getitem__)
    return [(aten.permute.default, (to_last,)), *steps, (aten.permute.default, (back,))]


def _set_fake_values(value: torch.Tensor, matrix: torch.Tensor, steps: list, nodes: list) -> None:
    """The nodes' meta["val"] (the planner reads shapes and dtypes there),
    computed under the fake mode of `value`, the rotated tensor's."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([value])
    if mode is None:
        return
    with mode:
        fake_matrix = mode.from_tensor(matrix, static_shapes=True)  # a constant: no symbolic sizes
        vals, last = [fake_matrix], value
        for op, args in steps:
            try:
                last = op(last, *(fake_matrix if a is None else a for a in args))
            except RuntimeError as e:
                if "symbolic sizes" not in str(e):
                    raise
                # torch 2.11's aten.linear asks a tensor of rank >= 3 with a
                # symbolic size for its numel(); torch 2.13 does not.
                raise NotImplementedError(
                    f"input rotation: torch {torch.__version__} cannot trace aten.linear on the "
                    f"{tuple(value.shape)} input of a rotation ({e.args[0].splitlines()[0]}); rotate a model "
                    "exported with static shapes, or use torch >= 2.13") from None
            vals.append(last)
    for node, val in zip(nodes, vals):
        node.meta["val"] = val


def _insert_rotation(gm: GraphModule, x: Node, channel_dim: int, matrix_name: str, block_size: int,
                     stack) -> Node:
    graph = gm.graph
    steps = _rotation_steps(x.meta["val"].dim(), channel_dim, block_size)
    with graph.inserting_after(x):
        matrix = graph.get_attr(matrix_name)
    nodes, last = [matrix], x
    for op, args in steps:
        with graph.inserting_after(nodes[-1]):
            last = graph.call_function(op, (last, *(matrix if a is None else a for a in args)))
        nodes.append(last)
    _set_fake_values(x.meta["val"], _tensor(gm, matrix_name), steps, nodes)
    for node in nodes:
        node.meta[ROTATION] = True
        if stack is not None:
            node.meta["nn_module_stack"] = dict(stack)
    return last


def rotate_inputs(gm: GraphModule, block_size: int, wanted: Callable[[Node], bool] = lambda node: True,
                  seed: int = SEED) -> RotationReport:
    """Rotates the inputs of the linears and convolutions (CHANNEL_DIM) of
    `gm` for which `wanted(node)` is true (module doc), in place; the
    function of `gm` is unchanged up to float rounding.

    Args:
        gm: an exported GraphModule holding its own parameters
            (pt2e_fq.flow.own_tensors: the folded weights are written in place).
        block_size: the largest Hadamard block, a power of two >= 2.
        wanted: which layers to rotate (the quantizer: those with a quantized input or weight).
        seed: the seed of the sign vector.

    Returns:
        A RotationReport.

    Raises:
        TypeError, ValueError: block_size not a power of two >= 2.
    """
    check_block_size("rotate_inputs: block_size", block_size)
    report = RotationReport(block_size)
    readers_of = tensor_readers(gm)
    by_input: dict[tuple[Node, int], list[Node]] = {}
    for node in gm.graph.nodes:
        if is_layer(node, CHANNEL_DIM) and wanted(node):
            why = _why_not(gm, node, readers_of)
            if why:
                report.skipped[node.name] = why
            else:
                by_input.setdefault((node.args[0], CHANNEL_DIM[node.target]), []).append(node)
    if not by_input:
        return report
    rotations: dict[tuple, str] = {}  # one buffer per (block, input dtype)
    folds: dict[int, torch.Tensor] = {}  # block -> R in float64, for folding into the weights
    for (x, channel_dim), layers in by_input.items():
        dtype = x.meta["val"].dtype
        block = block_of(x.meta["val"].shape[channel_dim], block_size)
        if (block, dtype) not in rotations:
            name = f"{ROTATION_BUFFER}{len(rotations)}"
            gm.register_buffer(name, hadamard_rotation(block, seed, dtype).T.contiguous())  # linear's (out, in)
            rotations[block, dtype] = name
        r = folds.setdefault(block, hadamard_rotation(block, seed))
        rotated = _insert_rotation(gm, x, channel_dim, rotations[block, dtype], block,
                                   layers[0].meta.get("nn_module_stack"))
        for layer in layers:
            layer.replace_input_with(x, rotated)
            weight = _tensor(gm, layer.args[1].target)
            with torch.no_grad():  # (out, in, *kernel): the input channels in blocks, times R
                blocks = weight.double().movedim(1, -1).unflatten(-1, (-1, block))
                weight.copy_((blocks @ r).flatten(-2).movedim(-1, 1).to(weight.dtype))
            report.rotated[layer.name] = block
    gm.graph.lint()
    gm.recompile()
    return report
