"""benchmarks/stock_flows.py, the model suites' yardsticks: the stock flows at
4-bit weights (what a 4-bit preset is measured against), sqnr_gap's
standard error, and the coverage of a converted graph, against values
counted or computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from torch import nn

from benchmarks.stock_flows import (
    STOCK_QUANTIZERS,
    Coverage,
    coverage,
    float_op_types,
    on_stock_coverage,
    sqnr_gap,
    stock_quantize,
    stock_weight_bits,
)
from pt2e_fq.cli import pipeline
from quantizers import presets
from tests.models.mlp import ReluMLP


def _weight_codes(converted: torch.fx.GraphModule) -> list[tuple[int, int]]:
    """Per quantized weight, the smallest and largest integer code of its
    quantize_per_channel node (the weight, folded to int8 by convert_pt2e, is
    a get_attr read by a dequantize_per_channel node)."""
    found = []
    for node in converted.graph.nodes:
        if node.op == "call_function" and "dequantize_per_channel" in str(node.target):
            source = node.args[0]
            if source.op == "get_attr":
                codes = getattr(converted, source.target)
                found.append((int(codes.min()), int(codes.max())))
    return found


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.needs_torch("2.13", "torchao 0.18's X86InductorQuantizer annotates no linear or convolution of an exported graph on torch 2.11 (one observer on a Linear-ReLU-Linear), so there is no stock layout to compare with")) if name == "X86InductorQuantizer" else name for name in STOCK_QUANTIZERS])
@pytest.mark.parametrize("weight_bits, allowed", [(8, (-128, 127)), (4, (-8, 7))])
def test_stock_flows_store_weight_codes_of_the_width_asked_for(name, weight_bits, allowed):
    torch.manual_seed(0)
    model, batches = ReluMLP(64, 32, 8).eval(), [(torch.randn(4, 64),) for _ in range(2)]
    converted = stock_quantize(model, batches[0], batches, name, weight_bits)
    codes = _weight_codes(converted)
    assert len(codes) == 2, f"{name}: expected both linears' weights quantized per channel, got {codes}"
    for low, high in codes:
        assert allowed[0] <= low and high <= allowed[1], f"{name} int{weight_bits}: codes {low}..{high}"
        # A random weight's extreme rows reach the range's ends (within the narrow ranges' one code).
        assert high >= allowed[1] - 1 and low <= allowed[0] + 1, f"{name} int{weight_bits}: codes {low}..{high}"


def test_a_preset_is_measured_against_stock_weights_of_its_own_width():
    assert [stock_weight_bits(presets.get_preset(p)) for p in ("w8a8", "w4a8", "w4a16", "w8a16")] == [8, 4, 4, 8]
    with pytest.raises(ValueError, match="FP8_E4M3|fp8|e4m3"):
        stock_weight_bits(presets.get_preset("fp8"))


def test_stock_quantize_names_the_weight_widths_it_has():
    with pytest.raises(ValueError, match=r"weight_bits must be one of \(8, 4\), got 6"):
        stock_quantize(ReluMLP(64, 32, 8), (torch.randn(2, 64),), [], "XNNPACKQuantizer", 6)


def test_sqnr_gap_and_its_standard_error_by_hand():
    # Two batches of one element each; reference 1, ours off by 0.1 and 0.2, theirs by 0.2 and 0.2.
    reference = torch.tensor([1.0, 1.0])
    ours, theirs = torch.tensor([1.1, 1.2]), torch.tensor([1.2, 1.2])
    gap, error = sqnr_gap(reference, ours, theirs, 2)
    # SQNR over both: 10 log10(2 / 0.05) against 10 log10(2 / 0.08).
    assert gap == pytest.approx(10 * math.log10(0.08 / 0.05), abs=1e-4)
    per_batch = [10 * math.log10(0.04 / 0.01), 0.0]  # noise theirs / ours per batch
    mean = sum(per_batch) / 2
    sd = math.sqrt(sum((d - mean) ** 2 for d in per_batch) / 1)
    assert error == pytest.approx(sd / math.sqrt(2), abs=1e-4)
    with pytest.raises(ValueError, match="2 batches or more, got 1"):
        sqnr_gap(reference, ours, theirs, 1)


class _ConvLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


class _Decoder(nn.Module):
    """An embedding table, a projection written as transformers' Conv1D
    writes it (addmm with a (in, out) parameter) and a product of two
    activations: 2 weights and 3 activation inputs."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(12, 8)
        self.weight = nn.Parameter(torch.randn(8, 8))
        self.bias = nn.Parameter(torch.randn(8))

    def forward(self, ids):
        h = torch.addmm(self.bias, self.embed(ids).view(-1, 8), self.weight).view(ids.shape[0], -1, 8)
        return h @ h.transpose(1, 2)


def test_coverage_counts_what_the_converted_graph_quantizes():
    model, x = _ConvLinear().eval(), torch.randn(2, 3, 8, 8)
    weight_only = pipeline.quantize(model, x, "w4a16", progress=False, algorithms=False)
    assert str(coverage(weight_only)) == "W 2/2, A 0/2"
    assert str(coverage(stock_quantize(model, x, [x], "XNNPACKQuantizer"))) == "W 2/2, A 2/2"
    assert str(coverage(torch.export.export(model, (x,)).module())) == "W 0/2, A 0/2"


def test_coverage_counts_addmm_embedding_and_products_of_activations():
    torch.manual_seed(0)
    model, ids = _Decoder().eval(), torch.randint(0, 12, (2, 5))
    assert str(coverage(torch.export.export(model, (ids,)).module())) == "W 0/2, A 0/3"
    # w8a8 keeps embedding tables float (presets), w8a16 quantizes them for memory.
    ours = coverage(pipeline.quantize(model, ids, "w8a8", progress=False, algorithms=False))
    assert str(ours) == "W 1/2, A 3/3" and ours.float_op_types() == ["embedding"]
    assert str(coverage(pipeline.quantize(model, ids, "w8a16", progress=False, algorithms=False))) == "W 2/2, A 0/3"
    # X86InductorQuantizer annotates linear, not addmm, nor an embedding or a matmul.
    x86 = stock_quantize(model, ids, [ids], "X86InductorQuantizer")
    assert str(coverage(x86)) == "W 0/2, A 0/3"
    assert sorted(float_op_types(x86)) == ["addmm", "embedding"]
    # The preset on that coverage leaves both float.
    ours = coverage(pipeline.quantize(model, ids, on_stock_coverage("w8a8", float_op_types(x86)), progress=False,
                                      algorithms=False))
    assert str(ours) == "W 0/2, A 2/3"


def test_covers_compares_the_quantized_counts():
    weight_only, stock = Coverage(2, 2, 0, 2), Coverage(2, 2, 2, 2)
    assert weight_only.covers(stock, activations=False) and not weight_only.covers(stock)
    assert stock.covers(weight_only) and not Coverage(1, 2, 2, 2).covers(stock)
    # Another flow's graph with one lookup fewer: the counts decide.
    assert Coverage(14, 17, 14, 14).covers(Coverage(14, 16, 14, 14))
