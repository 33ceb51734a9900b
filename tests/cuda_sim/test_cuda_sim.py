"""The CUDA kernels without a GPU: the unchanged .cu files, compiled as host
C++ with the simulation harness of tests/cuda_sim (blocks of fibers,
lockstep warp collectives) under AddressSanitizer and UBSan, against the CPU
kernels bit for bit: y, the packed mask, the block scales, the global scale,
and the STE gradient; the fused observe kernels against the observers and
CUDA's qparam arithmetic. The harness stops on what would be undefined
behaviour on a GPU; the self-tests at the end show it does.

Past 2^31 elements, the kernels run on sparse buffers and only the last
blocks of their grid, which compute the tensor's end: 64-bit tile, mask and
scale indices without allocating or computing the rest.

What stays GPU-only (tests/cuda_sim/test_cuda_kernels.py on a GPU machine): the torch
binding (binding.cpp: argument checks, allocation, streams), the middle of
a tensor over 2^31 elements, real concurrency between warps and blocks.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from tests.cuda_sim.kernel_cases import (
    AFFINE_VARIANTS, BLOCK_SHAPES, ELEM_DTYPES, FLOAT_VARIANTS, block_input, gradient_seed, param_grid,
    with_specials,
)

from tests.conftest import FLOAT_DTYPES, affine_cases, assert_bits_equal, make_case
from pt2e_fq import observers, ops, reference
from pt2e_fq.ops import _checks
from pt2e_fq.ops.blocks import block_min_max, reduce_blocks
from pt2e_fq.spec.formats import ELEMENTS
from pt2e_fq.spec.qparams import int_range_limit
from pt2e_fq.spec.schemes import Scheme

# Every kernel variant through the ASan-built harness, a process per case: minutes.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SIM = ROOT / "tests" / "cuda_sim"
CUDA_DIR = ROOT / "pt2e_fq" / "csrc" / "cuda"
# -D__CUDA_ARCH__: the shared headers take their device branches (__fdiv_rn ...).
FLAGS = [
    "-std=c++17", "-O1", "-g", "-fno-omit-frame-pointer", "-ffp-contract=off",
    "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
    "-D__CUDACC__", "-D__CUDA_ARCH__=900", "-DPT2E_FQ_CUDA_SIM",
    f"-I{SIM / 'include'}", f"-I{SIM}", f"-I{ROOT / 'pt2e_fq' / 'csrc' / 'include'}",
]
DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
# aligned: malloc's 16 bytes (the kernels' vector path); misaligned: one
# element further (their scalar path); empty: no element.
PLACEMENTS = ("aligned", "misaligned", "empty")


def _compiler() -> str:
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "the CUDA simulation harness needs a C++17 compiler (g++) on PATH"
    return cxx


def _object(source: Path, cuda_dir: Path) -> Path:
    """source compiled with FLAGS and cuda_dir's headers, cached by the text of
    the source, of every header it may include and of the flags."""
    digest = hashlib.sha256("\0".join(FLAGS).encode())
    for path in sorted(p for d in (SIM, ROOT / "pt2e_fq" / "csrc" / "include", cuda_dir)
                       for p in d.rglob("*") if p.suffix in (".h", ".cuh")):
        digest.update(path.read_bytes())
    digest.update(source.read_bytes())
    obj = ROOT / "build" / "cuda_sim" / f"{source.stem}-{digest.hexdigest()[:16]}.o"
    if not obj.exists():
        obj.parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{obj}.{os.getpid()}"  # pytest-xdist workers may build at once: each its own file
        cmd = [_compiler(), *FLAGS, f"-I{cuda_dir}", "-x", "c++", str(source), "-c", "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"compiling {source.name} for the simulation harness failed:\n{done.stderr[-4000:]}"
        Path(tmp).replace(obj)
    return obj


def build_driver(compiled_from: dict[str, Path] | None = None) -> Path:
    """The harness's driver (each object built once per version of its
    sources; about 15 s for all on a free core). compiled_from: the .cu
    files to compile from another copy of csrc/cuda instead (a mutated one)."""
    compiled_from = compiled_from or {}
    objects = [_object(compiled_from.get(src.name, CUDA_DIR) / src.name, compiled_from.get(src.name, CUDA_DIR))
               for src in sorted(CUDA_DIR.glob("*.cu"))]
    objects += [_object(SIM / name, CUDA_DIR) for name in ("cuda_sim.cpp", "driver.cpp")]
    key = hashlib.sha256("\0".join(o.name for o in objects).encode()).hexdigest()[:16]
    exe = objects[0].parent / f"driver-{key}"
    if not exe.exists():
        tmp = f"{exe}.{os.getpid()}"
        done = subprocess.run([_compiler(), *FLAGS, *map(str, objects), "-o", tmp], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, f"linking the CUDA simulation harness failed:\n{done.stderr[-4000:]}"
        Path(tmp).replace(exe)
    return exe


@pytest.fixture(scope="session")
def driver() -> Path:
    return build_driver()


def run(driver: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(driver), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def raw(t: torch.Tensor) -> bytes:
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1))  # stride 1, even for one element
    return flat.view(torch.uint8).numpy().tobytes()


def read(path: Path, dtype: torch.dtype, shape) -> torch.Tensor:
    data = path.read_bytes()
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


class Case:
    """One case directory for the driver: case.txt and the input arrays."""

    def __init__(self, root: Path, name: str, op: str, x: torch.Tensor, placement: str, shape=None, **kv):
        """shape: the tensor's, when x holds only its tail (the `tail` key)."""
        self.dir = root / name
        self.dir.mkdir()
        self.x = x
        offset = x.element_size() if placement == "misaligned" else 0
        shape = ",".join(map(str, x.shape if shape is None else shape))
        fields = dict(op=op, dtype=DTYPE_NAMES[x.dtype], shape=shape, offset=offset, **kv)
        (self.dir / "case.txt").write_text("".join(f"{k}={v}\n" for k, v in fields.items()))
        if op != "ste":  # the STE's input is dy (ste_case)
            self.put("x.bin", x)

    def put(self, name: str, t: torch.Tensor) -> None:
        (self.dir / name).write_bytes(raw(t))

    def output(self, name: str, dtype: torch.dtype, shape) -> torch.Tensor:
        return read(self.dir / name, dtype, shape)

    def mask(self) -> torch.Tensor:
        return self.output("mask.bin", torch.uint8, (-(-self.x.numel() // 8),))


def simulate(driver: Path, *cases: Case, env: dict | None = None) -> None:
    done = run(driver, *(str(c.dir) for c in cases), env=env)
    assert done.returncode == 0, f"the simulated kernels failed (exit {done.returncode}):\n{done.stderr[-4000:]}"


def ste_case(root: Path, mask: torch.Tensor, like: torch.Tensor, placement: str) -> tuple[Case, torch.Tensor]:
    """A case for the STE kernel on the CPU op's mask, and the CPU's dx."""
    dy = gradient_seed(like, like.numel())
    case = Case(root, "ste", "ste", dy, placement)
    case.put("dy.bin", dy)
    case.put("mask.bin", mask)
    return case, torch.ops.pt2e_fq.ste_grad(dy, mask)


def assert_forward_and_backward(driver, root, forward: Case, expected: tuple, placement: str, extra=(), env=None):
    """Runs the forward case and the STE on its mask; compares y, the mask,
    the named extra outputs ((file, expected tensor)) and dx."""
    y_ref, mask_ref = expected[0], expected[1]
    backward, dx_ref = ste_case(root, mask_ref, forward.x, placement)
    simulate(driver, forward, backward, env=env)
    assert_bits_equal(forward.output("y.bin", forward.x.dtype, forward.x.shape), y_ref)
    assert torch.equal(forward.mask(), mask_ref), "packed mask differs"
    for name, want in extra:
        assert_bits_equal(forward.output(name, want.dtype, want.shape), want)
    assert_bits_equal(backward.output("dx.bin", dx_ref.dtype, dx_ref.shape), dx_ref)


# ---------------------------------------------------------------------------
# Every op variant against the CPU kernels.


def affine_forward(root, x, block, scale, zero_point, minval, qmin, qmax, placement) -> tuple[Case, tuple]:
    expected = torch.ops.pt2e_fq.fake_quantize_affine(x, block, scale, zero_point, qmin, qmax, minval)
    case = Case(root, "affine", "affine", x, placement, block=",".join(map(str, block)), qmin=qmin, qmax=qmax,
                zp=int(zero_point is not None), minval=int(minval is not None))
    case.put("scale.bin", scale.float())
    if zero_point is not None:
        case.put("zp.bin", zero_point.float())  # the binding passes zero points as fp32 too
    if minval is not None:
        case.put("minval.bin", minval.float())
    return case, expected


def _affine_inputs(variant, dtype, placement):
    """x (with NaN / Inf / ties), block, (scale, zero point, minval) and the
    range of an affine variant; all empty for the "empty" placement."""
    _, shape, block, zp, qrange = variant
    c = make_case(shape, block, dtype, qrange, zp=zp, seed=len(shape))
    x, qparams = with_specials(c.x, seed=3), (c.scale, c.zero_point, c.minval)
    if placement == "empty":
        x, qparams = x[:0], tuple(None if t is None else t[:0] for t in qparams)
    return x, list(block), qparams, qrange


@pytest.mark.parametrize("variant,dtype,placement", param_grid(AFFINE_VARIANTS, FLOAT_DTYPES, PLACEMENTS))
def test_affine_kernel_equals_cpu(driver, tmp_path, variant, dtype, placement):
    x, block, qparams, (qmin, qmax) = _affine_inputs(variant, dtype, placement)
    case, expected = affine_forward(tmp_path, x, block, *qparams, qmin, qmax, placement)
    assert_forward_and_backward(driver, tmp_path, case, expected, placement)


@settings(max_examples=25, deadline=None)
@given(affine_cases(max_numel=4000))
def test_affine_kernel_equals_cpu_on_random_cases(driver, c):
    with tempfile.TemporaryDirectory() as tmp:
        case, expected = affine_forward(Path(tmp), c.x.contiguous(), c.block_size, c.scale, c.zero_point, c.minval,
                                        c.quant_min, c.quant_max, "aligned")
        assert_forward_and_backward(driver, Path(tmp), case, expected, "aligned")


def learnable_backward(driver, root, x, block, scale, zero_point, minval, qmin, qmax, placement, seed=0,
                       grad_factor=0.125):
    """The learnable op's backward in the harness and on the CPU: dx is the
    same bits; d scale and d offset are fp32 sums in another fixed order
    (per block, slices of a warp each), so they agree to fp32 rounding.
    grad_factor None: LSQ's per block, which both kernels compute."""
    # No NaN in dy: one would make its whole block's sums NaN.
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(x.numel() + seed)).to(x.dtype)
    expected = torch.ops.pt2e_fq.fake_quantize_affine_learnable_backward(
        dy, x, block, scale, zero_point, qmin, qmax, grad_factor, minval)
    case = Case(root, "lsq", "lsq", x, placement, block=",".join(map(str, block)), qmin=qmin, qmax=qmax,
                zp=int(zero_point is not None), minval=int(minval is not None),
                grad_factor="lsq" if grad_factor is None else grad_factor)
    case.put("dy.bin", dy)
    case.put("scale.bin", scale.float())
    if zero_point is not None:  # as the binding passes it: fp32, a float one rounded after clamping
        case.put("zp.bin", zero_point.float().clamp(qmin, qmax).round())
    if minval is not None:
        case.put("minval.bin", minval.float())
    simulate(driver, case)
    dx, dscale, doffset = expected
    assert_bits_equal(case.output("dx.bin", x.dtype, x.shape), dx)
    factor = reference.lsq_grad_factors(x.shape, block, qmax) if grad_factor is None else grad_factor
    bound = reduce_blocks(dy.abs().double(), block, torch.sum, 0.0) * (qmax - qmin + 1) * factor * 1e-4
    for name, want in (("dscale", dscale), ("doffset", doffset)):
        got = case.output(f"{name}.bin", torch.float32, want.shape)
        assert torch.equal(got.isnan(), want.isnan()), f"{name}: NaN blocks differ"
        ok = got.isnan() | ((got.double() - want.double()).abs() <= bound.reshape(want.shape))
        assert ok.all(), f"{name}: {(~ok).sum()} blocks differ beyond fp32 rounding"


@pytest.mark.parametrize("variant,dtype,placement", param_grid(AFFINE_VARIANTS, FLOAT_DTYPES, PLACEMENTS))
def test_learnable_backward_kernel_equals_cpu(driver, tmp_path, variant, dtype, placement):
    x, block, qparams, (qmin, qmax) = _affine_inputs(variant, dtype, placement)
    learnable_backward(driver, tmp_path, x.contiguous(), block, *qparams, qmin, qmax, placement)


@settings(max_examples=25, deadline=None)
@given(affine_cases(max_numel=4000))
def test_learnable_backward_kernel_equals_cpu_on_random_cases(driver, c):
    with tempfile.TemporaryDirectory() as tmp:
        learnable_backward(driver, Path(tmp), c.x.contiguous(), c.block_size, c.scale, c.zero_point, c.minval,
                           c.quant_min, c.quant_max, "aligned")


@pytest.mark.parametrize("shape,block", [((5, 70), (1, 32)), ((9, 70), (4, 16)), ((4, 3, 10), (2, 3, 4))])
def test_learnable_backward_default_grad_factor_is_per_block_on_ragged_blocks(driver, tmp_path, shape, block):
    # grad_factor None: each block's own 1 / sqrt(n * quant_max), the
    # ragged last blocks' larger than the full ones', the same on both.
    c = make_case(shape, block, torch.float32, (-8, 7), zp="random", seed=7)
    learnable_backward(driver, tmp_path, c.x.contiguous(), list(block), c.scale, c.zero_point, c.minval,
                       c.quant_min, c.quant_max, "aligned", grad_factor=None)


def test_learned_scale_floor_is_the_same_bits_in_the_kernels(driver, tmp_path, monkeypatch):
    # Learned scales an optimizer pushed to 0 or below reach the op as fp32
    # eps (the floor convert freezes); the kernels take that floor as the
    # CPU does: y, mask and dx the same bits as a training forward on the CPU.
    from pt2e_fq import FakeQuantize, QSpec
    from pt2e_fq.spec.formats import INT8
    from pt2e_fq.spec.granularity import PerChannel

    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    point = FakeQuantize(QSpec(INT8, PerChannel(0), "asymmetric", learnable=True))
    point(x)
    point.disable_observer()
    with torch.no_grad():
        point.scale.view(-1)[:3] = torch.tensor([-2.0, -3.0, 0.0])
    taken = []
    learnable_op = ops.fake_quantize_affine_learnable

    def spy(x, block_size, scale, *args, **kwargs):
        taken.append(scale.detach().clone())
        return learnable_op(x, block_size, scale, *args, **kwargs)

    monkeypatch.setattr(ops, "fake_quantize_affine_learnable", spy)
    y = point(x).detach()
    (scale,) = taken
    eps = torch.finfo(torch.float32).eps
    assert_bits_equal(scale.view(-1)[:3], torch.full((3,), eps))
    zero_point = point.zero_point.detach().clamp(-128, 127).round().to(torch.int32)  # as the op applies it
    case, (y_cpu, mask) = affine_forward(tmp_path, x, [1, 64], scale, zero_point, None, -128, 127, "aligned")
    assert_bits_equal(y_cpu, y)
    assert_forward_and_backward(driver, tmp_path, case, (y, mask), "aligned")
    learnable_backward(driver, tmp_path, x, [1, 64], scale, point.zero_point.detach(), None, -128, 127, "aligned")


# ---------------------------------------------------------------------------
# The fused observe ops. The range state is compared with the observers'
# torch ops (bit for bit: min, max and the moving average round alike on
# any device). The qparams with a reference written here for CUDA's
# arithmetic: ATen's CUDA kernels divide a tensor by a Python float by
# multiplying with the float's fp32 reciprocal, and the kernels copy that
# (the harness compiles the device branch); y and the mask with the CPU
# static op on those qparams.

SCHEMES = {"symmetric": 0, "asymmetric": 1, "minval": 2, "symmetric_no_clip": 3}


def _by_cuda_scalar(t: torch.Tensor, b: float) -> torch.Tensor:
    """ATen CUDA's `fp32 tensor / python float`: t * fp32(1 / fp32(b))."""
    return t * (torch.tensor(1.0) / torch.tensor(b, dtype=torch.float32))


def _cuda_affine_qparams(lo, hi, scheme, qmin, qmax, limit):
    empty = lo > hi
    lo, hi = torch.where(empty, 0.0, lo).clamp(-limit, limit), torch.where(empty, 0.0, hi).clamp(-limit, limit)
    eps = torch.finfo(torch.float32).eps
    if scheme == "minval":
        return _by_cuda_scalar(hi - lo, float(qmax - qmin)).clamp(min=eps), lo
    if scheme == "symmetric":
        amax = torch.maximum(-lo.clamp(max=0), hi.clamp(min=0))
        scale = _by_cuda_scalar(amax, (qmax - qmin) / 2).clamp(min=eps)
        return scale, torch.full_like(scale, (qmin + qmax + 1) // 2, dtype=torch.int32)
    if scheme == "symmetric_no_clip":
        middle = (qmin + qmax + 1) // 2
        below = _by_cuda_scalar(-lo.clamp(max=0), float(middle - qmin))
        scale = torch.maximum(below, _by_cuda_scalar(hi.clamp(min=0), float(qmax - middle))).clamp(min=eps)
        return scale, torch.full_like(scale, middle, dtype=torch.int32)
    min_neg = lo.clamp(max=0)
    scale = _by_cuda_scalar(hi.clamp(min=0) - min_neg, float(qmax - qmin)).clamp(min=eps)
    return scale, (qmin - torch.round(min_neg / scale).to(torch.int32)).clamp(qmin, qmax)


def _observe_input(shape, dtype, seed):
    """No exact zeros (the kernels keep -0.0 as a block's min, torch.amin
    either zero); NaN and Inf here and there, and the first block all NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3 + 0.25
    x = torch.where(x == 0, 0.5, x).reshape(-1)
    x[torch.randint(0, x.numel(), (3,), generator=g)] = float("nan")
    x[torch.randint(0, x.numel(), (2,), generator=g)] = float("inf")
    return x.reshape(shape).to(dtype)


OBSERVE_VARIANTS = [  # shape, block
    ((4, 70), (4, 70)),  # per-tensor
    ((6, 50), (1, 50)),  # per-channel
    ((3, 100), (1, 32)),  # per-group, ragged last group
    ((2, 5, 9), (1, 5, 3)),  # 3-D blocks
]


@pytest.mark.parametrize("shape,block", OBSERVE_VARIANTS, ids=str)
@pytest.mark.parametrize("kind", ["symmetric", "symmetric_no_clip", "asymmetric", "minval", "e4m3", "e2m1"])
@pytest.mark.parametrize("averaging", [None, 0.25])
@pytest.mark.parametrize("dtype,placement", [(torch.float32, "aligned"), (torch.bfloat16, "misaligned"),
                                             (torch.float16, "aligned")])
def test_observe_kernels_equal_the_observers_and_cuda_qparams(driver, tmp_path, shape, block, kind, averaging,
                                                              dtype, placement):
    x = _observe_input(shape, dtype, seed=len(shape) + len(kind))
    if kind == "minval" or kind == "asymmetric":
        qmin, qmax = 0, 255
    elif kind == "symmetric_no_clip":  # a signed range's sides differ by one code
        qmin, qmax = -8, 7
    else:
        qmin, qmax = -127, 127
    # A running range from an earlier batch; block 0 never saw a finite value.
    lo, hi = block_min_max(_observe_input(shape, dtype, seed=99) * 0.5, block)
    lo[(0,) * lo.dim()], hi[(0,) * hi.dim()] = math.inf, -math.inf
    count = torch.tensor([5], dtype=torch.int64)
    affine = kind in SCHEMES
    fields = dict(block=",".join(map(str, block)), moving=int(averaging is not None), c=averaging or 0,
                  kind="affine" if affine else kind)
    if affine:
        limit = int_range_limit(dtype, qmin, qmax, Scheme("asymmetric" if kind == "minval" else kind))
        fields.update(scheme=SCHEMES[kind], qmin=qmin, qmax=qmax, range_limit=repr(limit))
    case = Case(tmp_path, "observe", "observe", x, placement, **fields)
    case.put("min_val.bin", lo)
    case.put("max_val.bin", hi)
    case.put("nonfinite.bin", count)
    offset_dtype = torch.float32 if kind == "minval" else torch.int32
    if affine:
        case.put("offset.bin", torch.zeros(lo.shape, dtype=offset_dtype))
    simulate(driver, case)

    observer = observers.MinMaxObserver() if averaging is None else observers.MovingAverageMinMaxObserver(averaging)
    lo_ref, hi_ref = observer.update((lo, hi), block_min_max(x, block))
    assert_bits_equal(case.output("min_val_out.bin", torch.float32, lo.shape), lo_ref)
    assert_bits_equal(case.output("max_val_out.bin", torch.float32, hi.shape), hi_ref)
    assert int(case.output("nonfinite_out.bin", torch.int64, (1,))) == 5 + int((~torch.isfinite(x)).sum())
    if affine:
        scale_ref, offset_ref = _cuda_affine_qparams(lo_ref, hi_ref, kind, qmin, qmax, limit)
        zp, minval = (None, offset_ref) if kind == "minval" else (offset_ref, None)
        y_ref, mask_ref = torch.ops.pt2e_fq.fake_quantize_affine(x, list(block), scale_ref, zp, qmin, qmax, minval)
        assert_bits_equal(case.output("offset_out.bin", offset_dtype, lo.shape), offset_ref)
    else:
        empty = lo_ref > hi_ref
        amax = torch.maximum(torch.where(empty, 0.0, lo_ref).abs(), torch.where(empty, 0.0, hi_ref).abs())
        scale_ref = _by_cuda_scalar(amax, ELEMENTS[kind].fmax).clamp(min=torch.finfo(torch.float32).tiny)
        y_ref, mask_ref = torch.ops.pt2e_fq.fake_quantize_float(x, list(block), scale_ref, kind)
    assert_bits_equal(case.output("scale_out.bin", torch.float32, lo.shape), scale_ref)
    assert_bits_equal(case.output("y.bin", x.dtype, x.shape), y_ref)
    assert torch.equal(case.mask(), mask_ref), "packed mask differs"


@pytest.mark.parametrize("averaging", [0.01, 1.0])
def test_the_moving_average_kernel_between_opposite_fp32_extremes_stays_finite(driver, tmp_path, averaging):
    """A running range near -fp32 max and a batch near +fp32 max: batch -
    running overflows fp32 (observe.h moving_average). The kernel's range
    equals the observer's, finite, and so do the qparams."""
    x = torch.tensor([[3.06e38, 1.0e38]])
    lo, hi = torch.tensor([[-3.06e38]]), torch.tensor([[-3.0e38]])
    qmin, qmax = -2, 1
    limit = int_range_limit(torch.float32, qmin, qmax, Scheme.ASYMMETRIC)
    case = Case(tmp_path, "observe", "observe", x, "aligned", block="1,2", moving=1, c=averaging, kind="affine",
                scheme=SCHEMES["asymmetric"], qmin=qmin, qmax=qmax, range_limit=repr(limit))
    case.put("min_val.bin", lo)
    case.put("max_val.bin", hi)
    case.put("nonfinite.bin", torch.tensor([0], dtype=torch.int64))
    case.put("offset.bin", torch.zeros(lo.shape, dtype=torch.int32))
    simulate(driver, case)
    lo_ref, hi_ref = observers.MovingAverageMinMaxObserver(averaging).update((lo, hi), block_min_max(x, [1, 2]))
    assert torch.isfinite(lo_ref).all() and torch.isfinite(hi_ref).all()
    assert_bits_equal(case.output("min_val_out.bin", torch.float32, lo.shape), lo_ref)
    assert_bits_equal(case.output("max_val_out.bin", torch.float32, hi.shape), hi_ref)
    scale_ref, zp_ref = _cuda_affine_qparams(lo_ref, hi_ref, "asymmetric", qmin, qmax, limit)
    assert torch.isfinite(scale_ref).all()
    assert_bits_equal(case.output("scale_out.bin", torch.float32, lo.shape), scale_ref)
    assert_bits_equal(case.output("offset_out.bin", torch.int32, lo.shape), zp_ref)


@pytest.mark.parametrize(
    "variant,fmt,dtype,placement", param_grid(FLOAT_VARIANTS, ELEM_DTYPES, FLOAT_DTYPES, PLACEMENTS)
)
def test_float_kernel_equals_cpu(driver, tmp_path, variant, fmt, dtype, placement):
    _, shape, block = variant
    g = torch.Generator().manual_seed(11)
    scale = torch.rand([-(-s // b) for s, b in zip(shape, block)], generator=g) * 0.5 + 0.01
    x = with_specials((torch.randn(shape, generator=g) * reference.FLOAT_FORMATS[fmt][0] * 0.3).to(dtype), seed=5)
    if placement == "empty":
        x, scale = x[:0], scale[:0]
    name = _checks._elem_format("fake_quantize_float", "dtype", fmt)
    expected = torch.ops.pt2e_fq.fake_quantize_float(x, list(block), scale, name)
    case = Case(tmp_path, "float", "float", x, placement, block=",".join(map(str, block)), fmt=name)
    case.put("scale.bin", scale)
    assert_forward_and_backward(driver, tmp_path, case, expected, placement)


def block_scaled_input(shape, axis, dtype, placement, seed):
    x = block_input(shape, dtype, seed)
    return (x.narrow(axis, 0, 0) if placement == "empty" else x), axis % len(shape)


@pytest.mark.parametrize(
    "shape,fmt,dtype,placement", param_grid(BLOCK_SHAPES, ELEM_DTYPES, FLOAT_DTYPES, PLACEMENTS)
)
def test_mx_kernel_equals_cpu(driver, tmp_path, shape, fmt, dtype, placement):
    x, axis = block_scaled_input(shape[1], shape[2], dtype, placement, seed=7)
    name = _checks._elem_format("fake_quantize_mx", "elem_dtype", fmt)
    y, mask, scales = torch.ops.pt2e_fq.fake_quantize_mx(x, name, 32, axis)
    case = Case(tmp_path, "mx", "mx", x, placement, fmt=name, block=32, axis=axis)
    assert_forward_and_backward(driver, tmp_path, case, (y, mask), placement, [("scales.bin", scales)])


@pytest.mark.parametrize("block", [1, 7, 16, 64])
def test_mx_kernel_with_other_block_sizes_equals_cpu(driver, tmp_path, block):
    x = block_input((33, 90), torch.bfloat16, seed=13)
    y, mask, scales = torch.ops.pt2e_fq.fake_quantize_mx(x, "e2m1", block, 1)
    case = Case(tmp_path, "mx", "mx", x, "aligned", fmt="e2m1", block=block, axis=1)
    assert_forward_and_backward(driver, tmp_path, case, (y, mask), "aligned", [("scales.bin", scales)])


@pytest.mark.parametrize(
    "shape,global_scale,dtype,placement", param_grid(BLOCK_SHAPES, ("computed", "given"), FLOAT_DTYPES, PLACEMENTS)
)
def test_nvfp4_kernel_equals_cpu(driver, tmp_path, shape, global_scale, dtype, placement):
    x, axis = block_scaled_input(shape[1], shape[2], dtype, placement, seed=9)
    given = torch.tensor(0.0123) if global_scale == "given" else None
    y, mask, scales, used = torch.ops.pt2e_fq.fake_quantize_nvfp4(x, given, axis)
    case = Case(tmp_path, "nvfp4", "nvfp4", x, placement, axis=axis, **{"global": int(given is not None)})
    if given is not None:
        case.put("global.bin", given)
    extra = [("scales.bin", scales), ("global_out.bin", used.reshape(()))]
    assert_forward_and_backward(driver, tmp_path, case, (y, mask), placement, extra)


@pytest.mark.parametrize("placement", ["aligned", "misaligned"])
def test_ste_kernel_equals_cpu_for_every_tail_length(driver, tmp_path, dtype, placement):
    cases, expected = [], []
    for n in (1, 7, 8, 9, 31, 33, 255, 257, 1000, 4103, 70001):
        mask = reference.pack_mask(torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.5)
        (tmp_path / str(n)).mkdir()
        case, dx = ste_case(tmp_path / str(n), mask, torch.empty(n, dtype=dtype), placement)
        cases.append(case)
        expected.append(dx)
    simulate(driver, *cases)
    for case, dx in zip(cases, expected):
        assert_bits_equal(case.output("dx.bin", dx.dtype, dx.shape), dx)


# ---------------------------------------------------------------------------
# Two generations of kernels. PT2E_FQ_CUDA_KERNELS=previous selects the
# kernels as they were before the latest rework (one vector a lane in the
# blockwise kernel; one thread a block for MX / NVFP4 blocks along an outer
# axis), kept so that one GPU run times both; both stay bit-exact.

PREVIOUS = {"PT2E_FQ_CUDA_KERNELS": "previous"}
KERNELS = {"current": None, "previous": PREVIOUS}

OUTER_AXIS_SHAPES = [
    # (id, shape, axis): blocks along an outer axis (inner > 1), the column kernel's.
    ("inner_5_ragged", (70, 5), 0),  # several blocks in one warp, a short last block
    ("inner_48", (64, 48), 0),  # warps across two blocks, runs of mask bits across words
    ("inner_64", (40, 64), 0),  # runs on whole words
    ("inner_33_middle_axis", (3, 45, 33), 1),
    ("many_columns", (33, 3000), 0),  # more columns than the harness's grid has threads
]


def _block_scaled_case(root, x, axis, op, fmt=None):
    """A MX (block 32) or NVFP4 (computed global scale) case and the CPU's y, mask and extras."""
    if op == "mx":
        y, mask, scales = torch.ops.pt2e_fq.fake_quantize_mx(x, fmt, 32, axis)
        case = Case(root, f"mx_{fmt}", "mx", x, "aligned", fmt=fmt, block=32, axis=axis)
        return case, (y, mask), [("scales.bin", scales)]
    y, mask, scales, used = torch.ops.pt2e_fq.fake_quantize_nvfp4(x, None, axis)
    case = Case(root, "nvfp4", "nvfp4", x, "aligned", axis=axis, **{"global": 0})
    return case, (y, mask), [("scales.bin", scales), ("global_out.bin", used.reshape(()))]


@pytest.mark.parametrize("shape", OUTER_AXIS_SHAPES, ids=lambda s: s[0])
@pytest.mark.parametrize("kernels", KERNELS)
def test_block_scaled_kernels_on_outer_axes_equal_cpu(driver, tmp_path, shape, kernels):
    _, shape, axis = shape
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for op, fmt in (("mx", "e4m3"), ("mx", "e2m1"), ("nvfp4", None)):
            root = tmp_path / f"{op}{fmt}{DTYPE_NAMES[dtype]}"
            root.mkdir()
            cases.append(_block_scaled_case(root, block_input(shape, dtype, seed=len(cases)), axis, op, fmt))
    simulate(driver, *(c for c, _, _ in cases), env=KERNELS[kernels])
    for case, (y, mask), extra in cases:
        assert_bits_equal(case.output("y.bin", case.x.dtype, case.x.shape), y)
        assert torch.equal(case.mask(), mask), f"{case.dir.name}: packed mask differs"
        for name, want in extra:
            assert_bits_equal(case.output(name, want.dtype, want.shape), want)


@pytest.mark.parametrize("variant", AFFINE_VARIANTS, ids=lambda v: v[0])
def test_previous_blockwise_kernel_equals_cpu(driver, tmp_path, variant):
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        x, block, qparams, (qmin, qmax) = _affine_inputs(variant, dtype, "aligned")
        (tmp_path / DTYPE_NAMES[dtype]).mkdir()
        cases.append(affine_forward(tmp_path / DTYPE_NAMES[dtype], x, block, *qparams, qmin, qmax, "aligned"))
    simulate(driver, *(c for c, _ in cases), env=PREVIOUS)
    for case, (y, mask) in cases:
        assert_bits_equal(case.output("y.bin", case.x.dtype, case.x.shape), y)
        assert torch.equal(case.mask(), mask), "packed mask differs"


# The tests above must fail when the code they claim to run is broken: each
# mutation below breaks one part of a kernel in a copy of csrc/cuda, and the
# case must then fail under the kernels that contain that part and pass
# under the others (which also shows the switch selects what it says).


def _affine_per_tensor(root):
    # 8643 fp32 elements: whole tiles of 4 sub-tiles, then a partial tile
    # holding 3 whole sub-tiles and a tail.
    x, block, qparams, (qmin, qmax) = _affine_inputs(AFFINE_VARIANTS[0], torch.float32, "aligned")
    return affine_forward(root, x, block, *qparams, qmin, qmax, "aligned") + ((),)


def _mx_inner_48(root):
    return _block_scaled_case(root, block_input((64, 48), torch.float32, seed=3), 0, "mx", "e4m3")


MUTATIONS = [
    # (id, file, original, mutated, the .cu compiled with it, case, the kernels that contain it)
    ("tile_mask_words_of_every_sub_tile", "elementwise.cuh",
     "write_tile_mask<VEC>(bits[u], lane, mask + (base + u * kSub) / 32);",
     "write_tile_mask<VEC>(bits[u], lane, mask + base / 32);", "affine_kernels.cu", _affine_per_tensor, "current"),
    ("whole_sub_tiles_of_the_partial_tile", "elementwise.cuh",
     "write_tile_mask<VEC>(bits, lane, mask + sub / 32);",
     "write_tile_mask<VEC>(bits, lane, mask + base / 32);", "affine_kernels.cu", _affine_per_tensor, "current"),
    ("column_kernel_run_into_the_next_word", "float_kernels.cu",
     "if (high) atomicOr(mask + (i >> 5) + 1, high);", "", "float_kernels.cu", _mx_inner_48, "current"),
    ("column_kernel_run_ends_at_its_block", "float_kernels.cu",
     "const uint32_t seg_mask = seg_len >= 32 ? 0xFFFFFFFFu : (1u << seg_len) - 1u;",
     "const uint32_t seg_mask = 0xFFFFFFFFu;", "float_kernels.cu", _mx_inner_48, "current"),
    ("thread_per_block_kernel_mask", "float_kernels.cu",
     "m.add(i, in_range);", "m.add(i, !in_range);", "float_kernels.cu", _mx_inner_48, "previous"),
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m[0])
def test_a_broken_kernel_fails_its_comparison(tmp_path, mutation):
    _, name, original, mutated, compiled, make_case_, broken_in = mutation
    text = (CUDA_DIR / name).read_text()
    assert text.count(original) == 1, f"{name} no longer holds the mutated line: update MUTATIONS"
    copy = tmp_path / "cuda"
    shutil.copytree(CUDA_DIR, copy)
    (copy / name).write_text(text.replace(original, mutated))
    exe = build_driver({compiled: copy})
    for kernels, env in KERNELS.items():
        (tmp_path / kernels).mkdir()
        case, expected, extra = make_case_(tmp_path / kernels)
        if kernels == broken_in:
            with pytest.raises(AssertionError):
                assert_forward_and_backward(exe, tmp_path / kernels, case, expected, "aligned", extra, env=env)
        else:
            assert_forward_and_backward(exe, tmp_path / kernels, case, expected, "aligned", extra, env=env)


# ---------------------------------------------------------------------------
# Past 2^31 elements: a device with enough multiprocessors that the grid needs
# no grid-stride step, and only its last blocks run (they cover at least the
# last 3 * 8 warps * 256 fp16 elements); the driver computes on sparse
# buffers and returns the last TAIL elements.

HUGE = {"PT2E_FQ_SIM_SMS": str(1 << 20), "PT2E_FQ_SIM_LAST_BLOCKS": "4"}
TAIL = 4096


def big_shape(cols: int) -> tuple[int, int]:
    rows = -(-(2**31 + 5000) // cols)
    return rows, cols


def tail_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The mask bits of the last TAIL elements from the driver's mask bytes,
    which start at the byte holding bit numel - TAIL."""
    bits = (packed.int().unsqueeze(1) >> torch.arange(8)) & 1
    first = (numel - TAIL) % 8
    return bits.reshape(-1)[first:first + TAIL].bool()


@pytest.mark.parametrize("cols", [2**15, 2**15 + 3], ids=["vector_lookup", "element_lookup_partial_tile"])
def test_affine_kernel_past_2_pow_31_elements(driver, tmp_path, cols):
    rows, cols = big_shape(cols)
    numel = rows * cols
    assert numel > 2**31
    g = torch.Generator().manual_seed(cols)
    scale = torch.rand(rows, 1, generator=g) * 0.05 + 0.001
    x_tail = (torch.randn(TAIL, generator=g) * 3).half()
    case = Case(tmp_path, "affine", "affine", x_tail, "aligned", shape=(rows, cols), block=f"1,{cols}",
                qmin=-128, qmax=127, zp=0, minval=0, tail=TAIL)
    case.put("scale.bin", scale)
    simulate(driver, case, env=HUGE)
    # The last TAIL elements lie in the last row.
    y_ref, mask_ref = torch.ops.pt2e_fq.fake_quantize_affine(x_tail.reshape(1, TAIL), [1, TAIL], scale[-1:],
                                                             None, -128, 127, None)
    assert_bits_equal(read(case.dir / "y.bin", torch.float16, (1, TAIL)), y_ref)
    mask = tail_bits(read(case.dir / "mask.bin", torch.uint8, (-1,)), numel)
    assert torch.equal(mask, tail_bits(mask_ref, TAIL)), "mask bits of the tail differ"


def test_ste_kernel_past_2_pow_31_elements(driver, tmp_path):
    rows, cols = big_shape(2**15)
    numel = rows * cols
    g = torch.Generator().manual_seed(1)
    dy = torch.randn(TAIL, generator=g).half()
    bits = torch.rand(TAIL, generator=g) < 0.5
    first = (numel - TAIL) % 8
    case = Case(tmp_path, "ste", "ste", dy, "aligned", shape=(rows, cols), tail=TAIL)
    case.put("dy.bin", dy)
    case.put("mask.bin", reference.pack_mask(torch.cat([torch.zeros(first, dtype=torch.bool), bits])))
    simulate(driver, case, env=HUGE)
    expected = torch.ops.pt2e_fq.ste_grad(dy, reference.pack_mask(bits))
    assert_bits_equal(read(case.dir / "dx.bin", torch.float16, (TAIL,)), expected)


# ---------------------------------------------------------------------------
# The harness itself: correct collectives, and what it must stop.


@pytest.mark.parametrize(
    "name,message",
    [
        ("collectives", None),
        ("early_exit_before_ballot", "__ballot_sync not reached by every lane of the warp"),
        ("divergent_ballots", "divergent warp"),
        ("early_exit_before_syncthreads", "__syncthreads not reached by every thread of the block"),
        ("write_past_the_end", "AddressSanitizer: heap-buffer-overflow"),
    ],
)
def test_harness_runs_collectives_and_stops_undefined_behaviour(driver, name, message):
    done = run(driver, "--selftest", name)
    if message is None:
        assert done.returncode == 0, done.stderr[-2000:]
    else:
        assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]
        if "AddressSanitizer" not in message:
            assert f"in {name} at line" in done.stderr  # names the kernel
