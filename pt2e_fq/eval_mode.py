"""What an exported model keeps of its float model's batch norms and train-only
randomness, and the check that a model leaving the flow kept them.

torchao rewrites batch norms from patterns traced with the default arguments,
so each rewrite writes momentum 0.1 and eps 1e-5 into every batch norm it
touches (torchvision's MobileNetV3 and EfficientNet use 0.01 and 1e-3):
prepare_qat_pt2e's conv-bn fusion, and move_exported_model_to_eval /
move_exported_model_to_train. torchao's eval switch also rewrites only
`aten.dropout`: a scaled_dot_product_attention with the dropout_p of a
train-mode export, and stochastic depth's random masks, stay random.

So FakeQuantQuantizer records each batch norm's own values before the fusion
(`record_batch_norms`, in `transform_for_annotation`) and writes them back
after it (`restore_batch_norms`, in `prepare_obs_or_fq_callback`); the record
stays in the GraphModule's `meta`, through prepare, convert and deepcopy.
`pt2e_fq.move_exported_model_to_eval` (flow.py) restores them too, and
`check_eval_mode` refuses, in convert_pt2e (FakeQuantize.convert), `save` and
`to_onnx`, a model whose graph lost them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torchao.quantization.pt2e.export_utils import _EXPORTED_TRAINING_ATTR

aten = torch.ops.aten


# Dropouts (input, p, train), in place or not: the identity where train is False.
DROPOUTS = frozenset(getattr(aten, name).default for name in (
    "dropout", "dropout_", "feature_dropout", "feature_dropout_", "alpha_dropout", "alpha_dropout_",
    "feature_alpha_dropout", "feature_alpha_dropout_"))
BATCH_NORM = aten.batch_norm.default
SDPA = aten.scaled_dot_product_attention.default
_SDPA_DROPOUT_P = 4  # its argument index
# GraphModule.meta key: {running_var buffer: (momentum, eps)} of each batch norm, as the float model had them.
RECORD = "pt2e_fq.batch_norms"


def _running_var(node: torch.fx.Node) -> Optional[str]:
    """The running_var buffer a batch_norm node reads: what identifies its
    batch norm across torchao's pattern rewrites (they replace the node)."""
    var = node.args[4]
    return var.target if isinstance(var, torch.fx.Node) and var.op == "get_attr" else None


def _batch_norms(gm: torch.fx.GraphModule):
    return [n for n in gm.graph.nodes if n.target is BATCH_NORM and _running_var(n) is not None]


def _eps_adds(gm: torch.fx.GraphModule, record: dict):
    """The `running_var + eps` of torchao's QAT conv-bn pattern (its scale
    factor is weight / sqrt(running_var + eps))."""
    return [n for n in gm.graph.nodes
            if n.target is aten.add.Tensor and isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "get_attr"
            and n.args[0].target in record and isinstance(n.args[1], float)]


def record_batch_norms(gm: torch.fx.GraphModule) -> None:
    """Records the momentum and eps of every batch norm with running
    statistics in `gm.meta` (the float model's values, before any torchao rewrite)."""
    gm.meta[RECORD] = {_running_var(n): (n.args[6], n.args[7]) for n in _batch_norms(gm)}


def restore_batch_norms(gm: torch.fx.GraphModule) -> None:
    """Writes each recorded batch norm's momentum and eps back into its
    batch_norm node and into the eps of torchao's QAT conv-bn pattern."""
    record = gm.meta.get(RECORD)
    if not record:
        return
    for n in _batch_norms(gm):
        if _running_var(n) in record:
            momentum, eps = record[_running_var(n)]
            n.args = (*n.args[:6], momentum, eps, *n.args[8:])
    for n in _eps_adds(gm, record):
        n.args = (n.args[0], record[n.args[0].target][1])
    gm.recompile()


def sdpa_dropout_p(node: torch.fx.Node) -> float:
    """The dropout_p of a scaled_dot_product_attention node."""
    return node.kwargs.get("dropout_p", node.args[_SDPA_DROPOUT_P] if len(node.args) > _SDPA_DROPOUT_P else 0.0)


# Uniform draws in [0, 1): floor(keep + draw) is a 0/1 mask that is 1 with probability keep
# (DropPath in transformers and older timm: x.div(keep) * floor(keep + rand)).
UNIFORM_DRAWS = (aten.rand, aten.rand_like, aten.uniform, aten.uniform_)
FLOORS = frozenset((aten.floor.default, aten.floor_.default))
_ADDS = frozenset((aten.add.Tensor, aten.add_.Tensor))


def random_noise(gm: torch.fx.GraphModule) -> tuple[set[torch.fx.Node], set[torch.fx.Node]]:
    """(masks, draws): masks are the nodes computed from Bernoulli draws, or
    from the floor of uniform draws, and scalars only; draws the uniform
    draws and what is computed from them alone before a floor makes a mask.
    A uniform draw used otherwise is not a mask: nothing says that the model
    does not mean it in eval mode."""
    masks, draws = set(), set()
    for n in gm.graph.nodes:
        tensors = [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor) or a.op == "get_attr"]
        packet = getattr(n.target, "overloadpacket", None)
        if n.op == "call_function" and packet in (aten.bernoulli, aten.bernoulli_):
            masks.add(n)
        elif n.op == "call_function" and packet in UNIFORM_DRAWS:
            draws.add(n)
        elif n.target in FLOORS and tensors and all(a in draws for a in tensors):
            masks.add(n)
        elif n.op in ("call_function", "call_module") and tensors and all(a in masks for a in tensors):
            masks.add(n)
        elif n.op in ("call_function", "call_module") and tensors and all(a in draws for a in tensors):
            draws.add(n)
    return masks, draws


def random_masks(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Nodes whose value is a random mask computed from Bernoulli draws, or
    from the floor of uniform draws, and scalars only (stochastic depth's
    mask: empty -> bernoulli_ -> div_, or floor(keep + rand); and a
    fake-quant point on it), not from the model's inputs or parameters."""
    return random_noise(gm)[0]


def floor_mask_keep(mask: torch.fx.Node) -> Optional[float]:
    """keep where `mask` is floor(keep + draw) of one uniform draw and a
    Python number keep (a 0/1 mask, 1 with probability keep), else None."""
    if mask.target not in FLOORS or not isinstance(mask.args[0], torch.fx.Node) or mask.args[0].target not in _ADDS:
        return None
    a, b = mask.args[0].args[:2]
    draw, keep = (a, b) if isinstance(a, torch.fx.Node) else (b, a)
    if not isinstance(draw, torch.fx.Node) or getattr(draw.target, "overloadpacket", None) not in UNIFORM_DRAWS:
        return None
    return float(keep) if isinstance(keep, (int, float)) and not isinstance(keep, bool) else None


def eval_value_of_masked_product(product: torch.fx.Node, masks: set[torch.fx.Node]) -> Optional[torch.fx.Node]:
    """What a product of a tensor with a random mask is in eval mode, where
    it can be told safely, else None:

    - a Bernoulli mask (scaled by 1 / keep or not, as torchvision and timm
      build it): the other factor x, what those modules return in eval mode;
    - a 0/1 mask floor(keep + rand) times x.div(keep) (transformers'
      DropPath): x itself, not x / keep (the scaling sits on the other
      factor). Any other factor with such a mask is left: its eval value is
      not known here."""
    a, b = product.args[:2]
    mask, other = (a, b) if a in masks else (b, a)
    ancestry, todo = set(), [mask]
    while todo:
        n = todo.pop()
        if n not in ancestry:
            ancestry.add(n)
            todo += [i for i in n.all_input_nodes if i in masks]
    if not any(n.target in FLOORS for n in ancestry):
        return other
    keep = floor_mask_keep(mask)
    if (keep is not None and isinstance(other, torch.fx.Node) and other.target is aten.div.Tensor
            and isinstance(other.args[0], torch.fx.Node) and isinstance(other.args[1], (int, float))
            and float(other.args[1]) == keep):
        return other.args[0]
    return None  # a 0/1 mask scaled or transformed otherwise: its eval value is not known here


def masked_products(gm: torch.fx.GraphModule, noise: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """The products of a tensor with a random mask (stochastic depth's x * mask)."""
    return [n for n in gm.graph.nodes
            if n.target in (aten.mul.Tensor, aten.mul_.Tensor) and (n.args[0] in noise) != (n.args[1] in noise)]


def is_eval(gm: torch.nn.Module) -> bool:
    """Whether an exported model was switched to eval mode (by torchao's
    move_exported_model_to_eval or ours: both set torchao's flag, an
    attribute of the GraphModule that copy.deepcopy does not carry; the
    batch norms' record is in `meta`, which it does)."""
    return getattr(gm, _EXPORTED_TRAINING_ATTR, True) is False


def eval_mode_problems(gm: torch.fx.GraphModule) -> list[str]:
    """What `gm` lost of its float model in eval mode: batch norms whose
    momentum or eps differ from the record, and, once switched to eval
    mode, train-only randomness left in the graph."""
    problems = []
    record = gm.meta.get(RECORD) or {}
    for n in _batch_norms(gm):
        want = record.get(_running_var(n))
        if want is not None and (n.args[6], n.args[7]) != want:
            problems.append(f"batch_norm '{n.name}' has momentum {n.args[6]} and eps {n.args[7]}, its module "
                            f"{want[0]} and {want[1]}")
    for n in _eps_adds(gm, record):
        if n.args[1] != record[n.args[0].target][1]:
            problems.append(f"the conv-bn eps '{n.name}' is {n.args[1]}, its module's {record[n.args[0].target][1]}")
    if is_eval(gm):
        problems += [f"'{n.name}' keeps dropout_p {sdpa_dropout_p(n)}" for n in gm.graph.nodes
                     if n.target is SDPA and sdpa_dropout_p(n) != 0]
        problems += [f"dropout '{n.name}' is in train mode" for n in gm.graph.nodes
                     if n.target in DROPOUTS and n.args[2] is True]
        problems += [f"'{n.name}' multiplies by a random mask (stochastic depth)"
                     for n in masked_products(gm, random_masks(gm))]
    return problems


def check_eval_mode(model, where: str) -> None:
    """Raises ValueError, in one line, where an exported model lost its float
    model's batch norm momentum / eps or kept train-only randomness in eval
    mode (torchao's move_exported_model_to_eval does both); other models
    pass unchecked."""
    if not isinstance(model, torch.fx.GraphModule):
        return
    problems = eval_mode_problems(model)
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise ValueError(
            f"{where}: the model differs from its float model in eval mode ({shown}), as torchao's "
            "move_exported_model_to_eval leaves it; call pt2e_fq.move_exported_model_to_eval(model) instead "
            "(it also repairs a model that torchao's switch changed)"
        )
