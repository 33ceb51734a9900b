"""`pt2e-fq demo`: the whole flow on a real data set, in about a minute on a
laptop CPU.

scikit-learn's 8x8 digits (shipped inside the package, no download) train a
small CNN in float; PTQ with the w8a8 preset; QAT with w4a8 from the float
weights, a few epochs with a progress bar; convert; .pt2 and ONNX files;
the ONNX model run in ONNX Runtime on the test split. It ends with a table:
accuracy, file bytes and training step time of each model.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from tabulate import tabulate

from . import digits, pipeline
from .step_time import step_times

BATCH = 64


@dataclass
class Row:
    """One model of the demo's table."""

    model: str
    accuracy: Optional[float]
    file: Optional[str] = None
    bytes: Optional[int] = None
    step_ms: Optional[float] = None
    note: str = ""


@dataclass
class DemoResult:
    rows: list[Row] = field(default_factory=list)
    seconds: float = 0.0

    def row(self, model: str) -> Row:
        return next(r for r in self.rows if r.model == model)

    def table(self) -> str:
        float_ms = self.rows[0].step_ms
        body = []
        for r in self.rows:
            step = "" if r.step_ms is None else f"{r.step_ms:.1f}"
            if r.step_ms is not None and r is not self.rows[0] and float_ms:
                step += f" ({r.step_ms / float_ms:.1f}x float)"
            body.append([
                r.model,
                "" if r.accuracy is None else f"{100 * r.accuracy:.1f}%",
                r.file or "",
                "" if r.bytes is None else f"{r.bytes:,}",
                step,
                r.note,
            ])
        return tabulate(body, headers=["model", "test accuracy", "file", "bytes", "train step ms", "note"])


def _epoch_batches(data: digits.Digits, seed: int):
    return lambda epoch: data.batches("train", BATCH, seed=seed + epoch)


def run(
    out: Path | str = "demo-out",
    *,
    float_epochs: int = 8,
    qat_epochs: int = 3,
    calibration_batches: int = 8,
    seed: int = 0,
    progress: bool = True,
    log=print,
) -> DemoResult:
    """Runs the demo, writes its files under `out` and returns the table's rows."""
    start = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    result = DemoResult()
    data = digits.load(seed=seed)
    x_test, y_test = data.x_test, data.y_test
    example = (data.x_train[:BATCH],)
    log(f"digits: {len(data.x_train)} training and {len(x_test)} test images of 8x8 pixels, {digits.CLASSES} classes")

    # Float training.
    torch.manual_seed(seed)
    model = digits.DigitsCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    pipeline.train(model.train(), _epoch_batches(data, seed), F.cross_entropy, optimizer,
                   epochs=float_epochs, desc="float", progress=progress)
    model.eval()
    result.rows.append(Row("float", digits.accuracy(model, x_test, y_test)))
    float_state = copy.deepcopy(model.state_dict())

    # PTQ w8a8: calibrate on a few training batches.
    ptq = pipeline.prepare(model, example, "w8a8")
    pipeline.calibrate(ptq, [x for x, _ in data.batches("train", BATCH, seed=seed)][:calibration_batches],
                       progress=progress)
    ptq = pipeline.convert(ptq)
    result.rows.append(Row("PTQ w8a8", digits.accuracy(ptq, x_test, y_test)))

    # QAT w4a8 from the float weights.
    model.load_state_dict(float_state)
    qat = pipeline.prepare(model, example, "w4a8", qat=True)
    ms = step_times({"float": model.train(), "qat": qat}, example, data.y_train[:BATCH], F.cross_entropy)
    optimizer = torch.optim.Adam([p for p in qat.parameters() if p.requires_grad], lr=5e-4)
    pipeline.train(qat, _epoch_batches(data, seed + 1000), F.cross_entropy, optimizer,
                   epochs=qat_epochs, desc="QAT w4a8", progress=progress)
    pipeline.freeze_qat(qat, data.x_train[:256])
    qat = pipeline.convert(qat)
    result.rows[0].step_ms = ms["float"]
    result.rows.append(Row("QAT w4a8", digits.accuracy(qat, x_test, y_test), step_ms=ms["qat"]))

    # Deployment files: pending the export issue (pt2e_fq.save, pt2e_fq.export.to_onnx).
    for r in result.rows:
        r.note = "file: pending pt2e_fq.save (export issue)"
    result.rows.append(Row("QAT w4a8 in ONNX Runtime", None, note="pending pt2e_fq.export.to_onnx (export issue)"))

    result.seconds = time.perf_counter() - start
    (out / "results.json").write_text(json.dumps(
        {"rows": [asdict(r) for r in result.rows], "seconds": result.seconds}, indent=2) + "\n")
    table = result.table()
    (out / "results.md").write_text(table + "\n")
    log(table)
    log(f"artifacts in {out}/; {result.seconds:.0f} s")
    return result
