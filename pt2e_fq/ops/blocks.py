"""Block granularity: the reduced shape of scales, and its validation.

A granularity is a `block_size` with one entry per dimension of x: per-tensor
is x.shape, per-channel on `axis` is 1 there and full elsewhere, per-group and
per-block are anything between. Scale, zero point and minval have the shape
ceil(x.shape / block_size); a last block shorter than the others is allowed.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true


def reduced_shape(shape: Sequence[int], block_size: Sequence[int]) -> tuple[int, ...]:
    """The shape of the per-block qparams: ceil(shape / block_size). A block
    the size of its dimension is one block, also where that size is 0 (a
    block of 0 is allowed there, see `check_block_size`): per-tensor
    `block_size = x.shape` keeps a one-element scale when x is empty, and on
    a dynamic batch, where the block is the symbolic batch itself, without
    dividing by it.

    Other blocks count (s + b - 1) // b, a floor division of nonnegative
    sizes: on a symbolic size (a dynamic batch) it is traced into the
    program, and the ONNX exporter writes a symbolic floor division as an
    integer Div, which truncates, so -(-s // b) would come out as
    floor(s / b) there."""
    return tuple(1 if statically_known_true(b == s) else (s + b - 1) // b for s, b in zip(shape, block_size))


# The largest block_size entry: the operators take 64-bit ints.
MAX_BLOCK = 2**63 - 1


def check_block_size(op: str, x: torch.Tensor, block_size: Sequence[int]) -> None:
    """block_size: a sequence of one int per dimension of x, each >= 1, or 0
    on a dimension of size 0 (the whole, empty, dimension)."""
    if isinstance(block_size, (str, bytes)) or not isinstance(block_size, Sequence):
        raise TypeError(
            f"{op}: block_size must be a sequence of ints, one per dimension of x "
            f"(x.shape={tuple(x.shape)}), got {type(block_size).__name__}"
        )
    if len(block_size) != x.dim():
        raise ValueError(
            f"{op}: block_size needs one entry per dimension of x (x.shape={tuple(x.shape)}), "
            f"got {len(block_size)} entries: {list(block_size)}"
        )
    for d, b in enumerate(block_size):
        if not isinstance(b, (int, torch.SymInt)) or isinstance(b, bool):
            raise TypeError(f"{op}: block_size[{d}] must be an int, got {type(b).__name__}")
        if isinstance(b, int) and b > MAX_BLOCK:
            raise ValueError(f"{op}: block_size[{d}] must be at most 2**63 - 1, got {b}")
        if b < 1 and not (b == 0 and x.shape[d] == 0):
            raise ValueError(
                f"{op}: block_size[{d}] must be >= 1 (or 0 on a dimension of size 0), got {b}"
            )


def _same_up_to_ones(a: Sequence[int], b: Sequence[int]) -> bool:
    """a and b are equal once their size-1 dimensions are dropped.

    Under export a size may be symbolic (a dynamic batch). The first pass
    drops and compares only what is statically known, so it installs no
    guard: asking `s != 1` of a dynamic batch would guard the program to
    sizes other than 1. Only where that pass cannot decide (a size that is 1
    for the example input but not provably so, as opcheck's dynamic shapes
    give) are the sizes compared by value, guarding on them."""

    def static(shape):
        return [s for s in shape if not statically_known_true(s == 1)]

    sa, sb = static(a), static(b)
    if len(sa) == len(sb) and all(statically_known_true(x == y) for x, y in zip(sa, sb)):
        return True
    return [s for s in a if s != 1] == [s for s in b if s != 1]


def check_qparam(
    op: str,
    name: str,
    t: torch.Tensor,
    x: torch.Tensor,
    expected: Sequence[int],
    what: str = "ceil(x.shape / block_size)",
) -> None:
    """A per-block qparam must be on x's device with the reduced shape; size-1
    dimensions may be left out (a per-channel scale may be 1-D, say). `what`
    says where the expected shape comes from. The C++ checks
    (csrc/common/affine_args.cpp, qparam_as_float) say the same."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != x.device:
        raise ValueError(f"{op}: {name} is on {t.device} but x is on {x.device}")
    if not _same_up_to_ones(t.shape, expected):
        raise ValueError(
            f"{op}: {name} must have shape {tuple(expected)} "
            f"({what}; size-1 dimensions may be omitted), got {tuple(t.shape)}"
        )


def whole_dims(shape: Sequence[int], block_size: Sequence[int]) -> Optional[list[int]]:
    """The dims that blocks span whole, where every other block size is 1
    (per-tensor, per-channel, per-token): such blocks reduce over those dims
    in place, without a reshape. None otherwise. Sizes are compared only
    where statically known, so a dynamic batch gets no guard."""
    whole = [d for d, (s, b) in enumerate(zip(shape, block_size)) if statically_known_true(b >= s)]
    ones = [d for d, b in enumerate(block_size) if statically_known_true(b == 1)]
    return whole if whole and len(set(whole) | set(ones)) == len(shape) else None


def blocked(x: torch.Tensor, block_size: Sequence[int], pad_value: float) -> torch.Tensor:
    """x as (r0, b0, r1, b1, ...): the reduced shape's dimensions interleaved
    with the block's, a ragged last block padded with `pad_value`. A block
    longer than its dimension is one block: no need to pad up to it.

    Under export a size may be symbolic (a dynamic batch), and asking how it
    compares with its block would guard the program to the example's answer
    (`batch >= block`, `batch % block == 0`), refusing other batch sizes. So
    sizes are compared only where statically known: a block is cut to its
    dimension only where it is known to be longer, and the padding (the
    symbolic r * b - s, possibly 0) is skipped only where it is known to be
    0. Padding up to a block longer than its dimension gives the same blocks,
    since `pad_value` changes no reduction."""
    shape = tuple(x.shape)
    block = [s if statically_known_true(b > s) else b for s, b in zip(shape, block_size)]
    red = reduced_shape(shape, block)
    pad = []
    for s, b, r in reversed(list(zip(shape, block, red))):
        pad += [0, r * b - s]  # F.pad lists the last dimension first
    if not all(statically_known_true(p == 0) for p in pad):
        x = torch.nn.functional.pad(x, pad, value=pad_value)
    return x.reshape([v for r, b in zip(red, block) for v in (r, b)])


def reduce_blocks(x: torch.Tensor, block_size: Sequence[int], reduce, pad_value: float) -> torch.Tensor:
    """Reduces every block of x to one value: `reduce(t, dim=...)` (torch.amin,
    torch.amax, torch.sum) over the elements of each block; the result has the
    reduced shape. A ragged last block is padded with `pad_value`, which must
    not change the result (+inf for amin, -inf for amax, 0 for sum)."""
    if x.numel() == 0:  # every block is empty: pad_value is the reduction's identity
        return x.new_full(reduced_shape(tuple(x.shape), block_size), pad_value)
    t = blocked(x, block_size, pad_value)
    # The (r0, r1, ...) dimensions of the (r0, b0, r1, b1, ...) result.
    return reduce_dims(t, list(range(1, 2 * x.dim(), 2)), reduce, pad_value)[tuple(
        slice(None) if d % 2 == 0 else 0 for d in range(t.dim()))]


def reduce_dims(t: torch.Tensor, dims: Sequence[int], reduce, identity: float) -> torch.Tensor:
    """reduce(t, dim=dims, keepdim=True), where a reduced dimension may have
    size 0 for amin / amax too (the result there is `identity`, which must
    not change the result: +inf for amin, -inf for amax, or a value at or
    below every one reduced). Callers' eager checks of an empty x are
    settled once when a program is traced, and a dynamic batch of a saved
    program can be 0, where amin / amax over it would raise: the dimensions
    not known to be non-empty are reduced last, each padded with one
    `identity`, bit for bit the same result (min and max do not round, and
    the identity changes no value). Sums take any size, directly."""
    if reduce is not torch.amin and reduce is not torch.amax:
        return reduce(t, dim=tuple(dims), keepdim=True)
    # A symbolic size is not "known non-empty" even where the tracer assumes
    # it (export takes sizes >= 2 while tracing, and the program runs at 0).
    sure = [d for d in dims if isinstance(t.shape[d], int) and t.shape[d] > 0]
    rest = [d for d in dims if d not in sure]
    if sure:
        t = reduce(t, dim=tuple(sure), keepdim=True)
    if not rest:
        return t
    # Padded in place: moving the symbolic dimensions last (a permute) would
    # guard the program to sizes other than 1 wherever another dimension kept
    # is not 1 (a dynamic per-channel point's blocks span the batch).
    pad = [0] * (2 * t.dim())
    for d in rest:
        pad[2 * (t.dim() - 1 - d) + 1] = 1  # F.pad lists the last dimension first
    return reduce(torch.nn.functional.pad(t, pad, value=identity), dim=tuple(rest), keepdim=True)


def expand_blocks(t: torch.Tensor, shape: Sequence[int], block_size: Sequence[int]) -> torch.Tensor:
    """Repeats each per-block value over its block: reduced shape -> shape."""
    t = t.reshape(reduced_shape(shape, block_size))
    for d, (s, b) in enumerate(zip(shape, block_size)):
        t = t.repeat_interleave(b, dim=d).narrow(d, 0, s)
    return t


# -- per-block reductions of the observers and the qparams ------------------------


def fp32(t: torch.Tensor) -> torch.Tensor:
    """t as float32. `t.float()` of an fp32 tensor is t itself in eager mode,
    but torch.export records it (a cast and a metadata assertion), and a
    dynamic point's qparam ops are traced into every exported graph."""
    return t if t.dtype == torch.float32 else t.float()


def block_min_max(x: torch.Tensor, block_size: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 minimum and maximum of the finite values of every block;
    (+inf, -inf), the reductions' identities, for a block with none: a
    running range folded with it stays as it was (observers.py)."""
    # Every non-finite value replaced by the reduction's identity: one fast pass each (isfinite and
    # where take several).
    lo = reduce_blocks(x.nan_to_num(math.inf, math.inf, math.inf), block_size, torch.amin, math.inf)
    hi = reduce_blocks(x.nan_to_num(-math.inf, -math.inf, -math.inf), block_size, torch.amax, -math.inf)
    return fp32(lo), fp32(hi)


def block_abs_max(x: torch.Tensor, block_size: Sequence[int]) -> torch.Tensor:
    """The fp32 maximum |value| of the finite values of every block, 0 for a
    block with none: max(|lo|, |hi|) of block_min_max with an empty range
    read as [0, 0], bit for bit (|x| is exact, and a maximum does not round),
    in half the ops. Every value reduced is >= +0, so neither the order of the
    reduction nor a padding 0 can change the result; blocks that span whole
    dimensions are reduced over those dimensions in place (whole_dims)."""
    a = x.abs()
    a = torch.where(a < math.inf, a, 0.0)  # |x| < inf: x is finite (False for NaN); fewer ops than isfinite
    whole = whole_dims(a.shape, block_size)
    if whole is not None and a.numel() > 0:
        return fp32(reduce_dims(a, whole, torch.amax, 0.0))
    return fp32(reduce_blocks(a, block_size, torch.amax, 0.0))
