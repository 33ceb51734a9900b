"""The PT2E quantization flow in a few calls.

    from pt2e_fq.cli import pipeline
    prepared = pipeline.prepare(model, (x,), "w8a8")              # export -> annotate -> prepare_pt2e
    pipeline.calibrate(prepared, calibration_batches)             # observers see data (tqdm bar)
    converted = pipeline.convert(prepared)                        # convert_pt2e

    qat = pipeline.prepare(model, (x,), "w4a8", qat=True)         # prepare_qat_pt2e on a train-mode export
    pipeline.start_learning_ranges(qat)                           # after calibrating: learnable points learn (LSQ)
    pipeline.train(qat, batches, loss_fn, optimizer, epochs=3)    # any training loop works; this one has a bar
    pipeline.freeze_qat(qat, batch)                               # eval mode, final weight qparams, observers off
    converted = pipeline.convert(qat)

`move_to_eval` is the eval switch freeze_qat uses, in place of torchao's
`move_exported_model_to_eval`, which resets every batch norm's eps to 1e-5
and leaves SDPA's dropout and stochastic depth random (docs/user_guide.md).

`quantize` runs the whole flow for a model without labels (what the CLI
does): calibration, then optionally QAT that distils the float model's
outputs. The model is exported with a dynamic batch dimension (by
default), so the prepared and converted models take any batch size.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import math
import re
import sys
import warnings
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
import torchao.quantization.pt2e as tao
from torchao.quantization.pt2e import qat_utils
from torchao.quantization.pt2e.export_utils import _EXPORTED_TRAINING_ATTR
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e, prepare_qat_pt2e
from tqdm import tqdm

from quantizers import FakeQuantQuantizer, QuantizerConfig, presets

from .. import calib
from ..graph import DROPOUTS, as_args
from ..fake_quantize import FakeQuantize

ConfigLike = Union[str, QuantizerConfig, FakeQuantQuantizer]

if torch.distributed.is_available():
    from torch.distributed.fsdp import FSDPModule

    _FSDP2 = (FSDPModule,)
else:  # a torch built without distributed support has no FSDP2 model to reshard
    _FSDP2 = ()


class ExportError(RuntimeError):
    """torch.export cannot export the model: a one-line message (the
    reason and, where torch names it, the line of the model's code); torch's
    full report, and its partial graph, are on the chained `__cause__`."""


class TrainingDiverged(ValueError):
    """The loss or a trained parameter became NaN or infinite (a learning
    rate too high, or non-finite data)."""


# Where torch.export's message points at the model's code:
#   File "/path/models.py", line 40, in forward\n    if x.sum() > 0:
_USER_CODE = re.compile(r'File "([^"]+)", line (\d+), in \w+\n\s*(.+)')


def _export_error(model: torch.nn.Module, error: Exception) -> ExportError:
    text = str(error).strip()
    reason = text.splitlines()[0].strip() if text else ""
    where = _USER_CODE.search(text)
    at = f" at {where[1]}:{where[2]} ({where[3].strip()})" if where else ""
    return ExportError(f"torch.export cannot export {type(model).__name__}{at}: {type(error).__name__}: {reason}")


def quantizer_for(config: ConfigLike, *, qat: bool = False) -> FakeQuantQuantizer:
    """A FakeQuantQuantizer from a preset name (with `qat`, the preset's QAT
    form: presets.get_preset), a QuantizerConfig or a quantizer."""
    if isinstance(config, FakeQuantQuantizer):
        return config
    if isinstance(config, QuantizerConfig):
        return FakeQuantQuantizer(config)
    if isinstance(config, str):
        return FakeQuantQuantizer(presets.get_preset(config, qat=qat))
    raise TypeError(
        f"config must be a preset name ({', '.join(presets.PRESETS)}), a QuantizerConfig or a "
        f"FakeQuantQuantizer, got {type(config).__name__}"
    )


def batch_dynamic_shapes(example_args: tuple, model: Optional[torch.nn.Module] = None):
    """Dimension 0 of every tensor argument dynamic (torch.export Dim.AUTO:
    it stays static where the model needs it to). torch.export wants them
    shaped as the parameters of the model's forward: give `model` where its
    forward gathers arguments in `*args` (common wrappers of HF models), whose
    entry is then one tuple for all the arguments it takes. Without `model`:
    one entry per argument, right for a forward with one parameter per
    argument, as the GraphModules of prepare and convert have."""
    specs = [{0: torch.export.Dim.AUTO} if isinstance(t, torch.Tensor) and t.dim() > 0 else None
             for t in example_args]
    if model is None:
        return tuple(specs)
    grouped = []
    for i, p in enumerate(inspect.signature(model.forward).parameters.values()):
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            return tuple(grouped) + (tuple(specs[i:]),)
        if i < len(specs):
            grouped.append(specs[i])
    return tuple(grouped)


def export(model: torch.nn.Module, example_inputs, *, dynamic_batch: bool = True) -> torch.fx.GraphModule:
    """torch.export of `model` in its current train/eval mode, as the
    GraphModule that prepare_pt2e takes; an ExportError when torch.export
    fails."""
    args = as_args(example_inputs)
    dynamic_shapes = batch_dynamic_shapes(args, model) if dynamic_batch else None
    # A failed torch.export prints the partial graph to stderr (once per
    # nested tracing level), dozens of lines, before it raises; the graph
    # stays on the chained cause (`partial_fx_graph`), and whatever else was
    # printed is passed on.
    printed, graph = io.StringIO(), None
    try:
        with contextlib.redirect_stderr(printed):
            return torch.export.export(model, args, dynamic_shapes=dynamic_shapes).module()
    except Exception as e:  # torch's reports run to dozens of lines; the cause keeps them
        graph = getattr(e, "partial_fx_graph", None)
        raise _export_error(model, e) from e
    finally:
        text = printed.getvalue()
        sys.stderr.write(text if graph is None else text.replace(f"{graph}\n", ""))


def prepare(
    model: torch.nn.Module, example_inputs, config: ConfigLike, *, qat: bool = False, dynamic_batch: bool = True
) -> torch.fx.GraphModule:
    """Exports `model` (train mode for QAT, eval mode for PTQ; the model's
    own mode is restored), annotates it with our quantizer and runs
    prepare_pt2e or prepare_qat_pt2e. A preset name takes the preset's QAT
    form for QAT (presets.get_preset)."""
    quantizer = quantizer_for(config, qat=qat)
    was_training = model.training
    try:
        gm = export(model.train(qat), example_inputs, dynamic_batch=dynamic_batch)
    finally:
        model.train(was_training)
    if not qat:
        return prepare_pt2e(gm, quantizer)
    # prepare_qat_pt2e's conv-bn fusion writes its pattern's momentum 0.1 and
    # eps 1e-5 into every batch norm it fuses (torchvision's MobileNetV3 and
    # EfficientNet use 0.01 and 1e-3): put each one's own back.
    literals = _batch_norm_literals(gm)
    prepared = prepare_qat_pt2e(gm, quantizer)
    _set_batch_norm_literals(prepared, literals)
    _warn_histogram_in_qat(prepared)
    return prepared


def _warn_histogram_in_qat(prepared: torch.nn.Module) -> None:
    """A HistogramObserver searches its range at every observed step: in QAT
    (observers on while training) that costs more than the step."""
    names = [name for name, m in prepared.named_modules()
             if isinstance(m, FakeQuantize) and m.qspec.observer_or_default.keeps_histogram]
    if names:
        warnings.warn(
            f"prepare(qat=True): {len(names)} point(s) calibrate with HistogramObserver ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}), whose range search runs at every training step while the "
            "observers are on (tens of ms per point); QAT usually keeps MinMaxObserver there: "
            "presets.get_preset(name, qat=True), or a preset name, which takes that form", stacklevel=3)


aten = torch.ops.aten
_BATCH_NORM = aten.batch_norm.default


def _running_var(node: torch.fx.Node) -> Optional[str]:
    """The running_var buffer a batch_norm node reads: what identifies its
    batch norm across torchao's pattern rewrites (they replace the node)."""
    var = node.args[4]
    return var.target if isinstance(var, torch.fx.Node) and var.op == "get_attr" else None


def _batch_norm_literals(gm: torch.fx.GraphModule) -> dict[str, tuple[float, float]]:
    """{running_var buffer: (momentum, eps)} of every batch norm with running statistics."""
    return {_running_var(n): (n.args[6], n.args[7]) for n in gm.graph.nodes
            if n.target is _BATCH_NORM and _running_var(n) is not None}


def _set_batch_norm_literals(gm: torch.fx.GraphModule, literals: dict[str, tuple[float, float]]) -> None:
    """Writes each batch norm's momentum and eps back, in its batch_norm node
    and in the `running_var + eps` of torchao's QAT conv-bn pattern (whose
    scale factor is weight / sqrt(running_var + eps))."""
    for n in gm.graph.nodes:
        if n.target is _BATCH_NORM and _running_var(n) in literals:
            momentum, eps = literals[_running_var(n)]
            n.args = (*n.args[:6], momentum, eps, *n.args[8:])
        elif (n.target is aten.add.Tensor and isinstance(n.args[0], torch.fx.Node)
              and n.args[0].op == "get_attr" and n.args[0].target in literals and isinstance(n.args[1], float)):
            n.args = (n.args[0], literals[n.args[0].target][1])
    gm.recompile()


def calibrate(prepared: torch.nn.Module, batches: Iterable, *, progress: bool = True) -> torch.nn.Module:
    """Runs every batch (a tensor or a tuple of tensors) through the prepared
    model without gradients, so its observers see the data. A model under
    FSDP2 (`fully_shard`) is resharded after: its root keeps the unsharded
    weights after a forward with no backward, and an optimizer built then
    would train copies that the next all-gather overwrites."""
    with torch.no_grad():
        for batch in tqdm(batches, desc="calibrate", disable=not progress, leave=False):
            prepared(*as_args(batch))
    if isinstance(prepared, _FSDP2):
        prepared.reshard()
    return prepared


def train(
    model: torch.nn.Module,
    batches: Union[Sequence, Callable[[int], Sequence]],
    loss_fn: Callable,
    optimizer: torch.optim.Optimizer,
    *,
    epochs: int = 1,
    max_steps: Optional[int] = None,
    desc: str = "train",
    progress: bool = True,
) -> list[float]:
    """A plain training loop with a tqdm bar, for a float model or a model
    from prepare_qat_pt2e; returns the loss of every step. `batches` is a
    sequence of (inputs, target) pairs, or a callable from the epoch number
    to such a sequence (to reshuffle); inputs is a tensor or a tuple of
    tensors, loss_fn(output, target) a scalar. Stops after `epochs` epochs
    or `max_steps` steps. A loss or a trained parameter that is NaN or
    infinite stops it with TrainingDiverged: every later step, and the
    qparams computed from such weights, would be NaN."""
    if epochs < 1:
        raise ValueError(f"train: epochs must be >= 1, got {epochs}")
    losses = []
    epoch_batches = batches(0) if callable(batches) else batches
    total = epochs * len(epoch_batches) if max_steps is None else min(epochs * len(epoch_batches), max_steps)
    with tqdm(total=total, desc=desc, disable=not progress, unit="step", mininterval=0.5) as bar:
        for epoch in range(epochs):
            if epoch > 0 and callable(batches):
                epoch_batches = batches(epoch)
            for inputs, target in epoch_batches:
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(*as_args(inputs)), target)
                loss.backward()
                optimizer.step()
                losses.append(float(loss.detach()))
                _check_finite(model, desc, losses)
                bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
                bar.update(1)
                if max_steps is not None and len(losses) >= max_steps:
                    return losses
    return losses


def _check_finite(model: torch.nn.Module, desc: str, losses: list[float]) -> None:
    """TrainingDiverged unless the step's loss and the trained parameters
    after it are finite. The parameters too: a step can make them infinite
    with a finite loss, and the next forward would then fail in a
    fake-quant op on a NaN scale, far from the cause."""
    if not math.isfinite(losses[-1]):
        raise TrainingDiverged(f"{desc}: the loss became {losses[-1]} at step {len(losses)}")
    for name, p in model.named_parameters():
        if p.requires_grad and not torch.isfinite(p).all():
            raise TrainingDiverged(f"{desc}: parameter {name} became NaN or infinite at step {len(losses)}")


_SDPA = aten.scaled_dot_product_attention.default
_SDPA_DROPOUT_P = 4  # its argument index


def _sdpa_dropout_p(node: torch.fx.Node) -> float:
    return node.kwargs.get("dropout_p", node.args[_SDPA_DROPOUT_P] if len(node.args) > _SDPA_DROPOUT_P else 0.0)


def _is_random(node: torch.fx.Node) -> bool:
    """An op that draws random numbers (ATen tags them nondeterministic_seeded);
    SDPA only where its dropout_p is not 0."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if node.target is _SDPA:
        return _sdpa_dropout_p(node) != 0
    return torch.Tag.nondeterministic_seeded in node.target.tags


def _random_masks(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Nodes whose value is computed from Bernoulli draws and scalars only
    (stochastic depth's mask: empty -> bernoulli_ -> div_, and a fake-quant
    point on it), not from the model's inputs or parameters."""
    noise = set()
    for n in gm.graph.nodes:
        tensors = [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor) or a.op == "get_attr"]
        if n.op == "call_function" and getattr(n.target, "overloadpacket", None) in (aten.bernoulli, aten.bernoulli_):
            noise.add(n)
        elif n.op in ("call_function", "call_module") and tensors and all(a in noise for a in tensors):
            noise.add(n)
    return noise


def move_to_eval(prepared: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The eval switch of an exported (prepared) model, in place; returns it.

    - batch norms use their running statistics, each with its own eps (torchao's
      move_exported_model_to_eval writes 1e-5 into every one);
    - dropouts become the identity; a scaled_dot_product_attention that
      train-mode export baked a dropout_p into gets dropout_p 0.0;
    - a product with a random Bernoulli mask (stochastic depth / DropPath in
      torchvision, timm and transformers: x * bernoulli(keep) / keep) becomes
      its other factor x, what those modules return in eval mode, and the
      draw is removed;
    - any other random op is left and named in a warning: nothing tells
      whether the model means it in eval mode.

    One way: dropouts and masks are removed, not switched off, so the model
    does not go back to training. torchao's eval switch sees the model as in
    eval mode already and leaves it alone."""
    graph = prepared.graph
    for n in list(graph.nodes):
        if n.target is _BATCH_NORM and n.args[5] and isinstance(n.args[3], torch.fx.Node):
            n.args = (*n.args[:5], False, *n.args[6:])  # training=False; momentum and eps as they were
        elif n.target in DROPOUTS:  # (input, p, train), in place or not: the identity in eval mode
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)
        elif n.target is _SDPA and _sdpa_dropout_p(n) != 0:
            if "dropout_p" in n.kwargs:
                n.update_kwarg("dropout_p", 0.0)
            else:
                n.update_arg(_SDPA_DROPOUT_P, 0.0)
    noise = _random_masks(prepared)
    for n in list(graph.nodes):
        if n.target in (aten.mul.Tensor, aten.mul_.Tensor) and (n.args[0] in noise) != (n.args[1] in noise):
            n.replace_all_uses_with(n.args[1] if n.args[0] in noise else n.args[0])
            noise.add(n)
    # In-place draws (bernoulli_, div_) count as side effects for plain dead-code elimination.
    graph.eliminate_dead_code(is_impure_node=lambda n: n not in noise and n.is_impure())
    prepared.delete_all_unused_submodules()
    prepared.recompile()
    left = [n for n in graph.nodes if _is_random(n)]
    if left:
        where = ", ".join(f"{n.name} ({n.target}) in {_module_text(n)}" for n in left)
        warnings.warn(f"move_to_eval: {len(left)} random op(s) stay in the eval-mode graph, so its outputs are "
                      f"random: {where}; only dropouts, SDPA's dropout_p and Bernoulli masks multiplied into a "
                      "tensor (stochastic depth) are recognised as train-only", stacklevel=2)
    setattr(prepared, _EXPORTED_TRAINING_ATTR, False)
    return prepared


def _module_text(node: torch.fx.Node) -> str:
    stack = list(node.meta.get("nn_module_stack", {}).values())
    return f"module '{stack[-1][0]}'" if stack else "the model itself"


def start_learning_ranges(prepared: torch.nn.Module) -> torch.nn.Module:
    """Turns off the observers of the learnable points (QSpec(learnable=True)),
    in place; returns the model. Call it after calibration, before QAT: a
    learnable point's observer, while on, sets its qparams at every forward,
    overwriting what the optimizer learned. The other points keep theirs."""
    for m in prepared.modules():
        if isinstance(m, FakeQuantize) and m.qspec.learnable:
            m.disable_observer()
    return prepared


def freeze_qat(prepared: torch.nn.Module, batch) -> torch.nn.Module:
    """Ends QAT: eval mode (move_to_eval: batch norms use their running
    statistics, train-only randomness is removed), one forward of `batch`
    with the observers on, so the weight qparams of a conv-bn see the final
    statistics, then every observer off. A learnable point's observer stays
    off: its range is the trained one."""
    move_to_eval(prepared)
    prepared.apply(tao.enable_observer)
    start_learning_ranges(prepared)  # a learned range is kept as trained
    with torch.no_grad():
        prepared(*as_args(batch))
    prepared.apply(tao.disable_observer)
    return prepared


def convert(prepared: torch.nn.Module) -> torch.fx.GraphModule:
    """convert_pt2e: freezes every fake-quant point (one op call each).

    When every point is one of ours, torchao's QAT conv-bn fold is skipped:
    it matches only torchao's own quantize/dequantize patterns, of which such
    a graph has none, and builds 96 pattern graphs to find that out (its
    cost: benchmarks/README.md). The graph is the one convert_pt2e gives (tested);
    folding batch norms is the export step's job."""
    points = [m for m in prepared.modules() if isinstance(m, (tao.ObserverBase, tao.FakeQuantizeBase))]
    if not all(isinstance(m, FakeQuantize) for m in points):
        return convert_pt2e(prepared)
    with _torchao_conv_bn_fold_skipped():
        return convert_pt2e(prepared)


@contextlib.contextmanager
def _torchao_conv_bn_fold_skipped():
    """torchao's _fold_conv_bn_qat without its pattern matching: what
    remains is its clean-up (the batch norms' num_batches_tracked updates
    removed, dead code eliminated), as convert_pt2e does it."""
    helper = qat_utils._fold_conv_bn_qat_helper
    qat_utils._fold_conv_bn_qat_helper = lambda m, *args, **kwargs: m
    try:
        yield
    finally:
        qat_utils._fold_conv_bn_qat_helper = helper


def quantize(
    model: torch.nn.Module,
    example_inputs,
    config: ConfigLike,
    *,
    calibration: Optional[Sequence] = None,
    qat_steps: int = 0,
    lr: float = 1e-4,
    progress: bool = True,
    dynamic_batch: bool = True,
    algorithms: bool = True,
) -> torch.fx.GraphModule:
    """The whole flow for a model without labels. PTQ: prepare, calibrate on
    `calibration` (batches; default: the example inputs), convert. For a
    preset name, PTQ runs the preset's defaults unless `algorithms` is
    False: on a convolutional network the 4-bit presets keep the first conv,
    depthwise convs and classifier at int8 weights (presets.int8_edges), and
    pt2e_fq.calib.apply runs the algorithms of presets.PTQ_ALGORITHMS
    between calibration and convert. With
    qat_steps > 0: prepare for QAT, calibrate, then train `qat_steps` steps
    (Adam, `lr`) to match the float model's outputs on the calibration
    batches (distillation, mean squared error), learnable ranges with the
    rest (their observers off after calibration: start_learning_ranges),
    freeze and convert.
    dynamic_batch=False exports with the example's batch size (a model
    whose batch dimension cannot be dynamic); then every calibration batch
    must have it. The model is not changed."""
    if qat_steps < 0:
        raise ValueError(f"quantize: qat_steps must be >= 0, got {qat_steps}")
    example = as_args(example_inputs)
    batches = [as_args(b) for b in (calibration if calibration is not None else [example])]
    if not batches:
        raise ValueError("quantize: calibration holds no batch")
    model = copy.deepcopy(model)
    name = config if algorithms and qat_steps == 0 and isinstance(config, str) else None
    if name in presets.INT8_EDGE_PRESETS:
        config = presets.int8_edges(presets.get_preset(name), model)
    prepared = prepare(model, example, config, qat=qat_steps > 0, dynamic_batch=dynamic_batch)
    calibrate(prepared, batches, progress=progress)
    if name in presets.PTQ_ALGORITHMS:
        calib.apply(prepared, batches)
    if qat_steps > 0:
        start_learning_ranges(prepared)
        model.eval()
        with torch.no_grad():
            targets = [model(*b) for b in batches]
        pairs = list(zip(batches, targets))
        optimizer = torch.optim.Adam([p for p in prepared.parameters() if p.requires_grad], lr=lr)
        epochs = -(-qat_steps // len(pairs))
        train(prepared, pairs, _mse, optimizer, epochs=epochs, max_steps=qat_steps, desc="QAT", progress=progress)
        freeze_qat(prepared, batches[0])
    return convert(prepared)


def _mse(output, target) -> torch.Tensor:
    outputs, targets = as_args(output), as_args(target)
    return sum(torch.nn.functional.mse_loss(o.float(), t.float()) for o, t in zip(outputs, targets))
