"""ONNX export of a quantized model, and its check in ONNX Runtime.

`to_onnx` exports through torch.onnx.export(dynamo=True) with our
translation table (onnx_qdq.py): each fake-quant point becomes
QuantizeLinear / DequantizeLinear, weights integer initializers.
`check_onnx` runs the file in ONNX Runtime on CPU and compares it with the
torch model: bit for bit with graph optimisations off, within one
quantization step of the output with ORT's fused kernels on.

Needs the `onnx` extra: pip install "pt2e_fq[onnx]".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

from .program import as_args, exported_program

# ONNX Runtime CPU optimizer passes with known bugs on QDQ graphs (DESIGN.md):
# ReluQuantRewrite drops a Relu before an fp8 QuantizeLinear with zero point 0;
# MatMulAddFusion fails on int8 activations into a 3-D Linear with bias.
ORT_DISABLED_OPTIMIZERS = ("ReluQuantRewrite", "MatMulAddFusion")

_MASK_OUTPUT = 1  # output index of the packed clamp mask in every pt2e_fq op


def _require_onnx():
    try:
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"ONNX export needs onnx, onnxscript and onnxruntime ({e}); pip install 'pt2e_fq[onnx]'"
        ) from None


def _placeholder_constants(ep: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    """The program's parameters, buffers and constants by placeholder name."""
    sig = ep.graph_signature
    named = {**ep.state_dict, **ep.constants}
    mapping = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
    return {placeholder: named[target] for placeholder, target in mapping.items() if target in named}


def _check_no_mask_use(ep: torch.export.ExportedProgram) -> None:
    for node in ep.graph.nodes:
        if node.op == "call_function" and str(node.target).startswith("pt2e_fq."):
            for user in node.users:
                if user.args[1] == _MASK_OUTPUT and user.users:
                    raise NotImplementedError(
                        f"to_onnx: {user.name}, the clamp mask of {node.name}, is used in the graph; "
                        "the ONNX export carries the fake-quantized values only"
                    )


def to_onnx(
    model,
    example_inputs,
    path: Union[str, os.PathLike],
    opset: int = 21,
    dynamic_shapes: Optional[Any] = None,
    *,
    fold_bn: bool = True,
):
    """Exports a converted model (or an ExportedProgram of one) to an ONNX
    file of QuantizeLinear / DequantizeLinear, folding QAT conv-bn first
    unless fold_bn=False. Returns the torch.onnx.ONNXProgram.

    opset must be >= 21 (int4, int16 and blocked Q/DQ). dynamic_shapes is
    torch.export's. The file is written without external data.
    """
    _require_onnx()
    from .onnx_qdq import translation_table

    if not isinstance(opset, int) or opset < 21:
        raise ValueError(f"to_onnx: opset must be an int >= 21 (int4, int16 and blocked QDQ), got {opset!r}")
    ep = exported_program(model, example_inputs, dynamic_shapes=dynamic_shapes, fold_bn=fold_bn)
    _check_no_mask_use(ep)
    program = torch.onnx.export(
        ep,
        as_args(example_inputs),
        dynamo=True,
        opset_version=opset,
        custom_translation_table=translation_table(_placeholder_constants(ep)),
        verbose=False,
    )
    program.save(os.fspath(path), external_data=False)
    return program


@dataclass(frozen=True)
class OnnxCheck:
    """What check_onnx measured: max |ORT - torch| over all outputs with
    graph optimisations off (must be 0) and on, and the step it allowed."""

    max_abs_diff_unoptimized: float
    max_abs_diff_optimized: float
    step: float


def _session(path, optimized: bool):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimized else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    return ort.InferenceSession(
        os.fspath(path), so, providers=["CPUExecutionProvider"], disabled_optimizers=list(ORT_DISABLED_OPTIMIZERS)
    )


def output_steps(path) -> list[Optional[float]]:
    """Per graph output: the largest scale of the DequantizeLinear that
    produces it (its quantization step), None when no DequantizeLinear does."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(os.fspath(path))
    producers = {out: n for n in model.graph.node for out in n.output}
    consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant":
            consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    steps = []
    for out in model.graph.output:
        node = producers.get(out.name)
        # Cast back to bf16 / fp16, Add of minval and the Min / Max clamp keep the DQ's step.
        while node is not None and node.op_type in ("Cast", "Add", "Max", "Min") and node.input[0] in producers:
            node = producers[node.input[0]]
        scale = consts.get(node.input[1]) if node is not None and node.op_type == "DequantizeLinear" else None
        steps.append(float(np.max(scale)) if scale is not None else None)
    return steps


def _numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        raise TypeError(
            "check_onnx: ONNX Runtime's Python API exchanges no bfloat16 arrays (numpy has no bfloat16); "
            "check the model in float32 or float16"
        )
    return t.detach().cpu().numpy()


def check_onnx(path: Union[str, os.PathLike], model, inputs, *, atol: Optional[float] = None) -> OnnxCheck:
    """Runs the ONNX file in ONNX Runtime (CPU) on `inputs` and compares it
    with `model(*inputs)` (a torch.nn.Module or an ExportedProgram):

    - graph optimisations off: every output bit for bit equal;
    - optimisations on (fused integer kernels; ORT_DISABLED_OPTIMIZERS off):
      within one quantization step of each output, i.e. the scale of the
      DequantizeLinear that produces it, or `atol` where given (needed when an
      output is not quantized).

    Raises AssertionError on a mismatch; returns the measured OnnxCheck.
    """
    _require_onnx()
    args = as_args(inputs)
    runnable = model.module() if isinstance(model, torch.export.ExportedProgram) else model
    with torch.no_grad():
        expected = [_numpy(t) for t in tree_leaves(runnable(*args))]
    feeds_values = [_numpy(a) for a in tree_leaves(args)]
    steps = output_steps(path) if atol is None else [atol] * len(expected)
    if any(s is None for s in steps):
        raise ValueError(
            "check_onnx: an output has no constant quantization step (it is not produced by a "
            "DequantizeLinear with a constant scale); pass atol= for the optimised comparison"
        )
    diffs = {}
    for optimized in (False, True):
        session = _session(path, optimized)
        feeds = {i.name: v for i, v in zip(session.get_inputs(), feeds_values)}
        got = session.run(None, feeds)
        worst = 0.0
        for k, (g, e, step) in enumerate(zip(got, expected, steps)):
            if g.shape != e.shape or g.dtype != e.dtype:
                raise AssertionError(f"check_onnx: output {k}: ORT gives {g.dtype}{g.shape}, torch {e.dtype}{e.shape}")
            diff = float(np.max(np.abs(g.astype(np.float64) - e.astype(np.float64)))) if g.size else 0.0
            worst = max(worst, diff)
            exact = np.array_equal(g.view(np.uint8), e.view(np.uint8))
            if not optimized and not exact:
                raise AssertionError(
                    f"check_onnx: output {k} differs from torch with ORT graph optimisations off "
                    f"(max |diff| {diff:g}); it must be bit-exact"
                )
            if optimized and not diff <= step * (1 + 1e-6):
                raise AssertionError(
                    f"check_onnx: output {k} differs from torch by {diff:g} with ORT optimisations on, "
                    f"more than one quantization step ({step:g})"
                )
        diffs[optimized] = worst
    return OnnxCheck(diffs[False], diffs[True], max(steps))
