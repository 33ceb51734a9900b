"""Folding the QAT conv-bn pattern: conv(x, fq(w * sf), 0) / sf + b -> bn
becomes conv(x, fq(w_fold), b_fold), equal to the unfolded graph within fp32
rounding; save / to_onnx fold by default."""

from __future__ import annotations

import pytest
import torch
import torchao.quantization.pt2e as tao
from tests.models.quantized import QAT_SHAPE, batch, fake_quant_nodes, qat_converted, qat_prepared
from tests.models.simple_quantizer import ConvBnReluLinear, LinearConvQuantizer
from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e

import pt2e_fq as q
from pt2e_fq.export import exported_program, fold_conv_bn

aten = torch.ops.aten


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _conv_weight_point(gm):
    conv = next(n for n in gm.graph.nodes if n.target == aten.conv2d.default)
    return conv, gm.get_submodule(conv.args[1].target)


def _points_after_conv(gm):
    """The fake-quant points downstream of the conv (its output chain)."""
    conv = next(n for n in gm.graph.nodes if n.target == aten.conv2d.default)
    seen, todo, found = set(), [conv], []
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in seen:
                seen.add(u)
                todo.append(u)
                if u.op == "call_module":
                    found.append(u.target)
    return found


@pytest.mark.parametrize("conv_bias", [True, False], ids=["conv-bias", "no-conv-bias"])
def test_folded_graph_equals_the_unfolded_one_within_fp32_rounding(conv_bias):
    unfolded = qat_prepared(conv_bias)
    bn = unfolded.get_submodule("bn")
    expected_weight = unfolded.get_parameter("conv.weight") * (
        bn.weight / torch.sqrt(bn.running_var + 1e-5)  # BatchNorm2d's default eps
    ).reshape(-1, 1, 1, 1)
    folded = qat_prepared(conv_bias)
    assert fold_conv_bn(folded) == 1

    assert aten.batch_norm.default not in _targets(folded)
    assert aten.div.Tensor not in _targets(folded) and aten.mul.Tensor not in _targets(folded)
    assert len(fake_quant_nodes(folded)) == len(fake_quant_nodes(unfolded))
    conv, weight_fq = _conv_weight_point(folded)
    assert conv.args[1].args[0].op == "get_attr"  # the point quantizes a folded parameter
    assert torch.equal(folded.get_parameter(conv.args[1].args[0].target), expected_weight)
    assert conv.args[2] is not None and conv.args[2].op == "get_attr"

    x = batch(20, QAT_SHAPE)
    with torch.no_grad():
        # All points on: one output step at most (an fp32 rounding difference may
        # flip a rounding decision at a later point).
        y_unfolded, y_folded = unfolded(x), folded(x)
        step = unfolded.get_submodule(fake_quant_nodes(unfolded)[-1].target).scale.max()
        assert (y_folded - y_unfolded).abs().max() <= step
        # Points after the conv off: the float path through the folded conv-bn.
        for gm in (unfolded, folded):
            for target in _points_after_conv(gm):
                gm.get_submodule(target).disable_fake_quant()
        torch.testing.assert_close(folded(x), unfolded(x), rtol=1e-5, atol=1e-6)


def test_folding_refuses_a_training_mode_batch_norm():
    gm = qat_prepared()
    tao.move_exported_model_to_train(gm)
    with pytest.raises(ValueError, match="move_exported_model_to_eval"):
        fold_conv_bn(gm)


def test_exporters_fold_by_default_and_leave_the_model_alone():
    model = qat_converted()
    x = batch(21, QAT_SHAPE)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    folded = exported_program(model, (x,))
    assert aten.batch_norm.default not in [n.target for n in folded.graph.nodes]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert aten.batch_norm.default in _targets(model)

    kept = exported_program(model, (x,), fold_bn=False)
    assert aten.batch_norm.default in [n.target for n in kept.graph.nodes]
    assert torch.equal(kept.module()(x), model(x))
    # An ExportedProgram is folded too (through its module), and stays as it was.
    refolded = exported_program(kept, (x,))
    assert aten.batch_norm.default not in [n.target for n in refolded.graph.nodes]
    assert aten.batch_norm.default in [n.target for n in kept.graph.nodes]
    torch.testing.assert_close(refolded.module()(x), folded.module()(x), rtol=0, atol=0)


# One weight spec per format kind (integer, scaled float, MX, NVFP4); the
# conv weight is 8 x 3 x 3 x 3, so the blocks run along its 3 input channels.
WEIGHT_OF_EVERY_KIND = {
    "int8": q.QSpec(q.INT8, q.PerChannel(0), observer=q.CurrentMinMaxObserver()),
    "fp8": q.QSpec(q.FP8_E4M3, q.PerChannel(0), observer=q.CurrentMinMaxObserver()),
    "mxfp8": q.QSpec(q.MXFP8_E4M3, q.PerGroup(32, 1), dynamic=True),
    "nvfp4": q.QSpec(q.NVFP4, q.PerGroup(16, 1), observer=q.CurrentMinMaxObserver()),
}


@pytest.mark.parametrize("weight", WEIGHT_OF_EVERY_KIND.values(), ids=WEIGHT_OF_EVERY_KIND.keys())
def test_an_exported_program_folds_under_every_weight_format(weight):
    """The conv weight's point is read off the op call whatever its format,
    so the pattern folds in an ExportedProgram (where points are op calls,
    not FakeQuantize modules) for float formats too."""
    torch.manual_seed(0)
    x = batch(0, QAT_SHAPE)
    activation = q.QSpec(q.INT8, observer=q.CurrentMinMaxObserver())
    gm = prepare_qat_pt2e(torch.export.export(ConvBnReluLinear().train(), (x,)).module(),
                          LinearConvQuantizer(activation, weight))
    gm(x)  # calibrates
    gm.apply(tao.disable_observer)
    tao.move_exported_model_to_eval(gm)
    # Points after the conv off: what remains differs from the unfolded graph by fp32 rounding only.
    for target in _points_after_conv(gm):
        gm.get_submodule(target).disable_fake_quant()
    program = torch.export.export(gm, (x,))
    assert aten.batch_norm.default in [n.target for n in program.graph.nodes]

    folded = exported_program(program, (x,))
    assert aten.batch_norm.default not in [n.target for n in folded.graph.nodes]
    y = batch(22, QAT_SHAPE)
    with torch.no_grad():
        torch.testing.assert_close(folded.module()(y), program.module()(y), rtol=1e-5, atol=1e-5)
