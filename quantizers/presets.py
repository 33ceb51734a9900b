"""Preset QuantizerConfigs.

Weight granularity axes are in the (out, in, ...) layout of linear and conv
weights (the quantizer swaps axes 0 and 1 for conv_transpose): PerChannel(0)
is one scale per output channel, PerGroup(n, axis=1) groups n consecutive
input channels (on a conv weight with fewer input channels than n, a group
also spans kernel positions: quantizers/plan.py). Weight points use CurrentMinMaxObserver: qparams follow the
current weights (right for PTQ and for QAT, where the weights move). Static
integer activation points use HistogramObserver for calibration: it clips
the outliers whose range would cost more rounding error than their
clipping does (on the model zoo it is what brings w8a8 to or above
torchao's X86InductorQuantizer, which uses a histogram observer too; with
min-max ranges ViT is 0.7 dB below it, docs/quantizers.md). QAT runs the
observers at every training step, where a histogram search per point and
step would cost more than the step: `get_preset(name, qat=True)`, which
the QAT flows use, gives the same preset with MinMaxObserver on those
points (the fused observe op). Float formats' static points (NVFP4's
global scale) keep MinMaxObserver. Bias stays in float.

| preset | weights | activations |
| w8a8   | int8 per channel, symmetric narrow | int8 per tensor, asymmetric, static (histogram) |
| w4a8   | int4 per group of 32, symmetric no-clip | int8 per tensor, asymmetric, static (histogram) |
| w4a16  | int4 per group of 32, asymmetric MINVAL | float |
| w8a16  | int8 per group of 128, symmetric narrow | float |
| fp8    | fp8 E4M3 per channel               | fp8 E4M3 per tensor, dynamic |
| mxfp8  | MXFP8 E4M3 (blocks of 32, E8M0 scales) | MXFP8 E4M3, dynamic |
| mxfp4  | MXFP4 (blocks of 32, E8M0 scales)  | MXFP4, dynamic |
| nvfp4  | NVFP4 (blocks of 16, E4M3 scales, per-tensor global scale) | NVFP4, static global scale |
| w4a8-dyn | int4 per group of 32, symmetric (bfloat16 scales with target "xnnpack") | int8 per token, asymmetric, dynamic (linears only) |
| w8a8-dyn | int8 per channel, symmetric | int8 per token, asymmetric, dynamic (linears only) |

The `-dyn` presets are the LLM deployment layout of ExecuTorch's XNNPACK
("8da4w", "8da8w"): activations quantized per token at run time, as
XNNPACK's dynamically quantized linear does, and the weights and the
activations' qparams computed as torchao's QAT (`Int8DynamicActivation-
IntxWeightConfig`) computes them, so QAT here trains what torchao's trains.
They quantize every linear (an lm_head too; linear, addmm and einsum with a
weight) and nothing else: a matmul of two activations (attention) and convs
stay float, as in torchao's 8da4w; XNNPACK's dynamically quantized ops take
a static weight. No int8 edges and no post-training algorithms: the
one-call form quantizes them round-to-nearest.

`get_preset("w4a8-dyn", target="xnnpack")` rounds the int4 group scales to
bfloat16 (QSpec.scale_dtype), as ExecuTorch's XNNPACK delegate stores
them, so the .pte applies the scales the model trained and calibrated
with; plain `get_preset("w4a8-dyn")` keeps fp32 scales, which the other
runtimes (ONNX's blocked DequantizeLinear, torchao's int4 kernels) store
as they are. w8a8-dyn's per-channel scales are fp32 in XNNPACK too.

On a convolutional network the 4-bit presets' one-call form
(pt2e_fq.cli.pipeline.quantize) keeps the layers 4 bits cannot carry at
int8 per-channel weights, as deployed int4 models do: the first conv, the
depthwise convs and the classifier (the last linear), with `int8_edges`
(nvfp4's at FP8 E4M3 weights and activations), and it runs the
post-training algorithms of PTQ_ALGORITHMS (pt2e_fq.calib: activation-weight
equalisation, for w8a8 output-aware ranges of the int8 activation points,
GPTQ rounding, bias correction) between calibration and
convert, then, on a convolutional network, those of CNN_PTQ_ALGORITHMS (the
whole model's mean output error removed layer by layer). docs/quantizers.md,
"Trained models", shows what they do.

MX and NVFP4 blocks run along the reduction dimension: a linear or matmul
input's last axis, a conv input's channel axis (axis 1, hence the op-type
entries for convolutions).

What a preset quantizes (docs/quantizers.md, "What the presets quantize"):
the inputs and weights of the ops that compute on them (linear, conv,
matmul, addmm, einsum), as int8 / fp8 kernels read them, and nothing else.
No op's output gets a point of its own: where another computing op reads it,
that op's input point quantizes it (one point either way); elsewhere
(a residual add, softmax, a norm, the logits) a kernel writes it at higher
precision. add, mul, cat and stack stay float: a residual stream, RMSNorm's
`x * rsqrt(...)` and a concatenation of a parameter-derived token (ViT's
class token) with activations each lose most of their signal on one
per-tensor grid. Embedding tables are lookups, not compute: the weight-only
presets (w4a16, w8a16) quantize them for memory, the others leave them float,
as torchao's XNNPACK and X86 quantizers do.
"""

from __future__ import annotations

import torch

from pt2e_fq import (
    FP8_E4M3,
    INT4,
    INT8,
    MXFP4,
    MXFP8_E4M3,
    NVFP4,
    CurrentMinMaxObserver,
    HistogramObserver,
    PerChannel,
    PerGroup,
    PerTensor,
    PerToken,
    QSpec,
)
from pt2e_fq.export.lowering.qdq import XNNPACK_FUSED_ACTIVATIONS
from pt2e_fq.spec.format_kinds import INTEGER, MX, kind_of

from .config import OpConfig, QuantizerConfig
from .patterns import CONV_OPS, OP_TYPES

_WEIGHT_OBSERVER = CurrentMinMaxObserver()
_INT8_ACT = QSpec(INT8, PerTensor(), "asymmetric", observer=HistogramObserver())
_INT8_ACT_QAT = QSpec(INT8, PerTensor(), "asymmetric")  # MinMaxObserver
# Ops whose tensors no preset quantizes (see the module doc).
_FLOAT_OP_TYPES = ("add", "mul", "cat", "stack")


def _compute_inputs_only(config: QuantizerConfig) -> QuantizerConfig:
    """The policy of the module doc on a config whose op configs have no
    output_activation: add, mul, cat, stack float, and embeddings float
    where activations are quantized."""
    for op_type in _FLOAT_OP_TYPES:
        config.set_operator_type(op_type, None)
    if config.global_config.input_activation is not None:
        config.set_operator_type("embedding", None)
    return config


def _int_config(weight: QSpec, activation=None) -> QuantizerConfig:
    return _compute_inputs_only(QuantizerConfig(OpConfig(input_activation=activation, weight=weight)))


def _block_config(fmt, activation_dynamic: bool) -> QuantizerConfig:
    """MX / NVFP4: the format's blocks along the reduction axis of every op."""

    def spec(axis, dynamic, observer=None):
        return QSpec(fmt, PerGroup(fmt.scale_block, axis), dynamic=dynamic, observer=observer)

    # MX: the kernel scales every block (nothing to observe); NVFP4: an observed global scale.
    weight_dynamic = kind_of(fmt) is MX
    weight = spec(1, weight_dynamic, None if weight_dynamic else _WEIGHT_OBSERVER)
    config = QuantizerConfig(OpConfig(spec(-1, activation_dynamic), weight))
    conv = OpConfig(spec(1, activation_dynamic), weight)
    for op_type in CONV_OPS:
        config.set_operator_type(op_type, conv)
    return _compute_inputs_only(config)


# The -dyn presets' activations (module doc): int8 per token, asymmetric, from the live tensor.
_INT8_PER_TOKEN_ACT = QSpec(INT8, PerToken(), "asymmetric", dynamic=True)
# Presets whose activations are dynamic per token: XNNPACK runs their linears as dynamically
# quantized linears with float outputs, so get_preset(name, target="xnnpack") takes them as they are.
DYNAMIC_ACTIVATION_PRESETS = ("w4a8-dyn", "w8a8-dyn")
# Op types the -dyn presets quantize: the linear forms (quantizers/patterns.py).
_LINEAR_OP_TYPES = ("linear", "addmm", "einsum")


def _linear_only_config(weight: QSpec, activation: QSpec) -> QuantizerConfig:
    """Every linear form at (activation, weight); every other op type float."""
    config = QuantizerConfig(OpConfig(input_activation=activation, weight=weight))
    for op_type in OP_TYPES:
        if op_type not in _LINEAR_OP_TYPES:
            config.set_operator_type(op_type, None)
    return config


def _presets(int8_activation: QSpec) -> dict[str, QuantizerConfig]:
    fp8_act = QSpec(FP8_E4M3, PerTensor(), dynamic=True)
    return {
        "w8a8": _int_config(QSpec(INT8, PerChannel(0), "symmetric_narrow", observer=_WEIGHT_OBSERVER), int8_activation),
        "w4a8": _int_config(QSpec(INT4, PerGroup(32, 1), "symmetric_no_clip", observer=_WEIGHT_OBSERVER),
                            int8_activation),
        "w4a16": _int_config(QSpec(INT4, PerGroup(32, 1), "asymmetric", "minval", observer=_WEIGHT_OBSERVER)),
        "w8a16": _int_config(QSpec(INT8, PerGroup(128, 1), "symmetric_narrow", observer=_WEIGHT_OBSERVER)),
        "fp8": _int_config(QSpec(FP8_E4M3, PerChannel(0), observer=_WEIGHT_OBSERVER), fp8_act),
        "mxfp8": _block_config(MXFP8_E4M3, activation_dynamic=True),
        "mxfp4": _block_config(MXFP4, activation_dynamic=True),
        "nvfp4": _block_config(NVFP4, activation_dynamic=False),
        "w4a8-dyn": _linear_only_config(QSpec(INT4, PerGroup(32, 1), "symmetric", observer=_WEIGHT_OBSERVER),
                                        _INT8_PER_TOKEN_ACT),
        "w8a8-dyn": _linear_only_config(QSpec(INT8, PerChannel(0), "symmetric", observer=_WEIGHT_OBSERVER),
                                        _INT8_PER_TOKEN_ACT),
    }


PRESETS = _presets(_INT8_ACT)
# The same presets for QAT: MinMaxObserver on the static integer activations (module doc).
_QAT_PRESETS = _presets(_INT8_ACT_QAT)


# pt2e_fq.calib.apply's algorithms that pipeline.quantize runs for a preset (module doc). Not
# mxfp4: GPTQ's updates move MX blocks' maxima, and with them the kernel's power-of-two scales
# (MiniLM: mean cosine 0.928 with round-to-nearest, 0.877 after; docs/quantizers.md).
# Equalisation (calib.equalize) first where it raised MiniLM's cosine (docs/quantizers.md); w8a16 is at
# 0.9999 without it.
PTQ_ALGORITHMS = {name: ("equalization", "gptq", "bias_correction") for name in ("w4a8", "w4a16", "nvfp4")}
PTQ_ALGORITHMS["w8a16"] = ("gptq", "bias_correction")
# w8a8 also searches its int8 activation points' ranges for their layers' output error
# (calib.search_activation_ranges; docs/quantizers.md, "Trained models"). Not w4a8: on
# EfficientNet-Lite0 (quick data) it gave top-1 70.3 % against 71.9 without (one crop in 64),
# KL 0.237 against 0.229, logit SQNR 7.7 against 7.4 dB: no gain. nvfp4's activations are NVFP4
# blocks and FP8 edges, nothing the search takes.
PTQ_ALGORITHMS["w8a8"] = ("equalization", "activation_ranges", "gptq", "bias_correction")
# What pipeline.quantize runs after PTQ_ALGORITHMS' on a convolutional network (is_convolutional):
# pt2e_fq.calib.activation_bias, the mean output error of the whole quantized model (activation
# points included) removed layer by layer (EfficientNet-Lite0 w8a8: docs/quantizers.md, "Trained models").
CNN_PTQ_ALGORITHMS = {name: ("activation_bias",) for name in PTQ_ALGORITHMS}
# Presets whose one-call form keeps a convolutional network's edge layers at int8 weights (int8_edges).
INT8_EDGE_PRESETS = ("w4a8", "w4a16", "nvfp4", "mxfp4")


def is_convolutional(model) -> bool:
    """True when `model` has a torch.nn.Conv2d (the CNN defaults apply:
    int8_edges, CNN_PTQ_ALGORITHMS).

    Args:
        model: a torch.nn.Module.

    Returns:
        Whether any submodule is a Conv2d."""
    import torch

    return any(isinstance(m, torch.nn.Conv2d) for m in model.modules())


def int8_edges(config: QuantizerConfig, model) -> QuantizerConfig:
    """`config` with the first conv, every depthwise conv and the last
    linear (the classifier) of `model` at 8 bits, by module name: int8
    per-channel symmetric weights (w8a8's) with the activations the config
    gives them; for an NVFP4 config, FP8 E4M3 weights per channel and FP8
    E4M3 activations per tensor (the fp8 preset's), the 8-bit format of the
    hardware that runs NVFP4 (NVFP4's 4-bit activations on a depthwise
    conv's input, blocks of 16 channels at one pixel, lose most of it). A
    model without convolutions is left as it is (its last linear is no
    classifier). Changes and returns `config`.

    Args:
        config: the preset's QuantizerConfig.
        model: the float model (module names and conv shapes are read).

    Returns:
        config, changed."""
    import torch

    if not is_convolutional(model):
        return config
    convs = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    names = {convs[0][0]} | {n for n, m in convs if m.groups > 1 and m.groups == m.in_channels}
    names |= set(linears[-1:])
    fp8 = config.global_config.weight is not None and config.global_config.weight.format == NVFP4
    edge = PRESETS["fp8"].global_config if fp8 else None
    weight = edge.weight if fp8 else PRESETS["w8a8"].global_config.weight
    conv_config = config.operator_type.get("conv2d") or config.global_config
    for name in sorted(names):
        is_conv = isinstance(model.get_submodule(name), torch.nn.Conv2d)
        activation = edge.input_activation if fp8 else (conv_config if is_conv else config.global_config).input_activation
        config.set_module_name(name, OpConfig(input_activation=activation, weight=weight))
    return config


TARGETS = ("generic", "xnnpack", "x86_inductor")
# Op types Inductor's x86 int8 kernels (oneDNN qconv / qlinear) have no int8
# form of when both operands are activations, as in attention.
_X86_FLOAT_OP_TYPES = ("matmul", "bmm")


def _check_target(where: str, target: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"{where}: unknown target {target!r}; allowed: {', '.join(TARGETS)}")


def _for_x86_inductor(config: QuantizerConfig) -> QuantizerConfig:
    for op_type in _X86_FLOAT_OP_TYPES:
        config.set_operator_type(op_type, None)
    return config


def _xnnpack_group_scales(config: QuantizerConfig) -> None:
    """Per-group integer weights with bfloat16 scales, in place: ExecuTorch's
    XNNPACK delegate stores the scales of its per-group (int4) weights in
    bfloat16 (pt2e_fq.spec.qparams.SCALE_DTYPES says where), so training
    and calibration see the scales the .pte applies. Per-channel and
    per-tensor scales, which XNNPACK keeps in fp32, stay fp32."""
    import dataclasses

    for section, key, op_config in list(config.op_configs()):
        weight = None if op_config is None else op_config.weight
        if weight is None or kind_of(weight.format) is not INTEGER or not isinstance(weight.granularity, PerGroup):
            continue
        config.replace_op_config(section, key, dataclasses.replace(
            op_config, weight=dataclasses.replace(weight, scale_dtype=torch.bfloat16)))


# Presets whose every point is of an integer format and whose activations are static: those learned
# ranges apply to (learnable_ranges). The dynamic-activation presets' activation qparams come from each
# input, and their lowering to XNNPACK has been checked with observed weight scales only.
LEARNABLE_PRESETS = tuple(name for name, config in PRESETS.items()
                          if name not in DYNAMIC_ACTIVATION_PRESETS and all(kind_of(spec.format) is INTEGER for _, _, c in config.op_configs() if c is not None
                                 for spec in (c.input_activation, c.weight, c.bias, c.output_activation) if spec))


def learnable_ranges(config: QuantizerConfig, where: str = "learnable_ranges") -> QuantizerConfig:
    """`config` with every static point learnable (QSpec(learnable=True):
    LSQ scales; LSQ+ offsets for asymmetric points, a floating zero point
    or MINVAL's minval), in place: weights and static activations; dynamic
    points stay as they are (their qparams follow each input). The observer
    still sets each range at calibration; flow.start_learning_ranges (which
    pt2e_fq.qat.distill calls) hands them to the optimizer.

    Args:
        config: the config to change.
        where: the caller's name, for the error messages.

    Returns:
        `config`.

    Raises:
        ValueError: a static point of a float format (LSQ learns an integer
            grid), or no static point at all; the message names the point.
    """
    import dataclasses

    changed = 0
    for section, key, op_config in list(config.op_configs()):
        if op_config is None:
            continue
        specs = {}
        for role in ("input_activation", "weight", "bias", "output_activation"):
            spec = getattr(op_config, role)
            if spec is None or spec.dynamic or spec.learnable:
                continue
            if kind_of(spec.format) is not INTEGER:
                place = "the global config" if section == "global" else f"{section} {key!r}"
                raise ValueError(f"{where}: the {role} of {place} is {spec.format.name}; learned ranges (LSQ) need "
                                 f"an integer format: use a preset with integer points ({', '.join(LEARNABLE_PRESETS)})")
            specs[role] = dataclasses.replace(spec, learnable=True)
        if specs:
            changed += len(specs)
            config.replace_op_config(section, key, dataclasses.replace(op_config, **specs))
    if not changed:
        raise ValueError(f"{where}: the config has no static point to learn (dynamic points compute their ranges "
                         "from every input)")
    return config


def get_preset(name: str, target: str = "generic", *, qat: bool = False, learnable: bool = False) -> QuantizerConfig:
    """A fresh copy of a preset (safe to change with the setters); with
    `qat`, its QAT form (MinMaxObserver on the static integer activations,
    see the module doc); with `learnable`, its weights and static
    activations learn their ranges in training (learnable_ranges; integer
    presets only: LEARNABLE_PRESETS).

    target (the targets of pt2e_fq.export.to_qdq): "generic", the preset;
    "x86_inductor", the preset with matmul and bmm float: Inductor runs a
    matmul of two activations in float on the dequantized values whatever
    its points, so they only add rounding and kernels, and they keep
    Inductor from fusing attention's matmuls and softmax into its flash
    attention (docs/export.md, Speed). "xnnpack" is an error: XNNPACK runs
    an op in int8 only with its output quantized, which the presets leave
    float; use every_point(name, target="xnnpack"); except for the
    presets of DYNAMIC_ACTIVATION_PRESETS, whose dynamically quantized
    linears XNNPACK runs with float outputs: those come as they are,
    except that per-group integer weights get bfloat16 scales, as XNNPACK
    stores them (QSpec.scale_dtype)."""
    if name not in PRESETS:
        raise ValueError(f"get_preset: unknown preset {name!r}; allowed: {', '.join(PRESETS)}")
    if not isinstance(learnable, bool):
        raise TypeError(f"get_preset: learnable must be a bool, got {learnable!r}")
    if learnable and name in DYNAMIC_ACTIVATION_PRESETS:
        raise ValueError(f"get_preset: learnable=True: preset {name!r} computes its activation qparams from each "
                         f"input (dynamic), and learned ranges need static ones; allowed: {', '.join(LEARNABLE_PRESETS)}")
    if learnable and name not in LEARNABLE_PRESETS:
        raise ValueError(f"get_preset: learnable=True: preset {name!r} has float-format points, and learned ranges "
                         f"(LSQ) need integer ones; allowed: {', '.join(LEARNABLE_PRESETS)}")
    _check_target("get_preset", target)
    if target == "xnnpack" and name not in DYNAMIC_ACTIVATION_PRESETS:
        raise ValueError("get_preset: target 'xnnpack': XNNPACK runs a linear or conv in int8 only with its output "
                         "quantized, and the presets leave outputs float; use "
                         f"presets.every_point({name!r}, target='xnnpack'), or a dynamic-activation preset "
                         f"({', '.join(DYNAMIC_ACTIVATION_PRESETS)})")
    config = QuantizerConfig.from_dict((_QAT_PRESETS if qat else PRESETS)[name].to_dict())
    if learnable:
        learnable_ranges(config, "get_preset")
    if target == "xnnpack":
        _xnnpack_group_scales(config)
    return _for_x86_inductor(config) if target == "x86_inductor" else config


def every_point(name: str, target: str = "generic", *, qat: bool = False) -> QuantizerConfig:
    """A preset's formats on every tensor an op config reaches: each op's
    inputs, weight and output (the preset's input QSpec), add, mul, cat,
    stack and embeddings included, the model's outputs too. The layout
    the PT2E runtimes' int8 ops read and write (XNNPACK has no int8 op with
    a float output); it costs accuracy (docs/quantizers.md).

    target places the output points of fused units for a runtime (the
    targets of pt2e_fq.export.to_qdq):
    - "generic": an op's output point after any activation that follows it
      (linear -> gelu -> point);
    - "xnnpack": after ReLU or a clamp only
      (pt2e_fq.export.XNNPACK_FUSED_ACTIVATIONS), the activations XNNPACK
      fuses into an int8 conv or linear; any other gets the point on the op's
      own output (linear -> point -> gelu), without which XNNPACK runs that
      linear in fp32 (config.set_fuse_activations);
    - "x86_inductor": as generic, with conv -> [bn] -> add -> [relu] and no
      point on the conv's output, as Inductor's fused int8 conv-add reads it
      (config.set_fuse_conv_add), and matmul and bmm float (see get_preset).
    qat: the preset's QAT form (get_preset)."""
    _check_target("every_point", target)
    config = get_preset(name, qat=qat)
    full = lambda c: OpConfig(c.input_activation, c.weight, c.bias, c.input_activation)  # noqa: E731
    result = QuantizerConfig(full(config.global_config), model_output=True, fuse_conv_add=target == "x86_inductor")
    if target == "xnnpack":
        result.set_fuse_activations(XNNPACK_FUSED_ACTIVATIONS)
    for op_type, op_config in config.operator_type.items():
        if op_config is not None:
            result.set_operator_type(op_type, full(op_config))
    return _for_x86_inductor(result) if target == "x86_inductor" else result
