"""Benchmark of the fused fake-quant op against the implementations it replaces.

Each case pairs our op with one baseline on the same inputs and prints, per
implementation: forward ms, forward+backward ms (medians), forward GB/s,
the bytes autograd saves for backward, and our speed-up over the baseline
measured in the same run. Cases: integer affine against ATen and torchao;
FP8 against the eager torch composite; MXFP4 and NVFP4 against torchao's
Python quantize-dequantize. Add a case by appending to CASES.

    python benchmarks/bench_ops.py [--device cpu|cuda] [--repeats N] [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from tabulate import tabulate
from torchao.quantization.quant_primitives import _fake_quantize_affine

import pt2e_fq
from pt2e_fq.blocks import reduced_shape

SHAPE = (1024, 4096)
INT8 = (-128, 127)
INT4 = (-8, 7)


@dataclass
class Case:
    """One comparison: our op and a baseline on the same inputs.

    make(x) returns the qparams both callables take as their second argument;
    ours(x, qparams) and baseline(x, qparams) return the fake-quantized x."""

    name: str
    baseline_name: str
    make: Callable[[torch.Tensor], dict]
    ours: Callable[[torch.Tensor, dict], torch.Tensor]
    baseline: Callable[[torch.Tensor, dict], torch.Tensor]
    max_repeats: int | None = None  # for baselines that take a second a call


def affine_qparams(x, block_size, qrange):
    """fp32 scales and int32 zero points of shape ceil(x.shape / block_size)."""
    shape = reduced_shape(x.shape, block_size)
    qmin, qmax = qrange
    scale = (x.detach().float().abs().amax() / qmax).expand(shape).contiguous()
    zero_point = torch.zeros(shape, dtype=torch.int32, device=x.device)
    return dict(block_size=list(block_size), scale=scale, zero_point=zero_point, qmin=qmin, qmax=qmax)


def ours(x, p):
    return pt2e_fq.fake_quantize_affine(x, p["block_size"], p["scale"], p["zero_point"], p["qmin"], p["qmax"])


def aten_per_tensor(x, p):
    return torch.fake_quantize_per_tensor_affine(x, p["scale"].reshape(()), p["zero_point"].reshape(()),
                                                 p["qmin"], p["qmax"])


def aten_per_channel(x, p):
    return torch.fake_quantize_per_channel_affine(x, p["scale"].reshape(-1), p["zero_point"].reshape(-1), 0,
                                                  p["qmin"], p["qmax"])


def torchao_affine(x, p):
    return _fake_quantize_affine(x, tuple(p["block_size"]), p["scale"], p["zero_point"], torch.int8,
                                 p["qmin"], p["qmax"])


E4M3, E2M1 = torch.float8_e4m3fn, torch.float4_e2m1fn_x2


def fp8_qparams(x):
    return dict(scale=(x.detach().float().abs().amax() / 448).reshape(()))


def ours_fp8(x, p):
    return pt2e_fq.ops.fake_quantize_float(x, list(x.shape), p["scale"], E4M3)


def torch_fp8_composite(x, p):
    """The eager torch recipe: div, clamp, to(fp8), to(x.dtype), mul."""
    return torch.clamp(x / p["scale"], -448.0, 448.0).to(E4M3).to(x.dtype) * p["scale"]


def straight_through(qdq):
    """torchao's MX / NVFP4 functions are not differentiable: the usual
    x + (qdq(x) - x).detach() saves nothing, but also passes the gradient of
    clamped elements (ours saves the 1-bit mask and zeroes them)."""
    return lambda x, p: x + (qdq(x.detach()) - x).detach()


def torchao_mxfp4(x):
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    scale, data = to_mx(x, E2M1, 32)
    return to_dtype(data, scale, E2M1, 32, x.dtype)


def torchao_nvfp4(x):
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    global_scale = per_tensor_amax_to_scale(x.abs().amax())
    return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=global_scale).dequantize(x.dtype)


CASES = [
    Case("per-tensor int8", "torch.fake_quantize_per_tensor_affine",
         lambda x: affine_qparams(x, x.shape, INT8), ours, aten_per_tensor),
    Case("per-channel int8 (axis 0)", "torch.fake_quantize_per_channel_affine",
         lambda x: affine_qparams(x, (1, x.shape[1]), INT8), ours, aten_per_channel),
    Case("per-group 32 int4", "torchao _fake_quantize_affine",
         lambda x: affine_qparams(x, (1, 32), INT4), ours, torchao_affine),
    Case("FP8 E4M3 per-tensor", "torch composite (div, clamp, to fp8, to x.dtype, mul)",
         fp8_qparams, ours_fp8, torch_fp8_composite),
    Case("MXFP4 (E2M1, block 32)", "torchao to_mx / to_dtype",
         lambda x: {}, lambda x, p: pt2e_fq.ops.fake_quantize_mx(x, E2M1), straight_through(torchao_mxfp4),
         max_repeats=3),
    Case("NVFP4 (block 16)", "torchao NVFP4Tensor",
         lambda x: {}, lambda x, p: pt2e_fq.ops.fake_quantize_nvfp4(x), straight_through(torchao_nvfp4),
         max_repeats=5),
]


# ---------------------------------------------------------------------------
# Measurement


def median_ms(fns, repeats: int, sync) -> list[float]:
    """Median milliseconds of each callable. The callables take turns within
    every repeat, so load from other processes hits them alike."""
    for fn in fns:  # warm-up: allocator, lazy init
        fn()
        fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, t in zip(fns, times):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) * 1e3 for t in times]


def saved_bytes_by_dtype(fn, x) -> dict:
    """Bytes of the distinct tensors autograd saves for backward, per dtype."""
    seen = {}

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape))
        seen[key] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x.detach().requires_grad_())
    by_dtype = {}
    for (_, _, dtype, _), n in seen.items():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + n
    return by_dtype


def saved_bytes(fn, x) -> int:
    """Bytes of the distinct tensors autograd saves for backward."""
    return sum(saved_bytes_by_dtype(fn, x).values())


def timed_steps(fn, x, p):
    """The forward and the forward+backward step of fn on x, as callables."""
    dy = torch.randn_like(x)
    xg = x.detach().requires_grad_()

    def forward():
        with torch.no_grad():
            fn(x, p)

    def forward_backward():
        xg.grad = None
        fn(xg, p).backward(dy)

    return [forward, forward_backward]


def measure(impls, x, p, repeats, sync):
    """Per implementation: (forward ms, forward+backward ms, forward GB/s,
    saved bytes), or a string saying why it cannot run on x."""
    steps, results = [], []
    for fn in impls:
        try:
            fn(x.detach().requires_grad_(), p).sum().backward()
            steps.append(timed_steps(fn, x, p))
            results.append(saved_bytes(lambda t: fn(t, p), x))
        except Exception as e:  # a baseline that does not take this dtype
            results.append(f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:60]}")
    times = iter(median_ms([s for pair in steps for s in pair], repeats, sync))
    out = []
    for r in results:
        if isinstance(r, str):
            out.append(r)
            continue
        fwd, fwd_bwd = next(times), next(times)
        # Forward traffic: x read and y written (qparams and masks not counted).
        gbps = 2 * x.numel() * x.element_size() / (fwd * 1e-3) / 1e9
        out.append((fwd, fwd_bwd, gbps, r))
    return out


def run(device: str, dtypes, repeats: int):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for dtype in dtypes:
        x = torch.randn(SHAPE, device=device).to(dtype)
        for case in CASES:
            p = case.make(x)
            n = min(repeats, case.max_repeats or repeats)
            mine, base = measure([case.ours, case.baseline], x, p, n, sync)
            rows.append(row(case.name, "pt2e_fq", dtype, mine, x.numel(), base))
            rows.append(row(case.name, case.baseline_name, dtype, base, x.numel()))
    return rows


def row(case, impl, dtype, m, numel, baseline=None):
    dt = str(dtype).removeprefix("torch.")
    if isinstance(m, str):
        return [case, impl, dt, m, "", "", "", ""]
    fwd, fwd_bwd, gbps, saved = m
    speedup = ""
    if isinstance(baseline, str):
        speedup = "n/a"
    elif baseline is not None:
        speedup = f"{baseline[0] / fwd:.2f}x / {baseline[1] / fwd_bwd:.2f}x"
    return [case, impl, dt, f"{fwd:.2f}", f"{fwd_bwd:.2f}", f"{gbps:.1f}",
            f"{saved:,} ({saved / numel:.3g}/elem)", speedup]


HEADERS = ["case", "impl", "dtype", "fwd ms", "fwd+bwd ms", "fwd GB/s", "saved for bwd, bytes",
           "our speed-up (fwd / fwd+bwd)"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--repeats", type=int, default=20, help="timed runs per measurement (median)")
    ap.add_argument("--quick", action="store_true", help="3 repeats, fp32 only")
    ap.add_argument("--threads", type=int, help="CPU threads (default: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is available here; nothing measured.")
        return
    repeats = 3 if args.quick else args.repeats
    dtypes = [torch.float32] if args.quick else [torch.float32, torch.bfloat16]
    rows = run(args.device, dtypes, repeats)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"x: {SHAPE[0]}x{SHAPE[1]} on {where}; torch {torch.__version__}; median of {repeats} runs")
    print(tabulate(rows, headers=HEADERS, tablefmt="github", disable_numparse=True))


if __name__ == "__main__":
    main()
