"""The accuracy comparison of the model suite (tests/flow/test_model_suite.py)
and of benchmarks/bench_accuracy.py: a model's outputs over held-out
batches, their SQNR against the float model, and torchao's stock PT2E
quantizers run on the same model with the same calibration data, the
reference our presets are measured against.

    reference = outputs(model, held_out)
    stock = stock_quantize(model, example, calibration, "X86InductorQuantizer")
    sqnr_db(reference, outputs(stock, held_out))
    gap, error = sqnr_gap(reference, ours, theirs, len(held_out))   # dB, and its standard error

Two quantizers of the same quality differ in which values round up or down,
and on a net of a few layers those flips decide a few tenths of a dB of the
outputs' SQNR (measured: our flow given X86InductorQuantizer's own qparams
on ViT lands 0.4 dB from it, on 2 held-out batches). `sqnr_gap` gives the
difference with its standard error over the held-out batches, so "at least
as good" can be a claim the data supports: not below by more than two
standard errors.

The stock flows are torchao's own, with their default configs:
`X86InductorQuantizer` with `get_default_x86_inductor_quantization_config()`
(uint8 activations, int8 per-channel weights) and torchao's copy of
`XNNPACKQuantizer` with `get_symmetric_quantization_config(is_per_channel=True)`
(ExecuTorch's class, the same code; torchao's needs no executorch), then
torchao's `convert_pt2e` (real q/dq). A 4-bit preset is measured against the
same flows with 4-bit weights (`weight_bits=4`): int4 per channel, the range
-8..7 in the int8 dtype (neither config has a 4-bit dtype; XNNPACK's takes
`weight_qmin` / `weight_qmax`, which is how ExecuTorch asks it for int4, and
X86's weight spec gets the same range), activations as in the int8 configs.
Stock configs have no 16-bit or float activations: a preset that keeps them
(w4a16, w8a16) is measured against the stock flow of its weight width.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from quantizers import QuantizerConfig, presets

from pt2e_fq.spec.formats import IntFormat
from pt2e_fq.graph import as_args, is_fake_quant_node
from pt2e_fq.report import sqnr_db
from pt2e_fq.cli import pipeline

__all__ = ["STOCK_QUANTIZERS", "STOCK_WEIGHT_BITS", "Coverage", "coverage", "float_op_types", "on_stock_coverage",
           "outputs", "sqnr_db", "sqnr_gap", "stock_quantizer", "stock_quantize", "stock_weight_bits"]

STOCK_QUANTIZERS = ("XNNPACKQuantizer", "X86InductorQuantizer")
# Weight widths the stock flows are run at: each weight range, in the int8 dtype.
_STOCK_WEIGHT_RANGES = {8: None, 4: (-8, 7)}  # None: the config's own int8 range
STOCK_WEIGHT_BITS = tuple(_STOCK_WEIGHT_RANGES)


def stock_quantizer(name: str, weight_bits: int = 8):
    """torchao's stock quantizer `name` (one of STOCK_QUANTIZERS) with its
    default int8 config, or that config with `weight_bits`-wide weights (one
    of STOCK_WEIGHT_BITS; module doc)."""
    if weight_bits not in _STOCK_WEIGHT_RANGES:
        raise ValueError(f"stock_quantizer: weight_bits must be one of {STOCK_WEIGHT_BITS}, got {weight_bits!r}")
    weight_range = _STOCK_WEIGHT_RANGES[weight_bits]
    if name == "XNNPACKQuantizer":
        from torchao.testing.pt2e._xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config

        qmin, qmax = weight_range or (-127, 127)  # the function's defaults
        config = get_symmetric_quantization_config(is_per_channel=True, weight_qmin=qmin, weight_qmax=qmax)
        return XNNPACKQuantizer().set_global(config)
    if name == "X86InductorQuantizer":
        from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
            X86InductorQuantizer,
            get_default_x86_inductor_quantization_config,
        )

        config = get_default_x86_inductor_quantization_config()
        if weight_range is not None:
            weight = dataclasses.replace(config.weight, quant_min=weight_range[0], quant_max=weight_range[1])
            config = dataclasses.replace(config, weight=weight)
        return X86InductorQuantizer().set_global(config)
    raise ValueError(f"stock_quantizer: unknown quantizer {name!r}; allowed: {', '.join(STOCK_QUANTIZERS)}")


def stock_weight_bits(config) -> int:
    """The weight width of the stock flows an integer preset's QuantizerConfig
    is measured against: that of its global weights (one of STOCK_WEIGHT_BITS)."""
    fmt = config.global_config.weight.format
    bits = fmt.bits if isinstance(fmt, IntFormat) else None
    if bits not in _STOCK_WEIGHT_RANGES:
        raise ValueError(f"stock_weight_bits: the config's weights are {fmt}; the stock flows run with "
                         f"{', '.join(f'int{b}' for b in STOCK_WEIGHT_BITS)} weights")
    return bits


def stock_prepare(model: torch.nn.Module, example_inputs, name: str, weight_bits: int = 8) -> torch.fx.GraphModule:
    """The stock flow's export (eval mode, a dynamic batch as ours) and prepare_pt2e."""
    return prepare_pt2e(pipeline.export(model.eval(), example_inputs), stock_quantizer(name, weight_bits))


def stock_quantize(model: torch.nn.Module, example_inputs, calibration, name: str,
                   weight_bits: int = 8) -> torch.fx.GraphModule:
    """PTQ of `model` with torchao's stock quantizer `name` (weights
    `weight_bits` wide): export, prepare_pt2e, calibration on `calibration`
    (batches), convert_pt2e."""
    prepared = stock_prepare(model, example_inputs, name, weight_bits)
    pipeline.calibrate(prepared, calibration, progress=False)
    return convert_pt2e(prepared)


def outputs(model, batches) -> torch.Tensor:
    """The model's outputs (one tensor per batch) over `batches`, concatenated
    along the batch dimension, without gradients."""
    with torch.no_grad():
        return torch.cat([model(*as_args(b)) for b in batches])


def sqnr_gap(reference: torch.Tensor, ours: torch.Tensor, theirs: torch.Tensor, batches: int) -> tuple[float, float]:
    """SQNR(ours) - SQNR(theirs) in dB against `reference` (outputs of
    `batches` equal batches concatenated along dimension 0), and its
    standard error: that of the mean of the per-batch paired differences
    10 * log10(noise theirs / noise ours)."""
    if batches < 2:
        raise ValueError(f"sqnr_gap: the standard error needs 2 batches or more, got {batches}")
    gap = sqnr_db(reference, ours) - sqnr_db(reference, theirs)
    per_batch = [10 * math.log10(float((t - r).double().pow(2).sum()) / float((o - r).double().pow(2).sum()))
                 for r, o, t in zip(reference.chunk(batches), ours.chunk(batches), theirs.chunk(batches))]
    d = torch.tensor(per_batch, dtype=torch.float64)
    return gap, float(d.std() / math.sqrt(batches))


# -- coverage: what a converted graph quantizes ---------------------------------

_aten = torch.ops.aten
# The ops our presets quantize that carry a weight or multiply two
# activations, by op type name (quantizers.patterns.OP_TYPES), and the
# positions of their tensor inputs (einsum: every operand). Embedding
# counts its table; its indices are no quantization point.
_COUNTED = {
    "conv1d": ((_aten.conv1d.default, _aten.conv1d.padding), (0, 1)),
    "conv2d": ((_aten.conv2d.default, _aten.conv2d.padding), (0, 1)),
    "conv3d": ((_aten.conv3d.default, _aten.conv3d.padding), (0, 1)),
    "conv_transpose1d": ((_aten.conv_transpose1d.default,), (0, 1)),
    "conv_transpose2d": ((_aten.conv_transpose2d.input,), (0, 1)),
    "linear": ((_aten.linear.default,), (0, 1)),
    "addmm": ((_aten.addmm.default,), (1, 2)),
    "matmul": ((_aten.matmul.default,), (0, 1)),
    "bmm": ((_aten.bmm.default,), (0, 1)),
    "mm": ((_aten.mm.default,), (0, 1)),
    "einsum": ((_aten.einsum.default,), None),
    "embedding": ((_aten.embedding.default,), (0,)),
}
_OP_TYPE = {target: (name, positions) for name, (targets, positions) in _COUNTED.items() for target in targets}
_VIEWS = {_aten.view.default, _aten.reshape.default, _aten.permute.default, _aten.transpose.int, _aten.t.default,
          _aten.unsqueeze.default, _aten.squeeze.dim, _aten.expand.default, _aten.contiguous.default}


def _quantizer_of(gm: torch.fx.GraphModule, node) -> Optional[torch.fx.Node]:
    """The quantization `node` comes from through views: our fake-quant
    module or op, or a stock dequantize; None if it is float."""
    from torchao.quantization.pt2e import FakeQuantizeBase

    while isinstance(node, torch.fx.Node):
        if node.op == "call_module":
            return node if isinstance(gm.get_submodule(node.target), FakeQuantizeBase) else None
        if node.op != "call_function":
            return None
        if is_fake_quant_node(node) or "dequantize" in str(node.target):
            return node
        if node.target not in _VIEWS:
            return None
        node = node.args[0]
    return None


def _is_weight(node) -> bool:
    """`node` reads a parameter or constant (a get_attr), through views and
    quantization (a fake-quant module or op, a stock quantize or
    dequantize: each takes its input first)."""
    while isinstance(node, torch.fx.Node) and node.args and (
            node.op == "call_module" or (node.op == "call_function" and (
                node.target in _VIEWS or is_fake_quant_node(node) or "quantize" in str(node.target)))):
        node = node.args[0]
    return isinstance(node, torch.fx.Node) and node.op == "get_attr"


@dataclasses.dataclass
class Coverage:
    """Of the weight inputs and the activation inputs of the ops in
    _COUNTED, how many a converted graph quantizes; `weights_by_op`: per op
    type, [quantized, total] of its weights."""

    weights: int = 0
    weight_total: int = 0
    activations: int = 0
    activation_total: int = 0
    weights_by_op: dict = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        return f"W {self.weights}/{self.weight_total}, A {self.activations}/{self.activation_total}"

    def float_op_types(self) -> list[str]:
        """The op types whose every weight the graph leaves float."""
        return [op_type for op_type, (quantized, _) in self.weights_by_op.items() if not quantized]

    def covers(self, other: "Coverage", activations: bool = True) -> bool:
        """Quantizes at least as many weights (and with `activations`,
        activation inputs) as `other`. (The totals of two flows' graphs of
        one model may differ: XNNPACKQuantizer's converted BERT has one
        embedding lookup fewer.)"""
        return self.weights >= other.weights and (not activations or self.activations >= other.activations)


def coverage(gm: torch.fx.GraphModule) -> Coverage:
    """What a converted graph (ours, or a stock flow's) quantizes, counted
    from its nodes: every tensor input of the ops in _COUNTED is a weight
    (it reads a get_attr) or an activation, quantized if it comes from a
    quantization (our fake-quant point, or a stock dequantize, through
    views)."""
    c = Coverage()
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in _OP_TYPE:
            continue
        op_type, positions = _OP_TYPE[n.target]
        for inp in list(n.args[1]) if positions is None else [n.args[i] for i in positions]:
            quantized = _quantizer_of(gm, inp) is not None
            if _is_weight(inp):
                c.weights += quantized
                c.weight_total += 1
                counts = c.weights_by_op.setdefault(op_type, [0, 0])
                counts[0] += quantized
                counts[1] += 1
            else:
                c.activations += quantized
                c.activation_total += 1
    return c


def float_op_types(stock: torch.fx.GraphModule) -> list[str]:
    """The op types whose every weight the converted model `stock` leaves
    float (`coverage`): those ours leaves float too when it is compared with
    that flow (on_stock_coverage)."""
    return coverage(stock).float_op_types()


def on_stock_coverage(preset: str, float_op_types) -> QuantizerConfig:
    """Preset `preset`'s config with the op types `float_op_types` (from
    float_op_types of a converted stock model) left float: ours on the stock
    quantizer's coverage, the parity comparison."""
    config = presets.get_preset(preset)
    for op_type in float_op_types:
        config.set_operator_type(op_type, None)
    return config
