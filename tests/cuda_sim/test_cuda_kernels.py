"""The CUDA kernels on a GPU: bit for bit equal to the CPU kernels for every
op variant, dtype and memory layout, through torch.compile, a tensor over
2^31 elements, and with no host sync in the ops or a QAT step.

Each CUDA result here is compared with the CPU kernel's result for the same
inputs: y, the packed mask, the block scales, and the gradient. The tests
that run on every device (opcheck, the pure-torch reference, autograd) are
parametrized by DEVICES in test_affine_registration, test_affine_numerics,
test_affine_autograd, test_float_formats and test_float_ops_pt2. Every test
here is marked requires_cuda_kernels: without a GPU, or with pt2e_fq built
without its CUDA kernels, it is skipped with that reason.
"""

from __future__ import annotations

import pytest
import torch
from tests.cuda_sim.kernel_cases import (
    AFFINE_VARIANTS, BLOCK_SHAPES, E2M1, E4M3, ELEM_DTYPES, FLOAT_VARIANTS, block_input, dtype_id,
    gradient_seed, param_grid, with_specials,
)

from tests.conftest import FLOAT_DTYPES, assert_bits_equal, make_case, requires_cuda_kernels
from pt2e_fq import ops, reference
from pt2e_fq.ops import _checks

pytestmark = requires_cuda_kernels

# ---------------------------------------------------------------------------
# Memory layouts of x. The op makes x contiguous (a copy for a non-contiguous
# view), so "transposed" checks that path; "misaligned" gives the kernel a
# pointer that is not 16-byte aligned (its scalar path); "empty" has a
# zero-size dimension.

LAYOUTS = ("contiguous", "transposed", "misaligned", "empty")


def in_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """x's values in the given layout, on x's device (empty: x's shape with
    dimension 0 cut to 0)."""
    if layout == "contiguous":
        return x.contiguous()
    if layout == "empty":
        return x[:0]
    if layout == "transposed":
        return x.transpose(0, -1).contiguous().transpose(0, -1)
    flat = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    out = flat[1:].view(x.shape)
    out.copy_(x)
    assert out.data_ptr() % 16 != 0
    return out


def run_on(device: str, fn, x: torch.Tensor, others: tuple, layout: str, dy: torch.Tensor):
    """(outputs of fn, x.grad) with x and the tensor arguments on `device`,
    x in `layout`, and dy (in layout's shape) fed backward through output 0."""
    move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    xd = in_layout(x.detach().to(device, copy=True), layout).requires_grad_()
    outs = fn(xd, *map(move, others))
    outs = outs if isinstance(outs, tuple) else (outs,)
    outs[0].backward(in_layout(dy.to(device), layout))
    return [o.detach().cpu() for o in outs], xd.grad.cpu()


def assert_same_results(fn, x, others, layout, seed=0):
    dy = gradient_seed(x, seed)
    cpu_outs, cpu_grad = run_on("cpu", fn, x, others, layout, dy)
    gpu_outs, gpu_grad = run_on("cuda", fn, x, others, layout, dy)
    assert len(cpu_outs) == len(gpu_outs)
    for i, (c, g) in enumerate(zip(cpu_outs, gpu_outs)):
        if c.dtype == torch.uint8:
            assert torch.equal(g, c), f"output {i} (packed mask) differs"
        else:
            assert_bits_equal(g, c)
    assert_bits_equal(gpu_grad, cpu_grad)


# ---------------------------------------------------------------------------
# Integer affine: every granularity and formulation, shaped so that the
# kernel's three qparam lookups (one block, one block per vector, per
# element), full and partial tiles, and several tiles per warp all occur.

@pytest.mark.parametrize("variant,dtype,layout", param_grid(AFFINE_VARIANTS, FLOAT_DTYPES, LAYOUTS))
def test_affine_cuda_equals_cpu(variant, dtype, layout):
    _, shape, block_size, zp, (qmin, qmax) = variant
    case = make_case(shape, block_size, dtype, (qmin, qmax), zp=zp, seed=len(shape))
    x = with_specials(case.x, seed=3)
    qparams = (case.scale, case.zero_point, case.minval)
    if layout == "empty":  # x[:0]: every qparam cut to its blocks, none
        x, layout = x[:0], "contiguous"
        qparams = tuple(None if t is None else t[:0] for t in qparams)

    def fn(x, scale, zero_point, minval):
        return ops.fake_quantize_affine_with_mask(x, block_size, scale, zero_point, qmin, qmax, minval=minval)

    assert_same_results(fn, x, qparams, layout)


# ---------------------------------------------------------------------------
# Float formats with static scales: FP8 E4M3 / E5M2 and FP4 E2M1.

@pytest.mark.parametrize("variant,fmt,dtype,layout", param_grid(FLOAT_VARIANTS, ELEM_DTYPES, FLOAT_DTYPES, LAYOUTS))
def test_float_cuda_equals_cpu(variant, fmt, dtype, layout):
    _, shape, block_size = variant
    g = torch.Generator().manual_seed(11)
    rshape = [-(-s // b) for s, b in zip(shape, block_size)]
    scale = torch.rand(rshape, generator=g) * 0.5 + 0.01
    fmax = reference.FLOAT_FORMATS[fmt][0]
    x = with_specials((torch.randn(shape, generator=g) * fmax * 0.3).to(dtype), seed=5)
    block = list(block_size)
    if layout == "empty":
        x, block, scale, layout = x[:0], [1] + block[1:], scale[:0], "contiguous"

    def fn(x, scale):
        return ops.fake_quantize_float_with_mask(x, block, scale, fmt)

    assert_same_results(fn, x, (scale,), layout)


# ---------------------------------------------------------------------------
# Block-scaled formats whose scales come from the data: MX and NVFP4.

@pytest.mark.parametrize("shape,fmt,dtype,layout", param_grid(BLOCK_SHAPES, ELEM_DTYPES, FLOAT_DTYPES, LAYOUTS))
def test_mx_cuda_equals_cpu(shape, fmt, dtype, layout):
    _, dims, axis = shape
    x = block_input(dims, dtype, seed=7)

    def fn(x):
        return torch.ops.pt2e_fq.fake_quantize_mx(x, _checks._elem_format("fake_quantize_mx", "elem_dtype", fmt), 32, axis)

    if layout == "empty":
        x, layout = x.narrow(axis, 0, 0), "contiguous"
    assert_same_results(fn, x, (), layout)


@pytest.mark.parametrize(
    "shape,global_scale,dtype,layout", param_grid(BLOCK_SHAPES, ("computed", "given"), FLOAT_DTYPES, LAYOUTS)
)
def test_nvfp4_cuda_equals_cpu(shape, global_scale, dtype, layout):
    _, dims, axis = shape
    x = block_input(dims, dtype, seed=9)
    others = (torch.tensor(0.0123),) if global_scale == "given" else (None,)

    def fn(x, global_scale):
        return torch.ops.pt2e_fq.fake_quantize_nvfp4(x, global_scale, axis)

    if layout == "empty":
        x, layout = x.narrow(axis, 0, 0), "contiguous"
    assert_same_results(fn, x, others, layout)


def test_mx_block_size_other_than_32_equals_cpu():
    x = block_input((33, 90), torch.bfloat16, seed=13)
    for block in (1, 7, 16, 64):
        assert_same_results(
            lambda t: torch.ops.pt2e_fq.fake_quantize_mx(t, "e2m1", block, -1), x, (), "contiguous"
        )


def test_ste_grad_cuda_equals_cpu_for_every_tail_length(dtype):
    # Every numel mod 8 and mod the vector width, aligned and misaligned.
    for n in (1, 7, 8, 9, 31, 33, 255, 257, 1000, 4103):
        g = torch.Generator().manual_seed(n)
        mask = (torch.rand(n, generator=g) < 0.5)
        packed = reference.pack_mask(mask)
        dy = gradient_seed(torch.empty(n, dtype=dtype), n)
        expected = torch.ops.pt2e_fq.ste_grad(dy, packed)
        for layout in ("contiguous", "misaligned"):
            got = torch.ops.pt2e_fq.ste_grad(in_layout(dy.cuda(), layout), packed.cuda())
            assert_bits_equal(got.cpu(), expected)


# ---------------------------------------------------------------------------
# Beyond 2^31 elements: 64-bit indices in the tiles, the block lookup, the
# mask words and the grid-stride loops.


def _free_gpu_bytes() -> int:
    free, _ = torch.cuda.mem_get_info()
    return free


BIG_ROWS, BIG_COLS = 2**16 + 3, 2**15  # 2^31 + 3 * 2^15 elements


def test_over_2_pow_31_elements_equals_cpu():
    torch.cuda.empty_cache()  # what earlier tests left in the caching allocator is free for this one
    if _free_gpu_bytes() < 40 * 2**30:
        pytest.skip("needs 40 GiB of free GPU memory for a tensor of over 2^31 fp16 elements")
    x = torch.randn(BIG_ROWS, BIG_COLS, device="cuda", dtype=torch.float16) * 3
    assert x.numel() > 2**31
    x_cpu = x.cpu()
    # Per-tensor on a flat view whose length is not a multiple of the tile,
    # so the last, partial tile lies beyond 2^31.
    n = x.numel() - 5
    scale, zp = torch.tensor(0.02), torch.tensor(3, dtype=torch.int32)
    got = torch.ops.pt2e_fq.fake_quantize_affine(x.view(-1)[:n], [n], scale.cuda(), zp.cuda(), -128, 127, None)
    want = torch.ops.pt2e_fq.fake_quantize_affine(x_cpu.view(-1)[:n], [n], scale, zp, -128, 127, None)
    assert torch.equal(got[0].cpu().view(torch.int16), want[0].view(torch.int16))
    assert torch.equal(got[1].cpu(), want[1])
    # The backward of the same call.
    dy = torch.ones(n, dtype=torch.float16)
    grad = torch.ops.pt2e_fq.ste_grad(dy.cuda(), got[1])
    assert torch.equal(grad.cpu().view(torch.int16), torch.ops.pt2e_fq.ste_grad(dy, want[1]).view(torch.int16))
    del got, grad
    # Per channel (one scale per row: rows past 2^31 / cols read their own).
    scale = torch.rand(BIG_ROWS, 1) * 0.05 + 0.001
    got = torch.ops.pt2e_fq.fake_quantize_affine(x, [1, BIG_COLS], scale.cuda(), None, -8, 7, None)
    want = torch.ops.pt2e_fq.fake_quantize_affine(x_cpu, [1, BIG_COLS], scale, None, -8, 7, None)
    assert torch.equal(got[0].cpu().view(torch.int16), want[0].view(torch.int16))
    assert torch.equal(got[1].cpu(), want[1])
    del got
    # MX and NVFP4 (blocks and their scales past 2^31 / 32).
    for op, args in (
        (torch.ops.pt2e_fq.fake_quantize_mx, ("e2m1", 32, -1)),
        (torch.ops.pt2e_fq.fake_quantize_nvfp4, (None, -1)),
    ):
        got = op(x, *args)
        want = op(x_cpu, *args)
        for g, w in zip(got, want):
            g = g.cpu()
            if w.dtype == torch.float16:
                g, w = g.view(torch.int16), w.view(torch.int16)
            assert torch.equal(g, w), op
        del got


# ---------------------------------------------------------------------------
# torch.compile on CUDA: inductor's Triton kernels around the op.


class _Surrounded(torch.nn.Module):
    """An op between pointwise ops, so inductor generates Triton kernels
    around it, not only a call."""

    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x):
        return self.op(x * 2.0).relu() - 1.0


def _op_on(name: str, x: torch.Tensor):
    """A callable of x for op variant `name`, its qparams made on x's device
    now (a tensor made from a Python number on the GPU is a host sync)."""
    rows, dev = x.shape[0], x.device
    groups = -(-x.shape[1] // 32)
    if name == "affine_per_channel":
        scale = torch.full((rows, 1), 0.05, device=dev)
        return lambda t: ops.fake_quantize_affine(t, [1, t.shape[1]], scale, None, -8, 7)
    if name == "affine_per_group_zero_point":
        scale = torch.full((rows, groups), 0.02, device=dev)
        zp = torch.ones(rows, groups, dtype=torch.int32, device=dev)
        return lambda t: ops.fake_quantize_affine(t, [1, 32], scale, zp, -128, 127)
    if name == "affine_per_group_minval":
        scale, minval = torch.full((rows, groups), 0.05, device=dev), torch.full((rows, groups), -0.4, device=dev)
        return lambda t: ops.fake_quantize_affine(t, [1, 32], scale, None, 0, 15, minval=minval)
    if name == "fp8_per_tensor":
        scale = torch.full((), 0.01, device=dev)
        return lambda t: ops.fake_quantize_float(t, list(t.shape), scale, E4M3)
    if name == "mxfp4":
        return lambda t: ops.fake_quantize_mx(t, E2M1)
    if name == "nvfp4":
        return lambda t: ops.fake_quantize_nvfp4(t)
    assert name == "nvfp4_given_global_scale"
    global_scale = torch.full((), 0.01, device=dev)
    return lambda t: ops.fake_quantize_nvfp4(t, global_scale)


OP_VARIANTS = ["affine_per_channel", "affine_per_group_zero_point", "affine_per_group_minval",
               "fp8_per_tensor", "mxfp4", "nvfp4", "nvfp4_given_global_scale"]


@pytest.mark.parametrize("name", OP_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_compile_inductor_on_cuda_equals_eager(name, dtype):
    torch._dynamo.reset()
    x0 = (torch.randn(48, 64, generator=torch.Generator().manual_seed(2)) * 2).to(dtype).cuda()
    module = _Surrounded(_op_on(name, x0))
    compiled = torch.compile(module, fullgraph=True, backend="inductor")
    dy = torch.randn(48, 64, generator=torch.Generator().manual_seed(3)).to(dtype).cuda()
    results = []
    for fn in (module, compiled):
        x = x0.detach().clone().requires_grad_()
        y = fn(x)
        y.backward(dy)
        results.append((y.detach().cpu(), x.grad.cpu()))
    (y_eager, g_eager), (y_compiled, g_compiled) = results
    assert_bits_equal(y_compiled, y_eager)
    assert_bits_equal(g_compiled, g_eager)


# ---------------------------------------------------------------------------
# No host sync: torch raises on any synchronising call in "error" mode.


class _sync_is_an_error:
    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("name", OP_VARIANTS)
def test_op_forward_and_backward_make_no_host_sync(name, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 96, generator=g) * 2).to(dtype).cuda().requires_grad_()
    fn = _op_on(name, x)
    fn(x)  # first call: lazy CUDA initialisation may sync
    with _sync_is_an_error():
        fn(x).sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("preset", ["w8a8", "w4a8", "w4a16", "fp8", "mxfp8", "mxfp4", "nvfp4"])
def test_qat_step_on_cuda_makes_no_host_sync(preset):
    from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e

    from benchmarks.models import CNN, EncoderBlock
    from pt2e_fq.cli.pipeline import quantizer_for

    torch.manual_seed(0)
    model, x = (EncoderBlock(d=64, hidden=128), torch.randn(4, 8, 64)) if preset != "w8a8" else (CNN(), torch.randn(4, 3, 8, 8))
    gm = torch.export.export(model.train(), (x,)).module()
    prepared = prepare_qat_pt2e(gm, quantizer_for(preset, qat=True)).cuda()
    x = x.cuda()
    opt = torch.optim.SGD(prepared.parameters(), lr=0.01)

    def step():
        opt.zero_grad()
        prepared(x).float().square().mean().backward()
        opt.step()

    step()  # first step: observers initialise their state, lazy CUDA init
    with _sync_is_an_error():
        step()
        step()


def test_step_times_on_cuda_wait_for_the_steps_kernels(monkeypatch):
    # A step's GPU kernels run after the Python call returns: a timer that
    # does not wait for them reads the launch time. Asserted on the waits, not
    # on times (a shared GPU machine is too noisy for a timing assertion):
    # every timed step is bracketed by a synchronize of the batch's device.
    from pt2e_fq.cli import step_time

    waits = []
    real_synchronize = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: (waits.append(device), real_synchronize(device)))
    model = torch.nn.Linear(64, 64).cuda()
    x, target = torch.randn(8, 64, device="cuda"), torch.randn(8, 64, device="cuda")
    step_time.step_times({"a": model, "b": model}, (x,), target, torch.nn.functional.mse_loss, steps=3, warmup=1)
    assert len(waits) == 2 * 2 * (3 + 1) and all(d == x.device for d in waits), waits
