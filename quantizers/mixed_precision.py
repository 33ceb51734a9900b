"""Per-layer sensitivity and budgeted mixed precision.

    gm = pipeline.export(model, example)                      # any exported GraphModule
    s = sensitivity(gm, calibration, evaluation, ("w4a8", "w8a8"))
    print(s.table())                                          # each point alone quantized, the rest float
    chosen = mixed_precision(s, budget_bits=5.0)              # int4 / int8 / float per layer
    chosen.config.save("mixed.yaml")                          # an ordinary QuantizerConfig
    prepared = pipeline.prepare(model, example, chosen.config)

`sensitivity` prepares a copy of the graph once per candidate preset,
calibrates it with every point observing and none quantizing (each point
sees float inputs, as it would with the rest of the model float), then
runs the evaluation batches with one point at a time quantized and records
the output's noise against the float model (sum of squared differences
over the float output's energy; its SQNR in dB in the table). A layer is
the module that holds a computing op with a weight (linear, conv, matmul
with a parameter, addmm, einsum); its cost under a candidate is the noise
of its weight point plus that of its input activation points.

`mixed_precision` chooses one candidate per layer (a preset, or "float":
weight and inputs float) to minimise the summed noise, the standard
additive model of independent quantization errors, with the average weight
bits of `average_weight_bits` at most the budget (a multiple-choice
knapsack, solved exactly on the bits in units of 1/2**17 of the budget,
rounded down, and again with less room while the choice overruns, so the
result never exceeds the budget). The config it returns is the first
candidate preset with, per layer, a module name and op type entry for each
of the layer's op types with a weight (its other ops, a residual add in
its forward, keep the preset's policy, as when sensitivity measured them).
The model's own forward is the layer at path "". An entry reaches the ops
of its type in the modules inside its module too (the entry for "" those
of every module), so a module whose ops of that type it would change, an
attention's matmuls of two activations, gets an entry of its own with the
first candidate's settings: every weight gets the format chosen for its
layer, and every op outside the layers the preset's settings. Only an op
of the same type in a layer's own forward, a matmul of activations beside
one with a weight, shares the layer's entry.

Average weight bits count every weight a computing op reads (embedding
tables are lookups and are not counted; their presets keep them float or
quantize them for memory alone): per weight, code bits per element plus,
per block, 16 bits per scale (an fp16 scale), the block scales' own width
for MX (E8M0, 8 bits) and NVFP4 (E4M3, 8 bits, plus a 32-bit global
scale), the code width per integer zero point and 16 bits per MINVAL
offset (a float); a float weight counts 32 bits per element. So int4 in
groups of 32 (w4a8) is 4.5, MXFP4 4.25, NVFP4 4.5 plus 32 bits per tensor.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence, Union

import torch
from tabulate import tabulate
from torch.fx import GraphModule
from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e
from tqdm import tqdm

from pt2e_fq import FakeQuantize, QSpec
from pt2e_fq.graph import as_args, module_path, point_role, weight_readers
from pt2e_fq.ops.blocks import reduced_shape
from pt2e_fq.spec.formats import ELEMENTS, FloatFormat, IntFormat
from pt2e_fq.spec.schemes import Formulation, Scheme

from . import presets
from .config import QuantizerConfig
from .patterns import COMPUTING_OP_TYPES, WEIGHT, match, op_type
from .plan import module_stack
from .quantizer import FakeQuantQuantizer

FLOAT = "float"
FLOAT_BITS = 32
SCALE_BITS = 16  # a scale stored as fp16
GLOBAL_SCALE_BITS = 32  # NVFP4's per-tensor fp32 global scale
# Block scales of the block-scaled float formats, by element: E8M0 (MX) is an 8-bit exponent.
_BLOCK_SCALE_BITS = {"e8m0": 8, **{name: e.bits for name, e in ELEMENTS.items()}}
# Sizes in units of 1/_BUDGET_UNITS of the budget: the knapsack's resolution.
_BUDGET_UNITS = 1 << 17


def weight_bits(spec: Optional[QSpec], shape: Sequence[int]) -> float:
    """The bits a weight of `shape` takes stored in `spec`'s format (module
    doc): code bits, scale bits and zero-point bits; 32 per element in
    float (spec None).

    Args:
        spec: the weight point's QSpec (as the quantizer planned it: a conv
            weight's groups may span kernel positions), or None for float.
        shape: the weight's shape.

    Returns:
        The bits, a float (an integer value).

    Raises:
        ValueError: the granularity does not fit the shape.
    """
    elements = math.prod(shape)
    if spec is None:
        return float(FLOAT_BITS * elements)
    fmt = spec.format
    bits = elements * fmt.bits
    if isinstance(fmt, FloatFormat) and fmt.block_scaled:
        blocks = math.prod(reduced_shape(shape, spec.granularity.block_size(shape)))
        bits += blocks * _BLOCK_SCALE_BITS[fmt.block_scale]
        if fmt.block_scale != "e8m0":  # NVFP4: E4M3 block scales under a global scale
            bits += GLOBAL_SCALE_BITS * math.prod(reduced_shape(shape, spec.range_granularity.block_size(shape)))
        return float(bits)
    blocks = math.prod(reduced_shape(shape, spec.range_granularity.block_size(shape)))
    bits += blocks * SCALE_BITS
    if isinstance(fmt, IntFormat) and spec.scheme is Scheme.ASYMMETRIC:
        bits += blocks * (SCALE_BITS if spec.formulation is Formulation.MINVAL else fmt.bits)
    return float(bits)


def _is_point(gm: GraphModule):
    def is_point(node) -> bool:
        return node.op == "call_module" and isinstance(gm.get_submodule(node.target), FakeQuantize)

    return is_point


def _counted_weights(gm: GraphModule) -> dict[str, tuple[tuple, Optional[QSpec]]]:
    """{weight: (shape, its point's QSpec or None)} for the weights computing
    ops read (module doc: embedding tables and parameters that only other
    ops read left out)."""
    is_point = _is_point(gm)
    found = {}
    for name, (shape, readers) in weight_readers(gm, is_point).items():
        ops = [u for r in readers for u in (r.users if is_point(r) else (r,))]
        # A 2-D parameter added to activations (BERT's position embeddings) is no weight of a computing op.
        if not any(op_type(op) in COMPUTING_OP_TYPES for op in ops):
            continue
        points = [r for r in readers if is_point(r)]
        if points:
            # The QSpec is laid out as the tensor the point quantizes, which may be a relayout of the
            # parameter (`x @ W.t()`: the point is on W.t()); the same elements in that shape.
            val = points[0].args[0].meta.get("val")
            shape = tuple(val.shape) if isinstance(val, torch.Tensor) else shape
        found[name] = (shape, gm.get_submodule(points[0].target).qspec if points else None)
    return found


def average_weight_bits(model: GraphModule) -> float:
    """The average bits per weight element of a prepared or converted model
    (module doc), over the weights its computing ops read.

    Args:
        model: a GraphModule from prepare_pt2e / prepare_qat_pt2e / convert_pt2e, or a float export (32).

    Returns:
        Total weight bits over total weight elements.

    Raises:
        ValueError: the model reads no weight in a computing op.
    """
    weights = _counted_weights(model)
    elements = sum(math.prod(shape) for shape, _ in weights.values())
    if not elements:
        raise ValueError("average_weight_bits: the model has no weight read by a computing op (linear, conv, ...)")
    return sum(weight_bits(spec, shape) for shape, spec in weights.values()) / elements


# -- sensitivity --------------------------------------------------------------


@dataclass
class Layer:
    """A module holding computing ops with weights: its op type and module
    stack (for QuantizerConfig.resolve), its weight elements, and per
    candidate its weight bits and its noise (weight and input points)."""

    name: str
    op_type: str
    stack: list
    elements: int = 0
    op_types: set = field(default_factory=set)  # of its ops with a weight
    bits: dict = field(default_factory=dict)
    noise: dict = field(default_factory=dict)


@dataclass
class Sensitivity:
    """What `sensitivity` measured. points: one dict per (candidate, point):
    candidate, point, module, role, noise (output noise over signal energy
    with that point alone quantized); layers: Layer by module path;
    candidates: the presets measured."""

    candidates: tuple
    points: list
    layers: dict
    evaluated: int  # evaluation samples
    # (module path, op type, module stack) of every op a config resolves: mixed_precision keeps those outside
    # the layers at the first candidate's settings.
    ops: list = field(default_factory=list)

    def table(self, top: Optional[int] = None) -> str:
        """One row per point (module, role), its output SQNR in dB alone
        quantized under each candidate, lowest first; `top` rows at most."""
        by_point: dict[tuple, dict] = {}
        for p in self.points:
            by_point.setdefault((p["module"], p["role"]), {})[p["candidate"]] = _db(p["noise"])
        rows = sorted(by_point.items(), key=lambda kv: min(kv[1].values()))[:top]
        body = [(m, r, *(("-" if c not in v else f"{v[c]:.1f}") for c in self.candidates)) for (m, r), v in rows]
        return tabulate(body, headers=("module", "role", *(f"{c} dB" for c in self.candidates)), disable_numparse=True)


def _db(noise: float) -> float:
    return math.inf if noise <= 0 else -10 * math.log10(noise)


def _noise(reference: list, outputs: list) -> float:
    signal = sum(float(r.double().pow(2).sum()) for r in reference)
    error = sum(float((r.double() - o.double()).pow(2).sum()) for r, o in zip(reference, outputs))
    return error / signal if signal > 0 else (0.0 if error == 0 else math.inf)


def _run(model, batches) -> list:
    with torch.no_grad():
        return [torch.cat([t.detach().float().reshape(t.shape[0], -1) for t in torch.utils._pytree.tree_leaves(
            model(*as_args(b))) if isinstance(t, torch.Tensor)], dim=-1) for b in batches]


def _layers(gm: GraphModule) -> dict[str, Layer]:
    """The layers of a float export, by module path: modules holding an op
    of a computing type with a parameter weight. The model itself (path "")
    is one too when it reads a weight in its own forward: its weights count
    in the budget like any other."""
    layers: dict[str, Layer] = {}
    for node in gm.graph.nodes:
        m = match(node)
        if m is None or m.op_type == "embedding" or not any(role == WEIGHT for _, role in m.inputs):
            continue
        path = module_path(node)
        layers.setdefault(path, Layer(path, m.op_type, module_stack(node))).op_types.add(m.op_type)
    return layers


def _ops(gm: GraphModule) -> list[tuple[str, str, tuple]]:
    """(module path, op type, module stack) of the ops of the graph that a
    config resolves, once each."""
    return list(dict.fromkeys((module_path(n), op_type(n), tuple(module_stack(n))) for n in gm.graph.nodes
                              if op_type(n) is not None))


def _options(layer: Layer, ops: list, candidates: tuple, options: tuple) -> tuple:
    """What the returned config can give a layer: any option through its
    module name and op type entries, unless one of its ops has no module
    stack (a graph not from torch.export), which no module entry reaches:
    those keep the first candidate's settings, which the config starts from."""
    stackless = sorted({t for path, t, stack in ops if path == layer.name and t in layer.op_types and not stack})
    if not stackless:
        return options
    warnings.warn(f"mixed_precision: the {', '.join(stackless)} ops of {layer.name or 'the model itself'!r} have "
                  f"no module stack (nn_module_stack) for a config entry to reach: they keep {candidates[0]}",
                  stacklevel=3)
    return (candidates[0],)


def _config_of(candidate: Union[str, QuantizerConfig]) -> QuantizerConfig:
    return presets.get_preset(candidate) if isinstance(candidate, str) else candidate


def sensitivity(gm: GraphModule, calibration: Iterable, evaluation: Sequence,
                candidates: Sequence[str] = ("w4a8", "w8a8"), *, progress: bool = True) -> Sensitivity:
    """Each point's effect on the output when it alone is quantized (module doc).

    Args:
        gm: the float model exported (torch.export ... .module(), pipeline.export); not changed.
        calibration: batches (tensors or tuples) the observers see.
        evaluation: batches the noise is measured on (held out from calibration where possible).
        candidates: preset names (presets.PRESETS) to measure.
        progress: a tqdm bar over the evaluations.

    Returns:
        A Sensitivity: per point and candidate the noise, per layer its bits and noise by candidate.

    Raises:
        ValueError: an unknown preset, no candidate, or no layer with a weight.
    """
    candidates = tuple(candidates)
    if not candidates or FLOAT in candidates:
        raise ValueError(f"sensitivity: candidates must be preset names ({', '.join(presets.PRESETS)}); "
                         f"'{FLOAT}' needs no measuring (mixed_precision always offers it), got {candidates!r}")
    configs = {c: _config_of(c) for c in candidates}
    calibration, evaluation = list(calibration), list(evaluation)
    reference = _run(gm, evaluation)
    layers = _layers(gm)
    if not layers:
        raise ValueError("sensitivity: the model has no module with a computing op that reads a weight")
    points, cache = [], {}
    for candidate in candidates:
        prepared = prepare_pt2e(copy.deepcopy(gm), FakeQuantQuantizer(configs[candidate]))
        modules = {n: m for n, m in prepared.named_modules() if isinstance(m, FakeQuantize)}
        for m in modules.values():
            m.enable_fake_quant(False)
        _run(prepared, calibration)
        for m in modules.values():
            m.enable_observer(False)
        for name, (shape, spec) in _counted_weights(prepared).items():
            node = next(n for n in prepared.graph.nodes if n.op == "get_attr" and n.target == name)
            layer = layers.get(module_path(next(iter(_users_past_points(prepared, node)))))
            if layer is not None:
                layer.bits[candidate] = layer.bits.get(candidate, 0.0) + weight_bits(spec, shape)
                if candidate == candidates[0]:
                    layer.elements += math.prod(shape)
        nodes = [n for n in prepared.graph.nodes if n.op == "call_module" and n.target in modules]
        for node in tqdm(nodes, desc=f"sensitivity {candidate}", disable=not progress, leave=False):
            module, role = point_role(node.args[0], node)
            # A point of the same format and observer in an earlier candidate calibrated alike (no point
            # quantizes during calibration): its noise is the same.
            key = (module, role, modules[node.target].qspec)
            if key not in cache:
                modules[node.target].enable_fake_quant(True)
                cache[key] = _noise(reference, _run(prepared, evaluation))
                modules[node.target].enable_fake_quant(False)
            points.append(dict(candidate=candidate, point=node.target, module=module, role=role, noise=cache[key]))
            # A point counts in each layer that reads it (an input shared by q, k and v: in all three).
            for path in {module_path(u) for u in node.users} & layers.keys():
                layers[path].noise[candidate] = layers[path].noise.get(candidate, 0.0) + cache[key]
    for layer in layers.values():
        for option in (*candidates, FLOAT):  # a candidate that leaves the layer float: float's bits and noise
            layer.bits.setdefault(option, float(FLOAT_BITS * layer.elements))
            layer.noise.setdefault(option, 0.0)
    layers = {n: layer for n, layer in layers.items() if layer.elements}
    return Sensitivity(candidates, points, layers, sum(len(r) for r in reference), _ops(gm))


def _users_past_points(gm: GraphModule, node) -> list:
    is_point = _is_point(gm)
    return [u for user in node.users for u in (user.users if is_point(user) else (user,))]


# -- the budget ---------------------------------------------------------------


@dataclass
class MixedPrecision:
    """The choice of `mixed_precision`: config (a QuantizerConfig), choices
    (layer -> candidate), the average weight bits of the layers, and the
    predicted output SQNR (dB, from the summed noise)."""

    config: QuantizerConfig
    choices: dict
    average_bits: float
    predicted_sqnr_db: float
    layers: dict

    def table(self) -> str:
        """One row per layer: its chosen format, weight elements, bits per element, SQNR alone (dB)."""
        body = [(n, c, f"{self.layers[n].elements:,}", f"{self.layers[n].bits[c] / self.layers[n].elements:.3f}",
                 f"{_db(self.layers[n].noise[c]):.1f}") for n, c in self.choices.items()]
        counts = {c: sum(1 for v in self.choices.values() if v == c) for c in dict.fromkeys(self.choices.values())}
        summary = ", ".join(f"{k} {v}" for k, v in counts.items())
        return (tabulate(body, headers=("layer", "format", "weights", "bits / weight", "SQNR alone dB"),
                         disable_numparse=True)
                + f"\n{summary}; average {self.average_bits:.3f} bits per weight; predicted SQNR "
                f"{self.predicted_sqnr_db:.1f} dB")


def _knapsack(layers: list, options: dict, unit: float, capacity: int) -> dict:
    """The choice per layer (layer name -> one of options[layer name]) of
    least summed noise whose sizes, each layer's bits in units rounded down,
    sum to at most `capacity`: dynamic programming over the used units."""
    inf = torch.tensor(math.inf, dtype=torch.float64)
    best = torch.full((capacity + 1,), math.inf, dtype=torch.float64)
    best[0] = 0.0
    picks = []
    for layer in layers:
        new, pick = torch.full_like(best, math.inf), torch.zeros(best.shape, dtype=torch.int8)
        for i, c in enumerate(options[layer.name]):
            size = int(layer.bits[c] // unit)
            if size > capacity:
                continue
            shifted = torch.cat([inf.expand(size), best[:len(best) - size]]) + layer.noise[c]
            better = shifted < new
            new, pick = torch.where(better, shifted, new), torch.where(better, i, pick)
        best = new
        picks.append(pick)
    at = int(best.argmin())
    choices = {}
    for layer, pick in zip(reversed(layers), reversed(picks)):
        c = options[layer.name][int(pick[at])]
        choices[layer.name] = c
        at -= int(layer.bits[c] // unit)
    return {layer.name: choices[layer.name] for layer in layers}


def _keep_the_rest(config: QuantizerConfig, base: QuantizerConfig, ops: list) -> None:
    """Gives every op outside the layers' own entries the base config's
    settings, as sensitivity measured it. A layer's entry reaches the ops of
    its type in the modules inside it, and the model's own (path "") those
    in every module: a module whose ops it would change gets an entry of
    its own with the base's settings, outermost first, so that an inner
    one is written only where its settings differ from its parent's."""
    owned = {(path, t) for path, by_type in config.module_name_operator_type.items() for t in by_type}
    for path, t, stack in sorted(ops, key=lambda op: len(op[2])):
        if stack and (path, t) not in owned:
            kept = base.resolve(t, stack).config
            if config.resolve(t, stack).config != kept:
                config.set_module_name_operator_type(path, t, kept)


def mixed_precision(measured: Sensitivity, budget_bits: float, *, allow_float: bool = True) -> MixedPrecision:
    """The per-layer formats with the least summed noise whose average
    weight bits (module doc) is at most `budget_bits`.

    Args:
        measured: what `sensitivity` measured.
        budget_bits: the average weight bits allowed, e.g. 5.0.
        allow_float: whether a layer may stay float (32 bits).

    Returns:
        A MixedPrecision: the QuantizerConfig (the first candidate preset with module name and op type entries
            per layer, the model itself at path "", and per module whose ops those would change; module doc).

    Raises:
        ValueError: a budget below what the smallest formats take.
    """
    if not isinstance(budget_bits, (int, float)) or isinstance(budget_bits, bool) or not budget_bits > 0:
        raise ValueError(f"mixed_precision: budget_bits must be a number > 0, got {budget_bits!r}")
    candidates = tuple(measured.candidates)
    layers = list(measured.layers.values())
    options = {}
    for layer in layers:  # a loop, not a comprehension: _options warns at the caller's line (stacklevel)
        options[layer.name] = _options(layer, measured.ops, candidates, candidates + ((FLOAT,) if allow_float else ()))
    elements = sum(layer.elements for layer in layers)
    smallest = sum(min(layer.bits[c] for c in options[layer.name]) for layer in layers) / elements
    if budget_bits < smallest:
        raise ValueError(f"mixed_precision: budget_bits {budget_bits} is below {smallest:.4f}, the average of the "
                         f"smallest of {', '.join(candidates + ((FLOAT,) if allow_float else ()))} in every layer")
    allowed = budget_bits * elements
    unit = allowed / _BUDGET_UNITS
    capacity = _BUDGET_UNITS
    while True:
        choices = _knapsack(layers, options, unit, capacity)
        used = sum(layer.bits[choices[layer.name]] for layer in layers)
        if used <= allowed:
            break
        # Sizes are rounded down: a choice may overrun by less than a unit per layer. Tighten and solve again.
        capacity -= math.ceil((used - allowed) / unit)
    base = _config_of(measured.candidates[0])
    config = QuantizerConfig.from_dict(base.to_dict())
    configs = {c: _config_of(c) for c in measured.candidates}
    for layer in layers:
        c = choices[layer.name]
        # Only the layer's weighted op types: its other ops (a residual add in the block) keep the base
        # config's policy, as when the sensitivity was measured. The model itself is the module at path "".
        for t in sorted(layer.op_types):
            config.set_module_name_operator_type(
                layer.name, t, None if c == FLOAT else configs[c].resolve(t, layer.stack).config)
    _keep_the_rest(config, base, measured.ops)
    noise = sum(layer.noise[choices[layer.name]] for layer in layers)
    average = sum(layer.bits[choices[layer.name]] for layer in layers) / elements
    return MixedPrecision(config, choices, average, _db(noise), measured.layers)
