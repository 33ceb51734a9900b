"""pt2e_fq.calib.activation_ranges: on a linear whose input has an outlier
channel that its weight barely reads, the chosen int8 range gives a lower
output error than the min-max range and matches a brute-force search over
the upper end done here with plain torch ops (hand-written int8 rounding);
a point read by two linears minimises the sum of their relative output
errors, also when one has more outputs than inputs; a depthwise conv's
chosen range matches a brute-force search over F.conv2d outputs, and with
its sampled values capped it stays within 2 % of that optimum; the calibrated range is never beaten on calibration data by a
worse one; points read elsewhere are left alone; the user's model is
unchanged; misuse is a clear error."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pt2e_fq import FakeQuantize, calib
from pt2e_fq.calib import activation_ranges as ar
from pt2e_fq.calib.activation_ranges import search_activation_ranges
from pt2e_fq.cli import pipeline


class _Readers(nn.Module):
    """relu(x) read by linears (all without bias): `clip` barely reads the
    outlier channel 0, `keep` reads it strongly, `wide` has four times more
    outputs than inputs."""

    def __init__(self, readers=("clip",)):
        super().__init__()
        self.names = readers
        for name in readers:
            layer = nn.Linear(16, 64 if name == "wide" else 8, bias=False)
            with torch.no_grad():
                layer.weight[:, 0] *= 0.01 if name == "clip" else 3.0
            setattr(self, name, layer)

    def forward(self, x):
        y = torch.relu(x)
        return torch.cat([getattr(self, name)(y) for name in self.names], -1)


def _batches(seed=1, count=2):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.randn(512, 16, generator=g)
        x[:, 0] *= 30.0  # the outlier channel
        out.append(x)
    return out


def _prepared(readers=("clip",), seed=0):
    torch.manual_seed(seed)
    model = _Readers(readers).eval()
    batches = _batches()
    prepared = pipeline.prepare(model, batches[0], "w8a8")
    pipeline.calibrate(prepared, batches, progress=False)
    return model, prepared, batches


def _weight_rtn(w):
    """int8 per output channel, symmetric narrow (the w8a8 weight), by hand."""
    s = w.abs().amax(1, keepdim=True) / 127
    return torch.clamp(torch.round(w / s), -127, 127) * s


def _relu_int8(y, hi):
    """Asymmetric int8 on [0, hi] (zero point -128) for each upper end of `hi` (K,): (K, *y.shape), by
    hand; torch.round rounds half to even."""
    scale = (hi.float() / 255).reshape(-1, *(1,) * y.dim())
    return (torch.clamp(torch.round(y / scale) - 128, -128, 127) + 128) * scale


def _relative_error(model, y, yq):
    """Sum over the readers of ||Wq y - Wq yq||^2 / ||Wq y||^2 (Wq: the int8 weight), for each of yq's
    (K, ...) inputs."""
    total = 0.0
    for name in model.names:
        wq = _weight_rtn(getattr(model, name).weight.detach())
        ref = y @ wq.T
        total = total + ((ref - yq @ wq.T).double().pow(2).sum((-1, -2)) / ref.double().pow(2).sum())
    return total


def _stored_grid(point, y):
    q = point.calculate_qparams()
    return (torch.clamp(torch.round(y / q["scale"]) + q["zero_point"], -128, 127) - q["zero_point"]) * q["scale"]


@pytest.mark.parametrize("readers", [("clip",), ("clip", "keep"), ("clip", "wide")])
def test_chosen_range_matches_brute_force_and_beats_min_max(readers):
    model, prepared, batches = _prepared(readers)
    y = torch.relu(torch.cat(batches))
    results = search_activation_ranges(prepared, batches, max_columns=10_000)  # every row: no sampling
    assert len(results) == 1 and len(results[0].consumers) == len(readers)
    point = prepared.get_submodule(results[0].point)
    chosen = _relative_error(model, y, _stored_grid(point, y)).item()
    top = y.max()
    min_max = _relative_error(model, y, _relu_int8(y, top)).item()
    upper_ends = top * torch.arange(1, 1001) / 1000
    brute = _relative_error(model, y, _relu_int8(y, upper_ends))
    assert chosen <= brute.min().item() * 1.01  # the minimum is flat: its place is not compared
    assert results[0].chosen[0] == 0.0
    if readers == ("clip",):  # the outlier channel barely matters: the range clips it hard
        assert chosen < min_max / 4 and results[0].chosen[1] < top.item() / 3
    elif "keep" in readers:  # `keep` reads the outlier: the sum of relative errors keeps more of it
        assert results[0].chosen[1] > search_alone_upper_end()


def search_alone_upper_end():
    _, prepared, batches = _prepared(("clip",))
    return search_activation_ranges(prepared, batches, max_columns=10_000)[0].chosen[1]


def test_never_worse_on_calibration_data_and_report():
    model, prepared, batches = _prepared()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = calib.apply(prepared, batches, activation_ranges=True)
    assert report.algorithms == ("activation_ranges", "gptq", "bias_correction")
    assert list(report.stage_seconds) == ["activation_ranges", "statistics", "rounding"]
    assert [r.consumers for r in report.ranges] == [("clip.weight",)]
    assert all(r.after_db >= r.before_db for r in report.ranges)
    assert "chosen range" in str(report)
    point = prepared.get_submodule(report.ranges[0].point)
    assert not point._observer_on  # more calibration must not move the chosen range
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


class _Depthwise(nn.Module):
    """relu(x) read by a 3x3 depthwise conv that barely reads the outlier channel 0."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        with torch.no_grad():
            self.conv.weight[0] *= 0.01

    def forward(self, x):
        return self.conv(torch.relu(x))


def _depthwise_prepared():
    torch.manual_seed(0)
    model = _Depthwise().eval()
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2):
        x = torch.randn(2, 8, 16, 16, generator=g)
        x[:, 0] *= 30.0
        batches.append(x)
    prepared = pipeline.prepare(model, batches[0], "w8a8")
    pipeline.calibrate(prepared, batches, progress=False)
    return model, prepared, batches


def _depthwise_errors(model, y, yq):
    """||conv(y) - conv(yq)||^2 / ||conv(y)||^2 with the int8 weight, for each of yq's (K, ...) inputs."""
    w = model.conv.weight.detach()
    wq = _weight_rtn(w.reshape(8, -1)).reshape(w.shape)
    ref = F.conv2d(y, wq, padding=1, groups=8)
    out = torch.stack([F.conv2d(q, wq, padding=1, groups=8) for q in yq])
    return (ref - out).double().pow(2).sum((1, 2, 3, 4)) / ref.double().pow(2).sum()


def test_depthwise_conv_matches_brute_force_and_capped_sampling_stays_near():
    """Every patch (2 batches x 2 images x 256 positions = 1024 columns of 8 x 9 values) against
    the capped run's 128 columns (max_values = 8 * 9 * 128): both against the brute-force optimum."""
    for max_values, tolerance in ((8 * 9 * 1024, 1.01), (8 * 9 * 128, 1.02)):
        model, prepared, batches = _depthwise_prepared()
        y = torch.relu(torch.cat(batches))
        upper_ends = y.max() * torch.arange(1, 1001) / 1000
        brute = _depthwise_errors(model, y, _relu_int8(y, upper_ends)).min().item()
        results = search_activation_ranges(prepared, batches, max_values=max_values)
        assert len(results) == 1 and results[0].consumers == ("conv.weight",)
        point = prepared.get_submodule(results[0].point)
        chosen = _depthwise_errors(model, y, _stored_grid(point, y).unsqueeze(0)).item()
        assert chosen <= brute * tolerance
        min_max = _depthwise_errors(model, y, _relu_int8(y, y.max().reshape(1))).item()
        assert chosen < min_max / 3  # the outlier channel clipped


def test_sampled_columns_respect_both_caps():
    """The sampler keeps min(max_columns, max_values // values per column) columns per reader,
    spread over the batches (two batches of two images: one unfold chunk each)."""
    _, prepared, batches = _depthwise_prepared()
    for max_columns, max_values, expected in ((2048, 8 * 9 * 100, 100), (60, 1 << 22, 60), (2048, 1, 2)):
        targets = ar.find_targets(prepared)
        with torch.no_grad():
            sampler = ar._Sampler(prepared, targets, len(batches), max_columns, max_values,
                                  torch.Generator().manual_seed(0))
            for b in batches:
                sampler.run(b)
        (columns,) = targets[0].columns.values()
        assert [c.shape[:2] for c in columns] == [(8, 9)] * 2
        assert sum(c.shape[-1] for c in columns) == expected


class _SharedWithMatmul(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        y = torch.relu(x)
        return self.fc(y) + y @ y.transpose(-1, -2)[..., :16]


def test_point_read_by_another_op_is_left_alone():
    torch.manual_seed(0)
    model = _SharedWithMatmul().eval()
    batches = [torch.randn(2, 16, 16) for _ in range(2)]
    prepared = pipeline.prepare(model, batches[0], "w8a8")
    pipeline.calibrate(prepared, batches, progress=False)
    fc_input = next(n for n in prepared.graph.nodes if n.op == "call_function" and "linear" in str(n.target)).args[0]
    point = prepared.get_submodule(fc_input.target)
    assert len(fc_input.users) > 1  # the matmul reads the same point
    qparams = {k: v.clone() for k, v in point.calculate_qparams().items()}
    results = search_activation_ranges(prepared, batches)
    assert fc_input.target not in [r.point for r in results]
    assert all(torch.equal(v, point.calculate_qparams()[k]) for k, v in qparams.items())


def test_bad_arguments_are_errors():
    _, prepared, batches = _prepared()
    with pytest.raises(TypeError, match="prepared must be the GraphModule"):
        search_activation_ranges(nn.Linear(2, 2), batches)
    with pytest.raises(ValueError, match="no batch"):
        search_activation_ranges(prepared, [])
    with pytest.raises(ValueError, match="grid must be an int >= 2, got 1"):
        search_activation_ranges(prepared, batches, grid=1)
    with pytest.raises(ValueError, match="max_columns must be an int >= 1, got 0"):
        search_activation_ranges(prepared, batches, max_columns=0)
    with pytest.raises(ValueError, match="max_values must be an int >= 1, got 0.5"):
        search_activation_ranges(prepared, batches, max_values=0.5)
    points = [m for m in prepared.modules() if isinstance(m, FakeQuantize)]
    assert all(m._observer_on for m in points)  # a refused call changes nothing


def test_w8a8_one_call_runs_the_search():
    """presets.PTQ_ALGORITHMS names the search for w8a8: pipeline.run_ptq_algorithms runs it."""
    model, prepared, batches = _prepared()
    report = pipeline.run_ptq_algorithms(prepared, model, [(b,) for b in batches], "w8a8")
    assert "activation_ranges" in report.algorithms
    assert [r.consumers for r in report.ranges] == [("clip.weight",)]
    assert report.ranges[0].chosen != report.ranges[0].calibrated
