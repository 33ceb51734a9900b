""".pte files through ExecuTorch's XNNPACK delegate, run in ExecuTorch's
Python runtime and compared with the converted model (our fake-quant
graph) and its output point's step."""

from __future__ import annotations

import builtins

import pytest
import torch
from tests.models.quantized import batch, ptq
from tests.export.test_export_qdq import ACT, WEIGHTS, _cnn_w8a8, _output_point
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

import pt2e_fq as q
from pt2e_fq.export import UnsupportedPointError, check_lowered, run_pte, to_executorch
from quantizers import presets

try:
    import executorch.runtime  # noqa: F401

    MISSING = None
except ImportError as e:  # make test installs the extra; a bare checkout may not have it
    MISSING = f"executorch is not installed ({e}); pip install 'pt2e_fq[executorch]'"

needs_executorch = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

# Each test lowers and runs a program in ExecuTorch: tens of seconds apiece.
pytestmark = pytest.mark.slow


def _assert_within_one_step(out, model, x):
    ref = model(x)
    step = _output_point(model).scale.float()
    diff = (out - ref).abs()
    assert (diff <= step * (1 + 1e-3)).all(), f"max diff {diff.max().item()} vs step {step.max().item()}"


@needs_executorch
def test_a_w8a8_cnn_is_fully_delegated_to_xnnpack_and_runs_within_one_step(tmp_path):
    model = _cnn_w8a8()
    x = batch(4, (4, 3, 8, 8))
    path = tmp_path / "cnn.pte"
    result = to_executorch(model, x, path)
    assert path.stat().st_size > 0
    # Every point is a q/dq pair XNNPACK took: no quantize / dequantize, conv or linear left outside.
    # One delegate subgraph: the residual add's shared dequantize is copied per user.
    assert result.delegated_subgraphs == 1 and not result.outside, str(result)
    points = [n for n in model.graph.nodes
              if n.op == "call_module" and isinstance(model.get_submodule(n.target), q.FakeQuantize)]
    assert len(result.qdq.lowered) == len(points) == 9
    (out,) = run_pte(path, x)
    _assert_within_one_step(out, model, x)
    check = check_lowered(path, model, x)
    assert check.ok, str(check)


@needs_executorch
def test_a_dynamic_batch_pte_runs_every_batch_up_to_its_max_and_refuses_a_larger_one(tmp_path):
    model = _cnn_w8a8()
    path = tmp_path / "dyn.pte"
    dims = ({0: torch.export.Dim("batch", min=1, max=8)},)
    with pytest.raises(ValueError, match=r"narrowed the dynamic dimension\(s\) s\d+: \[1, 8\] became \[1, 2\]"):
        to_executorch(model, batch(1, (1, 3, 8, 8)), path, dynamic_shapes=dims)  # an example of batch 1
    assert not path.exists()
    to_executorch(model, batch(1, (3, 3, 8, 8)), path, dynamic_shapes=dims)
    for b in (1, 5, 8):
        x = batch(b, (b, 3, 8, 8))
        (out,) = run_pte(path, x)
        assert out.shape == (b, 4)
        _assert_within_one_step(out, model, x)
    with pytest.raises(RuntimeError, match="set_inputs"):  # ExecuTorch planned the memory for 8
        run_pte(path, batch(9, (9, 3, 8, 8)))


@needs_executorch
def test_a_dynamic_dimension_without_a_max_is_refused_before_writing(tmp_path):
    model = _cnn_w8a8()
    with pytest.raises(ValueError, match=r"dynamic_shapes: dimension\(s\) s\d+ have no largest size.*max=64"):
        to_executorch(model, batch(1, (1, 3, 8, 8)), tmp_path / "d.pte", dynamic_shapes=({0: torch.export.Dim.AUTO},))
    assert not (tmp_path / "d.pte").exists()


@needs_executorch
def test_per_channel_int4_weights_run_as_int8_codes(tmp_path):
    spec = q.QSpec(q.INT4, q.PerChannel(0), "symmetric", observer=q.CurrentMinMaxObserver())
    model = ptq(ACT, spec)
    x = batch(9)
    result = to_executorch(model, x, tmp_path / "int4.pte")
    assert not result.outside, str(result)
    (out,) = run_pte(tmp_path / "int4.pte", x)
    _assert_within_one_step(out, model, x)


@needs_executorch
def test_per_group_weights_need_float_and_then_run_exactly_as_fake_quantized(tmp_path):
    model = ptq(ACT, WEIGHTS["per_group"])
    x = batch(9)
    with pytest.raises(UnsupportedPointError, match="weight of conv2d.*unsupported='float'"):
        to_executorch(model, x, tmp_path / "g.pte")
    assert not (tmp_path / "g.pte").exists()
    with pytest.warns(UserWarning, match="stored as float"):
        result = to_executorch(model, x, tmp_path / "g.pte", unsupported="float")
    assert len(result.qdq.in_float) == 2
    (out,) = run_pte(tmp_path / "g.pte", x)
    _assert_within_one_step(out, model, x)


@needs_executorch
def test_keep_is_refused_for_executorch(tmp_path):
    with pytest.raises(ValueError, match="unsupported='keep' would leave pt2e_fq ops"):
        to_executorch(ptq(ACT, WEIGHTS["per_channel"]), batch(9), tmp_path / "k.pte", unsupported="keep")


def test_without_executorch_the_error_names_the_extra(monkeypatch, tmp_path):
    real_import = builtins.__import__

    def no_executorch(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name.startswith("executorch"):  # not pt2e_fq.export.lowering.executorch
            raise ImportError(f"No module named {name!r}")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", no_executorch)
    with pytest.raises(ImportError, match=r"pip install 'pt2e_fq\[executorch\]'"):
        to_executorch(ptq(ACT, WEIGHTS["per_channel"]), batch(9), tmp_path / "m.pte")
    with pytest.raises(ImportError, match=r"pip install 'pt2e_fq\[executorch\]'"):
        check_lowered(tmp_path / "m.pte", ptq(ACT, WEIGHTS["per_channel"]), batch(9))


class ConvPoolConv(torch.nn.Module):
    """conv -> relu -> max pool -> conv -> flatten -> linear: our quantizer
    gives the pool's output its input's qparams (no point of its own)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8 * 4 * 4, 4)

    def forward(self, x):
        y = torch.nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        return self.fc(torch.relu(self.conv2(y)).flatten(1))


def _conv_pool_conv():
    from pt2e_fq.cli import pipeline

    torch.manual_seed(0)
    batches = [(torch.randn(4, 1, 8, 8),) for _ in range(3)]
    return pipeline.quantize(ConvPoolConv().eval(), batches[0], presets.every_point("w8a8"), calibration=batches,
                             progress=False)


@needs_executorch
def test_a_max_pool_between_a_dequantize_and_a_conv_is_passed_through(tmp_path):
    model, x = _conv_pool_conv(), batch(2, (4, 1, 8, 8))
    result = to_executorch(model, x, tmp_path / "pool.pte")
    assert result.delegated_subgraphs == 1 and not result.outside, str(result)
    (out,) = run_pte(tmp_path / "pool.pte", x)
    _assert_within_one_step(out, model, x)


@needs_executorch
def test_a_dequantize_xnnpack_leaves_outside_is_an_error_before_writing(tmp_path, monkeypatch):
    # Without the max pool pass-through, the second conv reads pool(dq(...)),
    # which XNNPACK does not quantize: its weight dequantize stays outside.
    from pt2e_fq.export.lowering import qdq

    monkeypatch.setattr(qdq, "_PASS_THROUGH", qdq._PASS_THROUGH - {torch.ops.aten.max_pool2d.default})
    with pytest.raises(UnsupportedPointError, match=r"XNNPACK did not take 1 quantize/dequantize node.*read by"):
        to_executorch(_conv_pool_conv(), batch(2, (4, 1, 8, 8)), tmp_path / "pool.pte")
    assert not (tmp_path / "pool.pte").exists()


@needs_executorch
def test_a_transformer_block_runs_with_the_linear_before_gelu_in_float(tmp_path):
    from tests.export.test_export_qdq import _encoder_w8a8

    model, x = _encoder_w8a8(), batch(6, (2, 6, 32))
    result = to_executorch(model, x, tmp_path / "block.pte")
    # mlp.0's output feeds GELU unquantized (the point is after GELU): XNNPACK
    # has no int8 linear with a float output, so that weight goes as its fake-quantized floats.
    assert [(p.module, p.role) for p in result.qdq.in_float] == [("mlp.0", "weight of linear_4")], str(result)
    assert not any("quantize" in op for op in result.outside), str(result)
    check = check_lowered(tmp_path / "block.pte", model, x)
    # Softmax, layer norm and GELU run in XNNPACK's / ExecuTorch's float kernels: a last-bit
    # difference that moves a value across a rounding boundary cascades, up to 2 steps here
    # (docs/export.md, "Where the runtimes differ").
    assert check.outputs[0].max_steps <= 2 + 1e-3, str(check)


@needs_executorch
def test_a_transformer_block_quantized_for_xnnpack_runs_every_linear_in_int8(tmp_path):
    from pt2e_fq.cli import pipeline
    from benchmarks.models import EncoderBlock

    torch.manual_seed(0)
    block = EncoderBlock().eval()
    batches = [(torch.randn(2, 6, 32),) for _ in range(4)]
    # every_point(target="xnnpack"): mlp.0 gets a point on its own output, GELU's
    # input, so XNNPACK can run it in int8.
    model = pipeline.quantize(block, batches[0], presets.every_point("w8a8", target="xnnpack"),
                              calibration=batches, progress=False)
    x = batch(6, (2, 6, 32))
    result = to_executorch(model, x, tmp_path / "block.pte")
    assert not result.qdq.in_float and not result.qdq.kept, str(result.qdq)
    # ExecuTorch's delegation summary: every linear inside the delegate with its
    # weight's int8 dequantize (XNNPACK takes that only as a quantized linear).
    linears = sum(isinstance(m, torch.nn.Linear) for m in block.modules())
    assert linears == 6
    assert result.delegated["aten_linear_default"] == linears, result.delegated
    assert result.delegated["quantized_decomposed_dequantize_per_channel_default"] == linears, result.delegated
    assert not any("quantize" in op or "linear" in op or "gelu" in op for op in result.outside), str(result)
    check = check_lowered(tmp_path / "block.pte", model, x)
    assert check.outputs[0].max_steps <= 2 + 1e-3, str(check)  # as in the test above


@needs_executorch
@pytest.mark.parametrize("layers, shape", [
    (lambda: torch.nn.Sequential(torch.nn.Conv2d(16, 32, 1), torch.nn.ReLU(), torch.nn.Conv2d(32, 8, 1)), (2, 16, 5, 5)),
    (lambda: torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)), (4, 32)),
], ids=["convs", "linears"])
def test_rotated_inputs_run_in_executorch_within_one_step(tmp_path, layers, shape):
    """Input rotation (Hadamard blocks folded into the weights, the input
    rotated in float) lowers in one XNNPACK subgraph, the rotations
    included, and the .pte's output is the converted model's within one
    output step."""
    from pt2e_fq.cli import pipeline

    torch.manual_seed(0)
    model = layers().eval()
    batches = [(torch.randn(shape) * torch.linspace(0.1, 30, shape[1]).reshape(-1, *[1] * (len(shape) - 2)),)
               for _ in range(4)]
    config = presets.every_point("w8a8").set_input_rotation(16)
    converted = pipeline.quantize(model, batches[0], config, calibration=batches, progress=False)
    rotations = [n for n in converted.graph.nodes if n.target is torch.ops.aten.linear.default and n.meta.get("pt2e_fq_rotation")]
    assert len(rotations) == 2  # both layers' inputs rotated
    x = batches[1][0]
    result = to_executorch(converted, x, tmp_path / "rotated.pte")
    assert result.delegated_subgraphs == 1 and not result.outside, str(result)  # the rotations too
    (out,) = run_pte(tmp_path / "rotated.pte", x)
    _assert_within_one_step(out, converted, x)
    check = check_lowered(tmp_path / "rotated.pte", converted, x)
    assert check.ok, str(check)
