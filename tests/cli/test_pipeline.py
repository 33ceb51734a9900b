"""pt2e_fq.cli.pipeline: the PT2E flow in a few calls, against the float model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from tests.models.quantizer import fake_quant_modules, sqnr_db, single_thread  # noqa: F401 (an autouse fixture: one thread)

from pt2e_fq import FakeQuantize
from pt2e_fq.cli import pipeline
from quantizers import FakeQuantQuantizer, presets


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).eval()


def _inputs(n, seed):
    return torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))


def test_quantizer_for():
    config = presets.get_preset("w4a8")
    assert pipeline.quantizer_for("w4a8").config == config
    assert pipeline.quantizer_for(config).config is config
    quantizer = FakeQuantQuantizer(config)
    assert pipeline.quantizer_for(quantizer) is quantizer
    with pytest.raises(ValueError, match="unknown preset 'w3a3'; allowed: w8a8, w4a8"):
        pipeline.quantizer_for("w3a3")
    with pytest.raises(TypeError, match="config must be a preset name .* got int"):
        pipeline.quantizer_for(8)


def test_ptq_takes_any_batch_size_and_stays_close_to_float():
    model = _mlp()
    prepared = pipeline.prepare(model, _inputs(8, 0), "w8a8")
    assert not model.training
    pipeline.calibrate(prepared, [_inputs(32, s) for s in range(1, 5)], progress=False)
    converted = pipeline.convert(prepared)
    x = _inputs(17, 100)  # another batch size than the example's
    y = converted(x)
    with torch.no_grad():
        assert sqnr_db(model(x), y) > 30
    # Frozen per-tensor qparams: each row's output does not depend on the batch.
    # The float matmuls may take another BLAS kernel for one row (a few ulps);
    # qparams that followed the batch would move it by a quantization step (~1e-2).
    torch.testing.assert_close(converted(x[3:4]), y[3:4], rtol=0, atol=1e-5)


def test_prepare_for_qat_exports_in_train_mode_and_restores_the_mode():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).eval()
    prepared = pipeline.prepare(model, torch.randn(4, 3, 6, 6), "w8a8", qat=True)
    assert not model.training
    running_mean = next(v for k, v in prepared.state_dict().items() if k.endswith("running_mean")).clone()
    prepared(torch.randn(4, 3, 6, 6) + 5)  # a train-mode batch norm updates its running mean
    after = next(v for k, v in prepared.state_dict().items() if k.endswith("running_mean"))
    assert not torch.equal(running_mean, after)


def test_train_runs_the_steps_and_lowers_the_loss():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    w = torch.randn(4, 1, generator=g)
    pairs = [(x[i:i + 16], x[i:i + 16] @ w) for i in range(0, 64, 16)]
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    seen = []

    def epoch_batches(epoch):
        seen.append(epoch)
        return pairs

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = pipeline.train(model, epoch_batches, nn.functional.mse_loss, opt, epochs=5, progress=False)
    assert seen == [0, 1, 2, 3, 4]
    assert len(losses) == 20
    assert losses[-1] < 0.05 * losses[0]
    with torch.no_grad():
        assert float(nn.functional.mse_loss(model(x), x @ w)) == pytest.approx(losses[-1], rel=0.5)
    losses = pipeline.train(model, pairs, nn.functional.mse_loss, opt, epochs=5, max_steps=7, progress=False)
    assert len(losses) == 7
    with pytest.raises(ValueError, match="epochs must be >= 1, got 0"):
        pipeline.train(model, pairs, nn.functional.mse_loss, opt, epochs=0)


def test_freeze_qat_stops_observers_and_batch_norm_updates():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(128, 4))
    prepared = pipeline.prepare(model, torch.randn(4, 3, 6, 6), "w8a8", qat=True)
    pipeline.calibrate(prepared, [torch.randn(4, 3, 6, 6)], progress=False)
    pipeline.freeze_qat(prepared, torch.randn(8, 3, 6, 6))
    state = copy.deepcopy(prepared.state_dict())
    x = torch.randn(5, 3, 6, 6) * 10  # far outside what the observers saw
    y = prepared(x)
    assert torch.equal(prepared(x), y)
    # Only the batch norm's num_batches_tracked counts on (an add_ node of the
    # exported graph, run in eval mode too; it changes nothing in eval mode).
    changed = [k for k, v in prepared.state_dict().items() if not torch.equal(state[k], v)]
    assert all(k.endswith("num_batches_tracked") for k in changed)
    converted = pipeline.convert(prepared)
    assert torch.equal(converted(x), y)


def test_quantize_qat_trains_and_stays_close_to_float():
    model = _mlp()
    state = copy.deepcopy(model.state_dict())
    calibration = [_inputs(32, s) for s in range(1, 9)]
    qat = pipeline.quantize(model, _inputs(8, 0), "w4a8", calibration=calibration, qat_steps=20, lr=1e-4,
                            progress=False)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # the model is not changed
    trained = {k: v for k, v in qat.state_dict().items() if k.endswith((".weight", ".bias"))}
    assert len(trained) == len(state)
    moved = [k for k, v in trained.items() if not torch.equal(v, state[k])]
    assert moved == list(trained)  # every parameter took Adam steps
    x = _inputs(256, 100)  # held out
    with torch.no_grad():
        assert sqnr_db(model(x), qat(x)) > 17  # the w4a8 floor of test_quantizer_flow


def test_quantize_argument_errors():
    with pytest.raises(ValueError, match="qat_steps must be >= 0, got -1"):
        pipeline.quantize(_mlp(), _inputs(8, 0), "w8a8", qat_steps=-1)
    with pytest.raises(ValueError, match="calibration holds no batch"):
        pipeline.quantize(_mlp(), _inputs(8, 0), "w8a8", calibration=[])
