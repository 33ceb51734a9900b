"""Spawning the rank processes of the distributed tests with a deadline.

A rank's process has been seen (once, in CI) to hang in gloo's
destroy_process_group after it had written its result: mp.spawn's join then
waits forever and the whole suite with it. So the join has a deadline; past
it the processes are terminated, and the test goes on only if every rank
wrote its result (a warning says which hung), else it fails naming them."""

from __future__ import annotations

import os
import time
import warnings

import torch.multiprocessing as mp

DEADLINE_S = 180  # a spawn takes 10-30 s on 2 cores


def spawn_ranks(worker, args: tuple, nprocs: int, results: list) -> None:
    """mp.spawn(worker, args, nprocs) joined within DEADLINE_S; `results` are
    the files the ranks write before they tear down their process group."""
    context = mp.spawn(worker, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=5):  # raises as mp.spawn does when a rank fails
        if time.monotonic() < deadline:
            continue
        alive = [(rank, p.pid) for rank, p in enumerate(context.processes) if p.is_alive()]
        for p in context.processes:
            if p.is_alive():
                p.terminate()
        missing = [os.fspath(r) for r in results if not os.path.exists(r)]
        if missing:
            raise AssertionError(f"rank processes (rank, pid) {alive} still running after {DEADLINE_S} s; "
                                 f"results never written: {missing}")
        warnings.warn(f"rank processes (rank, pid) {alive} wrote their results but were still running "
                      f"{DEADLINE_S} s later (a hang in process-group teardown); terminated")
        return
