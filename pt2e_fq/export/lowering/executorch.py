"""ExecuTorch `.pte` files with the XNNPACK delegate.

`to_executorch` lowers a converted model with to_qdq(target="xnnpack"), then
ExecuTorch's to_edge_transform_and_lower with the XNNPACK partitioner, and
writes the program atomically (files.py). `run_pte` runs a file in
ExecuTorch's Python runtime (check_lowered uses it).

Needs the `executorch` extra: pip install "pt2e_fq[executorch]" (executorch
1.5.x, which runs beside torch 2.13), imported only when these are called.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from ...files import check_writable, write_bytes
from ...graph import as_args
from .qdq import QdqSummary, UnsupportedPointError, to_qdq


def require_executorch() -> None:
    """Raises a clear ImportError when the `executorch` extra is missing."""
    try:
        import executorch.exir  # noqa: F401
        import executorch.runtime  # noqa: F401
    except ImportError as e:
        raise ImportError(f"ExecuTorch export needs executorch 1.5 ({e}); pip install 'pt2e_fq[executorch]'") from None


@dataclass(frozen=True)
class PteExport:
    """What to_executorch wrote: the file, what to_qdq did with each point,
    how many graph nodes the XNNPACK delegate took and which ops stayed
    outside it (op type: count, run by ExecuTorch's portable kernels), and
    the delegated nodes by op type (ExecuTorch's delegation summary: an int8
    linear or conv is there with its weight's dequantize,
    quantized_decomposed_dequantize_per_channel_default, say)."""

    path: str
    qdq: QdqSummary
    delegated_subgraphs: int
    delegated_nodes: int
    outside: dict
    delegated: dict = field(default_factory=dict)
    # Per node left outside the delegate: (node name, op, why XNNPACK did not take it).
    outside_nodes: list = field(default_factory=list)

    @property
    def delegated_linears(self) -> int:
        """Linears XNNPACK runs (ExecuTorch's count of aten.linear in the delegate)."""
        return self.delegated.get("aten_linear_default", 0)

    def why_outside(self) -> str:
        """One line per node left to ExecuTorch's portable kernels: the node, its op, and why."""
        return "\n".join(f"  {name} ({op}): {reason}" for name, op, reason in self.outside_nodes)

    def __str__(self) -> str:
        outside = ", ".join(f"{op} x{n}" for op, n in sorted(self.outside.items())) or "none"
        return (f"{self.path}: {len(self.qdq.lowered)} point(s) as q/dq, {len(self.qdq.in_float)} weight(s) in float; XNNPACK took "
                f"{self.delegated_nodes} node(s) in {self.delegated_subgraphs} subgraph(s); outside: {outside}")


def to_executorch(
    model_or_program,
    example_inputs,
    path: Union[str, os.PathLike],
    *,
    dynamic_shapes: Optional[Any] = None,
    unsupported: str = "error",
) -> PteExport:
    """Writes a converted model (or an ExportedProgram of one) as an
    ExecuTorch `.pte` file: to_qdq(target="xnnpack") (see qdq.py for what
    XNNPACK takes and what `unsupported` does; a point kept as our op has no
    ExecuTorch kernel, so "keep" is refused here), then
    to_edge_transform_and_lower with the XNNPACK partitioner. The file
    replaces `path` only once it is complete. `dynamic_shapes` is
    torch.export's; each dynamic dimension needs a largest size
    (`Dim("batch", min=1, max=64)`): ExecuTorch plans the file's memory for
    it, and the program then runs every size from min to max. Give an
    example of size 2 or more there: ExecuTorch narrows the range of a
    dimension whose example is 1 (an error here).

    Args:
        model_or_program: a converted model (a GraphModule from convert_pt2e) or an ExportedProgram of one.
        example_inputs: a tensor or a tuple of positional arguments.
        path: the `.pte` file to write.
        dynamic_shapes: as torch.export takes them; every dynamic dimension with a max.
        unsupported: "error" or "float" (see to_qdq; "keep" is refused).

    Returns:
        The PteExport: the path, the points lowered, the weights kept in float, the XNNPACK delegation.

    Raises:
        ImportError: the `executorch` extra is not installed.
        ValueError: unsupported="keep", or a dynamic dimension without a max or narrowed by its example.
        UnsupportedPointError: a point XNNPACK cannot take, with unsupported="error".
        pt2e_fq.files.WriteError: the file cannot be written.
    """
    require_executorch()
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.devtools.backend_debug import get_delegation_info
    from executorch.exir import to_edge_transform_and_lower

    if unsupported == "keep":
        raise ValueError(
            "to_executorch: unsupported='keep' would leave pt2e_fq ops, which ExecuTorch cannot run "
            "(no out variant); allowed: 'error', or 'float' to store weights XNNPACK cannot take as float"
        )
    check_writable(path)  # before the export's work
    args = as_args(example_inputs)
    program, summary = to_qdq(model_or_program, args, dynamic_shapes=dynamic_shapes, target="xnnpack",
                              unsupported=unsupported, summary=True)
    _check_bounded(program)
    with _partitioner_reasons() as reasons:
        edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    _check_ranges_kept(program, edge.exported_program())
    info = get_delegation_info(edge.exported_program().graph_module)
    outside = {op: b.non_delegated for op, b in info.delegation_by_operator.items()
               if b.non_delegated and op != "getitem"}
    delegated = {op: b.delegated for op, b in info.delegation_by_operator.items() if b.delegated}
    left = [n for n in edge.exported_program().graph.nodes
            if n.op == "call_function" and "quantize" in str(n.target)]
    if left:
        # ExecuTorch's Python runtime links no kernel for a quantize / dequantize
        # outside the delegate (to_executorch fails on "Missing out variants").
        node = left[0]
        users = ", ".join(u.name for u in node.users)
        raise UnsupportedPointError(
            f"to_executorch: XNNPACK did not take {len(left)} quantize/dequantize node(s) (first: {node.name}, "
            f"read by {users}) and ExecuTorch's runtime has no kernel for them outside the delegate; XNNPACK "
            "quantizes an op only when a dequantize feeds each of its inputs directly"
        )
    outside_nodes = _outside_nodes(edge.exported_program(), reasons)  # before to_executorch rewrites the graph
    write_bytes(path, edge.to_executorch().buffer)
    return PteExport(os.fspath(path), summary, info.num_delegated_subgraphs, info.num_delegated_nodes, outside,
                     delegated, outside_nodes)


# ExecuTorch's XNNPACK partitioner says why it rejects a node through
# WhyNoPartition, a debug record on its module's logger under this one.
_XNNPACK_LOGGER = "executorch.backends.xnnpack"
_NO_CONFIG = "XNNPACK has no kernel for this op (no partitioner config)"


@contextlib.contextmanager
def _partitioner_reasons():
    """Collects {node name: reason} from the XNNPACK partitioner's
    WhyNoPartition records while the block runs (the first reason per node)."""
    reasons: dict = {}

    class Collect(logging.Handler):
        def emit(self, record):
            why = record.msg
            node = getattr(why, "node", None)
            if node is not None and getattr(why, "reason", None):
                reasons.setdefault(node.name, why.reason)

    logger = logging.getLogger(_XNNPACK_LOGGER)
    handler, level, propagate = Collect(logging.DEBUG), logger.level, logger.propagate
    logger.addHandler(handler)
    # The records stay here: at DEBUG they would otherwise reach the user's root handlers.
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield reasons
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


_SIZE_ARITHMETIC = "a dynamic size (an integer, no tensor data), computed for the ops that take it"


def _outside_nodes(edge: torch.export.ExportedProgram, reasons: dict) -> list:
    """(name, op, reason) of each op node the delegate did not take."""
    found = []
    for node in edge.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem or "executorch_call_delegate" in str(node.target):
            continue
        if isinstance(node.meta.get("val"), (int, torch.SymInt)):  # sym_size, and products of sizes
            found.append((node.name, _op_name(node.target), _SIZE_ARITHMETIC))
            continue
        reason = reasons.get(node.name, _NO_CONFIG)
        if reason == "invalid dtype":  # XNNPACK's words for any input that is not a float or int8 tensor
            reason = _which_dtype(node)
        found.append((node.name, _op_name(node.target), reason))
    return found


def _which_dtype(node: torch.fx.Node) -> str:
    """XNNPACK's "invalid dtype", with the input it means: a size computed at
    run time (a reshape or slice to a dynamic size, which XNNPACK takes only
    as sizes fixed at export or one -1), or a tensor of another dtype."""
    inputs = [a for a in node.all_input_nodes if "val" in a.meta]
    if any(isinstance(a.meta["val"], torch.SymInt) for a in inputs):
        return "invalid dtype: an argument is a dynamic size (XNNPACK reshapes and slices to sizes fixed at export)"
    dtypes = sorted({str(a.meta["val"].dtype).removeprefix("torch.") for a in inputs
                     if isinstance(a.meta["val"], torch.Tensor)} - {"float32", "float16", "int8", "uint8"})
    return f"invalid dtype: {', '.join(dtypes)} input" if dtypes else "invalid dtype"


def _op_name(target) -> str:
    """aten.mean.dim for an edge op or an ATen overload, operator.mul for Python's."""
    from executorch.exir.dialects.edge._ops import EdgeOpOverload

    if isinstance(target, EdgeOpOverload):
        return str(target._op)
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return f"{target.__module__.lstrip('_')}.{target.__name__}"


def _check_bounded(program: torch.export.ExportedProgram) -> None:
    """A dynamic dimension without a largest size is an error: ExecuTorch
    would plan the memory for a bound of its own (measured: a Dim.AUTO batch
    exported at batch 1 ran up to 15 and failed at 33 with "Attempted to
    resize a bounded tensor")."""
    from torch.utils._sympy.numbers import int_oo

    unbounded = sorted(str(s) for s, r in program.range_constraints.items() if r.upper == int_oo)
    if unbounded:
        raise ValueError(
            f"to_executorch: dynamic_shapes: dimension(s) {', '.join(unbounded)} have no largest size; ExecuTorch "
            "plans the file's memory for the largest shape, so give each dynamic dimension a max, e.g. "
            "torch.export.Dim('batch', min=1, max=64) (Dim.AUTO and Dim.DYNAMIC have none)"
        )


def _check_ranges_kept(program: torch.export.ExportedProgram, edge: torch.export.ExportedProgram) -> None:
    """ExecuTorch's lowering must keep each dynamic dimension's largest
    size, for which it plans the memory: measured, a batch of Dim(min=1,
    max=8) exported on an example of batch 1 came out as [1, 2] (the .pte
    then refused batch 3), on batch 3 as [1, 8]. A smallest size of 1 that
    comes out as 2 is torch's 0/1 specialization of its retrace, not a
    limit: a Llama decoder's range [1, 64] came out as [2, 64], and its .pte
    runs batch 1 and sequence length 1 (tested)."""
    narrowed = [f"{s}: [{r.lower}, {r.upper}] became [{edge.range_constraints[s].lower}, "
                f"{edge.range_constraints[s].upper}]"
                for s, r in program.range_constraints.items()
                if s in edge.range_constraints and edge.range_constraints[s].upper != r.upper]
    if narrowed:
        raise ValueError(
            f"to_executorch: ExecuTorch's lowering narrowed the dynamic dimension(s) {'; '.join(narrowed)}; "
            "give example inputs whose dynamic dimensions are 2 or more (an example of size 1 makes it do that)"
        )


def run_pte(path: Union[str, os.PathLike], inputs) -> list[torch.Tensor]:
    """The outputs of a `.pte` file's forward on `inputs`, run in
    ExecuTorch's Python runtime. A missing file is a FileNotFoundError, a
    file that is not an ExecuTorch program (or is damaged) a ValueError,
    each naming the path."""
    require_executorch()
    from executorch.runtime import Runtime

    check_pte_file("run_pte", path)
    try:
        program = Runtime.get().load_program(os.fspath(path))
    except RuntimeError as e:  # ExecuTorch's own words are an error code: "Failed to load program, error: 0x:23"
        raise ValueError(f"run_pte: {os.fspath(path)!r} is not an ExecuTorch program, or is damaged "
                         f"(ExecuTorch: {e})") from None
    return list(program.load_method("forward").execute(list(as_args(inputs))))


# A .pte file is a flatbuffer whose file identifier, bytes 4 to 8, is "ET" and
# a two-digit schema version ("ET12" for executorch 1.5).
_PTE_IDENTIFIER = slice(4, 8)


def check_pte_file(where: str, path: Union[str, os.PathLike]) -> None:
    """A FileNotFoundError for a missing file (IsADirectoryError for a
    folder), a ValueError for one without ExecuTorch's identifier, each
    naming `where` and the path."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"{where}: {os.fspath(path)!r} is a folder; give a .pte file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{where}: no such file {os.fspath(path)!r}")
    with open(path, "rb") as f:
        identifier = f.read(8)[_PTE_IDENTIFIER]
    if not (identifier[:2] == b"ET" and identifier[2:].isdigit()):
        raise ValueError(f"{where}: {os.fspath(path)!r} is not an ExecuTorch program (a .pte file carries the "
                         f"identifier ET<version> at byte 4; this one has {identifier!r})")
