"""How an integer format maps a range onto its codes: the scheme (where the
zero point sits) and the formulation (what the offset is)."""

from __future__ import annotations

import enum


class Scheme(enum.Enum):
    SYMMETRIC = "symmetric"
    # The lowest integer code is unused, so the range is +-(2**(bits-1) - 1).
    SYMMETRIC_NARROW = "symmetric_narrow"
    # The zero point in the middle, each side of the range onto the codes on
    # its side (torchao's SYMMETRIC_NO_CLIPPING_ERR): int4 max(-lo / 8, hi / 7).
    # SYMMETRIC's amax / 7.5 puts the largest value on a rounding tie that
    # misses it by half a step, which costs a 4-bit grid (BERT w4a8: 1.5 dB).
    SYMMETRIC_NO_CLIP = "symmetric_no_clip"
    ASYMMETRIC = "asymmetric"


class Formulation(enum.Enum):
    # q = round(x / scale) + zero_point (integer zero point; 0 exact).
    ZP = "zp"
    # q = round((x - minval) / scale) + quant_min (float offset; the range exact).
    MINVAL = "minval"
