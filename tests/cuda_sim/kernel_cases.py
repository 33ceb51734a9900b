"""Op cases shared by the CUDA tests on a GPU (test_cuda_kernels) and in the
CUDA simulation harness (test_cuda_sim): the variants of every op, shaped so
that the kernels' lookups, full and partial tiles and grid-stride loops all
occur, and inputs with the special values every kernel must handle."""

from __future__ import annotations

import itertools

import pytest
import torch

E4M3, E5M2, E2M1 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float4_e2m1fn_x2
ELEM_DTYPES = (E4M3, E5M2, E2M1)
SPECIALS = (float("nan"), float("inf"), -float("inf"), 0.0, -0.0)



def dtype_id(d):
    return str(d).removeprefix("torch.")


def param_grid(variants, *choices):
    """pytest params: every variant (its id first) with every combination of
    the choices (formats, dtypes, layouts, ...), ids from their names."""
    name = lambda c: dtype_id(c) if isinstance(c, torch.dtype) else str(c)  # noqa: E731
    return [
        pytest.param(v, *combo, id="-".join([v[0], *map(name, combo)]))
        for v in variants
        for combo in itertools.product(*choices)
    ]


def with_specials(x: torch.Tensor, seed: int) -> torch.Tensor:
    """x with NaN, +-Inf and signed zeros at a few random positions."""
    g = torch.Generator().manual_seed(seed)
    x = x.clone()
    flat = x.view(-1)
    if flat.numel() >= 64:
        idx = torch.randperm(flat.numel(), generator=g)[: 4 * len(SPECIALS)]
        flat[idx] = torch.tensor(SPECIALS * 4, dtype=x.dtype)
    return x


def gradient_seed(x: torch.Tensor, seed: int) -> torch.Tensor:
    """dy for x with a NaN at a few positions: the STE must give 0 (a select)
    where the element was clamped, and NaN only where it was not."""
    g = torch.Generator().manual_seed(seed + 1)
    dy = torch.randn(x.shape, generator=g).to(x.dtype)
    if dy.numel() >= 16:
        dy.view(-1)[torch.randperm(dy.numel(), generator=g)[:8]] = float("nan")
    return dy


# Integer affine: every granularity and formulation. The last variant is
# long enough that the grid-stride loop iterates in the simulation harness
# (one simulated SM: 64 warps) in every dtype.
AFFINE_VARIANTS = [
    # (id, shape, block_size, zero point formulation, (quant_min, quant_max))
    ("per_tensor_int8", (67, 129), (67, 129), "random", (-128, 127)),
    ("per_channel_axis0_int8", (96, 160), (1, 160), "random", (-128, 127)),
    ("per_channel_last_axis_uint8", (96, 160), (96, 1), "random", (0, 255)),
    ("per_channel_middle_axis_int4", (4, 33, 50), (4, 1, 50), "random", (-8, 7)),
    ("per_block_2d_int4", (64, 96), (16, 32), "random", (-8, 7)),
    ("ragged_blocks_int8", (70, 45), (3, 16), "random", (-128, 127)),
    ("per_group_ragged_int4", (37, 70), (1, 32), "random", (-8, 7)),
    ("per_group_vector_ragged_int2", (40, 200), (1, 64), "random", (-2, 1)),
    ("minval_int4", (48, 96), (1, 16), "minval", (0, 15)),
    ("no_zero_point_int16", (48, 96), (2, 16), "none", (-(2**15), 2**15 - 1)),
    ("long_per_row_int8", (300, 257), (1, 257), "random", (-128, 127)),
]

FLOAT_VARIANTS = [
    # (id, shape, block_size)
    ("per_tensor", (67, 129), (67, 129)),
    ("per_channel_axis0", (96, 160), (1, 160)),
    ("per_channel_last_axis", (96, 160), (96, 1)),
    ("per_block_ragged", (70, 45), (3, 16)),
]

BLOCK_SHAPES = [
    # (id, shape, axis): ragged last block, blocks along an outer axis, a
    # middle axis, a single row, more blocks than the simulation harness's
    # grid has threads (2048), so its grid-stride loop iterates, and rows of
    # whole blocks (the warp kernel's mask words by one ballot).
    ("last_axis_ragged", (37, 100), -1),
    ("axis0", (70, 48), 0),
    ("middle_axis", (5, 45, 33), 1),
    ("one_row", (1, 4099), -1),
    ("many_blocks", (70, 1000), -1),
    ("rows_of_whole_blocks", (24, 256), -1),
]


def block_input(shape, dtype, seed):
    """Data with blocks of very different magnitude, an all-zero block, a
    block holding a NaN, Inf and signed zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float() / 4)
    x.view(-1)[:40] = 0.0
    return with_specials(x.to(dtype), seed)


