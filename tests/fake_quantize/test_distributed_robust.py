"""Two gloo ranks given what a real run gives: points whose inputs give
qparams of different shapes on each rank, a HistogramObserver point that
sees only NaN on both ranks, and a learnable model wrapped in DDP before it
saw data. Each is one line naming the point (or the fix) on every rank, or
the same result as one process; never an abort inside gloo or a gradient
error at the first backward.

The ranks run every scenario in one spawn (a spawn costs 10-30 s); each
test reads its scenario's outcome."""

from __future__ import annotations

import datetime
import math
import os

import pytest
import torch
import torch.distributed as dist
from tests.fake_quantize.rank_processes import spawn_ranks

import pt2e_fq as q
import pt2e_fq.distributed as qdist
from pt2e_fq.observers import HistogramObserver

WORLD = 2
PG_TIMEOUT_S = 20

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


class _Holder(torch.nn.Module):
    """A model holding one point under a name the errors must give."""

    def __init__(self, spec: q.QSpec):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.input_point = q.FakeQuantize(spec)

    def forward(self, x):
        return self.linear(self.input_point(x))


HISTOGRAM = q.QSpec(q.INT8, q.PerTensor(), "asymmetric", observer=HistogramObserver(bins=64, num_candidates=6))


def _finite_batch(rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))


def _outcome(fn):
    try:
        return fn()
    except Exception as e:  # what the rank surfaces, whatever it is
        return f"{type(e).__name__}: {e}"


def _histogram_nan_then_finite():
    point = q.FakeQuantize(HISTOGRAM)
    point(torch.full((4, 8), math.nan))
    point(torch.full((4, 8), math.inf))
    point(_finite_batch(dist.get_rank()))
    return {"scale": point.scale.clone(), "zero_point": point.zero_point.clone(), "nonfinite": point.nonfinite_count}


def _shapes_disagree():
    # Per channel on the last axis: 8 channels on rank 0, 12 on rank 1.
    model = _Holder(q.QSpec(q.INT8, q.PerChannel(1), "symmetric"))
    model.linear = torch.nn.Identity()
    model(torch.randn(3, 8 if dist.get_rank() == 0 else 12))
    return None


def _ddp_before_calibration():
    model = _Holder(q.QSpec(q.INT8, q.PerTensor(), "asymmetric", learnable=True))
    wrapped = qdist.ddp(model)
    for step in range(2):
        wrapped(_finite_batch(step)).square().sum().backward()
    return None


def _scenarios(rank, out_dir):
    torch.set_num_threads(1)  # 2 ranks on 2 cores
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    try:
        results = {name: _outcome(fn) for name, fn in (("histogram", _histogram_nan_then_finite),
                                                         ("shapes", _shapes_disagree),
                                                         ("ddp", _ddp_before_calibration))}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("robust")
    files = [os.path.join(out_dir, f"rank{r}.pt") for r in range(WORLD)]
    spawn_ranks(_scenarios, (str(out_dir),), WORLD, files)
    return [torch.load(f, weights_only=False) for f in files]


def test_histogram_points_that_see_only_nan_on_every_rank_calibrate_on_the_finite_batches(outcomes):
    # The same qparams as one process given both ranks' finite batches.
    one = q.FakeQuantize(HISTOGRAM)
    one(torch.cat([_finite_batch(r) for r in range(WORLD)]))
    for rank, got in enumerate(outcomes):
        assert isinstance(got["histogram"], dict), f"rank {rank}: {got['histogram']}"
        assert torch.equal(got["histogram"]["scale"], one.scale), rank
        assert torch.equal(got["histogram"]["zero_point"], one.zero_point), rank
        assert got["histogram"]["nonfinite"] == 64, rank  # its own NaN and Inf batches, ignored and counted


def test_ranks_whose_points_disagree_on_the_qparam_shape_all_raise_naming_the_point_and_shapes(outcomes):
    for rank, got in enumerate(outcomes):
        error = got["shapes"]
        assert error is not None and error.startswith("ValueError: FakeQuantize("), f"rank {rank}: {error}"
        assert "'input_point'" in error and "rank 0 (1, 8), rank 1 (1, 12)" in error, f"rank {rank}: {error}"
        assert "\n" not in error


def test_ddp_refuses_a_learnable_model_before_its_first_observation(outcomes):
    for rank, got in enumerate(outcomes):
        error = got["ddp"]
        assert error is not None and error.startswith("RuntimeError: ddp: 1 learnable fake-quant point(s) have "
                                                      "no qparams yet (input_point): calibrate first"), \
            f"rank {rank}: {error}"
        assert "\n" not in error
