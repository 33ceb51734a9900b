"""QAT training step under w4a8-dyn against torchao's own 8da4w QAT, eager and compiled.

For each model (bench_qat.py's transformer block and Llama decoder, at its
sizes per device), training steps on the same batch, measured in the same
run and interleaved: the float model; the model prepared for QAT through
the stock PT2E flow (torch.export, prepare_qat_pt2e with our quantizer,
presets.get_preset("w4a8-dyn", qat=True)); the float model under torchao's
8da4w QAT (`quantize_(model, QATConfig(Int8DynamicActivationIntxWeightConfig(
weight_dtype=torch.int4, weight_granularity=PerGroup(32),
weight_mapping_type=MappingType.SYMMETRIC), step="prepare"))`: int8
per-token asymmetric activations and int4 per-group-32 symmetric weights on
every linear, the same points). Printed per flow: the median step time
(zero_grad, forward, loss, backward, SGD step), its ratio to the float step
and to torchao's 8da4w step of the same mode, and the graphs torch.compile
made (more than one: graph breaks).

    python benchmarks/bench_qat_8da4w.py [--device cpu|cuda] [--models block llama] [--steps N]
                                         [--threads N] [--quick] [--compile | --no-compile]
"""

from __future__ import annotations

import argparse
import copy

import torch
# bench_qat first (through bench_ops it imports pt2e_fq before torchao); benchmarks/ is on sys.path.
from bench_qat import _to, cases, time_flows
from bench_ops import reason
from tabulate import tabulate

import torchao
from torchao.quantization import Int8DynamicActivationIntxWeightConfig, MappingType, PerGroup, quantize_
from torchao.quantization.qat import QATConfig
from pt2e_fq.cli import pipeline

PRESET = "w4a8-dyn"
THEIRS = "torchao 8da4w QAT"


def torchao_8da4w(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` under torchao's 8da4w QAT (its fake quantizers on every linear)."""
    model = copy.deepcopy(model)
    quantize_(model, QATConfig(Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4, weight_granularity=PerGroup(32), weight_mapping_type=MappingType.SYMMETRIC),
        step="prepare"))
    return model


def measure(name, model, x, target, loss_fn, *, device, modes, steps):
    """Rows of the table for one model: every flow in every mode, timed interleaved."""
    model = model.to(device).train()
    x, target = _to(x, device, torch.float32), _to(target, device, torch.float32)
    flows = {"float": model}
    for flow, build in [(f"pt2e_fq {PRESET}", lambda: pipeline.prepare(model, (x,), PRESET, qat=True)),
                        (THEIRS, lambda: torchao_8da4w(model))]:
        try:
            flows[flow] = build()
        except Exception as e:
            flows[flow] = reason(e)
    torch._dynamo.reset()
    runs, failed, ms = time_flows(flows, modes, x, target, loss_fn, steps, device)
    rows = []
    for mode in modes:
        for flow in flows:
            if (flow, mode) in failed:
                rows.append([name, flow, mode, failed[flow, mode], "", "", ""])
                continue
            ratio = lambda other: f"{ms[flow, mode] / ms[other, mode]:.2f}x" if (other, mode) in ms else "n/a"  # noqa: E731
            rows.append([name, flow, mode, f"{ms[flow, mode]:.2f}", ratio("float"), ratio(THEIRS),
                         runs[flow, mode].graphs])
    return rows


HEADERS = ["model", "flow", "mode", "step ms", "vs float", f"vs {THEIRS}", "graphs"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--models", nargs="+", choices=["block", "llama"], default=["block", "llama"])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per flow (median)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--quick", action="store_true", help="5 steps")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="also time every flow torch.compile'd (default on)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is available here; nothing measured.")
        return
    steps = 5 if args.quick else args.steps
    modes = ["eager", "compiled"] if args.compile else ["eager"]
    rows = []
    for case in cases(args.models, args.device, torch.float32):
        rows += measure(*case, device=args.device, modes=modes, steps=steps)
    where = (f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}" if args.device == "cuda"
             else f"CPU, {torch.get_num_threads()} threads")
    print(f"QAT training step, {PRESET} against torchao's 8da4w QAT, float32, {where}; torch {torch.__version__}, "
          f"torchao {torchao.__version__}; median of {steps} steps")
    print(tabulate(rows, headers=HEADERS, tablefmt="github", disable_numparse=True))


if __name__ == "__main__":
    main()
