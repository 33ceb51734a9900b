"""Example inputs as the positional-argument tuple torch.export, the
prepared model and the exporters take (a single tensor is one argument)."""

from __future__ import annotations

import torch


def as_args(example_inputs) -> tuple:
    """example_inputs as the positional-argument tuple torch.export takes."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise TypeError(
        f"example_inputs must be a tensor or a tuple of positional arguments, got {type(example_inputs).__name__}"
    )
