"""benchmarks/bench_qat_trained's rotated flows build what their names say:
"ours rotated" rotates every linear's input in the given blocks (the prepared graph's
rotations, counted by hand: one per rotated tensor) on w4a8's symmetric
int4 grid, and "ours rotated, asymmetric int4" on int4 groups with a zero
point each (the weight points' zero points, not all zero)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from benchmarks import bench_qat_trained
from pt2e_fq.calib.rotation import ROTATION
from pt2e_fq.fake_quantize import FakeQuantize


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(128)
        self.up, self.down = nn.Linear(128, 256), nn.Linear(256, 128)

    def forward(self, x):
        return self.down(nn.functional.gelu(self.up(self.ln(x))))


@pytest.mark.needs_torch("2.13", "torch 2.11's fake-tensor aten.linear calls numel() on a rank >= 3 input with a symbolic batch, which a rotation of such an input traces (input rotation then raises NotImplementedError there)")
@pytest.mark.parametrize("flow, asymmetric", [("ours rotated", False), ("ours rotated, asymmetric int4", True)])
def test_rotated_flows(flow, asymmetric):
    torch.manual_seed(0)
    model = _Mlp().eval()
    data = [(torch.randn(4, 16, 128),) for _ in range(2)]
    prepared = bench_qat_trained._ours(model, data, flow, rotation_block=64)
    rotations = [n for n in prepared.graph.nodes if n.meta.get(ROTATION) and n.target is torch.ops.aten.linear.default]
    assert len(rotations) == 2  # the LayerNorm output (up's input) and the GELU output (down's input)
    assert {tuple(getattr(prepared, n.args[1].target).shape) for n in rotations} == {(64, 64)}
    for n in rotations:  # the export has a dynamic batch; the matrix and the channels stay static sizes
        assert [type(d) for d in n.args[1].meta["val"].shape] == [int, int]
        assert type(n.meta["val"].shape[-1]) is int
    weights = [m for name, m in prepared.named_modules() if isinstance(m, FakeQuantize) and m.scale.dim() == 2]
    assert len(weights) == 2
    assert any(bool((w.zero_point != 0).any()) for w in weights) == asymmetric
