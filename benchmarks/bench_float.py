"""Float-format rows of the op benchmark: our fused ops against the torch
composite (FP8) and torchao's Python MX / NVFP4 quantize-dequantize, on CPU.

Run: .venv/bin/python benchmarks/bench_float.py   (or `make bench-float`)

For each case: forward ms, forward+backward ms (median over repeats), the
bytes autograd saves for backward (saved_tensors_hooks), and our speed-up
measured in the same run. torchao's MX / NVFP4 functions are not
differentiable, so they get the usual straight-through idiom
x + (qdq(x) - x).detach(), which saves nothing but also passes the gradient
of clamped elements; ours saves the 1-bit clamp mask.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from tabulate import tabulate

import pt2e_fq
from pt2e_fq import ops

warnings.filterwarnings("ignore")
E4M3, E2M1 = torch.float8_e4m3fn, torch.float4_e2m1fn_x2


def fp8_composite(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The eager torch recipe: div, clamp, to(fp8), to(x.dtype), mul."""
    return torch.clamp(x / scale, -448.0, 448.0).to(E4M3).to(x.dtype) * scale


def straight_through(qdq):
    return lambda x: x + (qdq(x.detach()) - x).detach()


def torchao_mxfp4(x: torch.Tensor) -> torch.Tensor:
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    scale, data = to_mx(x, E2M1, 32)
    return to_dtype(data, scale, E2M1, 32, x.dtype)


def torchao_nvfp4(x: torch.Tensor) -> torch.Tensor:
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    global_scale = per_tensor_amax_to_scale(x.abs().amax())
    return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=global_scale).dequantize(x.dtype)


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def saved_bytes(fn, x: torch.Tensor) -> int:
    """Bytes of the distinct tensors autograd saves for backward."""
    seen = {}

    def pack(t):
        seen[(t.data_ptr(), t.numel(), t.dtype)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(seen.values())


def measure(fn, x: torch.Tensor, repeats: int) -> tuple[float, float, int]:
    xg = x.clone().requires_grad_()
    dy = torch.randn_like(x)

    def forward():
        with torch.no_grad():
            fn(x)

    def forward_backward():
        xg.grad = None
        fn(xg).backward(dy)

    return median_ms(forward, repeats), median_ms(forward_backward, repeats), saved_bytes(fn, xg)


def cases(scale: torch.Tensor):
    """(case, ours, baseline name, baseline, repeats of the baseline)"""
    return [
        (
            "FP8 E4M3 per-tensor",
            lambda x: ops.fake_quantize_float(x, list(x.shape), scale, E4M3),
            "torch composite",
            lambda x: fp8_composite(x, scale),
            20,
        ),
        ("MXFP4 (E2M1, block 32)", lambda x: ops.fake_quantize_mx(x, E2M1), "torchao to_mx/to_dtype", straight_through(torchao_mxfp4), 3),
        ("NVFP4 (block 16)", lambda x: ops.fake_quantize_nvfp4(x), "torchao NVFP4Tensor", straight_through(torchao_nvfp4), 5),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed repeats of our ops")
    parser.add_argument("--shape", type=int, nargs=2, default=[1024, 4096])
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(*args.shape).to(dtype)
        scale = (x.float().abs().amax() / 448).reshape(())
        for case, ours, base_name, base, base_repeats in cases(scale):
            o_fwd, o_fb, o_saved = measure(ours, x, args.repeats)
            b_fwd, b_fb, b_saved = measure(base, x, base_repeats)
            name = str(dtype).replace("torch.", "")
            rows.append([case, name, "pt2e_fq", f"{o_fwd:.2f}", f"{o_fb:.2f}", o_saved, f"{b_fwd / o_fwd:.1f}x", f"{b_fb / o_fb:.1f}x"])
            rows.append(["", "", base_name, f"{b_fwd:.2f}", f"{b_fb:.2f}", b_saved, "", ""])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, x {args.shape[0]}x{args.shape[1]}, pt2e_fq {pt2e_fq.__version__}")
    headers = ["case", "dtype", "impl", "fwd ms", "fwd+bwd ms", "saved bytes", "fwd speed-up", "fwd+bwd speed-up"]
    print(tabulate(rows, headers=headers, tablefmt="github"))


if __name__ == "__main__":
    main()
