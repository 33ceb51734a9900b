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

`freeze_qat` and `convert` are pt2e_fq.flow's freeze_qat and convert_pt2e
(the eval switch that keeps each batch norm's eps, and convert without
torchao's conv-bn pattern search).

`quantize` runs the whole flow for a model without labels (what the CLI
does): calibration, then optionally QAT that distils the float model's
outputs. The model is exported with a dynamic batch dimension (by
default), so the prepared and converted models take any batch size.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import re
import sys
import warnings
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
from torchao.quantization.pt2e import disable_observer
from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e, prepare_qat_pt2e
from tqdm import tqdm

from quantizers import FakeQuantQuantizer, QuantizerConfig, presets

from .. import calib, qat
from ..qat import TrainingDiverged  # noqa: F401 (the pipeline's name for it)
from ..graph import as_args
from ..fake_quantize import FakeQuantize
from ..flow import convert_pt2e as convert, freeze_qat, start_learning_ranges  # noqa: F401 (the pipeline's names for them)

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


def batch_of_one(args: tuple) -> bool:
    """Every tensor argument with a batch dimension has a batch of 1: a
    size torch.export fixes (it specializes dimensions of size 0 and 1), so
    the program would take batch 1 only."""
    batched = [t for t in args if isinstance(t, torch.Tensor) and t.dim() > 0]
    return bool(batched) and all(t.shape[0] == 1 for t in batched)


BATCH_OF_ONE = ("a batch (dimension 0) of 1, which torch.export fixes at 1: the program takes batch 1 only, and "
                "another batch size fails on a guard inside it; give an example batch of 2 or more (random values "
                "will do) for a program that takes any batch")


def export(model: torch.nn.Module, example_inputs, *, dynamic_batch: bool = True) -> torch.fx.GraphModule:
    """torch.export of `model` in its current train/eval mode, as the
    GraphModule that prepare_pt2e takes; an ExportError when torch.export
    fails."""
    args = as_args(example_inputs)
    if dynamic_batch and batch_of_one(args):
        warnings.warn(f"export: example_inputs have {BATCH_OF_ONE}, or pass dynamic_batch=False to say that batch "
                      "1 is meant", stacklevel=2)
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
    # Each submodule's own mode comes back (a wrapper in train mode around a model in eval
    # mode, as a user may build, keeps its inner model in eval mode).
    modes = [(m, m.training) for m in model.modules()]
    try:
        gm = export(model.train(qat), example_inputs, dynamic_batch=dynamic_batch)
    finally:
        for m, training in modes:
            m.training = training
    if not qat:
        return prepare_pt2e(gm, quantizer)
    prepared = prepare_qat_pt2e(gm, quantizer)
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
                qat.check_finite(model, desc, losses)
                bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
                bar.update(1)
                if max_steps is not None and len(losses) >= max_steps:
                    return losses
    return losses


def run_ptq_algorithms(prepared, model, batches, name, before_rounding: Optional[Callable] = None):
    """Runs a preset's post-training algorithms on a calibrated `prepared`
    model: pt2e_fq.calib.apply with those of presets.PTQ_ALGORITHMS[name],
    then, when `model` is convolutional, those of
    presets.CNN_PTQ_ALGORITHMS[name] (calib.correct_activation_bias).

    Args:
        prepared: the calibrated GraphModule of prepare_pt2e.
        model: the float model it was exported from (decides the CNN step).
        batches: the calibration batches (tuples of tensors).
        name: the preset's name, or None (nothing runs).
        before_rounding: callable(prepared) run after equalisation and
            before the rounding replaces the weights (QAT keeps their float
            values: pt2e_fq.qat.float_weights); None: calib.apply runs both.

    Returns:
        calib.apply's CalibReport (with a hook, its `equalized` and
        `algorithms` cover the equalisation run before it), or None when
        the preset runs no algorithm."""
    report = None
    if name in presets.PTQ_ALGORITHMS:
        row = presets.PTQ_ALGORITHMS[name]
        equalization, activation_ranges = "equalization" in row, "activation_ranges" in row
        if before_rounding is None:
            report = calib.apply(prepared, batches, equalization=equalization, activation_ranges=activation_ranges)
        else:
            equalized = calib.equalize(prepared, batches) if equalization else []
            before_rounding(prepared)
            report = calib.apply(prepared, batches, activation_ranges=activation_ranges)
            if equalization:
                report.algorithms, report.equalized = ("equalization",) + report.algorithms, equalized
    if name in presets.CNN_PTQ_ALGORITHMS and presets.is_convolutional(model):
        calib.correct_activation_bias(prepared, batches)
    return report


def start_qat_from_ptq(prepared, model, batches, name) -> torch.fx.GraphModule:
    """run_ptq_algorithms, then what QAT from that PTQ needs, in place:
    every observer off (the calibrated ranges stay) and the weights GPTQ
    rounded to nearest given their float values back
    (pt2e_fq.qat.latent_weights_in_cells). The outputs are the PTQ's bit
    for bit; train it with pt2e_fq.qat.distill.

    Args:
        prepared: the calibrated GraphModule of prepare_pt2e.
        model: the float model it was exported from.
        batches: the calibration batches (tuples of tensors).
        name: the preset whose algorithms run, or None (none).

    Returns:
        `prepared`."""
    floats = {}
    run_ptq_algorithms(prepared, model, batches, name, before_rounding=lambda gm: floats.update(qat.float_weights(gm)))
    prepared.apply(disable_observer)
    if floats:
        qat.latent_weights_in_cells(prepared, floats)
    return prepared


def quantize(
    model: torch.nn.Module,
    example_inputs,
    config: ConfigLike,
    *,
    calibration: Optional[Sequence] = None,
    qat_steps: int = 0,
    lr: float = 1e-4,
    qparam_lr: Optional[float] = None,
    loss: str = "mse",
    temperature: float = 1.0,
    progress: bool = True,
    dynamic_batch: bool = True,
    algorithms: bool = True,
    validation: Optional[Sequence] = None,
) -> torch.fx.GraphModule:
    """The whole flow for a model without labels. PTQ: prepare, calibrate on
    `calibration` (batches; default: the example inputs), convert. For a
    preset name, PTQ runs the preset's defaults unless `algorithms` is
    False: on a convolutional network the 4-bit presets keep the first conv,
    depthwise convs and classifier at int8 weights (presets.int8_edges), and
    pt2e_fq.calib.apply runs the algorithms of presets.PTQ_ALGORITHMS
    between calibration and convert (on a convolutional network followed
    by calib.correct_activation_bias: presets.CNN_PTQ_ALGORITHMS).

    With qat_steps > 0, QAT starts from that PTQ (the same prepared model,
    the same algorithms: its converted output before the first step is the
    PTQ result) and trains it `qat_steps` steps to match the float model's
    outputs on the calibration batches (pt2e_fq.qat.distill: Adam at `lr`
    with a cosine decay; `loss` "mse", "cosine" or "kl" at `temperature`
    for logits). The model is trained as prepare_pt2e left it: exported in
    eval mode (batch norms folded into their convs, dropout off), every
    observer off (the calibrated ranges stay; learnable points' ranges
    train at `qparam_lr`), the fake-quant points passing gradients through
    their straight-through estimator. Where GPTQ rounded a weight to
    nearest, it trains from its float value, not from the centre of its
    cell (pt2e_fq.qat.latent_weights_in_cells: the same outputs, and a
    weight that can change its rounding in a few steps):
    start_qat_from_ptq. With `validation` batches, QAT is scored on them by
    the same loss (pt2e_fq.qat.output_error) before the first step, after
    every tenth of the steps and after the last, and the model converted is
    the best-scored state (distill's keep_best="min"): QAT that drifts away
    from the float model on data it does not train on ends no worse there
    than the PTQ it started from.

    dynamic_batch=False exports with the example's batch size (a model
    whose batch dimension cannot be dynamic); then every calibration batch
    must have it. The model is not changed.

    Args:
        model: the float model (its parameters are not changed).
        example_inputs: a tensor or a tuple of tensors, the model's input.
        config: a preset name, a QuantizerConfig or a FakeQuantQuantizer.
        calibration: calibration (and QAT) batches; default: the example.
        qat_steps: distillation steps after PTQ (0: PTQ only).
        lr: the weights' learning rate in QAT.
        qparam_lr: the learnable ranges' learning rate in QAT (None: `lr`).
        loss: the distillation loss (pt2e_fq.qat.distill).
        temperature: the softmax temperature of "kl".
        progress: show tqdm bars.
        dynamic_batch: export with a dynamic batch dimension.
        algorithms: run a preset's post-training algorithms and int8 edges.
        validation: batches QAT is scored on (not trained on); None: QAT
            ends after its last step. Only with qat_steps > 0.

    Returns:
        The converted GraphModule.

    Raises:
        ValueError: qat_steps < 0, no calibration batch, or `validation`
            empty or given without QAT.
        ExportError: torch.export cannot export the model.
        TrainingDiverged: QAT's loss or a parameter became NaN or infinite.
    """
    if qat_steps < 0:
        raise ValueError(f"quantize: qat_steps must be >= 0, got {qat_steps}")
    example = as_args(example_inputs)
    batches = [as_args(b) for b in (calibration if calibration is not None else [example])]
    if not batches:
        raise ValueError("quantize: calibration holds no batch")
    if validation is not None:
        if qat_steps == 0:
            raise ValueError("quantize: validation scores QAT; give qat_steps > 0 with it")
        validation = [as_args(b) for b in validation]
        if not validation:
            raise ValueError("quantize: validation holds no batch")
    name = config if algorithms and isinstance(config, str) else None
    if name in presets.INT8_EDGE_PRESETS:
        config = presets.int8_edges(presets.get_preset(name), model)
    prepared = prepare(model, example, config, dynamic_batch=dynamic_batch)
    calibrate(prepared, batches, progress=progress)
    if qat_steps == 0:
        run_ptq_algorithms(prepared, model, batches, name)
        return convert(prepared)
    start_qat_from_ptq(prepared, model, batches, name)
    scoring = {} if validation is None else dict(
        evaluate=lambda student: qat.output_error(student, model, validation, loss, temperature),
        eval_every=max(1, qat_steps // 10), keep_best="min")
    history = qat.distill(prepared, model, batches, steps=qat_steps, loss=loss, temperature=temperature, lr=lr,
                          qparam_lr=qparam_lr, progress=progress, desc="QAT", **scoring)
    if validation is not None and progress:
        (step, best), start = history.best, history.evaluations[0][1]
        tqdm.write(f"QAT: the state after step {step} of {qat_steps} kept: validation loss {best:.4g} "
                   f"(at the start {start:.4g}, after the last step {history.evaluations[-1][1]:.4g})")
    return convert(prepared)
