"""The `pt2e-fq` command (also `python -m pt2e_fq`).

    pt2e-fq demo [--out DIR]
    pt2e-fq quantize --model pkg.module:factory --example-input 1x3x32x32 --preset w8a8
                     [--calib-data batches.pt] [--qat-steps N] [--qat-validation batches.pt] [--qat-loss mse|cosine|kl] [--static-batch] [--out model.pt2] [--onnx model.onnx]
                     [--target fake_quant|generic|xnnpack|x86_inductor] [--pte model.pte]
                     [--unsupported error|keep|float]
    pt2e-fq report model.pt2 [--trusted-module MODULE ...]

A bad argument is a one-line error naming it and what is allowed, with exit
status 2, found before any work where it can be (the output paths too); any
other failure prints one line, its type and the first line of its message
(the traceback with --traceback), with exit status 1. The quantization flow (torchao) and the
demo (scikit-learn) are imported only by the commands that use them.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import os
import re
import sys
import traceback
import zipfile
from pathlib import Path
from typing import Optional, Sequence

from ..export.lowering.qdq import TARGETS, UNSUPPORTED
from ..files import WriteError, check_writable

PROG = "pt2e-fq"
_SHAPE = re.compile(r"^\d+(x\d+)*$")
_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
# torch.load(weights_only=True) refusing a class: "Unsupported global: GLOBAL mymod.Foo was not ..."
_UNSUPPORTED_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)")
# Its other refusals: "Weights only load failed. ... Re-running `torch.load` with `weights_only` set to `False`
# will likely succeed ... WeightsUnpickler error: <the reason>".
_WEIGHTS_UNPICKLER_ERROR = re.compile(r"WeightsUnpickler error:\s*(\S[^\n]*)")


class UsageError(Exception):
    """A bad argument: reported as `pt2e-fq <command>: error: ...`, exit status 2."""


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


FLOAT32_MAX = 3.4028234663852886e38  # the optimizer computes in the parameters' float32


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value <= FLOAT32_MAX:
        raise argparse.ArgumentTypeError(f"expected a number > 0 and at most {FLOAT32_MAX:.4g} (float32), "
                                         f"got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse, whose errors are one line (its own print a usage block
    first); subcommand parsers are of the same class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0].strip() if lines else ""


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Fused fake quantization for the PT2E flow.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--traceback", action="store_true", help="show the Python traceback of a failure")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = commands.add_parser("demo", parents=[common], help="train, quantize (PTQ, QAT), export and check a CNN on the digits data")
    demo.add_argument("--out", default="demo-out", help="folder for the demo's files (default: demo-out)")
    demo.add_argument("--float-epochs", type=_int_at_least(1), default=8, metavar="N",
                      help="epochs of float training (default 8)")
    demo.add_argument("--qat-epochs", type=_int_at_least(1), default=3, metavar="N",
                      help="epochs of QAT (default 3)")
    demo.add_argument("--threads", type=_int_at_least(1), default=1, metavar="N",
                      help="torch threads (default 1: the CNN is tiny, more threads mostly wait for each other)")
    demo.add_argument("--no-deploy", action="store_true",
                      help="leave out the Inductor and ExecuTorch rows (their compilation takes most of a minute)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.add_argument("--learned-ranges", action="store_true",
                      help="also QAT with w4a8, w3a8, w2a8 weights, fixed ranges against learned ones (LSQ)")

    quantize = commands.add_parser("quantize", parents=[common], help="quantize a model of yours and print the per-layer report")
    quantize.add_argument("--model", required=True, metavar="MODULE:FACTORY",
                          help="a callable returning the torch.nn.Module, e.g. mypkg.models:build "
                               "(the current folder is importable)")
    quantize.add_argument("--example-input", required=True, metavar="SHAPES|FILE.pt",
                          help="the inputs' shapes, dims joined by x, inputs by commas (1x3x32x32,1x10), "
                               "random float32; or a .pt file holding a tensor or a tuple of tensors")
    which = quantize.add_mutually_exclusive_group(required=True)
    which.add_argument("--preset", metavar="NAME", help="a preset name, e.g. w8a8, w4a8 or w4a8-dyn (docs/quantizers.md lists them)")
    which.add_argument("--config", metavar="FILE", help="a QuantizerConfig file (.yaml, .yml or .json)")
    quantize.add_argument("--calib-data", metavar="FILE.pt",
                          help="calibration batches: a list of batches (each a tensor or a tuple of tensors), "
                               "or one tensor split into batches of the example's batch size "
                               "(default: the example input)")
    quantize.add_argument("--mixed-budget", type=_positive_float, metavar="BITS",
                          help="with --preset: per layer, the preset's weights, w8a8's (int8 per channel) or "
                               "float, at most BITS average weight bits, chosen by each point's sensitivity on "
                               "the calibration data (quantizers.mixed_precision; docs/quantizers.md)")
    quantize.add_argument("--save-config", metavar="FILE.yaml",
                          help="write the config used (with --mixed-budget: the chosen one) as YAML or JSON")
    quantize.add_argument("--qat-steps", type=_int_at_least(0), default=0, metavar="N",
                          help="QAT steps after calibration, distilling the float model's outputs (default 0: PTQ)")
    quantize.add_argument("--qat-validation", metavar="FILE.pt",
                          help="batches in --calib-data's format that QAT does not train on: its loss is scored on "
                               "them before the first step and after every tenth of the steps, and the best-scored "
                               "state is kept (needs --qat-steps)")
    quantize.add_argument("--lr", type=_positive_float, default=1e-4, help="QAT learning rate (Adam; default 1e-4)")
    quantize.add_argument("--qat-loss", choices=("mse", "cosine", "kl"), default="mse",
                          help="QAT distillation loss on the outputs: mse (default), cosine (embeddings), "
                               "kl (classifier logits, temperature 2)")
    quantize.add_argument("--static-batch", action="store_true",
                          help="export with the example's batch size (default: any batch size), for a model whose "
                               "batch dimension cannot be dynamic; every --calib-data batch must then have it")
    quantize.add_argument("--out", metavar="FILE.pt2", help="save the quantized program (.pt2)")
    quantize.add_argument("--onnx", metavar="FILE.onnx", help="export to ONNX and check it in ONNX Runtime")
    quantize.add_argument("--target", choices=("fake_quant", *TARGETS), default="fake_quant",
                          help="what --out holds: our fake-quant ops (default), or the quantize / dequantize ops "
                               "of a PT2E runtime (generic, xnnpack, x86_inductor: compile it with "
                               "pt2e_fq.export.compile_x86), checked against the fake-quant graph; with "
                               "x86_inductor a --preset leaves matmul and bmm float "
                               "(presets.get_preset(..., target='x86_inductor'))")
    quantize.add_argument("--pte", metavar="FILE.pte",
                          help="export an ExecuTorch program (XNNPACK delegate; needs the executorch extra) "
                               "and check it in ExecuTorch's runtime; with --pte or --target xnnpack a --preset "
                               "goes on every tensor with XNNPACK's fusions (presets.every_point(..., "
                               "target='xnnpack')), as XNNPACK delegates static int8 ops with int8 outputs only; "
                               "a dynamic-activation preset (w4a8-dyn, w8a8-dyn) is taken as it is")
    quantize.add_argument("--unsupported", choices=UNSUPPORTED, default="error",
                          help="a point the target cannot take: an error (default), kept as our op, or, for a "
                               "weight, stored as its fake-quantized floats")
    quantize.add_argument("--no-progress", action="store_true", help="no progress bars")

    report = commands.add_parser("report", parents=[common], help="print the per-layer table of a saved .pt2")
    report.add_argument("path", metavar="FILE.pt2")
    report.add_argument("--example-input", metavar="SHAPES|FILE.pt",
                        help="inputs to run it on, as for quantize (default: the example inputs saved in the file)")
    report.add_argument("--trusted-module", action="append", default=[], metavar="MODULE",
                        help="a module to import if the file names a type of it (pt2e_fq.load's trusted_modules; "
                             "repeatable); importing runs the module's code, so name only modules you trust")
    return parser


# -- argument values ---------------------------------------------------------------


def load_factory(spec: str):
    """`pkg.module:factory` -> the callable (the current folder is importable)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"--model: expected MODULE:FACTORY (e.g. mypkg.models:build), got {spec!r}")
    # importlib would take "..x" as a relative import and fail with a TypeError.
    if not _DOTTED.match(module_name) or not _DOTTED.match(attr):
        raise UsageError(f"--model: expected MODULE:FACTORY, each a dotted Python name (e.g. mypkg.models:build), "
                         f"got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise UsageError(f"--model: cannot import module {module_name!r} ({e})") from None
    except Exception as e:  # the module's own code failed (a syntax error, an exception at import)
        raise UsageError(f"--model: importing {module_name!r} failed: {type(e).__name__}: {_first_line(e)}") from None
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise UsageError(f"--model: module {module_name!r} has no attribute {attr!r}")
    if not callable(factory):
        raise UsageError(f"--model: {spec!r} is a {type(factory).__name__}, not a callable returning a model")
    return factory


def build_model(spec: str):
    import torch

    model = load_factory(spec)()
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"--model: {spec}() returned a {type(model).__name__}, not a torch.nn.Module")
    return model.eval()


def _load_pt(flag: str, path: str):
    import torch

    if not Path(path).is_file():
        raise UsageError(f"{flag}: no such file {path!r}")
    if not _is_torch_file(path):
        raise UsageError(f"{flag}: {path!r} is not a torch file (torch.save writes a zip archive; this file is not "
                         "one, or is damaged); save the inputs with torch.save")
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:  # a class the safe loader refuses, a damaged archive, ...
        # torch's message suggests weights_only=False, which would run code from the file: name what it holds.
        unsupported = _UNSUPPORTED_GLOBAL.search(str(e))
        if unsupported:
            raise UsageError(f"{flag}: {path!r} holds a {unsupported[1]}; the file may hold only tensors, in tuples, "
                             "lists or dicts (it is read with torch.load(weights_only=True), which runs no code "
                             "from it)") from None
        refused = _WEIGHTS_UNPICKLER_ERROR.search(str(e))
        reason = refused[1] if refused else _first_line(e)
        raise UsageError(f"{flag}: cannot load {path!r} with torch.load(weights_only=True), which runs no code from "
                         f"the file: {reason}") from None


def _is_torch_file(path: str) -> bool:
    """What torch.save writes: a zip archive, or in its legacy format
    (_use_new_zipfile_serialization=False) a pickle of its magic number first."""
    import pickle

    import torch.serialization

    if zipfile.is_zipfile(path):
        return True
    legacy = pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=torch.serialization.DEFAULT_PROTOCOL)
    with open(path, "rb") as f:
        return f.read(len(legacy)) == legacy


def _model_args(flag: str, path: str, value) -> tuple:
    """A tensor, or a tuple / list of tensors, as the model's positional arguments."""
    import torch

    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and value and all(isinstance(t, torch.Tensor) for t in value):
        return tuple(value)
    found = type(value).__name__
    if isinstance(value, (tuple, list)):
        found += f" of ({', '.join(type(v).__name__ for v in value)})"
    raise UsageError(f"{flag}: {path!r}: a model input must be a tensor or a tuple of tensors, got {found}")


def example_inputs(text: str) -> tuple:
    """`1x3x32x32,1x10` -> random float32 tensors of those shapes; a .pt file
    -> its tensor, or its tuple / list of tensors."""
    import torch

    if text.endswith(".pt"):
        example = _model_args("--example-input", text, _load_pt("--example-input", text))
        for i, t in enumerate(example):
            if t.numel() == 0:
                raise UsageError(f"--example-input: input {i} of {text!r} is empty (shape {tuple(t.shape)}); "
                                 "every dimension must be >= 1")
        return example
    shapes = text.split(",")
    if not all(_SHAPE.match(s) for s in shapes):
        raise UsageError(f"--example-input: {text!r} is neither a .pt file nor shapes; write dims joined by x "
                         "and inputs separated by commas, e.g. 1x3x32x32 or 8x16,8x4")
    dims = [[int(d) for d in s.split("x")] for s in shapes]
    if any(0 in shape for shape in dims):
        raise UsageError(f"--example-input: {text!r} has a dimension of size 0 (an empty input, nothing to "
                         "calibrate on); every dimension must be >= 1")
    # Checked before allocating: torch would overflow its size computation or
    # ask the allocator for petabytes.
    needed = sum(4 * math.prod(shape) for shape in dims)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed > memory:
        raise UsageError(f"--example-input: {text!r} needs {needed:,} bytes of float32, more than this machine's "
                         f"{memory:,} bytes of memory; give smaller shapes")
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randn(shape, generator=generator) for shape in dims)


def batches_file(path: str, example: tuple, static_batch: bool = False, flag: str = "--calib-data",
                 purpose: str = "calibration") -> list[tuple]:
    """A list of batches, or one tensor split into batches of the example's
    size; with static_batch, every batch has the example's shapes. `flag`
    and `purpose` name the option and its data in the errors."""
    import torch

    value = _load_pt(flag, path)
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise UsageError(f"{flag}: {path!r} holds a 0-dim tensor (one number); expected a tensor whose "
                             "first dimension is the batch, or a list of batches")
        if len(example) != 1:
            raise UsageError(f"{flag}: {path!r} holds one tensor but the model takes {len(example)} inputs; "
                             "save a list of batches, each a tuple of tensors")
        size = example[0].shape[0] if example[0].dim() else 1
        batches = [(b,) for b in value.split(size)]
    else:
        if isinstance(value, tuple):
            value = [value]
        if not isinstance(value, list) or not value:
            raise UsageError(f"{flag}: {path!r} holds a {type(value).__name__}; expected a tensor or a "
                             "non-empty list of batches (each a tensor or a tuple of tensors)")
        batches = [_model_args(flag, path, b) for b in value]
    # The model is exported with a dynamic batch dimension only, or none (--static-batch).
    expected = [((None,) + tuple(t.shape[1:]) if t.dim() and not static_batch else tuple(t.shape), t.dtype)
                for t in example]
    for i, batch in enumerate(batches):
        check_inputs(flag, f"batch {i} of {path!r}", batch, expected)
        if any(t.numel() == 0 for t in batch):
            raise UsageError(f"{flag}: batch {i} of {path!r} is empty (shapes "
                             f"{[tuple(t.shape) for t in batch]}); {purpose} needs at least one sample per batch")
        bad = sum(int((~torch.isfinite(t)).sum()) for t in batch if t.is_floating_point())
        if bad:
            raise UsageError(f"{flag}: batch {i} of {path!r} holds {bad} NaN or infinite value(s); "
                             f"{purpose} data must be finite")
    return batches


# Per positional input: (its shape, None for a dimension of any size; its dtype).
InputSpec = list[tuple[tuple[Optional[int], ...], "torch.dtype"]]


def _describe_inputs(spec: InputSpec) -> str:
    def dims(shape):
        return "(" + ", ".join("any" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"

    return "[" + ", ".join(f"{dims(shape)} {str(dtype).removeprefix('torch.')}" for shape, dtype in spec) + "]"


def check_inputs(flag: str, what: str, given: tuple, expected: InputSpec) -> None:
    """The inputs' count, dtypes and shapes match `expected` (None: any size),
    or a UsageError that shows both."""

    def fits(t, shape, dtype):
        return t.dtype == dtype and t.dim() == len(shape) and all(d is None or d == n for d, n in zip(shape, t.shape))

    if len(given) != len(expected) or not all(fits(t, *e) for t, e in zip(given, expected)):
        got = [(tuple(t.shape), t.dtype) for t in given]
        raise UsageError(f"{flag}: {what} has inputs {_describe_inputs(got)}; the model takes "
                         f"{_describe_inputs(expected)}")


def program_inputs(program) -> InputSpec:
    """What a saved program takes: its user inputs' shapes (None for a
    dynamic dimension) and dtypes."""
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    spec = []
    for name in program.graph_signature.user_inputs:
        value = placeholders[name].meta["val"]
        spec.append((tuple(d if isinstance(d, int) else None for d in value.shape), value.dtype))
    return spec


def _plain_preset(args):
    """--preset's config with no target: the preset's QAT form with --qat-steps."""
    from quantizers import presets

    return presets.get_preset(args.preset, qat=getattr(args, "qat_steps", 0) > 0)


def quantizer_config(args):
    from quantizers import ConfigError, QuantizerConfig, presets

    if args.preset:
        if args.preset not in presets.PRESETS:
            raise UsageError(f"--preset: unknown preset {args.preset!r}; allowed: {', '.join(presets.PRESETS)}")
        qat = getattr(args, "qat_steps", 0) > 0  # the preset's QAT form (presets.get_preset)
        xnnpack = getattr(args, "pte", None) or getattr(args, "target", None) == "xnnpack"
        if xnnpack and args.preset in presets.DYNAMIC_ACTIVATION_PRESETS:
            # XNNPACK's dynamically quantized linears have float outputs: the preset as it is.
            return presets.get_preset(args.preset, target="xnnpack", qat=qat)
        if xnnpack:
            # XNNPACK delegates int8 ops with int8 outputs only (docs/export.md): the preset on every
            # tensor, an op's output point after ReLU / clamp only (the activations XNNPACK fuses).
            return presets.every_point(args.preset, target="xnnpack", qat=qat)
        if getattr(args, "target", None) == "x86_inductor":
            # Inductor has no int8 matmul of two activations: matmul and bmm float (docs/export.md).
            return presets.get_preset(args.preset, target="x86_inductor", qat=qat)
        return _plain_preset(args)
    if not Path(args.config).is_file():
        raise UsageError(f"--config: no such file {args.config!r}")
    try:
        return QuantizerConfig.load(args.config)
    except ConfigError as e:
        raise UsageError(f"--config: {args.config}: {e}") from None
    except Exception as e:  # YAML / JSON syntax
        raise UsageError(f"--config: cannot read {args.config!r}: {_syntax_error(e)}") from None


def _syntax_error(error: Exception) -> str:
    """A YAML error on one line (PyYAML's spans several: the context, a
    quoted excerpt, a caret); any other error's first line."""
    import yaml

    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        context = f" ({error.context})" if error.context else ""
        return f"{error.problem} at line {mark.line + 1}, column {mark.column + 1}{context}"
    return _first_line(error)


def _check_output(flag: str, path: Optional[str], suffix: str) -> None:
    """An output file's name and place, checked before any work."""
    if path is None:
        return
    if not path.endswith(suffix):
        raise UsageError(f"{flag}: expected a {suffix} file name, got {path!r}")
    try:
        check_writable(path)
    except WriteError as e:
        raise UsageError(f"{flag}: {e}") from None


# -- commands ---------------------------------------------------------------------


def _quiet() -> None:
    """Known noise of the libraries under the commands: torch.onnx's notes
    on a missing torchvision, torch's pytree deprecation (copying a
    GraphModule), torch.export's graph dumps."""
    import warnings

    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    # A model torch.export cannot export makes it log the whole graph before
    # it raises; the error itself says what failed. A filter, not a level:
    # torch's logging set-up resets this logger's level when it loads.
    logging.getLogger("torch.fx.experimental.symbolic_shapes").addFilter(lambda r: r.levelno >= logging.ERROR)
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)


def cmd_demo(args) -> int:
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out: {args.out!r} is a file; give a folder for the demo's files (created if missing)")
    from . import demo

    demo.run(args.out, float_epochs=args.float_epochs, qat_epochs=args.qat_epochs, threads=args.threads,
             progress=not args.no_progress, deploy=not args.no_deploy, learned_ranges=args.learned_ranges)
    return 0


def cmd_quantize(args) -> int:
    _check_output("--out", args.out, ".pt2")
    _check_output("--onnx", args.onnx, ".onnx")
    _check_output("--pte", args.pte, ".pte")
    if args.pte:
        from ..export.lowering.executorch import require_executorch

        try:
            require_executorch()
        except ImportError as e:
            raise UsageError(f"--pte: {e}") from None
        if args.unsupported == "keep":
            raise UsageError("--pte: --unsupported keep leaves pt2e_fq ops, which ExecuTorch cannot run; "
                             "allowed with --pte: error, float")
    if args.mixed_budget is not None and not args.preset:
        raise UsageError("--mixed-budget: give the base format with --preset (e.g. --preset w4a8)")
    if args.save_config and not args.save_config.endswith((".yaml", ".yml", ".json")):
        raise UsageError(f"--save-config: expected a .yaml, .yml or .json file name, got {args.save_config!r}")
    _check_output("--save-config", args.save_config, Path(args.save_config or "").suffix)
    if args.qat_validation and not args.qat_steps:
        raise UsageError("--qat-validation: it scores QAT; give --qat-steps N (N > 0) with it")
    example = example_inputs(args.example_input)
    from . import pipeline

    if not args.static_batch and pipeline.batch_of_one(example):
        raise UsageError(f"--example-input: {pipeline.BATCH_OF_ONE}, or add --static-batch for a program of the "
                         "example's shapes")
    config = quantizer_config(args)
    calibration = batches_file(args.calib_data, example, args.static_batch) if args.calib_data else None
    validation = (batches_file(args.qat_validation, example, args.static_batch, "--qat-validation", "validation")
                  if args.qat_validation else None)
    model = build_model(args.model)
    import torch

    with torch.no_grad():
        try:
            model(*example)
        except Exception as e:
            raise UsageError(f"--example-input: the model fails on inputs of shapes "
                             f"{[tuple(t.shape) for t in example]}: {type(e).__name__}: {_first_line(e)}") from None
    from ..export import check_lowered, check_onnx, save, to_executorch, to_onnx, to_qdq
    from ..report import report

    if args.mixed_budget is not None:
        config = _mixed_config(args, model, example, calibration or [example])
    if args.save_config:
        config.save(args.save_config)
        print(f"saved {args.save_config}")
    try:
        # A plain preset goes by its name: pipeline.quantize then runs its defaults (int8 edges, calib algorithms).
        how = args.preset if args.preset and args.mixed_budget is None and config == _plain_preset(args) else config
        converted = pipeline.quantize(model, example, how, calibration=calibration, qat_steps=args.qat_steps,
                                      lr=args.lr, loss=args.qat_loss, validation=validation,
                                      temperature=2.0 if args.qat_loss == "kl" else 1.0, progress=not args.no_progress, dynamic_batch=not args.static_batch)
    except pipeline.ExportError as e:
        raise UsageError(f"--model: {e}") from None
    except pipeline.TrainingDiverged as e:
        raise UsageError(f"--lr: QAT diverged ({e}) at --lr {args.lr:g}; give a smaller --lr") from None
    report(converted, example, file=sys.stdout)
    # The files take any batch size, or the example's with --static-batch.
    batch = None if args.static_batch else pipeline.batch_dynamic_shapes(example)
    if args.out:
        program = converted
        if args.target != "fake_quant":
            program = to_qdq(converted, example, dynamic_shapes=batch, target=args.target,
                             unsupported=args.unsupported)
        save(program, example, args.out, dynamic_shapes=batch)
        print(f"saved {args.out} ({Path(args.out).stat().st_size:,} bytes); load it with pt2e_fq.load")
        if args.target != "fake_quant":
            check = check_lowered(program, converted, example)
            print(f"{args.target} q/dq program against the fake-quant graph:\n{check}")
            _check_passed(check, f"the {args.target} q/dq program in {args.out}")
    if args.onnx:
        to_onnx(converted, example, args.onnx, dynamic_shapes=batch)
        check = check_onnx(args.onnx, converted, example)
        print(f"saved {args.onnx} ({Path(args.onnx).stat().st_size:,} bytes); ONNX Runtime: {check.points} points "
              f"bit-exact, outputs within {check.max_abs_diff_optimized:.3g} (one step: {check.tolerance:.3g})")
    if args.pte:
        # ExecuTorch plans its memory for the example's shapes: the .pte takes that batch size.
        result = to_executorch(converted, example, args.pte, unsupported=args.unsupported)
        print(f"saved {result}")
        check = check_lowered(args.pte, converted, example)
        print(f"ExecuTorch against the fake-quant graph:\n{check}")
        _check_passed(check, f"the ExecuTorch program {args.pte}")
    return 0


def _mixed_config(args, model, example, calibration):
    """--mixed-budget: the sensitivity table and the chosen config."""
    from quantizers import mixed_precision

    from . import pipeline

    candidates = tuple(dict.fromkeys((args.preset, "w8a8")))
    measured = mixed_precision.sensitivity(pipeline.export(model, example, dynamic_batch=not args.static_batch),
                                           calibration, calibration, candidates, progress=not args.no_progress)
    print(f"sensitivity: each point alone quantized, output SQNR on the calibration data\n{measured.table()}\n")
    try:
        chosen = mixed_precision.mixed_precision(measured, args.mixed_budget)
    except ValueError as e:
        raise UsageError(f"--mixed-budget: {e}") from None
    print(f"mixed precision within {args.mixed_budget:g} bits per weight\n{chosen.table()}\n")
    return chosen.config


class CheckFailed(Exception):
    """A written file computes other values than the fake-quant graph:
    reported as one line, exit status 1."""


def _check_passed(check, what: str) -> None:
    problems = check.problems()
    if problems:
        raise CheckFailed(f"{what} differs from the fake-quant graph: {'; '.join(problems)} (the file is written; "
                          "the table above has each output)")


def cmd_report(args) -> int:
    if not args.path.endswith(".pt2"):
        raise UsageError(f"FILE.pt2: expected a .pt2 file name, got {args.path!r}")
    if not Path(args.path).is_file():
        raise UsageError(f"no such file {args.path!r}")
    for module in args.trusted_module:
        if not _DOTTED.match(module):
            raise UsageError(f"--trusted-module: {module!r} is not a module name; give an exact dotted name "
                             "such as mypackage.outputs")
    example = example_inputs(args.example_input) if args.example_input else None
    from ..export import UnsafeArchiveError, UntrustedModuleError, load
    from ..report import report

    if not zipfile.is_zipfile(args.path):
        raise UsageError(f"{args.path!r} is not a .pt2 archive (torch.export.save writes a zip file)")
    export_log = logging.getLogger("torch.export")
    level = export_log.level
    export_log.setLevel(logging.CRITICAL)  # torch.export.load logs a traceback before it raises
    try:
        program = load(args.path, trusted_modules=args.trusted_module)
    except UntrustedModuleError as e:
        raise UsageError(f"{args.path!r} takes or returns a {e.type_name}, whose module {e.module!r} is not "
                         f"trusted, so it was not imported; if you trust it, add --trusted-module {e.module}") from None
    except UnsafeArchiveError as e:
        raise UsageError(f"{args.path!r}: {e.member} {e.what}, which loading would run as code, so the file was not "
                         "loaded") from None
    except Exception as e:  # not a torch.export archive, or from another torch
        raise UsageError(f"cannot load {args.path!r} as a torch.export program: "
                         f"{type(e).__name__}: {_first_line(e)}") from None
    finally:
        export_log.setLevel(level)
    if example is not None:
        check_inputs("--example-input", "the example", example, program_inputs(program))
    report(program, example, file=sys.stdout)
    return 0


COMMANDS = {"demo": cmd_demo, "quantize": cmd_quantize, "report": cmd_report}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)  # exits 2 with a usage message on a bad argument
    _quiet()
    try:
        return COMMANDS[args.command](args)
    except UsageError as e:
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (WriteError, CheckFailed) as e:  # its message names the file and the reason; the type adds nothing
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001  (a message, not a traceback; --traceback shows it)
        if args.traceback:
            traceback.print_exc()
        else:
            print(f"{PROG} {args.command}: error: {type(e).__name__}: {_first_line(e)} (--traceback for details)",
                  file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
