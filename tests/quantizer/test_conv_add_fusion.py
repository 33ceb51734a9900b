"""QuantizerConfig.fuse_conv_add: conv2d -> [bn] -> add -> [relu] quantized
as one unit (no point on the conv's output, the add's other input and its
output quantized), so that Inductor runs it as one qconv2d_pointwise.binary.

References: torchao's X86InductorQuantizer (where its points are around each
residual add of the same graph), Inductor's generated code, ONNX Runtime
(check_onnx) and the converted model itself (.pt2, to_qdq)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
from tests.models.quantized import batch
from tests.models.resnet import ResNet
from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

import pt2e_fq as q
from pt2e_fq.cli import pipeline
from pt2e_fq.export import check_lowered, check_onnx, compile_x86, to_onnx, to_qdq
from quantizers import ConfigError, FakeQuantQuantizer, QuantizerConfig, presets

SHAPE = (4, 3, 8, 8)


def _model():
    torch.manual_seed(0)
    model = ResNet().eval()
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return model


def _w8a8(fuse: bool, qat: bool = False) -> QuantizerConfig:
    # every_point: the presets leave adds float, so only a layout that
    # quantizes adds and conv outputs has a conv-add unit to fuse.
    return presets.every_point("w8a8", qat=qat).set_fuse_conv_add(fuse)


def _converted(fuse: bool, qat_steps: int = 0):
    """PTQ, or QAT (conv-bn fused by prepare_qat_pt2e, folded at export) for qat_steps steps."""
    batches = [(batch(s, SHAPE),) for s in range(4)]
    model = _model().train() if qat_steps else _model()
    config = _w8a8(fuse, qat=qat_steps > 0)
    return pipeline.quantize(model, batches[0], config, calibration=batches, qat_steps=qat_steps,
                             progress=False)


def _quantized_add_inputs(quantizer) -> list:
    """Per residual add of the PTQ-prepared graph: which of its operands is
    an observer's (a fake-quant module's) output, the conv's operand first."""
    gm = prepare_pt2e(torch.export.export(_model(), (batch(0, SHAPE),)).module(), quantizer)
    observed = lambda n: n.op == "call_module"  # noqa: E731
    adds = [n for n in gm.graph.nodes if n.target == torch.ops.aten.add.Tensor]
    assert len(adds) == 2
    return [sorted(observed(a) for a in add.args) for add in adds]


@pytest.mark.needs_torch("2.13", "torchao 0.18's X86InductorQuantizer annotates no linear or convolution of an exported graph on torch 2.11 (one observer on a Linear-ReLU-Linear), so there is no stock layout to compare with")
@pytest.mark.parametrize("fuse", [True, False])
def test_points_around_each_residual_add_are_torchaos_x86_inductor_quantizers(fuse):
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    stock = _quantized_add_inputs(X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config()))
    assert stock == [[False, True], [False, True]]  # the conv's output in float, the other operand quantized
    ours = _quantized_add_inputs(FakeQuantQuantizer(_w8a8(fuse)))
    assert (ours == stock) is fuse, ours


def test_the_plan_leaves_out_only_the_output_point_of_each_conv_into_an_add():
    gm = torch.export.export(_model(), (batch(0, SHAPE),)).module()
    fused, unfused = (FakeQuantQuantizer(_w8a8(f)).plan(gm) for f in (True, False))
    into = {op.node.name: op.fused_into.name for op in fused.ops if op.fused_into is not None}
    # conv2 of each block; the downsample conv of the second block keeps its point (one conv per add).
    assert into == {"conv2d_2": "add", "conv2d_4": "add_1"}
    outputs = lambda plan: {n.name for n, _, where, _ in plan.points() if where == "output"}  # noqa: E731
    assert outputs(unfused) - outputs(fused) == {"batch_norm_2", "batch_norm_4"}
    assert outputs(fused) <= outputs(unfused)
    assert fused.num_modules == unfused.num_modules - 2
    table = FakeQuantQuantizer(_w8a8(True)).describe(gm, print_table=False)
    assert "float: into add_1 (fuse_conv_add)" in table


class NotFusable(nn.Module):
    """conv -> relu -> add (an activation between); a conv read by the add
    and by another op; an add that broadcasts."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Conv2d(8, 8, 3, padding=1) for _ in range(3))
        self.d = nn.Conv2d(8, 1, 1)

    def forward(self, x):
        y = torch.relu(self.a(x)) + x
        z = self.b(y)
        y = z + y + z.mean()
        return self.d(y) + self.c(y)  # (N, 1, H, W) + (N, 8, H, W): a broadcast


def test_no_fusion_where_inductor_could_not_fuse():
    gm = torch.export.export(NotFusable().eval(), (torch.randn(2, 8, 6, 6),)).module()
    plan = FakeQuantQuantizer(_w8a8(True)).plan(gm)
    convs = [op for op in plan.ops if op.match.op_type == "conv2d"]
    assert [op.fused_into for op in convs] == [None] * 4
    assert all(plan.annotations[op.match.output].output is not None for op in convs)


def test_an_add_left_in_float_keeps_the_convs_output_point():
    gm = torch.export.export(_model(), (batch(0, SHAPE),)).module()
    plan = FakeQuantQuantizer(_w8a8(True).set_operator_type("add", None)).plan(gm)
    assert all(op.fused_into is None for op in plan.ops)
    unfused = FakeQuantQuantizer(_w8a8(False).set_operator_type("add", None)).plan(gm)
    assert plan.num_modules == unfused.num_modules


@pytest.mark.slow
@pytest.mark.parametrize("fuse, qat_steps", [(True, 0), (False, 0), (True, 3)])
def test_inductor_runs_each_conv_add_relu_as_one_qconv2d_binary_call(fuse, qat_steps):
    from torch._inductor.utils import run_and_get_code

    model = _converted(fuse, qat_steps)
    x = batch(5, SHAPE)
    compiled = compile_x86(to_qdq(model, x, target="x86_inductor"))
    out, code = run_and_get_code(compiled, x)
    kernels = re.findall(r"torch\.ops\.onednn\.(qconv\w*)\.(\w+)", "\n".join(code))
    # .binary_tensor: the dynamic batch's program passes the input's qparams as tensors.
    binary = [k for k in kernels if k[0] == "qconv2d_pointwise" and k[1].startswith("binary")]
    assert len(binary) == (2 if fuse else 0), kernels
    assert len(kernels) == 6, kernels  # every conv an int8 oneDNN call either way
    check = check_lowered(compiled, model, x)
    # oneDNN requantizes in its own arithmetic, and a one-step flip at an
    # inner point cascades (docs/export.md): on these inputs the outputs are
    # within 2 steps (PTQ unfused, with the presets' histogram ranges: 4 of
    # 16 outputs 1 or 2 steps off, 45 dB; 3 steps without the fusion after
    # QAT on batch(9)).
    assert check.outputs[0].max_steps <= 2 + 1e-3, str(check)


@pytest.mark.slow
def test_the_fused_model_exports_to_pt2_and_onnx_with_its_numerics(tmp_path):
    model = _converted(True)
    x = batch(7, SHAPE)
    q.save(model, (x,), tmp_path / "m.pt2")
    assert torch.equal(q.load(tmp_path / "m.pt2").module()(x), model(x))
    to_onnx(model, (x,), tmp_path / "m.onnx")
    check_onnx(tmp_path / "m.onnx", model, (x,))  # every point bit for bit, outputs within a step


def test_fuse_conv_add_round_trips_and_a_bad_value_is_named(tmp_path):
    config = _w8a8(True)
    assert config.to_dict()["fuse_conv_add"] is True and presets.get_preset("w8a8").fuse_conv_add is False
    config.save(tmp_path / "c.yaml")
    assert "fuse_conv_add: true" in (tmp_path / "c.yaml").read_text()
    assert QuantizerConfig.load(tmp_path / "c.yaml") == config
    with pytest.raises(ConfigError, match="fuse_conv_add: expected true or false, got str 'yes'"):
        QuantizerConfig.from_dict({**config.to_dict(), "fuse_conv_add": "yes"})
    with pytest.raises(TypeError, match="set_fuse_conv_add: fuse: expected true or false"):
        config.set_fuse_conv_add(1)
