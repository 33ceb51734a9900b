"""ONNX QDQ export and its check in ONNX Runtime (the `onnx` extra):
`export` (to_onnx), `translate` (the fake-quant ops as QuantizeLinear /
DequantizeLinear), `layout` (a point's ONNX tensors), `scale` (fused float
scales), `check` (check_onnx, ort_session) and `divergence` (where an
export that fails its check first departs from the graph)."""

from .check import OnnxCheck, check_onnx, ort_session
from .export import MIN_OPSET, POINTS_METADATA, supported_opsets, to_onnx

__all__ = ["to_onnx", "check_onnx", "ort_session", "OnnxCheck", "MIN_OPSET", "POINTS_METADATA", "supported_opsets"]
