"""Models and steps shared by the stock-flow tests: a torchvision-style
conv-bn CNN and an attention block, both with batch norms whose eps (1e-3)
and momentum (0.01) differ from torchao's pattern defaults (1e-5, 0.1) and
whose running variances are of the order of eps, so a wrong eps shows
(a factor of ~1.4 in a channel's scale)."""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e, prepare_qat_pt2e

from quantizers import FakeQuantQuantizer, presets

EPS, MOMENTUM = 1e-3, 0.01


def _small_statistics(bn: nn.BatchNorm2d) -> None:
    bn.running_var.uniform_(5e-4, 2e-3)
    bn.running_mean.uniform_(-0.1, 0.1)


class ConvBnCnn(nn.Module):
    """conv-bn-relu twice, then a linear head (MobileNet / EfficientNet's batch norm settings)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8, eps=EPS, momentum=MOMENTUM)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8, eps=EPS, momentum=MOMENTUM)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


class AttentionBlock(nn.Module):
    """conv-bn, then attention over the pixels with SDPA's dropout_p 0.1 in
    training (Hugging Face's attention modules pass it so) and a dropout."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8, eps=EPS, momentum=MOMENTUM)
        self.qkv = nn.Linear(8, 24)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        t = F.relu(self.bn(self.conv(x))).flatten(2).transpose(1, 2)
        q, k, v = self.qkv(t).chunk(3, dim=-1)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0)
        return self.head(self.drop(a.mean(1)))


MODELS = {"conv_bn_cnn": ConvBnCnn, "attention_block": AttentionBlock}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[name]()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            _small_statistics(m)
    return model


def batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, 6, 6, generator=g) for _ in range(n)]


def quantizer() -> FakeQuantQuantizer:
    return FakeQuantQuantizer(presets.get_preset("w8a8"))


def stock_qat(model: nn.Module) -> torch.fx.GraphModule:
    """torchao's stock QAT prepare of a train-mode export; the model's own mode is kept."""
    was_training = model.training
    gm = torch.export.export(model.train(), (batches(1)[0],)).module()
    model.train(was_training)
    return prepare_qat_pt2e(gm, quantizer())


@functools.lru_cache(maxsize=None)
def _stock_qat_of(name: str) -> torch.fx.GraphModule:
    return stock_qat(build(name))


def qat_prepared(name: str) -> torch.fx.GraphModule:
    """A copy of stock_qat(build(name)), prepared once per process
    (prepare_qat_pt2e's conv-bn fusion traces its patterns: seconds)."""
    return copy.deepcopy(_stock_qat_of(name))


def stock_ptq(model: nn.Module) -> torch.fx.GraphModule:
    gm = torch.export.export(model.eval(), (batches(1)[0],)).module()
    return prepare_pt2e(gm, quantizer())


def calibrate(prepared: torch.fx.GraphModule, data) -> None:
    with torch.no_grad():
        for x in data:
            prepared(x)


def batch_norm_literals(gm: torch.fx.GraphModule) -> list[tuple[float, float]]:
    """(momentum, eps) of every aten.batch_norm node."""
    return [(n.args[6], n.args[7]) for n in gm.graph.nodes if n.target is torch.ops.aten.batch_norm.default]
