"""Drop-ins for torchao's PT2E flow functions, with the fixes every user of
the stock flow needs, and the end of QAT.

    from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e
    from pt2e_fq import convert_pt2e, move_exported_model_to_eval

    prepared = prepare_qat_pt2e(torch.export.export(model.train(), example).module(), quantizer)
    ...                                   # train
    move_exported_model_to_eval(prepared) # torchao's: every batch norm's eps becomes 1e-5
    converted = convert_pt2e(prepared)    # torchao's graph, without its conv-bn fold's pattern search

- `move_exported_model_to_eval`: batch norms keep their own momentum and eps,
  and the train-only randomness of a train-mode export (dropouts, SDPA's
  dropout_p, stochastic depth's random masks) is removed.
- `convert_pt2e`: torchao's convert_pt2e; where every point is a pt2e_fq
  FakeQuantize it skips torchao's QAT conv-bn fold, which matches only
  torchao's own quantize/dequantize patterns (none in such a graph) and
  builds 96 pattern graphs to find that out (tens of seconds on a QAT CNN).
- `freeze_qat`: the eval switch, one forward with the observers on (the
  weight qparams of a conv-bn see the final statistics), observers off.
- `own_tensors`: the exported graph's own copies of its parameters and
  buffers (FakeQuantQuantizer runs it in prepare): the GraphModule of
  `torch.export.export(model, ...).module()` holds the very tensors of
  `model`, so training it would train the user's float model too.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torchao.quantization.pt2e as tao
from torchao.quantization.pt2e import qat_utils
from torchao.quantization.pt2e.export_utils import _EXPORTED_TRAINING_ATTR
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e as _torchao_convert_pt2e

from .eval_mode import (BATCH_NORM, DROPOUTS, SDPA, _SDPA_DROPOUT_P, eval_value_of_masked_product, masked_products,
                        random_noise, restore_batch_norms, sdpa_dropout_p)
from .fake_quantize import FakeQuantize
from .graph import as_args

aten = torch.ops.aten


def own_tensors(gm: torch.nn.Module) -> torch.nn.Module:
    """Gives `gm` its own copy of every parameter and buffer, in place:
    `torch.export.export(model, ...).module()` shares them with `model`, so
    QAT (optimizer steps, batch norms' running statistics) would change the
    float model, which is often the distillation teacher too. A tensor held
    under several names (tied weights) is copied once and stays tied; a
    parameter stays a Parameter with its requires_grad.

    Args:
        gm: a module, usually the GraphModule of an exported program.

    Returns:
        `gm`, holding no tensor it held before (their values unchanged).
    """
    copies: dict[int, torch.Tensor] = {}

    def copy_of(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in copies:
            data = t.detach().clone()
            copies[id(t)] = torch.nn.Parameter(data, t.requires_grad) if isinstance(t, torch.nn.Parameter) else data
        return copies[id(t)]

    for module in gm.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = copy_of(p)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = copy_of(b)
    return gm


def _is_random(node: torch.fx.Node) -> bool:
    """An op that draws random numbers (ATen tags them nondeterministic_seeded);
    SDPA only where its dropout_p is not 0."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if node.target is SDPA:
        return sdpa_dropout_p(node) != 0
    return torch.Tag.nondeterministic_seeded in node.target.tags


def _module_text(node: torch.fx.Node) -> str:
    stack = list(node.meta.get("nn_module_stack", {}).values())
    return f"module '{stack[-1][0]}'" if stack else "the model itself"


def move_exported_model_to_eval(model: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Switches an exported (prepared) model to eval mode, in place; a drop-in
    for torchao's `move_exported_model_to_eval`.

    - batch norms use their running statistics, each with its own momentum
      and eps (torchao's switch writes 0.1 and 1e-5 into every one; a model
      it switched is repaired from the values FakeQuantQuantizer recorded);
    - dropouts become the identity; a scaled_dot_product_attention with the
      dropout_p of a train-mode export gets dropout_p 0.0;
    - a product with a random Bernoulli mask (stochastic depth / DropPath in
      torchvision and timm: x * bernoulli(keep) / keep) becomes its other
      factor x, and x.div(keep) * floor(keep + rand) (DropPath in
      transformers and older timm) becomes x: what those modules return in
      eval mode. A product with a mask built from the floor of uniform
      draws in any other way is left (and named in the warning below):
      convert_pt2e, `save` and `to_onnx` refuse the model;
    - any other random op is left and named in a warning: nothing tells
      whether the model means it in eval mode.

    One way: dropouts and masks are removed, not switched off; torchao's
    switches see the model as in eval mode and leave it alone.

    Args:
        model: a GraphModule from torch.export (prepared or not).

    Returns:
        `model`, switched.

    Raises:
        TypeError: `model` is not a torch.fx.GraphModule.
    """
    if not isinstance(model, torch.fx.GraphModule):
        raise TypeError(f"move_exported_model_to_eval: model must be a torch.fx.GraphModule (from torch.export), "
                        f"got {type(model).__name__}")
    restore_batch_norms(model)
    graph = model.graph
    for n in list(graph.nodes):
        if n.target is BATCH_NORM and n.args[5] and isinstance(n.args[3], torch.fx.Node):
            n.args = (*n.args[:5], False, *n.args[6:])  # training=False; momentum and eps as they are
        elif n.target in DROPOUTS:  # (input, p, train), in place or not: the identity in eval mode
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)
        elif n.target is SDPA and sdpa_dropout_p(n) != 0:
            if "dropout_p" in n.kwargs:
                n.update_kwarg("dropout_p", 0.0)
            else:
                n.update_arg(_SDPA_DROPOUT_P, 0.0)
    noise, draws = random_noise(model)
    removable = noise | draws
    for n in masked_products(model, noise):
        value = eval_value_of_masked_product(n, noise)
        if value is not None:  # else left: the warning below names it, convert and save refuse it
            n.replace_all_uses_with(value)
            removable.add(n)
    # In-place draws (bernoulli_, uniform_, floor_, div_) count as side effects for plain dead-code elimination.
    graph.eliminate_dead_code(is_impure_node=lambda n: n not in removable and n.is_impure())
    model.delete_all_unused_submodules()
    model.recompile()
    left = [n for n in graph.nodes if _is_random(n)]
    if left:
        where = ", ".join(f"{n.name} ({n.target}) in {_module_text(n)}" for n in left)
        warnings.warn(f"move_exported_model_to_eval: {len(left)} random op(s) stay in the eval-mode graph, so its "
                      f"outputs are random: {where}; only dropouts, SDPA's dropout_p, Bernoulli masks multiplied "
                      "into a tensor and x.div(keep) * floor(keep + rand) (stochastic depth) are recognised as "
                      "train-only", stacklevel=2)
    setattr(model, _EXPORTED_TRAINING_ATTR, False)
    return model


def convert_pt2e(model: torch.fx.GraphModule, use_reference_representation: bool = False,
                 fold_quantize: bool = True) -> torch.fx.GraphModule:
    """torchao's `convert_pt2e`, the same graph, faster: freezes every
    fake-quant point (one op call each; a pt2e_fq FakeQuantize keeps its node).

    When every point is a pt2e_fq FakeQuantize, torchao's QAT conv-bn fold is
    skipped: it matches only torchao's quantize/dequantize patterns, of which
    such a graph has none. Folding batch norms is the export step's job
    (`save`, `to_onnx`).

    Args:
        model: a model from prepare_pt2e or prepare_qat_pt2e, calibrated or
            trained (for QAT, after `move_exported_model_to_eval` or `freeze_qat`).
        use_reference_representation: passed to torchao's convert_pt2e.
        fold_quantize: passed to torchao's convert_pt2e.

    Returns:
        The converted GraphModule (torchao converts in place).

    Raises:
        UncalibratedError: a point never saw data.
        NonFiniteQParamsError: a point's qparams are NaN or infinite.
        ValueError: torchao's eval switch left the model different from its
            float model (pt2e_fq.eval_mode.check_eval_mode).
    """
    points = [m for m in model.modules() if isinstance(m, (tao.ObserverBase, tao.FakeQuantizeBase))]
    if not all(isinstance(m, FakeQuantize) for m in points):
        return _torchao_convert_pt2e(model, use_reference_representation, fold_quantize)
    with _torchao_conv_bn_fold_skipped():
        return _torchao_convert_pt2e(model, use_reference_representation, fold_quantize)


@contextlib.contextmanager
def _torchao_conv_bn_fold_skipped():
    """torchao's _fold_conv_bn_qat without its pattern matching: what
    remains is its clean-up (the batch norms' num_batches_tracked updates
    removed, dead code eliminated), as convert_pt2e does it. The helper is
    private: pyproject.toml pins torchao's minor version and
    tests/flow/test_convert.py fails where the name is gone."""
    helper = qat_utils._fold_conv_bn_qat_helper
    qat_utils._fold_conv_bn_qat_helper = lambda m, *args, **kwargs: m
    try:
        yield
    finally:
        qat_utils._fold_conv_bn_qat_helper = helper


def start_learning_ranges(prepared: torch.nn.Module) -> torch.nn.Module:
    """Turns off the observers of the learnable points (QSpec(learnable=True)),
    in place. Call it after calibration, before QAT: a learnable point's
    observer, while on, sets its qparams at every forward, overwriting what
    the optimizer learned. The other points keep theirs.

    Args:
        prepared: a model from prepare_qat_pt2e, calibrated.

    Returns:
        `prepared`.

    Raises:
        Nothing: a model without learnable points is left as it is.
    """
    for m in prepared.modules():
        if isinstance(m, FakeQuantize) and m.qspec.learnable:
            m.disable_observer()
    return prepared


def freeze_qat(prepared: torch.fx.GraphModule, batch) -> torch.fx.GraphModule:
    """Ends QAT, in place: `move_exported_model_to_eval`, one forward of
    `batch` with the observers on, so the weight qparams of a conv-bn see the
    final statistics, then every observer off. A learnable point's observer
    stays off: its range is the trained one.

    Args:
        prepared: a model from prepare_qat_pt2e, trained.
        batch: the model's input: a tensor or a tuple of tensors.

    Returns:
        `prepared`, ready for `convert_pt2e`.

    Raises:
        TypeError: `prepared` is not a torch.fx.GraphModule.
    """
    move_exported_model_to_eval(prepared)
    prepared.apply(tao.enable_observer)
    start_learning_ranges(prepared)  # a learned range is kept as trained
    with torch.no_grad():
        prepared(*as_args(batch))
    prepared.apply(tao.disable_observer)
    return prepared
