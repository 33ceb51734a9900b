"""In-place ops and no-op casts: a model written with in-place
ops (torchvision's `out += identity` and `ReLU(inplace=True)`, MobileNetV3's
`Hardswish(inplace=True)`) is quantized exactly as its out-of-place twin,
and HF RMSNorm's casts to the dtype a tensor already has add no point.

The reference of each test is the same model written out of place, without
the casts: same weights, same calibration, so the converted models must
agree bit for bit and have the same number of fake-quant modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from tests.models.resnet import BasicBlock
from tests.models.quantizer import fake_quant_modules, prepare, single_thread, sqnr_db  # noqa: F401 (an autouse fixture)
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

from quantizers import FakeQuantQuantizer
from quantizers.presets import every_point

aten = torch.ops.aten


def _converted(model, batches, preset="w8a8"):
    gm = prepare(model, batches[0], FakeQuantQuantizer(every_point(preset)))
    with torch.no_grad():
        for b in batches:
            gm(b)
    return gm, convert_pt2e(gm)


def _twins(make, batches, preset="w8a8"):
    """(prepared, converted) of make(True) and of make(False) with the same weights."""
    torch.manual_seed(0)
    inplace = make(True).eval()
    twin = make(False).eval()
    twin.load_state_dict(inplace.state_dict())
    return _converted(inplace, batches, preset), _converted(twin, batches, preset)


def _targets(gm) -> set:
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


def _batches(*shape, n=3):
    g = torch.Generator().manual_seed(len(shape) + n)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def test_a_residual_add_in_place_gets_the_add_config_and_its_output_point():
    batches = _batches(2, 4, 6, 6)
    (prepared, converted), (twin_prepared, twin_converted) = _twins(lambda inplace: BasicBlock(4, 4, inplace=inplace), batches)
    assert {aten.add_.Tensor, aten.relu_.default} <= _targets(prepared)  # the in-place ops are really there
    # x, conv1 weight, conv1-bn1-relu, conv2 weight, conv2-bn2, the add's output after the relu:
    # 6 modules; the add's inputs are already quantized (bn2's output point and x).
    assert len(fake_quant_modules(prepared)) == len(fake_quant_modules(twin_prepared)) == 6
    add = next(n for n in prepared.graph.nodes if n.target == aten.add_.Tensor)
    (relu,) = add.users
    assert relu.target == aten.relu_.default and next(iter(relu.users)).op == "call_module"
    x = _batches(2, 4, 6, 6, n=1)[0]
    torch.testing.assert_close(converted(x), twin_converted(x), rtol=0, atol=0)


class ConvAct(nn.Module):
    def __init__(self, activation: type, inplace: bool):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.act = activation(inplace=inplace)
        self.fc = nn.Linear(4, 4)
        self.fc_act = activation(inplace=inplace)

    def forward(self, x):
        h = self.act(self.bn(self.conv(x))).mean((2, 3))
        return self.fc_act(self.fc(h))


@pytest.mark.parametrize("activation", [nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.SiLU, nn.Hardswish, nn.LeakyReLU, nn.ELU],
                         ids=lambda a: a.__name__)
def test_an_in_place_activation_fuses_with_the_conv_or_linear_before_it(activation):
    batches = _batches(2, 3, 6, 6)
    (prepared, converted), (twin_prepared, twin_converted) = _twins(lambda i: ConvAct(activation, i), batches)
    assert any(str(t).split(".")[-2].endswith("_") for t in _targets(prepared))  # an in-place activation is there
    # x, conv weight, the conv-bn-act output, the mean (fc's input), fc weight,
    # the fc-act output: the conv's and the linear's outputs get no point of their own.
    assert len(fake_quant_modules(prepared)) == len(fake_quant_modules(twin_prepared)) == 6
    x = _batches(2, 3, 6, 6, n=1)[0]
    torch.testing.assert_close(converted(x), twin_converted(x), rtol=0, atol=0)


class RMSNormMLP(nn.Module):
    """linear -> HF LlamaRMSNorm (casts to float32 and back) -> mul by a
    gate -> linear; the twin is the same norm without the casts."""

    def __init__(self, with_casts: bool):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.up, self.gate, self.down = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        self.norm = LlamaRMSNorm(16)
        self.with_casts = with_casts

    def forward(self, x):
        h = self.up(x)
        if self.with_casts:
            h = self.norm(h)
        else:
            h = self.norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.norm.variance_epsilon))
        return self.down(h * self.gate(x))


def test_a_cast_to_the_same_dtype_is_a_pass_through():
    batches = _batches(4, 8)
    (prepared, converted), (twin_prepared, twin_converted) = _twins(RMSNormMLP, batches)
    assert aten.to.dtype in _targets(prepared)
    assert len(fake_quant_modules(prepared)) == len(fake_quant_modules(twin_prepared))
    x = _batches(4, 8, n=1)[0]
    torch.testing.assert_close(converted(x), twin_converted(x), rtol=0, atol=0)


class MutatedAfterRead(nn.Module):
    """`v` is a view of `h` taken before `h += fc2(x)`: it sees the sum."""

    def __init__(self):
        super().__init__()
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x):
        h = x * 2.0
        v = h.view(-1, 2, 4)
        h += self.fc2(x)
        return v


def test_an_in_place_add_whose_input_is_read_later_stays_in_float():
    """A fake-quant point on the mutated edge would take the mutation, and
    the view would return 2x without fc2's output."""
    torch.manual_seed(0)
    model = MutatedAfterRead().eval()
    batches = _batches(4, 8)
    _, converted = _converted(model, batches)
    x = _batches(4, 8, n=1)[0]
    with torch.no_grad():
        expected, got = model(x), converted(x)
    assert sqnr_db(expected, got) > 30  # fc2's weight and input are quantized, the sum is not lost


class DropoutMLP(nn.Module):
    """linear -> relu -> dropout -> linear (BERT's dense -> dropout shape);
    the twin has no dropout."""

    def __init__(self, with_dropout: bool):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.drop = nn.Dropout(0.1) if with_dropout else nn.Identity()

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def test_an_eval_mode_dropout_is_a_pass_through():
    batches = _batches(4, 8)
    (prepared, converted), (twin_prepared, twin_converted) = _twins(DropoutMLP, batches)
    assert aten.dropout.default in _targets(prepared)  # eval-mode export keeps it, with train=False
    # x, fc1 weight, the relu's output, fc2 weight, fc2's output: fc2 reads the relu's point through the dropout.
    assert len(fake_quant_modules(prepared)) == len(fake_quant_modules(twin_prepared)) == 5
    x = _batches(4, 8, n=1)[0]
    torch.testing.assert_close(converted(x), twin_converted(x), rtol=0, atol=0)
