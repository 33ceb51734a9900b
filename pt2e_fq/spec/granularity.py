"""Granularities: which elements share one scale.

Each granularity turns a tensor shape into a `block_size` (one entry per
dimension; see ops/blocks.py), so observers, qparams and the op handle every
granularity the same way. Qparams have the shape ceil(shape / block_size),
the same rank as the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union


def _check_int(owner: str, name: str, value, minimum=None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{owner}: {name} must be >= {minimum}, got {value}")


def _normalize_axis(owner, axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        # repr only here: dataclass repr is not traceable by torch.compile.
        raise ValueError(f"{owner!r}: axis={axis} is out of range for a tensor with {ndim} dimensions")
    return axis % ndim


@dataclass(frozen=True)
class PerTensor:
    """One scale for the whole tensor."""

    def block_size(self, shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(shape)


@dataclass(frozen=True)
class PerChannel:
    """One scale per index of `axis` (e.g. axis 0 of a Linear or Conv weight).

    Args:
        axis: the dimension with one scale per index (negative counts from the end).

    Raises:
        TypeError: axis is not an int.
    """

    axis: int = 0

    def __post_init__(self):
        _check_int("PerChannel", "axis", self.axis)

    def block_size(self, shape: Sequence[int]) -> tuple[int, ...]:
        axis = _normalize_axis(self, self.axis, len(shape))
        return tuple(1 if d == axis else s for d, s in enumerate(shape))


@dataclass(frozen=True)
class PerGroup:
    """One scale per `group_size` consecutive elements along `axis` (the MX
    and NVFP4 layout; the last group may be shorter).

    Args:
        group_size: elements per scale, >= 1.
        axis: the dimension the groups run along.

    Raises:
        TypeError: group_size or axis is not an int.
        ValueError: group_size < 1.
    """

    group_size: int
    axis: int = -1

    def __post_init__(self):
        _check_int("PerGroup", "group_size", self.group_size, minimum=1)
        _check_int("PerGroup", "axis", self.axis)

    def block_size(self, shape: Sequence[int]) -> tuple[int, ...]:
        axis = _normalize_axis(self, self.axis, len(shape))
        return tuple(self.group_size if d == axis else 1 for d in range(len(shape)))


@dataclass(frozen=True)
class PerBlock:
    """One scale per block of the given size (one entry per dimension; the
    last block along a dimension may be shorter).

    Args:
        block: the block's size in each dimension of the tensor, each >= 1.

    Raises:
        TypeError: block is not a non-empty tuple of ints.
        ValueError: an entry < 1.
    """

    block: tuple[int, ...]

    def __post_init__(self):
        if not isinstance(self.block, (tuple, list)) or not self.block:
            raise TypeError(f"PerBlock: block must be a non-empty tuple of ints, got {self.block!r}")
        object.__setattr__(self, "block", tuple(self.block))  # lists are not hashable
        for d, b in enumerate(self.block):
            _check_int("PerBlock", f"block[{d}]", b, minimum=1)

    def block_size(self, shape: Sequence[int]) -> tuple[int, ...]:
        if len(self.block) != len(shape):
            raise ValueError(
                f"{self!r}: block has {len(self.block)} entries but the tensor has "
                f"{len(shape)} dimensions (shape {tuple(shape)})"
            )
        return self.block


@dataclass(frozen=True)
class PerToken:
    """One scale per token: per row of the last dimension (per-tensor over the
    hidden size, separately for every batch and sequence position)."""

    def block_size(self, shape: Sequence[int]) -> tuple[int, ...]:
        if len(shape) == 0:
            raise ValueError("PerToken: a 0-dimensional tensor has no tokens")
        return (1,) * (len(shape) - 1) + (shape[-1],)


Granularity = Union[PerTensor, PerChannel, PerGroup, PerBlock, PerToken]
GRANULARITIES = (PerTensor, PerChannel, PerGroup, PerBlock, PerToken)
