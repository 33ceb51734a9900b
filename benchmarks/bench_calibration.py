"""Observer calibration time on the trained checkpoints: our w8a8 preset
(HistogramObserver on activations) against torchao's XNNPACKQuantizer and
X86InductorQuantizer (stock_flows.stock_quantizer, their default int8
configs, whose activation observers are HistogramObservers too), the
stages timed separately in one process: torch.export, prepare_pt2e, and
the calibration forwards (pipeline.calibrate: batches through the
prepared model without gradients). Post-calibration algorithms
(pt2e_fq.calib.apply) are not part of it. Wall and CPU seconds; CPU
seconds (time.process_time, all threads) are the steadier figure on a
shared machine. Coverage (stock_flows.coverage, of the converted graph)
says what each flow quantized: X86InductorQuantizer leaves
EfficientNet-Lite0's padded convolutions float.

    python benchmarks/bench_calibration.py                 # 8 batches of 8, both models
    python benchmarks/bench_calibration.py --quick         # 2 batches of 8
    python benchmarks/bench_calibration.py --models minilm --batches 4 --threads 4
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

import stock_flows  # noqa: E402
import trained_models as tm  # noqa: E402
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e  # noqa: E402

from pt2e_fq.cli import pipeline  # noqa: E402
from quantizers import presets  # noqa: E402

MODELS = ("efficientnet_lite0", "minilm")
FLOWS = ("ours w8a8", *stock_flows.STOCK_QUANTIZERS)


def _data(name: str, batches: int, batch: int):
    if name == "efficientnet_lite0":
        model = tm.efficientnet_lite0()
        return model, tm.image_data(batches * batch, len(tm.HELD_OUT_IMAGES), batch=batch)[0]  # held-out: unused
    model = tm.minilm()
    return model, tm.sentence_data(model.tokenizer, batches * batch, batch, batch=batch)[0]


class _Clock:
    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def _quantizer(flow: str):
    if flow == "ours w8a8":
        return pipeline.quantizer_for(presets.get_preset("w8a8"))
    return stock_flows.stock_quantizer(flow)


def run(name: str, batches: int, batch: int) -> list:
    model, data = _data(name, batches, batch)
    rows = []
    for flow in FLOWS:
        with _Clock() as export:
            gm = pipeline.export(model.eval(), data[0])
        with _Clock() as prepare:
            prepared = prepare_pt2e(gm, _quantizer(flow))
        with _Clock() as calibrate:
            pipeline.calibrate(prepared, data, progress=False)
        coverage = stock_flows.coverage(convert_pt2e(prepared))
        rows.append((name, flow, str(coverage), f"{export.wall:.2f}", f"{prepare.wall:.2f} ({prepare.cpu:.2f})",
                     f"{calibrate.wall:.2f} ({calibrate.cpu:.2f})",
                     f"{prepare.wall + calibrate.wall:.2f} ({prepare.cpu + calibrate.cpu:.2f})"))
        print(f"  {rows[-1]}", flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--quick", action="store_true", help="2 calibration batches")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = 2 if args.quick else args.batches
    rows = [row for name in args.models for row in run(name, batches, args.batch)]
    print(f"\n{batches} calibration batches of {args.batch}; torch {torch.__version__}, {args.threads} thread(s); "
          "seconds: wall (CPU)")
    print(tabulate(rows, headers=("model", "flow", "coverage", "export s", "prepare s", "calibrate s",
                                  "prepare + calibrate s")))


if __name__ == "__main__":
    main()
