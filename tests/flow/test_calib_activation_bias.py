"""pt2e_fq.calib.activation_bias: after the correction, the last layer's
mean output channel on the calibration batches equals the float model's
(both models run directly) and its reported SQNR is the one computed from
those outputs, the user's model is unchanged, and misuse is
a clear error."""

import pytest
import torch
from torch import nn

from pt2e_fq import FakeQuantize
from pt2e_fq.calib.activation_bias import correct_activation_bias
from pt2e_fq.cli import pipeline


class _Net(nn.Module):
    """conv -> ReLU6 -> depthwise conv -> ReLU6 -> pointwise conv (no bias) -> pool -> linear."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.project = nn.Conv2d(8, 6, 1, bias=False)
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        x = nn.functional.relu6(self.stem(x) * 3)
        x = nn.functional.relu6(self.depthwise(x))
        return self.fc(self.project(x).mean((2, 3)))


def _prepared(seed=0):
    torch.manual_seed(seed)
    model = _Net().eval()
    batches = [torch.randn(4, 3, 10, 10) + 0.3 for _ in range(3)]
    # A coarse int4 grid on the weights makes the mean errors large enough to see.
    prepared = pipeline.prepare(model, batches[0], "w4a8")
    pipeline.calibrate(prepared, batches, progress=False)
    for m in prepared.modules():
        if isinstance(m, FakeQuantize):
            m.enable_observer(False)
    return model, prepared, batches


def test_every_layer_output_mean_matches_the_float_model():
    model, prepared, batches = _prepared()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        logits_before = torch.cat([prepared(b) for b in batches])
    shifts = correct_activation_bias(prepared, batches)
    assert [s.name.split(".")[0] for s in shifts] == ["stem", "depthwise", "project", "fc"]
    with torch.no_grad():
        logits_after = torch.cat([prepared(b) for b in batches])
        logits_float = torch.cat([model(b) for b in batches])
    # The model's output is the last layer's output: its mean per logit now is the float model's.
    want = logits_float.double().mean(0)
    assert torch.allclose(logits_after.double().mean(0), want, atol=1e-5)
    assert not torch.allclose(logits_before.double().mean(0), want, atol=1e-3)
    err_before = (logits_before - logits_float).pow(2).mean()
    err_after = (logits_after - logits_float).pow(2).mean()
    assert err_after < err_before
    assert shifts[-1].after_db > shifts[-1].before_db
    # The last layer's reported SQNR after its correction is the corrected model's, run directly.
    direct_db = 10 * torch.log10(logits_float.double().pow(2).sum() / (logits_float - logits_after).double().pow(2).sum())
    assert shifts[-1].after_db == pytest.approx(direct_db.item(), abs=0.01)
    # The project conv had no bias: it got one, and the user's model is as it was.
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert model.project.bias is None


def test_ranges_and_observer_switches_are_kept():
    model, prepared, batches = _prepared()
    points = [m for m in prepared.modules() if isinstance(m, FakeQuantize)]
    points[0].enable_observer(True)
    qparams = [{k: v.clone() for k, v in m.calculate_qparams().items()} for m in points]
    correct_activation_bias(prepared, batches)
    assert [m._observer_on for m in points] == [True] + [False] * (len(points) - 1)
    assert all(torch.equal(v, m.calculate_qparams()[k]) for m, q in zip(points, qparams) for k, v in q.items())


def test_bad_arguments_are_errors():
    model, prepared, batches = _prepared()
    with pytest.raises(ValueError, match="no batch"):
        correct_activation_bias(prepared, [])
    with pytest.raises(TypeError, match="GraphModule"):
        correct_activation_bias(model, batches)


def test_pipeline_quantize_runs_it_on_a_cnn():
    """pipeline.quantize's w4a8 default on a CNN ends with the correction:
    the converted model's mean logits on the calibration batches are within
    a tenth of their error with algorithms=False of the float model's (not
    exactly: after calib.apply the pass's reference runs the rounded
    weights, whose own mean error apply's bias correction removed on the
    quantized inputs)."""
    model, _, batches = _prepared()
    error = {}
    with torch.no_grad():
        want = torch.cat([model(b) for b in batches]).double().mean(0)
        for algorithms in (True, False):
            converted = pipeline.quantize(model, batches[0], "w4a8", calibration=batches, progress=False,
                                          algorithms=algorithms)
            error[algorithms] = (torch.cat([converted(b) for b in batches]).double().mean(0) - want).abs().max()
    assert error[True] < error[False] / 10, error
