"""The fused observe-and-fake-quantize operators: a static point's whole
training step while its observer is on, in one op.

`fake_quantize_affine_observe` (integer formats) and
`fake_quantize_float_observe` (FP8 / FP4 with static scales) update, in
place on x's device with no host sync, the running per-block range of a
MinMaxObserver or MovingAverageMinMaxObserver (non-finite values ignored and
counted), the qparams of that range, and return y (and the packed mask) of
`fake_quantize_affine` / `fake_quantize_float` on the new qparams: the bits
of the unfused path (observers.py, spec/qparams.py, spec/format_kinds.py, then the
static op), which stays the reference and serves the first observation,
distributed sync and the other observers.

This module registers their fake implementations. Their autograd is the
static ops' C++ kernel (csrc/common/ste_autograd.cpp): straight through the
mask to x; the state tensors get no gradient, and their version counters
count the in-place update.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .blocks import check_block_size, check_qparam, reduced_shape
from ..spec.formats import ELEMENTS
from .fake_quant import _call, _check_x

AFFINE_OP = "pt2e_fq.fake_quantize_affine_observe"
FLOAT_OP = "pt2e_fq.fake_quantize_float_observe"
SCHEMES = ("symmetric", "symmetric_no_clip", "asymmetric", "minval")
_INT16_MIN, _INT16_MAX = -(2**15), 2**15 - 1


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
    op = AFFINE_OP
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
    if scheme not in SCHEMES:
        raise ValueError(f"{op}: scheme must be one of {', '.join(map(repr, SCHEMES))}, got {scheme!r}")
    minval = scheme == "minval"
    _check_state(op, "offset (minval)" if minval else "offset (zero_point)", offset, x, block_size,
                 torch.float32 if minval else torch.int32)


def _check_float_observe_args(x, block_size, min_val, max_val, scale, nonfinite, fmt, averaging_constant) -> None:
    _check_observe_args(FLOAT_OP, x, block_size, min_val, max_val, scale, nonfinite, averaging_constant)
    if fmt not in ELEMENTS:
        raise ValueError(f"{FLOAT_OP}: fmt must be one of {', '.join(map(repr, ELEMENTS))}, got {fmt!r}")


def fake_quantize_affine_observe(
    x: torch.Tensor,
    block_size: Sequence[int],
    min_val: torch.Tensor,
    max_val: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    nonfinite: torch.Tensor,
    quant_min: int,
    quant_max: int,
    scheme: str,
    range_limit: float,
    averaging_constant: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Observes x and fake-quantizes it with the new qparams, in one op.

    Per block of `block_size`: the finite values' min / max fold into the
    running range `min_val` / `max_val` (fp32; averaging_constant None: the
    running min / max of MinMaxObserver, else MovingAverageMinMaxObserver's
    average, a block seen for the first time taking the batch's range); the
    range clamped to +-range_limit (`qparams.int_range_limit`) gives `scale`
    (fp32) and `offset`: the int32 zero point for scheme "symmetric" /
    "symmetric_no_clip" / "asymmetric", the fp32 minval for "minval"; an empty range gives the
    qparams of [0, 0]. `nonfinite` (one int64) counts the NaN / Inf values
    ignored. All in place. Returns (y, packed mask) of
    `fake_quantize_affine` on the new qparams; the gradient reaches x
    straight through the mask."""
    if type(range_limit) is int:  # the op takes a float
        range_limit = float(range_limit)
    if type(range_limit) is not float or not (averaging_constant is None or type(averaging_constant) is float):
        # e.g. a bool, which the op would take as 1.0
        _check_affine_observe_args(x, block_size, min_val, max_val, scale, offset, nonfinite, quant_min, quant_max,
                                   scheme, range_limit, averaging_constant)
    return _call(  # checks: see "Argument checks" in ops.py
        torch.ops.pt2e_fq.fake_quantize_affine_observe.default, _check_affine_observe_args, block_size,
        (quant_min, quant_max), x, block_size, min_val, max_val, scale, offset, nonfinite, quant_min, quant_max,
        scheme, range_limit, averaging_constant,
    )


def fake_quantize_float_observe(
    x: torch.Tensor,
    block_size: Sequence[int],
    min_val: torch.Tensor,
    max_val: torch.Tensor,
    scale: torch.Tensor,
    nonfinite: torch.Tensor,
    fmt: str,
    averaging_constant: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fake_quantize_affine_observe` for an FP8 / FP4 element `fmt`
    ("e4m3", "e5m2", "e2m1"): the scale is max(|lo|, |hi|) / fmax floored at
    the smallest normal fp32 (`qparams.float_scale`); returns (y, packed
    mask) of `fake_quantize_float`."""
    if not (averaging_constant is None or type(averaging_constant) is float):  # e.g. a bool, taken as 1.0
        _check_float_observe_args(x, block_size, min_val, max_val, scale, nonfinite, fmt, averaging_constant)
    return _call(  # checks: see "Argument checks" in ops.py
        torch.ops.pt2e_fq.fake_quantize_float_observe.default, _check_float_observe_args, block_size, (),
        x, block_size, min_val, max_val, scale, nonfinite, fmt, averaging_constant,
    )


def _empty_outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    return y, x.new_empty(((x.numel() + 7) // 8,), dtype=torch.uint8)


@torch.library.register_fake("pt2e_fq::fake_quantize_affine_observe")
def _affine_observe_fake(x, block_size, min_val, max_val, scale, offset, nonfinite, quant_min, quant_max, scheme,
                         range_limit, averaging_constant=None):
    _check_affine_observe_args(x, block_size, min_val, max_val, scale, offset, nonfinite, quant_min, quant_max,
                               scheme, range_limit, averaging_constant)
    return _empty_outputs(x)


@torch.library.register_fake("pt2e_fq::fake_quantize_float_observe")
def _float_observe_fake(x, block_size, min_val, max_val, scale, nonfinite, fmt, averaging_constant=None):
    _check_float_observe_args(x, block_size, min_val, max_val, scale, nonfinite, fmt, averaging_constant)
    return _empty_outputs(x)
