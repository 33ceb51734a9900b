"""Model factories for the CLI tests (`--model tests.models.cli:tiny_mlp`)."""

import torch
import torch.nn as nn


def tiny_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def gelu_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def not_a_model():
    return "a string"


def two_inputs() -> nn.Module:
    class Add(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 4), nn.Linear(6, 4)

        def forward(self, x, y):
            return self.a(x) + self.b(y)

    torch.manual_seed(0)
    return Add()


def broken():
    raise RuntimeError("boom: the factory failed")
