"""Linears written as addmm (transformers' Conv1D, GPT-2), mm and einsum are
quantized as linears, with one weight scale per output channel whichever
side the weight is stored on; an op with weights that no
pattern covers (an LSTM) is named by describe, by a warning at annotate and
by report.

References: each weight's fake-quantized value is computed here by hand
(int8 symmetric narrow, one scale per output channel: amax / 127), and a
tiny GPT-2 is compared with its float self."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e
from tests.models.quantizer import single_thread, sqnr_db  # noqa: F401 (an autouse fixture)

import pt2e_fq
from pt2e_fq.cli import pipeline
from quantizers import FakeQuantQuantizer, presets


def _per_output_channel_int8(w: torch.Tensor, out_axis: int) -> torch.Tensor:
    amax = w.abs().amax(dim=1 - out_axis, keepdim=True)
    scale = amax / 127
    return torch.clamp(torch.round(w / scale), -127, 127) * scale


class Linears(nn.Module):
    """Four linears of 8 -> 6 written four ways; weights (out, in) or (in, out)."""

    def __init__(self):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.conv1d = Conv1D(6, 8)  # addmm(bias, x, weight (in, out))
        self.w_out_in = nn.Parameter(torch.randn(6, 8))
        self.w_in_out = nn.Parameter(torch.randn(8, 6))
        self.w_mm = nn.Parameter(torch.randn(8, 6))

    def forward(self, x):  # x: (n, 8)
        return (self.conv1d(x) + torch.einsum("bi,oi->bo", x, self.w_out_in)
                + torch.einsum("b i, i o -> b o", x, self.w_in_out) + torch.mm(x, self.w_mm))


# parameter name -> axis of its output channels
OUT_AXIS = {"conv1d.weight": 1, "w_out_in": 0, "w_in_out": 1, "w_mm": 1}


def test_addmm_mm_and_einsum_linears_quantize_their_weights_per_output_channel():
    torch.manual_seed(0)
    model = Linears().eval()
    x = torch.randn(16, 8)
    prepared = pipeline.prepare(model, (x,), "w8a8")
    ops = {n.target for n in prepared.graph.nodes if n.op == "call_function"}
    aten = torch.ops.aten
    assert {aten.addmm.default, aten.einsum.default, aten.mm.default} <= ops
    pipeline.calibrate(prepared, [(x,)], progress=False)
    found = {}
    for node in prepared.graph.nodes:
        if node.op == "call_module" and node.args[0].op == "get_attr" and node.args[0].target in OUT_AXIS:
            weight = prepared.get_parameter(node.args[0].target)
            found[node.args[0].target] = (prepared.get_submodule(node.target)(weight), weight)
    assert found.keys() == OUT_AXIS.keys()
    for name, (fake_quantized, weight) in found.items():
        torch.testing.assert_close(fake_quantized, _per_output_channel_int8(weight.detach(), OUT_AXIS[name]),
                                   rtol=0, atol=0, msg=name)


def test_a_einsum_that_is_not_a_linear_is_left_alone():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 8))

        def forward(self, x):  # x: (n, 8); the weight's both indices are kept: no reduction over the input
            return torch.einsum("bi,ji->bji", x, self.w)

    gm = pipeline.export(Outer(), (torch.randn(2, 8),))
    table = FakeQuantQuantizer(presets.get_preset("w8a8")).describe(gm, print_table=False)
    assert "einsum" not in table.split("warning:")[0]  # not in the table of ops a config reaches
    assert "warning: 1 op(s) with weights stay in float" in table and "einsum (einsum) in module '': w (4, 8)" in table


class GPT2(nn.Module):
    def __init__(self):
        super().__init__()
        import transformers

        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                         use_cache=False, bos_token_id=0, eos_token_id=0)
        torch.manual_seed(0)
        self.m = transformers.GPT2LMHeadModel(config).eval()

    def forward(self, ids):
        return self.m(input_ids=ids, return_dict=False)[0]


def test_gpt2_s_conv1d_projections_are_quantized():
    """Every Conv1D (attention c_attn, c_proj; MLP c_fc, c_proj)
    kept its weight float under every preset; now each has a weight point."""
    model = GPT2()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 64, (8, 8), generator=g),) for _ in range(4)]
    converted = pipeline.quantize(model, batches[0], "w8a8", calibration=batches, progress=False)
    report = pt2e_fq.report(converted, batches[0], file=None)
    conv1d = sorted(r["module"] for r in report.rows if r["role"].startswith("weight of addmm"))
    assert conv1d == sorted(f"m.transformer.h.{i}.{p}" for i in range(2)
                            for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    # Only the embedding tables stay float: w8a8 leaves lookups float (quantizers.presets).
    assert sorted(op["module"] for op in report.float_weight_ops) == ["m.transformer.wpe", "m.transformer.wte"]
    ids = torch.randint(0, 64, (3, 8), generator=g)
    with torch.no_grad():
        assert sqnr_db(model(ids), converted(ids)) > 20


class WithLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.lstm = nn.LSTM(8, 4, batch_first=True)

    def forward(self, x):
        return self.lstm(self.fc(x))[0]


def test_an_op_with_weights_that_no_pattern_covers_is_named_by_describe_annotate_and_report():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    expected = ("1 op(s) with weights stay in float, no fake-quant point on their weights: lstm (lstm) in module "
                "'lstm': lstm.weight_ih_l0 (16, 8), lstm.weight_hh_l0 (16, 4)")
    quantizer = FakeQuantQuantizer(presets.get_preset("w8a8"))
    with pytest.warns(UserWarning, match="were assigned during export"):  # torch.export on nn.LSTM
        gm = pipeline.export(WithLSTM().eval(), (x,), dynamic_batch=False)
    assert "warning: " + expected in quantizer.describe(gm, print_table=False)
    with pytest.warns(UserWarning, match=re.escape(f"FakeQuantQuantizer: {expected}")):
        prepared = prepare_pt2e(gm, quantizer)
    pipeline.calibrate(prepared, [(x,)], progress=False)
    report = pt2e_fq.report(pipeline.convert(prepared), (x,), file=None)
    assert report.table().splitlines()[-2] == "warning: " + expected  # above the weights summary


class ViewedWeight(nn.Module):
    """A weight (out, in) = (6, 8), as nn.Linear stores it, read through a view."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.W = nn.Parameter(torch.randn(6, 8))

    def forward(self, x):  # x: (n, 8)
        if self.form == "t":
            return x @ self.W.t()
        if self.form == "mm_T":
            return torch.mm(x, self.W.T)
        if self.form == "transpose":
            return torch.matmul(x, self.W.transpose(0, 1))
        return x @ self.W.permute(1, 0)


@pytest.mark.parametrize("form", ["t", "mm_T", "transpose", "permute"])
def test_a_weight_read_through_a_view_gets_the_weight_qspec_per_output_channel(form):
    torch.manual_seed(0)
    model, x = ViewedWeight(form).eval(), torch.randn(16, 8)
    prepared = pipeline.prepare(model, (x,), "w8a8")
    pipeline.calibrate(prepared, [(x,)], progress=False)
    points = [n for n in prepared.graph.nodes if n.op == "call_module" and n.args[0].op == "call_function"
              and n.args[0].args[0].op == "get_attr"]
    assert len(points) == 1  # the point on the view the matmul reads
    w = prepared.get_parameter(points[0].args[0].args[0].target).detach()
    fake_quantized = prepared.get_submodule(points[0].target)(w.t())
    # One int8 scale per output channel: per row of W (out, in), per column of the W.t() the matmul reads.
    torch.testing.assert_close(fake_quantized, _per_output_channel_int8(w, 0).t(), rtol=0, atol=0)


def test_a_weight_read_through_a_view_is_quantized_by_a_weight_only_preset():
    torch.manual_seed(0)
    model, x = ViewedWeight("t").eval(), torch.randn(16, 64)
    model.W = nn.Parameter(torch.randn(6, 64))
    prepared = pipeline.prepare(model, (x,), "w4a16")
    pipeline.calibrate(prepared, [(x,)], progress=False)
    points = [n for n in prepared.graph.nodes if n.op == "call_module" and n.target.startswith("activation_post")]
    assert len(points) == 1
    fake_quantized = prepared.get_submodule(points[0].target)(model.W.detach().t())  # (in, out) = (64, 6)
    # int4 groups of 32 input channels of each output channel: at most 16 values per group.
    for group in fake_quantized.t().reshape(6, 2, 32).reshape(12, 32):
        assert 1 < group.unique().numel() <= 16
    with torch.no_grad():
        torch.testing.assert_close(prepared(x), x @ fake_quantized)


class HeadsWeight(nn.Module):
    """A (64, 32) weight split into 4 heads of (16, 32): per head its own output channels, which no
    (out, in) axis of a weight QSpec names."""

    def __init__(self):
        super().__init__()
        self.W = nn.Parameter(torch.randn(64, 32))

    def forward(self, x):  # x: (4, n, 16)
        return torch.matmul(x, self.W.view(4, 16, 32))


@pytest.mark.parametrize("preset, gets", [
    ("w8a8", "gets the input_activation QSpec INT8 PerTensor() asymmetric HistogramObserver"),
    ("w4a16", "stays float"),
])
def test_a_weight_whose_layout_cannot_be_mapped_is_named_by_describe_and_annotate(preset, gets):
    x = torch.randn(4, 8, 16)
    expected = "matmul (matmul) in module '': W (64, 32) " + gets
    quantizer = FakeQuantQuantizer(presets.get_preset(preset))
    gm = pipeline.export(HeadsWeight().eval(), (x,), dynamic_batch=False)
    table = quantizer.describe(gm, print_table=False)
    assert "warning: 1 op(s) read a weight through a layout" in table and expected in table
    with pytest.warns(UserWarning, match=re.escape(expected)):
        prepare_pt2e(gm, quantizer)
