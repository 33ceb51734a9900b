"""The observers' side of distributed runs: the process-wide setting (sync on
or off, which process group) and the one collective a static observer makes.
FakeQuantize calls it; pt2e_fq.distributed (the user's entry point, with the
model-level helpers) re-exports the setting. Kept apart so that
fake_quantize need not import the helpers, which import it."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

_sync = True
_group: Optional["dist.ProcessGroup"] = None  # None: the world group


def configure(*, sync: bool = True, group: Optional["dist.ProcessGroup"] = None) -> None:
    """Sets, for the whole process, whether static observers synchronise
    (`sync`) and over which process group (`group`; None: the world).
    Every rank of a group makes the same call; with several groups (data
    parallel within a node, say) each rank names the one it belongs to."""
    if not isinstance(sync, bool):
        raise TypeError(f"configure: sync must be a bool, got {type(sync).__name__}")
    if group is not None:
        # new_group hands a rank outside the group this marker, not a group.
        outside = group is dist.GroupMember.NON_GROUP_MEMBER
        if not outside and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"configure: group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
        if outside or dist.get_rank(group) < 0:
            raise ValueError(
                f"configure: group does not contain this process (global rank {dist.get_rank()}); "
                "every rank must configure a group it belongs to"
            )
    global _sync, _group
    _sync, _group = sync, group


def sync_group() -> Optional["dist.ProcessGroup"]:
    """The group static observers all-reduce over, or None when they do not
    synchronise: torch.distributed unavailable or not initialised, a group of
    one rank, or configure(sync=False)."""
    if not _sync or not dist.is_available() or not dist.is_initialized():
        return None
    group = configured_group()
    return group if dist.get_world_size(group) > 1 else None


def enabled() -> bool:
    """False after configure(sync=False)."""
    return _sync


def configured_group() -> "dist.ProcessGroup":
    """The group given to configure, else the world (torch.distributed must be initialised)."""
    return _group if _group is not None else dist.group.WORLD


# The most dimensions a tensor has (torch's limit): every rank's shape goes
# into one fixed-size header, so the gather itself never disagrees on sizes.
_MAX_DIMS = 64


def check_shapes_agree(shape: Sequence[int], device: torch.device, group: "dist.ProcessGroup",
                       who: Callable[[], str]) -> None:
    """Raises ValueError on every rank of `group` unless every rank gives the
    same `shape` (a batch range's, before all_reduce_range: a collective of
    different sizes aborts the process inside gloo, or hangs). One
    all_gather of a fixed-size header on `device` (the data's: the one the
    group's backend takes); `who()` names the point in the message."""
    header = torch.zeros(_MAX_DIMS + 1, dtype=torch.int64)
    header[0] = len(shape)
    header[1:len(shape) + 1] = torch.tensor(list(shape), dtype=torch.int64)
    header = header.to(device)
    gathered = [torch.empty_like(header) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, header, group=group)
    shapes = [tuple(h[1:int(h[0]) + 1].tolist()) for h in gathered]
    if len(set(shapes)) > 1:
        ranks = ", ".join(f"rank {r} {s}" for r, s in enumerate(shapes))
        raise ValueError(
            f"{who()}: the ranks' batches give ranges of different shapes ({ranks}, group ranks); every rank "
            "must give this point inputs whose qparams have one shape"
        )


def all_reduce_range(lo: torch.Tensor, hi: torch.Tensor, group: "dist.ProcessGroup") -> tuple[torch.Tensor, torch.Tensor]:
    """The per-block min of `lo` and max of `hi` over the ranks of `group`, in
    one all-reduce MIN of cat([lo, -hi]) (negation is exact, so the result is
    bit-identical to reducing all the data in one process). Empty blocks
    (+inf, -inf) are the identities of MIN and MAX and stay correct."""
    n = lo.numel()
    both = torch.cat([lo.reshape(-1), hi.reshape(-1).neg()])
    dist.all_reduce(both, op=dist.ReduceOp.MIN, group=group)
    return both[:n].view(lo.shape), both[n:].neg().view(hi.shape)



def all_reduce_sum(t: torch.Tensor, group: "dist.ProcessGroup") -> torch.Tensor:
    """`t` summed over the ranks of `group` (HistogramObserver's counts)."""
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t
