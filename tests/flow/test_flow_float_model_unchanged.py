"""The stock flow never trains the user's float model: the GraphModule of
`torch.export.export(model, ...).module()` holds `model`'s own parameter
and buffer tensors, and FakeQuantQuantizer's prepare hook gives the graph
copies, so optimizer steps and batch norms' running statistics move the
prepared model only. The reference is a snapshot of the float model's
state_dict taken before prepare, compared bit for bit."""

from __future__ import annotations

import torch
from tests.models.stock_flow import batches, build, stock_ptq, stock_qat
from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e

from pt2e_fq.cli import pipeline
from pt2e_fq.flow import own_tensors
from quantizers import FakeQuantQuantizer, presets


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_bit_identical(model: torch.nn.Module, snapshot: dict[str, torch.Tensor]) -> None:
    for name, value in model.state_dict().items():
        assert torch.equal(value, snapshot[name]), f"{name} of the float model changed"


def _train(prepared: torch.nn.Module, steps: int = 3) -> None:
    """A few SGD steps with a large learning rate, batch norms in train mode."""
    optimizer = torch.optim.SGD([p for p in prepared.parameters() if p.requires_grad], lr=0.5)
    for x in batches(steps, seed=3):
        optimizer.zero_grad()
        prepared(x).square().mean().backward()
        optimizer.step()


def test_stock_qat_training_leaves_the_float_model_unchanged():
    model = build("conv_bn_cnn")
    before = _snapshot(model)
    prepared = stock_qat(model)
    with torch.no_grad():
        prepared(batches(1)[0])  # calibrate: the observers see data
    trained_before = _snapshot(prepared)
    _train(prepared)
    _assert_bit_identical(model, before)
    # The prepared model did train: weights and the running statistics moved.
    after = prepared.state_dict()
    assert any(not torch.equal(after[k], v) for k, v in trained_before.items() if k.endswith("weight"))
    assert any(not torch.equal(after[k], v) for k, v in trained_before.items() if k.endswith("running_mean"))


def test_prepared_model_starts_from_the_float_model_s_values():
    model = build("attention_block")
    prepared = prepare_qat_pt2e(torch.export.export(model.train(), (batches(1)[0],)).module(),
                                FakeQuantQuantizer(presets.get_preset("w8a8", qat=True)))
    float_tensors = {id(t) for t in (*model.parameters(), *model.buffers())}
    assert not float_tensors & {id(t) for t in (*prepared.parameters(), *prepared.buffers())}
    assert torch.equal(prepared.get_submodule("qkv").weight, model.qkv.weight)


def test_tied_weights_stay_tied_in_the_copy():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    model = Tied()
    gm = torch.export.export(model, (torch.randn(2, 8),)).module()
    assert gm.get_submodule("a").weight is gm.get_submodule("b").weight  # torch.export keeps the tie
    own_tensors(gm)
    assert gm.get_submodule("a").weight is gm.get_submodule("b").weight
    assert gm.get_submodule("a").weight is not model.a.weight


def test_ptq_with_calibration_algorithms_leaves_the_float_model_unchanged():
    model = build("conv_bn_cnn")
    before = _snapshot(model)
    pipeline.quantize(model, (batches(1)[0],), "w4a8", calibration=batches(2), progress=False)
    _assert_bit_identical(model, before)
    prepared = stock_ptq(model)
    with torch.no_grad():
        prepared(batches(1)[0])
    _assert_bit_identical(model, before)
