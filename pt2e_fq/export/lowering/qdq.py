"""Lowering to the PT2E runtimes' quantize / dequantize representation.

ExecuTorch's XNNPACK delegate and Inductor's x86 int8 kernels (oneDNN qconv /
qlinear) do not know our fused op; they match the standard pattern that
torchao's stock convert_pt2e writes:

    activation:  quantize_per_tensor -> dequantize_per_tensor   (Python-scalar qparams)
    weight:      integer codes -> dequantize_per_channel / _per_tensor / torchao dequantize_affine

`to_qdq` rewrites each integer fake-quant point of a converted model into that
pattern and re-exports it. The weight codes are computed by our own kernel
(the runtimes' quantize computes round(x * (1/scale)), which rounds exact ties
of x / scale the other way now and then), so a lowered weight dequantizes to
exactly the fake-quantized weight. Activations are quantized by the runtime
and may differ from ours by one step on such ties.

What each target takes:

- generic: per-tensor and per-channel activations; per-tensor, per-channel
  and per-block weights (blocks that divide the weight), any integer range.
- xnnpack: int8 per-tensor activations; int8 (int4 as int8 codes in -8..7)
  symmetric per-tensor or per-channel weights (a conv's int4 codes are
  declared int8: XNNPACK's 4-bit weights are for linear only). XNNPACK
  quantizes a linear or conv only when its output is quantized too,
  directly or after a ReLU or clamp it fuses (XNNPACK_FUSED_ACTIVATIONS;
  a linear before a GELU whose output is the point is not): such an op's
  weight is stored as its fake-quantized floats, and listed. Quantize for
  it with quantizers.presets.every_point(name, target="xnnpack"), which
  puts such a point on the linear's own output. And XNNPACK's dynamically
  quantized linear (the w4a8-dyn / w8a8-dyn presets): a dynamic int8
  per-token asymmetric input becomes torchao's choose_qparams_affine ->
  quantize_affine -> dequantize_affine, one chain per linear as torchao's
  8da4w export has it; its weight may be per-channel or int4 symmetric per
  group (1, g). XNNPACK recomputes the per-token qparams itself and keeps
  group scales in bfloat16 (a model trained with them,
  QSpec(scale_dtype=torch.bfloat16), loses nothing there: check.py); a
  dynamic point whose scales are rounded in the graph is refused (the
  runtimes compute them in fp32).
- x86_inductor: per-tensor activations as uint8 (an int8 point's codes and
  zero point shifted by 128, which is exact); int8 symmetric per-channel
  weights (a per-tensor weight becomes per-channel with its scale repeated).
  Compile with torch._inductor.config.freezing = True (`compile_x86`).

For both runtimes each quantized op needs a dequantize directly in front of
it, so an activation's pair is repeated after pass-through ops (view,
flatten, permute, max pooling, ...), which is exact: a per-tensor quantize of values
already on the grid returns their codes; and each user of a dequantize gets
its own copy (as torchao's DuplicateDQPass gives the stock flow).

A point with another format (FP8, MX, NVFP4), a MINVAL formulation, scales
computed in the graph (dynamic points), a used clamp mask, or a granularity
or range the target does not take, is an UnsupportedPointError naming the
point (FakeQuantize path, module path, role) and why. unsupported="keep"
leaves such points as our op (Inductor and eager run it; ExecuTorch cannot);
unsupported="float" stores such a weight as its fake-quantized values
(computed by our op, so exact; the op then runs in float). Either warns with
the list.
"""

from __future__ import annotations

import dataclasses
import operator
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ...ops.blocks import expand_blocks
from ...spec.qparams import INT_SCALE_EPS
from ...spec.format_kinds import INTEGER, OpCall
from ...graph import as_args, check_finite_qparams, decode_node, is_fake_quant_node, point_name, point_role
from ..program import exported_program

TARGETS = ("generic", "xnnpack", "x86_inductor")
UNSUPPORTED = ("error", "keep", "float")

qd = torch.ops.quantized_decomposed

# Ops that move or select elements without changing them: a per-tensor
# quantize commutes with them exactly, so XNNPACK's pairs are repeated after them.
_PASS_THROUGH = {
    # max pooling too: a dequantize is increasing, so the max of dequantized
    # codes is the dequantized max code.
    torch.ops.aten.max_pool2d.default,
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.flatten.using_ints,
    torch.ops.aten.permute.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.contiguous.default,
}

# Narrowest storage dtype of codes in [qmin, qmax], in order.
_CODE_DTYPES = (
    (torch.int8, -128, 127),
    (torch.uint8, 0, 255),
    (torch.int16, -(2**15), 2**15 - 1),
    (torch.uint16, 0, 2**16 - 1),
)


class UnsupportedPointError(ValueError):
    """A fake-quant point the chosen target cannot run; the message names the
    point (module path and role) and why."""


@dataclass(frozen=True)
class QdqPoint:
    """One fake-quant point as to_qdq saw it."""

    name: str  # the FakeQuantize module it was traced from
    module: str  # the module path of the op it belongs to
    role: str  # "weight of linear", "output of conv2d, input of relu", ...
    lowered_as: Optional[str]  # the ops it became; None where kept as our op
    reason: str = ""  # why the target could not take it (kept, or a weight stored as float)

    def describe(self) -> str:
        return f"{self.name} ({self.module or '<top>'}: {self.role})"


@dataclass
class QdqSummary:
    """The points of one to_qdq call: lowered and kept (left as our op)."""

    target: str
    points: list

    @property
    def kept(self) -> list:
        return [p for p in self.points if p.lowered_as is None]

    @property
    def in_float(self) -> list:
        """Weights the target cannot take, stored as their fake-quantized floats."""
        return [p for p in self.points if p.lowered_as is not None and p.reason]

    @property
    def lowered(self) -> list:
        """Points now quantize / dequantize ops."""
        return [p for p in self.points if p.lowered_as is not None and not p.reason]

    def __str__(self) -> str:
        lines = [f"to_qdq(target={self.target!r}): {len(self.lowered)} point(s) lowered to q/dq, "
                 f"{len(self.in_float)} weight(s) stored as float, {len(self.kept)} kept as pt2e_fq ops"]
        lines += [f"  kept {p.describe()}: {p.reason}" for p in self.kept]
        lines += [f"  float {p.describe()}: {p.reason}" for p in self.in_float]
        return "\n".join(lines)


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"to_qdq: {name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def _tensor(gm: torch.fx.GraphModule, node) -> Optional[torch.Tensor]:
    """The tensor of a get_attr node (a parameter, buffer or constant), else None."""
    if isinstance(node, torch.fx.Node) and node.op == "get_attr":
        return operator.attrgetter(node.target)(gm)
    return None


def _code_dtype(qmin: int, qmax: int) -> torch.dtype:
    return next(dtype for dtype, lo, hi in _CODE_DTYPES if lo <= qmin and qmax <= hi)


def _granularity(scale: torch.Tensor, block_size, x_shape) -> tuple[str, Optional[int]]:
    """("tensor", None), ("channel", axis) or ("block", None), from the
    scale's shape: one scale, one per index of a single dimension with
    blocks of 1 there, or anything else."""
    if scale.numel() == 1:
        return "tensor", None
    split = [d for d, n in enumerate(scale.shape) if n != 1]
    if len(split) == 1 and block_size[split[0]] == 1 and scale.shape[split[0]] == x_shape[split[0]]:
        return "channel", split[0]
    return "block", None


@dataclass
class _Plan:
    """How one point is lowered: its granularity, the codes' dtype and range
    (after any shift), the zero point shift, and per-channel emission of a
    per-tensor weight."""

    granularity: str
    axis: Optional[int]
    dtype: torch.dtype
    quant_min: int
    quant_max: int
    shift: int = 0
    per_channel_weight: bool = False


def _plan(call: OpCall, target: str, weight: bool, scale, zero_point, x_shape) -> tuple[Optional[_Plan], str]:
    """The plan for a point, or None and why the target cannot take it."""
    if call.kind is not INTEGER:
        return None, f"{call.format.name} is not an integer format; the PT2E q/dq ops carry integer codes only"
    if call.minval is not None:
        return None, "the MINVAL formulation (a float minimum per block): the standard dequantize takes an integer zero point"
    qmin, qmax = call.quant_min, call.quant_max
    if scale is None or (call.zero_point is not None and zero_point is None):
        return _dynamic_plan(call, target, weight, x_shape)
    granularity, axis = _granularity(scale, call.block_size, x_shape)
    symmetric = zero_point is None or bool((zero_point == 0).all())
    what = f"{'weight' if weight else 'activation'} [{qmin}, {qmax}] per {granularity}"
    if granularity == "block":
        if not weight:
            return None, "per-block activation qparams: no standard quantize op takes them"
        if target == "x86_inductor" or (target == "xnnpack" and not _xnnpack_group_weight(call, x_shape, symmetric)):
            return None, (f"per-block weight qparams: {target} takes per-tensor or per-channel weights"
                          + (f" (and {_XNNPACK_GROUPS})" if target == "xnnpack" else "")
                          + "; use target='generic' or a per-channel weight")
        if any(s % min(b, s) for s, b in zip(x_shape, call.block_size)):
            return None, f"blocks {tuple(call.block_size)} do not divide the weight's shape {tuple(x_shape)}"
        return _Plan("block", None, _code_dtype(qmin, qmax), qmin, qmax), ""
    if target == "generic":
        return _Plan(granularity, axis, _code_dtype(qmin, qmax), qmin, qmax), ""
    in_int8 = -128 <= qmin and qmax <= 127
    if target == "xnnpack":
        if not weight and (granularity != "tensor" or not in_int8):
            return None, f"XNNPACK takes int8 per-tensor activations; this is an {what}"
        if weight and (not in_int8 or not symmetric):
            return None, f"XNNPACK takes symmetric int8 (or narrower) weights; this is a{'' if symmetric else 'n asymmetric'} {what}"
        if len(x_shape) != 2 and -8 <= qmin and qmax <= 7:
            # XNNPACK reads a [-8, 7] range as 4-bit weights, which it has for
            # linear only; the same codes declared as int8 run everywhere.
            qmin, qmax = -128, 127
        return _Plan(granularity, axis, torch.int8, qmin, qmax), ""
    # x86_inductor
    if not weight:
        if granularity != "tensor":
            return None, f"Inductor's x86 int8 kernels take per-tensor activations; this is an {what}"
        if in_int8:
            return _Plan("tensor", None, torch.uint8, qmin + 128, qmax + 128, shift=128), ""
        if 0 <= qmin and qmax <= 255:
            return _Plan("tensor", None, torch.uint8, qmin, qmax), ""
        return None, f"Inductor's x86 int8 kernels take 8-bit activations; this is an {what}"
    if not in_int8 or not symmetric:
        return None, f"Inductor's x86 int8 kernels take symmetric int8 weights; this is {what}{'' if symmetric else ' asymmetric'}"
    if granularity == "channel" and axis != 0:
        return None, f"Inductor's x86 int8 kernels take weights per output channel (axis 0); this one is per axis {axis}"
    return _Plan("channel", 0, torch.int8, qmin, qmax, per_channel_weight=granularity == "tensor"), ""


# What XNNPACK's dynamically quantized linear takes as per-group weights
# (ExecuTorch's per_channel_group: 4-bit codes only, its "qb4w").
_XNNPACK_GROUPS = ("int4 [-8, 7] symmetric per-group weights of a linear, blocks (1, g) with g dividing its "
                   "input size, read by a linear with dynamic per-token activations")


def _xnnpack_group_weight(call: OpCall, x_shape, symmetric: bool) -> bool:
    block = tuple(call.block_size)
    return (len(x_shape) == 2 and len(block) == 2 and block[0] == 1 and block[1] < x_shape[1]
            and x_shape[1] % block[1] == 0 and symmetric and (call.quant_min, call.quant_max) == (-8, 7))


def _scale_rounded_through(scale) -> Optional[torch.dtype]:
    """The narrower float dtype a scale computed in the graph is rounded
    through (a dynamic point with QSpec.scale_dtype bfloat16: the cast to
    it and back, qparams.stored_scale), or None."""
    if not (isinstance(scale, torch.fx.Node) and scale.target in _CASTS and scale.all_input_nodes):
        return None
    source = scale.all_input_nodes[0].meta.get("val")
    if isinstance(source, torch.Tensor) and source.dtype in (torch.bfloat16, torch.float16):
        return source.dtype
    return None


_CASTS = (torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default)


def _dynamic_plan(call: OpCall, target: str, weight: bool, x_shape) -> tuple[Optional[_Plan], str]:
    """A dynamic point (qparams computed from the live tensor) lowers as
    torchao's per-token choose_qparams_affine / quantize_affine /
    dequantize_affine, the pattern XNNPACK's dynamically quantized linear
    takes (it recomputes those qparams itself, per row): int8 [-128, 127]
    with a zero point, one block per token (the whole last dimension)."""
    dims = len(x_shape)
    per_token = (dims >= 1 and isinstance(x_shape[-1], int) and all(b == 1 for b in call.block_size[:-1])
                 and call.block_size[-1] >= x_shape[-1])
    if weight:
        return None, "its qparams are computed in the graph (a dynamic weight); the lowering takes a weight's static qparams"
    rounded = _scale_rounded_through(call.scale)
    if rounded is not None:
        return None, (f"its scales are rounded to {str(rounded).removeprefix('torch.')} in the graph "
                      "(QSpec.scale_dtype); the runtimes' dynamic quantization computes fp32 scales")
    if target == "x86_inductor":
        return None, "its qparams are computed in the graph (a dynamic point); Inductor's x86 int8 kernels take static ones"
    if not per_token:
        return None, (f"a dynamic activation with blocks {tuple(call.block_size)}: the lowering takes dynamic "
                      "activations per token only (blocks of 1, the whole last dimension)")
    if (call.quant_min, call.quant_max) != (-128, 127) or call.zero_point is None:
        return None, (f"a dynamic per-token activation in [{call.quant_min}, {call.quant_max}]"
                      f"{'' if call.zero_point is not None else ' without a zero point'}: the runtimes' dynamic "
                      "quantization is int8 [-128, 127] asymmetric")
    return _Plan("token", None, torch.int8, -128, 127), ""


def _fake_quantized(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Optional[torch.Tensor]:
    """The value of a point whose inputs are all constants (a weight), as
    its own op computes it; None when an input is computed in the graph."""
    inputs = node.all_input_nodes
    if not all(n.op == "get_attr" for n in inputs):
        return None
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: _tensor(gm, n))
    with torch.no_grad():
        return node.target(*args, **kwargs)[0]


def _weight_codes(call: OpCall, y: torch.Tensor, scale, zero_point, plan: _Plan) -> torch.Tensor:
    """The integer codes of a weight as our kernel rounds them: the kernel's
    fake-quantized weight y divided by its scale is (q - zero point) exactly
    up to fp32 rounding far below half a step, so rounding recovers q."""
    with torch.no_grad():
        s = expand_blocks(scale.float(), y.shape, call.block_size)
        zp = 0 if zero_point is None else expand_blocks(zero_point.float(), y.shape, call.block_size)
        q = torch.round(y.float() / s) + zp
    return q.to(plan.dtype)


class _Emitter:
    """Adds constants and q/dq nodes to the module being lowered."""

    def __init__(self, gm: torch.fx.GraphModule):
        self.gm, self.count = gm, 0

    def constant(self, tensor: torch.Tensor, stem: str) -> torch.fx.Node:
        name = f"_qdq_{stem}_{self.count}"
        self.count += 1
        self.gm.register_buffer(name, tensor.detach().clone())
        return self.gm.graph.get_attr(name)

    def call(self, op, *args) -> torch.fx.Node:
        return self.gm.graph.call_function(op, tuple(args))


def _lower_weight(em: _Emitter, call: OpCall, w, y, scale, zero_point, plan: _Plan) -> tuple[torch.fx.Node, str]:
    codes = em.constant(_weight_codes(call, y, scale, zero_point, plan), "weight")
    out_dtype = w.dtype
    if plan.granularity == "tensor":
        zp = 0 if zero_point is None else int(zero_point.reshape(()))
        node = em.call(qd.dequantize_per_tensor.default, codes, float(scale.reshape(())), zp,
                       plan.quant_min, plan.quant_max, plan.dtype)
        return node, "dequantize_per_tensor"
    if plan.granularity == "channel":
        size = w.shape[plan.axis]
        scales = scale.float().reshape(-1).expand(size) if plan.per_channel_weight else scale.float().reshape(-1)
        zps = torch.zeros(size, dtype=torch.int64) if zero_point is None else (
            zero_point.reshape(-1).expand(size).to(torch.int64))
        node = em.call(qd.dequantize_per_channel.default, codes, em.constant(scales.contiguous(), "scale"),
                       em.constant(zps.contiguous(), "zero_point"), plan.axis, plan.quant_min, plan.quant_max,
                       plan.dtype)
        return node, "dequantize_per_channel"
    # A block longer than its dimension covers it (as in the op); dequantize_affine wants the dimension.
    block = [min(b, s) for s, b in zip(w.shape, call.block_size)]
    reduced = scale.float().reshape([s // b for s, b in zip(w.shape, block)])
    zps = None if zero_point is None else em.constant(zero_point.reshape(reduced.shape).to(torch.int64), "zero_point")
    node = em.gm.graph.call_function(
        torch.ops.torchao.dequantize_affine.default,
        (codes, block, em.constant(reduced, "scale"), zps, plan.dtype, plan.quant_min, plan.quant_max),
        {"output_dtype": out_dtype},
    )
    return node, "torchao.dequantize_affine"


def _lower_activation(em: _Emitter, x, scale, zero_point, plan: _Plan) -> tuple[torch.fx.Node, str]:
    if plan.granularity == "tensor":
        s = float(scale.reshape(()))
        zp = (0 if zero_point is None else int(zero_point.reshape(()))) + plan.shift
        args = (s, zp, plan.quant_min, plan.quant_max, plan.dtype)
        q = em.call(qd.quantize_per_tensor.default, x, *args)
        return em.call(qd.dequantize_per_tensor.default, q, *args), "quantize_per_tensor/dequantize_per_tensor"
    scales = em.constant(scale.float().reshape(-1), "scale")
    zps = em.constant(
        torch.zeros(scale.numel(), dtype=torch.int64) if zero_point is None else zero_point.reshape(-1).to(torch.int64),
        "zero_point",
    )
    args = (scales, zps, plan.axis, plan.quant_min, plan.quant_max, plan.dtype)
    q = em.call(qd.quantize_per_channel.default, x, *args)
    return em.call(qd.dequantize_per_channel.default, q, *args), "quantize_per_channel/dequantize_per_channel"


_DYNAMIC_LOWERED_AS = "choose_qparams_affine/quantize_affine/dequantize_affine"


def _lower_dynamic(em: _Emitter, x, value: torch.fx.Node, plan: _Plan) -> list[torch.fx.Node]:
    """A per-token choose_qparams_affine -> quantize_affine ->
    dequantize_affine chain from x for each user of `value` (as torchao's
    8da4w export has one per linear: XNNPACK's partitioner takes the chain
    into each linear's partition); returns the dequantize nodes."""
    tao = torch.ops.torchao
    dims = x.meta["val"].dim()
    block = [1] * (dims - 1) + [x.meta["val"].shape[-1]]
    bounds = (plan.quant_min, plan.quant_max)
    dqs = []
    for user in list(value.users):
        chosen = em.call(tao.choose_qparams_affine.default, x, "ASYMMETRIC", block, plan.dtype, *bounds,
                         INT_SCALE_EPS, torch.float32, plan.dtype)
        scale, zero_point = (em.call(operator.getitem, chosen, i) for i in (0, 1))
        q = em.call(tao.quantize_affine.default, x, block, scale, zero_point, plan.dtype, *bounds)
        dq = em.gm.graph.call_function(tao.dequantize_affine.default,
                                       (q, block, scale, zero_point, plan.dtype, *bounds),
                                       {"output_dtype": x.meta["val"].dtype})
        dq.meta.update({k: v for k, v in value.meta.items() if k in ("nn_module_stack", "stack_trace")})
        user.replace_input_with(value, dq)
        dqs.append(dq)
    return dqs


def _xnnpack_dynamic_users(value: torch.fx.Node) -> str:
    """Why XNNPACK cannot run the ops reading a dynamic activation, or ""
    when each is a linear reading it as input with a quantized weight."""
    for user in value.users:
        weight = user.args[1] if user.target == torch.ops.aten.linear.default and len(user.args) > 1 else None
        quantized_weight = isinstance(weight, torch.fx.Node) and (
            (weight.target is operator.getitem and is_fake_quant_node(weight.args[0])) or "dequantize" in str(weight.target))
        if user.args[0] is not value or not quantized_weight:
            return (f"XNNPACK quantizes activations dynamically only as the input of a linear with a quantized weight; "
                    f"this one is read by {user.name} ({user.target})")
    return ""


def _dynamic_linear(op: torch.fx.Node, dynamic_dqs: set) -> bool:
    return op.target == torch.ops.aten.linear.default and op.args[0] in dynamic_dqs


def _repeat_through_views(gm: torch.fx.GraphModule) -> None:
    """After every pass-through op reading a per-tensor dequantize, a new
    quantize / dequantize pair of the same qparams (XNNPACK wants one right
    in front of each quantized op)."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _PASS_THROUGH:
            continue
        dq = node.args[0]
        if not (isinstance(dq, torch.fx.Node) and dq.target == qd.dequantize_per_tensor.default):
            continue
        with gm.graph.inserting_after(node):
            q = gm.graph.call_function(qd.quantize_per_tensor.default, (node, *dq.args[1:]))
        with gm.graph.inserting_after(q):
            new_dq = gm.graph.call_function(qd.dequantize_per_tensor.default, (q, *dq.args[1:]))
        node.replace_all_uses_with(new_dq, delete_user_cb=lambda user: user is not q)


def _one_dequantize_per_user(gm: torch.fx.GraphModule) -> None:
    """Gives each user of a shared activation dequantize its own copy, as
    torchao's DuplicateDQPass does for the stock flow: XNNPACK's partitioner
    matches dq -> op per op, and a dq shared by a conv and a residual add
    split the conv net's delegate into 7 subgraphs (1 with copies)."""
    for dq in list(gm.graph.nodes):
        if dq.target != qd.dequantize_per_tensor.default or len(dq.users) < 2:
            continue
        for user in list(dq.users)[1:]:
            with gm.graph.inserting_after(dq):
                copy = gm.graph.call_function(dq.target, dq.args, dict(dq.kwargs))
            copy.meta.update(dq.meta)
            user.replace_input_with(dq, copy)


# The activations XNNPACK fuses into a quantized conv / linear before the
# output's quantize (ExecuTorch's gemm partitioner configs and
# FuseActivationPass: relu and hardtanh; relu6 is a hardtanh), by aten op
# name. The one list: quantizers.presets.every_point(target="xnnpack") fuses
# only these with the op before them, so that every other activation's op
# gets its own output point.
XNNPACK_FUSED_ACTIVATIONS = ("relu", "relu6", "hardtanh")
_FUSED_ACTIVATIONS = {getattr(getattr(torch.ops.aten, name + suffix), "default")
                      for name in XNNPACK_FUSED_ACTIVATIONS for suffix in ("", "_")}


def _quantized(node: torch.fx.Node) -> bool:
    """Whether node's output is quantized, directly or after a fused activation."""
    return any(u.target == qd.quantize_per_tensor.default or (u.target in _FUSED_ACTIVATIONS and _quantized(u))
               for u in node.users)


def _output_quantized(weight: torch.fx.Node) -> bool:
    """Whether every op reading this weight has its output quantized."""
    return all(_quantized(op) for op in weight.users)


def _delete_unused_attributes(gm: torch.fx.GraphModule) -> None:
    """Drops the float weights (and qparams) no node reads any more, so the
    lowered program does not carry them."""
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name, _ in list(gm.named_parameters()) + list(gm.named_buffers()):
        if name not in used:
            owner, _, attr = name.rpartition(".")
            delattr(gm.get_submodule(owner) if owner else gm, attr)
    gm.delete_all_unused_submodules()


def _dynamic_shapes_of(ep: torch.export.ExportedProgram, args: tuple):
    """Dim.AUTO on each dimension that is symbolic in the program's user
    inputs, so re-exporting keeps them dynamic; None when all are static."""
    sig = ep.graph_signature
    user = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in sig.user_inputs]
    if len(user) != len(args) or not all(isinstance(a, torch.Tensor) for a in args):
        return None
    shapes = []
    for node in user:
        dims = {d: torch.export.Dim.AUTO for d, s in enumerate(node.meta["val"].shape) if isinstance(s, torch.SymInt)}
        shapes.append(dims or None)
    return tuple(shapes) if any(shapes) else None


def lower_points(gm: torch.fx.GraphModule, target: str, unsupported: str) -> QdqSummary:
    """Rewrites, in place, each fake-quant point of `gm` (an unlifted
    program module: ExportedProgram.module()) into q/dq for `target`;
    returns what became of each point."""
    em = _Emitter(gm)
    # weights: (dequantize node, index in points, fake-quantized weight, plan)
    points, weights, dynamic_dqs = [], [], set()
    for node in list(gm.graph.nodes):
        if not is_fake_quant_node(node):
            continue
        call = decode_node(node)
        users = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        value = users.get(0)
        name = point_name(node)
        module, role = point_role(call.x, value) if value is not None else ("", "unused")
        x_val = call.x.meta["val"]
        w = _tensor(gm, call.x)
        scale, zero_point = _tensor(gm, call.scale), _tensor(gm, call.zero_point)
        plan, reason = _plan(call, target, w is not None, scale, zero_point, tuple(x_val.shape))
        used_outputs = [i for i, u in users.items() if i != 0 and u.users]
        if plan is not None and used_outputs:
            plan, reason = None, f"output {used_outputs[0]} of the op (the clamp mask) is used in the graph"
        if plan is not None and plan.granularity == "token" and target == "xnnpack":
            reason = _xnnpack_dynamic_users(value)
            plan = None if reason else plan
        y = _fake_quantized(gm, node) if w is not None else None
        if plan is None and unsupported == "float" and y is not None and not used_outputs:
            with gm.graph.inserting_before(node):
                new = em.constant(y, "fake_quantized_weight")
            value.replace_all_uses_with(new)
            points.append(QdqPoint(name, module, role, "float weight (fake-quantized)", reason))
            continue
        if plan is None:
            point = QdqPoint(name, module, role, None, reason)
            if unsupported == "error" or (unsupported == "float" and y is None):
                raise UnsupportedPointError(
                    f"to_qdq(target={target!r}): point {point.describe()} cannot be lowered: {reason}. "
                    "Pass unsupported='keep' to leave such points as pt2e_fq ops"
                    + ("" if y is None else ", or unsupported='float' to store such weights fake-quantized in float")
                )
            points.append(point)
            continue
        if plan.granularity == "token":
            with gm.graph.inserting_before(node):
                dynamic_dqs.update(_lower_dynamic(em, call.x, value, plan))
            points.append(QdqPoint(name, module, role, _DYNAMIC_LOWERED_AS))
            continue
        with gm.graph.inserting_before(node):
            if w is not None:
                new, lowered_as = _lower_weight(em, call, w, y, scale, zero_point, plan)
            else:
                new, lowered_as = _lower_activation(em, call.x, scale, zero_point, plan)
        new.meta.update({k: v for k, v in value.meta.items() if k in ("nn_module_stack", "stack_trace")})
        value.replace_all_uses_with(new)
        points.append(QdqPoint(name, module, role, lowered_as))
        if w is not None:
            weights.append((new, len(points) - 1, y, plan))
    if target == "xnnpack":
        for dq, i, y, plan in weights:
            if all(_dynamic_linear(op, dynamic_dqs) for op in dq.users):
                continue  # XNNPACK's dynamically quantized linear: per-channel or per-group weights
            if plan.granularity == "block":
                reason = f"per-block weight qparams: xnnpack takes them only as {_XNNPACK_GROUPS}"
            elif _output_quantized(dq):
                continue
            else:
                reason = ("XNNPACK quantizes a linear or conv only when its output is quantized or its input "
                          "dynamically quantized; this one's output is float")
            if unsupported == "error" and plan.granularity == "block":
                raise UnsupportedPointError(
                    f"to_qdq(target={target!r}): point {points[i].describe()} cannot be lowered: {reason}. "
                    "Pass unsupported='float' to store such weights fake-quantized in float")
            # Otherwise the weight's dequantize stays outside the delegate,
            # where ExecuTorch has no kernel for it. The fake-quantized weight
            # in float is the same values, run by an fp32 XNNPACK op.
            with gm.graph.inserting_before(dq):
                dq.replace_all_uses_with(em.constant(y, "fake_quantized_weight"))
            points[i] = dataclasses.replace(points[i], lowered_as="float weight (fake-quantized)", reason=reason)
    if target != "generic":
        _repeat_through_views(gm)
        _one_dequantize_per_user(gm)
    gm.graph.eliminate_dead_code()
    _delete_unused_attributes(gm)
    gm.recompile()
    return QdqSummary(target, points)


def to_qdq(
    model_or_program,
    example_inputs,
    *,
    dynamic_shapes: Optional[Any] = None,
    target: str = "generic",
    unsupported: str = "error",
    summary: bool = False,
):
    """A converted model (or an ExportedProgram of one) as an ExportedProgram
    in the PT2E quantize / dequantize representation for `target`
    ("generic", "xnnpack", "x86_inductor"; see the module docstring). QAT
    conv-bn is folded first. A point the target cannot take is an
    UnsupportedPointError naming it, unless unsupported="keep" (leave it as
    our op) or "float" (store such a weight as its fake-quantized floats),
    which warn with the list. dynamic_shapes is torch.export's;
    for a program it defaults to the program's own dynamic dimensions.
    With summary=True returns (program, QdqSummary).

    Args:
        model_or_program: a converted model (a GraphModule from convert_pt2e) or an ExportedProgram of one.
        example_inputs: a tensor or a tuple of positional arguments.
        dynamic_shapes: as torch.export takes them (the export before prepare must declare the same dimensions).
        target: "generic", "xnnpack" or "x86_inductor".
        unsupported: "error", "keep" or "float": what to do with a point the target cannot take.
        summary: also return the QdqSummary.

    Returns:
        The ExportedProgram of quantize / dequantize ops, or (program, QdqSummary) with summary=True.

    Raises:
        ValueError: an unknown target or unsupported, or a point with non-finite qparams.
        UnsupportedPointError: a point the target cannot take, with unsupported="error".
    """
    _check_choice("target", target, TARGETS)
    _check_choice("unsupported", unsupported, UNSUPPORTED)
    args = as_args(example_inputs)
    if dynamic_shapes is None and isinstance(model_or_program, torch.export.ExportedProgram):
        dynamic_shapes = _dynamic_shapes_of(model_or_program, args)
    ep = exported_program(model_or_program, args, dynamic_shapes=dynamic_shapes)
    check_finite_qparams(ep, "to_qdq")
    gm = ep.module()
    result = lower_points(gm, target, unsupported)
    if result.kept or result.in_float:
        warnings.warn(str(result), stacklevel=2)
    # Export size-oblivious as program.py does (kept points still return the packed mask, and an
    # example of size 1 keeps its dimension dynamic), except with dynamic points lowered: there
    # size-oblivious reasoning takes torchao's per-token ops' `block 1 != size` on a dynamic batch
    # or sequence length as a guard that the size is not 1.
    oblivious = not any(p.lowered_as == _DYNAMIC_LOWERED_AS for p in result.points)
    with torch.fx.experimental._config.patch(backed_size_oblivious=oblivious):
        lowered = torch.export.export(gm, args, dynamic_shapes=dynamic_shapes)
    return (lowered, result) if summary else lowered


# CPU flags of an int8 dot product that accumulates in int32 (oneDNN's exact int8 kernels).
INT8_DOT_PRODUCT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def cpu_flags() -> Optional[frozenset]:
    """This CPU's feature flags from /proc/cpuinfo; None where it cannot be read (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split())
    except OSError:
        return None


def compile_x86(program: torch.export.ExportedProgram):
    """to_qdq(target="x86_inductor")'s program compiled by Inductor with
    freezing (which folds the weight codes into oneDNN's packed int8 weights
    and lets its patterns turn dq -> conv / linear -> q into qconv / qlinear),
    run without autograd, which freezing needs. Returns the callable, which
    runs the compiled module on copies of its tensor arguments (Inductor's
    fused linear + add may write into an input). Warns on an x86 CPU
    without a VNNI or AMX int8 dot product: oneDNN's AVX2 kernels saturate
    each pair of u8 x s8 products at int16 (vpmaddubsw), so the compiled
    model can be several steps off its q/dq program (docs/export.md)."""
    if not isinstance(program, torch.export.ExportedProgram):
        raise TypeError(f"compile_x86: program must be to_qdq's ExportedProgram, got {type(program).__name__}")
    flags = cpu_flags()
    if flags is not None and "avx2" in flags and not flags & INT8_DOT_PRODUCT_FLAGS:
        warnings.warn("compile_x86: this CPU has no VNNI or AMX int8 dot product (none of "
                      f"{', '.join(sorted(INT8_DOT_PRODUCT_FLAGS))} in /proc/cpuinfo): oneDNN's AVX2 int8 kernels "
                      "saturate pairs of products at int16, so the compiled model can be several steps off its "
                      "q/dq program; check it with check_lowered, or deploy through ExecuTorch", stacklevel=2)
    compiled = torch.compile(program.module())

    # Inductor compiles at the first call (and again for a new shape), so the
    # setting must hold then; torch.compile(options={"freezing": True}) does
    # not reach the freezing pass (onednn::qconv_prepack then fails on meta tensors).
    def run(*args):
        # Inductor's fused int8 linear + residual add (qlinear_pointwise.binary
        # with the "sum" post-op) accumulates into its float operand in place,
        # a graph input too: the encoder block's input came back holding
        # x + attn(x), and was the output. The copy keeps the caller's tensors.
        args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        with torch._inductor.config.patch(freezing=True), torch.no_grad():
            return compiled(*args)

    return run
