"""Trained checkpoints quantized by every preset, against the float model,
with torchao's stock PT2E flows beside and the coverage of every flow
(how many conv / linear weights and activation inputs its converted graph
quantizes: a flow that leaves layers float looks accurate for that reason).

Rows per model: the float model; each preset as `get_preset(name)` gives it
(round-to-nearest weights, "RTN"); each preset as the one-call
`pipeline.quantize(model, example, name, calibration=batches)` runs it
("preset default": on a CNN the 4-bit presets keep the first conv,
depthwise convs and classifier at int8 weights, presets.int8_edges; then
pt2e_fq.calib.apply's algorithms for the presets of presets.PTQ_ALGORITHMS
and, on a CNN, calib.correct_activation_bias (presets.CNN_PTQ_ALGORITHMS),
timed: the wall and CPU seconds of them all, and the wall seconds of the
weight rounding (weight ranges, GPTQ, bias correction) and of the
activation range search (w8a8) among them);
XNNPACKQuantizer and X86InductorQuantizer with int8 and int4 weights
(stock_flows.stock_quantizer).
Metrics: benchmarks/trained_models.py (± one standard error).

    python benchmarks/bench_trained.py                         # the full table
    python benchmarks/bench_trained.py --quick                 # fewer crops and sentences
    python benchmarks/bench_trained.py --models minilm --presets w8a8 w4a8 --layers 5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trained_models as tm  # noqa: E402

from pt2e_fq import calib  # noqa: E402
import stock_flows  # noqa: E402
from pt2e_fq.cli import pipeline  # noqa: E402
from quantizers import presets  # noqa: E402

MODELS = ("efficientnet_lite0", "minilm")
PRESETS = ("w8a8", "w8a16", "w4a16", "w4a8", "fp8", "mxfp8", "nvfp4", "mxfp4")


def _setup(name: str, quick: bool):
    if name == "efficientnet_lite0":
        model = tm.efficientnet_lite0()
        sizes = (32, 64) if quick else (tm.CALIBRATION_CROPS, tm.HELD_OUT_CROPS)
        calibration, held_out = tm.image_data(*sizes)
        return model, calibration, held_out, tm.classifier_metrics, ("top1", "top5", "kl", "sqnr")
    model = tm.minilm()
    sizes = (64, 128) if quick else (tm.CALIBRATION_SENTENCES, tm.HELD_OUT_SENTENCES)
    calibration, held_out = tm.sentence_data(model.tokenizer, *sizes)
    return model, calibration, held_out, tm.embedding_metrics, ("cosine", "nn", "spearman", "sqnr")


def preset_default_config(model, name: str):
    """The config pipeline.quantize uses for the preset `name`."""
    config = presets.get_preset(name)
    return presets.int8_edges(config, model) if name in presets.INT8_EDGE_PRESETS else config


def _ours(model, calibration, name: str, default: bool):
    config = preset_default_config(model, name) if default else presets.get_preset(name)
    prepared = pipeline.prepare(model, calibration[0], config)
    pipeline.calibrate(prepared, calibration, progress=False)
    start, cpu_start = time.perf_counter(), time.process_time()
    report = pipeline.run_ptq_algorithms(prepared, model, calibration, name if default else None)
    seconds = (time.perf_counter() - start, time.process_time() - cpu_start)
    return convert_pt2e(prepared), report, seconds


DIGITS = {"top1": 1, "top5": 1, "kl": 3, "sqnr": 1, "cosine": 4, "nn": 1, "spearman": 4}
# Column headers, as docs/quantizers.md's tables have them (the table prints as Markdown to paste there).
HEADERS = {"top1": "top-1 %", "top5": "top-5 %", "kl": "KL", "sqnr": "SQNR dB", "cosine": "cosine",
           "nn": "NN agreement %", "spearman": "Spearman"}


def run(name: str, preset_names, quick: bool, layers: int, stock_bits=stock_flows.STOCK_WEIGHT_BITS) -> None:
    model, calibration, held_out, metrics, keys = _setup(name, quick)
    reference = tm.outputs(model, held_out)
    rows, worst = [], []

    def add(flow, preset, converted, report=None, seconds=None):
        values = metrics(reference, tm.outputs(converted, held_out))
        time_text = "-"
        if report is not None:  # the whole of run_ptq_algorithms, and the weight rounding within it
            stages = report.stage_seconds
            time_text = f"{seconds[0]:.0f} ({seconds[1]:.0f} CPU), rounding {stages['rounding']:.0f}"
            if "activation_ranges" in stages:
                time_text += f", range search {stages['activation_ranges']:.0f}"
        rows.append((flow, preset, str(stock_flows.coverage(converted)),
                     *(tm.format_estimate(values[k], DIGITS[k]) for k in keys), time_text))
        print("| " + " | ".join(rows[-1]) + " |", flush=True)  # as the table prints it, should the run stop

    for preset in preset_names:
        add("ours RTN", preset, _ours(model, calibration, preset, default=False)[0])
        if preset in presets.PTQ_ALGORITHMS or preset in presets.INT8_EDGE_PRESETS:
            converted, report, seconds = _ours(model, calibration, preset, default=True)
            add("ours preset default", preset, converted, report, seconds)
            if report is not None and layers:
                worst.append((preset, report))
    for stock in stock_flows.STOCK_QUANTIZERS:
        for bits in stock_bits:
            converted = stock_flows.stock_quantize(model, calibration[0], calibration, stock, bits)
            add(stock, f"w{bits}a8", converted)
    n = sum(len(b[0]) if isinstance(b, tuple) else len(b) for b in held_out)
    headers = ("flow", "preset", "coverage", *(HEADERS[k] for k in keys), "PTQ algorithms s")
    print(f"\n{name}: {n} held-out samples, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))
    for preset, report in worst:
        print(f"\n{name} {preset}: the {layers} layers of lowest output SQNR after the algorithms "
              "(calibration inputs, dB)")
        print(tabulate([(r.name, f"{r.before_db:.1f}", f"{r.after_db:.1f}") for r in report.worst(layers)],
                       headers=("layer", "RTN", "after"), tablefmt="github", disable_numparse=True))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--presets", nargs="+", default=PRESETS, choices=PRESETS)
    parser.add_argument("--quick", action="store_true", help="64 crops / 128 sentences held out")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=5, help="worst layers listed per preset (0: none)")
    parser.add_argument("--stock-bits", nargs="*", type=int, default=stock_flows.STOCK_WEIGHT_BITS,
                        choices=stock_flows.STOCK_WEIGHT_BITS, help="weight widths of the stock flows (none: no stock rows)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for name in args.models:
        start = time.perf_counter()
        run(name, args.presets, args.quick, args.layers, args.stock_bits)
        print(f"({name}: {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
