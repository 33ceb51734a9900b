"""benchmarks.bench_ops.median_ms times callables in turns; with warm=True
each is timed right after an untimed call of its own (as a deployed model
runs its forwards back to back), without it right after another callable.
Checked with callables that are slow only when another ran just before
them (a cold cache, made explicit)."""

from __future__ import annotations

import time

from benchmarks.bench_ops import median_ms

COLD_S = 0.02


def _three():
    last = [None]

    def make(name):
        def fn():
            if last[0] != name:
                time.sleep(COLD_S)
            last[0] = name

        return fn

    return [make(name) for name in "abc"]


def test_warm_times_each_callable_right_after_a_call_of_its_own():
    warm = median_ms(_three(), repeats=6, device="cpu", warmup=1, warm=True)
    assert all(ms < COLD_S * 1e3 / 2 for ms in warm), warm


def test_without_warm_each_callable_follows_another():
    # Three or more: the turns rotate, so with two the last of one repeat
    # would start the next.
    cold = median_ms(_three(), repeats=6, device="cpu", warmup=1)
    assert all(ms >= COLD_S * 1e3 for ms in cold), cold
