"""Distributed calibration and QAT (pt2e_fq.distributed) on 2 CPU processes
with gloo, as CI runs it. Each spawn runs several checks in both ranks and
saves what they hold; the test process compares it with an independent
reference computed here, in one process: calibration on all the ranks'
batches, or QAT on the concatenated batch.

One spawn per concern, since a spawn costs a torch import per rank (~5 s on
2 cores): calibration, training (DDP, FSDP2, distributed checkpoint), a rank
that fails.
"""

from __future__ import annotations

import copy
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pt2e_fq as q
import pt2e_fq.distributed as qdist
from pt2e_fq.app import pipeline
from pt2e_fq.app.models import MLP

WORLD = 2
PG_TIMEOUT_S = 20  # a collective no rank answers fails after this, rather than hanging the test

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def _run(fn, out_dir, *args):
    """fn(rank, out_dir, *args) in WORLD processes joined in a gloo group;
    returns what each rank's fn returned (saved with torch.save)."""
    mp.spawn(_worker, args=(fn, str(out_dir), args), nprocs=WORLD, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


def _init(rank, out_dir):
    torch.set_num_threads(1)  # 2 ranks on 2 cores
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )


def _worker(rank, fn, out_dir, args):
    _init(rank, out_dir)
    try:
        result = fn(rank, out_dir, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------
# Calibration: N ranks = one process on all the data, bit for bit

# (name, QSpec): every granularity, integer (ZP and MINVAL, signed and
# unsigned, 4 to 16 bits) and float (scaled FP8 / FP4, NVFP4's global scale).
SPECS = [
    ("int8_tensor_asym", q.QSpec(q.INT8, q.PerTensor(), "asymmetric")),
    ("int8_channel_sym", q.QSpec(q.INT8, q.PerChannel(1), "symmetric")),
    ("int4_group_sym", q.QSpec(q.INT4, q.PerGroup(4), "symmetric")),
    ("uint8_block_minval", q.QSpec(q.UINT8, q.PerBlock((2, 4)), "asymmetric", "minval")),
    ("int16_channel_narrow", q.QSpec(q.INT16, q.PerChannel(1), "symmetric_narrow")),
    ("fp8_e4m3_channel", q.QSpec(q.FP8_E4M3, q.PerChannel(1))),
    ("fp8_e5m2_tensor", q.QSpec(q.FP8_E5M2, q.PerTensor())),
    ("fp4_group", q.QSpec(q.FP4_E2M1, q.PerGroup(4))),
    ("nvfp4", q.QSpec(q.NVFP4, q.PerGroup(16))),
    ("int8_tensor_moving_average", q.QSpec(q.INT8, q.PerTensor(), "asymmetric",
                                           observer=q.MovingAverageMinMaxObserver(0.3))),
    ("int8_channel_moving_average", q.QSpec(q.INT8, q.PerChannel(1), "asymmetric",
                                            observer=q.MovingAverageMinMaxObserver(0.3))),
]
STEPS = 3


def _batch(step: int, rank: int) -> torch.Tensor:
    """Rank r's batch at a step: the ranks' ranges differ (rank 1 wider,
    shifted), so a rank that sees only its own data gets other qparams."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 16, generator=g) * (1 + 2 * rank) + rank


def _state(m: q.FakeQuantize) -> dict:
    return {k: v.clone() for k, v in m.state_dict().items() if k not in ("fake_quant_enabled", "observer_enabled")}


def _calibrate_points(rank, steps, batch_fn):
    points = {name: q.FakeQuantize(spec) for name, spec in SPECS}
    for step in range(steps):
        x = batch_fn(step, rank)
        for m in points.values():
            m(x)
    return {name: _state(m) for name, m in points.items()}


def _calibration_ranks(rank, out_dir):
    result = {"synced": _calibrate_points(rank, STEPS, _batch)}

    # A whole prepared model (w8a8: static per-tensor activations, per-channel
    # weights), calibrated on each rank's batches through the pipeline.
    torch.manual_seed(0)
    prepared = pipeline.prepare(MLP(), (_batch(0, 0),), "w8a8")
    pipeline.calibrate(prepared, [_batch(s, rank) for s in range(STEPS)], progress=False)
    result["model"] = {k: v.clone() for k, v in prepared.state_dict().items()}
    qdist.check_ranks_agree(prepared)  # synced: no error

    # A rank with an empty batch joins the others' all-reduce (no hang) and
    # takes their range.
    point = q.FakeQuantize(SPECS[1][1])
    point(_batch(0, rank))
    point(_batch(1, rank) if rank == 0 else torch.empty(0, 16))
    result["empty_batch"] = _state(point)

    # NaN / Inf counts: per rank during the run, the total on rank 0 after reduce_nonfinite_counts.
    nan_point = q.FakeQuantize(SPECS[0][1])
    x = _batch(0, rank)
    x[0, : rank + 1] = float("nan")  # rank 0: 1 NaN; rank 1: 2 NaN and 1 Inf
    if rank == 1:
        x[1, 0] = float("inf")
    nan_point(x)
    result["nonfinite_local"] = nan_point.nonfinite_count
    qdist.reduce_nonfinite_counts(nan_point)
    qdist.reduce_nonfinite_counts(nan_point)  # again: the total is kept, not doubled
    result["nonfinite_reduced"] = nan_point.nonfinite_count

    # Sync off: each rank keeps its own ranges, and the debug check says so on every rank.
    qdist.configure(sync=False)
    result["unsynced"] = _calibrate_points(rank, STEPS, _batch)
    unsynced = q.FakeQuantize(SPECS[0][1])
    unsynced(_batch(0, rank))
    try:
        qdist.check_ranks_agree(unsynced)
        result["check_error"] = None
    except RuntimeError as e:
        result["check_error"] = str(e)
    try:
        qdist.ddp(unsynced)
        result["ddp_error"] = None
    except RuntimeError as e:
        result["ddp_error"] = str(e)
    qdist.configure(sync=True)
    return result


def _reference_points():
    """One process, every rank's batch of every step: MinMax sees them one
    after the other; MovingAverage sees one step's batches concatenated (its
    update averages the step's global range)."""
    refs = {}
    for name, spec in SPECS:
        m = q.FakeQuantize(spec)
        for step in range(STEPS):
            batches = [_batch(step, r) for r in range(WORLD)]
            if isinstance(spec.observer, q.MovingAverageMinMaxObserver):
                m(torch.cat(batches))
            else:
                for b in batches:
                    m(b)
        refs[name] = _state(m)
    return refs


def _assert_bit_identical(got: dict, want: dict, what: str):
    assert got.keys() == want.keys(), what
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), f"{what}: {k}: {got[k]} != {want[k]}"


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    return _run(_calibration_ranks, tmp_path_factory.mktemp("calibration"))


def test_split_calibration_is_bit_identical_to_one_process_on_all_the_data(calibration):
    refs = _reference_points()
    for rank, result in enumerate(calibration):
        for name, _ in SPECS:
            _assert_bit_identical(result["synced"][name], refs[name], f"rank {rank} {name}")


def test_without_sync_the_ranks_get_other_qparams(calibration):
    """The sync is what makes the test above pass: with it off, every point
    of rank 0 (which sees the narrower data) differs from the reference."""
    refs = _reference_points()
    for name, _ in SPECS:
        got, want = calibration[0]["unsynced"][name], refs[name]
        assert any(not torch.equal(got[k], want[k]) for k in want), name


def test_split_calibration_of_a_prepared_model_equals_one_process(calibration):
    torch.manual_seed(0)
    prepared = pipeline.prepare(MLP(), (_batch(0, 0),), "w8a8")
    pipeline.calibrate(prepared, [_batch(s, r) for s in range(STEPS) for r in range(WORLD)], progress=False)
    want = prepared.state_dict()
    for rank, result in enumerate(calibration):
        _assert_bit_identical(result["model"], dict(want), f"rank {rank} w8a8 MLP")


def test_a_rank_with_an_empty_batch_joins_the_all_reduce(calibration):
    m = q.FakeQuantize(SPECS[1][1])
    m(_batch(0, 0))
    m(_batch(0, 1))
    m(_batch(1, 0))
    for result in calibration:
        _assert_bit_identical(result["empty_batch"], _state(m), "empty batch")


def test_nonfinite_counts_are_per_rank_until_reduced_to_rank_0(calibration):
    assert [r["nonfinite_local"] for r in calibration] == [1, 3]
    assert [r["nonfinite_reduced"] for r in calibration] == [4, 0]


def test_the_debug_check_and_the_ddp_helper_refuse_ranks_that_disagree(calibration):
    for result in calibration:
        assert "4 fake-quant buffer(s) differ between ranks: scale, zero_point, min_val, max_val;" in result["check_error"]
        assert "observer sync is off" in result["ddp_error"]


def test_nothing_changes_without_torch_distributed():
    """Not initialised here: no group, and the observers run as before."""
    assert not dist.is_initialized() and qdist.sync_group() is None
