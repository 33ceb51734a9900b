"""Block granularity: the reduced shape of scales, and its validation.

A granularity is a `block_size` with one entry per dimension of x: per-tensor
is x.shape, per-channel on `axis` is 1 there and full elsewhere, per-group and
per-block are anything between. Scale, zero point and minval have the shape
ceil(x.shape / block_size); a last block shorter than the others is allowed.
"""

from __future__ import annotations

from typing import Sequence

import torch


def reduced_shape(shape: Sequence[int], block_size: Sequence[int]) -> tuple[int, ...]:
    """The shape of the per-block qparams: ceil(shape / block_size)."""
    return tuple(-(-s // b) for s, b in zip(shape, block_size))


def check_block_size(op: str, x: torch.Tensor, block_size: Sequence[int]) -> None:
    if len(block_size) != x.dim():
        raise ValueError(
            f"{op}: block_size needs one entry per dimension of x (x.shape={tuple(x.shape)}), "
            f"got {len(block_size)} entries: {list(block_size)}"
        )
    for d, b in enumerate(block_size):
        if not isinstance(b, (int, torch.SymInt)) or isinstance(b, bool):
            raise TypeError(f"{op}: block_size[{d}] must be an int, got {type(b).__name__}")
        if b < 1:
            raise ValueError(f"{op}: block_size[{d}] must be >= 1, got {b}")


def _squeezed(shape: Sequence[int]) -> list[int]:
    return [s for s in shape if s != 1]


def check_qparam(op: str, name: str, t: torch.Tensor, x: torch.Tensor, expected: Sequence[int]) -> None:
    """A per-block qparam must be on x's device with the reduced shape; size-1
    dimensions may be left out (a per-channel scale may be 1-D, say)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != x.device:
        raise ValueError(f"{op}: {name} is on {t.device} but x is on {x.device}")
    if _squeezed(t.shape) != _squeezed(expected):
        raise ValueError(
            f"{op}: {name} must have shape ceil(x.shape / block_size) = {tuple(expected)} "
            f"(size-1 dimensions may be omitted), got {tuple(t.shape)}"
        )


def reduce_blocks(x: torch.Tensor, block_size: Sequence[int], reduce, pad_value: float) -> torch.Tensor:
    """Reduces every block of x to one value: `reduce(t, dim=...)` (torch.amin,
    torch.amax, torch.sum) over the elements of each block; the result has the
    reduced shape. A ragged last block is padded with `pad_value`, which must
    not change the result (+inf for amin, -inf for amax, 0 for sum)."""
    shape = tuple(x.shape)
    # A block longer than its dimension is one block: no need to pad up to it.
    block = [b if b <= s else s for s, b in zip(shape, block_size)]
    red = reduced_shape(shape, block)
    pad = []
    for s, b, r in reversed(list(zip(shape, block, red))):
        pad += [0, r * b - s]  # F.pad lists the last dimension first
    if any(p != 0 for p in pad):
        x = torch.nn.functional.pad(x, pad, value=pad_value)
    blocked = x.reshape([v for r, b in zip(red, block) for v in (r, b)])
    return reduce(blocked, dim=tuple(range(1, 2 * len(shape), 2)))


def expand_blocks(t: torch.Tensor, shape: Sequence[int], block_size: Sequence[int]) -> torch.Tensor:
    """Repeats each per-block value over its block: reduced shape -> shape."""
    t = t.reshape(reduced_shape(shape, block_size))
    for d, (s, b) in enumerate(zip(shape, block_size)):
        t = t.repeat_interleave(b, dim=d).narrow(d, 0, s)
    return t
