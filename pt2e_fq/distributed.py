"""Distributed calibration and QAT: static observers synchronised across ranks.

When torch.distributed is initialised with more than one rank, every static
point whose observer keeps a running range (MinMaxObserver,
MovingAverageMinMaxObserver, HistogramObserver) all-reduces the per-block
min and max of each batch over the process group before it updates that
range, so N ranks calibrate exactly as one process on all their data, and
every rank holds the same range and qparams at every step. Two collectives
per point per observation: an all-gather of the batch range's shape (ranks
whose inputs give ranges of different shapes then all raise, naming the
point and the shapes, instead of aborting inside the all-reduce), then an
all-reduce MIN of cat([lo, -hi]);
HistogramObserver adds one, an all-reduce SUM of the batch's bin counts
(binned over the reduced range, so the bins are the same on every rank).

    import pt2e_fq.distributed as qdist
    qdist.configure(group=dp_group)       # default: the world group
    qdist.configure(sync=False)           # opt out (each rank keeps its own ranges)
    model = qdist.ddp(prepared)           # DDP after checking the ranks agree
    qdist.check_ranks_agree(model)        # debug: every point's state is the same on every rank
    qdist.reduce_nonfinite_counts(model)  # before convert on rank 0: the NaN/Inf counts of all ranks

Not synchronised: MSEObserver and CurrentMinMaxObserver look at the current
tensor only, which is meant for weights (identical on every rank under DDP,
and unsharded inside forward under FSDP2), and dynamic points compute their
qparams from the live tensor at every call. `check_ranks_agree` catches a
point that drifts anyway.

The count of NaN / Inf values a point ignored (`FakeQuantize.nonfinite_count`)
stays per rank during the run: summing it at every step would add a second
collective per point. `reduce_nonfinite_counts` moves the totals to the
group's rank 0 (one collective for all points), where convert and report
read them.

Nothing here syncs with the host, and nothing changes when torch.distributed
is not initialised. docs/fake_quantize.md, "Distributed QAT", says what a user
must and must not do.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch
import torch.distributed as dist

from . import _observer_sync
from .fake_quantize import FakeQuantize
from ._observer_sync import all_reduce_range, configure, sync_group

__all__ = ["configure", "sync_group", "check_ranks_agree", "reduce_nonfinite_counts", "ddp", "broadcast_buffers",
           "checkpoint_state_dict"]

def _points(model: torch.nn.Module) -> list[tuple[str, FakeQuantize]]:
    return [(path, m) for path, m in model.named_modules() if isinstance(m, FakeQuantize)]


def _group_or_default(group, who: str) -> "dist.ProcessGroup":
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{who}: torch.distributed is not initialised (call torch.distributed.init_process_group first)")
    return group if group is not None else _observer_sync.configured_group()


def check_ranks_agree(
    model: torch.nn.Module, group: Optional["dist.ProcessGroup"] = None, *, synced_only: bool = False
) -> None:
    """Debug check, a collective every rank must call: raises RuntimeError on
    every rank, naming them, when any FakeQuantize qparam (a buffer, or a
    learnable point's Parameter) or running range differs between the ranks
    of `group` (default: the observers' group, else the world). `synced_only`:
    only the points whose observers synchronise (the others, weight points,
    recompute their qparams from the weights at the next observed forward,
    and DDP's construction broadcasts rank 0's Parameters, learned qparams
    included). Two all-reduces for the whole model (the sizes, then the
    values); a NaN reads as a difference."""
    group = _group_or_default(group, "check_ranks_agree")
    named = [
        (f"{path}.{name}" if path else name, m._state(name))
        for path, m in _points(model)
        for name in m._qparam_buffer_names() + ("min_val", "max_val", "histogram")
        if not synced_only or m._observer.keeps_range
        if m._state(name) is not None
    ]
    if not named:
        return
    device = named[0][1].device
    # float64 holds every fp32 and int32 value exactly.
    numels = torch.tensor([float(t.numel()) for _, t in named], dtype=torch.float64, device=device)
    sizes = torch.cat([torch.tensor([float(len(named))], dtype=torch.float64, device=device), numels.sum().reshape(1)])
    lo, hi = all_reduce_range(sizes, sizes, group)
    if not torch.equal(lo, hi):
        raise RuntimeError(
            f"check_ranks_agree: the ranks hold different fake-quant state: {int(lo[0])}..{int(hi[0])} buffers "
            f"of {int(lo[1])}..{int(hi[1])} elements; every rank must prepare the same model"
        )
    values = torch.cat([numels] + [t.detach().reshape(-1).to(torch.float64) for _, t in named])
    lo, hi = all_reduce_range(values, values, group)
    same = lo == hi
    k = len(named)
    bad = [name for (name, _), ok in zip(named, same[:k].tolist()) if not ok]
    if not bad:
        start = k
        for name, t in named:
            if not bool(same[start:start + t.numel()].all()):
                bad.append(name)
            start += t.numel()
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise RuntimeError(
            f"check_ranks_agree: {len(bad)} fake-quant buffer(s) differ between ranks: {shown}; calibrate with "
            "the observers synchronised (pt2e_fq.distributed.configure(sync=True), the default) and the same "
            "points enabled on every rank"
        )


def reduce_nonfinite_counts(model: torch.nn.Module, group: Optional["dist.ProcessGroup"] = None) -> None:
    """A collective every rank must call: moves the total, over the ranks of
    `group`, of each static point's count of ignored NaN / Inf values to the
    group's rank 0 (the others keep 0), so that convert and report on rank 0
    show the whole run's counts. Calling it again is harmless: the counts'
    sum over the ranks is kept."""
    group = _group_or_default(group, "reduce_nonfinite_counts")
    counts = [m._buffers["nonfinite"] for _, m in _points(model) if m._buffers.get("nonfinite") is not None]
    if not counts:
        return
    total = torch.stack(counts)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    keep = 1 if dist.get_rank(group) == 0 else 0
    for count, value in zip(counts, total.unbind()):
        count.copy_(value * keep)


def ddp(model: torch.nn.Module, **ddp_kwargs) -> torch.nn.parallel.DistributedDataParallel:
    """Wraps a prepared model in DistributedDataParallel over the observers'
    group, after checking that the observers synchronise and that every
    rank's synchronised points hold the same ranges and qparams
    (check_ranks_agree(synced_only=True); DDP's own broadcast at
    construction would otherwise hide ranks that calibrated alone). The DDP arguments pass through as given, `broadcast_buffers`
    included: with synchronised observers every rank already holds rank 0's
    ranges, so broadcasting them is redundant (False saves one broadcast per
    forward; batch norm statistics are then per rank, as without QAT).
    A model with learnable points must have seen data first (their
    Parameters are sized by the first observation, and DDP fixes its
    gradient buckets at construction)."""
    group = sync_group()
    if group is None:
        why = ("torch.distributed is not initialised" if not (dist.is_available() and dist.is_initialized())
               else "observer sync is off (pt2e_fq.distributed.configure(sync=False))" if not _observer_sync.enabled()
               else "the group has one rank")
        raise RuntimeError(
            f"ddp: the observers would not synchronise ({why}); wrap with DistributedDataParallel "
            "directly if each rank should keep its own ranges"
        )
    unsized = [path for path, m in _points(model)
               if any(p is not None and p.numel() == 0 for p in m._parameters.values())]
    if unsized:
        # DDP sizes its gradient buckets at construction: a learnable point's
        # Parameter, still empty, would get a bucket slot of 0 elements.
        raise RuntimeError(
            f"ddp: {len(unsized)} learnable fake-quant point(s) have no qparams yet ({', '.join(unsized[:3])}"
            f"{', ...' if len(unsized) > 3 else ''}): calibrate first (one forward of the prepared model on "
            "every rank), then wrap it"
        )
    check_ranks_agree(model, group, synced_only=True)
    ddp_kwargs.setdefault("process_group", group)
    return torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs)


def broadcast_buffers(model: torch.nn.Module, src: int = 0, group: Optional["dist.ProcessGroup"] = None) -> None:
    """A collective every rank must call: every buffer of `model`, and the
    learned qparams (Parameters) of its learnable fake-quant points, become
    rank `src`'s (group rank). Call it before freeze_qat or an evaluation
    that observes: DDP broadcasts rank 0's buffers before each forward, and
    each rank's batch then updates its own batch-norm running statistics,
    which a conv-bn's weight fake-quant reads in QAT; without this the
    ranks freeze different weight qparams. A learned scale that drifted
    apart (trained before DDP wrapped the model, or by a rank's own
    optimizer step) is made equal too; the model's other Parameters are
    DDP's to keep equal and are left alone. One broadcast per tensor."""
    group = _group_or_default(group, "broadcast_buffers")
    learned = [p for _, m in _points(model) for p in m._parameters.values() if p is not None]
    with torch.no_grad():  # in place into the Parameters, which autograd must not record
        for t in list(model.buffers()) + learned:
            dist.broadcast(t, group_src=src, group=group)


def checkpoint_state_dict(model: torch.nn.Module, checkpoint_id: Union[str, os.PathLike]) -> dict:
    """The model's state dict (torch.distributed.checkpoint.state_dict.
    get_model_state_dict), ready for `dcp.load(state, checkpoint_id=...)`
    from the checkpoint folder `checkpoint_id`: dcp.load fills the given
    tensors in place, and a fake-quant buffer that has seen no data yet is
    empty, so it gets the shape the checkpoint saved. Then
    `set_model_state_dict(model, state)`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if not os.path.isdir(checkpoint_id):
        raise FileNotFoundError(f"checkpoint_state_dict: checkpoint_id {os.fspath(checkpoint_id)!r} is not a checkpoint folder")
    saved = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    state = get_model_state_dict(model)
    for path, m in _points(model):
        for name, buf in m._buffers.items():
            key = f"{path}.{name}" if path else name
            meta = saved.get(key)
            if key in state and buf.numel() == 0 and isinstance(meta, TensorStorageMetadata):
                state[key] = torch.empty(meta.size, dtype=buf.dtype, device=buf.device)
    return state
