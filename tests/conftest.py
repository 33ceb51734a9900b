"""Shared helpers for the op tests: the op and the reference side by side,
NaN-aware bit-exact comparison, Hypothesis strategies for op arguments, and
the devices the kernels run on.

Every expected value comes from `pt2e_fq.reference` (pure torch, independent
of the kernels), from ATen, or from hand-computed numbers in the test itself.

A test that runs the CUDA kernels carries the `requires_cuda_kernels` marker
(a whole file through `pytestmark`, or the "cuda" case of `DEVICES`); where
they cannot run it is skipped with the reason (`pytest -rs` prints it), and
`pytest -m requires_cuda_kernels` selects every such test.

A test of something an older torch than CI's gets wrong in torch itself
(its exporter, its fake tensors) carries `needs_torch("2.13", why)`: on the
older torch the project admits (2.11, the GPU machine's) it is skipped with
that reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional

import pytest
import torch
from hypothesis import strategies as st

import pt2e_fq  # noqa: F401  (registers torch.ops.pt2e_fq)
from pt2e_fq import ops, reference
from pt2e_fq.ops.blocks import reduced_shape
from pt2e_fq.plugins.torchvision import allow_torchvision_import

# The models extra installs torchvision, whose PyPI wheel cannot load its C ops
# beside a CPU torch; transformers' modeling_utils imports it wherever it is
# installed, so every test building a Hugging Face model needs this first.
allow_torchvision_import()

# ---------------------------------------------------------------------------
# Devices

CUDA_OPS = ("fake_quantize_affine", "ste_grad", "fake_quantize_float", "fake_quantize_mx", "fake_quantize_nvfp4")

requires_cuda_kernels = pytest.mark.requires_cuda_kernels

# Every device the kernels are tested on: `@pytest.mark.parametrize("device",
# DEVICES)`, the way pytorch/extension-cpp's tests run each test on "cpu" and
# on "cuda" where the extension has CUDA kernels.
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda_kernels)]


def cuda_kernels_missing() -> Optional[str]:
    """Why the CUDA kernels cannot run here, or None where they can."""
    if not torch.cuda.is_available():
        return "no CUDA device: the CUDA kernels are tested on a GPU machine"
    missing = [op for op in CUDA_OPS if not torch._C._dispatch_has_kernel_for_dispatch_key(f"pt2e_fq::{op}", "CUDA")]
    if missing:
        return (f"pt2e_fq was built without CUDA kernels (no CUDA kernel for {', '.join(missing)}): "
                "rebuild with PT2E_FQ_CUDA=1")
    return None


def torch_release(version: str) -> tuple[int, ...]:
    """(major, minor) of a torch version string: "2.11.0+cu130" -> (2, 11)."""
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


def pytest_configure(config):
    # Under pytest-xdist (make test: -n auto) each worker gets its share of
    # the cores, so that N workers do not each start a thread per core.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    config.addinivalue_line(
        "markers",
        "requires_cuda_kernels: runs pt2e_fq's CUDA kernels; skipped, with the reason, where there is "
        "no CUDA device or pt2e_fq was built without them",
    )
    config.addinivalue_line(
        "markers",
        "needs_torch(version, why): behaviour of torch's own that an older torch the project admits "
        "(pyproject: torch >= 2.11) lacks; skipped there, with why",
    )


def pytest_collection_modifyitems(config, items):
    reason = cuda_kernels_missing()
    release = torch_release(torch.__version__)
    for item in items:
        if reason is not None and item.get_closest_marker("requires_cuda_kernels") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
        needs = item.get_closest_marker("needs_torch")
        if needs is not None and release < torch_release(needs.args[0]):
            item.add_marker(pytest.mark.skip(
                reason=f"needs torch >= {needs.args[0]} (this is {torch.__version__}): {needs.args[1]}"))


def to_device(args, device: str) -> tuple:
    """args with every tensor on `device`, as a leaf that requires grad if
    the original did."""
    return tuple(
        a.detach().to(device).requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args
    )


# ---------------------------------------------------------------------------
# Op cases and comparisons

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}

# (name, quant_min, quant_max): int2..int8, unsigned, int16.
QUANT_RANGES = (
    [(f"int{b}", -(2 ** (b - 1)), 2 ** (b - 1) - 1) for b in range(2, 9)]
    + [("uint4", 0, 15), ("uint8", 0, 255), ("int16", -(2**15), 2**15 - 1)]
)


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype, shape and bits, except that any NaN equals any NaN."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan), "NaN positions differ"
    a, e = actual[~nan], expected[~nan]
    if a.dtype.is_floating_point:
        a, e = a.view(_INT_VIEW[a.dtype]), e.view(_INT_VIEW[e.dtype])
    diff = (a != e).nonzero()
    assert diff.numel() == 0, (
        f"{diff.shape[0]} of {a.numel()} elements differ, first at {diff[0].tolist()}: "
        f"{actual[~nan][diff[0]].tolist()} != {expected[~nan][diff[0]].tolist()}"
    )


@dataclass
class AffineCase:
    """The arguments of one fake_quantize_affine call."""

    x: torch.Tensor
    block_size: list[int]
    scale: torch.Tensor
    zero_point: Optional[torch.Tensor]
    quant_min: int
    quant_max: int
    minval: Optional[torch.Tensor] = None

    def args(self):
        return (self.x, self.block_size, self.scale, self.zero_point, self.quant_min, self.quant_max)

    def op(self):
        """(y, packed mask) from the op under test."""
        return ops.fake_quantize_affine_with_mask(*self.args(), minval=self.minval)

    def to(self, device) -> "AffineCase":
        """The same case with every tensor on `device`."""
        tensors = {k: getattr(self, k) for k in ("x", "scale", "zero_point", "minval")}
        return replace(self, **{k: t.to(device) for k, t in tensors.items() if t is not None})

    def ref(self):
        """(y, bool mask, packed mask) from the reference."""
        y, mask = reference.fake_quantize_affine(*self.args(), minval=self.minval)
        return y, mask, reference.pack_mask(mask)


def make_case(
    shape,
    block_size,
    dtype=torch.float32,
    qrange=(-128, 127),
    *,
    zp: str = "random",  # "random", "none" or "minval"
    seed: int = 0,
) -> AffineCase:
    """A case with x spread over the in-range and the clamped region."""
    g = torch.Generator().manual_seed(seed)
    qmin, qmax = qrange
    rshape = reduced_shape(shape, block_size)
    scale = torch.rand(rshape, generator=g) * 0.5 + 0.01
    zero_point = minval = None
    if zp == "random":
        zero_point = torch.randint(qmin, qmax + 1, rshape, generator=g, dtype=torch.int32)
    elif zp == "minval":
        minval = torch.randn(rshape, generator=g) * 4
    spread = float(scale.max()) * (qmax - qmin) * 0.7 if scale.numel() else 1.0
    x = (torch.randn(shape, generator=g) * spread).to(dtype)
    return AffineCase(x, list(block_size), scale, zero_point, qmin, qmax, minval)


# ---------------------------------------------------------------------------
# Hypothesis strategies

_dim = st.one_of(st.integers(1, 5), st.integers(6, 70), st.integers(71, 5000))


@st.composite
def shapes_and_blocks(draw, max_dims: int = 4, max_numel: int = 40_000):
    """A shape of 1..max_dims dimensions (size-1 ones included) and a block
    size per dimension: full, 1, ragged, or larger than the dimension."""
    shape, numel = [], 1
    for _ in range(draw(st.integers(1, max_dims))):
        size = min(draw(_dim), max(1, max_numel // numel))
        shape.append(size)
        numel *= size
    blocks = [draw(st.sampled_from([s, 1, max(1, s // 2), max(1, (s + 2) // 3), s + 3])) for s in shape]
    return shape, blocks


def layouts():
    """How x is laid out in memory: contiguous, permuted or strided."""
    return st.sampled_from(["contiguous", "permuted", "strided"])


def with_layout(x: torch.Tensor, layout: str, perm_seed: int = 0) -> torch.Tensor:
    """x's values in a tensor with the given memory layout."""
    if layout == "contiguous" or x.dim() == 0:
        return x.contiguous()
    if layout == "strided":
        wide = list(x.shape[:-1]) + [2 * x.shape[-1]]
        return x.new_empty(wide)[..., ::2].copy_(x)
    perm = torch.randperm(x.dim(), generator=torch.Generator().manual_seed(perm_seed)).tolist()
    if perm == sorted(perm):
        perm = perm[::-1]
    inverse = [perm.index(d) for d in range(x.dim())]
    return x.new_empty([x.shape[p] for p in perm]).permute(inverse).copy_(x)


@st.composite
def affine_cases(draw, max_numel: int = 40_000) -> AffineCase:
    """Random op arguments: shapes, blocks, layouts, bit widths, formulations,
    qparam dtypes and x dtypes, with exact ties and NaN/Inf sprinkled in."""
    shape, block_size = draw(shapes_and_blocks(max_numel=max_numel))
    _, qmin, qmax = draw(st.sampled_from(QUANT_RANGES))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    formulation = draw(st.sampled_from(["zp", "none", "minval"]))
    seed = draw(st.integers(0, 2**32 - 1))
    g = torch.Generator().manual_seed(seed)

    rshape = reduced_shape(shape, block_size)
    scale_dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
    scale = torch.exp2(torch.rand(rshape, generator=g) * 14 - 10).to(scale_dtype)  # 2^-10 .. 2^4
    s = reference.expand_blocks(scale.float(), shape, block_size)
    width = qmax - qmin
    zero_point = minval = None
    if formulation == "zp":
        zp_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
        zero_point = torch.randint(qmin, qmax + 1, rshape, generator=g, dtype=zp_dtype)
    elif formulation == "minval":
        minval = torch.randn(rshape, generator=g) * scale.float() * width
        minval = minval.to(draw(st.sampled_from([torch.float32, torch.float64])))

    # x is centred on the grid's middle and spans it and beyond on both sides.
    if minval is not None:
        offset = reference.expand_blocks(minval.float(), shape, block_size)
        centre = offset + s * (width / 2)
    else:
        zp = 0 if zero_point is None else reference.expand_blocks(zero_point.float(), shape, block_size)
        offset = 0.0
        centre = s * ((qmin + qmax) / 2 - zp)
    x = centre + torch.randn(shape, generator=g) * s * (width * 0.6)
    if draw(st.booleans()):  # exact ties (x - offset) / scale = k + 0.5 wherever representable
        k = torch.randint(-width - 3, width + 3, shape, generator=g).float()
        x = torch.where(torch.rand(shape, generator=g) < 0.3, (k + 0.5) * s + offset, x)
    if draw(st.booleans()):
        special = torch.tensor([float("nan"), float("inf"), -float("inf")])
        pick = torch.randint(0, 3, shape, generator=g)
        x = torch.where(torch.rand(shape, generator=g) < 0.05, special[pick], x)
    x = with_layout(x.to(dtype), draw(layouts()), seed)
    return AffineCase(x, block_size, scale, zero_point, qmin, qmax, minval)


@pytest.fixture(params=FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request):
    return request.param


def cli_main(capsys, *args):
    """pt2e_fq.cli.command.main(args) in this process: (exit status, stdout, stderr)."""
    from pt2e_fq.cli import command

    try:
        rc = command.main(list(args))
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err
