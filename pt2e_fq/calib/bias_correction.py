"""Bias correction (Nagel et al., 2019, empirical form): the mean output
error a weight's rounding causes, E[(W - Q) x] = (W - Q) E[x] over the
calibration inputs, added to the bias, so that the quantized layer's mean
output matches the float layer's on that data."""

from __future__ import annotations

import torch


def bias_correction(weight: torch.Tensor, rounded: torch.Tensor, mean_input: torch.Tensor) -> torch.Tensor:
    """The bias delta (groups * rows,) for float `weight` and `rounded`
    (groups, rows, n) given the mean input columns (groups, n)."""
    if mean_input.shape != (weight.shape[0], weight.shape[2]) or rounded.shape != weight.shape:
        raise ValueError(f"bias_correction: weight and rounded (groups, rows, n), mean_input (groups, n) expected, "
                         f"got {tuple(weight.shape)}, {tuple(rounded.shape)}, {tuple(mean_input.shape)}")
    delta = (weight.double() - rounded.double()) @ mean_input.double().unsqueeze(-1)
    return delta.reshape(-1).float()
