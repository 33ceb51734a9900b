"""torchvision's ResNet basic block and a two-block ResNet built from it, at
toy sizes: the one residual CNN block of the tests."""

from __future__ import annotations

import torch
import torch.nn as nn


class BasicBlock(nn.Module):
    """relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)), the shortcut a
    1x1 conv-bn where the stride or the channel count changes. inplace: as
    torchvision writes it, `out += identity` and `ReLU(inplace=True)`."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1, inplace: bool = False):
        super().__init__()
        self.inplace = inplace
        self.conv1, self.bn1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out)
        self.conv2, self.bn2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out)
        # One ReLU module each (torchvision shares one): torchao's X86InductorQuantizer
        # rejects a module partition with two outputs.
        self.relu1, self.relu2 = nn.ReLU(inplace=inplace), nn.ReLU(inplace=inplace)
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.down is None else self.down(x)
        if self.inplace:
            out += identity
        else:
            out = out + identity
        return self.relu2(out)


class ResNet(nn.Module):
    """A stem, a block with an identity shortcut, one with a 1x1 conv downsample (conv + conv), a classifier."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.Sequential(BasicBlock(8, 8, 1), BasicBlock(8, 16, 2))
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))
