"""Per-call overhead of the fused op: against ATen from 128 to 4M elements, and in a QAT step.

One run, every ratio measured side by side (the implementations compared take
turns within every repeat, so load from other processes hits them alike):

1. per call, x fp32 of 128 to 4M elements, int8 per-tensor and per-channel
   (axis 0): our op through its public wrapper, our op as the bare
   `torch.ops.pt2e_fq` call (the difference is the wrapper's cost), and
   ATen's `torch.fake_quantize_per_tensor_affine` /
   `torch.fake_quantize_per_channel_affine`; forward under `no_grad`, forward
   with x requiring grad (the autograd node is built, no backward), forward
   plus `y.backward(dy)`;
2. one FakeQuantize module in QAT mode (observer and fake quant on, per-tensor
   int8, moving-average min-max observer): ours against torchao's stock
   FakeQuantize, where the observer's per-step cost shows;
3. with --compile: our forward against the same math as an Inductor-compiled
   composite (bench_ops.affine_composite: div, round, clamp, mul, a
   straight-through mask), int8 per-tensor, per-channel, per-group 32 and
   int4 per-group 32;
4. bench_qat's QAT step (demo CNN, transformer block, Llama decoder; float,
   ours, torchao's stock FakeQuantize), eager and, with --compile, compiled;

then the issue's targets, each met or not.

    python benchmarks/bench_overhead.py [--threads N] [--repeats N] [--quick] [--compile | --no-compile]
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

# bench_qat imports bench_ops first, which imports pt2e_fq before torchao
# (quieter torchao import); benchmarks/ is on sys.path when this file runs.
import bench_qat
from bench_ops import (GROUP, INT4, INT8, affine_composite, affine_qparams, median_ms, ours_affine, per_block,
                       per_channel, per_tensor, reason)
from tabulate import tabulate

import pt2e_fq
import torchao
import torchao.quantization.pt2e as tao

# (rows, cols): 128, 1K, 16K, 256K, 1M and 4M elements.
SIZES = [(8, 16), (32, 32), (128, 128), (512, 512), (1024, 1024), (2048, 2048)]
QUICK_SIZES = [(8, 16), (128, 128), (512, 512)]
MODULE_SHAPES = [(8, 16), (64, 256), (1024, 1024)]
COMPOSITE_SHAPES = [(64, 256), (1024, 1024), (2048, 2048)]
# A timed sample loops over calls until it lasts about this long: a call on
# 128 elements takes microseconds, near the clock's and the loop's own cost.
SAMPLE_MS = 1.0
LARGE = 256 * 1024  # from here forward+backward must be 2x ATen's
MODES = ["fwd, grad off", "fwd, grad on", "fwd+bwd"]


def raw_affine(x, p):
    """Our op as the bare torch.ops call: no argument checks, no wrapper."""
    return torch.ops.pt2e_fq.fake_quantize_affine.default(x, p["block_size"], p["scale"], p["zero_point"],
                                                          p["qmin"], p["qmax"], None)[0]


def aten_per_tensor(p):
    """ATen's op, its qparams shaped once here: bench_ops' callables reshape
    them at every call, views that would add to ATen's per-call time."""
    scale, zero_point = p["scale"].reshape(()), p["zero_point"].reshape(())
    return lambda x, _: torch.fake_quantize_per_tensor_affine(x, scale, zero_point, p["qmin"], p["qmax"])


def aten_per_channel(p):
    scale, zero_point = p["scale"].reshape(-1), p["zero_point"].reshape(-1)
    return lambda x, _: torch.fake_quantize_per_channel_affine(x, scale, zero_point, 0, p["qmin"], p["qmax"])


# name, block size of x, ATen's op for the qparams
PER_CALL_CASES = [("int8 per-tensor", per_tensor, aten_per_tensor),
                  ("int8 per-channel (axis 0)", per_channel, aten_per_channel)]
IMPLS = ["pt2e_fq wrapper", "pt2e_fq raw op", "ATen"]


def step_fns(fn, x, p):
    """fn's three steps (MODES) on x, as callables."""
    xg, dy = x.detach().requires_grad_(), torch.randn_like(x)

    def fwd_grad_off():
        with torch.no_grad():
            fn(x, p)

    def fwd_bwd():
        xg.grad = None
        fn(xg, p).backward(dy)

    return [fwd_grad_off, lambda: fn(xg, p), fwd_bwd]


def looped(fn, n):
    if n == 1:
        return fn

    def loop():
        for _ in range(n):
            fn()

    return loop


def calls_per_sample(fns) -> int:
    """Calls per timed sample: enough for the fastest of fns to take SAMPLE_MS."""
    fastest = math.inf
    for fn in fns:
        fn()
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            fastest = min(fastest, (time.perf_counter() - t0) * 1e3)
    return max(1, math.ceil(SAMPLE_MS / fastest))


def per_call_us(impls, repeats) -> list[list[float]]:
    """Median µs of one call of every impl's steps: [impl][mode]. Every step
    of every impl is timed in one median_ms, interleaved; a mode's sample
    loops the same number of calls for every impl."""
    steps = [step_fns(*impl) for impl in impls]
    counts = [calls_per_sample([s[m] for s in steps]) for m in range(len(MODES))]
    ms = iter(median_ms([looped(s[m], counts[m]) for s in steps for m in range(len(MODES))], repeats, "cpu"))
    return [[next(ms) * 1e3 / counts[m] for m in range(len(MODES))] for _ in steps]


def per_call(sizes, repeats):
    """{(case, shape): [impl][mode] µs} for IMPLS."""
    times = {}
    for name, block, aten in PER_CALL_CASES:
        for shape in sizes:
            x = torch.randn(shape)
            p = affine_qparams(x, block(x), INT8)
            times[name, shape] = per_call_us([(ours_affine, x, p), (raw_affine, x, p), (aten(p), x, p)], repeats)
    return times


def numel(shape) -> int:
    return math.prod(shape)


def size_label(shape) -> str:
    n = numel(shape)
    count = f"{n // 2**20}M" if n >= 2**20 else f"{n // 2**10}K" if n >= 2**10 else str(n)
    return f"{shape[0]}x{shape[1]} ({count})"


def per_call_rows(times):
    rows = []
    for (name, shape), by_impl in times.items():
        aten = by_impl[IMPLS.index("ATen")]
        for impl, us in zip(IMPLS, by_impl):
            ratios = [""] * len(MODES) if impl == "ATen" else [f"{a / t:.2f}x" for a, t in zip(aten, us)]
            rows.append([name, size_label(shape), impl] + [f"{t:.1f}" for t in us] + ratios)
    return rows


PER_CALL_HEADERS = (["case", "x (elements)", "impl"] + [f"{m} µs" for m in MODES]
                    + [f"ATen / it, {m}" for m in MODES])


# ---------------------------------------------------------------------------
# The FakeQuantize module


def fake_quantize_modules():
    """Ours and torchao's stock FakeQuantize for the same point: per-tensor
    int8, asymmetric, moving-average min-max (the stock module's observer,
    as bench_qat's stock flow gives it for activations)."""
    qspec = pt2e_fq.QSpec(pt2e_fq.INT8, pt2e_fq.PerTensor(), "asymmetric",
                          observer=pt2e_fq.MovingAverageMinMaxObserver())
    spec = qspec.to_quantization_spec()
    stock = tao.FakeQuantize(observer=tao.MovingAverageMinMaxObserver, dtype=spec.dtype, quant_min=spec.quant_min,
                             quant_max=spec.quant_max, qscheme=spec.qscheme)
    return {"pt2e_fq FakeQuantize": pt2e_fq.FakeQuantize(qspec), "torchao FakeQuantize": stock}


def module_times(shapes, repeats):
    """{shape: {impl: (fwd grad off, fwd+bwd) µs}}, both modules in QAT mode
    (observer on: every call updates the range and the qparams). median_ms's
    warm-up calls calibrate them before the timing."""
    times = {}
    for shape in shapes:
        x = torch.randn(shape)
        modules = fake_quantize_modules()
        steps = [step_fns(lambda t, _, m=m: m(t), x, None) for m in modules.values()]
        fns = [[s[MODES.index("fwd, grad off")], s[MODES.index("fwd+bwd")]] for s in steps]
        counts = [calls_per_sample([f[k] for f in fns]) for k in range(2)]
        ms = iter(median_ms([looped(f[k], counts[k]) for f in fns for k in range(2)], repeats, "cpu"))
        times[shape] = {name: [next(ms) * 1e3 / counts[k] for k in range(2)] for name in modules}
    return times


def module_rows(times):
    rows = []
    for shape, by_impl in times.items():
        stock = by_impl["torchao FakeQuantize"]
        for name, us in by_impl.items():
            ratios = [f"{s / t:.2f}x" for s, t in zip(stock, us)] if name != "torchao FakeQuantize" else ["", ""]
            rows.append([size_label(shape), name, f"{us[0]:.1f}", f"{us[1]:.1f}"] + ratios)
    return rows


MODULE_HEADERS = ["x (elements)", "module (QAT mode)", "fwd, grad off µs", "fwd+bwd µs", "torchao / it, fwd",
                  "torchao / it, fwd+bwd"]


# ---------------------------------------------------------------------------
# Our forward against the compiled composite


COMPOSITE_CASES = [("int8 per-tensor", per_tensor, INT8), ("int8 per-channel (axis 0)", per_channel, INT8),
                   (f"int8 per-group {GROUP}", per_block, INT8), (f"int4 per-group {GROUP}", per_block, INT4)]


def composite_times(shapes, repeats):
    """{(case, shape): (ours µs, compiled composite µs or why it failed)},
    forward under no_grad, fp32. Compiled afresh per case and shape
    (dynamic=False, as bench_ops), before the timing."""
    times = {}
    for name, block, qrange in COMPOSITE_CASES:
        for shape in shapes:
            x = torch.randn(shape)
            p = affine_qparams(x, block(x), qrange)
            torch._dynamo.reset()
            compiled = torch.compile(affine_composite, dynamic=False)
            fns = [step_fns(fn, x, p)[MODES.index("fwd, grad off")] for fn in (ours_affine, compiled)]
            failed = None
            try:
                fns[1]()  # compiles, outside the timing
            except Exception as e:
                failed, fns = reason(e), fns[:1]
            n = calls_per_sample(fns)
            us = [t * 1e3 / n for t in median_ms([looped(f, n) for f in fns], repeats, "cpu")]
            times[name, shape] = (us[0], failed or us[1])
    return times


def composite_rows(times):
    rows = []
    for (name, shape), (ours, theirs) in times.items():
        if isinstance(theirs, str):
            rows.append([name, size_label(shape), f"{ours:.1f}", theirs, ""])
        else:
            rows.append([name, size_label(shape), f"{ours:.1f}", f"{theirs:.1f}", f"{theirs / ours:.2f}x"])
    return rows


COMPOSITE_HEADERS = ["case (fp32)", "x (elements)", "pt2e_fq fwd µs", "torch.compile'd composite fwd µs",
                     "composite / pt2e_fq"]


# ---------------------------------------------------------------------------
# The QAT step


def qat_steps(modes, steps):
    """bench_qat's rows for its three models on CPU, fp32, and the median step
    ms by (model key, flow, mode)."""
    rows, ms = [], {}
    keys = ["cnn", "block", "llama"]
    for key, case in zip(keys, bench_qat.cases(keys, "cpu", torch.float32)):
        model_rows, model_ms = bench_qat.measure(*case, device="cpu", dtype=torch.float32, modes=modes, steps=steps)
        rows += model_rows
        ms.update({(key, flow, mode): t for (flow, mode), t in model_ms.items()})
    return rows, ms


# ---------------------------------------------------------------------------
# Targets


def verdict(ok: bool) -> str:
    return "yes" if ok else "no"


def per_call_targets(times):
    """The issue's per-call targets, through the public wrapper (the raw op's
    figure beside, for where the time goes)."""
    rows = []
    wrapper, raw, aten = range(len(IMPLS))  # IMPLS's order
    off, fwd_bwd = MODES.index("fwd, grad off"), MODES.index("fwd+bwd")
    for name, _, _ in PER_CALL_CASES:
        sizes = [shape for (case, shape) in times if case == name]
        smallest = min(sizes, key=numel)
        if numel(smallest) == 128:
            t = times[name, smallest]
            ratio = t[wrapper][off] / t[aten][off]
            rows.append([name, "fwd, grad off, 128 elements: <= 1.5x ATen's time",
                         f"{ratio:.2f}x (raw op {t[raw][off] / t[aten][off]:.2f}x)", verdict(ratio <= 1.5)])
        for what, bound, chosen in [("every size", 1.0, sizes),
                                    (f"from {LARGE // 1024}K elements", 2.0, [s for s in sizes if numel(s) >= LARGE])]:
            if not chosen:
                continue
            speedups = {s: times[name, s][aten][fwd_bwd] / times[name, s][wrapper][fwd_bwd] for s in chosen}
            worst = min(speedups, key=speedups.get)
            rows.append([name, f"fwd+bwd, {what}: >= {bound:g}x ATen's speed",
                         f"{speedups[worst]:.2f}x (lowest, at {size_label(worst)})", verdict(speedups[worst] >= bound)])
    return rows


def composite_targets(times):
    rows = []
    for name, _, _ in COMPOSITE_CASES:
        ratios = {s: theirs / ours for (case, s), (ours, theirs) in times.items()
                  if case == name and not isinstance(theirs, str)}
        if not ratios:
            continue
        worst = min(ratios, key=ratios.get)
        rows.append([name, "fwd at least as fast as the compiled composite",
                     f"{ratios[worst]:.2f}x (lowest, at {size_label(worst)})", verdict(ratios[worst] >= 1.0)])
    return rows


# (model key, the flow compared, its bound as a fraction of the reference's step)
QAT_TARGETS = [("cnn", "float", 1.4), ("cnn", "torchao FakeQuantize", 0.75), ("block", "float", 1.15)]
QAT_NAMES = {"cnn": "demo CNN QAT step", "block": "transformer block QAT step"}


def qat_targets(ms, modes):
    rows = []
    for key, reference, bound in QAT_TARGETS:
        for mode in modes:
            ours, theirs = ms.get((key, "pt2e_fq", mode)), ms.get((key, reference, mode))
            target = f"<= {bound}x the {reference} step"
            if ours is None or theirs is None:
                rows.append([f"{QAT_NAMES[key]}, {mode}", target, "n/a (a flow did not run)", "no"])
                continue
            ratio = ours / theirs
            rows.append([f"{QAT_NAMES[key]}, {mode}", target, f"{ratio:.2f}x", verdict(ratio <= bound)])
    return rows


TARGET_HEADERS = ["what", "target", "measured", "met"]


# ---------------------------------------------------------------------------


def table(title, rows, headers):
    print(f"\n{title}")
    print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch.set_num_threads (default 1: the issue's figures are one thread)")
    parser.add_argument("--repeats", type=int, default=30,
                        help="timed samples per measurement (median), and QAT steps per flow")
    parser.add_argument("--quick", action="store_true",
                        help=f"{', '.join(size_label(s) for s in QUICK_SIZES)} only, 5 repeats, no compile")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="the compiled composite and the compiled QAT flows (default: on, off with --quick; "
                             "the compilations take a few minutes on CPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    repeats = 5 if args.quick else args.repeats
    compiled = not args.quick if args.compile is None else args.compile
    sizes = QUICK_SIZES if args.quick else SIZES
    print(f"CPU, {torch.get_num_threads()} threads; torch {torch.__version__}, torchao {torchao.__version__}; "
          f"median of {repeats}; x fp32; load average {os.getloadavg()[0]:.2f} at the start")

    times = per_call(sizes, repeats)
    table("Per call, our op against ATen's (the ATen / it columns: ATen's time over the row's; > 1: faster "
          "than ATen)", per_call_rows(times), PER_CALL_HEADERS)
    modules = module_times(MODULE_SHAPES[:2] if args.quick else MODULE_SHAPES, repeats)
    table("One FakeQuantize module, QAT mode (observer on), int8 per-tensor, moving-average min-max",
          module_rows(modules), MODULE_HEADERS)
    composites = {}
    if compiled:
        composites = composite_times(COMPOSITE_SHAPES, repeats)
        table("Forward (grad off): our op against the Inductor-compiled composite of the same math",
              composite_rows(composites), COMPOSITE_HEADERS)
    modes = ["eager", "compiled"] if compiled else ["eager"]
    qat_rows, qat_ms = qat_steps(modes, repeats)
    table(f"QAT training step ({bench_qat.PRESET}; bench_qat.py's table)", qat_rows, bench_qat.HEADERS)

    targets = per_call_targets(times) + composite_targets(composites) + qat_targets(qat_ms, modes)
    table(f"Targets (load average {os.getloadavg()[0]:.2f} at the end)", targets, TARGET_HEADERS)


if __name__ == "__main__":
    main()
