"""How far a runtime's output is from ours: the per-output statistics that
check_onnx (ONNX Runtime) and check_lowered (Inductor, ExecuTorch) report.

Equal values differ by 0, NaN and Inf included; NaN against a number is an
infinite difference. Differences are also given in quantization steps (the
scale of the point that produces the output) where there is one: a rounding
flip is one step, and deep nets cascade a few of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

ArrayLike = Union[np.ndarray, torch.Tensor]


@dataclass(frozen=True)
class OutputDiff:
    """One output. max_steps and rms_steps are None for an output that no
    quantization point produces (float compute after the last point);
    sqnr_db is ours against the difference (inf when equal), over the
    elements finite in both."""

    index: int
    numel: int
    differing: int
    max_abs_diff: float
    max_steps: Optional[float]
    rms_steps: Optional[float]
    sqnr_db: float

    @property
    def non_finite_mismatch(self) -> Optional[str]:
        """The phrase saying that one side is NaN or infinite where the other
        is a number (or another non-finite value), else None. sqnr_db skips
        such elements, so every SQNR bound must be checked with this too."""
        if math.isfinite(self.max_abs_diff):
            return None
        return f"output {self.index} is NaN or infinite where ours is a number, or the reverse"

    @property
    def differing_share(self) -> float:
        return self.differing / self.numel if self.numel else 0.0

    def row(self) -> tuple:
        """The columns of `HEADERS`, formatted."""
        steps = lambda v: "n/a (float)" if v is None else f"{v:.3g}"  # noqa: E731
        return (self.index, self.numel, f"{self.differing} ({100 * self.differing_share:.2f}%)",
                f"{self.max_abs_diff:.3g}", steps(self.max_steps), steps(self.rms_steps), f"{self.sqnr_db:.1f}")


HEADERS = ("output", "elements", "differ", "max |diff|", "max diff (steps)", "RMS diff (steps)", "SQNR dB")


def _float64(a: ArrayLike) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu().double().numpy()
    return np.asarray(a, dtype=np.float64)


def abs_diff(ours: ArrayLike, theirs: ArrayLike) -> np.ndarray:
    """|ours - theirs| per element in float64: 0 where equal (NaN and Inf
    included), inf for NaN or Inf against a number (kept inf, not the
    largest float that nan_to_num would make of it)."""
    a, b = _float64(ours), _float64(theirs)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    return np.where(same, 0.0, np.nan_to_num(np.abs(a - b), nan=np.inf, posinf=np.inf))


def output_diff(index: int, ours: ArrayLike, theirs: ArrayLike, step: Optional[ArrayLike]) -> OutputDiff:
    """ours and theirs of one shape; step a scalar or an array of the
    output's shape (per-element scale), or None for a float output."""
    a, b = _float64(ours), _float64(theirs)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    diff = abs_diff(a, b)
    finite = np.isfinite(a) & np.isfinite(b)
    noise = float(np.sum(diff[finite] ** 2))
    signal = float(np.sum(a[finite] ** 2))
    sqnr = math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal > 0 else -math.inf)
    max_steps = rms_steps = None
    if step is not None:
        in_steps = diff / np.broadcast_to(_float64(step), diff.shape)
        max_steps = float(in_steps.max()) if in_steps.size else 0.0
        rms_steps = float(np.sqrt(np.mean(in_steps ** 2))) if in_steps.size else 0.0
    return OutputDiff(index, int(a.size), int((~same).sum()), float(diff.max()) if diff.size else 0.0,
                      max_steps, rms_steps, sqnr)
