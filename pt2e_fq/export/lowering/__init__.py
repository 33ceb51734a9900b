"""Lowering to the PT2E runtimes' quantize / dequantize representation:
`qdq` (XNNPACK, Inductor x86 int8), `check` (the lowered program against
the fake-quant graph), `executorch` (`.pte` files with the XNNPACK
delegate)."""

from .check import LoweredCheck, check_lowered
from .executorch import PteExport, run_pte, to_executorch
from .qdq import XNNPACK_FUSED_ACTIVATIONS, QdqSummary, UnsupportedPointError, compile_x86, to_qdq

__all__ = ["to_qdq", "QdqSummary", "XNNPACK_FUSED_ACTIVATIONS", "UnsupportedPointError", "compile_x86",
           "check_lowered", "LoweredCheck", "to_executorch", "run_pte", "PteExport"]
