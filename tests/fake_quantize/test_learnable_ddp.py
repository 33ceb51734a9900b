"""Learned qparams under DDP (2 gloo ranks on CPU): DistributedDataParallel
all-reduces their gradients like any parameter's, so each rank's gradient is
the mean of what one process computes on each rank's batch; and
pt2e_fq.distributed's helpers cover them (check_ranks_agree finds a learned
scale that differs between ranks, broadcast_buffers makes it rank 0's)."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from tests.fake_quantize.rank_processes import spawn_ranks

import pt2e_fq as q
import pt2e_fq.distributed as qdist

WORLD = 2
pytestmark = [pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
              pytest.mark.slow]


class _LearnedLinear(torch.nn.Module):
    """x @ fake_quant(weight).T, the weight's ranges learned per channel
    (scale) and the output's per tensor (scale and zero point, asymmetric)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(6, 16, generator=torch.Generator().manual_seed(0)))
        self.weight_fq = q.FakeQuantize(q.QSpec(q.INT4, q.PerChannel(0), learnable=True,
                                                observer=q.CurrentMinMaxObserver()))
        self.out_fq = q.FakeQuantize(q.QSpec(q.INT8, q.PerTensor(), "asymmetric", learnable=True,
                                             observer=q.CurrentMinMaxObserver()))

    def forward(self, x):
        return self.out_fq(x @ self.weight_fq(self.weight).T)


def _batch(rank):
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + rank))


def _model():
    model = _LearnedLinear()
    # The same first batch on every rank: the observers size and set the
    # qparams. Half-size, so that the batches below leave the output's range
    # and its zero point gets a gradient.
    model(_batch(0) * 0.5)
    for m in model.modules():
        if isinstance(m, q.FakeQuantize):
            m.disable_observer()
    return model


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _worker(rank, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(_model())
        ddp(_batch(rank)).square().sum().backward()
        torch.save(_grads(ddp.module), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ddp_averages_the_learned_qparams_gradients(tmp_path):
    spawn_ranks(_worker, (str(tmp_path),), WORLD, [tmp_path / f"rank{r}.pt" for r in range(WORLD)])
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    per_rank = []
    for rank in range(WORLD):  # one process, each rank's batch
        model = _model()
        model(_batch(rank)).square().sum().backward()
        per_rank.append(_grads(model))
    names = {"weight_fq.scale", "out_fq.scale", "out_fq.zero_point"}
    assert names <= set(got[0])
    for name in got[0]:
        want = (per_rank[0][name] + per_rank[1][name]) / WORLD
        assert want.abs().sum() > 0, f"{name}: no gradient to compare"
        for r in range(WORLD):
            torch.testing.assert_close(got[r][name], want, rtol=1e-5, atol=1e-6)


def _drift_worker(rank, out_dir):
    """Each rank trains its own copy one step on its own batch (no DDP), so
    the learned scales differ; then the helpers run."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    try:
        model = _model()
        model(_batch(rank)).square().sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
        found = None
        try:
            qdist.check_ranks_agree(model)
        except RuntimeError as e:
            found = str(e)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        qdist.broadcast_buffers(model, src=0)
        qdist.check_ranks_agree(model)  # raises if the broadcast missed one
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
        torch.save(dict(found=found, before=before, after=after,
                        params_are_leaves=all(p.is_leaf and p.grad_fn is None for p in model.parameters())),
                   os.path.join(out_dir, f"drift{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_the_distributed_helpers_find_and_fix_learned_qparams_that_differ(tmp_path):
    spawn_ranks(_drift_worker, (str(tmp_path),), WORLD, [tmp_path / f"drift{r}.pt" for r in range(WORLD)])
    got = [torch.load(tmp_path / f"drift{r}.pt") for r in range(WORLD)]
    learned = ["weight_fq.scale", "out_fq.scale", "out_fq.zero_point"]
    for name in learned:  # the premise: one step on different batches moved them apart
        assert not torch.equal(got[0]["before"][name], got[1]["before"][name]), name
    for r in range(WORLD):
        message = got[r]["found"]
        assert message is not None, f"rank {r}: check_ranks_agree found no difference"
        for name in learned:
            assert name in message, f"rank {r}: {name} not named in {message!r}"
        assert got[r]["params_are_leaves"]
        for name in learned:  # rank 0's values, bit for bit, on every rank
            assert torch.equal(got[r]["after"][name], got[0]["before"][name]), (r, name)
        # The weight is DDP's to keep equal, not the helper's: left as it was.
        assert torch.equal(got[r]["after"]["weight"], got[r]["before"]["weight"])
