"""linear -> relu -> linear, with named layers (fc1, fc2) for the tests that
read a layer's points or weights by name."""

from __future__ import annotations

import torch
import torch.nn as nn


class ReluMLP(nn.Module):
    def __init__(self, d_in: int = 64, hidden: int = 64, d_out: int = 8):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, hidden), nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))
