"""spawn_ranks (tests/fake_quantize/rank_processes.py), the deadline on the distributed
tests' rank processes: a rank that hangs after writing its result is
terminated with a warning, one that hangs before writing it fails the test."""

from __future__ import annotations

import os
import time

import pytest
from tests.fake_quantize import rank_processes


def _hangs_after_writing(rank, out_dir, write):
    if write or rank == 0:
        with open(os.path.join(out_dir, f"r{rank}"), "w") as f:
            f.write("done")
    if rank == 1:
        time.sleep(600)  # the hang: never returns within the test's deadline


# Long enough for two fresh interpreters to import torch and write their
# results on a loaded 2-core machine (3 s was not), short against the 180 s
# the distributed tests get.
SHORT_DEADLINE_S = 20

pytestmark = pytest.mark.slow


@pytest.fixture
def short_deadline(monkeypatch):
    monkeypatch.setattr(rank_processes, "DEADLINE_S", SHORT_DEADLINE_S)


def test_a_rank_hanging_after_its_result_is_terminated_with_a_warning(tmp_path, short_deadline):
    results = [tmp_path / f"r{r}" for r in range(2)]
    start = time.monotonic()
    with pytest.warns(UserWarning, match=rf"\(1, \d+\)\] wrote their results but were still running {SHORT_DEADLINE_S} s later"):
        rank_processes.spawn_ranks(_hangs_after_writing, (str(tmp_path), True), 2, results)
    assert time.monotonic() - start < SHORT_DEADLINE_S + 60


def test_a_rank_hanging_before_its_result_fails_naming_it(tmp_path, short_deadline):
    results = [tmp_path / f"r{r}" for r in range(2)]
    with pytest.raises(AssertionError, match=rf"\(1, \d+\)\] still running after {SHORT_DEADLINE_S} s; results never written: .*r1'\]"):
        rank_processes.spawn_ranks(_hangs_after_writing, (str(tmp_path), False), 2, results)
