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

Their fake implementations are in _fake.py. Their autograd is the
static ops' C++ kernel (csrc/common/ste_autograd.cpp): straight through the
mask to x; the state tensors get no gradient, and their version counters
count the in-place update.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ._checks import _call, _check_affine_observe_args, _check_float_observe_args


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
    return _call(  # checks: see _checks.py
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
    return _call(  # checks: see _checks.py
        torch.ops.pt2e_fq.fake_quantize_float_observe.default, _check_float_observe_args, block_size, (),
        x, block_size, min_val, max_val, scale, nonfinite, fmt, averaging_constant,
    )
