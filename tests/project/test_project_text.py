"""The project's text speaks of the software, not of how it was built: no
tracked source or text file names a work session, an issue number, a
numbered work round, the machine it was developed on or a date of work, and
no notebook carries execution timestamps (they change on every run and say
when, not what). A hit fails with file:line and the phrase found."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# This file names the phrases it looks for, so it is the one file not searched.
THIS_FILE = Path(__file__).resolve().relative_to(ROOT)

# The tracked files searched: by ending, plus the Makefile and the CI scripts.
TEXT_ENDINGS = (".py", ".md", ".ipynb", ".cpp", ".h", ".cu", ".cuh", ".toml", ".yaml")

NARRATION = {
    "a work session": re.compile(r"\bsessions?\s+#?\d+", re.IGNORECASE),
    "an issue number": re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE),
    "a numbered work round": re.compile(r"\b(?:work\s+)?rounds?\s+#?\d+\b", re.IGNORECASE),
    "the development machine": re.compile(r"\bdevelopment\s+(?:VM|machine)\b", re.IGNORECASE),
    "a date of work": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
}

# Jupyter writes these into a cell's metadata["execution"] (and papermill
# into metadata["papermill"]) when a notebook runs.
NOTEBOOK_TIMESTAMPS = ("iopub.execute_input", "iopub.status.busy", "iopub.status.idle", "shell.execute_reply",
                       "start_time", "end_time")


def tracked_text_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (or no git): the tracked files cannot be listed")
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = []
    for name in filter(None, names.split("\0")):
        path = Path(name)
        if path == THIS_FILE:
            continue
        if path.suffix in TEXT_ENDINGS or path.name == "Makefile" or path.parts[0] == ".ci":
            files.append(path)
    return files


def narration_hits(path: Path, text: str) -> list[str]:
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in NARRATION.items():
            match = pattern.search(line)
            if match:
                hits.append(f"{path}:{number}: {what}: {match.group(0)!r} in {line.strip()[:160]!r}")
    return hits


def timestamp_hits(path: Path, text: str) -> list[str]:
    notebook = json.loads(text)
    hits = []
    for index, cell in enumerate(notebook.get("cells", [])):
        metadata = cell.get("metadata", {})
        stamped = sorted({key for key in NOTEBOOK_TIMESTAMPS
                          for part in (metadata.get("execution", {}), metadata.get("papermill", {})) if key in part})
        if stamped:
            line = next((n for n, l in enumerate(text.splitlines(), 1) if f'"{stamped[0]}"' in l), 0)
            hits.append(f"{path}:{line}: cell {index} has execution timestamps {stamped}")
    if any(key in notebook.get("metadata", {}).get("papermill", {}) for key in NOTEBOOK_TIMESTAMPS):
        hits.append(f"{path}:1: notebook metadata has papermill timestamps")
    return hits


def test_the_text_files_do_not_narrate_how_the_software_was_built():
    hits = []
    for path in tracked_text_files():
        full = ROOT / path
        if not full.is_file():  # deleted in the working tree, not yet in the index
            continue
        text = full.read_text(encoding="utf-8", errors="replace")
        hits += narration_hits(path, text)
        if path.suffix == ".ipynb":
            hits += timestamp_hits(path, text)
    assert not hits, "the project text narrates how it was built; say the software fact instead:\n" + "\n".join(hits)


# Each sample is split in two so that this file, which the search reads too, holds none of them whole.
@pytest.mark.parametrize("line", ["Measured in sess" "ion 4.", "(iss" "ue 17.1)", "see iss" "ue #12", "in round 2 of work",
                                  "on the develop" "ment VM", "measured 2026-01-05"])
def test_each_kind_of_narration_is_found(line):
    assert narration_hits(Path("x.md"), line), line


@pytest.mark.parametrize("line", ["an ONNX Runtime session", "round(x / scale)", "rounds to 0", "issue a warning",
                                  "torch 2.13.0", "session-scoped fixture"])
def test_software_text_is_not_a_hit(line):
    assert not narration_hits(Path("x.md"), line), line


def test_notebook_execution_timestamps_are_found():
    cell = {"cell_type": "code", "metadata": {"execution": {"iopub.execute_input": "t", "shell.execute_reply": "t"}},
            "source": [], "outputs": [], "execution_count": 1}
    text = json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}, indent=1)
    (hit,) = timestamp_hits(Path("n.ipynb"), text)
    assert hit.startswith("n.ipynb:") and "iopub.execute_input" in hit
    cell["metadata"] = {}
    assert timestamp_hits(Path("n.ipynb"), json.dumps({"cells": [cell], "metadata": {}})) == []
