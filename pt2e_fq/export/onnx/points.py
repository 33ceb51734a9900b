"""The exported file beside the program it came from: the setup of check_onnx
and first_divergence, written once (`Run`: the program's node values on the
inputs, the file with its shapes inferred, the feeds), and the strict check
that every point of the file is bit for bit the program's (`check_points`).
A mismatch is an `OnnxMismatch`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Union

import numpy as np
import torch
from torch.utils._pytree import tree_leaves, tree_map

from ...graph import as_args, decode_node, is_fake_quant_node, program_constants
from ..output_diff import output_diff
from ..program import exported_program
from .export import POINTS_METADATA, require_onnx
from .session import ort_session


class OnnxMismatch(AssertionError):
    """An exported ONNX file does not compute what its model computes (or is
    not the model's file); the message says where and by how much."""


# An output that no constant-scale DequantizeLinear produces (a float output,
# weight-only models) may differ by the rounding of the float ops: this share
# of its largest magnitude.
FLOAT_OUTPUT_RTOL = 1e-5


def numpy_of(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        raise TypeError(
            "check_onnx: ONNX Runtime's Python API exchanges no bfloat16 arrays (numpy has no bfloat16); "
            "check the model in float32 or float16"
        )
    return t.detach().cpu().numpy()


def float_tolerance(expected: np.ndarray) -> float:
    finite = np.abs(expected[np.isfinite(expected)])
    return FLOAT_OUTPUT_RTOL * float(finite.max()) if finite.size else 0.0


def node_values(ep: torch.export.ExportedProgram, args) -> dict[str, torch.Tensor]:
    """Every node's value in a run of the program, by node name, and the
    program's parameters, buffers and constants by placeholder name (a
    dynamic point may read one directly: a position embedding)."""
    values = dict(program_constants(ep))

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            result = super().run_node(node)
            # A copy: a later in-place op (`out += x`, relu_) would change
            # the recorded tensor under the point that read it.
            values[node.name] = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, result)
            return result

    module = ep.module()
    with torch.no_grad():
        Recorder(module).run(*tree_leaves(args))
    # The module's placeholders are the program's user inputs in order, but
    # FX renames one that shadows a Python builtin (nn.Sequential's `input`
    # becomes `input_1`): give their values the program's names too.
    placeholders = [n.name for n in module.graph.nodes if n.op == "placeholder"]
    for program_name, module_name in zip(ep.graph_signature.user_inputs, placeholders):
        values[program_name] = values[module_name]
    return values


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def check_points(model, ep, values, graph_feeds: dict) -> list:
    """Runs each point's Q/DQ subgraph of `model` (located by the file's
    POINTS_METADATA) on the torch point's input and compares bit for bit;
    returns the (program node, file entry) of every point, in graph order.

    The file's points pair with the program's in graph order (to_onnx
    records them as it translates the program's nodes in order), not by
    name: the exporter decomposes the program first and renames its nodes.
    Its optimizer merges identical subgraphs (CSE: two norms' weights that
    are both all ones give the same codes and scales), so a point whose
    output is gone from the file must give, in torch, the bits of a point
    that was checked."""
    from onnx.utils import Extractor

    metadata = {p.key: p.value for p in model.metadata_props}.get(POINTS_METADATA)
    if metadata is None:
        raise OnnxMismatch(f"check_onnx: the file has no {POINTS_METADATA!r} metadata; export it with to_onnx")
    file_points = json.loads(metadata)
    nodes = [node for node in ep.graph.nodes if is_fake_quant_node(node)]
    if not nodes:
        suspect = (f"the file has {len(file_points)} point(s): pass the converted model it was exported "
                   "from, not the float model" if file_points else
                   "neither has the file: export and check a converted model (pipeline.convert)")
        raise OnnxMismatch(f"check_onnx: the model has no fake-quant point, so nothing would be checked; {suspect}")
    if len(nodes) != len(file_points):
        raise OnnxMismatch(
            f"check_onnx: the file has {len(file_points)} points, the model {len(nodes)}; check the file against "
            "the model it was exported from"
        )
    file_values = {v for n in model.graph.node for v in n.output} | {v.name for v in model.graph.input} | {
        t.name for t in model.graph.initializer}
    extractor = Extractor(model)
    checked, merged = [], []
    pairs = list(zip(nodes, file_points))
    for node, file_point in pairs:
        expected = numpy_of(values[output_of(node).name])
        x_name, y_name = file_point["input"], file_point["output"]
        if y_name not in file_values:
            merged.append((node, expected))
            continue
        # The graph's inputs come along: a point of a dynamic batch reads its
        # size from them (Shape of the model's input) for its qparams' layout.
        feeds = {**graph_feeds, **({x_name: numpy_of(values[node.args[0].name])} if x_name else {})}
        point = extractor.extract_model(list(feeds), [y_name])
        (got,) = ort_session(point, optimized=False).run(None, feeds)
        if not same_bits(got, expected):
            if x_name:  # an input of the run (a weight point reads a constant of the file)
                explain_nan(node, x_name, y_name, values[node.args[0].name], got, expected)
            raise OnnxMismatch(
                f"check_onnx: point {node.name} ({x_name} -> {y_name} in the file) differs from torch in ONNX "
                f"Runtime on the same input: {int((got != expected).sum())} of {got.size} elements, max |diff| "
                f"{output_diff(0, expected, got, None).max_abs_diff:g}; it must be bit-exact"
            )
        checked.append(expected)
    for node, expected in merged:
        if not any(same_bits(expected, c) for c in checked):
            raise OnnxMismatch(
                f"check_onnx: point {node.name} is not in the file, and no point of the file gives its values "
                "(its subgraph was merged away by the exporter's optimizer only if an identical one remains)"
            )
    return pairs


def output_of(node) -> torch.fx.Node:
    (y,) = [u for u in node.users if u.args[1] == 0]
    return y


def explain_nan(node, x_name, y_name, x: torch.Tensor, got: np.ndarray, expected: np.ndarray) -> None:
    """Raises the precise AssertionError when a point differs only where its
    input is NaN and torch gives NaN: an integer QuantizeLinear has no NaN
    code (ONNX leaves the conversion undefined; ONNX Runtime 1.32 CPU gives
    the lowest code, as for -Inf), so the file turns NaN into a finite value."""
    x = numpy_of(x)
    if got.shape != expected.shape or x.shape != expected.shape:
        return
    differs = ~((got == expected) | (np.isnan(got) & np.isnan(expected)))
    nan_in = np.isnan(x)
    if not differs.any() or not (nan_in[differs].all() and np.isnan(expected[differs]).all()):
        return
    fmt = decode_node(node).format
    finite = np.unique(got[differs])
    raise OnnxMismatch(
        f"check_onnx: point {node.name} ({x_name} -> {y_name}) gets {int(nan_in.sum())} NaN input element(s): "
        f"torch gives NaN, ONNX Runtime {', '.join(f'{v:g}' for v in finite[:4])} (QuantizeLinear to {fmt!r} "
        "has no NaN code; ONNX Runtime uses the lowest, as for -Inf); every other element is bit-exact. "
        "The ONNX file turns NaN inputs into finite values (docs/export.md, 'Non-finite values'): check it "
        "with finite inputs"
    )


@dataclass
class Run:
    """The program and the file side by side on the same inputs."""

    args: tuple
    program: torch.export.ExportedProgram
    values: dict  # every node's value in the program's run, by node name
    model: object  # the onnx.ModelProto, shapes inferred
    feeds: list  # the inputs as numpy arrays, in the file's input order
    graph_feeds: dict  # the same by the file's input names
    pairs: list  # (program node, file point) of every point, in graph order, checked bit for bit


def run(path: Union[str, os.PathLike], model, inputs) -> Run:
    """Runs `model` (a converted model or an ExportedProgram) on `inputs`,
    loads the file at `path`, and checks each of its points bit for bit
    against the program's (check_points)."""
    require_onnx()
    import onnx

    args = as_args(inputs)
    # An empty tensor leaves no element to compare, and torch.export specialises a program to a size of 0
    # (the points it keeps differ from the file's): refused, not reported as another model's file.
    for k, a in enumerate(tree_leaves(args)):
        if isinstance(a, torch.Tensor) and a.numel() == 0:
            raise ValueError(f"check_onnx: inputs: input {k} of shape {tuple(a.shape)} has no element, so nothing "
                             "would be compared; check with inputs of at least one element (a batch of 1 or more)")
    program = exported_program(model, args)
    values = node_values(program, args)
    onnx_model = onnx.shape_inference.infer_shapes(onnx.load(os.fspath(path)))
    feeds = [numpy_of(a) for a in tree_leaves(args)]
    graph_feeds = {i.name: v for i, v in zip(onnx_model.graph.input, feeds)}
    pairs = check_points(onnx_model, program, values, graph_feeds)
    return Run(args, program, values, onnx_model, feeds, graph_feeds, pairs)
