"""The QAT eval switch (pt2e_fq.move_exported_model_to_eval, run by freeze_qat) on the
shapes of real architectures: batch norms keep
their own eps and momentum (torchvision's MobileNetV3 / EfficientNet use
1e-3 and 0.01; torchao writes 1e-5 and 0.1), and the train-only randomness
of a train-mode export (SDPA's baked dropout_p, dropouts, torchvision's
StochasticDepth) is gone, so the frozen and converted model is deterministic
and computes what the float model computes in eval mode.

The reference is the float model itself in eval mode: with every fake-quant
point switched off, the frozen QAT graph must reproduce it."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchao.quantization.pt2e as tao
from tests.models.quantizer import single_thread, sqnr_db  # noqa: F401 (an autouse fixture)

import pt2e_fq
from pt2e_fq import flow
from pt2e_fq.cli import pipeline
from pt2e_fq.eval_mode import sdpa_dropout_p


def stochastic_depth(x, p: float, training: bool):
    """torchvision.ops.stochastic_depth, mode "row" (torchvision itself
    cannot be imported beside the CPU torch without stubbing its C ops)."""
    if not training or p == 0.0:
        return x
    survival = 1.0 - p
    noise = torch.empty([x.shape[0]] + [1] * (x.ndim - 1), dtype=x.dtype, device=x.device).bernoulli_(survival)
    noise.div_(survival)
    return x * noise


class Block(nn.Module):
    """EfficientNet-like: conv-bn(eps 1e-3, momentum 0.01)-hardswish with a
    stochastic-depth residual, Dropout2d, then attention with dropout_p
    0.1 in training (HF GPT-2 / BERT style) and a dropout before the head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8, eps=1e-3, momentum=0.01)
        self.act = nn.Hardswish(inplace=True)
        self.drop2d = nn.Dropout2d(0.2)
        self.qkv = nn.Linear(8, 24)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = x + stochastic_depth(self.act(self.bn(self.conv(x))), 0.2, self.training)
        t = self.drop2d(x).flatten(2).transpose(1, 2)  # (n, 16 tokens, 8)
        q, k, v = self.qkv(t).chunk(3, dim=-1)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0)
        return self.head(self.drop(a.mean(1)))


def _model() -> Block:
    torch.manual_seed(0)
    model = Block()
    # Running variances of the order of eps, so that eps 1e-3 against 1e-5 shows (a factor of ~1.4 in scale).
    model.bn.running_var.uniform_(5e-4, 2e-3)
    model.bn.running_mean.uniform_(-0.1, 0.1)
    return model


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 8, 4, 4, generator=g) for _ in range(n)]


def _frozen(model, preset="w8a8"):
    batches = _batches(3)
    prepared = pipeline.prepare(model, batches[0], preset, qat=True)
    pipeline.calibrate(prepared, batches, progress=False)
    return pipeline.freeze_qat(prepared, batches[0])


def test_the_frozen_qat_graph_keeps_each_batch_norm_s_eps_and_momentum():
    model = _model()
    frozen = _frozen(model)
    x = _batches(4)[-1]
    with torch.no_grad():
        # The prepared model has its own batch norm statistics, which the calibration
        # forwards (train mode) updated; the reference sees the same forwards.
        for batch in _batches(3):
            model.train()(batch)
        expected = model.eval()(x)
        frozen.apply(tao.disable_fake_quant)
        # momentum 0.01 kept: calibration moved the statistics by 1% of the batch's;
        # with torchao's 0.1 they move by 10% and eps 1e-5 rescales every channel.
        torch.testing.assert_close(frozen(x), expected, rtol=0.05, atol=0.02)


def test_the_frozen_graph_reproduces_the_float_model_in_eval_mode_exactly_with_the_batch_norm_frozen():
    """momentum 0 (the statistics never move): the frozen graph with the
    fake-quant points off is the float eval model up to float rounding."""
    model = _model()
    model.bn.momentum = 0.0
    frozen = _frozen(model)
    x = _batches(4)[-1]
    with torch.no_grad():
        frozen.apply(tao.disable_fake_quant)
        torch.testing.assert_close(frozen(x), model.eval()(x), rtol=1e-4, atol=1e-5)


def test_the_frozen_and_converted_qat_model_is_deterministic(tmp_path):
    frozen = _frozen(_model())
    converted = pipeline.convert(frozen)
    x = _batches(4)[-1]
    with torch.no_grad():
        first = converted(x)
        assert all(torch.equal(converted(x), first) for _ in range(3))
        # The saved program (conv-bn folded, as pt2e_fq.save does) is deterministic too.
        pt2e_fq.save(converted, (x,), tmp_path / "m.pt2")
        loaded = pt2e_fq.load(tmp_path / "m.pt2").module()
        saved = loaded(x)
        assert torch.equal(loaded(x), saved)
        assert sqnr_db(first, saved) > 30
    ops = {n.target for n in converted.graph.nodes if n.op == "call_function"}
    assert not ops & {torch.ops.aten.bernoulli_.float, torch.ops.aten.dropout.default,
                      torch.ops.aten.feature_dropout.default}
    (sdpa,) = [n for n in converted.graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default]
    assert sdpa_dropout_p(sdpa) == 0.0


def test_the_torchao_eval_switch_after_freeze_changes_nothing():
    """freeze_qat marks the model as in eval mode for torchao: a later
    move_exported_model_to_eval (docs, older scripts) must not write its eps
    1e-5 back."""
    frozen = _frozen(_model())
    x = _batches(4)[-1]
    with torch.no_grad():
        y = frozen(x)
        tao.move_exported_model_to_eval(frozen)
        assert torch.equal(frozen(x), y)


class Noisy(nn.Module):
    """Gaussian noise added in training: not a recognised train-only pattern."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return h + 0.1 * torch.randn_like(h) if self.training else h


def test_random_ops_it_does_not_recognise_are_named_in_a_warning():
    x = torch.randn(4, 8)
    prepared = pipeline.prepare(Noisy(), x, "w8a8", qat=True)
    with pytest.warns(UserWarning, match=r"1 random op\(s\) stay in the eval-mode graph.*randn_like.*module ''"):
        flow.move_exported_model_to_eval(prepared)


def test_move_to_eval_of_a_model_without_randomness_warns_nothing():
    x = torch.randn(4, 8)
    prepared = pipeline.prepare(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)), x, "w8a8", qat=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flow.move_exported_model_to_eval(prepared)
    prepared.apply(tao.disable_fake_quant)
    assert torch.equal(prepared(x), prepared(x))
