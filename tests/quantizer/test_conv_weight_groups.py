"""Integer groups along a conv weight's input-channel axis that is shorter
than the group span kernel positions (quantizers/plan.py,
_conv_weight_groups): checked against block shapes and fake-quantized
weights computed by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from tests.models.quantizer import prepare, single_thread  # noqa: F401 (single_thread: an autouse fixture)

import pt2e_fq as q
from quantizers import FakeQuantQuantizer, OpConfig, QuantizerConfig, presets

INT4_GROUPS_OF_32 = q.QSpec(q.INT4, q.PerGroup(32, 1), "symmetric", observer=q.CurrentMinMaxObserver())


def weight_points(gm: torch.fx.GraphModule) -> dict[str, q.FakeQuantize]:
    """Parameter name -> the fake-quant module its value goes through."""
    found = {}
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.args and getattr(node.args[0], "op", None) == "get_attr":
            found[node.args[0].target] = gm.get_submodule(node.target)
    return found


def by_hand(w: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """Symmetric int4 fake quantization of w with one scale per block of
    `block` (dims divisible): scale = amax / 7.5, codes in [-8, 7]."""
    shape = [s for d, b in zip(w.shape, block) for s in (d // b, b)]
    blocks = w.reshape(shape)
    inner = tuple(range(1, len(shape), 2))
    scale = blocks.abs().amax(dim=inner, keepdim=True) / 7.5
    return (torch.round(blocks / scale).clamp(-8, 7) * scale).reshape(w.shape)


CASES = [
    # (layer, expected block of its weight)
    (nn.Conv2d(3, 16, 3), (1, 3, 3, 3)),  # a stem: groups of 27, not of 3
    (nn.Conv2d(16, 16, 5, groups=16), (1, 1, 5, 5)),  # depthwise: one filter, not one element
    (nn.Conv2d(8, 4, 3), (1, 8, 1, 3)),  # 4 positions fit: the last dim's largest divisor, 3
    (nn.Conv2d(16, 8, 3), (1, 16, 1, 1)),  # 2 positions fit, no divisor of 3 does: unchanged
    (nn.ConvTranspose2d(4, 6, 3), (4, 1, 1, 3)),  # stored (in, out, kh, kw): the group is on axis 0
    (nn.Conv1d(2, 4, 7), (1, 2, 7)),
]


@pytest.mark.parametrize("layer,block", CASES, ids=lambda v: repr(v) if isinstance(v, tuple) else type(v).__name__)
def test_a_conv_weights_group_spans_kernel_positions(layer, block):
    model = nn.Sequential(layer).eval()
    x = torch.randn(2, layer.in_channels, *([12] * (layer.weight.dim() - 2)))
    gm = prepare(model, x, FakeQuantQuantizer(QuantizerConfig(OpConfig(weight=INT4_GROUPS_OF_32))))
    gm(x)
    (fq,) = weight_points(gm).values()
    w = layer.weight.detach()
    # A block longer than its dim covers the dim.
    assert tuple(map(min, fq.qspec.granularity.block_size(w.shape), w.shape)) == block
    torch.testing.assert_close(fq(w), by_hand(w, block), rtol=0, atol=0)


def test_a_depthwise_weight_is_no_longer_exact():
    """The bug it fixes: with groups along the length-1 input axis every
    element had its own scale and came through unchanged."""
    layer = nn.Conv2d(8, 8, 3, groups=8)
    gm = prepare(nn.Sequential(layer).eval(), torch.randn(1, 8, 6, 6),
                 FakeQuantQuantizer(QuantizerConfig(OpConfig(weight=INT4_GROUPS_OF_32))))
    (fq,) = weight_points(gm).values()
    w = layer.weight.detach()
    y = fq(w)
    assert not torch.equal(y, w)
    assert all(len(y[c].unique()) <= 16 for c in range(8))


def test_linear_weights_and_float_block_formats_keep_their_groups():
    """Only integer groups on conv weights widen: a linear layer's input axis
    is its reduction, and MX blocks are the format's own (32 along axis 1)."""
    model = nn.Sequential(nn.Conv2d(8, 8, 3, groups=8), nn.Flatten(), nn.Linear(8 * 16, 4)).eval()
    x = torch.randn(2, 8, 6, 6)
    gm = prepare(model, x, FakeQuantQuantizer(QuantizerConfig(OpConfig(weight=q.QSpec(
        q.INT4, q.PerGroup(256, 1), "symmetric", observer=q.CurrentMinMaxObserver())))))
    points = weight_points(gm)
    assert points["0.weight"].qspec.granularity == q.PerBlock((1, 1, 3, 3))
    assert points["2.weight"].qspec.granularity == q.PerGroup(256, 1)
    gm = prepare(model, x, FakeQuantQuantizer(presets.get_preset("mxfp4")))
    points = weight_points(gm)
    assert points["0.weight"].qspec.granularity == q.PerGroup(32, 1)
