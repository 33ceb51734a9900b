"""Training step time of several models on the same batch, measured
interleaved (one step of each in turn), so that a machine whose load drifts
slows them alike and their ratio stays meaningful.

    ms = step_times({"float": model, "QAT": prepared}, (x,), y, F.cross_entropy)
    ms["QAT"] / ms["float"]          # the QAT overhead
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from typing import Callable

import torch


def _wait_for_device(args) -> None:
    """On a GPU the step's kernels run after the Python call returns: wait for
    them, so the clock reads the step's time, not its launch time."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_cuda:
            torch.cuda.synchronize(a.device)
            return


def _step(model, optimizer, args, target, loss_fn) -> float:
    _wait_for_device(args)
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss_fn(model(*args), target).backward()
    optimizer.step()
    _wait_for_device(args)
    return time.perf_counter() - start


def step_times(
    models: dict[str, torch.nn.Module],
    args: tuple,
    target,
    loss_fn: Callable,
    *,
    steps: int = 20,
    warmup: int = 3,
) -> dict[str, float]:
    """Median milliseconds of one training step (zero_grad, forward, loss,
    backward, SGD step) per model, on copies: the models are not changed."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"step_times: steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    runs = {}
    for name, model in models.items():
        with warnings.catch_warnings():  # torch's own pytree deprecation, raised by copying a GraphModule
            warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
            model = copy.deepcopy(model)
        params = [p for p in model.parameters() if p.requires_grad]
        runs[name] = (model, torch.optim.SGD(params, lr=1e-4))
    seconds = {name: [] for name in runs}
    for i in range(warmup + steps):
        for name, (model, optimizer) in runs.items():
            t = _step(model, optimizer, args, target, loss_fn)
            if i >= warmup:
                seconds[name].append(t)
    return {name: 1000 * statistics.median(s) for name, s in seconds.items()}
