"""The accuracy comparison of the model suite (tests/test_model_suite.py)
and of benchmarks/bench_accuracy.py: a model's outputs over held-out
batches, their SQNR against the float model, and torchao's stock PT2E
quantizers run on the same model with the same calibration data, the
reference our presets are measured against (issue 17.1).

    reference = outputs(model, held_out)
    stock = stock_quantize(model, example, calibration, "X86InductorQuantizer")
    sqnr_db(reference, outputs(stock, held_out))

The stock flows are torchao's own, with their default configs:
`X86InductorQuantizer` with `get_default_x86_inductor_quantization_config()`
(uint8 activations, int8 per-channel weights) and torchao's copy of
`XNNPACKQuantizer` with `get_symmetric_quantization_config(is_per_channel=True)`
(ExecuTorch's class, the same code; torchao's needs no executorch), then
torchao's `convert_pt2e` (real q/dq).
"""

from __future__ import annotations

import torch
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from ..inputs import as_args
from ..report import sqnr_db
from . import pipeline

__all__ = ["STOCK_QUANTIZERS", "outputs", "sqnr_db", "stock_quantizer", "stock_quantize"]

STOCK_QUANTIZERS = ("XNNPACKQuantizer", "X86InductorQuantizer")


def stock_quantizer(name: str):
    """torchao's stock quantizer `name` (one of STOCK_QUANTIZERS) with its default int8 config."""
    if name == "XNNPACKQuantizer":
        from torchao.testing.pt2e._xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config

        return XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))
    if name == "X86InductorQuantizer":
        from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
            X86InductorQuantizer,
            get_default_x86_inductor_quantization_config,
        )

        return X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
    raise ValueError(f"stock_quantizer: unknown quantizer {name!r}; allowed: {', '.join(STOCK_QUANTIZERS)}")


def stock_prepare(model: torch.nn.Module, example_inputs, name: str) -> torch.fx.GraphModule:
    """The stock flow's export (eval mode, a dynamic batch as ours) and prepare_pt2e."""
    return prepare_pt2e(pipeline.export(model.eval(), example_inputs), stock_quantizer(name))


def stock_quantize(model: torch.nn.Module, example_inputs, calibration, name: str) -> torch.fx.GraphModule:
    """PTQ of `model` with torchao's stock quantizer `name`: export,
    prepare_pt2e, calibration on `calibration` (batches), convert_pt2e."""
    prepared = stock_prepare(model, example_inputs, name)
    pipeline.calibrate(prepared, calibration, progress=False)
    return convert_pt2e(prepared)


def outputs(model, batches) -> torch.Tensor:
    """The model's outputs (one tensor per batch) over `batches`, concatenated
    along the batch dimension, without gradients."""
    with torch.no_grad():
        return torch.cat([model(*as_args(b)) for b in batches])
