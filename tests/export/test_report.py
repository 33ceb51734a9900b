"""pt2e_fq.report: one row per fake-quant point with its role, qparam
ranges, clipped share and SQNR; float vs quantized weight bytes."""

from __future__ import annotations

import io
import math

import pytest
import torch
from tests.models.mlp import ReluMLP
from tests.models.quantized import batch, fake_quant_nodes, ptq, qat_prepared

import pt2e_fq as q
from pt2e_fq import reference

aten = torch.ops.aten
INT8_W = q.QSpec(q.INT8, q.PerChannel(0), "symmetric_narrow")


def _expected_roles(gm) -> dict[str, str]:
    """Each point's role, read off the graph by hand for ConvLinear /
    ConvBnReluLinear (conv -> [bn] -> relu -> flatten -> linear)."""
    roles = {}
    for node in fake_quant_nodes(gm):
        src, (user, *_) = node.args[0], list(node.users)
        if user.target in (aten.conv2d.default, aten.linear.default) and user.args[1] is node:
            roles[node.target] = f"weight of {user.name}"
        elif src.op == "placeholder":
            roles[node.target] = f"input of {user.name}"
        elif user.op == "output":
            roles[node.target] = f"output of {src.name}"
        else:
            roles[node.target] = f"output of {src.name}, input of {user.name}"
    return roles


@pytest.mark.parametrize("which", ["ptq-converted", "qat-prepared"])
def test_every_point_is_listed_once_with_its_role(which):
    gm = ptq(q.QSpec(q.INT8, scheme="asymmetric"), INT8_W) if which == "ptq-converted" else qat_prepared()
    rows = q.report(gm, (batch(5, (2, 3, 6, 6) if which == "ptq-converted" else (8, 3, 8, 8)),), file=None).rows
    points = [r["point"] for r in rows]
    assert sorted(points) == sorted(n.target for n in fake_quant_nodes(gm))
    assert len(set(points)) == len(points) == 6
    expected = _expected_roles(gm)
    assert {r["point"]: r["role"] for r in rows} == expected
    assert sorted(expected.values())[0].startswith("input of conv2d")
    assert sum(v.startswith("weight of") for v in expected.values()) == 2
    assert {r["module"] for r in rows if r["role"].startswith("weight of")} == {"conv", "fc"}


def test_clipped_share_sqnr_and_qparams_match_a_hand_computation():
    gm = ptq(q.QSpec(q.INT8, scheme="asymmetric"), INT8_W)
    x = 3 * batch(6)  # wider than the calibration data: the input point clips
    rows = {r["point"]: r for r in q.report(gm, (x,), file=None).rows}
    node = next(n for n in fake_quant_nodes(gm) if n.args[0].op == "placeholder")
    point = gm.get_submodule(node.target)
    s, zp = point.scale.reshape(()), point.zero_point.reshape(())
    codes = torch.round(x / s) + zp
    clipped = ((codes < -128) | (codes > 127)).float().mean().item()
    y, _ = reference.fake_quantize_affine(x, x.shape, point.scale, point.zero_point, -128, 127)
    sqnr = 10 * math.log10((x.double() ** 2).sum() / ((x.double() - y.double()) ** 2).sum())
    row = rows[node.target]
    assert 0 < clipped and row["clipped"] == pytest.approx(clipped, abs=1e-7)
    assert row["sqnr_db"] == pytest.approx(sqnr, rel=1e-6)
    assert row["scale"] == (s.item(), s.item()) and row["zero_point"] == (zp.item(), zp.item())
    assert row["format"] == "INT8 asymmetric" and row["granularity"] == "PerTensor()"


def test_dynamic_points_report_the_qparams_of_the_live_tensor():
    gm = ptq(q.QSpec(q.INT8, q.PerToken(), "asymmetric", dynamic=True),
             q.QSpec(q.INT4, q.PerGroup(16), "asymmetric", "minval"), q.QSpec(q.UINT8, scheme="asymmetric"))
    x = batch(7)
    rows = {r["point"]: r for r in q.report(gm, (x,), file=None).rows}
    node = next(n for n in fake_quant_nodes(gm) if n.args[0].op == "placeholder")
    lo, hi = x.amin(-1).clamp(max=0), x.amax(-1).clamp(min=0)
    scales = (hi - lo) / 255
    row = rows[node.target]
    assert row["scale"] == pytest.approx((scales.min().item(), scales.max().item()), rel=1e-6)
    assert row["clipped"] == 0.0 and row["granularity"] == "PerToken() dynamic"
    weight_row = next(r for r in rows.values() if r["role"] == "weight of linear")
    assert weight_row["minval"] is not None and weight_row["zero_point"] is None
    assert weight_row["format"] == "INT4 asymmetric minval"


def test_weight_bytes_summary_and_printed_table():
    gm = ptq(q.QSpec(q.INT8, scheme="asymmetric"), INT8_W)
    out = io.StringIO()
    result = q.report(gm, (batch(8),), file=out)
    # ConvLinear: conv 4x3x3x3 + 4, fc 5x64 + 5 parameters, fp32.
    assert result.float_weight_bytes == (108 + 4 + 320 + 5) * 4
    # int8 weights, one fp32 scale and one int8 zero point per output channel, fp32 biases.
    assert result.quantized_weight_bytes == (108 + 320) + (4 + 5) * (4 + 1) + (4 + 5) * 4
    text = out.getvalue()
    assert "SQNR dB" in text and "weight of conv2d" in text
    assert "weights: 1,748 bytes in float, 509 bytes quantized (29.1%)" in text


def test_report_leaves_the_model_alone_and_names_a_bad_model():
    gm = ptq(q.QSpec(q.INT8, scheme="asymmetric"), INT8_W, convert=False)  # observers still on
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    q.report(gm, (10 * batch(9),), file=None)
    after = gm.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(TypeError, match="report: model must be the torch.fx.GraphModule"):
        q.report(torch.nn.Linear(2, 2), (torch.randn(1, 2),))


# The granularity each preset's weight of fc1 (64 x 64) gets, written out by hand.
WEIGHT_GRANULARITY = {
    "w8a8": "PerChannel(axis=0)",
    "w4a8": "PerGroup(group_size=32, axis=1)",
    "w4a16": "PerGroup(group_size=32, axis=1)",
    "fp8": "PerChannel(axis=0)",
    "mxfp8": "PerGroup(group_size=32, axis=1) dynamic",
    "nvfp4": "PerGroup(group_size=16, axis=1)",
    "w8a8-dyn": "PerChannel(axis=0)",  # its activations per token (PerToken() dynamic, as the model says)
}


@pytest.mark.parametrize("preset", list(WEIGHT_GRANULARITY))
def test_a_saved_program_reports_what_its_model_reports(preset, tmp_path):
    """A program has op calls where the model had modules: the same rows,
    with the format and granularity read off the op's arguments."""
    from pt2e_fq.cli import pipeline

    torch.manual_seed(0)
    x = torch.randn(8, 64)
    converted = pipeline.quantize(ReluMLP().eval(), (x,), preset, calibration=[torch.randn(8, 64) for _ in range(3)],
                                  progress=False)
    torch.export.save(torch.export.export(converted, (x,)), tmp_path / "m.pt2")
    program = q.load(tmp_path / "m.pt2")
    from_model = q.report(converted, (x,), file=None)
    from_program = q.report(program, file=None)  # runs on the example inputs saved in the file
    assert sorted(r["point"] for r in from_program.rows) == sorted(r["point"] for r in from_model.rows)
    by_point = {r["point"]: r for r in from_model.rows}
    for row in from_program.rows:
        expected = by_point[row["point"]]
        for key in ("module", "role", "scale", "zero_point", "minval", "clipped", "sqnr_db"):
            assert row[key] == expected[key], (row["point"], key)
        assert row["granularity"] == expected["granularity"]
    assert from_program.quantized_weight_bytes == from_model.quantized_weight_bytes
    assert from_program.float_weight_bytes == from_model.float_weight_bytes
    weight = next(r for r in from_program.rows if r["role"] == "weight of linear")
    assert weight["granularity"] == WEIGHT_GRANULARITY[preset]
    int_ranges = {"w8a8": "INT8 [-127, 127]", "w4a8": "INT4 [-8, 7]", "w4a16": "INT4 [-8, 7] minval",
                  "w8a8-dyn": "INT8 [-128, 127]"}
    assert weight["format"] == int_ranges.get(preset, by_point[weight["point"]]["format"])


def test_a_program_without_example_inputs_needs_them():
    torch.manual_seed(0)
    program = torch.export.export(ReluMLP(), (torch.randn(2, 64),))
    program.example_inputs = None
    with pytest.raises(ValueError, match="saved without example inputs; pass example_inputs"):
        q.report(program, file=None)
    assert q.report(program, (torch.randn(2, 64),), file=None).rows == []  # no fake-quant point


# ---------------------------------------------------------------------------
# Nothing (or no weight) quantized: the summary says so instead of "(nan%)" or "100.0%"


class _ReluOnly(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x)


def test_a_float_model_or_program_reports_that_nothing_is_quantized():
    x = torch.randn(2, 64)
    cases = [
        (torch.export.export(_ReluOnly(), (x,)).module(), (x,), 0),
        (torch.export.export(ReluMLP(), (x,)).module(), (x,), (64 * 64 + 64 + 8 * 64 + 8) * 4),
        (torch.export.export(ReluMLP(), (x,)), None, (64 * 64 + 64 + 8 * 64 + 8) * 4),
    ]
    for model, inputs, float_bytes in cases:
        out = io.StringIO()
        result = q.report(model, inputs, file=out)
        assert result.rows == []
        last = out.getvalue().strip().splitlines()[-1]
        assert last == (
            f"no fake-quant points: nothing is quantized (weights: {float_bytes:,} bytes in float); report a model "
            "from prepare_pt2e / convert_pt2e, or a program saved from one"
        )


def test_activations_only_report_no_quantized_weights():
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from quantizers import FakeQuantQuantizer, OpConfig, QuantizerConfig

    act = q.QSpec(q.INT8, q.PerTensor(), "asymmetric")
    x = torch.randn(2, 64)
    gm = torch.export.export(ReluMLP(), (x,)).module()
    gm = prepare_pt2e(gm, FakeQuantQuantizer(QuantizerConfig(OpConfig(input_activation=act, output_activation=act))))
    gm(x)
    out = io.StringIO()
    result = q.report(convert_pt2e(gm), (x,), file=out)
    assert result.rows and all(not r["role"].startswith("weight") for r in result.rows)
    float_bytes = (64 * 64 + 64 + 8 * 64 + 8) * 4
    assert out.getvalue().strip().splitlines()[-1] == f"weights: {float_bytes:,} bytes in float, none quantized (activations only)"


class _TiedEmbeddingHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(128, 64)
        self.head = torch.nn.Linear(64, 128, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids))


def test_a_weight_that_two_points_read_counts_its_float_bytes_once(tmp_path):
    """A tied embedding and LM head, each reader with its own format: the
    float tensor (128 x 64 fp32) is stored once and replaced by one
    quantized copy per point."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from quantizers import FakeQuantQuantizer, OpConfig, presets

    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 5))
    config = presets.get_preset("w4a16")  # the embedding: int4, groups of 32 along the row, a scale and minval each
    config.set_module_name("head", OpConfig(weight=presets.get_preset("w8a8").global_config.weight))  # int8 per row
    gm = prepare_pt2e(torch.export.export(_TiedEmbeddingHead().eval(), (ids,)).module(), FakeQuantQuantizer(config))
    gm(ids)
    converted = convert_pt2e(gm)
    int8_head = 128 * 64 + 128 * (4 + 1)  # int8 codes, an fp32 scale and an int8 zero point per row
    int4_embedding = 128 * 64 // 2 + (128 * 64 // 32) * (4 + 4)  # int4 codes, an fp32 scale and minval per group
    path = tmp_path / "tied.pt2"
    torch.export.save(torch.export.export(converted, (ids,)), path)
    for model, inputs in ((converted, (ids,)), (q.load(path), None)):
        result = q.report(model, inputs, file=None)
        assert sorted(r["role"] for r in result.rows) == ["weight of embedding", "weight of linear"]
        assert result.float_weight_bytes == 128 * 64 * 4
        assert result.quantized_weight_bytes == int8_head + int4_embedding
