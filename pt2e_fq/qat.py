"""Distillation QAT: a prepared (fake-quantized) student learns to reproduce
its float teacher's outputs, the usual way to fine-tune a trained checkpoint
for deployment when its training data and labels are not at hand.

    prepared = prepare_qat_pt2e(torch.export.export(model.train(), example).module(), quantizer)
    for batch in calibration:                      # observers see data
        prepared(*batch)
    history = pt2e_fq.qat.distill(prepared, model, batches, steps=300, loss="kl", temperature=2.0,
                                  freeze_batch_norms_after=50)
    pt2e_fq.freeze_qat(prepared, batches[0])       # then convert_pt2e

- the teacher runs in eval mode without gradients and is left as it was
  (prepare gives the student its own parameter copies: flow.own_tensors);
- `loss`: "kl" for classifier logits (KL(teacher || student) of the
  softmaxes at `temperature`, times temperature², Hinton et al.), "mse" for
  embeddings or any output, "cosine" (1 - cosine similarity along the last
  axis) for embeddings whose direction is what counts, or a callable; a
  model returning several tensors (a tuple, a dict, a ModelOutput) is
  scored by the mean of the built-in loss over its floating-point tensor
  outputs, paired by position (a callable gets the outputs as they are);
- `intermediate`: module paths (the student is an export of the teacher, so
  the same paths name the same layers) whose outputs are matched too (mean
  squared error, weighted `intermediate_weight`);
- `freeze_batch_norms_after`: after that many steps every batch norm
  normalises with its running statistics and stops updating them (the
  running statistics of a small fine-tuning set are noisier than the
  pre-trained ones);
- `freeze_observers_after`: after that many steps every observer is off
  (the ranges stay where they are, learnable ones keep learning);
- `augment`: applied to each batch before both models see it;
- a tqdm bar; the returned History holds the loss of every step and any
  held-out evaluations (`evaluate` every `eval_every` steps);
- `keep_best`: the student also evaluated before the first step, and left
  at the state of its best evaluation, so that a run that overfits its
  fine-tuning data does not end worse than it started on the user's
  validation data (a trained EfficientNet-Lite0 at w8a8, 300 steps of
  Adam at 1e-4 on augmented crops of nine images: top-1 agreement with the
  float model on ten other photographs fell from 91.0 to 82.0 %).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Sequence, Union

import torch
import torch.nn.functional as F
import torchao.quantization.pt2e as tao
from torch.utils._pytree import tree_flatten
from tqdm import tqdm

from .eval_mode import BATCH_NORM
from .fake_quantize import FakeQuantize
from .flow import start_learning_ranges
from .graph import as_args
from .ops.blocks import expand_blocks
from .spec.format_kinds import INTEGER, kind_of

LOSSES = ("kl", "mse", "cosine")
KEEP_BEST = (None, "max", "min")


class TrainingDiverged(ValueError):
    """The loss or a trained parameter became NaN or infinite (a learning
    rate too high, or non-finite data)."""


@dataclass
class History:
    """What a distillation run did: `losses` the total loss of every step,
    `intermediate_losses` the intermediate-matching part of it (empty
    without `intermediate`), `evaluations` (step, value) pairs of
    `evaluate`, `best` the (step, value) of the evaluation whose state
    the student ends at under `keep_best` (None without it),
    `batch_norms_frozen_at` and `observers_off_at` the step after which
    each happened (None: not during the run), `seconds` the wall time."""

    losses: list = field(default_factory=list)
    intermediate_losses: list = field(default_factory=list)
    evaluations: list = field(default_factory=list)
    best: Optional[tuple] = None
    batch_norms_frozen_at: Optional[int] = None
    observers_off_at: Optional[int] = None
    seconds: float = 0.0


def check_finite(model: torch.nn.Module, desc: str, losses: Sequence[float]) -> None:
    """Raises TrainingDiverged unless the last loss and every trained
    parameter are finite: a step can make a parameter infinite with a finite
    loss, and the next forward would fail in a fake-quant op on a NaN scale,
    far from the cause.

    Args:
        model: the model being trained.
        desc: the loop's name, for the message.
        losses: the losses so far (the last one is checked).

    Raises:
        TrainingDiverged: naming the step and the parameter.
    """
    if not math.isfinite(losses[-1]):
        raise TrainingDiverged(f"{desc}: the loss became {losses[-1]} at step {len(losses)}")
    for name, p in model.named_parameters():
        if p.requires_grad and not torch.isfinite(p).all():
            raise TrainingDiverged(f"{desc}: parameter {name} became NaN or infinite at step {len(losses)}")


def freeze_batch_norms(prepared: torch.fx.GraphModule) -> int:
    """Freezes every batch norm of an exported (prepared) model, in place:
    it normalises with its running statistics and no longer updates them
    (torchao's recipe for PT2E QAT: the batch_norm node's training flag set
    to False). Conv-bn patterns of prepare_qat_pt2e then see fixed
    statistics too.

    Args:
        prepared: a GraphModule from torch.export (prepared or not).

    Returns:
        The number of batch norms switched (0: none was in training mode).

    Raises:
        TypeError: `prepared` is not a torch.fx.GraphModule.
    """
    if not isinstance(prepared, torch.fx.GraphModule):
        raise TypeError(f"freeze_batch_norms: prepared must be a torch.fx.GraphModule (from torch.export), got "
                        f"{type(prepared).__name__}")
    switched = 0
    for n in prepared.graph.nodes:
        if n.target is BATCH_NORM and n.args[5]:
            n.args = (*n.args[:5], False, *n.args[6:])
            switched += 1
    if switched:
        prepared.recompile()
    return switched


def _weight_points(prepared: torch.fx.GraphModule) -> dict[str, FakeQuantize]:
    """Each weight (a get_attr read by one of our fake-quant points) by its
    attribute path, with its point."""
    return {n.args[0].target: prepared.get_submodule(n.target) for n in prepared.graph.nodes
            if n.op == "call_module" and n.args and isinstance(n.args[0], torch.fx.Node)
            and n.args[0].op == "get_attr" and isinstance(prepared.get_submodule(n.target), FakeQuantize)}


def _attribute(gm: torch.nn.Module, path: str) -> torch.Tensor:
    owner, _, attr = path.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, attr)


def float_weights(prepared: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """A copy of every fake-quantized weight of a prepared model, by
    attribute path: take it after equalisation and before a rounding
    algorithm (GPTQ) replaces the weights by grid values, for
    latent_weights_in_cells.

    Args:
        prepared: a GraphModule of prepare_pt2e / prepare_qat_pt2e.

    Returns:
        {attribute path: detached copy}.
    """
    return {path: _attribute(prepared, path).detach().clone() for path in _weight_points(prepared)}


def latent_weights_in_cells(prepared: torch.fx.GraphModule, floats: dict[str, torch.Tensor]) -> int:
    """Gives weights that a rounding algorithm left on grid values their
    float values back where the algorithm rounded them to nearest, in
    place: each such weight is its float value (clamped into its cell, a
    guard), every other weight keeps its grid value, so the fake-quantized
    weights (hence the model's outputs) stay bit for bit what they were,
    and QAT starts from them.

    Why: GPTQ stores each weight at the centre of its cell, half a grid step
    from a change of rounding; a QAT step moves a weight by a small fraction
    of a step (Adam: about the learning rate), so for many steps no rounding
    changes and only the biases learn (a small MLP, w4a8, 40 steps: held-out
    error 0.997x of the PTQ's; from these latent values 0.86x). The weights
    GPTQ rounded away from nearest stay at their centres: at their float
    values they would sit at the edge of the chosen cell, and the first
    steps would undo GPTQ's choices all at once (all-MiniLM-L6-v2, w4a8, lr
    1e-4: the held-out cosine fell from 0.980 to 0.925 in 40 steps).
    Integer formats only (a uniform grid of step `scale`); float-format
    weights keep their grid values. Call it with the weight points'
    observers off (calib.apply leaves them off; an observer on would move
    the cells).

    Args:
        prepared: the GraphModule after calibration and the rounding algorithm.
        floats: float_weights(prepared) taken before the rounding.

    Returns:
        How many weight elements moved off their grid value.

    Raises:
        ValueError: `floats` misses a weight of `prepared` or has another shape.
    """
    moved = 0
    for path, point in _weight_points(prepared).items():
        if kind_of(point.qspec.format) is not INTEGER:
            continue
        weight = _attribute(prepared, path)
        if path not in floats or floats[path].shape != weight.shape:
            raise ValueError(f"latent_weights_in_cells: floats has no weight {path!r} of shape "
                             f"{tuple(weight.shape)} (take it with float_weights(prepared) before the rounding)")
        with torch.no_grad():
            rounded = point(weight.detach().clone())
            step = expand_blocks(point.scale.detach().float(), weight.shape,
                                 point.qspec.granularity.block_size(weight.shape))
            half = 0.49 * step  # inside the cell, clear of its round-half-even edges
            offset = (floats[path].float() - weight.float()).clamp(-half, half)  # tensors: clamp elementwise
            latent = (weight.float() + offset).to(weight.dtype)
            # Only where the rounding kept the float value's own cell (the docstring says why).
            latent = torch.where((point(floats[path].to(weight.dtype)) == rounded) & (point(latent) == rounded),
                                 latent, weight)
            moved += int((latent != weight).sum())
            weight.copy_(latent)
    return moved


def _kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    t = temperature
    s, r = F.log_softmax(student.float() / t, -1), F.log_softmax(teacher.float() / t, -1)
    return F.kl_div(s.flatten(0, -2), r.flatten(0, -2), log_target=True, reduction="batchmean") * t * t


def _epoch_batches(batches, where: str) -> Callable[[int], Sequence]:
    """`batches` as a function from the epoch number to that epoch's batches:
    a callable as it is, a sequence for every epoch, and a re-iterable
    collection that is not a sequence (a DataLoader) iterated anew each
    epoch (a shuffling loader reshuffles). A one-pass iterator (a
    generator) cannot give a second epoch: a TypeError saying what to pass."""
    if callable(batches):
        return batches
    if isinstance(batches, (Sequence, torch.Tensor)):
        return lambda epoch: batches
    if not isinstance(batches, Iterable):
        raise TypeError(f"{where}: batches must be a list of batches, a DataLoader or a callable from the epoch "
                        f"number to a list of batches, got {type(batches).__name__}")
    if isinstance(batches, Iterator):  # iterating it consumes it
        raise TypeError(f"{where}: batches is a one-pass iterator ({type(batches).__name__}), which cannot be "
                        "read again for a later epoch or step; pass list(...) of it, a DataLoader, or a callable "
                        "from the epoch number to a list of batches")
    return lambda epoch: list(batches)


def output_error(student: torch.nn.Module, teacher: torch.nn.Module, batches: Sequence, loss: Union[str, Callable] = "mse",
                 temperature: float = 1.0) -> float:
    """The mean distillation loss of `student` against `teacher` over
    `batches`, without gradients: a validation score for distill's
    `evaluate` with keep_best="min" (the loss the run trains on, scored on
    data it does not train on). The teacher runs in eval mode, its mode
    restored after.

    Args:
        student: the model scored (a prepared student or a converted model).
        teacher: the float model.
        batches: model inputs, a tensor or a tuple of tensors per batch (a list, or a DataLoader).
        loss: as distill's `loss`.
        temperature: the softmax temperature of "kl".

    Returns:
        The mean over the batches.

    Raises:
        ValueError: no batch, or an unknown loss.
    """
    if not callable(loss) and loss not in LOSSES:
        raise ValueError(f"output_error: loss must be one of {', '.join(LOSSES)} or a callable, got {loss!r}")
    batches = _epoch_batches(batches, "output_error")(0)
    if len(batches) == 0:
        raise ValueError("output_error: batches holds no batch")
    score, was_training = _output_loss(loss, temperature, "output_error"), teacher.training
    teacher.eval()
    try:
        with torch.no_grad():
            return sum(float(score(student(*as_args(b)), teacher(*as_args(b)))) for b in batches) / len(batches)
    finally:
        teacher.train(was_training)


def _output_loss(loss: Union[str, Callable], temperature: float, where: str) -> Callable:
    """The loss of a student's output against the teacher's. A built-in
    loss takes the mean over the floating-point tensors of the two outputs
    (a tensor, or a tuple, list, dict or ModelOutput of them), paired by
    position: the mean, so that a one-tensor output scores as the tensor
    does and the loss's scale does not grow with the number of outputs."""
    if callable(loss):
        return loss
    if loss == "kl":
        one = lambda s, t: _kl(s, t, temperature)  # noqa: E731
    elif loss == "mse":
        one = lambda s, t: F.mse_loss(s.float(), t.float())  # noqa: E731
    else:
        one = lambda s, t: (1 - F.cosine_similarity(s.float(), t.float(), dim=-1)).mean()  # noqa: E731

    def over_outputs(student_out, teacher_out):
        if isinstance(student_out, torch.Tensor) and isinstance(teacher_out, torch.Tensor):
            return one(student_out, teacher_out)
        s_leaves, s_spec = tree_flatten(student_out)
        t_leaves, t_spec = tree_flatten(teacher_out)
        if s_spec != t_spec:
            raise ValueError(f"{where}: loss {loss!r} pairs the student's outputs with the teacher's, but they "
                             f"differ in structure (student {type(student_out).__name__} of {len(s_leaves)}, "
                             f"teacher {type(teacher_out).__name__} of {len(t_leaves)}); pass loss=callable(student, "
                             "teacher) -> scalar")
        pairs = [(a, b) for a, b in zip(s_leaves, t_leaves) if isinstance(a, torch.Tensor)
                 and isinstance(b, torch.Tensor) and a.is_floating_point() and b.is_floating_point()]
        if not pairs:
            raise ValueError(f"{where}: loss {loss!r} compares floating-point tensors, and the model returns none "
                             f"(a {type(teacher_out).__name__}); pass loss=callable(student, teacher) -> scalar")
        return sum(one(a, b) for a, b in pairs) / len(pairs)

    return over_outputs


def _module_outputs(student: torch.fx.GraphModule, paths: Sequence[str]) -> dict[str, torch.fx.Node]:
    """For each module path, the last node of the student's graph that
    torch.export recorded inside that module (its output, for a module
    whose body runs in order)."""
    found = {}
    for n in student.graph.nodes:
        stack = {v[0] for v in n.meta.get("nn_module_stack", {}).values()}
        for path in paths:
            if path in stack:
                found[path] = n
    missing = [p for p in paths if p not in found]
    if missing:
        raise ValueError(f"distill: intermediate names module(s) {missing} that no node of the student's graph "
                         "comes from; give module paths of the teacher (model.named_modules()) that torch.export "
                         "kept")
    return found


def _tap(store: dict, key: str) -> Callable:
    """A graph call that records a node's value in store[key] (its only side effect)."""

    def tap(value):
        store[key] = value

    tap.__name__ = f"distill_tap_{key.replace('.', '_')}"
    return tap


@contextlib.contextmanager
def _tapped(student: torch.fx.GraphModule, paths: Sequence[str], store: dict):
    """The student's graph with a _tap after each module output, removed on exit."""
    taps = []
    for path, node in _module_outputs(student, paths).items():
        with student.graph.inserting_after(node):
            taps.append(student.graph.call_function(_tap(store, path), (node,)))
    student.recompile()
    try:
        yield
    finally:
        for tap in taps:
            student.graph.erase_node(tap)
        student.recompile()


@contextlib.contextmanager
def _hooked(teacher: torch.nn.Module, paths: Sequence[str], store: dict):
    modules = dict(teacher.named_modules())
    missing = [p for p in paths if p not in modules]
    if missing:
        raise ValueError(f"distill: intermediate names module(s) {missing} that the teacher does not have")
    handles = [modules[p].register_forward_hook(lambda m, i, o, p=p: store.__setitem__(p, o)) for p in paths]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _check_step_count(name: str, value, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"distill: {name} must be an int >= 0{' or None' if allow_none else ''}, got {value!r}")


def _better(value: float, best: float, keep_best: str) -> bool:
    """Whether `value` beats `best` (strictly: a tie keeps the earlier state); NaN never does, and any number beats NaN."""
    if math.isnan(best):
        return not math.isnan(value)
    return value > best if keep_best == "max" else value < best


def _check_args(student, teacher, steps, loss, temperature, intermediate_weight, eval_every, lr, qparam_lr) -> None:
    if not isinstance(student, torch.fx.GraphModule):
        raise TypeError(f"distill: student must be the GraphModule of prepare_qat_pt2e / prepare_pt2e, got "
                        f"{type(student).__name__}")
    if not isinstance(teacher, torch.nn.Module) or teacher is student:
        raise TypeError("distill: teacher must be the float model (an nn.Module other than the student), got "
                        f"{type(teacher).__name__}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"distill: steps must be an int >= 1, got {steps!r}")
    if not callable(loss) and loss not in LOSSES:
        raise ValueError(f"distill: loss must be one of {', '.join(LOSSES)} or a callable(student, teacher), "
                         f"got {loss!r}")
    if not isinstance(temperature, (int, float)) or not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"distill: temperature must be a finite number > 0, got {temperature!r}")
    if not isinstance(intermediate_weight, (int, float)) or not intermediate_weight >= 0:
        raise ValueError(f"distill: intermediate_weight must be a number >= 0, got {intermediate_weight!r}")
    for name, value in (("lr", lr), ("qparam_lr", qparam_lr)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not (math.isfinite(value) and value >= 0)):
            raise ValueError(f"distill: {name} must be a finite number >= 0 (a learning rate), got {value!r}")
    _check_step_count("eval_every", eval_every)
    if eval_every == 0:
        raise ValueError("distill: eval_every must be >= 1 or None, got 0")


def trainable_parameters(student: torch.nn.Module) -> tuple[list, list]:
    """(weights and biases, learnable qparams) of a prepared model: the
    parameters an optimizer trains, split so that the ranges can take
    their own learning rate.

    Args:
        student: a prepared model.

    Returns:
        Two lists of Parameters with requires_grad.
    """
    qparams = {id(p) for m in student.modules() if isinstance(m, FakeQuantize) for p in m.parameters()}
    params = [p for p in student.parameters() if p.requires_grad]
    return [p for p in params if id(p) not in qparams], [p for p in params if id(p) in qparams]


def distill(
    student: torch.fx.GraphModule,
    teacher: torch.nn.Module,
    batches: Union[Sequence, Callable[[int], Sequence]],
    *,
    steps: int,
    loss: Union[str, Callable] = "mse",
    temperature: float = 1.0,
    optimizer: Optional[torch.optim.Optimizer] = None,
    lr: float = 1e-5,
    qparam_lr: Optional[float] = None,
    cosine_schedule: bool = True,
    intermediate: Sequence[str] = (),
    intermediate_weight: float = 1.0,
    freeze_batch_norms_after: Optional[int] = None,
    freeze_observers_after: Optional[int] = None,
    augment: Optional[Callable] = None,
    evaluate: Optional[Callable[[torch.fx.GraphModule], float]] = None,
    eval_every: Optional[int] = None,
    keep_best: Optional[str] = None,
    progress: bool = True,
    desc: str = "distill",
) -> History:
    """Trains `student` (a prepared, calibrated model) for `steps` steps to
    reproduce `teacher`'s outputs on `batches` (module doc).

    Args:
        student: the GraphModule of prepare_qat_pt2e (or prepare_pt2e: its
            fake-quant points train through their straight-through
            estimator too), calibrated. Learnable points' observers are
            switched off first (flow.start_learning_ranges).
        teacher: the float model; run in eval mode without gradients, its
            mode restored after.
        batches: model inputs (a tensor or a tuple of tensors per batch),
            cycled until `steps`; a re-iterable collection such as a
            DataLoader, read anew each epoch; or a callable from the epoch
            number to a sequence of them (to reshuffle or redraw). A
            generator is refused (it cannot give a second epoch).
        steps: optimizer steps.
        loss: "kl", "mse", "cosine" or callable(student_output, teacher_output) -> scalar;
            a built-in loss over several outputs (tuple, dict, ModelOutput) is the mean over
            their floating-point tensors.
        temperature: the softmax temperature of "kl".
        optimizer: the optimizer to step; None: Adam over the weights and
            biases at `lr` and the learnable qparams at `qparam_lr`.
        lr: the weights' learning rate of the default optimizer, a finite number >= 0.
        qparam_lr: the learnable qparams' learning rate (None: `lr`), a finite number >= 0.
        cosine_schedule: with the default optimizer, learning rates decay to
            0 along a half cosine over `steps`.
        intermediate: module paths whose outputs are matched as well (mean squared error).
        intermediate_weight: the weight of the intermediate losses.
        freeze_batch_norms_after: freeze_batch_norms after this many steps (0: before the first).
        freeze_observers_after: every observer off after this many steps (0: before the first).
        augment: callable(inputs tuple) -> inputs tuple, applied to each batch.
        evaluate: callable(a copy of the student) -> float (a held-out
            metric), called in no_grad every `eval_every` steps and after
            the last; it may freeze and convert the copy.
        eval_every: see `evaluate`.
        keep_best: "max" or "min": `evaluate` runs before the first step
            too, and the student ends at the state (parameters and
            buffers) of the highest ("max") or lowest ("min") evaluation,
            its batch norms and observers frozen as the run left them;
            None: the state after the last step.
        progress: show a tqdm bar.
        desc: the bar's label and the loop's name in errors.

    Returns:
        The History of the run.

    Raises:
        TypeError: `student` is not a GraphModule or `teacher` not a module.
        ValueError: a bad argument (the message names it and what is allowed).
        TrainingDiverged: the loss or a parameter became NaN or infinite.
    """
    _check_args(student, teacher, steps, loss, temperature, intermediate_weight, eval_every, lr, qparam_lr)
    if keep_best not in KEEP_BEST:
        raise ValueError(f"distill: keep_best must be one of {', '.join(map(repr, KEEP_BEST))}, got {keep_best!r}")
    if keep_best is not None and evaluate is None:
        raise ValueError(f"distill: keep_best={keep_best!r} needs evaluate (the metric that picks the best state)")
    _check_step_count("freeze_batch_norms_after", freeze_batch_norms_after)
    _check_step_count("freeze_observers_after", freeze_observers_after)
    intermediate = list(intermediate)
    epochs = _epoch_batches(batches, "distill")
    epoch_batches = epochs(0)
    if len(epoch_batches) == 0:
        raise ValueError("distill: batches holds no batch")
    start = time.perf_counter()
    start_learning_ranges(student)
    if optimizer is None:
        weights, qparams = trainable_parameters(student)
        groups = [{"params": weights, "lr": lr}]
        if qparams:
            groups.append({"params": qparams, "lr": lr if qparam_lr is None else qparam_lr})
        optimizer = torch.optim.Adam(groups)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps) if cosine_schedule else None
    else:
        schedule = None
    output_loss = _output_loss(loss, temperature, desc)
    history = History()
    teacher_was_training = teacher.training
    teacher.eval()
    student_store, teacher_store = {}, {}

    def freeze_due(after: Optional[int], step: int) -> bool:
        return after is not None and step == after

    best_state = None

    def run_evaluation(step: int) -> None:
        nonlocal best_state
        with torch.no_grad():
            value = float(evaluate(copy.deepcopy(student)))
        history.evaluations.append((step, value))
        if keep_best is not None and (history.best is None or _better(value, history.best[1], keep_best)):
            history.best = (step, value)
            best_state = {k: v.detach().clone() for k, v in student.state_dict().items()}

    try:
        with _tapped(student, intermediate, student_store) if intermediate else contextlib.nullcontext(), \
                _hooked(teacher, intermediate, teacher_store) if intermediate else contextlib.nullcontext(), \
                tqdm(total=steps, desc=desc, disable=not progress, unit="step", mininterval=0.5) as bar:
            if keep_best is not None:
                run_evaluation(0)
            epoch, position = 0, 0
            for step in range(steps):
                if freeze_due(freeze_batch_norms_after, step):
                    freeze_batch_norms(student)
                    history.batch_norms_frozen_at = step
                if freeze_due(freeze_observers_after, step):
                    student.apply(tao.disable_observer)  # torchao's fake-quant modules too
                    history.observers_off_at = step
                if position == len(epoch_batches):
                    epoch, position = epoch + 1, 0
                    epoch_batches = epochs(epoch)  # a sequence: the same batches again
                    if len(epoch_batches) == 0:
                        raise ValueError(f"{desc}: batches gave no batch for epoch {epoch}; a batches callable or "
                                         "DataLoader must give at least one batch for every epoch")
                inputs = as_args(epoch_batches[position])
                position += 1
                if augment is not None:
                    inputs = as_args(augment(inputs))
                with torch.no_grad():
                    target = teacher(*inputs)
                optimizer.zero_grad(set_to_none=True)
                total = output_loss(student(*inputs), target)
                if intermediate:
                    matched = sum(F.mse_loss(student_store[p].float(), teacher_store[p].float())
                                  for p in intermediate)
                    history.intermediate_losses.append(float(matched.detach()))
                    total = total + intermediate_weight * matched
                total.backward()
                optimizer.step()
                if schedule is not None:
                    schedule.step()
                history.losses.append(float(total.detach()))
                check_finite(student, desc, history.losses)
                bar.set_postfix(loss=f"{history.losses[-1]:.4g}", refresh=False)
                bar.update(1)
                if evaluate is not None and eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
                    run_evaluation(step + 1)
            if evaluate is not None:
                run_evaluation(steps)
    finally:
        teacher.train(teacher_was_training)
    if best_state is not None and history.best[0] != steps:
        student.load_state_dict(best_state)
        if history.observers_off_at is not None:  # the flags are buffers: the restored state may predate the switch
            student.apply(tao.disable_observer)
    history.seconds = time.perf_counter() - start
    return history
