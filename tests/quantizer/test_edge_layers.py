"""presets.int8_edges: on a small CNN, the first conv, the depthwise conv
and the classifier get 8-bit points (int8 weights for the integer
presets, FP8 E4M3 weights and activations for nvfp4) and the pointwise
conv keeps the preset's 4-bit format, read from the prepared graph's
points; a model without convolutions is left as it is."""

import pytest
import torch
from torch import nn

from pt2e_fq import FP8_E4M3, INT4, INT8, NVFP4
from pt2e_fq.calib.layers import find_layers
from pt2e_fq.cli import pipeline
from quantizers import presets


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.depthwise = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.pointwise = nn.Conv2d(32, 32, 1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = torch.relu(self.depthwise(torch.relu(self.stem(x))))
        return self.fc(self.pointwise(x).mean((2, 3)))


def _formats(preset):
    """{layer: (weight format, input activation format or None)} of the prepared graph."""
    model = _Net().eval()
    config = presets.int8_edges(presets.get_preset(preset), model)
    prepared = pipeline.prepare(model, torch.randn(2, 3, 8, 8), config)
    out = {}
    for layer in find_layers(prepared):
        source = layer.node.args[0]
        act = prepared.get_submodule(source.target).qspec.format if source.op == "call_module" else None
        out[layer.weight_name.split(".")[0]] = (layer.point.qspec.format, act)
    return out


@pytest.mark.parametrize("preset, edge, middle", [
    ("w4a8", (INT8, INT8), (INT4, INT8)),
    ("w4a16", (INT8, None), (INT4, None)),
    ("nvfp4", (FP8_E4M3, FP8_E4M3), (NVFP4, NVFP4)),
])
def test_edges_are_8_bit_and_the_rest_keeps_the_preset(preset, edge, middle):
    formats = _formats(preset)
    assert formats == {"stem": edge, "depthwise": edge, "pointwise": middle, "fc": edge}


def test_a_model_without_convolutions_is_left_as_it_is():
    config = presets.get_preset("w4a8")
    assert presets.int8_edges(config, nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))).to_dict() == \
        presets.get_preset("w4a8").to_dict()
    assert not presets.is_convolutional(nn.Linear(4, 4))
    assert presets.is_convolutional(_Net())
