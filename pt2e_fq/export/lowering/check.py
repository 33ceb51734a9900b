"""Checks a lowered model (to_qdq's program, a compiled module, a .pte file)
against our fake-quant graph, output by output.

The promise: every quantized output is within one quantization step of
ours. The runtimes quantize activations as round(x * (1/scale)) where our
op divides, so an activation exactly on a rounding tie (or within an ulp of
it) can land one code away; integer kernels (oneDNN, XNNPACK) also
requantize their accumulators in their own arithmetic. Weights are stored
as the codes our kernel computes, so they never differ.
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass

import torch
from tabulate import tabulate
from torch.utils._pytree import tree_leaves

from ...ops.blocks import expand_blocks
from ...graph import as_args, decode_node, is_fake_quant_node, program_constants
from ..output_diff import HEADERS, output_diff
from ..program import exported_program

# One quantization step, plus the fp32 rounding of the two dequantized values.
_STEP_SLACK = 1 + 1e-3


@dataclass(frozen=True)
class LoweredCheck:
    """outputs: an output_diff.OutputDiff per output (elements that differ,
    largest and RMS difference in quantization steps of the point producing
    the output, SQNR); str() is their table."""

    outputs: list

    @property
    def ok(self) -> bool:
        """Every quantized output within one step of ours."""
        return all(o.max_steps is None or o.max_steps <= _STEP_SLACK for o in self.outputs)

    def __str__(self) -> str:
        return tabulate([o.row() for o in self.outputs], headers=HEADERS)


def _output_steps(ep: torch.export.ExportedProgram, outputs: list) -> list:
    """Per output: the per-element step (scale) of the fake-quant point whose
    value it is, else None."""
    constants = program_constants(ep)
    steps = []
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    for node, value in zip(tree_leaves(out_node.args), outputs):
        step = None
        if isinstance(node, torch.fx.Node) and node.target is operator.getitem and node.args[1] == 0:
            op = node.args[0]
            if is_fake_quant_node(op):
                call = decode_node(op, constants)
                if isinstance(call.scale, torch.Tensor) and call.scale.numel():
                    step = expand_blocks(call.scale.float(), value.shape, call.block_size)
        steps.append(step)
    return steps


def _run(lowered, args: tuple) -> list:
    if isinstance(lowered, (str, os.PathLike)):
        from .executorch import run_pte

        return run_pte(lowered, args)
    if isinstance(lowered, torch.export.ExportedProgram):
        lowered = lowered.module()
    if not callable(lowered):
        raise TypeError(
            "check_lowered: lowered must be an ExportedProgram, a callable (a compiled module) or the path of "
            f"a .pte file, got {type(lowered).__name__}"
        )
    with torch.no_grad():
        return tree_leaves(lowered(*args))


def check_lowered(lowered, model, inputs) -> LoweredCheck:
    """Runs `lowered` (to_qdq's ExportedProgram, a torch.compile'd module, or
    a .pte path run in ExecuTorch's Python runtime) and our fake-quant graph
    (`model`: the converted model or its ExportedProgram, QAT conv-bn folded
    as every export does) on `inputs`, and reports per output the elements
    that differ and the largest difference in quantization steps. `.ok`
    says whether every quantized output is within one step."""
    args = as_args(inputs)
    ep = exported_program(model, args)
    with torch.no_grad():
        ours = [t.detach() for t in tree_leaves(ep.module()(*args))]
    # Copies: a compiled module may write into its inputs (Inductor's fused
    # int8 linear + add does, see compile_x86), which are the caller's.
    theirs = _run(lowered, tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
    if len(theirs) != len(ours):
        raise ValueError(f"check_lowered: the lowered model gave {len(theirs)} outputs, ours {len(ours)}")
    checks = []
    for i, (a, b, step) in enumerate(zip(ours, theirs, _output_steps(ep, ours))):
        if a.shape != b.shape:
            raise ValueError(f"check_lowered: output {i} has shape {tuple(b.shape)}, ours {tuple(a.shape)}")
        checks.append(output_diff(i, a, b, step))
    return LoweredCheck(checks)
