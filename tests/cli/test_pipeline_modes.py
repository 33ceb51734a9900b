"""pipeline.prepare exports in the mode the flow needs and gives every
submodule its own mode back: a wrapper left in train mode around a model in
eval mode keeps the inner model's dropout off."""

from __future__ import annotations

import torch
import torch.nn as nn

from pt2e_fq.cli import pipeline


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).eval()

    def forward(self, x):
        return self.inner(x)


def test_prepare_restores_each_submodule_s_mode():
    model = Wrapper()  # the wrapper itself is in train mode, its inner model in eval mode
    x = torch.randn(4, 8)
    with torch.no_grad():
        before = model(x)
    pipeline.prepare(model, (x,), "w8a8")
    assert model.training and not model.inner.training and not model.inner[1].training
    with torch.no_grad():
        assert torch.equal(model(x), before)  # dropout still off: the output is deterministic
