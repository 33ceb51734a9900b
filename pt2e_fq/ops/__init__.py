"""Python entry points of the fused fake-quant operators (`torch.ops.pt2e_fq`).

- `fake_quant`: the static and learnable fake-quant ops (integer affine,
  scaled float, MX, NVFP4) and `unpack_mask`;
- `observe`: the fused observe-and-fake-quantize ops;
- `blocks`, `float_cast`: the block layout and float-cast math they share
  with observers, export and the reference.

Importing this package registers the ops' fake (meta) implementations
(`_fake`); the argument checks are in `_checks`.
"""

from .fake_quant import (
    fake_quantize_affine,
    fake_quantize_affine_learnable,
    fake_quantize_affine_with_mask,
    fake_quantize_float,
    fake_quantize_float_with_mask,
    fake_quantize_mx,
    fake_quantize_mx_with_scales,
    fake_quantize_nvfp4,
    fake_quantize_nvfp4_with_scales,
    unpack_mask,
)
from . import _fake  # noqa: F401  (registers the fake implementations)
from ._qparam_grad import _warn_qparam_grad  # noqa: F401  (csrc/common/ste_autograd.cpp calls it by this name)
from .observe import fake_quantize_affine_observe, fake_quantize_float_observe

__all__ = [
    "fake_quantize_affine",
    "fake_quantize_affine_with_mask",
    "fake_quantize_affine_learnable",
    "fake_quantize_float",
    "fake_quantize_float_with_mask",
    "fake_quantize_mx",
    "fake_quantize_mx_with_scales",
    "fake_quantize_nvfp4",
    "fake_quantize_nvfp4_with_scales",
    "fake_quantize_affine_observe",
    "fake_quantize_float_observe",
    "unpack_mask",
]
