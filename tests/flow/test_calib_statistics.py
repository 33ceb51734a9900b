"""pt2e_fq.calib.statistics: a layer's weight matrix times the columns
input_columns yields gives ATen's conv2d output (without bias), for
strided, padded, dilated and grouped convs, whether the input is unfolded
whole, a sample at a time, or in chunks of several samples (as many whole
samples as the unfold budget holds, sized by ATen's output); columns_at
gathers the same columns at any output positions without unfolding, and
column_layout counts ATen's output positions and a column's values; the second moment
InputStatistics accumulates over chunks matches one computed here from
F.unfold of the whole input."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pt2e_fq.calib import layers, statistics
from pt2e_fq.cli import pipeline

CONVS = {  # name: (in, out, kernel, stride, padding, dilation, groups)
    "3x3 padded": (4, 6, 3, 1, 1, 1, 1),
    "5x5 strided depthwise": (6, 6, 5, 2, 2, 1, 6),
    "3x3 dilated grouped": (4, 8, 3, 1, 2, 2, 2),
    "2x2 stride 2, no padding": (3, 5, 2, 2, 0, 1, 1),
    "1x1 strided": (4, 6, 1, 2, 0, 1, 1),
    "1x1": (4, 6, 1, 1, 0, 1, 1),
}


def _layer(module: nn.Module, x: torch.Tensor):
    model = nn.Sequential(module).eval()
    prepared = pipeline.prepare(model, x, "w8a8")
    (layer,) = layers.find_layers(prepared)
    return layer


@pytest.mark.parametrize("name", CONVS)
@pytest.mark.parametrize("budget", [1, 700, 1 << 22])  # a sample per chunk, a few samples, the whole batch
def test_conv_columns_times_weight_are_the_conv_output(name, budget, monkeypatch):
    monkeypatch.setattr(statistics, "_UNFOLD_VALUES", budget)
    cin, cout, k, stride, padding, dilation, groups = CONVS[name]
    torch.manual_seed(0)
    conv = nn.Conv2d(cin, cout, k, stride, padding, dilation, groups, bias=False)
    x = torch.randn(5, cin, 9, 11)
    layer = _layer(conv, x)
    chunks = list(statistics.input_columns(layer, x))
    cols = torch.cat(chunks, dim=-1)  # (groups, n, samples x positions), sample-major
    w = layer.as_matrix(conv.weight.detach())
    reference = conv(x)  # ATen's
    b, _, h, wd = reference.shape
    out = (w @ cols).reshape(groups, cout // groups, b, h * wd).permute(2, 0, 1, 3).reshape(b, cout, h, wd)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    if (k, stride, padding) != (1, 1, 0):  # unfolded: whole samples of at most `budget` values, at least one
        per_sample = cin * k * k * h * wd
        assert len(chunks) == math.ceil(b / max(1, budget // per_sample))


def test_second_moment_matches_unfold_of_the_whole_input(monkeypatch):
    monkeypatch.setattr(statistics, "_UNFOLD_VALUES", 700)
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 6, 3, 1, 1, 1, 3, bias=False)
    x = torch.randn(5, 6, 8, 8)
    stats = statistics.InputStatistics(_layer(conv, x))
    stats.add(x)
    cols = F.unfold(x.double(), 3, padding=1).reshape(5, 3, 18, 64).permute(1, 2, 0, 3).reshape(3, 18, 320)
    torch.testing.assert_close(stats.second_moment, cols @ cols.transpose(1, 2) / 320)
    torch.testing.assert_close(stats.mean, cols.mean(-1))


@pytest.mark.parametrize("name", CONVS)
def test_columns_at_positions_are_those_of_the_unfold(name):
    """columns_at gathers, at any output positions, the columns input_columns
    unfolds there; column_layout gives the number of ATen's output positions."""
    cin, cout, k, stride, padding, dilation, groups = CONVS[name]
    torch.manual_seed(0)
    conv = nn.Conv2d(cin, cout, k, stride, padding, dilation, groups, bias=False)
    x = torch.randn(3, cin, 9, 11)
    layer = _layer(conv, x)
    every = torch.cat(list(statistics.input_columns(layer, x)), dim=-1)
    count, values = statistics.column_layout(layer, x)
    assert count == conv(x)[:, 0].numel() == every.shape[-1] and values == cin * k * k == every[..., 0].numel()
    index = torch.randperm(count, generator=torch.Generator().manual_seed(1))[:37]
    torch.testing.assert_close(statistics.columns_at(layer, x, index), every[..., index], rtol=0, atol=0)


def test_linear_columns_at_positions_are_its_rows():
    torch.manual_seed(0)
    linear = nn.Linear(6, 4)
    x = torch.randn(2, 5, 6)
    layer = _layer(linear, x)
    assert statistics.column_layout(layer, x) == (10, 6)
    index = torch.tensor([7, 0, 3])
    torch.testing.assert_close(statistics.columns_at(layer, x, index), x.reshape(10, 6)[index].T.unsqueeze(0),
                               rtol=0, atol=0)
