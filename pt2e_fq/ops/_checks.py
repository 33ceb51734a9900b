"""Argument checks of the fake-quant ops' Python entry points and fake
implementations (private to pt2e_fq.ops).

The C++ kernels check every argument they read, so on the success path a
wrapper only calls its op (a Python check costs more than the op on a small
tensor: benchmarks/bench_overhead.py). When the op raises, the Python check
runs (`_call`) and, where it finds the argument at fault, raises its
message, which names the argument, what was wrong and what is allowed. Two things the op's schema lets through
are checked first: a bool or a 0-dim tensor where an int belongs
(torch.ops would take True as 1).

Under torch.compile and torch.export the wrappers leave the checks to the
op's fake impl (_fake.py), which makes the same ones. A check traced by
Dynamo surfaces as "Unsupported: Observed exception" under fullgraph=True;
from the fake impl, the message comes through as written.
"""

from __future__ import annotations

import math

import torch

from ..spec.formats import ELEMENTS, NVFP4_BLOCK, element
from .blocks import MAX_BLOCK, check_block_size, check_qparam, reduced_shape

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT16_MIN, _INT16_MAX = -(2**15), 2**15 - 1
AFFINE_OBSERVE_OP = "pt2e_fq.fake_quantize_affine_observe"
FLOAT_OBSERVE_OP = "pt2e_fq.fake_quantize_float_observe"
BLOCK_HISTOGRAM_OP = "pt2e_fq.block_histogram"
FINITE_RANGE_OP = "pt2e_fq.block_finite_range"
# block_histogram's most bins (bin indices are int32 in the kernel: csrc/common/histogram_args.h).
MAX_OP_BINS = 1 << 24
OBSERVE_SCHEMES = ("symmetric", "symmetric_no_clip", "asymmetric", "minval")


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


def _check_state(op: str, name: str, t, x: torch.Tensor, block_size, dtype: torch.dtype) -> None:
    check_qparam(op, name, t, x, reduced_shape(x.shape, block_size))
    if t.dtype != dtype:
        raise TypeError(f"{op}: {name} must be a {dtype} tensor (updated in place), got {t.dtype}")


def _check_observe_args(op, x, block_size, min_val, max_val, scale, nonfinite, averaging_constant) -> None:
    _check_x(op, x)
    check_block_size(op, x, block_size)
    for name, t in (("min_val", min_val), ("max_val", max_val), ("scale", scale)):
        _check_state(op, name, t, x, block_size, torch.float32)
    if not isinstance(nonfinite, torch.Tensor):
        raise TypeError(f"{op}: nonfinite must be a torch.Tensor, got {type(nonfinite).__name__}")
    if nonfinite.dtype != torch.int64 or nonfinite.numel() != 1:
        raise TypeError(
            f"{op}: nonfinite must be a one-element int64 tensor (a counter, added to in place), "
            f"got {nonfinite.dtype} of shape {tuple(nonfinite.shape)}"
        )
    if nonfinite.device != x.device:
        raise ValueError(f"{op}: nonfinite is on {nonfinite.device} but x is on {x.device}")
    if averaging_constant is not None:
        c = averaging_constant
        if not isinstance(c, (int, float)) or isinstance(c, bool):
            raise TypeError(f"{op}: averaging_constant must be a float or None, got {type(c).__name__}")
        if not 0 < c <= 1:
            raise ValueError(f"{op}: averaging_constant must be in (0, 1] (None: running min / max), got {c}")


def _check_affine_observe_args(x, block_size, min_val, max_val, scale, offset, nonfinite, quant_min, quant_max,
                               scheme, range_limit, averaging_constant) -> None:
    op = AFFINE_OBSERVE_OP
    _check_observe_args(op, x, block_size, min_val, max_val, scale, nonfinite, averaging_constant)
    for name, v in (("quant_min", quant_min), ("quant_max", quant_max)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{op}: {name} must be an int, got {type(v).__name__}")
    if not _INT16_MIN <= quant_min < quant_max <= _INT16_MAX:
        raise ValueError(
            f"{op}: need {_INT16_MIN} <= quant_min < quant_max <= {_INT16_MAX}, "
            f"got quant_min={quant_min}, quant_max={quant_max}"
        )
    if not isinstance(range_limit, (int, float)) or isinstance(range_limit, bool):
        raise TypeError(f"{op}: range_limit must be a float, got {type(range_limit).__name__}")
    if not (math.isfinite(range_limit) and range_limit > 0):
        raise ValueError(f"{op}: range_limit must be finite and > 0, got {range_limit}")
    if scheme not in OBSERVE_SCHEMES:
        raise ValueError(f"{op}: scheme must be one of {', '.join(map(repr, OBSERVE_SCHEMES))}, got {scheme!r}")
    minval = scheme == "minval"
    _check_state(op, "offset (minval)" if minval else "offset (zero_point)", offset, x, block_size,
                 torch.float32 if minval else torch.int32)


def _check_float_observe_args(x, block_size, min_val, max_val, scale, nonfinite, fmt, averaging_constant) -> None:
    _check_observe_args(FLOAT_OBSERVE_OP, x, block_size, min_val, max_val, scale, nonfinite, averaging_constant)
    if fmt not in ELEMENTS:
        raise ValueError(f"{FLOAT_OBSERVE_OP}: fmt must be one of {', '.join(map(repr, ELEMENTS))}, got {fmt!r}")


def _check_histogram_args(x, block_size, lo, hi, bins) -> None:
    op = BLOCK_HISTOGRAM_OP
    _check_x(op, x)
    check_block_size(op, x, block_size)
    expected = reduced_shape(x.shape, block_size)
    for name, t in (("lo", lo), ("hi", hi)):
        check_qparam(op, name, t, x, expected)
        if t.dtype != torch.float32:
            raise TypeError(f"{op}: {name} must be a torch.float32 tensor (the running range), got {t.dtype}")
    _check_int(op, "bins", bins)
    if not 1 <= bins <= MAX_OP_BINS:
        raise ValueError(f"{op}: bins must be in [1, {MAX_OP_BINS}], got {bins}")


def _check_finite_range_args(x, block_size) -> None:
    _check_x(FINITE_RANGE_OP, x)
    check_block_size(FINITE_RANGE_OP, x, block_size)
