"""torchao's stock prepare_qat_pt2e with FakeQuantQuantizer gives the float
model's batch norms: torchao's conv-bn fusion writes momentum 0.1 and eps
1e-5 into each, and the quantizer's hooks put each one's own values back.

The reference is the float model: after the eval switch, a QAT model
calibrated without a training step is the PTQ model of the same float
model in another form (conv-bn fused, the weight fake-quantized after the
batch norm's scale), so its SQNR against the float model is the PTQ one."""

from __future__ import annotations

import pytest
import torch
from tests.models.stock_flow import EPS, MODELS, MOMENTUM, batch_norm_literals, batches, build, calibrate, qat_prepared, stock_ptq
from tests.models.quantizer import single_thread, sqnr_db  # noqa: F401 (an autouse fixture)

import pt2e_fq


@pytest.mark.parametrize("name", MODELS)
def test_stock_prepare_qat_keeps_each_batch_norm_s_momentum_and_eps(name):
    prepared = qat_prepared(name)
    literals = batch_norm_literals(prepared)
    assert literals and literals == [(MOMENTUM, EPS)] * len(literals)
    # torchao's QAT conv-bn pattern scales the weight by gamma / sqrt(running_var + eps): that eps too.
    eps_adds = [n.args[1] for n in prepared.graph.nodes
                if n.target is torch.ops.aten.add.Tensor and isinstance(n.args[1], float)
                and getattr(n.args[0], "op", None) == "get_attr" and n.args[0].target.endswith("running_var")]
    assert eps_adds == [EPS] * len(literals)


@pytest.mark.parametrize("name", MODELS)
def test_stock_qat_after_the_eval_switch_and_convert_matches_float_as_ptq_does(name):
    model = build(name)
    calibration, x = batches(4), batches(1, seed=9)[0]
    with torch.no_grad():
        expected = model.eval()(x)
    ptq = stock_ptq(model)
    calibrate(ptq, calibration)
    ptq = pt2e_fq.convert_pt2e(ptq)
    qat = qat_prepared(name)
    pt2e_fq.move_exported_model_to_eval(qat)
    calibrate(qat, calibration)
    qat = pt2e_fq.convert_pt2e(qat)
    with torch.no_grad():
        ptq_db, qat_db = sqnr_db(expected, ptq(x)), sqnr_db(expected, qat(x))
    assert ptq_db > 30  # w8a8 of a small model
    # Measured equal to 0.01 dB; with eps 1e-5 in the batch norms, 1.8 dB (CNN) and 9.8 dB (attention block).
    assert qat_db > ptq_db - 0.5
