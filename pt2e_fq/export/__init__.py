"""Deployment export of quantized models.

- `save` / `load`: `.pt2` files (torch.export), loadable wherever pt2e_fq is
  imported.
- `fold_conv_bn`: folds the QAT conv-bn pattern; `save` and `to_onnx` do it
  unless fold_bn=False.
"""

from .bn_fold import fold_conv_bn
from .program import exported_program
from .pt2 import load, save

__all__ = ["save", "load", "fold_conv_bn", "exported_program"]
