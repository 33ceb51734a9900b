"""The ExportedProgram a deployment file is written from.

A converted model (or an ExportedProgram of one) is exported with
torch.export, after folding its QAT conv-bn patterns (bn_fold.py) unless
`fold_bn=False`. Every exporter (`save`, `to_onnx`) starts here.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch

from ..fake_quantize import FakeQuantize
from ..inputs import as_args
from .bn_fold import fold_conv_bn


def _check_converted(model: torch.nn.Module) -> None:
    live = [path for path, m in model.named_modules() if isinstance(m, FakeQuantize) and not m.is_frozen]
    if live:
        raise ValueError(
            f"{len(live)} fake-quant point(s) are not converted (first: {live[0]}); run "
            "torchao's convert_pt2e(model) before exporting, so that no observer runs in the exported graph"
        )


def exported_program(
    model_or_program, example_inputs, *, dynamic_shapes: Optional[Any] = None, fold_bn: bool = True
) -> torch.export.ExportedProgram:
    """Exports a converted model (torch.nn.Module) or takes an ExportedProgram;
    with fold_bn (the default) its QAT conv-bn patterns are folded first. The
    model itself is left as it is."""
    args = as_args(example_inputs)
    if not isinstance(fold_bn, bool):
        raise TypeError(f"fold_bn must be True or False, got {fold_bn!r}")
    if isinstance(model_or_program, torch.export.ExportedProgram):
        if not fold_bn:
            return model_or_program
        module = model_or_program.module()  # a fresh GraphModule: folding it leaves the program alone
    elif isinstance(model_or_program, torch.nn.Module):
        _check_converted(model_or_program)
        module = model_or_program
        if fold_bn and isinstance(module, torch.fx.GraphModule):
            module = copy.deepcopy(module)
    else:
        raise TypeError(
            "model_or_program must be a torch.nn.Module or a torch.export.ExportedProgram, "
            f"got {type(model_or_program).__name__}"
        )
    if fold_bn and isinstance(module, torch.fx.GraphModule):
        fold_conv_bn(module)
    # Every fake-quant op returns a packed mask of ceil(numel / 8) bytes. When
    # export records that tensor's metadata, torch asks whether its size is
    # below 2 and, on a dynamic batch, guards on the answer at the example's
    # size: with 4 elements a row, (7 + 4*batch)//8 >= 2 refuses batch 1 and 2
    # (the float program takes them). Size-oblivious reasoning answers such
    # questions without a guard, so the program runs at every batch size.
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        return torch.export.export(module, args, dynamic_shapes=dynamic_shapes)
