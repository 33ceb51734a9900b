"""Deployment export of quantized models.

- `save` / `load`: `.pt2` files (torch.export), loadable wherever pt2e_fq is
  imported.
- `to_onnx` / `check_onnx`: ONNX QDQ files, verified in ONNX Runtime (needs
  the `onnx` extra, imported only when they are called); `ort_session`: an
  ONNX Runtime session with the settings check_onnx verifies.
- `fold_conv_bn`: folds the QAT conv-bn pattern; `save` and `to_onnx` do it
  unless fold_bn=False.
"""

from .bn_fold import fold_conv_bn
from .onnx import to_onnx
from .onnx_check import OnnxCheck, check_onnx, ort_session
from .program import exported_program
from .pt2 import load, save

__all__ = ["save", "load", "to_onnx", "check_onnx", "ort_session", "OnnxCheck", "fold_conv_bn", "exported_program"]
