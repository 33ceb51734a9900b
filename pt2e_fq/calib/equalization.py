"""Activation-weight equalisation (SmoothQuant, Xiao et al., 2023; AWQ, Lin
et al., 2024): a linear's input channel c divided by s_c and its weight's
column c multiplied by s_c, so that the input's outlier channels move into
the weight (where per-channel or per-group scales carry them) and a
weight-only format's salient columns get a finer grid.

The float function stays exactly the same: 1/s is folded into the op that
produces the input, and only where that op absorbs it exactly:

- a LayerNorm's (aten.layer_norm) or RMSNorm's (aten.rms_norm) affine
  weight and bias;
- a linear's output channels (its weight rows and bias), also through ops
  that move channels without mixing them (view, reshape, transpose,
  permute, dropout) and through attention's value input: softmax(Q K^T) V
  mixes positions, never channels, so a value projection's output scale
  reaches the output projection's input as it is, head by head.

The producer's readers lead to linears' inputs that way; all those
linears (q, k and v after one LayerNorm) take the same scale. Which input
column of each linear carries which producer channel is traced on a
calibration batch (an index tensor run through the path's ops), so any
head split and transpose works. Another reader of the producer's output
(a post-LN transformer such as BERT adds its LayerNorm's output to the
residual stream) gets it back times s through one inserted float mul
(`compensate`, on by default; Outlier Suppression's gamma migration,
Wei et al., 2022, does the same for BERT); the residual stream stays
float in every preset. An op between producer and linear that absorbs no
scale (GELU between two linears) ends the path: no equalisation there.

The scale is chosen per producer from candidates: no scale, SmoothQuant's
s_c = max|x_c|^a / max|W_:,c|^(1-a) and AWQ's s_c = mean|x_c|^a, each for
a in `alphas`, normalised to a geometric mean of 1 between the extremes.
The winner has the smallest output error of the producer's linears,
sum ||X W^T - Qa(X / s) Qw(W s)^T||^2 over calibration rows, where Qa and
Qw are fresh copies of the input and weight points (same QSpec, so any
format and granularity) that calibrate on the scaled tensors. After the
fold the points whose input changed are replaced by fresh ones and
calibrated again on the batches, so the ranges that convert keeps are
those of the scaled tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
from torch.utils._pytree import tree_leaves

from ..fake_quantize import FakeQuantize
from .layers import LINEAR, _set_attr, _tensor, is_layer, tensor_readers

aten = torch.ops.aten

# Ops that move channels without mixing them: the index tensor runs through the op itself.
_LAYOUT_OPS = frozenset({
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
    aten.permute.default, aten.contiguous.default, aten.clone.default, aten.alias.default,
    aten.flatten.using_ints, aten.unflatten.int, aten.unsqueeze.default, aten.squeeze.dim,
})
# Ops that scale every element by the same random factor or none: channel scales pass unchanged.
_IDENTITY_OPS = frozenset({aten.dropout.default, aten.detach.default})
# (op, argument index of the value operand): out[..., i, d] = sum_j a[..., i, j] v[..., j, d].
_VALUE_MIXERS = {aten.scaled_dot_product_attention.default: 2, aten.matmul.default: 1, aten.bmm.default: 1}
_NORMS = {aten.layer_norm.default: 3, aten.rms_norm.default: None}  # op -> bias argument index

DEFAULT_ALPHAS = (0.2, 0.35, 0.5, 0.65, 0.8, 0.95)


@dataclass(eq=False)
class _Consumer:
    node: torch.fx.Node  # the linear
    weight_name: str
    weight_point: Optional[torch.fx.Node]  # call_module of its weight's fake-quant point
    input_point: Optional[torch.fx.Node]  # call_module of its input's fake-quant point
    columns: Optional[torch.Tensor] = None  # producer channel of each input column (traced)


@dataclass(eq=False)  # hashed by identity
class _Group:
    producer: torch.fx.Node
    weight_name: str  # the producer's weight (norm affine weight or linear weight)
    bias_name: Optional[str]
    weight_point: Optional[torch.fx.Node]
    chain: set  # the nodes between producer and the consumers' inputs
    compensated: list = field(default_factory=list)  # (node, reader): reader given node's output times s back
    consumers: list = field(default_factory=list)
    samples: dict = field(default_factory=dict)  # consumer node -> its sampled input rows, per batch


@dataclass
class EqualizeResult:
    """One producer: its consumers, the chosen scale (`"none"`,
    `"smoothquant a=0.5"`, `"awq a=0.5"`) and the consumers' output SQNR
    (dB, on the sampled calibration rows, round-to-nearest weights) without
    a scale (`before_db`) and with the chosen one (`after_db`)."""

    producer: str
    consumers: tuple
    scale: str
    before_db: float
    after_db: float


def _point(gm: torch.fx.GraphModule, node) -> Optional[FakeQuantize]:
    if isinstance(node, torch.fx.Node) and node.op == "call_module":
        m = gm.get_submodule(node.target)
        if isinstance(m, FakeQuantize):
            return m
    return None


def _parameter(gm, node, reader, readers) -> Optional[tuple]:
    """(get_attr target, weight-point node or None) of a parameter argument
    read by `reader` alone, directly or through its fake-quant point; None
    otherwise (computed, or read elsewhere too, through this get_attr or
    another of the same tensor: scaling it would change another op).
    `readers`: calib.layers.tensor_readers(gm), counted once per search."""
    point = None
    if _point(gm, node) is not None:
        if set(node.users) != {reader}:
            return None
        point, node = node, node.args[0]
    if not (isinstance(node, torch.fx.Node) and node.op == "get_attr"):
        return None
    if set(node.users) != {point or reader} or readers[id(_tensor(gm, node.target))] > 1:
        return None
    return node.target, point


def _producer(gm, node, readers) -> Optional[_Group]:
    """The group of `node` if it can absorb a scale per output channel."""
    if not is_layer(node, (*_NORMS, LINEAR)):
        return None
    if node.target in _NORMS:
        shape = node.args[1]
        if len(shape) != 1 or len(node.args) < 3 or node.args[2] is None:
            return None
        weight = _parameter(gm, node.args[2], node, readers)
        at = _NORMS[node.target]
        bias_arg = node.args[at] if at is not None and len(node.args) > at else None
        bias = _parameter(gm, bias_arg, node, readers) if bias_arg is not None else (None, None)
        if weight is None or bias is None or weight[1] is not None:
            return None
        return _Group(node, weight[0], bias[0], None, set())
    if node.target is LINEAR:
        weight = _parameter(gm, node.args[1], node, readers)
        bias_arg = node.args[2] if len(node.args) > 2 else None
        bias = _parameter(gm, bias_arg, node, readers) if bias_arg is not None else (None, None)
        if weight is None or bias is None or bias[1] is not None:
            return None
        return _Group(node, weight[0], bias[0], weight[1], set())
    return None


def _consumer(gm, linear, source, readers) -> Optional[_Consumer]:
    """`linear` reading `source` as its input only, with a parameter weight."""
    if not is_layer(linear, (LINEAR,)) or linear.args[0] is not source:
        return None
    if source in linear.args[1:] or source in linear.kwargs.values():
        return None
    weight = _parameter(gm, linear.args[1], linear, readers)
    if weight is None:
        return None
    return _Consumer(linear, weight[0], weight[1], source if _point(gm, source) is not None else None)


def _step(gm, node, user, readers):
    """How `user` reads `node`: the consumers it gives (a linear, or the
    linears behind an input point), True for an op that passes channels on
    (module doc), None for anything else."""
    if user.op == "call_module" and _point(gm, user) is not None:
        if user.args[0] is not node or not user.users:
            return None
        consumers = [_consumer(gm, linear, user, readers) for linear in user.users]
        return None if None in consumers else consumers
    if user.op != "call_function":
        return None
    if user.target in _LAYOUT_OPS or user.target in _IDENTITY_OPS:
        others = list(user.args[1:]) + list(user.kwargs.values())
        return True if user.args[0] is node and node not in others else None
    if user.target in _VALUE_MIXERS:
        at = _VALUE_MIXERS[user.target]
        rest = [a for i, a in enumerate(user.args) if i != at] + list(user.kwargs.values())
        ok = len(user.args) > at and user.args[at] is node and node not in rest and not user.kwargs.get("enable_gqa")
        return True if ok else None
    consumer = _consumer(gm, user, node, readers)
    return None if consumer is None else [consumer]


def _follow(gm, group: _Group, compensate: bool, readers) -> Optional[_Group]:
    """The producer's readers as paths to linears' inputs (module doc); with
    `compensate`, a reader of another kind of the producer's output (or of
    dropout after it: BERT's embeddings) is kept in `group.compensated`.
    None where a reader fits neither."""
    frontier = [group.producer]
    same_layout = {group.producer}  # the producer and identity ops after it: channels last, as produced
    while frontier:
        node = frontier.pop()
        for user in node.users:
            step = _step(gm, node, user, readers)
            if step is None:
                if not (compensate and node in same_layout):
                    return None
                group.compensated.append((node, user))
            elif step is True:
                group.chain.add(user)
                frontier.append(user)
                if node in same_layout and user.target in _IDENTITY_OPS:
                    same_layout.add(user)
            else:
                group.consumers.extend(step)
    return group if group.consumers else None


def find_groups(gm: torch.fx.GraphModule, compensate: bool = True) -> list[_Group]:
    """The producers whose every reader leads to linears' inputs through
    channel-preserving ops, in graph order. A parameter read by more than
    one op (tied weights) is left out: scaling it would change the other.
    A linear may be a consumer of one group and the producer of another
    (a pre-LN transformer's value projection): scaling its columns and its
    rows commute."""
    groups, readers = [], tensor_readers(gm)
    for node in gm.graph.nodes:
        group = _producer(gm, node, readers)
        if group is None or _follow(gm, group, compensate, readers) is None:
            continue
        groups.append(group)
    return groups


class _Trace(torch.fx.Interpreter):
    """One pass over a batch: samples each consumer's input rows (as the
    consumer's input point sees them, upstream points quantizing) and, on
    the first batch, runs an index tensor from each producer's channels
    through its path to give each consumer's column map."""

    def __init__(self, gm, groups: list[_Group], max_rows: int):
        super().__init__(gm)
        self.groups = groups
        self.max_rows = max_rows
        self.index: Optional[dict] = None
        self.group_of = {}
        for g in groups:
            self.group_of[g.producer] = g
            for n in g.chain:
                self.group_of[n] = g
        self.sampled = {}  # source node -> [(consumer, group)]
        for g in groups:
            for c in g.consumers:
                self.sampled.setdefault(c.input_point.args[0] if c.input_point is not None else c.node.args[0],
                                        []).append((c, g))
        self.broken: set = set()

    def run_node(self, n):
        result = super().run_node(n)
        group = self.group_of.get(n)
        if self.index is not None and group is not None and group not in self.broken:
            index = self._index(n, result)
            if index is None:
                self.broken.add(group)
            else:
                self.index[n] = index
        for consumer, g in self.sampled.get(n, ()):
            rows = result.detach().float().reshape(-1, result.shape[-1])
            step = max(1, math.ceil(rows.shape[0] * self.batches / self.max_rows))
            g.samples.setdefault(consumer.node, []).append(rows[::step].clone())
            if self.index is not None and g not in self.broken:
                index = self.index.get(n)
                cols = index.reshape(-1, index.shape[-1]) if index is not None else None
                if cols is None or not (cols == cols[:1]).all():
                    self.broken.add(g)
                else:
                    consumer.columns = cols[0].clone()
        return result

    def _index(self, n, result) -> Optional[torch.Tensor]:
        if n is self.group_of[n].producer:
            return torch.arange(result.shape[-1]).expand(result.shape)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if n.target in _IDENTITY_OPS:
            return self.index[n.args[0]]
        if n.target in _LAYOUT_OPS:
            return n.target(self.index[n.args[0]], *args[1:], **kwargs)
        at = _VALUE_MIXERS[n.target]
        value = self.index[n.args[at]]
        if value.dim() < 2 or not (value == value[..., :1, :]).all():
            return None  # a value position mixes channels of different producers' channels
        return value[..., :1, :].expand(result.shape)


def _observers_off(gm) -> dict:
    points = [m for m in gm.modules() if isinstance(m, FakeQuantize)]
    state = {id(m): m._observer_on for m in points}
    for m in points:
        m.enable_observer(False)
    return state


def _fresh(point: FakeQuantize) -> FakeQuantize:
    """A new point of the same QSpec, observer on, nothing observed yet."""
    fresh = type(point)(point.qspec)
    fresh.train(point.training)
    device = next(point.buffers(), torch.empty(0)).device
    return fresh.to(device)


def _quantized(point: Optional[FakeQuantize], x: torch.Tensor) -> torch.Tensor:
    """x through a fresh copy of `point` that calibrates on x (x itself without a point)."""
    return x if point is None else _fresh(point)(x)


def _candidates(group: _Group, weights: dict, rows: dict, channels: int, alphas) -> list[tuple[str, torch.Tensor]]:
    act_max = torch.zeros(channels)
    act_mean = torch.zeros(channels)
    w_max = torch.zeros(channels)
    for c in group.consumers:
        x = rows[c.node][0].abs()
        act_max.scatter_reduce_(0, c.columns, x.amax(0), "amax")
        act_mean.scatter_reduce_(0, c.columns, x.mean(0), "amax")
        w_max.scatter_reduce_(0, c.columns, weights[c.node].abs().amax(0), "amax")
    live = (act_max > 0) & (w_max > 0)
    tiny = torch.finfo(torch.float32).tiny

    def normalised(s):
        s = torch.where(live, s, torch.ones_like(s)).clamp(min=1e-5)
        return s / (s[live].max() * s[live].min()).sqrt() if live.any() else s

    out = [("none", torch.ones(channels))]
    for a in alphas:
        out.append((f"smoothquant a={a:g}", normalised(act_max.clamp(min=tiny) ** a / w_max.clamp(min=tiny) ** (1 - a))))
    for a in alphas:
        out.append((f"awq a={a:g}", normalised(act_mean.clamp(min=tiny) ** a)))
    return out


def _errors(gm, group: _Group, weights: dict, rows: dict, scale: torch.Tensor) -> tuple[float, float]:
    """(output power, output error power) of the group's consumers on the sampled rows."""
    signal = noise = 0.0
    quantized_inputs = {}
    for c in group.consumers:
        x, y = rows[c.node]
        s = scale[c.columns]
        key = c.input_point if c.input_point is not None else c.node
        if key not in quantized_inputs:
            quantized_inputs[key] = _quantized(_point(gm, c.input_point), x / s)
        wq = _quantized(_point(gm, c.weight_point), weights[c.node] * s)
        signal += y.double().pow(2).sum().item()
        noise += (y - quantized_inputs[key] @ wq.T).double().pow(2).sum().item()
    return signal, noise


def _db(signal: float, noise: float) -> float:
    return 10 * math.log10(signal / noise) if noise > 0 else math.inf


def _fold(gm, group: _Group, scale: torch.Tensor) -> None:
    """1/s into the producer's output channels, s into the consumers' columns (new tensors)."""
    w = _tensor(gm, group.weight_name).detach()
    inverse = (1 / scale).to(w.dtype)
    _set_attr(gm, group.weight_name, w * (inverse[:, None] if w.dim() == 2 else inverse))
    if group.bias_name is not None:
        b = _tensor(gm, group.bias_name).detach()
        _set_attr(gm, group.bias_name, b * inverse.to(b.dtype))
    for c in group.consumers:
        w = _tensor(gm, c.weight_name).detach()
        _set_attr(gm, c.weight_name, w * scale[c.columns].to(w.dtype))
    if group.compensated:  # their input back: the producer's output (now y / s) times s, one float mul each
        name = f"{group.producer.name}_equalization_scale"
        gm.register_buffer(name, scale.to(_tensor(gm, group.weight_name).dtype).clone())
        for node in dict.fromkeys(node for node, _ in group.compensated):
            with gm.graph.inserting_after(node):
                attr = gm.graph.get_attr(name)
            with gm.graph.inserting_after(attr):
                restored = gm.graph.call_function(aten.mul.Tensor, (node, attr))
            for source, reader in group.compensated:
                if source is node:
                    reader.replace_input_with(node, restored)
        gm.recompile()


def equalize(prepared: torch.fx.GraphModule, batches: Iterable, *, alphas: Iterable[float] = DEFAULT_ALPHAS,
             max_rows: int = 2048, compensate: bool = True) -> list[EqualizeResult]:
    """Equalises every producer -> linears group of `prepared` (calibrated
    or not) on `batches` (tensors or tuples of tensors, as for calibration)
    and calibrates the points whose input changed again on them; returns
    one result per group found (module doc). The float function of the
    prepared model is unchanged; its parameters are replaced, never
    written in place (the user's float model keeps its own).

    Args:
        prepared: the GraphModule of prepare_pt2e.
        batches: the calibration batches.
        alphas: the exponents of the candidate scales, each in (0, 1].
        max_rows: input rows sampled per linear for the search.
        compensate: also equalise a producer whose output another op reads
            directly (a post-LN transformer's residual add), giving that op
            the output times s back through one inserted float mul.

    Returns:
        The EqualizeResults, in graph order.

    Raises:
        TypeError: prepared is not a GraphModule.
        ValueError: alphas empty or outside (0, 1], max_rows < 1, or batches empty.
    """
    if not isinstance(prepared, torch.fx.GraphModule):
        raise TypeError(f"calib.equalize: prepared must be the GraphModule of prepare_pt2e, got "
                        f"{type(prepared).__name__}")
    alphas = tuple(float(a) for a in alphas)
    if not alphas or not all(0 < a <= 1 for a in alphas):
        raise ValueError(f"calib.equalize: alphas must be a non-empty sequence of numbers in (0, 1], got {alphas}")
    if not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"calib.equalize: max_rows must be an int >= 1, got {max_rows!r}")
    batches = [tuple(tree_leaves(b if isinstance(b, tuple) else (b,))) for b in batches]
    if not batches:
        raise ValueError("calib.equalize: batches holds no batch")
    groups = find_groups(prepared, compensate)
    if not groups:
        return []
    observing = _observers_off(prepared)
    trace = _Trace(prepared, groups, max_rows)
    trace.batches = len(batches)
    try:
        with torch.no_grad():
            for i, batch in enumerate(batches):
                trace.index = {} if i == 0 else None
                trace.run(*batch)
    finally:
        for m in prepared.modules():
            if isinstance(m, FakeQuantize):
                m.enable_observer(observing[id(m)])
    results, refresh = [], set()
    with torch.no_grad():
        for group in groups:
            if group in trace.broken or any(c.columns is None for c in group.consumers):
                continue
            weights = {c.node: _tensor(prepared, c.weight_name).detach().float() for c in group.consumers}
            rows = {}  # consumer -> its sampled input rows and their float outputs, (x, x W^T)
            for c in group.consumers:
                x = torch.cat(group.samples.pop(c.node))
                rows[c.node] = (x, x @ weights[c.node].T)
            channels = _tensor(prepared, group.weight_name).shape[0]
            scored = [(name, s, _errors(prepared, group, weights, rows, s))
                      for name, s in _candidates(group, weights, rows, channels, alphas)]
            name, scale, (signal, noise) = min(scored, key=lambda t: t[2][1])
            before = scored[0][2]
            results.append(EqualizeResult(str(group.producer.name), tuple(str(c.node.name) for c in group.consumers),
                                          name, _db(*before), _db(signal, noise)))
            if name == "none":
                continue
            _fold(prepared, group, scale)
            refresh |= {n for c in group.consumers for n in (c.input_point, c.weight_point) if n is not None}
            if group.weight_point is not None:
                refresh.add(group.weight_point)
    if refresh:
        _recalibrate(prepared, refresh, batches)
    return results


def _recalibrate(gm: torch.fx.GraphModule, nodes: set, batches: list) -> None:
    """Replaces the points of `nodes` by fresh ones and calibrates them
    alone on the batches (the others' ranges stay as they are)."""
    observing = _observers_off(gm)
    fresh = {}
    for node in nodes:
        old = gm.get_submodule(node.target)
        fresh[node.target] = (_fresh(old), observing[id(old)])
        gm.add_submodule(node.target, fresh[node.target][0])
    try:
        with torch.no_grad():
            for batch in batches:
                gm(*batch)
    finally:
        for m in gm.modules():
            if isinstance(m, FakeQuantize) and id(m) in observing:
                m.enable_observer(observing[id(m)])
        for m, on in fresh.values():
            m.enable_observer(on)
