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


def tiny_cnn() -> nn.Module:
    """A first conv, a depthwise conv, a pointwise conv and a classifier (the
    layers presets.int8_edges keeps at int8 weights are the first, the
    depthwise and the last)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU(),
                         nn.Conv2d(8, 16, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))
