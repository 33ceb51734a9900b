"""GPTQ (Frantar et al., 2022): weight rounding that minimises a layer's
output error on calibration data, column by column, each rounding error fed
back into the columns not yet rounded through the inverse Hessian of the
layer's inputs, H = E[x x^T].

Vectorised over conv groups (a depthwise conv is one small problem per
channel, solved together) and over rows; lazy batches of `block` columns
(the feedback to later columns is one matrix product per batch). The
quantize function is the weight point's own fused op
(calib.layers.Layer.column_quantizer), so every format and granularity the
project has works, and the error fed back is the op's exact one: with
static qparams (integer formats, FP8) each element rounds on the
calibrated grid; MX and NVFP4 block scales are the kernel's, from the
block's values at the time its column is rounded.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


def _inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1, per group;
    the damping grows tenfold until the factorisation succeeds."""
    eye = torch.eye(h.shape[-1], dtype=h.dtype)
    mean_diag = h.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None]
    for _ in range(6):
        factor, info = torch.linalg.cholesky_ex(h + damp * mean_diag * eye)
        if not info.any():
            inverse = torch.cholesky_inverse(factor)
            return torch.linalg.cholesky(inverse, upper=True)
        damp *= 10
    raise ValueError("gptq: the input second moment stays singular after damping (non-finite inputs?)")


def act_order(h: torch.Tensor) -> torch.Tensor:
    """The columns by decreasing diagonal of `h` (groups, n, n), per group,
    (groups, n): GPTQ's act_order rounds the columns with the most input
    power first, while the most columns are left to absorb their error."""
    return torch.argsort(h.diagonal(dim1=-2, dim2=-1), dim=-1, descending=True, stable=True)


def residual_power(h: torch.Tensor, damp: float = 0.01, order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per column j (groups, n), natural order: the part of input j's power
    that the columns rounded after it cannot take over, 1 / [(H_{j:,j:})^-1]_jj
    with the columns in `order` (the damped H, as gptq uses it). GPTQ's
    output error is sum_j e_j^2 times this, e_j the rounding error of
    column j as it is rounded."""
    h = h.double().clone()
    if order is not None:
        h = h.gather(1, order[:, :, None].expand_as(h)).gather(2, order[:, None, :].expand_as(h))
    diagonal = h.diagonal(dim1=-2, dim2=-1)
    diagonal[diagonal == 0] = 1.0
    power = _inverse_cholesky(h, damp).diagonal(dim1=-2, dim2=-1).pow(-2)
    if order is not None:
        power = power.gather(1, torch.argsort(order, dim=1))
    return power.float()


def gptq(weight: torch.Tensor, h: torch.Tensor, quantize: Callable[[torch.Tensor, int], torch.Tensor], *,
         block: int = 128, damp: float = 0.01, order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The rounded weight (groups, rows, n) for `weight` of that shape, given
    the input second moment `h` (groups, n, n) and `quantize(columns, i)`:
    column i of the current weight rounded, (groups, rows), where `columns`
    is the current weight with its columns first, (groups, n, rows). With
    `order` (groups, n), a permutation of the columns per group, the columns
    are rounded in that order: `columns` and i are then in that order too
    (position i holds column order[:, i]); the result is in the natural
    order. Columns whose input is always zero (a zero diagonal) are
    rounded as they are: they cannot change the output."""
    if weight.dim() != 3 or h.shape != (weight.shape[0], weight.shape[2], weight.shape[2]):
        raise ValueError(f"gptq: weight (groups, rows, n) and h (groups, n, n) expected, got "
                         f"{tuple(weight.shape)} and {tuple(h.shape)}")
    if order is not None and order.shape != weight.shape[::2]:
        raise ValueError(f"gptq: order must be a permutation of the columns per group, (groups, n) = "
                         f"{tuple(weight.shape[::2])}, got {tuple(order.shape)}")
    # Columns first: each column is one contiguous row of `w` (the loop reads and writes them).
    # A copy always (contiguous() of a (groups, 1, n) weight would be the weight itself).
    w = weight.detach().float().transpose(1, 2).clone(memory_format=torch.contiguous_format)
    h = h.double().clone()
    if order is not None:
        w = w.gather(1, order[:, :, None].expand_as(w))
        h = h.gather(1, order[:, :, None].expand_as(h)).gather(2, order[:, None, :].expand_as(h))
    diagonal = h.diagonal(dim1=-2, dim2=-1)
    diagonal[diagonal == 0] = 1.0  # dead inputs: no feedback through them
    u = _inverse_cholesky(h, damp).float()
    n = w.shape[1]
    for start in range(0, n, block):
        stop = min(start + block, n)
        u_block = u[:, start:stop, start:stop]
        errors = torch.empty(w.shape[0], stop - start, w.shape[2])
        for i in range(stop - start):
            j = start + i
            q = quantize(w, j)
            error = (w[:, j] - q) / u_block[:, i, i, None]
            w[:, j:stop] -= u_block[:, i, i:, None] * error[:, None, :]
            w[:, j] = q
            errors[:, i] = error
        if stop < n:
            w[:, stop:] -= u[:, start:stop, stop:].transpose(1, 2) @ errors
    if order is not None:
        w = w.gather(1, torch.argsort(order, dim=1)[:, :, None].expand_as(w))
    return w.transpose(1, 2).contiguous()
