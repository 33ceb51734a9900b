"""benchmarks/bench_qat_trained's stock QAT flow trains a copy of the float
model: distilling its student leaves the teacher, which every later flow of
the benchmark starts from, bit for bit as it was (torchao's prepare keeps
the exported module's parameters, so without the copy this fails). The
reference is a snapshot of the teacher's state_dict taken before."""

from __future__ import annotations

import torch
from tests.models.stock_flow import batches, build

from benchmarks import bench_qat_trained
from pt2e_fq import qat


def test_the_stock_flow_s_qat_leaves_the_teacher_unchanged():
    torch.manual_seed(0)
    model = build("conv_bn_cnn").eval()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = [(x,) for x in batches(2)]
    student = bench_qat_trained._stock_qat(model, data)
    history = qat.distill(student, model, data, steps=3, loss="mse", lr=1e-2, progress=False)
    assert history.losses[-1] != history.losses[0]  # the student did train
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} of the teacher changed"
