"""ONNX export: every fake-quant point becomes QuantizeLinear /
DequantizeLinear with the right type and layout, weights become integer
initializers, ONNX Runtime (CPU) reproduces every point bit for bit and the
outputs within one quantization step (the end-to-end bound on deep nets: tests/export/test_onnx_check.py)."""

from __future__ import annotations

import onnx
import pytest
import torch
import torch.nn as nn
from onnx import TensorProto
from tests.models.quantized import (
    QAT_SHAPE,
    FloatFormatModel,
    batch,
    fake_quant_nodes,
    float_format_input,
    min_max_reference,
    ptq,
    qat_converted,
)
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

import pt2e_fq as q
from pt2e_fq.export import check_onnx, to_onnx
from pt2e_fq.export.onnx.session import ort_session
from quantizers import FakeQuantQuantizer, presets

INT8_ASYM = q.QSpec(q.INT8, scheme="asymmetric")


class MLP(nn.Module):
    def __init__(self, width=64, hidden=32, layers=2):
        super().__init__()
        dims = [width] + [hidden] * (layers - 1) + [5]
        self.layers = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(dims, dims[1:])])

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == 0 else layer(torch.relu(x))
        return x


def _weight_dqs(model: onnx.ModelProto) -> list[tuple[str, list, int, int]]:
    """(element type, dims, axis, block_size) of every DequantizeLinear of an
    integer initializer of rank >= 2 (a weight), in graph order."""
    inits = {t.name: t for t in model.graph.initializer}
    found = []
    for n in model.graph.node:
        if n.op_type == "DequantizeLinear" and n.input[0] in inits:
            t = inits[n.input[0]]
            attrs = {a.name: a.i for a in n.attribute}
            if len(t.dims) >= 2:
                found.append((TensorProto.DataType.Name(t.data_type), list(t.dims), attrs.get("axis", 1),
                              attrs.get("block_size", 0)))
    return found


def _activation_types(model: onnx.ModelProto) -> set[str]:
    """Element types of the zero points of every QuantizeLinear."""
    inits = {t.name: t for t in model.graph.initializer}
    return {TensorProto.DataType.Name(inits[n.input[2]].data_type) for n in model.graph.node
            if n.op_type == "QuantizeLinear" and n.input[2] in inits}


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


# name: (activation, weight, output, model, input shape, expected weight DQs, expected activation types, ops)
CASES = {
    "int8 per-tensor / per-channel": (
        INT8_ASYM, q.QSpec(q.INT8, q.PerChannel(0), "symmetric_narrow"), None, None, (2, 3, 6, 6),
        [("INT8", [4, 3, 3, 3], 0, 0), ("INT8", [5, 64], 0, 0)], {"INT8"}, set(),
    ),
    "int4 per-group": (
        INT8_ASYM, q.QSpec(q.INT4, q.PerGroup(16)), None, MLP, (2, 64),
        [("INT4", [32, 64], 1, 16), ("INT4", [5, 32], 1, 16)], {"INT8"}, set(),
    ),
    "int8 2-D blocks": (
        INT8_ASYM, q.QSpec(q.INT8, q.PerBlock((8, 16))), None, MLP, (2, 64),
        [("INT8", [32, 64], 1, 16), ("INT8", [5, 32], 1, 16)], {"INT8"}, set(),
    ),
    "minval": (
        q.QSpec(q.UINT8, scheme="asymmetric", formulation="minval"),
        q.QSpec(q.INT4, q.PerGroup(16), "asymmetric", "minval"), None, MLP, (2, 64),
        [("INT4", [32, 64], 1, 16), ("INT4", [5, 32], 1, 16)], {"UINT8"}, {"Sub", "Add"},
    ),
    "uint8": (
        q.QSpec(q.UINT8, scheme="asymmetric"), q.QSpec(q.UINT8, q.PerChannel(0), "asymmetric"), None, None,
        (2, 3, 6, 6), [("UINT8", [4, 3, 3, 3], 0, 0), ("UINT8", [5, 64], 0, 0)], {"UINT8"}, set(),
    ),
    "int16 narrow": (
        q.QSpec(q.INT16, scheme="symmetric_narrow"), q.QSpec(q.UINT4, q.PerChannel(0), "asymmetric"), None, None,
        (2, 3, 6, 6), [("UINT4", [4, 3, 3, 3], 0, 0), ("UINT4", [5, 64], 0, 0)], {"INT16"}, {"Max", "Min"},
    ),
    "int8 narrow, int4 narrow": (
        q.QSpec(q.INT8, scheme="symmetric_narrow"), q.QSpec(q.INT4, q.PerChannel(0), "symmetric_narrow"),
        q.QSpec(q.INT4, scheme="symmetric_narrow"), None, (2, 3, 6, 6),
        [("INT4", [4, 3, 3, 3], 0, 0), ("INT4", [5, 64], 0, 0)], {"INT8", "INT4"}, {"Clip", "Max", "Min"},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_onnx_runtime_reproduces_the_model_bit_for_bit(case, tmp_path):
    act, weight, out, model_cls, shape, weight_dqs, act_types, ops = CASES[case]
    model = ptq(act, weight, out, model=model_cls() if model_cls else None, shape=shape)
    path = tmp_path / "model.onnx"
    to_onnx(model, (batch(0, shape),), path)
    exported = onnx.load(path)
    onnx.checker.check_model(exported, full_check=True)
    assert _weight_dqs(exported) == weight_dqs
    assert _activation_types(exported) == act_types
    assert ops <= set(_ops(exported))
    # No float copy of a quantized weight is left.
    float_dims = [list(t.dims) for t in exported.graph.initializer if t.data_type == TensorProto.FLOAT]
    assert not [dims for _, dims, _, _ in weight_dqs if dims in float_dims]
    result = check_onnx(path, model, (batch(1, shape),))
    assert result.points == len(fake_quant_nodes(model))  # each compared bit for bit


def _sequential_w8a8_onnx(tmp_path):
    """(float model, converted model, x, path of the converted model's ONNX file)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    x = torch.randn(4, 16)
    gm = prepare_pt2e(torch.export.export(model, (x,)).module(), FakeQuantQuantizer(presets.get_preset("w8a8")))
    gm(x)
    converted = convert_pt2e(gm)
    path = tmp_path / "sequential.onnx"
    to_onnx(converted, (x,), path)
    return model, converted, x, path


def test_check_onnx_takes_an_input_named_like_a_builtin(tmp_path):
    """nn.Sequential's forward argument is `input`, which FX renames in the
    program's module (`input_1`); the first point reads it."""
    _, converted, _, path = _sequential_w8a8_onnx(tmp_path)
    assert check_onnx(path, converted, (torch.randn(4, 16),)).points == len(fake_quant_nodes(converted))


def test_check_onnx_refuses_the_float_model_for_a_quantized_file(tmp_path):
    # The float model has no point to check, so every comparison would pass vacuously.
    model, converted, x, path = _sequential_w8a8_onnx(tmp_path)
    points = len(fake_quant_nodes(converted))
    with pytest.raises(AssertionError, match=rf"the model has no fake-quant point.*the file has {points} point\(s\): "
                                             "pass the converted model it was exported from, not the float model"):
        check_onnx(path, model, (x,))


@pytest.mark.parametrize("activation", [q.QSpec(q.INT8, q.PerToken(), "asymmetric", dynamic=True),
                                        q.QSpec(q.FP8_E4M3, q.PerToken(), dynamic=True)], ids=["int8", "fp8"])
def test_dynamic_per_token_activations_with_a_dynamic_batch(activation, tmp_path):
    """3-D activations (batch, tokens, features) into Linear layers with bias:
    the case of ORT's MatMulAddFusion bug, which check_onnx works around.
    FP8: the zero point of a scale whose shape follows the batch is filled
    at run time, which ORT's Expand cannot do in FP8 (the session refused
    the file)."""
    dynamic = ({0: torch.export.Dim("batch")},)
    shape = (2, 4, 64)
    model = ptq(activation,
                q.QSpec(q.INT4, q.PerGroup(16), "asymmetric", "minval"),
                q.QSpec(q.UINT8, scheme="asymmetric"), model=MLP(), shape=shape, dynamic_shapes=dynamic)
    path = tmp_path / "model.onnx"
    to_onnx(model, (batch(0, shape),), path, dynamic_shapes=dynamic)
    exported = onnx.load(path)
    assert exported.graph.input[0].type.tensor_type.shape.dim[0].dim_param  # symbolic batch
    # Per token: one scale per (batch, token), blocked over the whole feature dim.
    q_layouts = [{a.name: a.i for a in n.attribute if a.name in ("axis", "block_size")}
                 for n in exported.graph.node if n.op_type == "QuantizeLinear"]
    assert {"axis": 2, "block_size": 64} in q_layouts and {"axis": 2, "block_size": 32} in q_layouts
    for n in (1, 5):
        check_onnx(path, model, (batch(1, (n, 4, 64)),))


@pytest.mark.parametrize("gran", [q.PerTensor(), q.PerToken(), q.PerChannel(1), q.PerGroup(16)], ids=repr)
def test_dynamic_fp8_scales_run_bit_for_bit(gran, tmp_path):
    """to_onnx traces a dynamic FP8 point's scale as one op where its blocks
    span whole dimensions (export/onnx/scale.py; PerGroup takes the ATen
    ops): either way ONNX Runtime computes the scale torch does, so every
    point is bit-exact, NaN and +-Inf included."""
    shape = (2, 4, 64)
    model = ptq(q.QSpec(q.FP8_E4M3, gran, dynamic=True), q.QSpec(q.FP8_E4M3, q.PerChannel(0)), model=MLP(),
                shape=shape)
    path = tmp_path / "model.onnx"
    to_onnx(model, (batch(0, shape),), path)
    ops = _ops(onnx.load(path))
    activations = ops.count("QuantizeLinear")
    assert activations >= 2 and ops.count("ReduceMax") == activations  # one computed scale per activation point
    x = batch(1, shape)
    x[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    x[-1, 1] = float("nan")  # a token (a group, a channel's row) with no finite value
    assert check_onnx(path, model, (x,)).points == ops.count("DequantizeLinear")  # one DQ per point


def _standalone_point(spec, x):
    """A calibrated, converted FakeQuantize as a model of its own."""
    point = q.FakeQuantize(spec)
    point(x)
    point.convert(point, None)
    return point


@pytest.mark.parametrize("rows", [2, 3])
def test_a_dynamic_point_blocked_along_a_dynamic_batch_runs_at_every_batch_size(rows, tmp_path):
    """The block count ceil(batch / rows) is computed in the graph: the
    exporter writes a symbolic floor division as ONNX's truncating Div, so
    -(-batch // rows) came out as floor(batch / rows) there and ONNX Runtime
    refused the scale at every batch size that is not a multiple of rows."""
    spec = q.QSpec(q.INT8, q.PerBlock((rows, 1)), "asymmetric", dynamic=True)
    point = _standalone_point(spec, torch.randn(8, 16))
    path = tmp_path / "point.onnx"
    to_onnx(point, (torch.randn(8, 16),), path, dynamic_shapes=({0: torch.export.Dim("batch")},))
    session = ort_session(path)
    for b in (0, 1, 2, 5):
        x = torch.randn(b, 16, generator=torch.Generator().manual_seed(b))
        (y,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        assert torch.equal(torch.from_numpy(y), min_max_reference(spec, x)), b


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_are_quantized_in_fp32(dtype, tmp_path):
    x = batch(40, (4, 32)).to(dtype)
    static = _standalone_point(q.QSpec(q.INT16, scheme="symmetric_narrow"), x)
    dynamic = _standalone_point(q.QSpec(q.INT4, q.PerToken(), "asymmetric", "minval", dynamic=True), x)
    for point, atol in ((static, None), (dynamic, 1.0)):  # a computed scale is no constant step
        path = tmp_path / "point.onnx"
        to_onnx(point, (x,), path)
        if dtype == torch.bfloat16:  # exported, but ORT's Python API takes no bfloat16 arrays
            with pytest.raises(TypeError, match="bfloat16"):
                check_onnx(path, point, (batch(41, (4, 32)).to(dtype),), atol=atol)
        else:
            check_onnx(path, point, (batch(41, (4, 32)).to(dtype),), atol=atol)


def test_qat_conv_bn_exports_folded(tmp_path):
    model = qat_converted()
    x = batch(30, QAT_SHAPE)
    path = tmp_path / "qat.onnx"
    to_onnx(model, (x,), path)
    assert "BatchNormalization" not in _ops(onnx.load(path))
    # The folded weight fake-quantizes to the same bits: every point compares exactly.
    assert check_onnx(path, model, (batch(31, QAT_SHAPE),)).points == len(fake_quant_nodes(model))


def test_w8a8_file_is_at_most_35_percent_of_the_float_file(tmp_path):
    x = batch(0, (2, 256))
    float_model = MLP(width=256, hidden=256, layers=3).eval()
    torch.onnx.export(float_model, (x,), tmp_path / "float.onnx", dynamo=True, external_data=False)
    gm = prepare_pt2e(torch.export.export(float_model, (x,)).module(), FakeQuantQuantizer(presets.get_preset("w8a8")))
    gm(x)
    to_onnx(convert_pt2e(gm), (x,), tmp_path / "w8a8.onnx")
    float_bytes = (tmp_path / "float.onnx").stat().st_size
    w8a8_bytes = (tmp_path / "w8a8.onnx").stat().st_size
    print(f"float {float_bytes} bytes, w8a8 {w8a8_bytes} bytes ({100 * w8a8_bytes / float_bytes:.1f}%)")
    assert w8a8_bytes <= 0.35 * float_bytes
    # A file that to_onnx did not write has no map of its points.
    with pytest.raises(AssertionError, match="no 'pt2e_fq.points' metadata"):
        check_onnx(tmp_path / "float.onnx", float_model, (x,))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("kind", ["fp8", "mx"])
def test_fp8_and_mxfp8_points_run_bit_for_bit(kind, dtype, tmp_path):
    model = FloatFormatModel(kind, dtype).eval()
    path = tmp_path / "model.onnx"
    to_onnx(model, (float_format_input(0),), path)
    exported = onnx.load(path)
    fp8 = "FLOAT8E4M3FN" if dtype == torch.float8_e4m3fn else "FLOAT8E5M2"
    if kind == "fp8":  # weights per output channel
        assert _weight_dqs(exported) == [(fp8, [3, 40, 1, 1], 0, 0), (fp8, [5, 48], 0, 0)]
    else:  # weights in blocks of 32 input channels, fp32 power-of-two scales
        assert _weight_dqs(exported) == [(fp8, [3, 40, 1, 1], 1, 32), (fp8, [5, 48], 1, 32)]
    assert _activation_types(exported) <= {fp8}
    x = float_format_input(1)
    x[1, 35, 0, 0], x[2, 3, 1, 1], x[0, 36, 1, 0] = float("nan"), float("inf"), -float("inf")
    assert check_onnx(path, model, (x,)).points == 4


def test_e2m1_formats_are_refused_with_the_reason(tmp_path):
    class Point(nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, x):
            return self.fn(x)

    fp4 = torch.float4_e2m1fn_x2
    for fn in (lambda x: q.ops.fake_quantize_float(x, x.shape, torch.ones(1, 1), fp4),
               lambda x: q.ops.fake_quantize_mx(x, fp4, 32, -1),
               lambda x: q.ops.fake_quantize_nvfp4(x, None, -1)):
        with pytest.raises(NotImplementedError, match="neither QuantizeLinear nor DequantizeLinear for FLOAT4E2M1"):
            to_onnx(Point(fn), (torch.randn(4, 32),), tmp_path / "m.onnx")


def test_check_onnx_fails_when_onnx_runtime_and_torch_disagree(tmp_path):
    model = ptq(INT8_ASYM, q.QSpec(q.INT8, q.PerChannel(0)))
    path = tmp_path / "model.onnx"
    to_onnx(model, (batch(0),), path)
    other = ptq(INT8_ASYM, q.QSpec(q.INT4, q.PerChannel(0)))
    with pytest.raises(AssertionError, match="bit-exact"):
        check_onnx(path, other, (batch(1),))


def test_to_onnx_errors_name_the_problem(tmp_path):
    model = ptq(INT8_ASYM, q.QSpec(q.INT8, q.PerChannel(0)))
    with pytest.raises(ValueError, match=r"opset must be an int from 21 \(int4, int16 and blocked Q/DQ\) to"):
        to_onnx(model, (batch(0),), tmp_path / "m.onnx", opset=20)

    class ReturnsMask(nn.Module):
        def forward(self, x):
            return q.ops.fake_quantize_affine_with_mask(x, x.shape, torch.ones(1, 1), None, -128, 127)

    with pytest.raises(NotImplementedError, match="clamp mask"):
        to_onnx(ReturnsMask(), (torch.randn(4, 8),), tmp_path / "m.onnx")

    # A computed scale blocked along two dims cannot be a single ONNX Q/DQ.
    point = _standalone_point(q.QSpec(q.INT8, q.PerBlock((2, 4)), dynamic=True), torch.randn(4, 8))
    with pytest.raises(Exception, match="ONNX blocks along one axis only"):
        to_onnx(point, (torch.randn(4, 8),), tmp_path / "m.onnx")


@pytest.mark.parametrize("opset", [onnx.defs.onnx_opset_version() + 1, 99, True, 21.0, "21"])
def test_to_onnx_refuses_an_opset_it_cannot_write_before_any_work(opset, tmp_path):
    """torch.onnx, asked for an opset newer than the onnx
    package defines, logged a traceback and wrote an opset-18 file that ONNX
    Runtime refuses. The check comes first: nothing is exported or written,
    and a file already at the path is left alone."""
    path = tmp_path / "m.onnx"
    path.write_bytes(b"an older export")
    newest = onnx.defs.onnx_opset_version()

    class Unexportable(nn.Module):  # would fail in torch.export if the check came later
        def forward(self, x):
            return x.item()

    with pytest.raises(ValueError, match=rf"^to_onnx: opset must be an int from 21 \(.*\) to {newest} \(the newest "
                                         rf"opset of the installed onnx {onnx.__version__}\), got {opset!r}$"):
        to_onnx(Unexportable(), (torch.randn(2),), path, opset=opset)
    assert path.read_bytes() == b"an older export"


def test_to_onnx_writes_the_opset_asked_for(tmp_path):
    model = ptq(INT8_ASYM, q.QSpec(q.INT8, q.PerChannel(0)))
    path = tmp_path / "m.onnx"
    to_onnx(model, (batch(0),), path, opset=23)
    assert {o.domain: o.version for o in onnx.load(path).opset_import}[""] == 23
    assert check_onnx(path, model, (batch(1),)).points == len(fake_quant_nodes(model))
