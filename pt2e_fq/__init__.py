"""pt2e_fq: fused, compiled fake quantization for torch.export / PT2E.

Importing the package registers the `torch.ops.pt2e_fq` operators, which a
saved `.pt2` file needs before `torch.export.load`.
"""

from importlib.metadata import version as _metadata_version

import torch  # noqa: F401  (loads the libraries _C links against)

from . import _C  # noqa: F401  (registers the C++/CUDA operators)
from . import ops  # noqa: F401  (registers the fake implementations)
from .plugins.torchao import import_torchao

import_torchao()  # before the modules that import torchao

from .fake_quantize import FakeQuantize, NonFiniteQParamsError, UncalibratedError
from .spec.formats import (
    FP4_E2M1,
    FP8_E4M3,
    FP8_E5M2,
    INT4,
    INT8,
    INT16,
    MXFP4,
    MXFP8_E4M3,
    MXFP8_E5M2,
    NVFP4,
    UINT4,
    UINT8,
    FloatFormat,
    IntFormat,
)
from .spec.granularity import PerBlock, PerChannel, PerGroup, PerTensor, PerToken
from .observers import (
    CurrentMinMaxObserver,
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MSEObserver,
)
from .ops import fake_quantize_affine, fake_quantize_float, fake_quantize_mx, fake_quantize_nvfp4
from .spec.qspec import QSpec
from .spec.schemes import Formulation, Scheme
from . import export  # pt2e_fq.export: .pt2 and ONNX export, conv-bn folding
from .export import load, save
from .flow import convert_pt2e, freeze_qat, move_exported_model_to_eval
from .report import report

__all__ = [
    "move_exported_model_to_eval",
    "convert_pt2e",
    "freeze_qat",
    "save",
    "load",
    "report",
    "export",
    "fake_quantize_affine",
    "fake_quantize_float",
    "fake_quantize_mx",
    "fake_quantize_nvfp4",
    "ops",
    "QSpec",
    "Scheme",
    "Formulation",
    "FakeQuantize",
    "UncalibratedError",
    "NonFiniteQParamsError",
    "IntFormat",
    "FloatFormat",
    "INT4",
    "UINT4",
    "INT8",
    "UINT8",
    "INT16",
    "FP8_E4M3",
    "FP8_E5M2",
    "FP4_E2M1",
    "MXFP8_E4M3",
    "MXFP8_E5M2",
    "MXFP4",
    "NVFP4",
    "PerTensor",
    "PerChannel",
    "PerGroup",
    "PerBlock",
    "PerToken",
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "MSEObserver",
    "HistogramObserver",
    "CurrentMinMaxObserver",
]
__version__ = _metadata_version("pt2e_fq")  # one place: pyproject.toml
