"""Checks a lowered model (to_qdq's program, a compiled module, a .pte file)
against our fake-quant graph, output by output.

The promise: every quantized output is within one quantization step of
ours, and every float output (one no point produces: the presets leave the
logits float) has an SQNR against ours of at least MIN_FLOAT_SQNR_DB. The
runtimes quantize activations as round(x * (1/scale)) where our op divides,
so an activation exactly on a rounding tie (or within an ulp of it) can
land one code away; integer kernels (oneDNN, XNNPACK) also requantize their
accumulators in their own arithmetic. Weights are stored as the codes our
kernel computes, so they never differ.

The float bound, 30 dB (the difference's RMS under 3.2% of the output's):
measured on CPU (torch 2.13, executorch 1.5), a correct lowering of the demo
CNN or of a transformer block gives 53 dB or more through ExecuTorch's
XNNPACK and 85 dB or more through Inductor, and a lowered program with a
q/dq scale or zero point off, a weight changed or another model's weights
gives 25 dB or less. A deep network run by integer kernels drifts further
from ours one rounding step at a time (ResNet-18 through XNNPACK: 25 to
28 dB) and fails the check; `min_sqnr_db` sets another bound.

Dynamic per-token activations (w4a8-dyn, w8a8-dyn through XNNPACK's
dynamically quantized linear) meet the same bound: XNNPACK computes each
token's qparams itself from the row's range, as the fake-quant op does, but
in its own arithmetic, and stores int4 group scales in bfloat16, which the
xnnpack target's w4a8-dyn trains with (QSpec.scale_dtype). Measured on CPU
(torch 2.13, executorch 1.5.1), a 2-layer decoder's logits at batches 1
and 4, sequence lengths 1 to 32, are at 133 dB or more with either preset,
except where an activation lands one code away (XNNPACK's float kernels
differ in the last bits; attention carries it to the later tokens): 55.9
dB at one shape. With fp32 group scales, which the .pte rounds, w4a8-dyn
gave 38 to 41 dB (tests/export/test_export_llm_pte.py, which also shows
that a weight scale 25% off, two groups' scales exchanged or codes one
step off fall below the bound; docs/export.md has the 4-layer decoder's
figures).
"""

from __future__ import annotations

import math
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
MIN_FLOAT_SQNR_DB = 30.0


@dataclass(frozen=True)
class LoweredCheck:
    """outputs: an output_diff.OutputDiff per output (elements that differ,
    largest and RMS difference in quantization steps of the point producing
    the output, SQNR); str() is their table. min_sqnr_db: the bound on
    float outputs."""

    outputs: list
    min_sqnr_db: float = MIN_FLOAT_SQNR_DB

    def problems(self) -> list[str]:
        """One phrase per output that fails the check."""
        found = []
        for o in self.outputs:
            if o.max_steps is not None:
                if not o.max_steps <= _STEP_SLACK:
                    found.append(f"output {o.index} is up to {o.max_steps:.3g} quantization steps from ours (at most 1)")
            elif o.non_finite_mismatch is not None:
                found.append(o.non_finite_mismatch)
            elif not o.sqnr_db >= self.min_sqnr_db:
                found.append(f"output {o.index} has an SQNR of {o.sqnr_db:.1f} dB against ours "
                             f"(at least {self.min_sqnr_db:g} dB)")
        return found

    @property
    def ok(self) -> bool:
        """Every quantized output within one step of ours, every float
        output finite where ours is, with an SQNR of min_sqnr_db or more."""
        return not self.problems()

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


def check_lowered(lowered, model, inputs, *, min_sqnr_db: float = MIN_FLOAT_SQNR_DB) -> LoweredCheck:
    """Runs `lowered` (to_qdq's ExportedProgram, a torch.compile'd module, or
    a .pte path run in ExecuTorch's Python runtime) and our fake-quant graph
    (`model`: the converted model or its ExportedProgram, QAT conv-bn folded
    as every export does) on `inputs`, and reports per output the elements
    that differ, the largest difference in quantization steps and the SQNR.
    `.ok` says whether every quantized output is within one step and every
    float output has an SQNR of at least `min_sqnr_db` (the module's
    docstring has what the default, 30 dB, allows)."""
    if isinstance(min_sqnr_db, bool) or not isinstance(min_sqnr_db, (int, float)) or math.isnan(min_sqnr_db):
        raise TypeError(f"check_lowered: min_sqnr_db must be a number of dB, got {min_sqnr_db!r}")
    args = as_args(inputs)
    if isinstance(lowered, (str, os.PathLike)):
        from .executorch import check_pte_file, require_executorch

        require_executorch()  # without the extra, that is the first thing to fix
        check_pte_file("check_lowered", lowered)  # before the export's work
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
    return LoweredCheck(checks, float(min_sqnr_db))
