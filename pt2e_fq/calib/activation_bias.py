"""Bias correction of the whole quantization error (Nagel et al., 2019,
empirical form, on every layer in graph order): per output channel, the
mean difference between the reference's layer output (below: the float
model, or the model with calib.apply's rounded weights and no activation
point) and the quantized model's, over the calibration batches, added to
the layer's bias.

calib.bias_correction removes the mean error of a layer's weight rounding
on the inputs the layer sees; this removes what is left of the mean error
at the layer's output whatever caused it: the activation points' rounding
and clipping (a ReLU6 network's clipped ranges shift means), and what the
upstream layers pass on (a depthwise conv, few inputs per output, passes
it on undamped). The model runs twice in lockstep, node by node over all
batches: as prepared (fake-quant points quantizing) and as the reference
(every point passing its input through, weights included), with the
graph's current parameters: run first, the reference is the float model;
run after calib.apply (as pipeline.quantize does), it has apply's rounded
weights and corrected biases, whose weight-rounding mean error apply
removed, so what this removes is the activation points' share. Each layer's
correction is applied before the layers after it run, so each corrects
what remains at its own output.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Iterable

import torch
from torch.utils._pytree import tree_leaves

from ..fake_quantize import FakeQuantize
from . import layers as _layers


@dataclass
class LayerShift:
    """One layer's output against the float model's on the calibration
    batches: SQNR (dB) before and after its correction, and the largest
    bias change relative to the RMS of the float output."""

    name: str
    before_db: float
    after_db: float
    relative_shift: float


def _sqnr_db(signal: float, noise: float) -> float:
    return 10 * math.log10(signal / noise) if noise > 0 else math.inf


def _channel_axis(layer: _layers.Layer, y: torch.Tensor) -> int:
    return 1 if layer.is_conv else y.dim() - 1


def _channel_sums(values: list, axis: int) -> torch.Tensor:
    """Per-channel sums over every other dimension of every tensor, accumulated in float64."""
    dims = [d for d in range(values[0].dim()) if d != axis]
    return sum(v.sum(dims, dtype=torch.float64) for v in values)


def _power(values) -> float:
    """The sum of squares of every tensor, accumulated in float64 (no float64 copy of a tensor)."""
    return sum(torch.linalg.vector_norm(v, dtype=torch.float64).item() ** 2 for v in values)


def correct_activation_bias(prepared: torch.fx.GraphModule, batches: Iterable) -> list[LayerShift]:
    """Adds to the bias of every layer of calib.layers (linear and conv2d
    with a weight point; a layer without bias gets one) the mean output
    difference, float minus quantized, on `batches` (tensors or tuples of
    tensors, as for calibration). The points keep their qparams: their
    observers are off during the pass and then as they were. Returns one LayerShift per layer, in graph order.

    Args:
        prepared: the calibrated GraphModule of prepare_pt2e.
        batches: calibration batches.

    Returns:
        The per-layer output SQNR against the float model, before and after.

    Raises:
        TypeError: prepared is not a GraphModule.
        ValueError: no batch.
    """
    if not isinstance(prepared, torch.fx.GraphModule):
        raise TypeError(f"correct_activation_bias: prepared must be the GraphModule of prepare_pt2e, got "
                        f"{type(prepared).__name__}")
    inputs = [tree_leaves(b if isinstance(b, tuple) else (b,)) for b in batches]
    if not inputs:
        raise ValueError("correct_activation_bias: batches holds no batch")
    points = [m for m in prepared.modules() if isinstance(m, FakeQuantize)]
    observing = [m._observer_on for m in points]
    for m in points:  # the pass must not move the ranges
        m.enable_observer(False)
    try:
        return _correct_all(prepared, inputs)
    finally:
        for m, on in zip(points, observing):
            m.enable_observer(on)


def _correct_all(prepared: torch.fx.GraphModule, inputs: list) -> list[LayerShift]:
    usable, skipped = _layers.usable_layers(prepared)
    if skipped:
        warnings.warn(_layers.skipped_text("correct_activation_bias", skipped), stacklevel=3)
    layers = {layer.node: layer for layer in usable}
    graph = prepared.graph
    nodes = list(graph.nodes)
    last_use = {}
    for i, node in enumerate(nodes):
        for used in node.all_input_nodes:
            last_use[used] = i
    quantized, floating = {}, {}  # node -> list of values, one per batch
    placeholders = iter(range(len(inputs[0])))
    results = []
    with torch.no_grad():
        for i, node in enumerate(nodes):
            if node.op == "output":
                break
            if node.op == "placeholder":
                k = next(placeholders)
                quantized[node] = floating[node] = [batch[k] for batch in inputs]
            elif node.op == "get_attr":
                value = _layers._tensor(prepared, node.target)
                quantized[node] = floating[node] = [value] * len(inputs)
            else:
                quantized[node] = _run(prepared, node, quantized, len(inputs), float_model=False)
                floating[node] = _run(prepared, node, floating, len(inputs), float_model=True)
            layer = layers.get(node)
            if layer is not None:
                results.append(_correct(prepared, layer, quantized[node], floating[node]))
            for used in node.all_input_nodes:
                if last_use.get(used) == i:
                    quantized.pop(used, None)
                    floating.pop(used, None)
    return results


def _run(gm: torch.fx.GraphModule, node: torch.fx.Node, env: dict, count: int, *, float_model: bool) -> list:
    """The node on each batch's values of env; in the float model every fake-quant point passes its input on."""
    values = []
    for b in range(count):
        args = torch.fx.node.map_arg(node.args, lambda n: env[n][b])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n][b])
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            values.append(args[0] if float_model and isinstance(module, FakeQuantize) else module(*args, **kwargs))
        elif node.op == "call_function":
            values.append(node.target(*args, **kwargs))
        elif node.op == "call_method":
            values.append(getattr(args[0], node.target)(*args[1:], **kwargs))
        else:
            raise ValueError(f"correct_activation_bias: unexpected node {node.name} ({node.op})")
    return values


def _correct(gm: torch.fx.GraphModule, layer: _layers.Layer, quantized: list, floating: list) -> LayerShift:
    axis = _channel_axis(layer, quantized[0])
    count = sum(y.numel() // y.shape[axis] for y in quantized)
    delta = (_channel_sums(floating, axis) - _channel_sums(quantized, axis)) / count
    signal = _power(floating)
    noise_before = _power(f - q for f, q in zip(floating, quantized))
    shape = [1] * quantized[0].dim()
    shape[axis] = -1
    step = delta.view(shape)
    for b, y in enumerate(quantized):
        quantized[b] = (y.double() + step).to(y.dtype)
    noise_after = _power(f - q for f, q in zip(floating, quantized))
    _layers.add_to_bias(gm, layer, delta.float())
    rms = math.sqrt(signal / (count * delta.numel())) if signal > 0 else 1.0
    return LayerShift(layer.weight_name, _sqnr_db(signal, noise_before), _sqnr_db(signal, noise_after),
                      delta.abs().max().item() / rms)
