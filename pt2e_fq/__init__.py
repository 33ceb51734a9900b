"""pt2e_fq: fused, compiled fake quantization for torch.export / PT2E.

Importing the package registers the `torch.ops.pt2e_fq` operators, which a
saved `.pt2` file needs before `torch.export.load`.
"""

import torch  # noqa: F401  (loads the libraries _C links against)

from . import _C  # noqa: F401  (registers the C++/CUDA operators)
from . import ops  # noqa: F401  (registers fake and autograd implementations)
from .ops import fake_quantize_affine

__all__ = ["fake_quantize_affine", "ops"]
__version__ = "0.1.0"
