"""Every notebook under notebooks/ runs top to bottom (NOTEBOOK_QUICK=1:
fewer epochs), and is committed with the outputs of a full run."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def test_the_five_notebooks_are_there():
    assert [p.stem for p in NOTEBOOKS] == [
        "01_ptq_quickstart", "02_qat_conv_bn", "03_custom_config", "04_onnx_export", "05_float_formats"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_with_the_outputs_of_a_full_run(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "not run top to bottom in one go"
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_runs_without_error(path, monkeypatch):
    monkeypatch.setenv("NOTEBOOK_QUICK", "1")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
