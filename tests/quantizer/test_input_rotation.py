"""Input rotation (pt2e_fq.calib.rotation, QuantizerConfig.input_rotation):
the rotation matrix against the Hadamard matrix written out by hand, the
float function against the unrotated model, the annotation (the rotation
stays float, each rotated linear's input point reads x R), the gain on
inputs with outlier channels against the same config without rotation, the
config's YAML round trip and errors, and the export checked in ONNX Runtime."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.export import export

import pt2e_fq
from pt2e_fq.calib.rotation import ROTATION, hadamard_rotation, rotate_inputs
from pt2e_fq.flow import own_tensors
from pt2e_fq.graph import is_rotation_matrix
from quantizers import FakeQuantQuantizer, QuantizerConfig, presets
from quantizers.qspec_dict import ConfigError
from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e


class Block(nn.Module):
    """A LayerNorm read by two linears and the residual, a GELU MLP, a 45-wide
    linear (odd: no block divides it) and a head tied to an embedding."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 64)
        self.ln = nn.LayerNorm(64)
        self.q, self.k = nn.Linear(64, 64), nn.Linear(64, 64)
        self.up, self.down = nn.Linear(64, 128), nn.Linear(128, 45)
        self.odd = nn.Linear(45, 64)
        self.head = nn.Linear(64, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        h = self.ln(x)
        h = h + self.q(h) * self.k(h)
        return self.head(x + self.odd(self.down(nn.functional.gelu(self.up(h)))))


def _sqnr(out, ref) -> float:
    return 10 * math.log10(ref.pow(2).sum() / (out - ref).pow(2).sum())


def test_rotation_matrix_is_the_signed_hadamard_matrix():
    r = hadamard_rotation(4, seed=3)
    h4 = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=torch.float64) / 2
    signs = torch.randint(0, 2, (4,), generator=torch.Generator().manual_seed(3)) * 2 - 1
    assert torch.equal(r, signs[:, None] * h4)
    r = hadamard_rotation(128)
    assert torch.allclose(r @ r.T, torch.eye(128, dtype=torch.float64), atol=1e-12)
    assert torch.equal(r.abs(), torch.full((128, 128), 1 / math.sqrt(128), dtype=torch.float64))


@pytest.mark.parametrize("bad, error", [(0, ValueError), (1, ValueError), (3, ValueError), (96, ValueError),
                                        (True, TypeError), (32.0, TypeError), ("32", TypeError)])
def test_block_size_errors_name_the_argument(bad, error):
    with pytest.raises(error, match=r"set_input_rotation: block_size must be"):
        QuantizerConfig().set_input_rotation(bad)
    with pytest.raises(ConfigError, match=r"^input_rotation must be"):
        QuantizerConfig.from_dict({"input_rotation": bad})


def test_config_round_trips_through_yaml(tmp_path):
    config = presets.get_preset("w4a8").set_input_rotation(128)
    config.save(tmp_path / "c.yaml")
    loaded = QuantizerConfig.load(tmp_path / "c.yaml")
    assert loaded.input_rotation == 128 and loaded == config
    assert "input_rotation: 128" in (tmp_path / "c.yaml").read_text()
    assert QuantizerConfig.from_dict(presets.get_preset("w4a8").to_dict()).input_rotation is None


def test_rotation_keeps_the_float_function_and_reports_what_it_left():
    model = Block().eval()
    ids = torch.randint(0, 10, (3, 7))
    gm = own_tensors(export(model, (ids,)).module())
    report = rotate_inputs(gm, 32)
    assert sorted(report.rotated) == ["linear", "linear_1", "linear_2", "linear_3"]  # q, k, up, down
    assert report.skipped == {"linear_4": "its 45 input channels are odd (no Hadamard block divides them)",
                              "linear_5": "its weight is read elsewhere too (tied weights)"}
    torch.testing.assert_close(gm(ids), model(ids), atol=1e-5, rtol=1e-5)
    # one rotation per rotated tensor: the LayerNorm's output is rotated once for q and k
    rotations = [n for n in gm.graph.nodes if n.meta.get(ROTATION) and n.target is torch.ops.aten.linear.default]
    assert len(rotations) == 3
    # A rotation's own linear is not a layer to rotate: a second pass sees the model's linears only.
    again = rotate_inputs(gm, 32)
    assert sorted(again.rotated) + sorted(again.skipped) == sorted(report.rotated) + sorted(report.skipped)


def test_quantizer_leaves_the_rotation_float_and_the_user_model_unchanged():
    model = Block().eval()
    before = copy.deepcopy(model.state_dict())
    ids = torch.randint(0, 10, (3, 7))
    config = presets.get_preset("w4a8").set_input_rotation(32)
    with pytest.warns(UserWarning, match=r"2 layer\(s\) left unrotated") as caught:
        prepared = prepare_pt2e(export(model, (ids,)).module(), FakeQuantQuantizer(config))
    assert not [w for w in caught if "stay in float" in str(w.message)]  # the rotation matrix is no weight
    assert len(prepared.meta["input_rotation"].rotated) == 4
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    for node in prepared.graph.nodes:
        if node.meta.get(ROTATION) and node.target is torch.ops.aten.linear.default:  # float input and matrix
            assert all(a.op != "call_module" for a in node.all_input_nodes)
            assert is_rotation_matrix(node.args[1].target)
        if node.target is torch.ops.aten.linear.default and node.name in ("linear", "linear_2", "linear_3"):
            point = node.args[0]
            assert point.op == "call_module" and point.args[0].target is torch.ops.aten.flatten.using_ints


class _Outliers(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, 32)

    def forward(self, x):
        return self.fc(x)


def _w8a8_sqnr(model, x, block):
    config = presets.get_preset("w8a8").set_input_rotation(block)
    prepared = prepare_pt2e(export(model, (x,)).module(), FakeQuantQuantizer(config))
    prepared(x)
    return _sqnr(pt2e_fq.convert_pt2e(prepared)(x), model(x))


@settings(max_examples=10, deadline=None)
@given(channel=st.integers(0, 127), magnitude=st.floats(20, 200), seed=st.integers(0, 2**16))
def test_rotation_wins_on_an_outlier_channel(channel, magnitude, seed):
    """One input channel `magnitude` times the others': a per-tensor int8
    grid on x spends its levels on that channel; on x R the outlier is
    spread over the block of 64, and the output SQNR rises by at least 10 dB."""
    g = torch.Generator().manual_seed(seed)
    model = _Outliers(128).eval()
    with torch.no_grad():
        model.fc.weight.copy_(torch.randn(32, 128, generator=g) / 10)
    x = torch.randn(64, 128, generator=g)
    x[:, channel] *= magnitude
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain, rotated = _w8a8_sqnr(model, x, None), _w8a8_sqnr(model, x, 64)
    assert rotated > plain + 10, (plain, rotated)


@pytest.mark.parametrize("model, shape", [
    (nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 16)), (8, 64)),
    (nn.Sequential(nn.Conv2d(64, 128, 1), nn.ReLU(), nn.Conv2d(128, 16, 3)), (2, 64, 5, 5)),
], ids=["linears", "convs"])
def test_rotated_export_runs_in_onnx_runtime(tmp_path, model, shape):
    from pt2e_fq.export import check_onnx, to_onnx

    model = model.eval()
    x = torch.randn(shape)
    x[:, 5] *= 40
    config = presets.get_preset("w8a8").set_input_rotation(64)
    prepared = prepare_pt2e(export(model, (x,)).module(), FakeQuantQuantizer(config))
    prepared(x)
    converted = pt2e_fq.convert_pt2e(prepared)
    path = tmp_path / "rotated.onnx"
    to_onnx(converted, (x,), path)
    result = check_onnx(path, converted, (torch.randn(shape),))
    assert result.points == 4  # two layers: input and weight each; the rotation has none
    # One float 64 x 64 constant for both rotations (the exporter stores a linear's weight transposed, once
    # per linear; to_onnx merges identical initializers).
    from onnx import numpy_helper

    constants = [numpy_helper.to_array(i) for i in __import__("onnx").load(path).graph.initializer]
    rotations = [c for c in constants if c.shape == (64, 64)]
    assert len(rotations) == 1 and (abs(abs(rotations[0]) - 1 / 8) < 1e-7).all()


class ConvNet(nn.Module):
    """A 1x1 and a 3x3 conv (rotated), a depthwise conv (not: groups), a 1x1
    projection, a conv1d over the pooled rows and a linear head."""

    def __init__(self):
        super().__init__()
        self.expand = nn.Conv2d(16, 32, 1)
        self.spatial = nn.Conv2d(32, 32, 3, padding=1)
        self.depthwise = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.project = nn.Conv2d(32, 16, 1)
        self.rows = nn.Conv1d(16, 16, 3)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        h = torch.relu(self.spatial(torch.relu(self.expand(x))))
        h = self.project(torch.relu(self.depthwise(h))) + x
        return self.head(self.rows(h.mean(-1)).mean(-1))


def test_convolutions_rotate_over_their_input_channels():
    model = ConvNet().eval()
    x = torch.randn(2, 16, 8, 8)
    gm = own_tensors(export(model, (x,)).module())
    report = rotate_inputs(gm, 32)
    # each tensor in blocks of the largest power of two dividing its channels, at most 32
    assert report.rotated == {"conv2d": 16, "conv2d_1": 32, "conv2d_3": 32, "conv1d": 16, "linear": 16}
    assert [tuple(b.shape) for name, b in gm.named_buffers() if is_rotation_matrix(name)] == [(16, 16), (32, 32)]
    assert report.skipped == {"conv2d_2": "it is a grouped convolution (it mixes no channels across groups)"}
    torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)
    # a conv's channels are moved last and back: two permutes around each rotation but the linear's
    permutes = [n for n in gm.graph.nodes if n.target is torch.ops.aten.permute.default]
    assert len(permutes) == 8 and all(n.meta.get("pt2e_fq_rotation") for n in permutes)
    assert [n.args[1] for n in permutes[:2]] == [[0, 2, 3, 1], [0, 3, 1, 2]]
    # the inserted nodes' shapes and dtypes in meta["val"] (the planner's) are those they compute
    computed = {}

    class Record(torch.fx.Interpreter):
        def run_node(self, n):
            computed[n] = super().run_node(n)
            return computed[n]

    Record(gm).run(x)
    rotation_nodes = [n for n in gm.graph.nodes if n.meta.get("pt2e_fq_rotation")]
    assert len(rotation_nodes) == 4 + 4 * 6  # the matrix and three ops for the linear, five for each conv
    for node in rotation_nodes:
        assert node.meta["val"].shape == computed[node].shape, node.name
        assert node.meta["val"].dtype == computed[node].dtype, node.name


def test_quantizer_rotates_conv_inputs_and_keeps_the_rotation_float():
    model = ConvNet().eval()
    x = torch.randn(2, 16, 8, 8)
    config = presets.get_preset("w8a8").set_input_rotation(16)
    with pytest.warns(UserWarning, match=r"1 layer\(s\) left unrotated:\n.*: 5 layer\(s\) rotated \(5 in blocks of 16\)\n"
                                         r"  left as it was \(it is a grouped convolution .*\): conv2d_2$"):
        prepared = prepare_pt2e(export(model, (x,)).module(), FakeQuantQuantizer(config))
    for node in prepared.graph.nodes:
        if node.target is torch.ops.aten.conv2d.default and node.name != "conv2d_2":
            point = node.args[0]  # the conv's input point reads the rotated tensor, channels back in place
            assert point.op == "call_module" and point.args[0].target is torch.ops.aten.permute.default
        if node.meta.get("pt2e_fq_rotation"):
            assert all(a.op != "call_module" for a in node.all_input_nodes), node.name


@pytest.mark.needs_torch("2.13", "torch 2.11's fake-tensor aten.linear calls numel() on a rank >= 3 input with a symbolic batch, which a rotation of such an input traces (input rotation then raises NotImplementedError there)")
def test_ptq_algorithms_leave_the_rotations_alone():
    """Equalisation, GPTQ and bias correction on a rotated model: each
    rotation matrix (one buffer shared by every rotation of its block size)
    is still the randomised Hadamard matrix, and with the fake quantization
    off the model still computes its float function. (Equalisation once
    took a rotation's linear for a layer and scaled the shared matrix.)"""
    from pt2e_fq import calib
    from pt2e_fq.cli import pipeline

    torch.manual_seed(0)
    model = ConvNet().eval()
    batches = [(torch.randn(2, 16, 8, 8),) for _ in range(3)]
    prepared = pipeline.prepare(model, batches[0], presets.get_preset("w4a8").set_input_rotation(16))
    pipeline.calibrate(prepared, batches, progress=False)
    calib.apply(prepared, batches, equalization=True)
    matrices = {n.target for n in prepared.graph.nodes if n.op == "get_attr" and is_rotation_matrix(n.target)}
    assert matrices
    for name in matrices:
        matrix = getattr(prepared, name)
        torch.testing.assert_close(matrix, hadamard_rotation(matrix.shape[0], dtype=matrix.dtype).T, atol=0, rtol=0)
    prepared.apply(torch.ao.quantization.disable_fake_quant)
    with torch.no_grad():  # equalisation rescales layer pairs exactly; GPTQ and bias correction moved weights
        assert torch.nn.functional.cosine_similarity(prepared(*batches[0]).flatten(), model(*batches[0]).flatten(),
                                                     dim=0) > 0.99


@settings(max_examples=8, deadline=None)
@given(channel=st.integers(0, 63), magnitude=st.floats(20, 200), seed=st.integers(0, 2**16))
def test_rotation_wins_on_an_outlier_conv_channel(channel, magnitude, seed):
    """As for the linear: one input channel of a 1x1 conv `magnitude` times
    the others', blocks of 64; at least 10 dB of output SQNR gained."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Conv2d(64, 16, 1).eval()
    with torch.no_grad():
        model.weight.copy_(torch.randn(16, 64, 1, 1, generator=g) / 10)
    x = torch.randn(4, 64, 6, 6, generator=g)
    x[:, channel] *= magnitude
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain, rotated = _w8a8_sqnr(model, x, None), _w8a8_sqnr(model, x, 64)
    assert rotated > plain + 10, (plain, rotated)


def test_report_names_the_skipped_layers_once_per_reason():
    from pt2e_fq.calib.rotation import RotationReport

    report = RotationReport(128, rotated={"a": 128, "b": 8, "c": 128},
                            skipped={"dw1": "grouped", "odd": "odd", "dw2": "grouped"})
    assert str(report) == ("input rotation (Hadamard blocks of at most 128): 3 layer(s) rotated "
                           "(2 in blocks of 128, 1 in blocks of 8)\n"
                           "  left as it was (grouped): dw1, dw2\n"
                           "  left as it was (odd): odd")
