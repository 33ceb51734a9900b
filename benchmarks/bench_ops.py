"""Benchmark of the fused fake-quant op against the implementations it replaces.

For every case (integer per-tensor, per-channel and per-block; learnable
integer ranges, LSQ+, per-tensor and per-channel; FP8 per-tensor and
per-channel; MXFP8, MXFP4, NVFP4), in fp32 and bf16, our op and every
baseline that applies run on the same x and qparams, interleaved within each
repeat. Baselines: ATen's fake-quant ops (and its learnable ones, whose
backward also gives d scale and d zero point, as ours, and torchao's
prototype range learning), torchao's Python paths, the eager
torch composite, and (with --compile, the default on CUDA) the same math as a
torch.compile'd composite; --baselines aten keeps ATen's alone. On CUDA our op
also runs with its previous kernels (PT2E_FQ_CUDA_KERNELS=previous: one
16-byte vector a lane, one thread a block for MX / NVFP4 blocks along an
outer axis), so one run times both. Printed: the environment; one table with, per
implementation, forward and forward+backward ms (medians), effective GB/s and
its fraction of the device-to-device copy bandwidth measured in the same run,
the bytes autograd saves for backward, and our speed-up over each baseline;
then a table of targets, each pass or miss. Add a case by appending to CASES.

    python benchmarks/bench_ops.py [--device cpu|cuda] [--shape ROWSxCOLS] [--dtype float32|bfloat16]
                                   [--repeats N] [--quick] [--threads N] [--compile | --no-compile]
                                   [--only TEXT] [--baselines all|aten] [--previous-kernels | --no-previous-kernels]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

import pt2e_fq  # before torchao: it quiets torchao's import-time log lines about its C++ libraries
import pt2e_fq.reference
import torchao
from tabulate import tabulate
from torchao.quantization.qat import IntxFakeQuantizeConfig, initialize_fake_quantizers
from torchao.quantization.qat.fake_quantizer import IntxFakeQuantizer
from torchao.quantization.quant_primitives import _fake_quantize_affine

# On CUDA x must be far larger than the L2 cache (50 MB on an H100) for GB/s
# to measure DRAM bandwidth; on CPU the size of the earlier measurements.
DEFAULT_SHAPE = {"cuda": (8192, 8192), "cpu": (1024, 4096)}
GROUP = 32  # per-block cases: groups of 32 along the last axis
INT8 = (-128, 127)
INT4 = (-8, 7)
E4M3, E2M1 = torch.float8_e4m3fn, torch.float4_e2m1fn_x2
E4M3_MAX = 448.0


@dataclass
class Baseline:
    """An implementation our op replaces. fn(x, qparams) returns the
    fake-quantized x. compiled: fn is torch.compile'd afresh for every case
    and dtype. target: the forward+backward speed-up our op must reach over
    it (None: no target)."""

    name: str
    fn: Callable[[torch.Tensor, dict], torch.Tensor]
    compiled: bool = False
    target: Optional[float] = None


@dataclass
class Case:
    """One format and granularity: make(x) returns the qparams every
    implementation takes as its second argument; ours(x, qparams) is our op.
    copy_fraction: the fraction of copy bandwidth our forward must reach
    (None: no forward target, the forward is another case's kernel).
    cpu_max_repeats: for baselines that take a second a call on CPU."""

    name: str
    make: Callable[[torch.Tensor], dict]
    ours: Callable[[torch.Tensor, dict], torch.Tensor]
    baselines: list[Baseline]
    copy_fraction: Optional[float]
    cpu_max_repeats: Optional[int] = None


# ---------------------------------------------------------------------------
# Qparams and our op


def _blocks(t: torch.Tensor, block_size) -> torch.Tensor:
    """2-D t viewed as (rows/b0, b0, cols/b1, b1), so that a qparam of shape
    (rows/b0, cols/b1), viewed by _per_block, broadcasts over its blocks
    without being expanded in memory."""
    (r, c), (b0, b1) = t.shape, block_size
    return t.reshape(r // b0, b0, c // b1, b1)


def _per_block(q: torch.Tensor) -> torch.Tensor:
    return q.reshape(q.shape[0], 1, q.shape[1], 1)


def _block_amax(x, block_size) -> torch.Tensor:
    return _blocks(x.detach().float(), block_size).abs().amax(dim=(1, 3))


def affine_qparams(x, block_size, qrange):
    """Symmetric: fp32 scales amax / qmax per block and int32 zero points,
    of shape ceil(x.shape / block_size)."""
    qmin, qmax = qrange
    scale = _block_amax(x, block_size) / qmax
    zero_point = torch.zeros_like(scale, dtype=torch.int32)
    return dict(block_size=list(block_size), scale=scale, zero_point=zero_point, qmin=qmin, qmax=qmax)


def fp8_qparams(x, block_size):
    """fp32 scales amax / 448 per block."""
    return dict(block_size=list(block_size), scale=_block_amax(x, block_size) / E4M3_MAX)


def ours_affine(x, p):
    return pt2e_fq.fake_quantize_affine(x, p["block_size"], p["scale"], p["zero_point"], p["qmin"], p["qmax"])


def ours_fp8(x, p):
    return pt2e_fq.ops.fake_quantize_float(x, p["block_size"], p["scale"], E4M3)


def learnable_qparams(x, block_size, qrange):
    """affine_qparams as leaves that require grad, the zero point fp32 (LSQ+
    learns it: both our op and torch's differentiate it), and LSQ's
    grad_factor for torch's op (ours computes it: grad_factor None; every
    block here is full, so it is one number)."""
    p = affine_qparams(x, block_size, qrange)
    p["scale"] = p["scale"].requires_grad_()
    p["zero_point"] = p["zero_point"].float().requires_grad_()
    factors = pt2e_fq.reference.lsq_grad_factors(x.shape, block_size, qrange[1]).unique()
    assert factors.numel() == 1, "a ragged block: torch's learnable ops take one grad_factor"
    p["grad_factor"] = float(factors)
    return p


def ours_learnable(x, p):
    return pt2e_fq.ops.fake_quantize_affine_learnable(x, p["block_size"], p["scale"], p["zero_point"], p["qmin"],
                                                      p["qmax"])


# ---------------------------------------------------------------------------
# Baselines


def aten_per_tensor(x, p):
    return torch.fake_quantize_per_tensor_affine(x, p["scale"].reshape(()), p["zero_point"].reshape(()),
                                                 p["qmin"], p["qmax"])


def aten_per_channel(x, p):
    return torch.fake_quantize_per_channel_affine(x, p["scale"].reshape(-1), p["zero_point"].reshape(-1), 0,
                                                  p["qmin"], p["qmax"])


def aten_learnable_per_tensor(x, p):
    return torch._fake_quantize_learnable_per_tensor_affine(x, p["scale"].reshape(1), p["zero_point"].reshape(1),
                                                           p["qmin"], p["qmax"], p["grad_factor"])


def aten_learnable_per_channel(x, p):
    return torch._fake_quantize_learnable_per_channel_affine(x, p["scale"].reshape(-1), p["zero_point"].reshape(-1),
                                                            0, p["qmin"], p["qmax"], p["grad_factor"])


def torchao_range_learning(x, p):
    """torchao's prototype range learning: IntxFakeQuantizer per channel,
    asymmetric int4, scale and (fp32) zero point as Parameters, initialised
    on x at first use (its Round is straight through, the rest autograd)."""
    if "torchao_fq" not in p:
        config = IntxFakeQuantizeConfig(torch.int4, granularity="per_channel", is_symmetric=False, is_dynamic=False,
                                        range_learning=True, zero_point_precision=torch.float32)
        p["torchao_fq"] = IntxFakeQuantizer(config)
        with torch.no_grad():
            initialize_fake_quantizers(p["torchao_fq"], (x.detach(),))
    return p["torchao_fq"](x)


def torchao_affine(x, p):
    return _fake_quantize_affine(x, tuple(p["block_size"]), p["scale"], p["zero_point"], torch.int8,
                                 p["qmin"], p["qmax"])


def masked_straight_through(x, y, mask):
    """y in the forward; in the backward dy where mask and 0 elsewhere (a
    select, as our op's straight-through estimator)."""
    return y.detach() + torch.where(mask, x - x.detach(), 0)


def affine_composite(x, p):
    """Our integer op's math in torch ops, for torch.compile: fp32, true
    division, round half to even, the mask on the unclamped q."""
    qmin, qmax = p["qmin"], p["qmax"]
    scale, zero_point = _per_block(p["scale"]), _per_block(p["zero_point"])
    q = torch.round(_blocks(x, p["block_size"]).float() / scale) + zero_point
    y = (q.clamp(qmin, qmax) - zero_point) * scale
    return masked_straight_through(x, y.reshape(x.shape).to(x.dtype), ((q >= qmin) & (q <= qmax)).reshape(x.shape))


def fp8_composite(x, p):
    """The torch recipe, in fp32 as our op: div, clamp, to(fp8), mul. The
    gradient is clamp's: dy inside [-448, 448], 0 outside."""
    scale = p["scale"]
    return (torch.clamp(x.float() / scale, -E4M3_MAX, E4M3_MAX).to(E4M3).float() * scale).to(x.dtype)


def straight_through(qdq):
    """torchao's MX / NVFP4 functions are not differentiable: the usual
    x + (qdq(x) - x).detach() saves nothing, but also passes the gradient of
    clamped elements (ours saves the 1-bit mask and zeroes them)."""
    return lambda x, p: x + (qdq(x.detach()) - x).detach()


def torchao_mx(elem_dtype):
    def qdq(x):
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

        scale, data = to_mx(x, elem_dtype, 32)
        return to_dtype(data, scale, elem_dtype, 32, x.dtype)

    return straight_through(qdq)


def torchao_nvfp4(x):
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    global_scale = per_tensor_amax_to_scale(x.abs().amax())
    return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=global_scale).dequantize(x.dtype)


ATEN_PER_TENSOR = Baseline("torch.fake_quantize_per_tensor_affine", aten_per_tensor, target=1.3)
ATEN_PER_CHANNEL = Baseline("torch.fake_quantize_per_channel_affine", aten_per_channel, target=1.5)
TORCHAO_AFFINE = Baseline("torchao _fake_quantize_affine", torchao_affine)
COMPILED_AFFINE = Baseline("torch.compile(round, clamp, dequant, where-STE)", affine_composite, compiled=True)
EAGER_FP8 = Baseline("torch composite (div, clamp, to fp8, mul)", fp8_composite)
COMPILED_FP8 = Baseline("torch.compile(div, clamp, to fp8, mul)", fp8_composite, compiled=True)


def mx_baselines(elem_dtype):
    return [Baseline("torchao to_mx / to_dtype", torchao_mx(elem_dtype)),
            Baseline("torch.compile(torchao to_mx / to_dtype)", torchao_mx(elem_dtype), compiled=True)]


def previous_kernels(fn):
    """fn with the CUDA launchers set to their previous kernels (read at every launch)."""
    def run(x, p):
        os.environ["PT2E_FQ_CUDA_KERNELS"] = "previous"
        try:
            return fn(x, p)
        finally:
            del os.environ["PT2E_FQ_CUDA_KERNELS"]

    return run


def per_tensor(x):
    return tuple(x.shape)


def per_channel(x):
    return (1, x.shape[1])


def per_block(x):
    return (1, GROUP)


# Learnable ranges: forward+backward also gives d scale and d zero point.
ATEN_LEARNABLE_PER_TENSOR = Baseline("ATen _fake_quantize_learnable_per_tensor_affine", aten_learnable_per_tensor,
                                     target=3.0)
ATEN_LEARNABLE_PER_CHANNEL = Baseline("ATen _fake_quantize_learnable_per_channel_affine",
                                      aten_learnable_per_channel, target=3.0)
TORCHAO_RANGE_LEARNING = Baseline("torchao IntxFakeQuantizer(range_learning=True) (prototype)",
                                  torchao_range_learning)
GIVEN_SCALES_FRACTION = 0.85  # integer and FP8: the scales are inputs
BLOCK_SCALED_FRACTION = 0.75  # MX and NVFP4: the kernel computes a scale per block
CASES = [
    Case("int8 per-tensor", lambda x: affine_qparams(x, per_tensor(x), INT8), ours_affine,
         [ATEN_PER_TENSOR, TORCHAO_AFFINE, COMPILED_AFFINE], GIVEN_SCALES_FRACTION),
    Case("int8 per-channel (axis 0)", lambda x: affine_qparams(x, per_channel(x), INT8), ours_affine,
         [ATEN_PER_CHANNEL, TORCHAO_AFFINE, COMPILED_AFFINE], GIVEN_SCALES_FRACTION),
    Case(f"int8 per-block {GROUP}", lambda x: affine_qparams(x, per_block(x), INT8), ours_affine,
         [TORCHAO_AFFINE, COMPILED_AFFINE], GIVEN_SCALES_FRACTION),
    Case(f"int4 per-block {GROUP}", lambda x: affine_qparams(x, per_block(x), INT4), ours_affine,
         [TORCHAO_AFFINE, COMPILED_AFFINE], GIVEN_SCALES_FRACTION),
    # The learnable forward is the integer cases' kernel: its target is theirs.
    Case("int8 learnable per-tensor (LSQ+)", lambda x: learnable_qparams(x, per_tensor(x), INT8), ours_learnable,
         [ATEN_LEARNABLE_PER_TENSOR], None),
    Case("int4 learnable per-channel (axis 0, LSQ+)", lambda x: learnable_qparams(x, per_channel(x), INT4),
         ours_learnable, [ATEN_LEARNABLE_PER_CHANNEL, TORCHAO_RANGE_LEARNING], None),
    Case("FP8 E4M3 per-tensor", lambda x: fp8_qparams(x, per_tensor(x)), ours_fp8,
         [EAGER_FP8, COMPILED_FP8], GIVEN_SCALES_FRACTION),
    Case("FP8 E4M3 per-channel (axis 0)", lambda x: fp8_qparams(x, per_channel(x)), ours_fp8,
         [EAGER_FP8, COMPILED_FP8], GIVEN_SCALES_FRACTION),
    Case("MXFP8 (E4M3, block 32)", lambda x: {}, lambda x, p: pt2e_fq.ops.fake_quantize_mx(x, E4M3),
         mx_baselines(E4M3), BLOCK_SCALED_FRACTION, cpu_max_repeats=3),
    Case("MXFP4 (E2M1, block 32)", lambda x: {}, lambda x, p: pt2e_fq.ops.fake_quantize_mx(x, E2M1),
         mx_baselines(E2M1), BLOCK_SCALED_FRACTION, cpu_max_repeats=3),
    Case("NVFP4 (E2M1, block 16)", lambda x: {}, lambda x, p: pt2e_fq.ops.fake_quantize_nvfp4(x),
         [Baseline("torchao NVFP4Tensor", straight_through(torchao_nvfp4))], BLOCK_SCALED_FRACTION,
         cpu_max_repeats=5),
]


# ---------------------------------------------------------------------------
# Measurement


def median_ms(fns, repeats: int, device: str, warmup: int = 3, calls_per_timing: int = 10,
              warm: bool = False) -> list[float]:
    """Median milliseconds of one call of each callable. The callables take
    turns within every repeat, so load from other processes hits them alike.
    On CUDA one pair of events on the stream times `calls_per_timing`
    back-to-back calls: a single call timed alone after a synchronize would
    count the host's launch latency as GPU time (the GPU idles until the
    first kernel arrives), and the first callable of every repeat would pay
    it. A callable whose host work per call exceeds its GPU work is still
    measured at the host's pace, as a training loop would run it. On CPU,
    the wall clock of one call. Each repeat starts at the next callable
    (a rotation), so each follows every other equally often (with three
    or more; with two, the last of a repeat also starts the next): the one
    timed right after a callable with a larger working set starts with
    colder caches (measured on bench_deploy's encoder block: the same
    compiled int8 block 7-20% slower right after the float one than later
    in the same repeat). With `warm`, each callable runs once more untimed
    right before its timed call, so it is timed with its own working set in
    the caches, as a deployed model runs its forwards back to back."""
    for fn in fns:  # allocator, lazy initialisation, and compilation
        for _ in range(warmup):
            fn()
    times = [[] for _ in fns]
    for r in range(repeats):
        turn = [(fns[i], times[i]) for i in range(len(fns))]
        for fn, t in turn[r % len(fns):] + turn[:r % len(fns)]:
            if device == "cuda":
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(calls_per_timing):
                    fn()
                end.record()
                end.synchronize()
                t.append(start.elapsed_time(end) / calls_per_timing)
            else:
                if warm:
                    fn()
                t0 = time.perf_counter()
                fn()
                t.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times]


def saved_bytes_by_dtype(fn, x) -> dict:
    """Bytes of the distinct tensors autograd saves for backward, per dtype."""
    seen = {}

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape))
        seen[key] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x.detach().requires_grad_() if x.is_floating_point() else x)  # tokens take no gradient
    by_dtype = {}
    for (_, _, dtype, _), n in seen.items():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + n
    return by_dtype


def saved_bytes(fn, x) -> int:
    """Bytes of the distinct tensors autograd saves for backward."""
    return sum(saved_bytes_by_dtype(fn, x).values())


def op_bytes(numel: int, dtype: torch.dtype) -> tuple[int, int]:
    """The bytes our op must move, forward (read x, write y and the 1-bit
    packed mask) and backward (read dy and the mask, write dx); qparams and
    block scales are negligible."""
    data, mask = numel * dtype.itemsize, -(-numel // 8)
    return 2 * data + mask, 2 * data + mask


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


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


@dataclass
class Result:
    fwd_ms: float
    fwd_bwd_ms: float
    saved: int


def reason(e: Exception) -> str:
    """A table cell saying why an implementation did not run."""
    lines = str(e).strip().splitlines()
    return f"n/a: {type(e).__name__}" + (f": {lines[0][:80]}" if lines else "")


def measure(impls, x, p, repeats, device) -> list:
    """Per implementation: a Result, or a string saying why it cannot run on x."""
    steps, results = [], []
    for fn in impls:
        try:
            # The first call with gradients also compiles a compiled baseline's
            # training graph; median_ms's warm-up compiles its inference graph.
            fn(x.detach().requires_grad_(), p).sum().backward()
            results.append(saved_bytes(lambda t: fn(t, p), x))
            steps.append(timed_steps(fn, x, p))
        except Exception as e:  # a baseline that does not take this dtype, or fails to compile
            results.append(reason(e))
    times = iter(median_ms([s for pair in steps for s in pair], repeats, device))
    return [r if isinstance(r, str) else Result(next(times), next(times), r) for r in results]


def copy_ms(x, repeats, device) -> float:
    """Median ms of a device-to-device copy of x (read x, write dst)."""
    dst = torch.empty_like(x)
    return median_ms([lambda: dst.copy_(x)], repeats, device)[0]


@dataclass
class Measured:
    case: Case
    dtype: torch.dtype
    ours: object  # Result or str
    baselines: list  # (Baseline, Result or str)


def is_aten(b: Baseline) -> bool:
    return b.name.startswith(("torch.fake_quantize", "ATen"))


def run(device, shape, dtypes, repeats, compile_baselines, cases=CASES, aten_only=False, previous=False):
    """Per dtype: the copy's ms, and a Measured per case of `cases`. previous:
    our op with its previous kernels as a baseline of the cases that have a
    bandwidth target."""
    copies, measured = {}, []
    for dtype in dtypes:
        x = torch.randn(shape, device=device).to(dtype)
        copies[dtype] = copy_ms(x, max(repeats, 50), device)  # cheap: more repeats, a steadier reference
        for case in cases:
            p = case.make(x)
            n = min(repeats, case.cpu_max_repeats or repeats) if device == "cpu" else repeats
            baselines = [b for b in case.baselines
                         if (compile_baselines or not b.compiled) and (is_aten(b) or not aten_only)]
            if previous and case.copy_fraction is not None:
                baselines.insert(0, Baseline("pt2e_fq, previous kernels", previous_kernels(case.ours)))
            if any(b.compiled for b in baselines):
                # A fresh cache per case and dtype: no recompile limit reached
                # across cases, no dimension made dynamic by the previous case.
                torch._dynamo.reset()
            fns = [torch.compile(b.fn, dynamic=False) if b.compiled else b.fn for b in baselines]
            mine, *theirs = measure([case.ours, *fns], x, p, n, device)
            measured.append(Measured(case, dtype, mine, list(zip(baselines, theirs))))
    return copies, measured


# ---------------------------------------------------------------------------
# Tables


def _dt(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def copy_gbps(shape, dtype, ms) -> float:
    """The copy's GB/s: x's bytes read and written."""
    return gbps(2 * shape[0] * shape[1] * dtype.itemsize, ms)


def bandwidth(r: Result, shape, dtype, copy: float) -> tuple[float, float, float, float]:
    """Effective GB/s (the bytes our op must move over the time) forward, its
    fraction of the copy's GB/s, and the same for forward+backward."""
    fwd, bwd = op_bytes(shape[0] * shape[1], dtype)
    fwd_gbps, fwd_bwd_gbps = gbps(fwd, r.fwd_ms), gbps(fwd + bwd, r.fwd_bwd_ms)
    return fwd_gbps, fwd_gbps / copy, fwd_bwd_gbps, fwd_bwd_gbps / copy


def result_row(case, impl, dtype, r, shape, copy, ours=None):
    if isinstance(r, str):
        return [case, impl, _dt(dtype), r] + [""] * 7
    fwd_gbps, fwd_frac, fb_gbps, fb_frac = bandwidth(r, shape, dtype, copy)
    speedup = ""
    if isinstance(ours, Result):
        speedup = f"{r.fwd_ms / ours.fwd_ms:.2f}x / {r.fwd_bwd_ms / ours.fwd_bwd_ms:.2f}x"
    numel = shape[0] * shape[1]
    return [case, impl, _dt(dtype), f"{r.fwd_ms:.3f}", f"{r.fwd_bwd_ms:.3f}", f"{fwd_gbps:.1f}",
            f"{fwd_frac:.0%}", f"{fb_gbps:.1f}", f"{fb_frac:.0%}", f"{r.saved:,} ({r.saved / numel:.3g}/elem)",
            speedup]


def results_table(shape, copies, measured):
    rows = []
    for m in measured:
        copy = copy_gbps(shape, m.dtype, copies[m.dtype])
        if m is next(n for n in measured if n.dtype == m.dtype):  # the copy heads the rows of its dtype
            rows.append(["device copy", "dst.copy_(x)", _dt(m.dtype), f"{copies[m.dtype]:.3f}", "",
                         f"{copy:.1f}", "100%"] + [""] * 4)
        rows.append(result_row(m.case.name, "pt2e_fq", m.dtype, m.ours, shape, copy))
        for b, r in m.baselines:
            rows.append(result_row(m.case.name, b.name, m.dtype, r, shape, copy, m.ours))
    return rows


RESULT_HEADERS = ["case", "impl", "dtype", "fwd ms", "fwd+bwd ms", "fwd GB/s", "fwd % of copy", "fwd+bwd GB/s",
                  "fwd+bwd % of copy", "saved for bwd, bytes", "pt2e_fq speed-up over it (fwd / fwd+bwd)"]


def targets_table(shape, copies, measured):
    """Per case and dtype: our forward's fraction of copy bandwidth against
    the case's target, and our forward+backward speed-up over every baseline
    that has a target."""
    rows = []
    for m in measured:
        where = [m.case.name, _dt(m.dtype)]
        if isinstance(m.ours, str):
            rows.append(where + ["runs", m.ours, "miss"])
            continue
        if m.case.copy_fraction is not None:
            target = f"fwd >= {m.case.copy_fraction:.0%} of copy"
            _, fwd_frac, _, fb_frac = bandwidth(m.ours, shape, m.dtype, copy_gbps(shape, m.dtype, copies[m.dtype]))
            rows.append(where + [target, f"{fwd_frac:.0%} (fwd+bwd {fb_frac:.0%})",
                                 "pass" if fwd_frac >= m.case.copy_fraction else "miss"])
        for b, r in m.baselines:
            if b.target is None:
                continue
            target = f"fwd+bwd >= {b.target}x {b.name}"
            if isinstance(r, str):
                rows.append(where + [target, r, "n/a"])
                continue
            speedup = r.fwd_bwd_ms / m.ours.fwd_bwd_ms
            rows.append(where + [target, f"{speedup:.2f}x", "pass" if speedup >= b.target else "miss"])
    return rows


TARGET_HEADERS = ["case", "dtype", "target", "measured", "result"]


def environment(device, shape, repeats) -> str:
    versions = f"torch {torch.__version__}, torchao {torchao.__version__}"
    timing = f"x: {shape[0]}x{shape[1]}; median of {repeats} runs"
    if device == "cpu":
        return f"CPU, {torch.get_num_threads()} threads; {versions}; {timing} (wall clock)"
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30, check=True).stdout.split()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        driver = f"unknown ({type(e).__name__})"
    return (f"GPU: {props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB); "
            f"driver {driver}; CUDA {torch.version.cuda}; {versions}\n{timing} (CUDA events around 10 back-to-back calls)")


def parse_shape(text: str) -> tuple[int, int]:
    try:
        rows, cols = (int(s) for s in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWSxCOLS, e.g. 8192x8192; got {text!r}") from None
    if rows < 1 or cols < 1 or cols % GROUP:
        raise argparse.ArgumentTypeError(f"need positive sizes and COLS a multiple of {GROUP}; got {text!r}")
    return rows, cols


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--shape", type=parse_shape,
                    help="x's shape, ROWSxCOLS (default: 8192x8192 on CUDA, 1024x4096 on CPU)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="one dtype only (default: both)")
    ap.add_argument("--repeats", type=int, default=20, help="timed runs per measurement (median)")
    ap.add_argument("--quick", action="store_true", help="3 repeats, fp32 only")
    ap.add_argument("--threads", type=int, help="CPU threads (default: torch's default)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction,
                    help="include the torch.compile'd baselines (default: on CUDA only; on CPU each "
                         "compilation takes tens of seconds)")
    ap.add_argument("--only", metavar="TEXT", help="only the cases whose name contains TEXT (e.g. learnable)")
    ap.add_argument("--baselines", choices=["all", "aten"], default="all",
                    help="aten: only ATen's ops (the targets' baselines), for a short run")
    ap.add_argument("--previous-kernels", action=argparse.BooleanOptionalAction,
                    help="also time our op with its previous CUDA kernels (default: on CUDA only)")
    args = ap.parse_args()
    cases = [c for c in CASES if args.only is None or args.only in c.name]
    if not cases:
        ap.error(f"--only {args.only!r} matches no case; cases: {', '.join(c.name for c in CASES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is available here; nothing measured.")
        return
    shape = args.shape or DEFAULT_SHAPE[args.device]
    repeats = 3 if args.quick else args.repeats
    if args.dtype:
        dtypes = [getattr(torch, args.dtype)]
    else:
        dtypes = [torch.float32] if args.quick else [torch.float32, torch.bfloat16]
    compile_baselines = args.device == "cuda" if args.compile is None else args.compile
    previous = args.device == "cuda" if args.previous_kernels is None else args.previous_kernels
    if previous and args.device != "cuda":
        ap.error("--previous-kernels: the previous kernels are CUDA kernels; use --device cuda")
    copies, measured = run(args.device, shape, dtypes, repeats, compile_baselines, cases,
                           aten_only=args.baselines == "aten", previous=previous)
    print(environment(args.device, shape, repeats))
    print(tabulate(results_table(shape, copies, measured), headers=RESULT_HEADERS, tablefmt="github",
                   disable_numparse=True))
    print("\nTargets")
    print(tabulate(targets_table(shape, copies, measured), headers=TARGET_HEADERS, tablefmt="github",
                   disable_numparse=True))


if __name__ == "__main__":
    main()
