"""Inference latency on the PT2E runtimes: our lowered int8 models against
float, and against torchao's stock quantizer flow, all in one run.

For a ResNet-style conv net and a transformer encoder block (32 tokens), at
batch 1 and 32 (CPU, float32 inputs), and on request (--models block256)
the same block on 256 tokens, where attention is a larger share:

- float eager; float under Inductor (torch.compile with freezing);
- ours under Inductor int8: PTQ w8a8 with our quantizer,
  presets.get_preset("w8a8", target="x86_inductor"), to_qdq(target=
  "x86_inductor"), compile_x86 (oneDNN qconv / qlinear). That layout puts
  its points where torchao's X86InductorQuantizer does in a transformer
  (inputs and weights of linears; outputs, matmuls and adds float: Inductor
  fuses linear + residual add and matches its flash attention). On the
  encoder blocks also the generic w8a8 preset (points on the matmuls'
  inputs too); on the conv net also presets.every_point("w8a8",
  target="x86_inductor") (fuse_conv_add: conv -> [bn] -> add -> [relu] with
  no point on the conv's output and an int8 add output, which Inductor
  fuses into qconv2d_pointwise.binary);
- stock x86: torchao's X86InductorQuantizer (its default config), the same
  calibration, compiled the same way;
- float .pte (ExecuTorch, XNNPACK fp32); ours .pte (to_executorch, XNNPACK
  int8, quantized with presets.every_point("w8a8", target="xnnpack"):
  XNNPACK delegates an int8 op only with its output quantized, directly or
  after a ReLU or clamp; on the encoder blocks also every_point("w8a8"),
  whose point after the GELU leaves mlp.0 in fp32); stock .pte: XNNPACKQuantizer
  (torchao's copy of ExecuTorch's class, symmetric per-channel), the same
  calibration.

Printed per model and batch: the median latency of one forward, its
speed-up over the float model of the same runtime (Inductor int8 against
float Inductor, .pte int8 against float .pte), and the SQNR of the outputs
against float eager (no labels: random inputs; the accuracy side of the
comparison). The variants of one runtime run in turn within each repeat
(starting at the next one each repeat: bench_ops.median_ms),
so load from other processes hits them alike; the runtimes are timed one
after the other.

    python benchmarks/bench_deploy.py [--models conv block block256] [--batches 1 32] [--repeats N] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings

import torch
import torch.nn as nn
from bench_ops import median_ms
from tabulate import tabulate
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from pt2e_fq.cli import pipeline
from stock_flows import stock_quantizer
from models import EncoderBlock
from pt2e_fq.export import compile_x86, run_pte, to_executorch, to_qdq
from pt2e_fq.report import sqnr_db
from quantizers import presets

CALIBRATION_BATCHES = 4


# Extra variants per model and runtime. Inductor: on the conv net our
# every-point layout with conv-add fusion, where the residual adds are
# quantized as torchao's X86InductorQuantizer quantizes them; on the blocks
# the generic w8a8 preset, whose points on the matmuls' inputs keep Inductor
# from its flash attention. XNNPACK, on the blocks: every_point's generic
# layout, with the point after the GELU.
_GENERIC_PRESET = ("generic preset", lambda: presets.get_preset("w8a8"))
_GENERIC_EVERY_POINT = ("generic every_point", lambda: presets.every_point("w8a8"))
EXTRA_INDUCTOR = {
    "conv": ("every_point + fuse_conv_add", lambda: presets.every_point("w8a8", target="x86_inductor")),
    "block": _GENERIC_PRESET,
    "block256": _GENERIC_PRESET,
}
EXTRA_PTE = {"block": _GENERIC_EVERY_POINT, "block256": _GENERIC_EVERY_POINT}


class BasicBlock(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNetish(nn.Module):
    """A ResNet-18-style net for 3x32x32 images: a stem, three stages of two
    basic blocks (32, 64, 128 channels), global pooling, a classifier."""

    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        blocks, c = [], 32
        for c_out, stride in ((32, 1), (64, 2), (128, 2)):
            blocks += [BasicBlock(c, c_out, stride), BasicBlock(c_out, c_out, 1)]
            c = c_out
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(128, classes)

    def forward(self, x):
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


def _randomize_bn(model):
    """Batch norms with non-trivial statistics, as a trained model has."""
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return model


MODELS = {
    "conv": (lambda: _randomize_bn(ResNetish()), lambda b: (b, 3, 32, 32)),
    "block": (lambda: EncoderBlock(d=128, heads=4, hidden=512), lambda b: (b, 32, 128)),
    "block256": (lambda: EncoderBlock(d=128, heads=4, hidden=512), lambda b: (b, 256, 128)),
}
DEFAULT_MODELS = ["conv", "block"]


def _stock(model, example, calibration, name: str):
    """torchao's stock flow with quantizer `name` (benchmarks.stock_flows's
    default configs), exported at the example's static shape as the
    runtimes take it."""
    prepared = prepare_pt2e(torch.export.export(model, example).module(), stock_quantizer(name))
    for batch in calibration:
        prepared(*batch)
    return convert_pt2e(prepared)


def _pte(program: torch.export.ExportedProgram, path: str) -> str:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    with open(path, "wb") as f:
        f.write(to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch().buffer)
    return path


def _pte_runner(path: str, example: tuple):
    from executorch.runtime import Runtime

    method = Runtime.get().load_program(path).load_method("forward")
    inputs = list(example)
    return lambda: method.execute(inputs)[0]


def _compiled(module, example):
    with torch._inductor.config.patch(freezing=True), torch.no_grad():
        compiled = torch.compile(module)

    def run():
        with torch._inductor.config.patch(freezing=True), torch.no_grad():
            return compiled(*example)

    return run


def bench(name: str, batch: int, repeats: int, folder: str) -> list:
    build, shape = MODELS[name]
    torch.manual_seed(0)
    model = build().eval()
    example = (torch.randn(shape(batch)),)
    calibration = [(torch.randn(shape(batch)),) for _ in range(CALIBRATION_BATCHES)]
    def quantize(config):
        return pipeline.quantize(model, example, config, calibration=calibration, progress=False)

    ours = quantize(presets.get_preset("w8a8", target="x86_inductor"))
    ours_every_point = quantize(presets.every_point("w8a8", target="xnnpack"))
    extra = {k: quantize(v()) for k, v in [EXTRA_INDUCTOR[name]]} if name in EXTRA_INDUCTOR else {}
    extra_pte = {k: quantize(v()) for k, v in [EXTRA_PTE[name]]} if name in EXTRA_PTE else {}
    stock_x86 = _stock(model, example, calibration, "X86InductorQuantizer")
    stock_xnn = _stock(model, example, calibration, "XNNPACKQuantizer")
    tag = f"{name}_b{batch}"

    def ours_x86(converted):
        def build_fn(ex):
            compiled = compile_x86(to_qdq(converted, ex, target="x86_inductor"))
            return lambda: compiled(*ex)

        return build_fn

    # Each variant gets its own copy of the inputs: the stock x86 flow's
    # compiled encoder block writes into its input (measured), which gave
    # every variant timed after it another input.
    builders = {
        "float eager": ("", lambda ex: lambda: model(*ex)),
        "float Inductor": ("Inductor", lambda ex: _compiled(model, ex)),
        "ours Inductor int8": ("Inductor", ours_x86(ours)),
        **{f"ours Inductor int8, {k}": ("Inductor", ours_x86(v)) for k, v in extra.items()},
        "stock x86 Inductor int8": ("Inductor", lambda ex: _compiled(torch.export.export(stock_x86, ex).module(), ex)),
        "float .pte (XNNPACK)": (".pte", lambda ex: _pte_runner(_pte(torch.export.export(model, ex),
                                                                      os.path.join(folder, f"{tag}_float.pte")), ex)),
        "ours .pte (XNNPACK int8)": (".pte", lambda ex: _pte_runner(
            to_executorch(ours_every_point, ex, os.path.join(folder, f"{tag}_ours.pte")).path, ex)),
        **{f"ours .pte (XNNPACK int8), {k}": (".pte", (lambda v: lambda ex: _pte_runner(
            to_executorch(v, ex, os.path.join(folder, f"{tag}_ours_extra.pte")).path, ex))(v))
           for k, v in extra_pte.items()},
        "stock .pte (XNNPACKQuantizer)": (".pte", lambda ex: _pte_runner(
            _pte(torch.export.export(stock_xnn, ex), os.path.join(folder, f"{tag}_stock.pte")), ex)),
    }
    variants, failed = {}, {}
    for k, (runtime, build_fn) in builders.items():
        try:
            variants[k] = (runtime, build_fn(tuple(t.clone() for t in example)))
        except Exception as e:  # a variant that cannot be built is a row saying why, not a lost run
            failed[k] = f"failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:90]}"
    with torch.no_grad():
        reference = model(*example)
        sqnr = {k: sqnr_db(reference, fn()) for k, (_, fn) in variants.items()}
        # Each runtime's variants are timed together, one runtime after the
        # other: XNNPACK's worker threads and Inductor's OpenMP threads would
        # otherwise compete for the same cores within a repeat.
        ms = {}
        for runtime in dict.fromkeys(r for r, _ in variants.values()):
            names = [k for k, (r, _) in variants.items() if r == runtime]
            ms.update(zip(names, median_ms([variants[k][1] for k in names], repeats, "cpu")))
    float_of = {"": "float eager", "Inductor": "float Inductor", ".pte": "float .pte (XNNPACK)"}
    rows = []
    for k, (runtime, _) in builders.items():
        if k in failed:
            rows.append([name, batch, k, failed[k], "", ""])
            continue
        base = ms.get(float_of[runtime])
        rows.append([name, batch, k, f"{ms[k]:.3f}", "" if base is None else f"{base / ms[k]:.2f}x",
                     f"{sqnr[k]:.1f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=DEFAULT_MODELS)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            for batch in args.batches:
                rows += bench(name, batch, args.repeats, folder)
    print(f"torch {torch.__version__}, {args.threads} thread(s); median of {args.repeats} runs; "
          "speed-up against the float model of the same runtime; SQNR against float eager")
    print(tabulate(rows, headers=["model", "batch", "variant", "ms", "speed-up", "SQNR dB"]))


if __name__ == "__main__":
    main()
