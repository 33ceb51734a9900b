"""The warning the straight-through ops' C++ autograd
(csrc/common/ste_autograd.cpp) raises, through a call back into Python, when
a qparam argument requires grad: the op differentiates x only. C++ calls it
as `pt2e_fq.ops._warn_qparam_grad`."""

from __future__ import annotations

import os
import sys
import warnings

import torch

_QPARAM_GRAD_WARNING = (
    "{op}: {what} has requires_grad=True but gets no gradient: the op differentiates "
    "x only (straight through the clamp mask); for learnable ranges (LSQ / LSQ+) use "
    "pt2e_fq.ops.fake_quantize_affine_learnable, else pass {what}.detach() to silence this"
)
_warned_qparam_grad = False
# Frames in these folders are ours or torch's dispatch: the warning points
# at the first frame outside them, the user's call, however deep the
# wrappers are (the raw torch.ops call or a FakeQuantize module).
_PACKAGE = sys.modules[__package__.partition(".")[0]]  # pt2e_fq, not pt2e_fq.ops
_INTERNAL_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, _PACKAGE))


def _user_stacklevel() -> int:
    """warnings.warn's stacklevel, called from _warn_qparam_grad, of the
    first frame outside pt2e_fq and torch."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def _warn_qparam_grad(op: str, name: str) -> None:
    """Warns, once per process, that the qparam argument `name` of `op`
    ("pt2e_fq::fake_quantize_affine") requires grad but gets none; the C++
    Autograd kernel calls it while grad mode is on."""
    global _warned_qparam_grad
    if _warned_qparam_grad:
        return
    _warned_qparam_grad = True
    warnings.warn(
        _QPARAM_GRAD_WARNING.format(op=op.replace("::", "."), what=name), UserWarning,
        stacklevel=_user_stacklevel(),
    )
