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

import torch
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from quantizers import QuantizerConfig, presets

from pt2e_fq.spec.formats import IntFormat
from pt2e_fq.graph import as_args
from pt2e_fq.report import sqnr_db
from pt2e_fq.cli import pipeline

__all__ = ["STOCK_QUANTIZERS", "STOCK_WEIGHT_BITS", "float_op_types", "on_stock_coverage", "outputs", "sqnr_db",
           "sqnr_gap", "stock_quantizer", "stock_quantize", "stock_weight_bits"]

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


# Op types our presets quantize whose weights a stock quantizer may leave
# float (X86InductorQuantizer annotates linear, not the addmm of
# transformers' Conv1D: GPT-2's 8 projections; neither stock quantizer
# quantizes an embedding table, which the weight-only presets do for
# memory), by the aten op they export to.
_WEIGHTED_OP_TYPES = {"addmm": torch.ops.aten.addmm.default, "einsum": torch.ops.aten.einsum.default,
                      "embedding": torch.ops.aten.embedding.default}


def on_stock_coverage(preset: str, float_op_types) -> QuantizerConfig:
    """Preset `preset`'s config with the op types `float_op_types` (from
    float_op_types of a converted stock model) left float: ours on the stock
    quantizer's coverage, the parity comparison."""
    config = presets.get_preset(preset)
    for op_type in float_op_types:
        config.set_operator_type(op_type, None)
    return config


def float_op_types(stock: torch.fx.GraphModule) -> list[str]:
    """The op types of _WEIGHTED_OP_TYPES that the converted stock model has
    but quantizes none of (no dequantize among any such node's inputs)."""
    found = {}
    for node in stock.graph.nodes:
        for op_type, target in _WEIGHTED_OP_TYPES.items():
            if node.op == "call_function" and node.target == target:
                dq = any("dequantize" in str(getattr(a, "target", "")) for a in node.all_input_nodes)
                found[op_type] = found.get(op_type, False) or dq
    return [op_type for op_type, quantized in found.items() if not quantized]
