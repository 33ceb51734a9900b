"""Calibrated, converted test models for the export and report tests."""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn as nn
import torchao.quantization.pt2e as tao
from simple_quantizer import ConvBnReluLinear, ConvLinear, LinearConvQuantizer
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e, prepare_qat_pt2e

import pt2e_fq as q

QAT_SHAPE = (8, 3, 8, 8)


def batch(seed, shape=(2, 3, 6, 6)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def ptq(activation, weight, output=None, model=None, shape=(2, 3, 6, 6), dynamic_shapes=None, convert=True):
    """`model` (default ConvLinear) exported, prepared with LinearConvQuantizer,
    calibrated on 4 batches and converted."""
    torch.manual_seed(0)
    model = (model or ConvLinear()).eval()
    gm = torch.export.export(model, (batch(0, shape),), dynamic_shapes=dynamic_shapes).module()
    gm = prepare_pt2e(gm, LinearConvQuantizer(activation, weight, output))
    for s in range(1, 5):
        gm(batch(s, shape))
    return convert_pt2e(gm) if convert else gm


QAT_SPECS = (
    q.QSpec(q.INT8, scheme="asymmetric", observer=q.MovingAverageMinMaxObserver(0.1)),
    q.QSpec(q.INT8, q.PerChannel(0), "symmetric_narrow", observer=q.CurrentMinMaxObserver()),
)


class ConvBnNoBias(nn.Module):
    """conv (no bias) -> bn -> relu -> linear."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


@functools.lru_cache(maxsize=None)
def _qat_prepared(conv_bias: bool) -> torch.fx.GraphModule:
    torch.manual_seed(0)
    model = (ConvBnReluLinear() if conv_bias else ConvBnNoBias()).train()
    x = batch(0, QAT_SHAPE)
    gm = prepare_qat_pt2e(torch.export.export(model, (x,)).module(), LinearConvQuantizer(*QAT_SPECS))
    opt = torch.optim.SGD(gm.parameters(), lr=0.05)
    for s in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(gm(batch(s, QAT_SHAPE)), torch.arange(8) % 4).backward()
        opt.step()
    gm.apply(tao.disable_observer)
    tao.move_exported_model_to_eval(gm)
    return gm


def qat_prepared(conv_bias: bool = True) -> torch.fx.GraphModule:
    """A conv-bn-relu-linear model after prepare_qat_pt2e and 3 SGD steps,
    observers off, in eval mode (a fresh copy on every call)."""
    return copy.deepcopy(_qat_prepared(conv_bias))


@functools.lru_cache(maxsize=None)
def _qat_converted() -> torch.fx.GraphModule:
    # convert_pt2e takes ~30 s here: torchao's _fold_conv_bn_qat exports 96
    # q/dq patterns, none of which can match our fake-quant nodes.
    converted = convert_pt2e(qat_prepared())
    tao.move_exported_model_to_eval(converted)
    return converted


def qat_converted() -> torch.fx.GraphModule:
    """qat_prepared() through convert_pt2e, in eval mode (a fresh copy)."""
    return copy.deepcopy(_qat_converted())


def fake_quant_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_module" and "activation_post_process" in n.target]
