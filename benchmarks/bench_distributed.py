"""Distributed QAT step: 1 rank against 2 ranks under DDP (gloo, CPU), and
the share of the step the observers' collectives take.

Each configuration trains the same model (an encoder block prepared for QAT
with w8a8: static int8 activations, whose MinMax observers synchronise) for
--steps timed steps after --warmup, one torch thread per rank, the same batch
per rank (weak scaling: 2 ranks see twice the data per step). Printed: the
median step time (zero_grad, forward, loss, backward with DDP's gradient
all-reduce, SGD step) over the ranks' medians' maximum, its ratio to the
1-rank step, the samples per second, the observer all-reduces per step
(one per synchronised point) and the time in them, measured around
pt2e_fq._observer_sync.all_reduce_range (gloo's CPU all-reduce returns when
done), as a share of the step. "2 ranks, sync off" is the same run with
pt2e_fq.distributed.configure(sync=False): what the synchronisation costs.

    python benchmarks/bench_distributed.py [--steps N] [--warmup N] [--batch N]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate

from pt2e_fq import _observer_sync
import pt2e_fq.distributed as qdist
from pt2e_fq.cli import pipeline
from models import EncoderBlock

SIZE = dict(d=128, heads=4, hidden=512)
SEQ = 32


def _batch(rank: int, batch: int):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(batch, SEQ, SIZE["d"], generator=g), torch.randn(batch, SEQ, SIZE["d"], generator=g)


def _timed_collectives():
    """Wraps the observers' all-reduce to add up its calls and seconds."""
    stats = {"calls": 0, "seconds": 0.0}
    inner = _observer_sync.all_reduce_range

    def timed(lo, hi, group):
        start = time.perf_counter()
        out = inner(lo, hi, group)
        stats["seconds"] += time.perf_counter() - start
        stats["calls"] += 1
        return out

    _observer_sync.all_reduce_range = timed
    return stats


def _measure(rank: int, world: int, args) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = _batch(rank, args.batch)
    prepared = pipeline.prepare(EncoderBlock(**SIZE), (x,), "w8a8", qat=True)
    pipeline.calibrate(prepared, [x], progress=False)
    model = qdist.ddp(prepared) if world > 1 and qdist.sync_group() is not None else (
        torch.nn.parallel.DistributedDataParallel(prepared) if world > 1 else prepared)
    optimizer = torch.optim.SGD(prepared.parameters(), lr=1e-3)
    stats = _timed_collectives()
    steps, collective = [], []
    for i in range(args.warmup + args.steps):
        calls, seconds = stats["calls"], stats["seconds"]
        start = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if i >= args.warmup:
            steps.append(time.perf_counter() - start)
            collective.append((stats["calls"] - calls, stats["seconds"] - seconds))
    return dict(step_ms=1e3 * statistics.median(steps),
                calls=collective[0][0],
                collective_ms=1e3 * statistics.median(s for _, s in collective))


def _rank(rank: int, world: int, sync: bool, store: str, args) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    qdist.configure(sync=sync)
    result = _measure(rank, world, args)
    torch.save(result, f"{store}.rank{rank}")
    dist.destroy_process_group()


def _run_ranks(world: int, sync: bool, args) -> dict:
    """The configuration on `world` spawned ranks: the slowest rank's medians."""
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.spawn(_rank, args=(world, sync, store, args), nprocs=world, join=True)
        results = [torch.load(f"{store}.rank{r}") for r in range(world)]
    return max(results, key=lambda r: r["step_ms"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    args = parser.parse_args()

    rows = []
    runs = [("1 rank", 1, True), ("2 ranks, DDP, observers synced", 2, True), ("2 ranks, DDP, sync off", 2, False)]
    base = None
    for name, world, sync in runs:
        r = _run_ranks(world, sync, args)
        base = base or r["step_ms"]
        share = r["collective_ms"] / r["step_ms"]
        rows.append([name, f"{r['step_ms']:.2f}", f"{r['step_ms'] / base:.2f}x",
                     f"{world * args.batch * 1e3 / r['step_ms']:.0f}", r["calls"],
                     f"{r['collective_ms']:.3f}", f"{100 * share:.1f}%"])
    print(f"QAT step, EncoderBlock(d={SIZE['d']}, hidden={SIZE['hidden']}) w8a8, batch {args.batch}x{SEQ} per rank, "
          f"gloo on CPU, 1 thread per rank, median of {args.steps} steps ({os.cpu_count()} cores)")
    print(tabulate(rows, headers=["run", "step ms", "vs 1 rank", "samples/s", "observer all-reduces/step",
                                  "ms in them/step", "share of step"]))


if __name__ == "__main__":
    main()
