"""Input statistics of the layers (calib.layers) over calibration batches,
in one pass through the prepared model: per layer, the second moment
H = E[x x^T] and the mean E[x] of its input columns (a linear's input
rows, a conv's unfolded patches, per conv group), as the layer sees them
in the prepared model (upstream points quantizing, observers off)."""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

from .layers import Layer

# Values of a conv's unfolded input made at once (whole samples, at least one). An unfolded
# input far above it (4 samples of a 3x3 conv's 96 x 112 x 112 input: 173 MB) is a fresh block
# of memory each time, paid for in page faults: on EfficientNet-Lite0, as much kernel time as
# arithmetic (about 20 s of each on 64 crops).
_UNFOLD_VALUES = 1 << 22
_FP64_COLUMNS = 64


def _conv_geometry(layer: Layer, x: torch.Tensor) -> tuple:
    """(kernel, stride, padding, dilation, groups, output size) of a conv layer on x."""
    stride, padding, dilation, groups = layer.conv_args()
    kernel = tuple(layer.weight_shape[2:])
    out = tuple((size + 2 * p - d * (k - 1) - 1) // st + 1
                for size, k, st, p, d in zip(x.shape[2:], kernel, stride, padding, dilation))
    return kernel, stride, padding, dilation, groups, out


def input_columns(layer: Layer, x: torch.Tensor):
    """The (groups, n, m) fp32 input columns of x for `layer` (its weight
    matrix times them gives its output without bias), a chunk of samples at
    a time for a conv that unfolds its input. Concatenated, the columns are
    in the order of the output positions: sample, then output row, then
    output column (a linear's: its input rows)."""
    x = x.detach().float()
    if not layer.is_conv:
        yield x.reshape(-1, x.shape[-1]).T.unsqueeze(0)
        return
    kernel, stride, padding, dilation, groups, out = _conv_geometry(layer, x)
    if kernel == (1, 1) and stride == (1, 1) and padding == (0, 0):  # a pointwise conv needs no unfold
        yield x.transpose(0, 1).reshape(groups, x.shape[1] // groups, -1)
        return
    for chunk in x.split(max(1, _UNFOLD_VALUES // (x.shape[1] * math.prod(kernel) * math.prod(out)))):
        cols = F.unfold(chunk, kernel, dilation=dilation, padding=padding, stride=stride)  # (B, C*kh*kw, L)
        b, n, l = cols.shape
        yield cols.reshape(b, groups, n // groups, l).permute(1, 2, 0, 3).reshape(groups, n // groups, b * l)


def column_layout(layer: Layer, x: torch.Tensor) -> tuple[int, int]:
    """(columns, values per column) of x for `layer`: its output positions,
    and the inputs each reads over all groups (a conv's channels x taps)."""
    if not layer.is_conv:
        return x.numel() // x.shape[-1], x.shape[-1]
    kernel, *_, out = _conv_geometry(layer, x)
    return x.shape[0] * math.prod(out), x.shape[1] * math.prod(kernel)


def columns_at(layer: Layer, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The (groups, n, len(index)) columns of input_columns(layer, x), concatenated,
    at the output positions `index`, gathered without unfolding the rest."""
    x = x.detach().float()
    if not layer.is_conv:
        return x.reshape(-1, x.shape[-1])[index].T.unsqueeze(0)
    kernel, stride, padding, dilation, groups, out = _conv_geometry(layer, x)
    sample, position = index // math.prod(out), index % math.prod(out)
    row, col = position // out[1] * stride[0], position % out[1] * stride[1]
    padded = F.pad(x, (padding[1], padding[1], padding[0], padding[0]))
    taps = [padded[sample, :, row + i * dilation[0], col + j * dilation[1]]  # (m, C) each
            for i in range(kernel[0]) for j in range(kernel[1])]
    # (C, kh * kw, m): unfold's order of a column's values (channel, then kernel row, then column).
    return torch.stack(taps, dim=-1).permute(1, 2, 0).reshape(groups, -1, len(index))


class InputStatistics:
    """Running sums of x x^T and x over a layer's input columns."""

    def __init__(self, layer: Layer):
        self.layer = layer
        self.count = 0
        self.xx = None  # (groups, n, n), float64
        self.x = None  # (groups, n), float64

    def add(self, x: torch.Tensor) -> None:
        for cols in input_columns(self.layer, x):
            # Few columns (a depthwise or stem conv): fp64 products, cheap there, so that the
            # covariance E[x x^T] - E[x] E[x]^T of inputs far from zero mean keeps its digits;
            # else fp32 products (a large unfolded input in fp64 costs seconds), fp64 sums.
            if cols.shape[1] <= _FP64_COLUMNS:
                cols = cols.double()
            xx = (cols @ cols.transpose(1, 2)).double()
            s = cols.sum(-1).double()
            self.xx = xx if self.xx is None else self.xx + xx
            self.x = s if self.x is None else self.x + s
            self.count += cols.shape[-1]

    @property
    def second_moment(self) -> torch.Tensor:
        return self.xx / self.count

    @property
    def mean(self) -> torch.Tensor:
        return self.x / self.count


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, stats: dict):
        super().__init__(gm)
        self.stats = stats  # node -> InputStatistics

    def run_node(self, n):
        record = self.stats.get(n)
        if record is not None:
            args, _ = self.fetch_args_kwargs_from_env(n)
            record.add(args[0])
        return super().run_node(n)


def collect(gm: torch.fx.GraphModule, layers: list[Layer], batches: Iterable) -> dict[torch.fx.Node, InputStatistics]:
    """One pass over `batches` (tensors or tuples of tensors) recording every layer's input statistics."""
    stats = {layer.node: InputStatistics(layer) for layer in layers}
    recorder = _Recorder(gm, stats)
    with torch.no_grad():
        for batch in batches:
            recorder.run(*tree_leaves(batch if isinstance(batch, tuple) else (batch,)))
    return stats
