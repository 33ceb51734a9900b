"""The layers the PTQ algorithms work on: every conv2d and linear of a
prepared graph whose weight is a parameter read through one of our
FakeQuantize points (get_attr -> FakeQuantize -> op), with its weight as a
matrix of (groups, rows, columns): a linear's (1, out, in); a conv's
(groups, out / groups, in / groups * kh * kw), columns in the order of
`torch.nn.functional.unfold` (channel, then kernel row, then column)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Collection, Optional

import torch

from ..fake_quantize import FakeQuantize
from ..ops.blocks import expand_blocks
from ..spec.format_kinds import INTEGER, MX, NVFP4, SCALED_FLOAT

aten = torch.ops.aten
LINEAR, CONV2D = aten.linear.default, aten.conv2d.default
# nn.Conv2d(padding="same" or "valid") calls this overload: padding as a string.
CONV2D_PADDING = aten.conv2d.padding
# aten.conv2d's arguments after (input, weight, bias), with their defaults.
_CONV_DEFAULTS = ((1, 1), (0, 0), (1, 1))  # stride, padding, dilation
_GROUPS_ARG = 6  # every aten.conv1d/2d/3d overload: (input, weight, bias, stride, padding, dilation, groups)
# node.meta key of the ops an input rotation inserts (pt2e_fq.calib.rotation): one is an aten.linear.
ROTATION = "pt2e_fq_rotation"


def is_layer(node: torch.fx.Node, ops: Collection = (LINEAR, CONV2D, CONV2D_PADDING)) -> bool:
    """A call of one of `ops` that is the model's own: not an input
    rotation's linear, whose matrix is fixed and shared by every rotation of
    its size (no pass may quantize, scale, rotate or reround it)."""
    return node.op == "call_function" and node.target in ops and not node.meta.get(ROTATION)


def tensor_readers(gm: torch.nn.Module) -> Counter:
    """How many get_attr nodes of `gm` read each tensor, by id(tensor). A
    tensor read through two (tied weights under two names, a shared rotation
    matrix) is shared by their ops even when each get_attr has one user."""
    return Counter(id(_tensor(gm, node.target)) for node in gm.graph.nodes if node.op == "get_attr")


def conv_groups(node: torch.fx.Node) -> int:
    """The groups of an aten.conv1d/2d/3d call (.default or .padding), positional or keyword."""
    return int(node.args[_GROUPS_ARG] if len(node.args) > _GROUPS_ARG else node.kwargs.get("groups", 1))


@dataclass
class Layer:
    node: torch.fx.Node  # the linear or conv2d call
    weight_name: str  # the get_attr target of the weight
    point: FakeQuantize  # the weight's fake-quant point
    weight_shape: torch.Size

    @property
    def is_conv(self) -> bool:
        return self.node.target in (CONV2D, CONV2D_PADDING)

    def conv_args(self) -> tuple:
        """(stride, padding, dilation, groups) of a conv2d node; padding
        "valid" as 0 and "same" as the kernel's reach on each side
        (same_padding says where that is not symmetric)."""
        given = tuple(self.node.args[3:]) + _CONV_DEFAULTS[len(self.node.args) - 3:]
        stride, padding, dilation = (given[i] if i < len(given) else _CONV_DEFAULTS[i] for i in range(3))
        pair = lambda v: tuple(v) if isinstance(v, (list, tuple)) else (v, v)  # noqa: E731
        dilation = pair(dilation)
        if padding == "valid":
            padding = 0
        elif padding == "same":
            padding = tuple(d * (k - 1) // 2 for d, k in zip(dilation, self.weight_shape[2:]))
        return pair(stride), pair(padding), dilation, conv_groups(self.node)

    def same_padding_is_uneven(self) -> bool:
        """padding="same" whose kernel reach is odd: torch pads one more
        row or column after than before, which the column layout of the
        statistics (one padding per side) does not hold."""
        if self.node.target is not CONV2D_PADDING:
            return False
        padding = self.node.args[4] if len(self.node.args) > 4 else self.node.kwargs.get("padding", "valid")
        if padding != "same":
            return False
        _, _, dilation, _ = self.conv_args()
        return any(d * (k - 1) % 2 for d, k in zip(dilation, self.weight_shape[2:]))

    @property
    def groups(self) -> int:
        return conv_groups(self.node) if self.is_conv else 1

    def weight(self, gm: torch.fx.GraphModule) -> torch.Tensor:
        return _tensor(gm, self.weight_name).detach()

    def as_matrix(self, w: torch.Tensor) -> torch.Tensor:
        g = self.groups
        return w.reshape(g, w.shape[0] // g, -1)

    def quantize(self, matrix: torch.Tensor) -> torch.Tensor:
        """The weight point's own op (its observer off) on a matrix of this layer's weight."""
        with torch.no_grad():
            return self.point(matrix.reshape(self.weight_shape)).reshape(matrix.shape)

    def column_quantizer(self, order: Optional[torch.Tensor] = None, bound: Optional[torch.Tensor] = None):
        """quantize(columns, i) for calib.gptq: column i (groups, rows) of the
        weight matrix given with its columns first (groups, n, rows), rounded
        by the weight point's op. With `order` (groups, n), the columns come
        permuted: position i holds column order[:, i] (GPTQ's act_order).
        With `bound` (the matrix's shape; NVFP4, calib.weight_ranges), the
        weight is clamped to +-bound before the op.

        A static integer or scaled-float point rounds each element on its own
        qparams: the op runs on the column alone with those qparams expanded
        to one per element (the same arithmetic as on the whole weight; they
        are fixed before the loop, so a group's scale is the same whatever
        order its columns are rounded in). MX and NVFP4 blocks along the
        columns of a linear or pointwise conv: the op on column i's block.
        Otherwise (block scales computed in the kernel: MX, NVFP4) the op runs
        on the whole weight, where a block's scale sees the block's current
        values."""
        spec = self.point.qspec
        n = self.weight_shape[1:].numel()
        if order is None:
            order = torch.arange(n).expand(self.groups, n)
        inverse = torch.argsort(order, dim=1)
        clamp = (lambda t, _cols: t) if bound is None else (  # noqa: E731
            lambda t, cols: torch.maximum(torch.minimum(t, bound[:, :, cols]), -bound[:, :, cols]))
        if spec.kind in (MX, NVFP4) and self.groups == 1 and self.weight_shape[2:].numel() == 1:
            # Blocks run along the columns (a linear's or pointwise conv's input channels): the op
            # on the block holding column j alone gives what it gives on the whole weight.
            size = spec.granularity.group_size
            tail = (1,) * (len(self.weight_shape) - 2)

            def quantize_block(columns, i):
                j = int(order[0, i])
                start = j - j % size
                cols = slice(start, min(start + size, n))
                block = clamp(columns[0, inverse[0, cols]].T[None], cols)[0]
                with torch.no_grad():
                    return self.point(block.reshape(*block.shape, *tail)).reshape(block.shape)[:, j - start][None]

            return quantize_block
        if spec.dynamic or spec.kind not in (INTEGER, SCALED_FLOAT):
            def quantize_whole(columns, i):
                natural = columns.gather(1, inverse[:, :, None].expand_as(columns)).transpose(1, 2)
                q = self.quantize(clamp(natural, slice(None)))
                return q.gather(2, order[:, None, i:i + 1].expand(-1, q.shape[1], 1))[:, :, 0]

            return quantize_whole
        block = spec.granularity.block_size(self.weight_shape)
        per_element = {}
        for name, q in self.point.applied_qparams().items():  # a learnable point's as its op applies them
            q = self.as_matrix(expand_blocks(q, self.weight_shape, block)).transpose(1, 2)
            per_element[name] = q.gather(1, order[:, :, None].expand_as(q)).contiguous()
        ones = (1, 1, 1)

        def quantize(columns, i):
            with torch.no_grad():
                qparams = {name: q[:, i:i + 1] for name, q in per_element.items()}
                return spec.kind.fake_quantize(spec, columns[:, i:i + 1], ones, qparams)[:, 0]

        return quantize

    def bias_node(self) -> Optional[torch.fx.Node]:
        b = self.node.args[2] if len(self.node.args) > 2 else None
        return b if isinstance(b, torch.fx.Node) else None


def _tensor(gm: torch.nn.Module, name: str) -> torch.Tensor:
    owner_name, _, attr = name.rpartition(".")
    return getattr(gm.get_submodule(owner_name) if owner_name else gm, attr)


def find_layers(gm: torch.fx.GraphModule) -> list[Layer]:
    """The linear and conv2d nodes whose weight is get_attr -> FakeQuantize, in graph order."""
    layers = []
    for node in gm.graph.nodes:
        if not is_layer(node) or len(node.args) < 2:
            continue
        point_node = node.args[1]
        if not (isinstance(point_node, torch.fx.Node) and point_node.op == "call_module"):
            continue
        point = gm.get_submodule(point_node.target)
        source = point_node.args[0]
        if isinstance(point, FakeQuantize) and isinstance(source, torch.fx.Node) and source.op == "get_attr":
            layers.append(Layer(node, source.target, point, _tensor(gm, source.target).shape))
    return layers


def usable_layers(gm: torch.fx.GraphModule) -> tuple[list[Layer], dict[str, str]]:
    """find_layers less the layers an algorithm that rewrites weights and
    biases cannot take, and {layer node name: why} of those: a weight or
    bias that another op reads too (a module called twice, tied weights:
    each use would round the weight for its own inputs, and bias
    corrections would add up on the shared bias), and a conv whose
    padding="same" is uneven (same_padding_is_uneven)."""
    layers = find_layers(gm)
    readers = tensor_readers(gm)
    kept, skipped = [], {}
    for layer in layers:
        point_node = layer.node.args[1]
        # Each tensor read by one get_attr node, read by one node: the weight's point (read by the layer
        # alone), the bias's layer. A second get_attr of the tensor, or a second reader, is another op.
        reads = [(point_node.args[0], point_node)] + ([(layer.bias_node(), layer.node)]
                                                      if layer.bias_node() is not None else [])
        shared = [node.target for node, reader in reads
                  if readers[id(_tensor(gm, node.target))] > 1 or set(node.users) != {reader}
                  or (reader is point_node and set(point_node.users) != {layer.node})]
        if shared:
            skipped[layer.node.name] = f"{' and '.join(shared)} read by another op too"
        elif layer.same_padding_is_uneven():
            skipped[layer.node.name] = 'padding="same" with an even kernel (one more row or column after)'
        else:
            kept.append(layer)
    return kept, skipped


def skipped_text(where: str, skipped: dict) -> str:
    """One line naming the layers an algorithm left as they were, and why."""
    return (f"{where}: {len(skipped)} layer(s) left as they were: "
            + "; ".join(f"{name} ({why})" for name, why in skipped.items()))


def _set_attr(gm: torch.fx.GraphModule, name: str, value: torch.Tensor) -> None:
    """Replaces the tensor at `name` with a new Parameter (never in place: a
    graph from torch.export(model).module() shares its parameters with the
    user's float model, which must stay as it is), in the old tensor's dtype
    (the algorithms compute in fp32; a bf16 or fp16 model stays one)."""
    owner_name, _, attr = name.rpartition(".")
    owner = gm.get_submodule(owner_name) if owner_name else gm
    old = getattr(owner, attr)
    value = value.to(old.dtype)
    if isinstance(old, torch.nn.Parameter):
        setattr(owner, attr, torch.nn.Parameter(value.detach().clone(), requires_grad=old.requires_grad))
    else:
        owner.register_buffer(attr, value.detach().clone())


def set_weight(gm: torch.fx.GraphModule, layer: Layer, weight: torch.Tensor) -> None:
    _set_attr(gm, layer.weight_name, weight)


def add_to_bias(gm: torch.fx.GraphModule, layer: Layer, delta: torch.Tensor) -> None:
    """bias += delta (out,), giving a layer without bias one (a new
    parameter `<weight name>_calib_bias` read by a get_attr node)."""
    node = layer.bias_node()
    if node is not None:
        old = _tensor(gm, node.target)
        _set_attr(gm, node.target, old.detach() + delta.to(old.dtype))
        return
    name = layer.weight_name.replace(".", "_") + "_calib_bias"
    dtype = _tensor(gm, layer.weight_name).dtype  # the layer's own: an op takes one dtype
    gm.register_parameter(name, torch.nn.Parameter(delta.detach().to(dtype), requires_grad=False))
    with gm.graph.inserting_before(layer.node):
        bias = gm.graph.get_attr(name)
    args = list(layer.node.args)
    if len(args) > 2:
        args[2] = bias
    else:
        args.append(bias)
    layer.node.args = tuple(args)
    gm.recompile()
