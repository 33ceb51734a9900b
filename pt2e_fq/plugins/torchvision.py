"""torchvision beside a CPU-only torch.

torchvision's PyPI wheel links libtorch_cuda, so beside a CPU torch its C
ops do not load and a plain `import torchvision` (which timm and parts of
transformers do) fails on the missing `torchvision::nms` schema. Defining
the `nms` and `qnms` schemas in a `torchvision` library fragment first lets
its pure-Python models import.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

# The torchvision schema fragment, kept alive for the process.
_TORCHVISION_SCHEMAS: list = []


def allow_torchvision_import() -> None:
    """Makes `import torchvision` work beside a CPU-only torch; call it
    before importing torchvision, timm or a transformers model (transformers'
    modeling_utils imports torchvision wherever it is installed).

    Where torchvision's C ops (`_C.so`) do not load, its Python code
    registers fake kernels for `torchvision::nms` and `qnms`, which fails on
    the missing schemas, and the import with it; the two schemas are defined
    here first, so that the pure-Python models import (the C ops stay
    missing; the models of torchvision, timm and transformers call none of
    them). Where `_C.so` loads, it defines them itself and nothing is added;
    where torchvision is not installed, nothing is done. Idempotent."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or _TORCHVISION_SCHEMAS or hasattr(torch.ops.torchvision, "nms"):
        return
    try:
        for library in Path(spec.origin).parent.glob("_C.*"):
            torch.ops.load_library(str(library))
    except OSError:  # libtorch_cuda.so: cannot open shared object file
        library = torch.library.Library("torchvision", "DEF")
        library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        library.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
        _TORCHVISION_SCHEMAS.append(library)  # a Library deregisters its schemas when collected


def import_torchvision():
    """`import torchvision` (allow_torchvision_import first); an ImportError
    naming the extra where it is not installed."""
    if importlib.util.find_spec("torchvision") is None:
        raise ImportError('torchvision is not installed: pip install "pt2e_fq[models]"')
    allow_torchvision_import()
    import torchvision

    return torchvision
