"""Budgeted mixed precision on the trained checkpoints against the uniform
presets, at their average weight bits (quantizers.mixed_precision).

Per model: the sensitivity of every point (w4a8 and w8a8, each point alone
quantized, measured on the calibration batches, the first one with --quick), the most sensitive points
listed; then for each budget the per-layer choice among int4 in groups of
32 (w4a8), int8 per channel (w8a8) and float, and rows for the uniform
presets (get_preset, and w4a8 with presets.int8_edges on a CNN, as the
one-call form configures it). Every row is prepared, calibrated and
converted the same way (round-to-nearest weights: no calib.apply
algorithms) and measured on the held-out data against the float model
(trained_models metrics, ± one standard error); "bits" is
average_weight_bits of the prepared model.

    python benchmarks/bench_mixed_precision.py                      # both models, budgets 4.5 5 6
    python benchmarks/bench_mixed_precision.py --quick              # fewer samples
    python benchmarks/bench_mixed_precision.py --models minilm --budgets 5 --top 10
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trained_models as tm  # noqa: E402
from bench_trained import DIGITS, _setup  # noqa: E402

from pt2e_fq.cli import pipeline  # noqa: E402
from quantizers import mixed_precision as mp  # noqa: E402
from quantizers import presets  # noqa: E402

MODELS = ("efficientnet_lite0", "minilm")
UNIFORM = ("mxfp4", "w4a8", "nvfp4", "w4a16", "w8a8")
CANDIDATES = ("w4a8", "w8a8")


def _measure(model, calibration, held_out, config, reference, metrics, keys):
    prepared = pipeline.prepare(model, calibration[0], config)
    pipeline.calibrate(prepared, calibration, progress=False)
    bits = mp.average_weight_bits(prepared)
    values = metrics(reference, tm.outputs(pipeline.convert(prepared), held_out))
    return f"{bits:.3f}", *(tm.format_estimate(values[k], DIGITS[k]) for k in keys)


def run(name: str, budgets, quick: bool, top: int) -> None:
    model, calibration, held_out, metrics, keys = _setup(name, quick)
    reference = tm.outputs(model, held_out)
    start = time.perf_counter()
    # --quick: the noise of each point on the first calibration batch only (one forward per point and format).
    evaluation = calibration[:1] if quick else calibration
    measured = mp.sensitivity(pipeline.export(model, calibration[0]), calibration, evaluation, CANDIDATES)
    seconds = time.perf_counter() - start
    print(f"\n{name}: the {top} most sensitive points alone (output SQNR on the calibration batches, dB; "
          f"{seconds:.0f} s)")
    print(measured.table(top))
    rows = []
    for preset in UNIFORM:
        rows.append(("uniform", preset, *_measure(model, calibration, held_out, presets.get_preset(preset),
                                                  reference, metrics, keys)))
        print(f"  {rows[-1]}", flush=True)
    if name == "efficientnet_lite0":
        config = presets.int8_edges(presets.get_preset("w4a8"), model)
        rows.append(("uniform", "w4a8 + int8 edges", *_measure(model, calibration, held_out, config, reference,
                                                               metrics, keys)))
    for budget in budgets:
        chosen = mp.mixed_precision(measured, budget)
        counts = ", ".join(f"{c} {n}" for c, n in sorted(
            {c: sum(v == c for v in chosen.choices.values()) for c in set(chosen.choices.values())}.items()))
        rows.append((f"mixed <= {budget:g}", counts, *_measure(model, calibration, held_out, chosen.config,
                                                               reference, metrics, keys)))
        print(f"  {rows[-1]}", flush=True)
    n = sum(len(b[0]) if isinstance(b, tuple) else len(b) for b in held_out)
    print(f"\n{name}: {n} held-out samples, torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
          "round-to-nearest weights")
    print(tabulate(rows, headers=("config", "formats", "bits", *keys), disable_numparse=True))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--budgets", nargs="+", type=float, default=(4.5, 5.0, 6.0))
    parser.add_argument("--quick", action="store_true", help="fewer calibration and held-out samples")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=8, help="sensitive points listed per model")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for name in args.models:
        start = time.perf_counter()
        run(name, args.budgets, args.quick, args.top)
        print(f"({name}: {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
