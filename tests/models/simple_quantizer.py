"""A small hand-written torchao Quantizer for the tests, and the test models.

It annotates the activation input, the weight and the output of every
aten.linear and aten.conv2d node; when a conv feeds a batch_norm (and a relu),
the output annotation goes on the end of that chain, as torchao's own
annotators do, so prepare_qat_pt2e can fuse conv-bn.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, Quantizer

from pt2e_fq import QSpec

aten = torch.ops.aten
_WEIGHTED = (aten.linear.default, aten.conv2d.default)
_CHAIN = (aten.batch_norm.default, aten.relu.default, aten.relu_.default)


def _output_end(node: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """The last node of a node -> [batch_norm] -> [relu] chain of single users,
    and the nodes in between."""
    inner = []
    while len(node.users) == 1:
        (user,) = node.users
        if user.op != "call_function" or user.target not in _CHAIN:
            break
        inner.append(node)
        node = user
    return node, inner


class LinearConvQuantizer(Quantizer):
    def __init__(self, activation: QSpec, weight: QSpec, output: Optional[QSpec] = None):
        super().__init__()
        self.activation = activation.to_quantization_spec()
        self.weight = weight.to_quantization_spec()
        self.output = (output or activation).to_quantization_spec()

    def annotate(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
        for node in model.graph.nodes:
            if node.op != "call_function" or node.target not in _WEIGHTED:
                continue
            end, inner = _output_end(node)
            node.meta["quantization_annotation"] = QuantizationAnnotation(
                input_qspec_map={node.args[0]: self.activation, node.args[1]: self.weight},
                output_qspec=self.output if end is node else None,
                _annotated=True,
            )
            for n in inner[1:]:
                n.meta["quantization_annotation"] = QuantizationAnnotation(_annotated=True)
            if end is not node:
                end.meta["quantization_annotation"] = QuantizationAnnotation(
                    output_qspec=self.output, _annotated=True
                )
        return model

    def validate(self, model: torch.fx.GraphModule) -> None:
        pass


class ConvLinear(nn.Module):
    """conv -> relu -> linear (PTQ flow)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


class ConvBnReluLinear(nn.Module):
    """conv -> bn -> relu -> linear (QAT flow)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))
