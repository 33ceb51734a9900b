"""pt2e_fq: fused, compiled fake quantization for torch.export / PT2E.

Importing the package registers the `torch.ops.pt2e_fq` operators, which a
saved `.pt2` file needs before `torch.export.load`.
"""

from . import _C  # noqa: F401  (registers the C++/CUDA operators)
from . import ops  # noqa: F401  (registers fake and autograd implementations)
from .ops import fake_quantize_affine, fake_quantize_float, fake_quantize_mx, fake_quantize_nvfp4

__all__ = ["fake_quantize_affine", "fake_quantize_float", "fake_quantize_mx", "fake_quantize_nvfp4", "ops"]
__version__ = "0.1.0"
