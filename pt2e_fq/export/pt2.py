"""`.pt2` files: torch.export.save / load of a quantized model.

A saved program holds one torch.ops.pt2e_fq node per quantization point with
its qparams as buffers. Loading it needs the pt2e_fq operators registered,
which `import pt2e_fq` does; `load` is torch.export.load after that import.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch

from .program import exported_program


def save(
    model_or_program,
    example_inputs,
    path: Union[str, os.PathLike],
    *,
    dynamic_shapes: Optional[Any] = None,
    fold_bn: bool = True,
) -> torch.export.ExportedProgram:
    """Exports a converted model (or takes an ExportedProgram), folds its QAT
    conv-bn patterns unless fold_bn=False, saves it to `path` (.pt2) and
    returns the saved program."""
    ep = exported_program(model_or_program, example_inputs, dynamic_shapes=dynamic_shapes, fold_bn=fold_bn)
    torch.export.save(ep, path)
    return ep


def load(path: Union[str, os.PathLike]) -> torch.export.ExportedProgram:
    """Loads a `.pt2` file saved by `save` (or torch.export.save); call
    `.module()` on the result to run it."""
    return torch.export.load(path)
