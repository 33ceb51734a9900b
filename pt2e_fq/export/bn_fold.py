"""Folds the QAT conv-bn pattern that prepare_qat_pt2e leaves in the graph.

prepare_qat_pt2e rewrites conv -> batch_norm into (torchao's
`_qat_conv_bn_pattern`, running statistics in eval mode):

    sf = bn.weight / sqrt(bn.running_var + eps)
    y  = conv(x, fake_quant(conv.weight * sf), 0) / sf + conv.bias
    y  = batch_norm(y, ...)

and convert_pt2e keeps it (our convert is a no-op). Folding turns it into

    y  = conv(x, fake_quant(w_fold), b_fold)
    w_fold = conv.weight * sf            (the very tensor the fake quant saw)
    b_fold = (conv.bias - running_mean) * bn.weight / sqrt(running_var + eps) + bn.bias

The fake-quantized weight is bit for bit the unfolded one (w_fold is computed
by the graph's own ops), so the weight's qparams stay valid; the output equals
the unfolded graph's within fp32 rounding.
"""

from __future__ import annotations

import torch
from torch.fx.node import map_arg

from ..fake_quantize import FakeQuantize
from ..graph import decode_node, is_fake_quant_node

aten = torch.ops.aten
_CONVS = {
    aten.conv1d.default,
    aten.conv2d.default,
    aten.conv3d.default,
    aten.conv_transpose1d.default,
    aten.conv_transpose2d.input,
    aten.conv_transpose3d.input,
}


def _is_call(node, *targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _fake_quant_input(gm: torch.fx.GraphModule, node):
    """The input of a fake-quant point: a FakeQuantize call_module node (a
    converted model) or getitem(pt2e_fq op, 0) (ExportedProgram.module()),
    of any format; None for anything else."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op == "call_module" and isinstance(gm.get_submodule(node.target), FakeQuantize):
        return node.args[0]
    if node.op == "call_function" and node.target.__name__ == "getitem" and node.args[1] == 0:
        op = node.args[0]
        if isinstance(op, torch.fx.Node) and is_fake_quant_node(op):
            return decode_node(op).x
    return None


def _evaluate(gm: torch.fx.GraphModule, node) -> torch.Tensor:
    """The value of a subgraph of get_attr and call_function nodes, computed by
    the graph's own ops (so bit for bit what the graph computes)."""
    if not isinstance(node, torch.fx.Node):
        return node
    if node.op == "get_attr":
        return gm.get_parameter(node.target) if _has_param(gm, node.target) else gm.get_buffer(node.target)
    if node.op != "call_function":
        raise ValueError(f"fold_conv_bn: node {node.name} ({node.op}) is not a constant")
    args = map_arg(node.args, lambda n: _evaluate(gm, n))
    kwargs = map_arg(node.kwargs, lambda n: _evaluate(gm, n))
    return node.target(*args, **kwargs)


def _has_param(gm, target: str) -> bool:
    try:
        gm.get_parameter(target)
        return True
    except AttributeError:
        return False


def _set_param(gm: torch.fx.GraphModule, target: str, value: torch.Tensor) -> None:
    owner, _, name = target.rpartition(".")
    module = gm.get_submodule(owner) if owner else gm
    setattr(module, name, torch.nn.Parameter(value.detach().clone(), requires_grad=False))


def _match(gm, bn):
    """The nodes of one QAT conv-bn pattern ending at `bn`, or None."""
    x = bn.args[0]
    bias = None
    if _is_call(x, aten.add.Tensor):
        x, bias_reshape = x.args
        if not _is_call(bias_reshape, aten.reshape.default) or bias_reshape.args[0].op != "get_attr":
            return None
        bias = bias_reshape.args[0]
    if not _is_call(x, aten.div.Tensor) or not _is_call(x.args[1], aten.reshape.default):
        return None
    conv, sf = x.args[0], x.args[1].args[0]
    if not _is_call(conv, *_CONVS) or len(conv.users) != 1:
        return None
    scaled = _fake_quant_input(gm, conv.args[1])
    if not _is_call(scaled, aten.mul.Tensor) or len(scaled.users) != 1:
        return None
    weight, w_reshape = scaled.args
    if weight.op != "get_attr" or len(weight.users) != 1:
        return None
    if not _is_call(w_reshape, aten.reshape.default) or w_reshape.args[0] is not sf:
        return None
    # sf = bn.weight / sqrt(running_var + eps), with the batch_norm's eps
    sqrt = sf.args[1] if _is_call(sf, aten.div.Tensor) else None
    add = sqrt.args[0] if _is_call(sqrt, aten.sqrt.default) else None
    if not _is_call(add, aten.add.Tensor) or add.args[1] != bn.args[7]:
        return None
    return conv, scaled, weight, bias


def has_conv_bn(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph holds a QAT conv-bn pattern that fold_conv_bn would
    fold (or refuse, in training mode); reads the graph only."""
    return any(_is_call(bn, aten.batch_norm.default) and _match(gm, bn) is not None for bn in gm.graph.nodes)


def fold_conv_bn(gm: torch.fx.GraphModule) -> int:
    """Folds, in place, every QAT conv-bn pattern of an eval-mode graph (see
    the module docstring) and returns how many it folded. A pattern whose
    batch_norm is in training mode is an error: its statistics are the
    batch's, so there is nothing to fold."""
    folded = 0
    for bn in list(gm.graph.nodes):
        if not _is_call(bn, aten.batch_norm.default):
            continue
        match = _match(gm, bn)
        if match is None:
            continue
        conv, scaled, weight, bias = match
        _, bn_w, bn_b, mean, var, training, _, eps = bn.args[:8]
        if training:
            raise ValueError(
                f"fold_conv_bn: batch_norm {bn.name} after {conv.name} is in training mode; call "
                "pt2e_fq.move_exported_model_to_eval(model) before exporting"
            )
        with torch.no_grad():
            w_fold = _evaluate(gm, scaled)
            mean, var = _evaluate(gm, mean), _evaluate(gm, var)
            b = _evaluate(gm, bias) if bias is not None else torch.zeros_like(mean)
            gamma = _evaluate(gm, bn_w) if bn_w is not None else torch.ones_like(mean)
            beta = _evaluate(gm, bn_b) if bn_b is not None else torch.zeros_like(mean)
            b_fold = (b - mean) * (gamma / torch.sqrt(var + eps)) + beta
        _set_param(gm, weight.target, w_fold)
        scaled.replace_all_uses_with(weight)
        bias_target = bias.target if bias is not None else f"{weight.target}_folded_bias"
        _set_param(gm, bias_target, b_fold)
        if bias is None:
            with gm.graph.inserting_before(conv):
                bias = gm.graph.get_attr(bias_target)
        conv.args = (conv.args[0], conv.args[1], bias) + tuple(conv.args[3:])
        bn.replace_all_uses_with(conv)
        folded += 1
    if folded:
        gm.graph.eliminate_dead_code()
        gm.delete_all_unused_submodules()
        gm.recompile()
    return folded
