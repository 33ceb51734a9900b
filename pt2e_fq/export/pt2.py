"""`.pt2` files: torch.export.save / load of a quantized model.

A saved program holds one torch.ops.pt2e_fq node per quantization point with
its qparams as buffers. Loading it needs the pt2e_fq operators registered,
which `import pt2e_fq` does; `load` is torch.export.load after that import.
The file is written atomically (files.py): a failed write leaves any file
already at the path as it was.
"""

from __future__ import annotations

import io
import os
from typing import Any, Optional, Union

import torch

from ..files import atomic_write, check_writable
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
    returns the saved program. The file is replaced only once it is
    complete; a failed write is a pt2e_fq.files.WriteError."""
    check_writable(path)  # before the export's work
    ep = exported_program(model_or_program, example_inputs, dynamic_shapes=dynamic_shapes, fold_bn=fold_bn)
    with atomic_write(path) as temporary:
        # Serialized in memory first: torch's C++ archive writer aborts the
        # whole process (SIGABRT) when a write to disk fails, e.g. on a full disk.
        buffer = io.BytesIO()
        torch.export.save(ep, buffer)
        temporary.write_bytes(buffer.getvalue())
    return ep


def load(path: Union[str, os.PathLike]) -> torch.export.ExportedProgram:
    """Loads a `.pt2` file saved by `save` (or torch.export.save); call
    `.module()` on the result to run it."""
    return torch.export.load(path)
