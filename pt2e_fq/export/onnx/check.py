"""Checks an exported ONNX file in ONNX Runtime (CPU) against the torch model.

Two comparisons:

- every quantization point, bit for bit: the point's Q/DQ subgraph is cut out
  of the file (by the names torch.onnx gives values: those of the program's
  nodes) and run on the very tensor the torch point received; its output must
  equal the torch op's. This is the exporter's promise, independent of the
  float ops around the points (ORT's and torch's conv, matmul, layer norm or
  gelu differ in the last bits, and such a difference can move a value
  across a rounding boundary of the next point);
- the outputs, end to end, with graph optimisations off and on (QDQ fusion
  into integer kernels): a quantized output agrees on average (RMS
  difference at most one quantization step: a float-kernel difference that
  moves a value across a rounding boundary flips it by a step, and in a deep
  net such flips cascade into a few elements some steps off); a float output
  within float rounding (in a weight-only file past it, no further from the
  program's float64 run than FLOAT64_ERROR_FACTOR times torch's float32 run;
  with optimisations on, after ORT's fused integer kernels: an SQNR floor,
  FUSED_FLOAT_OUTPUT_MIN_SQNR_DB). Each output's
  statistics (output_diff.OutputDiff) come back in the OnnxCheck.

Over that bound, the first point whose value leaves torch's in ORT's run of
the whole file must have an input within what a correct computation may
differ by (_input_bound: a conv's or matmul's float rounding derived from
its terms, plus the int32 rounding ORT's optimiser gives its bias;
FLOAT_OUTPUT_RTOL after other float ops): then the differences cascade from
a rounding flip there, and the check passes, saying so.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch
from tabulate import tabulate
from torch.utils._pytree import tree_leaves, tree_map

from ..output_diff import HEADERS, output_diff
from . import points
from .divergence import Cascade, _first_divergence
from .points import OnnxMismatch, float_tolerance, numpy_of
from .session import ort_session


# A float output of a file that quantizes no activations (a weight-only
# preset) comes out of every float op of the net in a row, and each
# runtime's float32 rounding is amplified layer by layer (EfficientNet-B0,
# 81 convolutions: ORT 1.7e-4 of the largest magnitude from torch, each
# about 1e-4 from exact arithmetic). Past FLOAT_OUTPUT_RTOL the bound is then
# ORT no further from the float64 run of the same program than this many
# times torch's float32 run is: two float32 implementations of the same
# arithmetic, neither more than a small factor less accurate than the other.
FLOAT64_ERROR_FACTOR = 4.0


# With graph optimisations on, ORT computes a float output after quantized
# activations in fused integer kernels (MatMulIntegerToFloat, QLinear*),
# whose accumulation and rescaling differ from torch's float op on the
# dequantized values by more than float rounding (measured: 1e-3 of the
# largest magnitude, 60 dB). The bound: the difference adds no more noise
# than one more 8-bit quantization of a full-range signal would
# (6.02 dB x 8 bits): SQNR of ORT against torch at least this.
FUSED_FLOAT_OUTPUT_MIN_SQNR_DB = 48.0


# The end-to-end bound of a quantized output: RMS of ORT - torch in its
# quantization steps (plus the fp32 rounding of the dequantized values).
END_TO_END_MAX_RMS_STEPS = 1 + 1e-3


@dataclass(frozen=True)
class OnnxCheck:
    """What check_onnx measured: how many points it compared bit for bit;
    per output, ORT against torch with graph optimisations off and on
    (`unoptimized`, `optimized`: OutputDiff per output); the largest
    |ORT - torch| of each, and the largest quantization step of the outputs
    (`tolerance`, the unit of the bound; for float outputs their rounding
    tolerance). str() is a table."""

    points: int
    max_abs_diff_unoptimized: float
    max_abs_diff_optimized: float
    tolerance: float
    unoptimized: tuple = ()
    optimized: tuple = ()
    cascade: Optional[Cascade] = None

    @property
    def max_steps(self) -> Optional[float]:
        """The largest difference in steps of any quantized output, either mode."""
        steps = [d.max_steps for d in self.unoptimized + self.optimized if d.max_steps is not None]
        return max(steps) if steps else None

    @property
    def min_sqnr_db(self) -> float:
        return min((d.sqnr_db for d in self.unoptimized + self.optimized), default=math.inf)

    def __str__(self) -> str:
        rows = [("off" if mode == "unoptimized" else "on",) + d.row()
                for mode in ("unoptimized", "optimized") for d in getattr(self, mode)]
        text = (f"{self.points} points bit-exact in ONNX Runtime on torch's inputs; outputs end to end:\n"
                + tabulate(rows, headers=("ORT optimisations",) + HEADERS))
        if self.cascade is not None:
            text += f"\nOver the bound, explained: {self.cascade}; the differences cascade from there."
        return text


def _output_steps(model) -> list[Optional[float]]:
    """Per graph output: the largest scale of the DequantizeLinear that
    produces it (its quantization step), None when no DequantizeLinear with a
    constant scale does."""
    from onnx import numpy_helper

    producers = {out: n for n in model.graph.node for out in n.output}
    consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    steps = []
    for out in model.graph.output:
        node = producers.get(out.name)
        # Cast back to bf16 / fp16, Add of minval and the Min / Max clamp keep the DQ's step.
        while node is not None and node.op_type in ("Cast", "Add", "Max", "Min") and node.input[0] in producers:
            node = producers[node.input[0]]
        scale = consts.get(node.input[1]) if node is not None and node.op_type == "DequantizeLinear" else None
        steps.append(float(np.max(scale)) if scale is not None else None)
    return steps


def _quantizes_activations(model) -> bool:
    """Whether the file quantizes an activation (a QuantizeLinear of a value
    that is not an initializer): only then can ORT fuse integer kernels
    with float outputs. Weight-only files keep the strict float bound."""
    constants = {t.name for t in model.graph.initializer}
    constants |= {out for n in model.graph.node if n.op_type == "Constant" for out in n.output}
    return any(n.op_type == "QuantizeLinear" and n.input[0] not in constants for n in model.graph.node)


def _float64_outputs(ep: torch.export.ExportedProgram, args) -> list[np.ndarray]:
    """The program's outputs computed in float64: every float op on float64
    values, the fake-quant ops (float32 kernels) on their inputs rounded to
    float32, their outputs taken back to float64 (in a weight-only program
    they read constants only: the same codes as the float32 run)."""

    def widen(v):
        return v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v

    def narrow(v):
        return v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.float64 else v

    class Float64(torch.fx.Interpreter):
        def call_function(self, target, args, kwargs):
            if getattr(target, "namespace", None) == "pt2e_fq":
                return tree_map(widen, target(*tree_map(narrow, args), **tree_map(narrow, kwargs)))
            return target(*tree_map(widen, args), **tree_map(widen, kwargs))

    with torch.no_grad():
        out = Float64(ep.module()).run(*tree_map(widen, tree_leaves(args)))
    return [numpy_of(v) for v in tree_leaves(out)]


def check_onnx(path: Union[str, os.PathLike], model, inputs, *, atol: Optional[float] = None) -> OnnxCheck:
    """Checks the ONNX file at `path`, exported by to_onnx from `model` (a
    converted model or an ExportedProgram, its QAT conv-bn folded as to_onnx
    does by default), in ONNX Runtime on CPU with `inputs`:

    - every fake-quant point, run on the input the torch point receives, is
      bit for bit the torch op's output (the strict check: the export's
      promise);
    - end to end, with graph optimisations off and on (ORT_DISABLED_OPTIMIZERS
      off, ORT_SESSION_CONFIG set), each quantized output's RMS difference
      from torch is at most one quantization step (the scale of the
      DequantizeLinear producing it; single elements may be further off
      where float-kernel differences flip roundings that cascade), a float
      output within FLOAT_OUTPUT_RTOL of its largest magnitude (in a file
      that quantizes no activation, past that, no further from the
      program's float64 run than FLOAT64_ERROR_FACTOR times torch's float32
      run: a deep net amplifies both runtimes' rounding), except with
      optimisations on in a file that quantizes activations, where ORT's
      fused integer kernels compute it: there its SQNR against torch is at
      least FUSED_FLOAT_OUTPUT_MIN_SQNR_DB. `atol`,
      where given, bounds the largest difference of every output instead.

    Args:
        path: the ONNX file to_onnx wrote.
        model: the converted model (or ExportedProgram) it was exported from.
        inputs: a tensor or a tuple of positional arguments.
        atol: where given, the largest difference allowed in every output.

    Returns:
        The OnnxCheck: per output, the elements that differ, max and RMS difference in steps, SQNR
        (print it for the table of every output).

    Raises:
        ImportError: the `onnx` extra is not installed.
        ValueError: an input tensor has no element (an empty batch): nothing would be compared.
        OnnxMismatch: (an AssertionError) a point or an output differs beyond what is allowed;
            the message says where.
    """
    r = points.run(path, model, inputs)
    ep, values, onnx_model = r.program, r.values, r.model

    output_node = next(n for n in ep.graph.nodes if n.op == "output")
    expected = [numpy_of(values[n.name]) for n in tree_leaves(output_node.args[0])]
    steps = _output_steps(onnx_model)
    fused = _quantizes_activations(onnx_model)
    diffs, violations, exact = {}, [], None
    for optimized in (False, True):
        sess = ort_session(path, optimized)
        got = sess.run(None, {i.name: v for i, v in zip(sess.get_inputs(), r.feeds)})
        diffs[optimized] = []
        for k, (g, e, step) in enumerate(zip(got, expected, steps)):
            if g.shape != e.shape or g.dtype != e.dtype:
                raise OnnxMismatch(f"check_onnx: output {k}: ORT gives {g.dtype}{g.shape}, torch {e.dtype}{e.shape}")
            d = output_diff(k, e, g, step)
            diffs[optimized].append(d)
            mode = f"with ORT graph optimisations {'on' if optimized else 'off'}"
            if d.non_finite_mismatch is not None:
                # No rounding flip turns a number into NaN or Inf: never a cascade to explain away,
                # and the SQNR bound below skips such elements.
                raise OnnxMismatch(f"check_onnx: {mode}, {d.non_finite_mismatch} (ours: torch's)")
            if atol is not None:
                if not d.max_abs_diff <= atol:
                    violations.append((optimized, f"output {k} differs from torch by {d.max_abs_diff:g} {mode}, "
                                                  f"more than atol ({atol:g})"))
            elif step is None and optimized and fused:
                if not d.sqnr_db >= FUSED_FLOAT_OUTPUT_MIN_SQNR_DB:
                    violations.append((optimized,
                        f"float output {k} differs from torch {mode} with an SQNR of {d.sqnr_db:.1f} dB, below "
                        f"{FUSED_FLOAT_OUTPUT_MIN_SQNR_DB:g} dB (FUSED_FLOAT_OUTPUT_MIN_SQNR_DB: ORT's integer "
                        f"kernels may add the noise of one 8-bit quantization); largest difference "
                        f"{d.max_abs_diff:g}"))
            elif step is None:
                if d.max_abs_diff <= float_tolerance(e):
                    continue
                why = (f"float output {k} differs from torch by {d.max_abs_diff:g} {mode}, more than float "
                       f"rounding ({float_tolerance(e):g}: FLOAT_OUTPUT_RTOL of its largest magnitude); "
                       f"SQNR {d.sqnr_db:.1f} dB")
                if not fused:  # weight-only: measured against float64 (FLOAT64_ERROR_FACTOR)
                    if exact is None:
                        exact = _float64_outputs(ep, r.args)
                    ort_error, torch_error = (float(np.abs(x.astype(np.float64) - exact[k]).max()) for x in (g, e))
                    if ort_error <= FLOAT64_ERROR_FACTOR * torch_error:
                        continue
                    why += (f"; from the float64 run ORT is {ort_error:g} off, torch {torch_error:g}: more than "
                            f"FLOAT64_ERROR_FACTOR ({FLOAT64_ERROR_FACTOR:g}) times torch's own rounding")
                violations.append((optimized, why))
            elif not d.rms_steps <= END_TO_END_MAX_RMS_STEPS:
                violations.append((optimized,
                    f"output {k} differs from torch {mode} by {d.rms_steps:.3g} quantization steps RMS (the bound "
                    f"is 1 step of {step:g}); {d.differing} of {d.numel} elements differ, the largest by "
                    f"{d.max_steps:.3g} steps, SQNR {d.sqnr_db:.1f} dB"))
    cascade = None
    if violations:
        broken_optimized, first_violation = violations[0]
        cascade = _first_divergence(onnx_model, r.pairs, values, r.graph_feeds, broken_optimized)
        if cascade is None or not cascade.explained:
            why = ("no point's rounding flipped on the way: a float op of the file differs from torch"
                   if cascade is None else f"{cascade}; over that bound, so the float ops before it differ "
                   "from torch")
            raise OnnxMismatch(f"check_onnx: {first_violation}; {why}")
    tolerance = max((s if s is not None else float_tolerance(e) for s, e in zip(steps, expected)), default=0.0)
    return OnnxCheck(len(r.pairs), max((d.max_abs_diff for d in diffs[False]), default=0.0),
                     max((d.max_abs_diff for d in diffs[True]), default=0.0), float(tolerance),
                     tuple(diffs[False]), tuple(diffs[True]), cascade)
