"""ONNX export of a quantized model.

`to_onnx` exports through torch.onnx.export(dynamo=True) with our
translation table (translate.py): each fake-quant point becomes
QuantizeLinear / DequantizeLinear, weights integer initializers. Its check
in ONNX Runtime is check.py.

Needs the `onnx` extra: pip install "pt2e_fq[onnx]".
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Union

import torch

from ...eval_mode import check_eval_mode
from ...files import atomic_write, check_writable
from ...spec.formats import FloatFormat
from ...graph import as_args, check_finite_qparams, decode_node, is_fake_quant_node, program_constants
from ..program import exported_program, no_new_stack_traces

# The lowest opset the translation targets: int4, int16 and blocked Q/DQ
# arrived in opset 21.
MIN_OPSET = 21

# ONNX metadata key: a JSON list, per fake-quant point, of the names of its
# input ("input": null for a weight stored as integers) and output values.
POINTS_METADATA = "pt2e_fq.points"


def require_onnx() -> None:
    """Raises a clear ImportError when the `onnx` extra is missing."""
    try:
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"ONNX export needs onnx, onnxscript and onnxruntime ({e}); pip install 'pt2e_fq[onnx]'"
        ) from None


def _check_exportable(ep: torch.export.ExportedProgram) -> None:
    """Refuses what the ONNX translation cannot carry: E2M1 elements, and any
    op output but the fake-quantized values (the clamp mask, MX scales)."""
    from .translate import E2M1_UNSUPPORTED

    for node in ep.graph.nodes:
        if not is_fake_quant_node(node):
            continue
        fmt = decode_node(node).format
        if isinstance(fmt, FloatFormat) and fmt.element.name == "e2m1":
            raise NotImplementedError(f"to_onnx: {node.name} has {E2M1_UNSUPPORTED}")
        for user in node.users:
            if user.args[1] != 0 and user.users:
                raise NotImplementedError(
                    f"to_onnx: {user.name} (output {user.args[1]} of {node.name}, the clamp mask or block "
                    "scales) is used in the graph; the ONNX export carries the fake-quantized values only"
                )


def supported_opsets() -> range:
    """The opsets to_onnx writes: MIN_OPSET up to the newest one the
    installed onnx package defines. torch.onnx converts the opset-21
    translation to any of them; asked for a newer one, it logs a traceback
    and silently writes opset 18, which has no blocked Q/DQ."""
    import onnx

    return range(MIN_OPSET, onnx.defs.onnx_opset_version() + 1)


def _check_opset(opset) -> None:
    allowed = supported_opsets()
    # bool is an int subclass: opset=True is a mistake, not opset 1.
    if isinstance(opset, bool) or not isinstance(opset, int) or opset not in allowed:
        import onnx

        raise ValueError(
            f"to_onnx: opset must be an int from {allowed.start} (int4, int16 and blocked Q/DQ) to "
            f"{allowed.stop - 1} (the newest opset of the installed onnx {onnx.__version__}), got {opset!r}"
        )


def _input_name(x, consumers) -> Optional[str]:
    """The name a point's input has in the optimized file: its own while the
    file still consumes it, else that of the value the optimizer gave its
    consumers in its place (a removed Identity's source). None, as for a
    weight stored as codes, where none of its consumers is left: the
    optimizer folded a point whose input derives from constants alone (a
    norm's weight, rotary embedding tables) into a constant."""
    if x is None:
        return None
    if x.uses():
        return x.name
    for node, index in consumers:
        if node.graph is not None:
            return node.inputs[index].name
    return None


def _optimize(model) -> None:
    """The exporter's own optimisation (onnxscript's optimize_ir) without its
    pattern rewriter and operator fusions: constant folding, dead code,
    constants lifted to initializers and deduplicated, common subexpressions
    merged. The rewriter's matching took most of an export's time (24 of 46 s
    on a tiny Llama under fp8, every rule tried at each of the many small
    nodes of the Q/DQ subgraphs), and its fusions (RMSNorm, GELU) would
    replace the float ops that check_onnx compares with torch's; ONNX
    Runtime applies its own graph optimisations when it loads the file."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common_passes
    from onnxscript.optimizer import constant_folding

    ir.passes.Sequential(
        common_passes.InlinePass(),
        ir.passes.PassManager(
            [constant_folding.FoldConstantsPass(
                shape_inference=True,
                input_size_limit=constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                output_size_limit=constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
                should_fold=lambda node: None,
            ), common_passes.RemoveUnusedNodesPass()],
            steps=2, early_stop=True,
        ),
        common_passes.RemoveUnusedFunctionsPass(),
        common_passes.RemoveUnusedOpsetsPass(),
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common_passes.LiftSubgraphInitializersToMainGraphPass(),
        # Up to 2^20 elements, not the pass's default 1024: the exporter writes a
        # linear's weight transposed once per linear, so a rotation matrix
        # (calib.rotation: 128 x 128) read by several linears would be stored
        # once per reader. Identical constants are merged by content (each
        # kept in memory as bytes during the pass, hence a bound).
        common_passes.DeduplicateInitializersPass(size_limit=1 << 20),
        common_passes.CommonSubexpressionEliminationPass(),
        common_passes.OutputFixPass(),
        common_passes.NameFixPass(),
    )(model)


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

    opset: from 21 (int4, int16 and blocked Q/DQ) to the newest opset the
    installed onnx package defines (see supported_opsets). dynamic_shapes is
    torch.export's. The file is written without external data, and
    replaces `path` only once it is complete; a failed write is a
    pt2e_fq.files.WriteError.

    Args:
        model: a converted model or an ExportedProgram of one.
        example_inputs: a tensor or a tuple of positional arguments.
        path: the `.onnx` file to write.
        opset: the ONNX opset, from 21 to the newest the installed onnx defines.
        dynamic_shapes: as torch.export takes them (the export before prepare must declare the same dimensions).
        fold_bn: fold the QAT conv-bn patterns (True) or keep them.

    Returns:
        The torch.onnx.ONNXProgram.

    Raises:
        ImportError: the `onnx` extra is not installed.
        ValueError: a bad opset, a point not converted or with non-finite qparams, or a model that torchao's
            eval switch changed (call pt2e_fq.move_exported_model_to_eval).
        NotImplementedError: an E2M1 format (FP4, MXFP4, NVFP4), or the clamp mask used in the graph.
        pt2e_fq.files.WriteError: the file cannot be written.
    """
    require_onnx()
    from .translate import translation_table
    from .scale import fused_scales

    _check_opset(opset)
    check_writable(path)  # before the export's work
    check_eval_mode(model, "to_onnx")
    with fused_scales():  # a dynamic FP8 point's scale as one node (scale.py)
        ep = exported_program(model, example_inputs, dynamic_shapes=dynamic_shapes, fold_bn=fold_bn)
    check_finite_qparams(ep, "to_onnx")
    _check_exportable(ep)
    points: list = []
    with no_new_stack_traces():  # the decomposition retraces the program (see no_new_stack_traces)
        program = torch.onnx.export(
            ep,
            as_args(example_inputs),
            dynamo=True,
            opset_version=opset,
            custom_translation_table=translation_table(program_constants(ep), points),
            verbose=False,
            optimize=False,
        )
    _optimize(program.model)
    # Where each point's Q/DQ subgraph starts and ends, for check_onnx (and
    # anyone reading the file): the names the values have in the file.
    program.model.metadata_props[POINTS_METADATA] = json.dumps(
        [{"input": _input_name(x, consumers), "output": y.name} for x, consumers, y in points]
    )
    with atomic_write(path) as temporary:
        program.save(os.fspath(temporary), external_data=False)
    return program
