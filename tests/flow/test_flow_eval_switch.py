"""pt2e_fq.move_exported_model_to_eval, the drop-in for torchao's eval switch,
and what happens where a user calls torchao's own: every convert path,
`save` and `to_onnx` refuse the model it leaves, in one line naming the
function to call, and that function repairs it.

References: the float model in eval mode (the switched graph with its
fake-quant points off must compute it), and the values of each float batch
norm module."""

from __future__ import annotations

import copy

import pytest
import torch
import torchao.quantization.pt2e as tao
from tests.models.stock_flow import EPS, MOMENTUM, batch_norm_literals, batches, build, calibrate, qat_prepared, quantizer
from tests.models.quantizer import single_thread  # noqa: F401 (an autouse fixture)
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e as torchao_convert_pt2e
from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e

import pt2e_fq
from pt2e_fq.eval_mode import SDPA, sdpa_dropout_p

TORCHAO_EVAL = "as torchao's move_exported_model_to_eval leaves it; call pt2e_fq.move_exported_model_to_eval"


def _sdpa_dropouts(gm):
    return [sdpa_dropout_p(n) for n in gm.graph.nodes if n.target is SDPA]


def _dropouts(gm):
    return [n for n in gm.graph.nodes if "dropout" in str(n.target)]


def test_the_eval_switch_keeps_eps_and_removes_train_only_randomness():
    model = build("attention_block")
    prepared = pt2e_fq.move_exported_model_to_eval(qat_prepared("attention_block"))
    assert batch_norm_literals(prepared) == [(MOMENTUM, EPS)]
    assert _sdpa_dropouts(prepared) == [0.0] and _dropouts(prepared) == []
    x = batches(1, seed=9)[0]
    prepared.apply(tao.disable_fake_quant)
    with torch.no_grad():
        y = prepared(x)
        assert torch.equal(prepared(x), y)  # deterministic
        torch.testing.assert_close(y, model.eval()(x), rtol=1e-4, atol=1e-5)


def test_torchao_s_eval_switch_still_resets_eps_and_keeps_sdpa_dropout():
    """Why the drop-in exists; where a torchao release fixes this, the
    drop-in and the guards below can go."""
    prepared = tao.move_exported_model_to_eval(qat_prepared("attention_block"))
    assert batch_norm_literals(prepared) == [(0.1, 1e-5)]
    assert _sdpa_dropouts(prepared) == [0.1]


def test_the_drop_in_repairs_a_model_torchao_s_switch_changed():
    ours = pt2e_fq.move_exported_model_to_eval(qat_prepared("attention_block"))
    repaired = pt2e_fq.move_exported_model_to_eval(tao.move_exported_model_to_eval(qat_prepared("attention_block")))
    assert batch_norm_literals(repaired) == [(MOMENTUM, EPS)]
    assert _sdpa_dropouts(repaired) == [0.0] and _dropouts(repaired) == []
    x = batches(1, seed=9)[0]
    with torch.no_grad():
        assert torch.equal(repaired(x), ours(x))


@pytest.mark.parametrize("convert", [torchao_convert_pt2e, pt2e_fq.convert_pt2e], ids=["torchao", "pt2e_fq"])
@pytest.mark.parametrize("name", ["conv_bn_cnn", "attention_block"])
def test_every_convert_refuses_a_model_torchao_s_switch_changed(convert, name):
    prepared = qat_prepared(name)
    tao.move_exported_model_to_eval(prepared)
    calibrate(prepared, batches(2))
    with pytest.raises(ValueError, match=r"^convert_pt2e: .*eps 1e-05, its module 0.01 and 0.001") as error:
        convert(copy.deepcopy(prepared))
    assert "\n" not in str(error.value) and TORCHAO_EVAL in str(error.value)
    pt2e_fq.move_exported_model_to_eval(prepared)
    pt2e_fq.convert_pt2e(prepared)  # repaired (torchao's own convert is the same: test_flow_convert)


def test_the_message_names_sdpa_dropout_left_by_torchao_s_switch():
    prepared = qat_prepared("attention_block")
    tao.move_exported_model_to_eval(prepared)
    calibrate(prepared, batches(2))
    with pytest.raises(ValueError, match=r"'scaled_dot_product_attention' keeps dropout_p 0.1"):
        pt2e_fq.convert_pt2e(prepared)


@pytest.fixture(scope="module")
def switched_after_convert():
    """Converted without an eval switch, then switched by torchao's: what a
    script that calls the eval switch just before export gets."""
    prepared = qat_prepared("conv_bn_cnn")
    calibrate(prepared, batches(2))
    return tao.move_exported_model_to_eval(pt2e_fq.convert_pt2e(prepared))


def test_save_refuses_a_model_torchao_s_switch_changed(switched_after_convert, tmp_path):
    with pytest.raises(ValueError, match=rf"^save: .*eps 1e-05.*{TORCHAO_EVAL}"):
        pt2e_fq.save(switched_after_convert, batches(1)[0], tmp_path / "m.pt2")
    assert not (tmp_path / "m.pt2").exists()


def test_to_onnx_refuses_a_model_torchao_s_switch_changed(switched_after_convert, tmp_path):
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
    with pytest.raises(ValueError, match=rf"^to_onnx: .*eps 1e-05.*{TORCHAO_EVAL}"):
        pt2e_fq.export.to_onnx(switched_after_convert, batches(1)[0], tmp_path / "m.onnx")


def test_save_takes_the_repaired_model(switched_after_convert, tmp_path):
    repaired = pt2e_fq.move_exported_model_to_eval(copy.deepcopy(switched_after_convert))
    assert batch_norm_literals(repaired) == [(MOMENTUM, EPS)] * 2
    x = batches(1, seed=9)[0]
    pt2e_fq.save(repaired, x, tmp_path / "m.pt2")
    with torch.no_grad():
        torch.testing.assert_close(pt2e_fq.load(tmp_path / "m.pt2").module()(x), repaired(x), rtol=1e-4, atol=1e-4)


class StochasticDepth(torch.nn.Module):
    """torchvision.ops.StochasticDepth's "row" mode: x * bernoulli(keep) / keep in training."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if not self.training:
            return x + h
        noise = torch.empty([x.shape[0], 1], dtype=x.dtype).bernoulli_(0.8).div_(0.8)
        return x + h * noise


def test_convert_refuses_a_stochastic_depth_mask_left_by_torchao_s_switch():
    x = torch.randn(4, 8)
    gm = torch.export.export(StochasticDepth().train(), (x,)).module()
    prepared = prepare_qat_pt2e(gm, quantizer())
    tao.move_exported_model_to_eval(prepared)
    calibrate(prepared, [x])
    with pytest.raises(ValueError, match=r"multiplies by a random mask \(stochastic depth\)"):
        pt2e_fq.convert_pt2e(prepared)  # the model itself: a deep copy loses torchao's eval-mode flag
    converted = pt2e_fq.convert_pt2e(pt2e_fq.move_exported_model_to_eval(prepared))
    with torch.no_grad():
        assert torch.equal(converted(x), converted(x))  # deterministic


class TransformersDropPath(torch.nn.Module):
    """transformers' ConvNextDropPath / SwinDropPath forward, verbatim: a 0/1
    mask floor(keep + rand), the scaling on the other factor."""

    def __init__(self, drop_prob):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, hidden_states):
        if self.drop_prob == 0.0 or not self.training:
            return hidden_states
        keep_prob = 1 - self.drop_prob
        shape = (hidden_states.shape[0],) + (1,) * (hidden_states.ndim - 1)
        random_tensor = torch.rand(shape, dtype=hidden_states.dtype, device=hidden_states.device)
        random_tensor = torch.floor(random_tensor + keep_prob)
        return hidden_states.div(keep_prob) * random_tensor


class OldTimmDropPath(torch.nn.Module):
    """timm's drop_path before bernoulli_: keep + rand, floor_ in place."""

    def forward(self, x):
        if not self.training:
            return x
        keep_prob = 0.7
        random_tensor = keep_prob + torch.rand((x.shape[0], 1), dtype=x.dtype, device=x.device)
        random_tensor.floor_()
        return x.div(keep_prob) * random_tensor


class ScaledAfterDropPath(torch.nn.Module):
    """A 0/1 mask with the scaling after the product: a form the switch does not rewrite."""

    def forward(self, x):
        if not self.training:
            return x
        return x * torch.floor(torch.rand((x.shape[0], 1)) + 0.7) / 0.7


class Residual(torch.nn.Module):
    def __init__(self, drop_path):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.drop_path = drop_path

    def forward(self, x):
        return x + self.drop_path(self.fc(x))


@pytest.mark.parametrize("drop_path", [lambda: TransformersDropPath(0.5), lambda: TransformersDropPath(0.1),
                                       OldTimmDropPath], ids=["transformers-0.5", "transformers-0.1", "old-timm"])
def test_the_eval_switch_removes_a_floor_of_rand_drop_path(drop_path):
    """The switched graph with its points off computes the float model in
    eval mode (x, not x / keep: keep 0.9 does not round-trip exactly);
    converted, it is deterministic."""
    torch.manual_seed(0)
    model = Residual(drop_path())
    x = torch.randn(16, 8)
    gm = torch.export.export(copy.deepcopy(model).train(), (x,)).module()
    prepared = pt2e_fq.move_exported_model_to_eval(prepare_qat_pt2e(gm, quantizer()))
    ops = {n.target for n in prepared.graph.nodes}
    assert not ops & {torch.ops.aten.rand.default, torch.ops.aten.floor.default, torch.ops.aten.floor_.default}
    prepared.apply(tao.disable_fake_quant)
    with torch.no_grad():
        torch.testing.assert_close(prepared(x), model.eval()(x), rtol=0, atol=0)
    prepared.apply(tao.enable_fake_quant)
    calibrate(prepared, [x])
    converted = pt2e_fq.convert_pt2e(prepared)
    with torch.no_grad():
        assert torch.equal(converted(x), converted(x))


def test_convert_and_save_refuse_a_floor_of_rand_mask_the_switch_cannot_rewrite(tmp_path):
    x = torch.randn(4, 8)
    gm = torch.export.export(Residual(ScaledAfterDropPath()).train(), (x,)).module()
    prepared = prepare_qat_pt2e(gm, quantizer())
    with pytest.warns(UserWarning, match=r"random op\(s\) stay in the eval-mode graph.*rand"):
        pt2e_fq.move_exported_model_to_eval(prepared)
    calibrate(prepared, [x])
    with pytest.raises(ValueError, match=r"multiplies by a random mask \(stochastic depth\)"):
        pt2e_fq.save(prepared, (x,), tmp_path / "m.pt2")
    with pytest.raises(ValueError, match=r"multiplies by a random mask \(stochastic depth\)"):
        pt2e_fq.convert_pt2e(prepared)
