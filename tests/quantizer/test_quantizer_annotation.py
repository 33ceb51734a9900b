"""FakeQuantQuantizer: which tensors get which QSpec, how many fake-quant
modules prepare creates, sharing, overrides, describe() and validate()."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
from tests.models.quantizer import (  # noqa: F401 (single_thread: an autouse fixture)
    build, example_batch, export, fake_quant_modules, prepare, single_thread)
from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e
from torchao.quantization.pt2e.quantizer import QuantizationSpec, SharedQuantizationSpec

import pt2e_fq as q
from quantizers import FakeQuantQuantizer, OpConfig, UnsupportedQuantizationError, presets
from quantizers.presets import every_point

CMM = q.CurrentMinMaxObserver()
INT8_ACT = q.QSpec(q.INT8, q.PerTensor(), "asymmetric", observer=q.HistogramObserver())  # the presets calibrate with it
# (activation, weight) of each preset, written from the preset table of the issue.
PRESET_SPECS = {
    "w8a8": (INT8_ACT, q.QSpec(q.INT8, q.PerChannel(0), "symmetric_narrow", observer=CMM)),
    "w4a8": (INT8_ACT, q.QSpec(q.INT4, q.PerGroup(32, 1), "symmetric_no_clip", observer=CMM)),
    "w4a16": (None, q.QSpec(q.INT4, q.PerGroup(32, 1), "asymmetric", "minval", observer=CMM)),
    "w8a16": (None, q.QSpec(q.INT8, q.PerGroup(128, 1), "symmetric_narrow", observer=CMM)),
    "fp8": (q.QSpec(q.FP8_E4M3, q.PerTensor(), dynamic=True), q.QSpec(q.FP8_E4M3, q.PerChannel(0), observer=CMM)),
    "mxfp8": (q.QSpec(q.MXFP8_E4M3, q.PerGroup(32, -1), dynamic=True), q.QSpec(q.MXFP8_E4M3, q.PerGroup(32, 1), dynamic=True)),
    "mxfp4": (q.QSpec(q.MXFP4, q.PerGroup(32, -1), dynamic=True), q.QSpec(q.MXFP4, q.PerGroup(32, 1), dynamic=True)),
    "nvfp4": (q.QSpec(q.NVFP4, q.PerGroup(16, -1)), q.QSpec(q.NVFP4, q.PerGroup(16, 1), observer=CMM)),
}


def _spec_text(spec):
    if isinstance(spec, SharedQuantizationSpec):
        where = spec.edge_or_node
        return "shared:" + (where.name if isinstance(where, torch.fx.Node) else f"{where[0].name}->{where[1].name}")
    assert isinstance(spec, QuantizationSpec)
    return spec.observer_or_fake_quant_ctr.p.keywords["qspec"]


def annotated(gm) -> dict:
    """{(tensor, consumer or "out"): QSpec or "shared:<edge or node>"} as written on the graph."""
    points = {}
    for node in gm.graph.nodes:
        ann = node.meta.get("quantization_annotation")
        if ann is None:
            continue
        for arg, spec in ann.input_qspec_map.items():
            if spec is not None:
                points[(arg.name, node.name)] = _spec_text(spec)
        if ann.output_qspec is not None:
            points[(node.name, "out")] = _spec_text(ann.output_qspec)
    return points


def prepared_points(gm) -> list[tuple[str, q.QSpec]]:
    """(the tensor it quantizes, its QSpec) for every distinct fake-quant module of a prepared graph."""
    seen, points = set(), []
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(m := gm.get_submodule(node.target), q.FakeQuantize):
            if id(m) not in seen:
                seen.add(id(m))
                points.append((node.args[0].name, m.qspec))
    return sorted(points, key=str)


def _annotate(config, name="mlp", train=False):
    gm = export(build(name, train), example_batch(name, 0))
    return FakeQuantQuantizer(config).annotate(gm)


def _mlp_expected(act, weight):
    """MLP: fc1 -> relu -> fc2 -> gelu -> head. A preset quantizes the input
    and weight of each linear and no output (quantizers.presets): the relu
    and gelu outputs as fc2's and head's inputs, the logits not at all."""
    expected = {("fc1_weight", "linear"): weight, ("fc2_weight", "linear_1"): weight,
                ("head_weight", "linear_2"): weight}
    if act is not None:
        expected.update({("x", "linear"): act, ("relu", "linear_1"): act, ("gelu", "linear_2"): act})
    return expected


@pytest.mark.parametrize("preset", list(PRESET_SPECS))
def test_mlp_points_of_every_preset(preset):
    expected = _mlp_expected(*PRESET_SPECS[preset])
    assert annotated(_annotate(presets.get_preset(preset))) == expected
    gm = prepare(build("mlp"), example_batch("mlp", 0), FakeQuantQuantizer(presets.get_preset(preset)))
    assert prepared_points(gm) == sorted(((t, s) for (t, _), s in expected.items()), key=str)


def test_module_name_regex_override_and_none_skip():
    act, w8 = PRESET_SPECS["w8a8"]
    w4 = PRESET_SPECS["w4a16"][1]
    regex = every_point("w8a8").set_module_name(re.compile(r"fc\d"), OpConfig(weight=w4))
    # fc1, fc2 weight-only int4; head keeps the global config and quantizes its own input.
    expected = {("fc1_weight", "linear"): w4, ("fc2_weight", "linear_1"): w4, ("gelu", "linear_2"): act,
                ("head_weight", "linear_2"): w8, ("linear_2", "out"): act}
    skip = every_point("w8a8").set_module_name("head", None)
    # head stays float; the gelu output is still fc2's output point.
    expected_skip = {("x", "linear"): act, ("fc1_weight", "linear"): w8, ("relu", "out"): act,
                     ("fc2_weight", "linear_1"): w8, ("gelu", "out"): act}
    for config, points in ((regex, expected), (skip, expected_skip)):
        assert annotated(_annotate(config)) == points
        gm = prepare(build("mlp"), example_batch("mlp", 0), FakeQuantQuantizer(config))
        assert len(fake_quant_modules(gm)) == len(points)


# Distinct fake-quant modules of the presets, counted by hand from each
# model's graph (inputs and weights of computing ops only, quantizers.presets):
# cnn: x, conv1 w, the relu into conv2, conv2 w, fc's input (the pooled,
#   flattened float sum), fc w = 6; the residual add and the pool stay float.
# encoder: ln1 output (one module for q, k, v), 3 weights, matmul's q and k,
#   matmul_1's softmax and v inputs, out's input and weight, ln2 into fc1,
#   fc1 w, the gelu into fc2, fc2 w = 14; the residual adds stay float.
# embedding: the head's input and weight = 2; the table only under the
#   weight-only presets (its weight and the head's = 2).
# Weight-only presets: one per weight.
COUNTS = {
    "cnn": {"w8a8": 6, "w4a8": 6, "w4a16": 3, "w8a16": 3, "fp8": 6, "mxfp8": 6, "mxfp4": 6, "nvfp4": 6},
    "encoder": {"w8a8": 14, "w4a8": 14, "w4a16": 6, "w8a16": 6, "fp8": 14, "mxfp8": 14, "mxfp4": 14, "nvfp4": 14},
    "embedding": {"w8a8": 2, "w4a8": 2, "w4a16": 2, "w8a16": 2, "fp8": 2, "mxfp8": 2, "mxfp4": 2, "nvfp4": 2},
}


@pytest.mark.parametrize("name", list(COUNTS))
def test_fake_quant_module_counts(name):
    for preset, count in COUNTS[name].items():
        own = [s for s in annotated(_annotate(presets.get_preset(preset), name)).values() if isinstance(s, q.QSpec)]
        assert len(own) == count, preset
        for qat in (False, True) if name != "cnn" or preset == "w8a8" else (False,):
            model = build(name, train=qat)
            gm = prepare(model, example_batch(name, 0), FakeQuantQuantizer(presets.get_preset(preset)), qat=qat)
            assert len(fake_quant_modules(gm)) == count, (preset, qat)


def test_qat_conv_bn_relu_is_quantized_after_the_relu_and_the_bn():
    gm = prepare(build("cnn", train=True), example_batch("cnn", 0), FakeQuantQuantizer(every_point("w8a8")), qat=True)
    quantized = sorted(str(n.args[0].target) for n in gm.graph.nodes
                       if n.op == "call_module" and isinstance(gm.get_submodule(n.target), q.FakeQuantize))
    aten = torch.ops.aten
    # never a conv output nor the add before the relu; bn2's output feeds the add directly
    assert quantized.count(str(aten.relu.default)) == 2
    assert quantized.count(str(aten.batch_norm.default)) == 1
    assert str(aten.conv2d.default) not in quantized and str(aten.add.Tensor) not in quantized


def test_an_override_that_torchao_would_merge_keeps_its_own_module():
    """fc2's input spec differs from the relu output's only in its observer;
    torchao's implicit sharing would drop it (docs/fake_quantize.md, trap 1)."""
    act, w8 = PRESET_SPECS["w8a8"]
    mse_act = q.QSpec(q.INT8, q.PerTensor(), "asymmetric", observer=q.MSEObserver(8))
    config = every_point("w8a8").set_module_name("fc2", OpConfig(mse_act, w8, None, act))
    gm = prepare(build("mlp"), example_batch("mlp", 0), FakeQuantQuantizer(config))
    points = prepared_points(gm)
    assert ("relu", act) in points
    assert len(points) == 8  # the 7 of w8a8 and fc2's own input
    relu_fq = next(n for n in gm.graph.nodes if n.op == "call_module" and n.args[0].name == "relu")
    (requant,) = relu_fq.users
    assert gm.get_submodule(requant.target).qspec == mse_act  # in series: relu -> MinMax -> MSE -> fc2


class CatModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(16, 4)
        with torch.no_grad():
            self.b.weight.mul_(10)  # b's outputs span a 10x wider range than a's

    def forward(self, x):
        return self.head(torch.cat([self.a(x), self.b(x)], dim=-1))


def test_cat_inputs_share_one_module_and_the_average_pool_shares_its_input():
    model, x = CatModel().eval(), torch.randn(16, 8)
    gm = prepare(model, x, FakeQuantQuantizer(every_point("w8a8")))
    gm(x)
    cat = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.cat.default)
    first, second = (gm.get_submodule(a.target) for a in cat.args[0])
    assert first is second  # b's output is requantized with a's module
    assert len(fake_quant_modules(gm)) == 7  # x, 3 weights, a and b outputs, head output
    with torch.no_grad():
        assert float(first.max_val) == pytest.approx(float(torch.cat([model.a(x), model.b(x)], -1).max()), rel=0.02)

    cnn = prepare(build("cnn"), example_batch("cnn", 0), FakeQuantQuantizer(every_point("w8a8")))
    pool = next(n for n in cnn.graph.nodes if n.target == torch.ops.aten.adaptive_avg_pool2d.default)
    (after_pool,) = pool.users
    before_pool = pool.args[0]
    assert cnn.get_submodule(after_pool.target) is cnn.get_submodule(before_pool.target)


def test_conv_transpose_weights_are_quantized_per_output_channel():
    model = nn.Sequential(nn.ConvTranspose2d(4, 6, 3), nn.ReLU()).eval()
    x = torch.randn(2, 4, 5, 5)
    gm = prepare(model, x, FakeQuantQuantizer(every_point("w8a8")))
    gm(x)
    (weight_fq,) = [m for m in fake_quant_modules(gm) if isinstance(m.qspec.granularity, q.PerChannel)]
    assert model[0].weight.shape == (4, 6, 3, 3)  # (in, out, kh, kw)
    assert weight_fq.scale.shape == (1, 6, 1, 1)
    amax = model[0].weight.detach().abs().amax(dim=(0, 2, 3))
    torch.testing.assert_close(weight_fq.scale.flatten(), amax / 127)


def test_describe_lists_every_op_its_rule_and_its_points():
    config = every_point("w8a8").set_module_name("head", None)
    gm = export(build("mlp"), example_batch("mlp", 0))
    table = FakeQuantQuantizer(config).describe(gm, print_table=False)
    lines = table.splitlines()
    row = {line.split()[0]: line for line in lines[2:-2]}
    assert set(row) == {"linear", "linear_1", "linear_2"}
    assert "fc1" in row["linear"] and "global" in row["linear"] and "(after relu)" in row["linear"]
    assert "(already at relu)" in row["linear_1"] and "(after gelu)" in row["linear_1"]
    assert "module name 'head'" in row["linear_2"] and row["linear_2"].count("float") == 4
    assert lines[-2:] == ["5 fake-quant module(s)",
                          "model outputs: quantized where an op config gives them an output point (model_output: true)"]
    assert "quantization_annotation" not in {k for n in gm.graph.nodes for k in n.meta}  # describe changes nothing
    ep = torch.export.export(build("mlp"), (example_batch("mlp", 0),))
    assert FakeQuantQuantizer(config).describe(ep, print_table=False) == table


def test_validate_names_node_module_and_reason():
    model = build("mlp").double()
    with pytest.raises(UnsupportedQuantizationError) as err:
        prepare(model, example_batch("mlp", 0).double(), FakeQuantQuantizer(every_point("w8a8")))
    text = str(err.value)
    assert "7 fake-quant point(s) cannot run" in text
    assert ("input 'fc1_weight' of node 'linear' (aten.linear.default) in module 'fc1' (Linear): the tensor is "
            "torch.float64; fake quantization takes float32, bfloat16, float16") in text

    blocked = q.QSpec(q.INT8, q.PerBlock((1, 4, 4)))  # 3 entries for a 2-D weight
    config = every_point("w8a8").set_module_name("head", OpConfig(weight=blocked))
    with pytest.raises(UnsupportedQuantizationError) as err:
        prepare(build("mlp"), example_batch("mlp", 0), FakeQuantQuantizer(config))
    text = str(err.value)
    assert "1 fake-quant point(s)" in text
    assert "input 'head_weight' of node 'linear_2' (aten.linear.default) in module 'head' (Linear):" in text
    assert "block has 3 entries but the tensor has 2 dimensions" in text


@pytest.mark.parametrize(
    "activation",
    [nn.ReLU(), nn.ReLU(inplace=True), nn.ReLU6(), nn.Hardtanh(-2, 2), nn.GELU(), nn.SiLU(), nn.Hardswish(),
     nn.Sigmoid(), nn.Tanh(), nn.LeakyReLU(), nn.ELU()],
    ids=lambda m: type(m).__name__ + ("_" if getattr(m, "inplace", False) else ""),
)
def test_an_activation_after_linear_or_conv_is_quantized_after_it(activation):
    act = PRESET_SPECS["w8a8"][0]
    for layer, x in ((nn.Linear(8, 8), torch.randn(4, 8)), (nn.Conv2d(3, 4, 3), torch.randn(2, 3, 6, 6))):
        gm = FakeQuantQuantizer(every_point("w8a8")).annotate(export(nn.Sequential(layer, activation).eval(), x))
        outputs = {t: s for (t, where), s in annotated(gm).items() if where == "out"}
        (activation_node,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.args[0].op == "call_function"]
        assert outputs == {activation_node.name: act}


class StackModel(CatModel):
    def forward(self, x):
        return self.head(torch.stack([self.a(x), self.b(x)], dim=1).flatten(1))


def test_stack_inputs_share_one_module():
    gm = prepare(StackModel().eval(), torch.randn(16, 8), FakeQuantQuantizer(every_point("w8a8")))
    stack = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.stack.default)
    first, second = (gm.get_submodule(a.target) for a in stack.args[0])
    assert first is second
    assert len(fake_quant_modules(gm)) == 7


def test_validate_refuses_a_shared_module_whose_qparams_change_shape():
    class Uneven(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x):
            return torch.cat([self.a(x), self.b(x)], dim=-1)

    per_channel = q.QSpec(q.INT8, q.PerChannel(1), "asymmetric")
    config = every_point("w8a8").set_operator_type("cat", OpConfig(input_activation=per_channel))
    with pytest.raises(UnsupportedQuantizationError) as err:
        prepare(Uneven().eval(), torch.randn(16, 8), FakeQuantQuantizer(config))
    assert ("input 'linear_1' of node 'cat' (aten.cat.default) in module '' (Uneven): it shares the "
            "fake-quant module of linear->cat, whose qparams have shape (1, 8), but") in str(err.value)


def test_config_entries_that_match_no_op_are_named_by_describe_and_annotate():
    model, x = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval(), torch.randn(4, 16)
    config = presets.get_preset("w8a8")
    config.set_module_name("head", None)  # no such module
    config.set_module_name("2 ", None)  # "2" with a trailing space
    config.set_module_name("2", None)  # used: the last linear
    config.set_module_name(re.compile(r"blocks\..*"), None)
    config.set_module_type(nn.Conv2d, None)
    config.set_operator_type("conv2d", None)  # op-type entries are policy: not named
    config.set_module_name_operator_type("0", "add", None)  # module "0" has a linear, no add
    config.set_module_name_operator_type("0", "linear", None)  # used
    expected = ("5 config entries matched no op of this model: module_name['head'], module_name['2 '], "
                "module_name_regex['blocks\\\\..*'], module_type['torch.nn.Conv2d'], "
                "module_name_operator_type['0: add']")
    gm = torch.export.export(model, (x,)).module()
    assert "warning: " + expected in FakeQuantQuantizer(config).describe(gm, print_table=False)
    with pytest.warns(UserWarning, match=re.escape(expected)):
        prepare_pt2e(gm, FakeQuantQuantizer(config))
