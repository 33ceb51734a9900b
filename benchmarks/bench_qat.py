"""QAT training step: pt2e_fq against torchao's stock FakeQuantize, eager and compiled.

For each model, training steps on the same batch, measured in the same run
and interleaved (one step of each in turn, so load from other processes hits
them alike): the float model; the model prepared for QAT with our quantizer
(w8a8); the same model prepared with the same annotations but torchao's
stock `FakeQuantize` (default moving-average min-max observers, per-channel
for the weights). With --compile (the default on CUDA) each of the three runs
eager and torch.compile'd. Printed per flow: the median step time (zero_grad,
forward, loss, backward, SGD step), its ratio to the float step of the same
mode (eager against eager, compiled against compiled), the graphs
torch.compile made (more than one: graph breaks), and for the eager flows the
bytes of the distinct tensors autograd saves for backward
(`torch.autograd.graph.saved_tensors_hooks`, parameters included) and of
those the fake-quant masks: ours packed 1 bit per element (uint8), torch's
fake-quant ops 1 byte (bool).

    python benchmarks/bench_qat.py [--device cpu|cuda] [--dtype float32|bfloat16] [--models cnn block llama]
                                   [--steps N] [--threads N] [--quick] [--compile | --no-compile]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import warnings

import torch
import torch.nn.functional as F
# bench_ops first: it imports pt2e_fq before torchao (quieter torchao import);
# benchmarks/ is on sys.path when this file runs.
from bench_ops import median_ms, reason, saved_bytes_by_dtype
from tabulate import tabulate
from torch._dynamo.utils import counters

import torchao.quantization.pt2e as tao
from torchao.quantization.pt2e.quantizer import QuantizationSpec
from pt2e_fq.cli import digits, pipeline
from models import EncoderBlock, LlamaDecoder
from quantizers import FakeQuantQuantizer, presets

PRESET = "w8a8"  # what torchao's stock FakeQuantize can express (no int4, no groups)
WARMUP = 3  # steps per run before timing, after the first (which compiles)

# Model sizes per device: on CPU those of the earlier measurements; on CUDA
# large enough that the GPU, not the Python launching its kernels, sets the pace.
SIZES = {
    "cpu": dict(block=dict(batch=16, seq=64, d=256, heads=4, hidden=1024),
                llama=dict(batch=4, seq=64, dim=128, layers=2, heads=4, vocab=1024)),
    "cuda": dict(block=dict(batch=8, seq=256, d=512, heads=8, hidden=2048),
                 llama=dict(batch=8, seq=256, dim=512, layers=4, heads=8, vocab=4096)),
}


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


def _mse(out, target):
    return F.mse_loss(out.float(), target.float())  # the loss in fp32 whatever the model's dtype


def _cross_entropy(out, target):
    return F.cross_entropy(out.flatten(0, -2).float(), target.flatten())


def cases(names, device, dtype):
    """(name, model, input, target, loss) on `device`; floating-point
    parameters, buffers and inputs in `dtype`."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    sizes = SIZES[device]
    if "cnn" in names:
        data = digits.load()
        yield ("demo CNN (digits, batch 64)", digits.DigitsCNN(), data.x_train[:64], data.y_train[:64],
               _cross_entropy)
    if "block" in names:
        s = sizes["block"]
        shape = (s["batch"], s["seq"], s["d"])
        # pre-norm: attention, layer norms, GELU MLP, residuals
        block = EncoderBlock(d=s["d"], heads=s["heads"], hidden=s["hidden"])
        yield (f"transformer block ({'x'.join(map(str, shape))})", block, torch.randn(shape, generator=g),
               torch.randn(shape, generator=g), _mse)
    if "llama" in names:
        s = sizes["llama"]
        decoder = LlamaDecoder(vocab=s["vocab"], dim=s["dim"], layers=s["layers"], heads=s["heads"],
                               max_seq=s["seq"])
        tokens, targets = (torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g) for _ in range(2))
        yield (f"Llama decoder ({s['layers']} layers, d {s['dim']}, vocab {s['vocab']}; "
               f"{s['batch']}x{s['seq']} tokens)", decoder, tokens, targets, _cross_entropy)


def _to(t, device, dtype):
    return t.to(device, dtype) if t.is_floating_point() else t.to(device)


@dataclasses.dataclass
class Run:
    """One flow in one mode: its own copy of the model (compiled or not) and
    an SGD optimizer."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    graphs: str = ""  # the graphs torch.compile made for it

    def step(self, x, target, loss_fn):
        self.optimizer.zero_grad(set_to_none=True)
        loss_fn(self.model(x), target).backward()
        self.optimizer.step()


def new_run(mode, model):
    with warnings.catch_warnings():  # torch's own pytree deprecation, raised by copying a GraphModule
        warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
        model = copy.deepcopy(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return Run(torch.compile(model) if mode == "compiled" else model, optimizer)


def time_flows(flows, modes, x, target, loss_fn, steps, device):
    """Times one training step of every flow (a model, or the reason it
    could not be prepared) in every mode, interleaved. Returns the runs and
    the failures by (flow, mode), and the median step ms by (flow, mode)."""
    runs, failed = {}, {}
    for flow, prepared in flows.items():
        for mode in modes:
            if isinstance(prepared, str):
                failed[flow, mode] = prepared
                continue
            run = new_run(mode, prepared)
            graphs = counters["stats"]["unique_graphs"]
            try:
                run.step(x, target, loss_fn)  # compiles a compiled run, outside the timing
            except Exception as e:
                failed[flow, mode] = reason(e)
                continue
            if mode == "compiled":
                run.graphs = str(counters["stats"]["unique_graphs"] - graphs)
            runs[flow, mode] = run
    ms = dict(zip(runs, median_ms([lambda r=r: r.step(x, target, loss_fn) for r in runs.values()], steps, device,
                                  WARMUP)))
    return runs, failed, ms


def measure(name, model, x, target, loss_fn, *, device, dtype, modes, steps):
    """Rows of the table for one model: every flow in every mode, timed
    interleaved; a flow that fails to prepare or to compile shows why. Also
    the median step ms by (flow, mode) of the flows that ran, for callers
    that compare them (bench_overhead.py's targets)."""
    # Export and prepare the model already on the device and in the dtype:
    # prepare_pt2e places the fake-quant modules on the model's device, and
    # their qparams stay fp32 (casting a prepared model would turn torchao's
    # stock FakeQuantize buffers to bf16; ours keep their dtype).
    model = model.to(device, dtype).train()
    x, target = _to(x, device, dtype), _to(target, device, dtype)
    flows = {"float": model}
    for flow, quantizer in [("pt2e_fq", FakeQuantQuantizer(presets.get_preset(PRESET, qat=True))),
                            ("torchao FakeQuantize", StockFakeQuantQuantizer(presets.get_preset(PRESET, qat=True)))]:
        try:
            prepared = pipeline.prepare(model, (x,), quantizer, qat=True)
            pipeline.calibrate(prepared, [x], progress=False)  # qparams exist before the timed steps
            flows[flow] = prepared
        except Exception as e:  # e.g. torchao's QAT conv-bn rewrite in bf16
            flows[flow] = reason(e)
    # A fresh compile cache per model: the stock FakeQuantize's forward, shared
    # by every instance, would otherwise reach the recompile limit on one model
    # and run eager on the next.
    torch._dynamo.reset()
    runs, failed, ms = time_flows(flows, modes, x, target, loss_fn, steps, device)
    rows = []
    for mode in modes:
        for flow in flows:
            if (flow, mode) in failed:
                rows.append([name, flow, mode, failed[flow, mode]] + [""] * 4)
                continue
            float_ms = ms.get(("float", mode))
            ratio = f"{ms[flow, mode] / float_ms:.2f}x" if float_ms else "n/a"
            run = runs[flow, mode]
            saved = masks = ""
            if mode == "eager":  # the hooks would make torch.compile build another graph
                by_dtype = saved_bytes_by_dtype(lambda inp: loss_fn(run.model(inp), target), x)
                saved = f"{sum(by_dtype.values()):,}"
                masks = f"{by_dtype.get(torch.bool, 0) + by_dtype.get(torch.uint8, 0):,}"
            rows.append([name, flow, mode, f"{ms[flow, mode]:.2f}", ratio, run.graphs, saved, masks])
    return rows, ms


HEADERS = ["model", "flow", "mode", "step ms", "vs float (same mode)", "graphs", "saved for backward, bytes",
           "of which masks (bool, uint8)"]


def environment(device, dtype, steps) -> str:
    where = f"CPU, {torch.get_num_threads()} threads"
    if device == "cuda":
        where = f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
    return (f"QAT training step, {PRESET}, {str(dtype).removeprefix('torch.')}, {where}; torch {torch.__version__}; "
            f"median of {steps} steps")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="of the models' parameters and inputs")
    parser.add_argument("--models", nargs="+", choices=["cnn", "block", "llama"],
                        help="default: cnn block llama on CPU, block llama on CUDA (the CNN's 8x8 images "
                             "only measure kernel launches there)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per flow (median)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--quick", action="store_true", help="5 steps")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        help="also time every flow torch.compile'd (default: on CUDA only; on CPU each "
                             "compilation takes a minute or more)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is available here; nothing measured.")
        return
    steps = 5 if args.quick else args.steps
    dtype = getattr(torch, args.dtype)
    names = args.models or (["block", "llama"] if args.device == "cuda" else ["cnn", "block", "llama"])
    compiled = args.device == "cuda" if args.compile is None else args.compile
    modes = ["eager", "compiled"] if compiled else ["eager"]
    rows = []
    for case in cases(names, args.device, dtype):
        rows += measure(*case, device=args.device, dtype=dtype, modes=modes, steps=steps)[0]
    print(environment(args.device, dtype, steps))
    print(tabulate(rows, headers=HEADERS, tablefmt="github", disable_numparse=True))


if __name__ == "__main__":
    main()
