"""QuantizerConfig.fuse_activations and presets.every_point(target=...):
which activations are quantized together with the op before them.

XNNPACK fuses only ReLU and clamps into an int8 conv or linear; a linear
followed by GELU runs in int8 only with a point on its own output. The
reference for where the points go is torchao's XNNPACKQuantizer on the same
graph (prepare_pt2e's observers); for what ExecuTorch makes of them,
tests/export/test_export_executorch.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from tests.models.quantized import batch
from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

from pt2e_fq.export import XNNPACK_FUSED_ACTIVATIONS
from quantizers import ConfigError, FakeQuantQuantizer, QuantizerConfig, presets
from quantizers.patterns import ACTIVATIONS

SHAPE = (4, 3, 8, 8)


class ConvReluLinearGelu(nn.Module):
    """conv -> relu, conv -> relu6, then linear -> gelu -> linear."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        x = nn.functional.relu6(self.conv2(torch.relu(self.conv1(x))))
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)
        return self.fc2(nn.functional.gelu(self.fc1(x)))


def _exported():
    torch.manual_seed(0)
    return torch.export.export(ConvReluLinearGelu().eval(), (batch(0, SHAPE),)).module()


def _observed_activation_inputs(quantizer) -> dict:
    """Per activation of the prepared graph (by op name): whether its input
    is an observer's output, i.e. the op before it has its own output point."""
    gm = prepare_pt2e(_exported(), quantizer)
    acts = [n for n in gm.graph.nodes if n.op == "call_function"
            and n.target in (torch.ops.aten.relu.default, torch.ops.aten.relu6.default, torch.ops.aten.gelu.default)]
    return {n.target.__name__.split(".")[0]: n.args[0].op == "call_module" for n in acts}


def test_xnnpack_points_around_activations_are_the_xnnpack_quantizers():
    from benchmarks.stock_flows import stock_quantizer

    stock = _observed_activation_inputs(stock_quantizer("XNNPACKQuantizer"))
    ours = _observed_activation_inputs(FakeQuantQuantizer(presets.every_point("w8a8", "xnnpack")))
    generic = _observed_activation_inputs(FakeQuantQuantizer(presets.every_point("w8a8")))
    # relu fused with conv1 by both; gelu after fc1's own output point. (The stock
    # quantizer leaves conv2 -> relu6 unfused: it fuses conv-relu only; XNNPACK's
    # partitioner fuses relu6, a hardtanh in its graph, too, and ours keeps it with the conv.)
    assert stock == {"relu": False, "relu6": True, "gelu": True}, stock
    assert ours == {"relu": False, "relu6": False, "gelu": True}, ours
    assert generic == {"relu": False, "relu6": False, "gelu": False}, generic


def test_the_plan_and_table_show_the_point_before_gelu():
    gm = _exported()
    plan = FakeQuantQuantizer(presets.every_point("w8a8", "xnnpack")).plan(gm)
    outputs = {n.name for n, _, where, _ in plan.points() if where == "output"}
    generic = {n.name for n, _, where, _ in FakeQuantQuantizer(presets.every_point("w8a8")).plan(gm).points()
               if where == "output"}
    assert "linear" in outputs and "gelu" not in outputs, outputs
    assert "gelu" in generic and "linear" not in generic, generic
    assert {"relu", "relu6"} <= outputs & generic  # the clamps stay fused
    table = FakeQuantQuantizer(presets.every_point("w8a8")).describe(gm, print_table=False)
    assert "(after gelu)" in table
    table = FakeQuantQuantizer(presets.every_point("w8a8", "xnnpack")).describe(gm, print_table=False)
    assert "(after gelu)" not in table and "(after relu)" in table


def test_an_empty_list_puts_every_output_point_right_after_its_op():
    gm = _exported()
    plan = FakeQuantQuantizer(presets.every_point("w8a8").set_fuse_activations([])).plan(gm)
    outputs = {n.name for n, _, where, _ in plan.points() if where == "output"}
    assert {"conv2d", "conv2d_1", "linear"} <= outputs and not outputs & {"relu", "relu6", "gelu"}, outputs


def test_every_point_targets():
    assert presets.every_point("w8a8").fuse_activations == tuple(ACTIVATIONS)
    xnn = presets.every_point("w8a8", target="xnnpack")
    assert xnn.fuse_activations == XNNPACK_FUSED_ACTIVATIONS == ("relu", "relu6", "hardtanh")
    assert not xnn.fuse_conv_add
    x86 = presets.every_point("w8a8", target="x86_inductor")
    assert x86.fuse_conv_add and x86.fuse_activations == tuple(ACTIVATIONS)
    assert x86.operator_type["matmul"] is None and x86.operator_type["bmm"] is None
    # Everything else is every_point's.
    strip = lambda c: {k: v for k, v in c.to_dict().items() if k not in ("fuse_activations", "fuse_conv_add")}  # noqa: E731
    assert strip(xnn) == strip(presets.every_point("w8a8"))
    generic = strip(presets.every_point("w8a8"))
    generic["operator_type"].update(matmul=None, bmm=None)
    assert strip(x86) == generic
    with pytest.raises(ValueError, match="every_point: unknown target 'onnx'; allowed: generic, xnnpack, x86_inductor"):
        presets.every_point("w8a8", target="onnx")


def test_get_preset_targets():
    x86, preset = presets.get_preset("w8a8", "x86_inductor").to_dict(), presets.get_preset("w8a8").to_dict()
    assert x86["operator_type"].pop("matmul") is None and x86["operator_type"].pop("bmm") is None
    assert x86 == preset  # matmul and bmm take the global config in the preset
    assert "matmul" not in preset["operator_type"] and presets.get_preset("w8a8", "generic").to_dict() == preset
    with pytest.raises(ValueError, match=r"use presets.every_point\('w8a8', target='xnnpack'\)"):
        presets.get_preset("w8a8", "xnnpack")
    with pytest.raises(ValueError, match="get_preset: unknown target 'tpu'"):
        presets.get_preset("w8a8", "tpu")


def test_fuse_activations_round_trips_and_bad_values_are_named(tmp_path):
    config = presets.every_point("w8a8", "xnnpack")
    config.save(tmp_path / "c.yaml")
    assert "fuse_activations:\n- relu\n- relu6\n- hardtanh\n" in (tmp_path / "c.yaml").read_text()
    assert QuantizerConfig.load(tmp_path / "c.yaml") == config
    # A config written before the key existed fuses every activation, as then.
    old = {k: v for k, v in config.to_dict().items() if k != "fuse_activations"}
    assert QuantizerConfig.from_dict(old).fuse_activations == tuple(ACTIVATIONS)
    # Order and repeats do not matter.
    assert QuantizerConfig().set_fuse_activations(["gelu", "relu", "gelu"]).fuse_activations == ("relu", "gelu")
    with pytest.raises(ConfigError, match="fuse_activations: unknown activation 'swish'; allowed: relu, relu6"):
        QuantizerConfig.from_dict({**config.to_dict(), "fuse_activations": ["relu", "swish"]})
    with pytest.raises(ConfigError, match="fuse_activations: expected a list of activation names, got str 'relu'"):
        QuantizerConfig.from_dict({**config.to_dict(), "fuse_activations": "relu"})
    with pytest.raises(TypeError, match="set_fuse_activations: names: expected a list of activation names"):
        config.set_fuse_activations(None)
