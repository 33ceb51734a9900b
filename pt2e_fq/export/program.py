"""The ExportedProgram a deployment file is written from.

A converted model (or an ExportedProgram of one) is exported with
torch.export, after folding its QAT conv-bn patterns (bn_fold.py) unless
`fold_bn=False`. Every exporter (`save`, `to_onnx`) starts here.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator, Optional

import torch

from ..fake_quantize import FakeQuantize
from ..graph import as_args
from .bn_fold import fold_conv_bn, has_conv_bn


def _check_converted(model: torch.nn.Module) -> None:
    live = [path for path, m in model.named_modules() if isinstance(m, FakeQuantize) and not m.is_frozen]
    if live:
        raise ValueError(
            f"{len(live)} fake-quant point(s) are not converted (first: {live[0]}); run "
            "torchao's convert_pt2e(model) before exporting, so that no observer runs in the exported graph"
        )


@contextlib.contextmanager
def no_new_stack_traces(enabled: bool = True) -> Iterator[None]:
    """While tracing a GraphModule, torch gives each new node the stack
    trace of the node it comes from; a node without one (everything a
    FakeQuantize module's forward traces to) gets a Python traceback of the
    tracer itself, captured and symbolized node by node: a tenth of an
    export's time, for a trace through torch and pt2e_fq internals that
    tells the user nothing. Inside this block torch captures none
    (torch.fx.config.do_not_emit_stack_traces); the stack traces that come
    from the model's own graph are kept. torch 2.11 has no such switch: there
    the block changes nothing, and export is slower, not different."""
    if not hasattr(torch.fx.config, "do_not_emit_stack_traces"):
        yield
        return
    previous = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = enabled or previous
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = previous


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
        fold_conv_bn(module)
    elif isinstance(model_or_program, torch.nn.Module):
        _check_converted(model_or_program)
        module = model_or_program
        # Folded in a copy, made only where there is something to fold (a deep
        # copy of a large graph costs a few tenths of a second).
        if fold_bn and isinstance(module, torch.fx.GraphModule) and has_conv_bn(module):
            module = copy.deepcopy(module)
            fold_conv_bn(module)
    else:
        raise TypeError(
            "model_or_program must be a torch.nn.Module or a torch.export.ExportedProgram, "
            f"got {type(model_or_program).__name__}"
        )
    # Every fake-quant op returns a packed mask of ceil(numel / 8) bytes. When
    # export records that tensor's metadata, torch asks whether its size is
    # below 2 and, on a dynamic batch, guards on the answer at the example's
    # size: with 4 elements a row, (7 + 4*batch)//8 >= 2 refuses batch 1 and 2
    # (the float program takes them). Size-oblivious reasoning answers such
    # questions without a guard, so the program runs at every batch size.
    # It guards elsewhere, though: torch's matmul on 4-D operands (attention's
    # q @ k.transpose(-2, -1)) reshapes them to 3-D, and size-oblivious export
    # guards a dynamic sequence length != 1 there, which refuses a range that
    # starts at 1 (the plain export takes it). Such a model gets the plain export.
    # A plain module has no graph whose stack traces the nodes could inherit: there the
    # traceback is the only pointer to the user's source, and it is kept.
    graph_input = isinstance(module, torch.fx.GraphModule)
    with no_new_stack_traces(graph_input):
        try:
            with torch.fx.experimental._config.patch(backed_size_oblivious=True):
                return torch.export.export(module, args, dynamic_shapes=dynamic_shapes)
        except torch._dynamo.exc.UserError as e:
            if e.error_type != torch._dynamo.exc.UserErrorType.CONSTRAINT_VIOLATION:
                raise
            oblivious_error = e
        try:
            return torch.export.export(module, args, dynamic_shapes=dynamic_shapes)
        except torch._dynamo.exc.UserError:
            raise oblivious_error from None
