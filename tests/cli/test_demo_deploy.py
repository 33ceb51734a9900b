"""The demo's runtime rows: the float model, PTQ w8a8 and QAT w4a8 under
Inductor and in ExecuTorch classify the digits test split as the same
models do in torch (our fake-quant graph: the demo's own "torch" rows)."""

from __future__ import annotations

import pytest
from tests.export.test_export_executorch import MISSING

from pt2e_fq.cli import demo


@pytest.mark.slow
def test_the_runtime_rows_classify_as_the_fake_quant_models_do(tmp_path):
    lines = []
    result = demo.run(tmp_path, float_epochs=2, qat_epochs=1, progress=False, log=lines.append)
    rows = {(r.model, r.runs_in): r for r in result.rows}
    runtimes = {"Inductor": {"PTQ w8a8": "int8", "QAT w4a8": "int8 act, float w"}}
    if MISSING is None:
        runtimes["ExecuTorch XNNPACK"] = runtimes["Inductor"]
        assert (tmp_path / "ptq_w8a8.pte").is_file() and (tmp_path / "qat_w4a8.pte").is_file()
    else:
        print(f"ExecuTorch rows not checked: {MISSING}")
        assert any("ExecuTorch rows left out" in line for line in lines)
    for runtime, kinds in runtimes.items():
        float_row = rows["float", runtime]
        assert float_row.accuracy == pytest.approx(rows["float", "torch"].accuracy, abs=1 / 450)
        for model, kind in kinds.items():
            row = rows[model, f"{runtime} {kind}"]
            # Within one quantization step of the fake-quant graph: a few of the 450 predictions may move.
            assert abs(row.accuracy - rows[model, "torch"].accuracy) <= 0.01, (model, runtime)
            assert row.batch_ms > 0 and row.float_batch_ms == float_row.batch_ms
    assert "float's speed" in result.table()
