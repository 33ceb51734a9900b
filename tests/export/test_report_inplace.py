"""report() on a model whose in-place ops mutate a point's input or output
after the point ran: each row must show what the point did
when it ran. The reference is the same model written out of place (same
weights, same points): its report is what the in-place model's must be."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from tests.models.quantizer import single_thread  # noqa: F401 (an autouse fixture)

import pt2e_fq
from pt2e_fq.cli import pipeline
from quantizers import presets


class Mutating(nn.Module):
    """fc's output point is read by fc2 and then rectified in place (the
    point's output mutated); `s` is read by `head`'s input point and then
    has 1 added in place (the point's input mutated)."""

    def __init__(self, inplace: bool):
        super().__init__()
        self.inplace = inplace
        self.fc, self.fc2, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = self.fc(x)
        a = self.fc2(h)
        s = x * 3.0  # a scalar product: float, so head's input point is on this edge
        b = self.head(s)
        if self.inplace:
            h.relu_()
            s.add_(1.0)
        else:
            h, s = torch.relu(h), s + 1.0
        return a, b, h, s


def _converted(inplace):
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    # every_point: the presets place no output points, and this test needs
    # one (fc's) whose output an in-place op mutates.
    prepared = pipeline.prepare(Mutating(inplace).eval(), (x,), presets.every_point("w8a8"))
    pipeline.calibrate(prepared, [(x,)], progress=False)
    return pipeline.convert(prepared), x


def _rows(report):
    return [(r["role"], r["clipped"], r["sqnr_db"]) for r in report.rows]


@pytest.mark.parametrize("saved", [False, True], ids=["model", "program"])
def test_a_point_mutated_in_place_after_it_ran_reports_what_it_did(saved, tmp_path):
    reports = []
    for inplace in (True, False):
        converted, x = _converted(inplace)
        model = converted
        if saved:
            pt2e_fq.save(converted, (x,), tmp_path / f"{inplace}.pt2")
            model = pt2e_fq.load(tmp_path / f"{inplace}.pt2")
        reports.append(pt2e_fq.report(model, (x,), file=None))
    inplace_rows, twin_rows = map(_rows, reports)
    assert len(inplace_rows) == 8  # x, 3 weights, the outputs of fc, fc2 and head, head's input
    assert [(clipped, sqnr) for _, clipped, sqnr in inplace_rows] == [(c, s) for _, c, s in twin_rows]
    roles = [role for role, *_ in inplace_rows]
    assert any(r.startswith("output of linear") for r in roles) and any("input of linear_2" in r for r in roles)
