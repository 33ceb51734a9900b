"""The presets end to end on the test models: export -> prepare (PTQ or QAT)
-> calibrate / train -> convert -> re-export, the output against the float
model, and QAT recovering what 4-bit PTQ loses."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torchao.quantization.pt2e as tao
from tests.models.quantizer import MODELS, build, example_batch, prepare, single_thread, sqnr_db  # noqa: F401 (an autouse fixture)
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

from quantizers import FakeQuantQuantizer, presets

# SQNR floors (dB) of the converted model's output against the float model,
# on held-out inputs, for the four test models (measured minimum in brackets).
# A uniform b-bit quantizer gives about 6 dB per bit on a full-range signal,
# less on bell-shaped weights and activations (max / rms of 3 to 4), and the
# errors of successive layers add up:
SQNR_FLOOR_DB = {
    # int8 weights and activations: ~38-40 dB per point, a few points in
    # series; the issue asks for 30 dB. [31.2: the MLP, whose 4 outputs of a
    # random init are small next to their int8 step]
    "w8a8": 30.0,
    # int4 weights (per group of 32, ~20 dB each) dominate. [19.8]
    "w4a8": 17.0,
    # int4 weights, MINVAL (the range itself, no zero point widening). [20.1]
    "w4a16": 17.0,
    # int8 weights alone, one scale per 128 inputs (~45 dB each). [43.7]
    "w8a16": 38.0,
    # Float formats: the error is relative to each value, about
    # 10 log10(12 * 4**m) dB per point for m mantissa bits (29 dB for E4M3,
    # 17 dB for E2M1), less where values fall into subnormals or saturate;
    # the points of a model add up. Measured minimum over the four models,
    # PTQ and QAT, in brackets; floors ~2.5 dB below.
    # FP8 E4M3, per-channel weights, dynamic per-tensor activations. [25.6]
    "fp8": 23.0,
    # MXFP8 E4M3: power-of-two block scales put amax anywhere in [256, 512)
    # of the grid, saturating above 448. [22.7: QAT CNN]
    "mxfp8": 20.0,
    # MXFP4: 1 mantissa bit, power-of-two scales. [13.4: QAT CNN]
    "mxfp4": 11.0,
    # NVFP4: E2M1 with finer E4M3 block scales over blocks of 16. [13.6: the MLP]
    "nvfp4": 11.0,
}


def _calibrated(model, name, quantizer, qat):
    gm = prepare(model, example_batch(name, 0), quantizer, qat=qat)
    with torch.no_grad():
        for seed in range(1, 5):
            gm(example_batch(name, seed))
    return gm


def _check_reexport(converted, name):
    x = example_batch(name, 100)
    ep = torch.export.export(converted, (example_batch(name, 0),))
    calls = [n for n in ep.graph.nodes if n.op == "call_function" and "pt2e_fq" in str(n.target)]
    assert calls, "the re-exported program has no fake-quant op"
    y = converted(x)
    assert torch.equal(ep.module()(x), y)
    return y


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("preset", list(SQNR_FLOOR_DB))
def test_ptq_flow_and_sqnr(preset, name):
    model = build(name)
    converted = convert_pt2e(_calibrated(model, name, FakeQuantQuantizer(presets.get_preset(preset)), qat=False))
    y = _check_reexport(converted, name)
    with torch.no_grad():
        reference = model(example_batch(name, 100))
    assert sqnr_db(reference, y) >= SQNR_FLOOR_DB[preset]


# convert_pt2e on a QAT model with batch norms costs ~20 s on 2 cores: its
# conv-bn fold exports 96 pattern graphs on every call (and, with our no-op
# convert, folds nothing). The CNN goes through convert once, with w8a8; for
# the other presets it is trained and checked up to convert.
def _qat_converts(preset, name):
    return name != "cnn" or preset == "w8a8"


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("preset", list(SQNR_FLOOR_DB))
def test_qat_flow_and_sqnr(preset, name):
    model = build(name, train=True)
    reference = copy.deepcopy(model)
    gm = _calibrated(model, name, FakeQuantQuantizer(presets.get_preset(preset, qat=True)), qat=True)
    with torch.no_grad():  # the same train-mode batches: the same batch norm statistics
        for seed in range(1, 6):
            reference(example_batch(name, seed))
    out = gm(example_batch(name, 5))  # a training step: gradients reach every parameter
    out.float().pow(2).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in gm.parameters() if p.requires_grad)
    gm.zero_grad()
    # Weight points of a QAT conv-bn see the weight scaled by the batch norm's
    # running variance, which every train-mode forward changes: one eval-mode
    # forward with the observers on gives them the final statistics.
    tao.move_exported_model_to_eval(gm)
    with torch.no_grad():
        gm(example_batch(name, 6))
    gm.apply(tao.disable_observer)
    if _qat_converts(preset, name):
        gm = convert_pt2e(gm)
        y = _check_reexport(gm, name)
    else:
        y = gm(example_batch(name, 100))
    with torch.no_grad():
        expected = reference.eval()(example_batch(name, 100))
    assert sqnr_db(expected, y) >= SQNR_FLOOR_DB[preset]


def test_qat_recovers_what_4_bit_ptq_loses():
    """A regression task a float MLP learns; w4a8 PTQ raises its held-out
    error, a short QAT from the same float weights brings most of it back."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    with torch.no_grad():
        y = teacher(x)
    x_train, y_train, x_test, y_test = x[:256], y[:256], x[256:], y[256:]

    def train(m, steps, lr):
        opt = torch.optim.Adam(m.parameters(), lr=lr)
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.mse_loss(m(x_train), y_train).backward()
            opt.step()

    def error(m):
        with torch.no_grad():
            return float(nn.functional.mse_loss(m(x_test), y_test))

    model = build("mlp")
    train(model, 600, 1e-2)
    float_state = copy.deepcopy(model.state_dict())
    float_error = error(model)
    quantizer = FakeQuantQuantizer(presets.get_preset("w4a8"))

    ptq = prepare(model.eval(), x_train, quantizer)
    with torch.no_grad():
        ptq(x_train)
    ptq_error = error(convert_pt2e(ptq))

    model.load_state_dict(float_state)
    qat = prepare(model.train(), x_train, quantizer, qat=True)
    train(qat, 100, 1e-3)
    qat.apply(tao.disable_observer)
    qat_error = error(convert_pt2e(qat))

    assert ptq_error > 1.1 * float_error  # 4 bits cost something here: the test can fail
    assert qat_error - float_error < 0.5 * (ptq_error - float_error)
