"""QAT of the digits CNN on several CPU processes: DDP over gloo, observers
synchronised across the ranks (pt2e_fq.distributed), the converted program
saved by rank 0.

    torchrun --nproc-per-node 2 examples/qat_ddp.py [--float-epochs 4] [--qat-epochs 2] [--out qat_ddp.pt2]

Every rank trains on its own shard of the training set (the same number of
steps on each: DDP needs every rank in every step). Rank 0 alone logs, shows
the progress bars, converts and saves; every rank runs every step that
observes (calibration, QAT, freeze_qat), since each observation is a
collective the ranks make together.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pt2e_fq
import pt2e_fq.distributed as qdist
from pt2e_fq.cli import digits, pipeline

BATCH = 32  # per rank


def shard_batches(data: digits.Digits, rank: int, world: int, seed: int):
    """The rank's batches of one epoch: the epoch's shuffle (the same on
    every rank), cut into `world` equal shards of whole batches, so every
    rank runs as many steps."""
    x, y = data.split("train")
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    per_rank = len(x) // world // BATCH * BATCH
    mine = order[rank * per_rank:(rank + 1) * per_rank]
    return [(x[i], y[i]) for i in mine.split(BATCH)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--float-epochs", type=int, default=4)
    parser.add_argument("--qat-epochs", type=int, default=2)
    parser.add_argument("--preset", default="w8a8")
    parser.add_argument("--out", default="qat_ddp.pt2")
    args = parser.parse_args()

    # A timeout: a rank that dies or stalls makes the others fail, not wait forever.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    lead = rank == 0
    log = print if lead else (lambda *a, **k: None)

    data = digits.load()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = digits.DigitsCNN()
    epochs = lambda seed: (lambda epoch: shard_batches(data, rank, world, seed + epoch))  # noqa: E731

    log(f"{world} ranks, {len(shard_batches(data, rank, world, 0))} steps per epoch per rank")
    float_ddp = torch.nn.parallel.DistributedDataParallel(model)
    pipeline.train(float_ddp, epochs(0), F.cross_entropy, torch.optim.Adam(model.parameters(), lr=3e-3),
                   epochs=args.float_epochs, desc="float", progress=lead)
    x_test, y_test = data.split("test")
    log(f"float test accuracy {digits.accuracy(model.eval(), x_test, y_test):.1%}")

    example = (x_test[:2],)
    prepared = pipeline.prepare(model, example, args.preset, qat=True)
    # Calibration: each rank its own batches; the ranges are those of all of them.
    pipeline.calibrate(prepared, [b for b, _ in shard_batches(data, rank, world, 100)[:4]], progress=lead)
    qat = qdist.ddp(prepared)  # checks that the ranks agree; broadcast_buffers left at DDP's default
    params = [p for p in prepared.parameters() if p.requires_grad]
    pipeline.train(qat, epochs(200), F.cross_entropy, torch.optim.Adam(params, lr=1e-4),
                   epochs=args.qat_epochs, desc="QAT", progress=lead)
    qdist.broadcast_buffers(prepared)  # rank 0's batch-norm statistics, which the conv-bn weight points read
    pipeline.freeze_qat(prepared, x_test[:BATCH])  # observes once more: every rank
    qdist.check_ranks_agree(prepared)
    qdist.reduce_nonfinite_counts(prepared)  # the NaN/Inf counts of every rank, for rank 0's convert

    if lead:
        converted = pipeline.convert(prepared)
        log(f"QAT {args.preset} test accuracy {digits.accuracy(converted, x_test, y_test):.1%}")
        pt2e_fq.save(converted, example, args.out, dynamic_shapes=pipeline.batch_dynamic_shapes(example))
        log(f"saved {args.out}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
