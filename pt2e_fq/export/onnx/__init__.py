"""ONNX QDQ export and its check in ONNX Runtime (the `onnx` extra):
`export` (to_onnx), `translate` (the fake-quant ops as QuantizeLinear /
DequantizeLinear), `layout` (a point's ONNX tensors), `scale` (fused float
scales), `session` (ort_session: the ONNX Runtime settings the check
verifies), `points` (the file beside its program, each point bit for bit),
`check` (check_onnx: the points and the outputs end to end; a failure is an
OnnxMismatch) and `divergence` (where ORT's run first leaves torch's
values, and whether float rounding explains it)."""

from .check import OnnxCheck, check_onnx
from .divergence import Cascade, first_divergence
from .export import MIN_OPSET, POINTS_METADATA, supported_opsets, to_onnx
from .points import OnnxMismatch
from .session import ort_session

__all__ = ["to_onnx", "check_onnx", "OnnxMismatch", "ort_session", "OnnxCheck", "first_divergence", "Cascade",
           "MIN_OPSET", "POINTS_METADATA", "supported_opsets"]
