"""QAT training step: pt2e_fq against torchao's stock FakeQuantize.

For each model, three training steps on the same batch, measured in the same
run and interleaved (one step of each in turn, so load from other processes
hits them alike): the float model; the model prepared for QAT with our
quantizer (w8a8); the same model prepared with the same annotations but
torchao's stock `FakeQuantize` (default moving-average min-max observers,
per-channel for the weights). Printed per flow: the median step time
(zero_grad, forward, loss, backward, SGD step), its ratio to the float step,
the bytes of the distinct tensors autograd saves for backward
(`torch.autograd.graph.saved_tensors_hooks`, parameters included), and of
those the fake-quant masks: ours packed 1 bit per element (uint8), torch's
fake-quant ops 1 byte (bool).

    python benchmarks/bench_qat.py [--steps N] [--threads N] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import torchao.quantization.pt2e as tao
from bench_ops import saved_bytes_by_dtype  # benchmarks/ is on sys.path when this file runs
from tabulate import tabulate
from torchao.quantization.pt2e.quantizer import QuantizationSpec

from pt2e_fq import digits, pipeline
from pt2e_fq.step_time import step_times
from quantizers import FakeQuantQuantizer, presets

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from quantizer_models import EncoderBlock  # noqa: E402  (the quantizer tests' transformer block)

PRESET = "w8a8"  # what torchao's stock FakeQuantize can express (no int4, no groups)


class StockFakeQuantQuantizer(FakeQuantQuantizer):
    """Our quantizer's annotations with torchao's stock FakeQuantize at every
    point: the same points, the same dtype / range / qscheme."""

    def annotate(self, model):
        super().annotate(model)
        for node in model.graph.nodes:
            ann = node.meta.get("quantization_annotation")
            if ann is None:
                continue
            ann.input_qspec_map = {k: _stock(v) for k, v in ann.input_qspec_map.items()}
            ann.output_qspec = _stock(ann.output_qspec)
        return model

    def validate(self, model):
        pass


def _stock(spec):
    if not isinstance(spec, QuantizationSpec):
        return spec  # None, SharedQuantizationSpec
    per_channel = spec.qscheme in (torch.per_channel_symmetric, torch.per_channel_affine)
    observer = tao.MovingAveragePerChannelMinMaxObserver if per_channel else tao.MovingAverageMinMaxObserver
    return dataclasses.replace(spec, observer_or_fake_quant_ctr=tao.FakeQuantize.with_args(observer=observer))


def cases():
    """(name, model, input, target, loss)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    data = digits.load()
    yield ("demo CNN (digits, batch 64)", digits.DigitsCNN(), data.x_train[:64], data.y_train[:64], F.cross_entropy)
    x = torch.randn(16, 64, 256, generator=g)
    block = EncoderBlock(d=256, heads=4, hidden=1024)  # pre-norm: attention, layer norms, GELU MLP, residuals
    yield ("transformer block (16x64x256)", block, x, torch.randn(16, 64, 256, generator=g), F.mse_loss)


def measure(name, model, x, target, loss_fn, steps):
    flows = {"float": model.train()}
    for flow, quantizer in [("pt2e_fq", FakeQuantQuantizer(presets.get_preset(PRESET))),
                            ("torchao FakeQuantize", StockFakeQuantQuantizer(presets.get_preset(PRESET)))]:
        prepared = pipeline.prepare(model, (x,), quantizer, qat=True)
        pipeline.calibrate(prepared, [x], progress=False)  # qparams exist before the timed steps
        flows[flow] = prepared
    ms = step_times(flows, (x,), target, loss_fn, steps=steps)
    rows = []
    for flow, m in flows.items():
        saved = saved_bytes_by_dtype(lambda inp: loss_fn(m(inp), target), x)
        total, masks = sum(saved.values()), saved.get(torch.bool, 0) + saved.get(torch.uint8, 0)
        rows.append([name, flow, f"{ms[flow]:.2f}", f"{ms[flow] / ms['float']:.2f}x", f"{total:,}", f"{masks:,}"])
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per flow (median)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--quick", action="store_true", help="5 steps")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = 5 if args.quick else args.steps
    rows = []
    for case in cases():
        rows += measure(*case, steps=steps)
    print(f"QAT training step, {PRESET}, {torch.get_num_threads()} threads, median of {steps} steps")
    print(tabulate(rows, headers=["model", "flow", "step ms", "vs float", "saved for backward, bytes",
                                  "of which masks (bool, uint8)"], tablefmt="github"))


if __name__ == "__main__":
    main()
