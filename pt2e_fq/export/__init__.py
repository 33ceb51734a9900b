"""Deployment export of quantized models.

- `save` / `load`: `.pt2` files (torch.export), loadable wherever pt2e_fq is
  imported.
- `to_onnx` / `check_onnx`: ONNX QDQ files, verified in ONNX Runtime (needs
  the `onnx` extra, imported only when they are called; a failed check is an
  `OnnxMismatch`, an AssertionError); `ort_session`: an
  ONNX Runtime session with the settings check_onnx verifies.
- `to_qdq` / `check_lowered` / `compile_x86`: the PT2E runtimes'
  quantize / dequantize representation (XNNPACK, Inductor x86 int8), checked
  against the fake-quant graph; `to_executorch` / `run_pte`: ExecuTorch
  `.pte` files with the XNNPACK delegate (needs the `executorch` extra).
- `fold_conv_bn`: folds the QAT conv-bn pattern; `save` and `to_onnx` do it
  unless fold_bn=False.
"""

from .bn_fold import fold_conv_bn
from .lowering import (
    XNNPACK_FUSED_ACTIVATIONS,
    LoweredCheck,
    PteExport,
    QdqSummary,
    UnsupportedPointError,
    check_lowered,
    compile_x86,
    run_pte,
    to_executorch,
    to_qdq,
)
from .onnx import OnnxCheck, OnnxMismatch, check_onnx, ort_session, to_onnx
from .program import exported_program
from .pt2 import TRUSTED_MODULES, UntrustedModuleError, load, save
from .pt2_archive import UnsafeArchiveError

__all__ = ["save", "load", "TRUSTED_MODULES", "UntrustedModuleError", "UnsafeArchiveError", "to_onnx", "check_onnx", "ort_session",
           "OnnxCheck", "OnnxMismatch", "fold_conv_bn", "exported_program",
           "to_qdq", "QdqSummary", "XNNPACK_FUSED_ACTIVATIONS", "UnsupportedPointError", "compile_x86", "check_lowered", "LoweredCheck",
           "to_executorch", "run_pte", "PteExport"]
