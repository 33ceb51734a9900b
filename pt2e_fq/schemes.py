"""How an integer format maps a range onto its codes: the scheme (where the
zero point sits) and the formulation (what the offset is)."""

from __future__ import annotations

import enum


class Scheme(enum.Enum):
    SYMMETRIC = "symmetric"
    # The lowest integer code is unused, so the range is +-(2**(bits-1) - 1).
    SYMMETRIC_NARROW = "symmetric_narrow"
    ASYMMETRIC = "asymmetric"


class Formulation(enum.Enum):
    # q = round(x / scale) + zero_point (integer zero point; 0 exact).
    ZP = "zp"
    # q = round((x - minval) / scale) + quant_min (float offset; the range exact).
    MINVAL = "minval"
