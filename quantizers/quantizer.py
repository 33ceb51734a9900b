"""FakeQuantQuantizer: the torchao Quantizer that annotates an exported graph
from a QuantizerConfig, refuses what the backend cannot run, and describes
what it will do before prepare.

    quantizer = FakeQuantQuantizer(presets.get_preset("w8a8"))
    gm = torch.export.export(model, example).module()
    print(quantizer.describe(gm))
    prepared = prepare_pt2e(gm, quantizer)   # or prepare_qat_pt2e
"""

from __future__ import annotations

import warnings
from typing import Optional, Union

import torch
from tabulate import tabulate
from torch.fx import GraphModule, Node
from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, Quantizer, SharedQuantizationSpec

from pt2e_fq import QSpec
from pt2e_fq.calib.rotation import rotate_inputs
from pt2e_fq.eval_mode import record_batch_norms, restore_batch_norms
from pt2e_fq.flow import own_tensors
from pt2e_fq.ops.blocks import reduced_shape
from pt2e_fq.graph import float_weights_text

from .config import OP_CONFIG_KEYS, QuantizerConfig
from .patterns import op_type
from .plan import (Plan, PlannedInput, PlannedPoint, build_plan, module_stack, node_or_edge_name,
                   unused_entries_text, weights_as_activations_text)

# What the fused op takes (docs/fake_quantize.md).
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class UnsupportedQuantizationError(ValueError):
    """The config asks for fake quantization the backend cannot run."""


def _module_of(node: Node) -> str:
    stack = module_stack(node)
    if not stack:
        return "module '' (the model itself)"
    path, type_name = stack[-1]
    return f"module '{path}' ({type_name.rsplit('.', 1)[-1]})"


def _tensor_shape_dtype(node: Node):
    val = node.meta.get("val")
    return (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else (None, None)


def _qparam_shape(spec: QSpec, shape) -> tuple:
    return tuple(reduced_shape(shape, spec.range_granularity.block_size(shape)))


def _is_dynamic(size) -> bool:
    """A size that varies: a symbol of torch.export's dynamic shapes (a
    SymInt whose expression has free symbols; ceil(s / s) simplifies to 1)."""
    return isinstance(size, torch.SymInt) and bool(size.node.expr.free_symbols)


def _shape_text(shape) -> str:
    """A shape with its dynamic sizes as '*' (their symbols mean nothing to a user)."""
    return "(" + ", ".join("*" if _is_dynamic(s) else str(int(s)) for s in shape) + ("," if len(shape) == 1 else "") + ")"


class FakeQuantQuantizer(Quantizer):
    """Annotates linear, conv, conv_transpose, matmul/bmm/mm, addmm and
    einsum linears, embedding, add, mul, cat and stack nodes as `config` says (see quantizers.patterns for
    the patterns and quantizers.plan for how points are shared).

    Args:
        config: what to quantize and how (presets.get_preset(name) gives one).

    Raises:
        TypeError: config is not a QuantizerConfig.
        UnsupportedQuantizationError: (from validate, which torchao's prepare calls) a point the backend
            cannot run, with its node and module.
    """

    def __init__(self, config: QuantizerConfig):
        super().__init__()
        if not isinstance(config, QuantizerConfig):
            raise TypeError(f"FakeQuantQuantizer: config must be a QuantizerConfig, got {type(config).__name__}")
        self.config = config

    def plan(self, model: Union[GraphModule, torch.export.ExportedProgram]) -> Plan:
        """The fake-quant points the config gives `model` (nothing is changed)."""
        if isinstance(model, torch.export.ExportedProgram):
            model = model.module()
        return build_plan(model, self.config)

    # -- torchao Quantizer ----------------------------------------------------------

    def transform_for_annotation(self, model: GraphModule) -> GraphModule:
        """Gives `model` its own copies of its parameters and buffers
        (pt2e_fq.flow.own_tensors): the GraphModule of
        `torch.export.export(float_model, ...).module()` holds float_model's
        tensors, and QAT would train them (a distillation teacher with them).
        Records each batch norm's momentum and eps in `model.meta`:
        prepare_qat_pt2e's conv-bn fusion, which runs after this hook, writes
        0.1 and 1e-5 into every one (pt2e_fq.eval_mode). With the config's
        `input_rotation`, rotates the inputs of the linears and convolutions
        whose input or weight the config quantizes (pt2e_fq.calib.rotation), warning about
        any it had to leave unrotated; the report is `model.meta["input_rotation"]`.

        Args:
            model: the exported GraphModule prepare_pt2e / prepare_qat_pt2e was given.

        Returns:
            `model`; its graph changed only by the rotations.
        """
        own_tensors(model)
        record_batch_norms(model)
        if self.config.input_rotation is not None:
            self._rotate(model)
        return model

    def _rotate(self, model: GraphModule) -> None:
        def quantized(node) -> bool:
            cfg = self.config.resolve(op_type(node), module_stack(node)).config
            return cfg is not None and (cfg.input_activation is not None or cfg.weight is not None)

        report = rotate_inputs(model, self.config.input_rotation, wanted=quantized)
        model.meta["input_rotation"] = report
        if report.skipped:
            warnings.warn(f"FakeQuantQuantizer: {len(report.skipped)} layer(s) left unrotated:\n{report}",
                          stacklevel=3)

    def prepare_obs_or_fq_callback(self, model: GraphModule, edge_or_node_to_obs_or_fq: dict) -> None:
        """Writes back each batch norm's recorded momentum and eps; torchao
        calls it after its conv-bn fusion, before it inserts the fake-quant
        modules.

        Args:
            model: the GraphModule being prepared.
            edge_or_node_to_obs_or_fq: torchao's map of the modules to insert (left as it is).
        """
        restore_batch_norms(model)

    def annotate(self, model: GraphModule) -> GraphModule:
        """Writes the plan's annotations; warns naming every op with weights
        that no op pattern covers (their weights stay float)."""
        plan = self.plan(model)
        for text in _warnings(plan):
            warnings.warn(f"FakeQuantQuantizer: {text}", stacklevel=2)
        specs: dict[QSpec, object] = {}

        def torchao_spec(point: Optional[PlannedPoint]):
            if point is None:
                return None
            if point.shared_with is not None:
                return SharedQuantizationSpec(point.shared_with)
            if point.qspec not in specs:
                specs[point.qspec] = point.qspec.to_quantization_spec()
            return specs[point.qspec]

        for node, ann in plan.annotations.items():
            node.meta["quantization_annotation"] = QuantizationAnnotation(
                input_qspec_map={arg: torchao_spec(p) for arg, p in ann.inputs.items()},
                output_qspec=torchao_spec(ann.output),
                allow_implicit_sharing=False,  # all sharing is explicit (quantizers.plan)
                _annotated=True,
            )
        return model

    def validate(self, model: GraphModule) -> None:
        """Raises UnsupportedQuantizationError listing every point the backend
        cannot run: its node, module path and the reason."""
        plan = self.plan(model)
        problems = []
        for node, tensor, where, point in plan.points():
            reason = self._problem(tensor, point)
            if reason:
                edge = f"input '{tensor.name}' of node '{node.name}'" if where == "input" else f"output of node '{node.name}'"
                problems.append(f"  {edge} ({node.target}) in {_module_of(node)}: {reason}")
        if problems:
            raise UnsupportedQuantizationError(
                f"FakeQuantQuantizer: {len(problems)} fake-quant point(s) cannot run on this backend:\n"
                + "\n".join(problems)
            )

    @staticmethod
    def _problem(tensor: Node, point: PlannedPoint) -> Optional[str]:
        spec = point.qspec
        shape, dtype = _tensor_shape_dtype(tensor)
        if dtype not in SUPPORTED_DTYPES:
            allowed = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
            return f"the tensor is {dtype}; fake quantization takes {allowed}"
        try:
            spec.granularity.block_size(shape)
            qparams = _qparam_shape(spec, shape)
        except ValueError as e:
            return f"{spec} does not fit a tensor of shape {shape}: {e}"
        if not spec.dynamic and any(_is_dynamic(r) for r in qparams):
            dims = [d for d, s in enumerate(shape) if _is_dynamic(s)]
            return (f"{spec} is static, but its qparams (shape {_shape_text(qparams)}) follow the dynamic "
                    f"dimension(s) {dims} of the tensor (shape {_shape_text(shape)}), so it would fail at another "
                    "size; use a granularity whose qparams do not depend on them (PerTensor, PerChannel or PerGroup "
                    "on a static axis) or dynamic=True")
        if point.shared_with is not None and not spec.dynamic:
            root = point.shared_with if isinstance(point.shared_with, Node) else point.shared_with[0]
            root_qparams = _qparam_shape(spec, _tensor_shape_dtype(root)[0])
            if root_qparams != qparams:
                return (f"it shares the fake-quant module of {node_or_edge_name(point.shared_with)}, whose "
                        f"qparams have shape {root_qparams}, but {spec} needs {qparams} here")
        return None

    # -- describe ---------------------------------------------------------------------

    def describe(self, model: Union[GraphModule, torch.export.ExportedProgram], print_table: bool = True) -> str:
        """A table of every op the config reaches and what each of its
        tensors gets, before prepare, the number of fake-quant modules,
        whether the model's outputs are quantized (model_output), then a
        warning naming every op with weights that no op pattern covers;
        printed and returned."""
        plan = self.plan(model)
        rows = []
        for op in plan.ops:
            node = op.node
            path = module_stack(node)[-1][0] if module_stack(node) else ""
            cells = {k: "-" for k in OP_CONFIG_KEYS}
            if op.config is None:
                cells = {k: "float" for k in OP_CONFIG_KEYS}
            else:
                for role in ("input_activation", "weight", "bias"):
                    texts = [_input_text(p) for p in op.inputs if p.role == role]
                    if texts:
                        cells[role] = "\n".join(texts)
                end = op.match.output
                out = plan.annotations.get(end).output if end is not None and end in plan.annotations else None
                if out is not None:
                    cells["output_activation"] = str(out.qspec) + ("" if end is node else f" (after {end.name})")
                elif op.fused_into is not None:
                    cells["output_activation"] = f"float: into {op.fused_into.name} (fuse_conv_add)"
                elif op.output_is_model_output and op.config.output_activation is not None:
                    cells["output_activation"] = "float: a model output (model_output: false)"
                elif op.match.shared_inputs and op.config.input_activation is not None:
                    cells["output_activation"] = "on the inputs' shared grid"
            rows.append([node.name, op.match.op_type, path, op.rule, *cells.values()])
        for node, ann in plan.annotations.items():  # averaging pools
            if ann.output is not None and ann.output.shared_with is not None:
                name = node_or_edge_name(ann.output.shared_with)
                rows.append([node.name, getattr(node.target, "_opname", str(node.target)), "", "pool", "-", "-", "-",
                             f"{ann.output.qspec} (shared with {name})"])
        table = tabulate(rows, headers=["node", "op", "module", "config from", *OP_CONFIG_KEYS])
        table += f"\n{plan.num_modules} fake-quant module(s)"
        table += "\nmodel outputs: " + ("quantized where an op config gives them an output point (model_output: true)"
                                        if self.config.model_output else "float (model_output: false)")
        for text in _warnings(plan):
            table += "\nwarning: " + text
        if print_table:
            print(table)
        return table


def _warnings(plan: Plan) -> list[str]:
    """What describe ends with and annotate warns: weights no op pattern
    covers, weights read as activations, config entries that match no op."""
    texts = [float_weights_text(plan.float_weight_ops), weights_as_activations_text(plan.weights_as_activations),
             unused_entries_text(plan.unused_entries)]
    return [t for t in texts if t]


def _input_text(p: PlannedInput) -> str:
    if p.qspec is None:
        return "-"
    if p.reuses is not None:
        return f"{p.qspec} (already at {node_or_edge_name(p.reuses)})"
    if p.point.shared_with is not None:
        return f"{p.qspec} (shared with {node_or_edge_name(p.point.shared_with)})"
    return str(p.qspec)
