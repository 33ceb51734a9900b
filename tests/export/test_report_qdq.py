"""pt2e_fq.report of a lowered q/dq program (to_qdq): one row per quantize ->
dequantize pair or dequantize of stored codes, in the fake-quant report's
layout, checked against the config each model was quantized with and
against the report of the fake-quant program it was lowered from."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.nn as nn
from tests.models.mlp import ReluMLP
from tests.models.quantized import batch, ptq

import pt2e_fq as q
from pt2e_fq.cli import pipeline
from pt2e_fq.export import to_qdq

ACT = q.QSpec(q.INT8, q.PerTensor(), "asymmetric")


def _saved(program: torch.export.ExportedProgram, path) -> torch.export.ExportedProgram:
    torch.export.save(program, path)
    return q.load(path)


def _reports(model, x, tmp_path, target="generic", unsupported="error"):
    """(report of the saved fake-quant program, report of the saved q/dq program lowered from it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unsupported="keep" / "float" warn with the list of points
        lowered = to_qdq(model, x, target=target, unsupported=unsupported)
    fake_quant = _saved(torch.export.export(model, (x,)), tmp_path / "fq.pt2")
    return q.report(fake_quant, file=None), q.report(_saved(lowered, tmp_path / "qdq.pt2"), file=None)


def _relu_mlp(preset: str):
    """ReluMLP (fc1 64x64, relu, fc2 8x64) quantized with `preset`, and its example batch."""
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    return pipeline.quantize(ReluMLP().eval(), (x,), preset, calibration=[torch.randn(8, 64)], progress=False,
                             algorithms=False), x


def _lowered(model, x) -> torch.export.ExportedProgram:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the lowering warns with the list of points it keeps
        return to_qdq(model, (x,))


def _by_role(result) -> dict:
    return {r["role"]: r for r in result.rows}


# ConvLinear (conv 4x3x3x3 -> relu -> flatten -> linear 5x64) with LinearConvQuantizer: each case's
# (activation, weight) specs, target, the q/dq ops it lowers to, and the rows written out by hand:
# the weights' format and granularity (conv, fc), the activations' (format before the scheme, which
# their zero points tell: symmetric where all are 0).
CASES = {
    "per-tensor weights": (
        ACT, q.QSpec(q.INT8, q.PerTensor(), "symmetric"), "generic",
        {"quantize_per_tensor", "dequantize_per_tensor"},
        ("INT8 [-128, 127] symmetric", "PerTensor()", "PerTensor()"),
        ("INT8 [-128, 127]", "PerTensor()"),
    ),
    "per-channel activations": (
        q.QSpec(q.INT8, q.PerChannel(1), "asymmetric"), q.QSpec(q.INT8, q.PerChannel(0), "symmetric_narrow"),
        "generic",
        {"quantize_per_channel", "dequantize_per_channel"},
        ("INT8 [-127, 127] symmetric", "PerChannel(axis=0)", "PerChannel(axis=0)"),
        ("INT8 [-128, 127]", "PerChannel(axis=1)"),
    ),
    "per-group weights": (
        ACT, q.QSpec(q.INT4, q.PerGroup(16, 1), "asymmetric", observer=q.CurrentMinMaxObserver()), "generic",
        {"quantize_per_tensor", "dequantize_affine"},
        # The conv's 3 input channels are one group shorter than 16.
        ("INT4 [-8, 7] asymmetric, int8 codes", "PerGroup(group_size=3, axis=1)", "PerGroup(group_size=16, axis=1)"),
        ("INT8 [-128, 127]", "PerTensor()"),
    ),
    "x86 inductor": (
        ACT, q.QSpec(q.INT8, q.PerTensor(), "symmetric"), "x86_inductor",
        {"quantize_per_tensor", "dequantize_per_channel"},
        # A per-tensor weight repeats its scale per output channel; activations are uint8.
        ("INT8 [-128, 127] symmetric", "PerChannel(axis=0)", "PerChannel(axis=0)"),
        ("UINT8 [0, 255]", "PerTensor()"),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_qdq_point_is_a_row_with_its_config_and_the_fake_quant_reports_qparams(case, tmp_path):
    activation, weight, target, ops, (w_format, conv_granularity, fc_granularity), (a_format, a_granularity) = \
        CASES[case]
    model, x = ptq(activation, weight), batch(9)
    fake_quant, lowered = _reports(model, x, tmp_path, target)
    program = q.load(tmp_path / "qdq.pt2")
    assert ops <= {n.target.__name__.split(".")[0] for n in program.graph.nodes if n.op == "call_function"}
    # Every point once, by the FakeQuantize name it was traced from, in the same module and role.
    expected = {r["point"]: r for r in fake_quant.rows}
    traced = [r for r in lowered.rows if r["point"] in expected]
    assert sorted((r["point"], r["module"], r["role"]) for r in traced) == \
        sorted((r["point"], r["module"], r["role"]) for r in fake_quant.rows)
    # Inductor wants a pair in front of each op: the relu's pair is repeated after the flatten,
    # its own row, named after its dequantize node.
    repeated = [r for r in lowered.rows if r["point"] not in expected]
    assert [r["role"].partition(", input of quantize_per_tensor")[0] for r in repeated] == \
        (["output of flatten"] if target == "x86_inductor" else [])
    assert all(r["scale"] == _by_role(lowered)["output of relu, input of flatten"]["scale"] for r in repeated)
    shift = 128 if target == "x86_inductor" else 0  # Inductor's uint8: int8 codes and zero point + 128
    for row in traced:
        ref = expected[row["point"]]
        if row["role"].startswith("weight"):
            assert row["format"] == w_format
            assert row["granularity"] == (conv_granularity if row["module"] == "conv" else fc_granularity)
            # Stored as codes: nothing to measure the clipped share or SQNR against.
            assert row["codes_only"] and row["clipped"] is None and row["sqnr_db"] is None
            assert row["scale"] == pytest.approx(ref["scale"])
        else:
            assert row["granularity"] == a_granularity == ref["granularity"]
            assert row["scale"] == ref["scale"]
            assert row["zero_point"] == tuple(zp + shift for zp in ref["zero_point"])
            scheme = "symmetric" if row["zero_point"] == (0, 0) else "asymmetric"
            assert row["format"] == f"{a_format} {scheme}"
            # The runtime's quantize rounds x * (1 / scale): a tie now and then goes the other way.
            assert row["clipped"] == pytest.approx(ref["clipped"], abs=0.01)
            assert row["sqnr_db"] == pytest.approx(ref["sqnr_db"], abs=0.5)
    # The same weight bytes: codes at the format's width, an fp32 scale and a zero point per block.
    assert lowered.float_weight_bytes == fake_quant.float_weight_bytes == (108 + 4 + 320 + 5) * 4
    if case != "x86 inductor":  # which stores a per-tensor weight's scale once per channel
        assert lowered.quantized_weight_bytes == fake_quant.quantized_weight_bytes
    assert lowered.unread_qdq == [] and lowered.float_weight_ops == []


def test_a_hand_counted_w8a8_program_and_its_printed_table(tmp_path):
    model, x = _relu_mlp("w8a8")
    program = _saved(_lowered(model, x), tmp_path / "qdq.pt2")
    out = io.StringIO()
    result = q.report(program, file=out)
    rows = _by_role(result)
    assert set(rows) == {"weight of linear", "weight of linear_1", "input of linear", "output of relu, input of linear_1"}
    for role, module in (("weight of linear", "fc1"), ("weight of linear_1", "fc2")):
        assert rows[role]["module"] == module
        assert (rows[role]["format"], rows[role]["granularity"]) == ("INT8 [-127, 127] symmetric", "PerChannel(axis=0)")
    assert rows["input of linear"]["format"] == "INT8 [-128, 127] asymmetric"
    # fc1 64x64 + 64, fc2 8x64 + 8, fp32; int8 codes, an fp32 scale and an int8 zero point per row.
    assert result.float_weight_bytes == 18_720
    assert result.quantized_weight_bytes == (64 * 64 + 8 * 64) + 72 * (4 + 1) + 72 * 4
    text = out.getvalue()
    assert "note: n/a: 2 weight(s) held as integer codes" in text
    assert text.strip().splitlines()[-1] == "weights: 18,720 bytes in float, 5,256 bytes quantized (28.1%)"


@pytest.mark.parametrize("preset, weight_format, weight_granularity", [
    ("w8a8-dyn", "INT8 [-128, 127] symmetric", "PerChannel(axis=0)"),
    ("w4a8-dyn", "INT4 [-8, 7] symmetric, int8 codes", "PerGroup(group_size=32, axis=1)"),
])
def test_dynamic_per_token_chains_are_rows(preset, weight_format, weight_granularity, tmp_path):
    """choose_qparams_affine -> quantize_affine -> dequantize_affine: the
    per-token qparams of the live tensor, asymmetric as chosen."""
    model, x = _relu_mlp(preset)
    fake_quant, lowered = _reports(model, x, tmp_path, target="xnnpack")
    rows, expected = _by_role(lowered), _by_role(fake_quant)
    assert set(rows) == set(expected)
    for role in ("input of linear", "output of relu, input of linear_1"):
        assert rows[role]["format"] == "INT8 [-128, 127] asymmetric"
        assert rows[role]["granularity"] == expected[role]["granularity"] == "PerToken() dynamic"
        # torchao's per-token qparams, as the fake-quant op's within fp32 rounding.
        assert rows[role]["scale"] == pytest.approx(expected[role]["scale"], rel=1e-5)
        assert rows[role]["sqnr_db"] == pytest.approx(expected[role]["sqnr_db"], abs=0.5)
    for role in ("weight of linear", "weight of linear_1"):
        assert (rows[role]["format"], rows[role]["granularity"]) == (weight_format, weight_granularity)
    assert lowered.quantized_weight_bytes == fake_quant.quantized_weight_bytes
    assert lowered.unread_qdq == []


def test_kept_points_are_rows_beside_the_qdq_rows(tmp_path):
    """unsupported="keep": FP8 activations stay pt2e_fq ops, with the rows
    they have in the fake-quant program, beside the lowered weights'."""
    model, x = ptq(q.QSpec(q.FP8_E4M3, q.PerTensor()), q.QSpec(q.INT8, q.PerChannel(0), "symmetric")), batch(9)
    fake_quant, lowered = _reports(model, x, tmp_path, unsupported="keep")
    rows, expected = _by_role(lowered), _by_role(fake_quant)
    assert set(rows) == set(expected)
    for role, row in rows.items():
        if role.startswith("weight"):
            assert row["codes_only"] and row["format"] == "INT8 [-128, 127] symmetric"
        else:
            assert row == expected[role] and row["format"] == "FP8_E4M3"
    assert lowered.quantized_weight_bytes == fake_quant.quantized_weight_bytes


def test_a_weight_the_lowering_stores_as_float_is_named_and_counted_float(tmp_path):
    """XNNPACK quantizes a linear only when its output is quantized: w8a8
    leaves fc2's output float, so to_qdq stores fc2's weight as its
    fake-quantized floats, which the float-weights warning names."""
    model, x = _relu_mlp("w8a8")
    fake_quant, lowered = _reports(model, x, tmp_path, target="xnnpack", unsupported="float")
    assert sorted(r["role"] for r in lowered.rows if r["role"].startswith("weight")) == ["weight of linear"]
    assert [(op["module"], [shape for _, shape in op["weights"]]) for op in lowered.float_weight_ops] == \
        [("fc2", [(8, 64)])]
    assert lowered.float_weight_bytes == fake_quant.float_weight_bytes == 18_720
    fc2_quantized = 8 * 64 + 8 * (4 + 1)  # what the fake-quant program counts for fc2's int8 weight
    assert lowered.quantized_weight_bytes == fake_quant.quantized_weight_bytes - fc2_quantized + 8 * 64 * 4


class _UnreadOps(nn.Module):
    """q/dq ops the lowering does not write: quantized_decomposed's dynamic
    per-tensor chain (tensor qparams), and a quantize whose codes are the output."""

    def forward(self, x):
        qd = torch.ops.quantized_decomposed
        scale, zero_point = qd.choose_qparams.tensor(x, -128, 127, 1e-5, torch.int8)
        codes = qd.quantize_per_tensor.tensor(x, scale, zero_point, -128, 127, torch.int8)
        y = qd.dequantize_per_tensor.tensor(codes, scale, zero_point, -128, 127, torch.int8)
        return y, qd.quantize_per_tensor(x, 0.1, 0, -128, 127, torch.int8)


def test_qdq_ops_the_report_cannot_read_are_named(tmp_path):
    x = torch.randn(2, 8)
    out = io.StringIO()
    result = q.report(_saved(torch.export.export(_UnreadOps(), (x,)), tmp_path / "u.pt2"), file=out)
    assert result.rows == []
    assert len(result.unread_qdq) == 4
    assert "quantize_per_tensor_1 (quantized_decomposed.quantize_per_tensor.default): no dequantize reads its codes" \
        in result.unread_qdq
    assert sum("an op the report does not read" in u for u in result.unread_qdq) == 3
    lines = out.getvalue().strip().splitlines()
    assert lines[-2].startswith("warning: 4 quantize / dequantize op(s) not read as points: ")
    assert lines[-1] == "no point read (weights: 0 bytes in float); the quantize / dequantize ops above are not read"


def test_the_graph_module_of_a_qdq_program_reports_the_same_points(tmp_path):
    """report(to_qdq(...).module(), x): the q/dq ops read from the
    GraphModule, as from the program, against the hand-known layout."""
    model, x = _relu_mlp("w8a8")
    program = _lowered(model, x)
    from_module = _by_role(q.report(program.module(), (x,), file=None))
    from_program = _by_role(q.report(program, (x,), file=None))
    assert set(from_module) == {"weight of linear", "weight of linear_1", "input of linear",
                                "output of relu, input of linear_1"}
    for role, row in from_module.items():
        assert (row["format"], row["granularity"]) == (from_program[role]["format"], from_program[role]["granularity"])
        assert row["scale"] == from_program[role]["scale"]
    assert from_module["weight of linear"]["granularity"] == "PerChannel(axis=0)"
