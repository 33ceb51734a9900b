"""Plan: every fake-quant point of an exported graph under a QuantizerConfig,
and which points share one fake-quant module.

A tensor is fake-quantized once per QSpec. The walk goes through the graph in
order and keeps, for every tensor whose value is already fake-quantized (an
op's quantized output, seen through pass-through ops such as view and
max-pool and no-op casts while the QSpec is per-tensor, or a cat's shared input group), the
QSpec and the point that did it. A consumer asking for that same QSpec
reuses it (no new point); siblings asking for the same QSpec of the same
tensor share one module; a different QSpec gets its own point (a
requantization).

The sharing is explicit: the quantizer writes SharedQuantizationSpecs and
turns torchao's implicit sharing off, because torchao merges adjacent points
whose dtype / range / qscheme agree without comparing their observers or
granularity (docs/fake_quantize.md, trap 1).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from dataclasses import dataclass, field
from typing import Optional, Union

from torch.fx import GraphModule, Node

from pt2e_fq import IntFormat, PerBlock, PerChannel, PerGroup, PerTensor, QSpec
from pt2e_fq.graph import float_weight_ops, is_constant, is_rotation_matrix, module_path, target_name

from .config import OpConfig, QuantizerConfig
from .patterns import AVERAGING_POOLS, COMPUTING_OP_TYPES, CONV_OPS, WEIGHT, OpMatch, activation_ops, match, passes_grid, residual_add

EdgeOrNode = Union[Node, tuple[Node, Node]]


@dataclass(frozen=True)
class PlannedPoint:
    """One quantized tensor: an op's input edge or a node's output. A point
    with `shared_with` uses the fake-quant module of that edge or node."""

    qspec: QSpec
    shared_with: Optional[EdgeOrNode] = None


@dataclass
class NodeAnnotation:
    """What the quantizer writes on one node: its input edges in argument
    order (None: not quantized here) and its output point."""

    inputs: dict[Node, Optional[PlannedPoint]] = field(default_factory=dict)
    output: Optional[PlannedPoint] = None


@dataclass
class PlannedInput:
    arg: Node
    role: str
    qspec: Optional[QSpec]  # None: left in float
    point: Optional[PlannedPoint] = None  # a new or shared point on this edge
    reuses: Optional[EdgeOrNode] = None  # already quantized there with this QSpec


@dataclass
class PlannedOp:
    """An op that takes an op config, the config chosen and why."""

    match: OpMatch
    config: Optional[OpConfig]
    rule: str
    inputs: list[PlannedInput] = field(default_factory=list)
    output_is_model_output: bool = False  # its output is read by the model's outputs only
    fused_into: Optional[Node] = None  # the residual add its float output goes into (fuse_conv_add)

    @property
    def node(self) -> Node:
        return self.match.node


@dataclass
class Plan:
    """ops: every op an op config can reach; float_weight_ops: the ops that
    read a weight (two or more dimensions) and that no op pattern covers, so
    no config can quantize it (pt2e_fq.graph.float_weight_ops)."""

    ops: list[PlannedOp] = field(default_factory=list)
    annotations: dict[Node, NodeAnnotation] = field(default_factory=dict)
    float_weight_ops: list[dict] = field(default_factory=list)
    # Weights an op reads as an activation operand (a layout the weight's
    # (out, in) axes do not map onto): {op, target, module, weights
    # [(name, shape)], qspec (the activation QSpec it gets, or None: float)}.
    weights_as_activations: list[dict] = field(default_factory=list)
    # The config's module-name, regex and module-type entries no op resolved to (section, key).
    unused_entries: list[tuple[str, str]] = field(default_factory=list)

    def points(self):
        """(node, tensor, role, point) for every point: `tensor` is the value
        quantized, `node` the node whose annotation holds the point."""
        for node, ann in self.annotations.items():
            for arg, p in ann.inputs.items():
                if p is not None:
                    yield node, arg, "input", p
            if ann.output is not None:
                yield node, node, "output", ann.output

    @property
    def num_modules(self) -> int:
        return sum(p.shared_with is None for *_, p in self.points())


def module_stack(node: Node) -> list[tuple[str, str]]:
    """(path, type name) of the modules a node was called in, outermost first."""
    return list(node.meta.get("nn_module_stack", {}).values())


def node_or_edge_name(where: EdgeOrNode) -> str:
    return where.name if isinstance(where, Node) else f"{where[0].name}->{where[1].name}"


def _swap_axes_0_1(spec: QSpec) -> QSpec:
    """Weight axes are given in the (out, in, ...) layout of linear and conv
    weights; conv_transpose, addmm and x @ W store (in, out, ...)."""
    g = spec.granularity
    swap = {0: 1, 1: 0}
    if isinstance(g, PerChannel):
        g = PerChannel(swap.get(g.axis, g.axis))
    elif isinstance(g, PerGroup):
        g = PerGroup(g.group_size, swap.get(g.axis, g.axis))
    elif isinstance(g, PerBlock) and len(g.block) >= 2:
        g = PerBlock((g.block[1], g.block[0], *g.block[2:]))
    return dataclasses.replace(spec, granularity=g)


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def _conv_weight_groups(spec: QSpec, weight: Node, in_axis: int) -> QSpec:
    """An integer PerGroup along a conv weight's input-channel axis that is
    longer than that axis: the group also spans kernel positions, last
    spatial dim first, up to group_size elements (every block the same
    shape, so a spatial dim contributes the largest divisor of its size that
    fits). Without it a group is one filter's input channels at a single
    kernel position: a depthwise (C, 1, k, k) weight would have one scale
    per element (exact, so a 4-bit preset's conv layers would stay float in
    effect), a stem conv (C, 3, k, k) groups of 3 instead of 32."""
    g = spec.granularity
    val = weight.meta.get("val")
    if not (isinstance(spec.format, IntFormat) and isinstance(g, PerGroup) and val is not None and val.dim() >= 3):
        return spec
    shape = val.shape
    if g.axis % len(shape) != in_axis or not all(isinstance(d, int) for d in shape):
        return spec
    positions = g.group_size // shape[in_axis]
    if positions < 2:
        return spec
    block = [1] * len(shape)
    block[in_axis] = shape[in_axis]
    for d in reversed(range(2, len(shape))):
        block[d] = _largest_divisor_at_most(shape[d], positions)
        positions //= block[d]
    if math.prod(block) == shape[in_axis]:
        return spec
    return dataclasses.replace(spec, granularity=PerBlock(tuple(block)))


def _weights_in(arg: Node) -> list[tuple[str, tuple]]:
    """(name, shape) of the weights (float parameters or buffers of two or
    more dimensions, as pt2e_fq.graph.weight_readers counts them) that a
    constant operand is computed from."""
    if not is_constant(arg):
        return []
    found, todo, seen = [], [arg], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr":
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor) and val.is_floating_point() and val.dim() >= 2 \
                    and not is_rotation_matrix(n.target):
                found.append((n.target, tuple(val.shape)))
        else:
            todo += n.all_input_nodes
    return found


def unused_entries_text(entries: list[tuple[str, str]]) -> str:
    """The warning of Plan.unused_entries, or "" where there is none."""
    if not entries:
        return ""
    return (f"{len(entries)} config entr{'y' if len(entries) == 1 else 'ies'} matched no op of this model: "
            + ", ".join(f"{section}[{key!r}]" for section, key in entries))


def weights_as_activations_text(ops: list[dict]) -> str:
    """The warning of Plan.weights_as_activations, or "" where there is none."""
    if not ops:
        return ""
    where = "; ".join(
        f"{o['op']} ({o['target']}) in module '{o['module']}': " + ", ".join(f"{n} {tuple(s)}" for n, s in o["weights"])
        + (f" gets the input_activation QSpec {o['qspec']}" if o["qspec"] is not None else " stays float")
        for o in ops)
    return (f"{len(ops)} op(s) read a weight through a layout whose output channels the weight QSpec cannot be "
            f"mapped onto (only a 2-D relayout of a parameter is a matmul weight), so it is treated as an "
            f"activation: {where}")


def _only_model_output(node: Node) -> bool:
    """Every reader of the node, seen through pass-through ops, is the graph's output."""
    return bool(node.users) and all(u.op == "output" or (passes_grid(u) and _only_model_output(u))
                                    for u in node.users)


class _Walk:
    def __init__(self, config: QuantizerConfig):
        self.config = config
        self.plan = Plan()
        # Tensors whose value is fake-quantized: node -> (QSpec, the point that did it).
        self.quantized: dict[Node, tuple[QSpec, EdgeOrNode]] = {}
        # First edge that quantized a tensor with a QSpec, for siblings to share.
        self.edge_roots: dict[tuple[Node, QSpec], EdgeOrNode] = {}
        # Residual adds of fuse_conv_add -> their input left in float (the conv's output).
        self.float_inputs: dict[Node, Node] = {}
        # Activations quantized with the op before them (fuse_activations).
        self.activations = activation_ops(config.fuse_activations)
        self.used_entries: set = set()

    def annotation(self, node: Node) -> NodeAnnotation:
        return self.plan.annotations.setdefault(node, NodeAnnotation())

    def _carries_grid(self, src: Node) -> bool:
        """A pass-through op keeps its input's grid when that input has one
        static-or-dynamic per-tensor scale (per-channel axes and groups move)."""
        return src in self.quantized and isinstance(self.quantized[src][0].granularity, PerTensor)

    def input_point(self, planned: PlannedInput, node: Node, group_root: Optional[EdgeOrNode]):
        """Fills planned.point / planned.reuses; returns the root of the tensor's quantization."""
        arg, spec = planned.arg, planned.qspec
        done = self.quantized.get(arg)
        if done is not None and (done[1] == group_root or (group_root is None and done[0] == spec)):
            planned.reuses = done[1]
            return done[1]
        if group_root is not None:  # cat / stack: the group's module, whatever this input had before
            planned.point = PlannedPoint(spec, shared_with=group_root)
            return group_root
        key = (arg, spec)
        if key in self.edge_roots:
            planned.point = PlannedPoint(spec, shared_with=self.edge_roots[key])
        else:
            planned.point = PlannedPoint(spec)
            self.edge_roots[key] = (arg, node)
        return self.edge_roots[key]

    def op(self, m: OpMatch) -> None:
        resolution = self.config.resolve(m.op_type, module_stack(m.node))
        self.used_entries.add(resolution.entry)
        planned = PlannedOp(m, resolution.config, resolution.rule)
        self.plan.ops.append(planned)
        cfg = resolution.config
        if cfg is None:
            return
        ann = self.annotation(m.node)
        group_root = None
        for arg, role in m.inputs:
            spec = None if self.float_inputs.get(m.node) is arg else getattr(cfg, role)
            if spec is not None and role == WEIGHT:
                if m.weight_transposed:
                    spec = _swap_axes_0_1(spec)
                if m.op_type in CONV_OPS:
                    spec = _conv_weight_groups(spec, arg, in_axis=0 if m.weight_transposed else 1)
            p = PlannedInput(arg, role, spec)
            planned.inputs.append(p)
            # A constant operand of a matmul is meant as a weight (an add's or a cat's, such as
            # position embeddings or a class token, is a tensor added to or joined with activations).
            if role != WEIGHT and m.op_type in COMPUTING_OP_TYPES:
                weights = _weights_in(arg)
                if weights:
                    self.plan.weights_as_activations.append(dict(
                        op=m.node.name, target=target_name(m.node), module=module_path(m.node),
                        weights=weights, qspec=spec))
            if spec is not None:
                root = self.input_point(p, m.node, group_root)
                if m.shared_inputs:
                    group_root = root
            # Every input gets an entry, None where nothing is inserted:
            # prepare_qat_pt2e's conv-bn fusion reads a conv's entries by
            # position (input, weight, bias).
            ann.inputs[arg] = p.point
        if m.shared_inputs:
            if group_root is not None and isinstance(cfg.input_activation.granularity, PerTensor) \
                    and not cfg.input_activation.dynamic:
                self.quantized[m.node] = (cfg.input_activation, group_root)
            return
        for inner in m.inner:
            self.annotation(inner)
        if self._fuses_into_add(m, cfg):
            self.annotation(m.output)
            planned.fused_into = residual_add(m)
            self.float_inputs[planned.fused_into] = m.output
            return
        planned.output_is_model_output = m.output is not None and _only_model_output(m.output)
        if m.output is not None and cfg.output_activation is not None and (
                self.config.model_output or not planned.output_is_model_output):
            self.annotation(m.output).output = PlannedPoint(cfg.output_activation)
            self.quantized[m.output] = (cfg.output_activation, m.output)

    def _fuses_into_add(self, m: OpMatch, cfg: OpConfig) -> bool:
        """fuse_conv_add: the op is a conv2d unit ending in a residual add
        that quantizes its other input and its output (the add's own config),
        so the conv's output point is left out. An add takes one conv (the
        first; the other operand of conv + conv keeps its point)."""
        add = residual_add(m) if self.config.fuse_conv_add and cfg.output_activation is not None else None
        if add is None or add in self.float_inputs:
            return False
        add_cfg = self.config.resolve("add", module_stack(add)).config
        return add_cfg is not None and add_cfg.input_activation is not None and add_cfg.output_activation is not None

    def run(self, gm: GraphModule) -> Plan:
        matched = set()
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            if passes_grid(node) and self._carries_grid(node.args[0]):
                self.quantized[node] = self.quantized[node.args[0]]
            elif node.target in AVERAGING_POOLS and self._carries_grid(node.args[0]):
                spec, root = self.quantized[node.args[0]]
                self.annotation(node).output = PlannedPoint(spec, shared_with=root)
                self.quantized[node] = (spec, root)
            else:
                m = match(node, self.activations)
                if m is not None:
                    self.op(m)
                    matched.add(node)
        self.plan.float_weight_ops = float_weight_ops(gm, matched.__contains__)
        # Op-type entries are policy (a preset's entries for ops a model lacks); entries that name modules
        # and match none are most often a wrong path or type.
        self.plan.unused_entries = [e for e in self.config.model_entries() if e not in self.used_entries]
        return self.plan


def build_plan(gm: GraphModule, config: QuantizerConfig) -> Plan:
    return _Walk(config).run(gm)
