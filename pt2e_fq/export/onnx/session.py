"""ONNX Runtime sessions with the settings check_onnx verifies: deploy an
exported file with these."""

from __future__ import annotations

import os

# ONNX Runtime CPU optimizer passes with known bugs on QDQ graphs (1.32):
# ReluQuantRewrite drops a Relu before an fp8 QuantizeLinear with zero point 0;
# MatMulAddFusion fails on int8 activations into a 3-D Linear with bias;
# QDQS8ToU8Transformer turns to uint8 the zero point of a QuantizeLinear that
# QDQPropagationTransformer inserted after a Reshape with output_dtype=INT8,
# and the session fails to load (int8 activations through flatten / view).
ORT_DISABLED_OPTIMIZERS = ("ReluQuantRewrite", "MatMulAddFusion", "QDQS8ToU8Transformer")


# ORT fuses DequantizeLinear (8-bit blocked weights) -> MatMul into
# MatMulNBits, which by default (accuracy level 4) quantizes its activations
# to int8 on the fly: not the model's numerics. Level 0 computes in fp32.
ORT_SESSION_CONFIG = {"session.qdq_matmulnbits_accuracy_level": "0"}


def ort_session(model_or_path, optimized: bool = True):
    """An ONNX Runtime CPU session of an exported file (or onnx.ModelProto)
    with the settings check_onnx verifies: ORT_DISABLED_OPTIMIZERS off,
    ORT_SESSION_CONFIG set; graph optimisations on unless optimized=False.
    Deploy with these settings."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    for key, value in ORT_SESSION_CONFIG.items():
        so.add_session_config_entry(key, value)
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimized else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    source = model_or_path.SerializeToString() if hasattr(model_or_path, "SerializeToString") else os.fspath(
        model_or_path)
    return ort.InferenceSession(
        source, so, providers=["CPUExecutionProvider"], disabled_optimizers=list(ORT_DISABLED_OPTIMIZERS)
    )
