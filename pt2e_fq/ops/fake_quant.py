"""Python entry points of the fused fake-quant operators.

Each public function validates its arguments (shapes and dtypes only: reading
values would sync the host with the device) and calls one `torch.ops.pt2e_fq`
operator, so torch.export and torch.compile see exactly one node. This module
also registers the operators' fake (meta) implementations; their autograd
is C++ (csrc/common/ste_autograd.cpp: dx through the bit-packed clamp mask,
the only tensor the node saves; learnable_autograd.cpp: the LSQ backward).
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from typing import Optional, Sequence, Union

import torch

from .blocks import MAX_BLOCK, check_block_size, check_qparam, reduced_shape
from ..spec.formats import ELEMENTS, MX_BLOCK, NVFP4_BLOCK, element

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT16_MIN, _INT16_MAX = -(2**15), 2**15 - 1

# The ops, looked up once (a torch.ops attribute chain costs ~0.3 us a call).
_OP_AFFINE = torch.ops.pt2e_fq.fake_quantize_affine.default
_OP_AFFINE_LEARNABLE = torch.ops.pt2e_fq.fake_quantize_affine_learnable.default
_OP_FLOAT = torch.ops.pt2e_fq.fake_quantize_float.default
_OP_MX = torch.ops.pt2e_fq.fake_quantize_mx.default
_OP_NVFP4 = torch.ops.pt2e_fq.fake_quantize_nvfp4.default


# Argument checks. The C++ kernels check every argument they read, so on the
# success path a wrapper only calls its op (a Python check costs more than
# the op on a small tensor, issue 15). When the op raises, the Python check
# below runs and, where it finds the argument at fault, raises its message,
# which names the argument, what was wrong and what is allowed. Two things
# the op's schema lets through are checked first: a bool or a 0-dim tensor
# where an int belongs (torch.ops would take True as 1).
#
# Under torch.compile and torch.export the wrappers leave the checks to the
# op's fake impl, which makes the same ones. A check traced by Dynamo
# surfaces as "Unsupported: Observed exception" under fullgraph=True; from
# the fake impl, the message comes through as written.


def _plain_ints(block_size, ints) -> bool:
    """Every entry of block_size (an int for MX) and of ints is an int."""
    try:
        types = set(map(type, block_size))
    except TypeError:  # not iterable
        types = {type(block_size)}
    types.update(map(type, ints))
    return types <= {int}


def _call(op, check, block_size, ints, *args):
    """op(*args), with `check(*args)` raising the precise error where the op
    fails or an entry of `block_size` or `ints` is not a plain int."""
    if torch.compiler.is_compiling():
        return op(*args)
    if not _plain_ints(block_size, ints):
        check(*args)
    try:
        return op(*args)
    except Exception as e:
        failure = e
    check(*args)  # outside the except block: its error is not shown as raised while handling the op's
    raise failure


def _check_x(op: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: x must be float32, bfloat16 or float16, got {x.dtype}")


def _check_affine_args(
    x, block_size, scale, zero_point, quant_min, quant_max, minval,
    op="pt2e_fq.fake_quantize_affine", float_zero_point=False,
) -> None:
    """float_zero_point: the learnable op also takes a floating zero point."""
    _check_x(op, x)
    check_block_size(op, x, block_size)
    for name, v in (("quant_min", quant_min), ("quant_max", quant_max)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{op}: {name} must be an int, got {type(v).__name__}")
    if not (_INT16_MIN <= quant_min <= quant_max <= _INT16_MAX):
        raise ValueError(
            f"{op}: need {_INT16_MIN} <= quant_min <= quant_max <= {_INT16_MAX}, "
            f"got quant_min={quant_min}, quant_max={quant_max}"
        )
    expected = reduced_shape(x.shape, block_size)
    check_qparam(op, "scale", scale, x, expected)
    if not scale.dtype.is_floating_point:
        raise TypeError(f"{op}: scale must be a floating-point tensor, got {scale.dtype}")
    if zero_point is not None:
        if minval is not None:
            raise ValueError(
                f"{op}: give zero_point (ZP formulation) or minval (MINVAL formulation), not both"
            )
        check_qparam(op, "zero_point", zero_point, x, expected)
        floating_ok = float_zero_point and zero_point.dtype.is_floating_point
        if not floating_ok and (
            zero_point.dtype.is_floating_point or zero_point.dtype.is_complex or zero_point.dtype == torch.bool
        ):
            allowed = "an integer or floating dtype" if float_zero_point else "an integer dtype"
            raise TypeError(f"{op}: zero_point must have {allowed}, got {zero_point.dtype}")
    if minval is not None:
        check_qparam(op, "minval", minval, x, expected)
        if not minval.dtype.is_floating_point:
            raise TypeError(f"{op}: minval must be a floating-point tensor, got {minval.dtype}")


def fake_quantize_affine_with_mask(
    x: torch.Tensor,
    block_size: Sequence[int],
    scale: torch.Tensor,
    zero_point: Optional[torch.Tensor],
    quant_min: int,
    quant_max: int,
    *,
    minval: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like `fake_quantize_affine`, and also returns the bit-packed clamp mask
    (uint8, ceil(numel / 8) bytes; see `unpack_mask`)."""
    return _call(
        _OP_AFFINE, _check_affine_args, block_size, (quant_min, quant_max),
        x, block_size, scale, zero_point, quant_min, quant_max, minval,
    )


def fake_quantize_affine(
    x: torch.Tensor,
    block_size: Sequence[int],
    scale: torch.Tensor,
    zero_point: Optional[torch.Tensor],
    quant_min: int,
    quant_max: int,
    *,
    minval: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Integer affine fake quantization in one fused op (differentiable).

    ZP formulation (minval=None):
        q = round_half_even(x / scale) + zero_point
        y = (clamp(q, quant_min, quant_max) - zero_point) * scale
    MINVAL formulation (zero_point=None, minval given):
        q = round_half_even((x - minval) / scale) + quant_min
        y = (clamp(q, quant_min, quant_max) - quant_min) * scale + minval

    `block_size` has one entry per dimension of x; scale, zero_point and minval
    have shape ceil(x.shape / block_size). zero_point=None means 0. The
    division is IEEE `x / scale` (as ONNX QuantizeLinear), computed in fp32; y
    has x's dtype. The gradient is `dy` where quant_min <= q <= quant_max and
    0 elsewhere. NaN gives NaN; +-Inf saturates to the clamp limits.
    """
    return fake_quantize_affine_with_mask(
        x, block_size, scale, zero_point, quant_min, quant_max, minval=minval
    )[0]


def unpack_mask(mask: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The bool clamp mask of the given shape (x's shape: ints >= 0) from its
    bit-packed form, which must hold at least one bit per element."""
    op = "pt2e_fq.unpack_mask"
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.uint8 or mask.dim() != 1:
        what = (
            f"a {mask.dim()}-dim {mask.dtype} tensor" if isinstance(mask, torch.Tensor) else type(mask).__name__
        )
        raise TypeError(f"{op}: mask must be a 1-D uint8 tensor (the packed mask), got {what}")
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise TypeError(f"{op}: shape must be a sequence of ints (x's shape), got {type(shape).__name__}")
    numel = 1
    for d, s in enumerate(shape):
        if not isinstance(s, (int, torch.SymInt)) or isinstance(s, bool):
            raise TypeError(f"{op}: shape[{d}] must be an int, got {type(s).__name__}")
        if s < 0:
            raise ValueError(f"{op}: shape[{d}] must be >= 0 (x's shape, no -1), got {s}")
        numel *= s
    # Traced sizes (SymInt) come with the op's own mask, which always fits:
    # comparing them would add a shape guard to an exported program.
    if not isinstance(numel, torch.SymInt) and 8 * mask.numel() < numel:
        raise ValueError(
            f"{op}: mask has {mask.numel()} bytes, too few for shape {tuple(shape)}: "
            f"needs ceil({numel} / 8) = {(numel + 7) // 8}"
        )
    # Element i is bit i % 8 of byte i // 8. Indexed, not sliced from all the
    # bits: a slice [:numel] of 8 * mask.numel() bits makes torch.export guard
    # on their relation, which it cannot prove for a dynamic batch.
    i = torch.arange(numel, device=mask.device)
    flat = (mask[i // 8] >> (i % 8).to(torch.uint8)) & 1
    return flat.bool().reshape(tuple(shape))


_LEARNABLE_OP = "pt2e_fq.fake_quantize_affine_learnable"


def _check_learnable_args(x, block_size, scale, zero_point, quant_min, quant_max, grad_factor, minval) -> None:
    _check_affine_args(x, block_size, scale, zero_point, quant_min, quant_max, minval, _LEARNABLE_OP, True)
    if grad_factor is None:
        if quant_max < 1:
            raise ValueError(
                f"{_LEARNABLE_OP}: the default grad_factor, LSQ's 1 / sqrt(block_numel * quant_max), needs "
                f"quant_max >= 1 (positive levels), got quant_max={quant_max}; pass grad_factor explicitly"
            )
        return
    if not isinstance(grad_factor, (int, float)) or isinstance(grad_factor, bool):
        raise TypeError(f"{_LEARNABLE_OP}: grad_factor must be a float or None, got {type(grad_factor).__name__}")
    if not (math.isfinite(grad_factor) and grad_factor > 0):
        raise ValueError(f"{_LEARNABLE_OP}: grad_factor must be finite and > 0, got {grad_factor}")


def fake_quantize_affine_learnable(
    x: torch.Tensor,
    block_size: Sequence[int],
    scale: torch.Tensor,
    zero_point: Optional[torch.Tensor],
    quant_min: int,
    quant_max: int,
    grad_factor: Optional[float] = None,
    *,
    minval: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """`fake_quantize_affine` with learnable ranges (LSQ / LSQ+) in one fused
    op: y is the same bits, and the backward gives, besides the
    straight-through dx, per block (rounding taken straight through):

        d scale  = grad_factor * sum(dy * (round(v) - v))        inside the range,
                                  + sum(dy * (q_limit - offset)) outside it
        d minval = grad_factor * sum(dy outside the range)        (MINVAL, LSQ+)
        d zero_point = -grad_factor * scale * sum(dy outside)      (a floating zero point)

    with v = (x - minval) / scale, q_limit the clamp limit that q passed and
    offset the integer offset (zero point, or quant_min for MINVAL). A
    floating zero_point is used as round_half_even(clamp(zero_point,
    quant_min, quant_max)); an integer one gets no gradient. grad_factor
    None (the default) is the LSQ paper's per block,
    1 / sqrt(block_numel * quant_max) with block_numel that block's own
    element count (a ragged last block has fewer), computed by the kernel;
    a float applies to every block as given. The sums are fp32 in an order
    fixed by the sizes (the same bits for any thread count). NaN in x gives
    a NaN d scale for its block.
    """
    if type(grad_factor) is int:  # the op takes a float
        grad_factor = float(grad_factor)
    if grad_factor is not None and type(grad_factor) is not float:  # e.g. a bool, which the op would take as 1.0
        _check_learnable_args(x, block_size, scale, zero_point, quant_min, quant_max, grad_factor, minval)
    return _call(
        _OP_AFFINE_LEARNABLE, _check_learnable_args,
        block_size, (quant_min, quant_max), x, block_size, scale, zero_point, quant_min, quant_max, grad_factor,
        minval,
    )


# ---------------------------------------------------------------------------
# Fake implementations (shape propagation for torch.export / torch.compile)


def _empty_outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    mask = x.new_empty(((x.numel() + 7) // 8,), dtype=torch.uint8)
    return y, mask


@torch.library.register_fake("pt2e_fq::fake_quantize_affine")
def _fake_quantize_affine_fake(x, block_size, scale, zero_point, quant_min, quant_max, minval=None):
    _check_affine_args(x, block_size, scale, zero_point, quant_min, quant_max, minval)
    return _empty_outputs(x)


@torch.library.register_fake("pt2e_fq::fake_quantize_affine_learnable")
def _fake_quantize_affine_learnable_fake(x, block_size, scale, zero_point, quant_min, quant_max, grad_factor,
                                         minval=None):
    _check_learnable_args(x, block_size, scale, zero_point, quant_min, quant_max, grad_factor, minval)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("pt2e_fq::fake_quantize_affine_learnable_backward")
def _fake_quantize_affine_learnable_backward_fake(grad, x, block_size, scale, zero_point, quant_min, quant_max,
                                                  grad_factor, minval=None):
    _check_learnable_args(x, block_size, scale, zero_point, quant_min, quant_max, grad_factor, minval)
    if grad.shape != x.shape or grad.dtype != x.dtype:
        raise ValueError(
            f"{_LEARNABLE_OP}_backward: grad must have x's shape {tuple(x.shape)} and dtype {x.dtype}, "
            f"got {tuple(grad.shape)} {grad.dtype}"
        )
    per_block = x.new_empty(reduced_shape(x.shape, block_size), dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), per_block, torch.empty_like(per_block)


@torch.library.register_fake("pt2e_fq::ste_grad")
def _ste_grad_fake(grad, mask):
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


# ---------------------------------------------------------------------------
# Autograd is C++, with no Python on the call: the straight-through ops'
# (csrc/common/ste_autograd.cpp: reverse and forward mode) and the learnable
# op's (csrc/common/learnable_autograd.cpp: reverse mode). The first calls
# back here only to warn about a qparam that requires grad.

_QPARAM_GRAD_WARNING = (
    "{op}: {what} has requires_grad=True but gets no gradient: the op differentiates "
    "x only (straight through the clamp mask); for learnable ranges (LSQ / LSQ+) use "
    "pt2e_fq.ops.fake_quantize_affine_learnable, else pass {what}.detach() to silence this"
)
_warned_qparam_grad = False
# Frames in these folders are ours or torch's dispatch: the warning points
# at the first frame outside them, the user's call, however deep the
# wrappers are (the raw torch.ops call or a FakeQuantize module).
_PACKAGE = sys.modules[__package__.partition(".")[0]]  # pt2e_fq, not pt2e_fq.ops
_INTERNAL_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, _PACKAGE))


def _user_stacklevel() -> int:
    """warnings.warn's stacklevel, called from _warn_qparam_grad, of the
    first frame outside pt2e_fq and torch."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def _warn_qparam_grad(op: str, name: str) -> None:
    """Warns, once per process, that the qparam argument `name` of `op`
    ("pt2e_fq::fake_quantize_affine") requires grad but gets none; the C++
    Autograd kernel calls it while grad mode is on."""
    global _warned_qparam_grad
    if _warned_qparam_grad:
        return
    _warned_qparam_grad = True
    warnings.warn(
        _QPARAM_GRAD_WARNING.format(op=op.replace("::", "."), what=name), UserWarning,
        stacklevel=_user_stacklevel(),
    )


# ---------------------------------------------------------------------------
# Float formats: FP8 E4M3 / E5M2 and FP4 E2M1 with static scales, and the
# block-scaled MX and NVFP4 formats whose scales the kernel computes.

def _elem_format(op: str, what: str, value) -> str:
    """The element name the operators take, from a name or a torch dtype."""
    return element(op, what, value).name


def _check_format_name(op: str, what: str, name: str) -> None:
    if name not in ELEMENTS:
        raise ValueError(f"{op}: {what} must be one of {tuple(ELEMENTS)}, got {name!r}")


def _check_int(op: str, what: str, v) -> None:
    if not isinstance(v, (int, torch.SymInt)) or isinstance(v, bool):
        raise TypeError(f"{op}: {what} must be an int, got {type(v).__name__}")


def _check_axis_blocks(op: str, x: torch.Tensor, block_size: int, axis: int) -> None:
    _check_x(op, x)
    _check_int(op, "block_size", block_size)
    _check_int(op, "axis", axis)
    if block_size < 1:
        raise ValueError(f"{op}: block_size must be >= 1, got {block_size}")
    if block_size > MAX_BLOCK:  # the op takes an int64
        raise ValueError(f"{op}: block_size must be at most 2**63 - 1, got {block_size}")
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least one dimension, got a 0-dim tensor")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(
            f"{op}: axis must be in [{-x.dim()}, {x.dim()}) for x of shape {tuple(x.shape)}, got {axis}"
        )


def _block_scale_shape(x: torch.Tensor, block_size: int, axis: int) -> list:
    shape = list(x.shape)
    shape[axis] = -(-shape[axis] // block_size)
    return shape


def _check_float_args(x, block_size, scale, fmt) -> None:
    op = "pt2e_fq.fake_quantize_float"
    _check_x(op, x)
    check_block_size(op, x, block_size)
    _check_format_name(op, "fmt", fmt)
    check_qparam(op, "scale", scale, x, reduced_shape(x.shape, block_size))
    if not scale.dtype.is_floating_point:
        raise TypeError(f"{op}: scale must be a floating-point tensor, got {scale.dtype}")


def _check_nvfp4_args(x, global_scale, axis) -> None:
    op = "pt2e_fq.fake_quantize_nvfp4"
    _check_axis_blocks(op, x, NVFP4_BLOCK, axis)
    if global_scale is not None:
        check_qparam(op, "global_scale", global_scale, x, (), what="a single value")
        if not global_scale.dtype.is_floating_point:
            raise TypeError(f"{op}: global_scale must be a floating-point tensor, got {global_scale.dtype}")


def fake_quantize_float_with_mask(
    x: torch.Tensor, block_size: Sequence[int], scale: torch.Tensor, dtype: Union[torch.dtype, str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like `fake_quantize_float`, and also returns the bit-packed clamp mask."""
    fmt = _elem_format("pt2e_fq.fake_quantize_float", "dtype", dtype)
    return _call(
        _OP_FLOAT, _check_float_args, block_size, (), x, block_size, scale, fmt
    )


def fake_quantize_float(
    x: torch.Tensor, block_size: Sequence[int], scale: torch.Tensor, dtype: Union[torch.dtype, str]
) -> torch.Tensor:
    """FP8 / FP4 fake quantization with static scales in one fused op
    (differentiable).

        y = cast_rne(clamp(x / scale, -fmax, fmax)) * scale

    dtype is an element of `pt2e_fq.spec.formats.ELEMENTS`, by name or torch
    dtype: "e4m3" (torch.float8_e4m3fn), "e5m2" (torch.float8_e5m2) or
    "e2m1" (torch.float4_e2m1fn_x2: 0, 0.5, 1, 1.5, 2, 3, 4, 6). The
    cast rounds to nearest, ties to even, with the format's subnormals.
    `block_size` and scale are as in `fake_quantize_affine` (per-tensor,
    per-channel, per-block; ragged last block). The gradient is dy where
    |x / scale| <= fmax and 0 elsewhere. NaN gives NaN; +-Inf gives
    +-fmax * scale.
    """
    return fake_quantize_float_with_mask(x, block_size, scale, dtype)[0]


def fake_quantize_mx_with_scales(
    x: torch.Tensor, elem_dtype: Union[torch.dtype, str], block_size: int = MX_BLOCK, axis: int = -1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like `fake_quantize_mx`, and also returns the block scales: fp32
    powers of two (exact E8M0 values, NaN for a block with a NaN) of x's
    shape with `axis` cut to ceil(size / block_size)."""
    op = "pt2e_fq.fake_quantize_mx"
    fmt = _elem_format(op, "elem_dtype", elem_dtype)
    y, _, scales = _call(
        _OP_MX, lambda x, fmt, b, a: _check_axis_blocks(op, x, b, a),
        block_size, (axis,), x, fmt, block_size, axis,
    )
    return y, scales


def fake_quantize_mx(
    x: torch.Tensor, elem_dtype: Union[torch.dtype, str], block_size: int = MX_BLOCK, axis: int = -1
) -> torch.Tensor:
    """MX fake quantization (OCP Microscaling v1.0) in one fused op
    (differentiable): MXFP8 with elem_dtype "e4m3" or "e5m2" (or their
    torch dtypes), MXFP4 with "e2m1" (torch.float4_e2m1fn_x2).

    Per block of `block_size` consecutive elements along `axis` (the last
    block may be shorter), the kernel computes the E8M0 scale
        X = 2^clamp(floor(log2(max |x|)) - emax_elem, -127, 127)
    (emax_elem: the element's `emax`) and returns cast_rne(clamp(x / X, -fmax, fmax)) * X.
    A block with a NaN is all NaN. The gradient is dy where |x / X| <= fmax.
    """
    return fake_quantize_mx_with_scales(x, elem_dtype, block_size, axis)[0]


def fake_quantize_nvfp4_with_scales(
    x: torch.Tensor, global_scale: Optional[torch.Tensor] = None, axis: int = -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Like `fake_quantize_nvfp4`, and also returns the E4M3 block scales (as
    fp32, x's shape with `axis` cut to ceil(size / 16)) and the fp32 global
    scale used (a 0-dim tensor)."""
    y, _, block_scales, used_global = _call(
        _OP_NVFP4, _check_nvfp4_args, (), (axis,), x, global_scale, axis
    )
    return y, block_scales, used_global


def fake_quantize_nvfp4(
    x: torch.Tensor, global_scale: Optional[torch.Tensor] = None, axis: int = -1
) -> torch.Tensor:
    """NVFP4 fake quantization in one fused op (differentiable): E2M1
    elements in blocks of 16 along `axis`, an E4M3 scale per block under an
    fp32 global scale g:

        g   = global_scale, or max|x| / (448 * 6) computed in the kernel
              (1 when that is 0 or Inf)
        s_b = e4m3_rne_sat(max_block|x| / 6 / g)
        y   = cast_e2m1(clamp(x / (s_b * g), -6, 6)) * (s_b * g)

    A block whose scale s_b * g is 0 becomes 0 with gradient dy. global_scale
    must be finite and > 0. The gradient is dy where |x / (s_b * g)| <= 6.
    """
    return fake_quantize_nvfp4_with_scales(x, global_scale, axis)[0]


@torch.library.register_fake("pt2e_fq::fake_quantize_float")
def _fake_quantize_float_fake(x, block_size, scale, fmt):
    _check_float_args(x, block_size, scale, fmt)
    return _empty_outputs(x)


@torch.library.register_fake("pt2e_fq::fake_quantize_mx")
def _fake_quantize_mx_fake(x, elem_fmt, block_size, axis):
    op = "pt2e_fq.fake_quantize_mx"
    _check_format_name(op, "elem_fmt", elem_fmt)
    _check_axis_blocks(op, x, block_size, axis)
    scales = x.new_empty(_block_scale_shape(x, block_size, axis), dtype=torch.float32)
    return _empty_outputs(x) + (scales,)


@torch.library.register_fake("pt2e_fq::fake_quantize_nvfp4")
def _fake_quantize_nvfp4_fake(x, global_scale, axis):
    _check_nvfp4_args(x, global_scale, axis)
    scales = x.new_empty(_block_scale_shape(x, NVFP4_BLOCK, axis), dtype=torch.float32)
    return _empty_outputs(x) + (scales, x.new_empty((), dtype=torch.float32))

