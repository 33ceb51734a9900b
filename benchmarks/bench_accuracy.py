"""Accuracy of every preset on real architectures against torchao's stock
quantizers, the time of each stage of the flow, and QAT's costs and drift,
on the model zoo (benchmarks/zoo.py: torchvision,
timm and Hugging Face classes at toy sizes, random init).

PTQ table, one row per model and preset: our quantizer through the
pipeline (export, prepare_pt2e, calibration on the zoo's calibration
batches, pipeline.convert), the SQNR of the converted model's outputs
against the float model's on held-out batches; beside it the SQNR of
torchao's stock XNNPACKQuantizer and X86InductorQuantizer (their int8
configs, same weights, same calibration batches; for a 4-bit preset the
same configs with int4 per-channel weights; benchmarks/stock_flows.py);
`vs stock` gives an integer preset's SQNR gap to the better stock quantizer
of its weight width with its standard error over the held-out batches
(stock_flows.sqnr_gap), on that quantizer's coverage (X86InductorQuantizer
leaves GPT-2's addmm projections float: ours is measured with them float
too, as the model suite does), "below" past two standard errors, with
`compared coverage` beside it (how many weights and activation inputs each
side quantizes, counted from its converted graph: stock_flows.coverage),
and marks an fp8 preset below w8a8 (the goal: fp8 at least as good as
w8a8). Then the seconds of each stage: torch.export, prepare_pt2e, calibration, pipeline.convert, torchao's
convert_pt2e on a copy of the same prepared model (what pipeline.convert
replaces), pt2e_fq.save, to_onnx and check_onnx (E2M1 formats have no ONNX
Runtime CPU kernel: to_onnx refuses them).

QAT table (w8a8), one row per model: the median training step of the QAT
model over the float model's (same batch, MSE loss, SGD; interleaved),
inference of the converted model over the float model's, the
seconds of pipeline.convert and of torchao's convert_pt2e on a copy (a QAT
graph keeps its batch norms: convert_pt2e's conv-bn search), and after
`--qat-steps` steps of distillation (Adam) and freeze_qat: the SQNR
of the `.pt2` saved with batch norms folded and loaded back against the
converted model it was saved from (inf = bit for bit), of the
converted model against float, and whether two runs of the converted model
are equal.

    python benchmarks/bench_accuracy.py [--models resnet18 llama] [--presets w8a8 fp8] [--quick] [--threads N]

--quick: no ONNX stages (the slow ones), 5 timing repeats. Each row is
also printed as soon as it is measured.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import platform
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F
from bench_ops import median_ms
from tabulate import tabulate
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from tqdm import tqdm

import pt2e_fq
import zoo
from stock_flows import (
    STOCK_QUANTIZERS,
    coverage,
    on_stock_coverage,
    outputs,
    sqnr_db,
    sqnr_gap,
    stock_quantize,
    stock_weight_bits,
)
from pt2e_fq.cli import pipeline
from pt2e_fq.cli.step_time import step_times
from pt2e_fq.export import check_onnx, to_onnx
from quantizers import presets

PRESETS = ("w8a8", "w4a8", "w4a16", "w8a16", "fp8", "mxfp8", "mxfp4", "nvfp4")
INTEGER_PRESETS = ("w8a8", "w4a8", "w4a16", "w8a16")
STAGES = ("export", "prepare", "calibrate", "convert", "convert_pt2e", "save", "to_onnx", "check_onnx")


def _failed(e: Exception) -> str:
    text = str(e).strip()
    return f"failed: {type(e).__name__}: {text.splitlines()[0][:60] if text else ''}"


class _Stages:
    """Seconds of each stage; a stage that raises records why and the rest of the row goes on."""

    def __init__(self):
        self.cells = {}

    def run(self, stage, fn):
        start = time.perf_counter()
        try:
            result = fn()
        except Exception as e:  # a stage that fails is a cell saying why, not a lost run
            self.cells[stage] = _failed(e)
            return None
        self.cells[stage] = f"{time.perf_counter() - start:.2f}"
        return result


def ptq_row(entry: zoo.ZooEntry, preset: str, reference: torch.Tensor, folder: str, onnx: bool) -> dict:
    stages = _Stages()
    gm = stages.run("export", lambda: pipeline.export(entry.model, entry.example))
    prepared = stages.run("prepare", lambda: prepare_pt2e(gm, pipeline.quantizer_for(preset)))
    stages.run("calibrate", lambda: pipeline.calibrate(prepared, entry.calibration, progress=False))
    spare = copy.deepcopy(prepared)
    converted = stages.run("convert", lambda: pipeline.convert(prepared))
    stages.run("convert_pt2e", lambda: convert_pt2e(spare))
    ours = outputs(converted, entry.held_out)
    path = os.path.join(folder, f"{entry.name}_{preset}")
    stages.run("save", lambda: pt2e_fq.save(converted, entry.example, path + ".pt2"))
    if onnx and stages.run("to_onnx", lambda: to_onnx(converted, entry.example, path + ".onnx")) is not None:
        stages.run("check_onnx", lambda: check_onnx(path + ".onnx", converted, entry.example))
    return {"sqnr": sqnr_db(reference, ours), "outputs": ours, "coverage": coverage(converted), **stages.cells}


def qat_row(entry: zoo.ZooEntry, qat_steps: int, timing_steps: int, repeats: int, folder: str) -> list:
    model = entry.model
    qat = pipeline.prepare(model, entry.example, "w8a8", qat=True)
    pipeline.calibrate(qat, entry.calibration, progress=False)
    with torch.no_grad():
        targets = [model(*b) for b in entry.calibration]
    step_ms = step_times({"float": copy.deepcopy(model).train(), "QAT": qat}, entry.example, targets[0],
                         F.mse_loss, steps=timing_steps)
    optimizer = torch.optim.Adam([p for p in qat.parameters() if p.requires_grad], lr=1e-4)
    pairs = list(zip(entry.calibration, targets))
    pipeline.train(qat, pairs, F.mse_loss, optimizer, epochs=math.ceil(qat_steps / len(pairs)), max_steps=qat_steps,
                   progress=False)
    pipeline.freeze_qat(qat, entry.calibration[0])
    spare = copy.deepcopy(qat)
    start = time.perf_counter()
    converted = pipeline.convert(qat)
    convert_s = time.perf_counter() - start
    start = time.perf_counter()
    convert_pt2e(spare)
    convert_pt2e_s = time.perf_counter() - start
    held_out = entry.held_out[0]
    float_ms, converted_ms = median_ms([lambda: model(*held_out), lambda: converted(*held_out)], repeats, "cpu")
    path = os.path.join(folder, f"{entry.name}_qat.pt2")
    pt2e_fq.save(converted, entry.example, path)
    loaded = pt2e_fq.load(path).module()
    ours = outputs(converted, entry.held_out)
    deterministic = torch.equal(ours, outputs(converted, entry.held_out))
    return [entry.name, qat_steps, f"{step_ms['float']:.1f}", f"{step_ms['QAT']:.1f}",
            f"{step_ms['QAT'] / step_ms['float']:.2f}x", f"{float_ms:.2f}", f"{converted_ms:.2f}",
            f"{converted_ms / float_ms:.2f}x", f"{convert_s:.2f}", f"{convert_pt2e_s:.2f}",
            f"{sqnr_db(ours, outputs(loaded, entry.held_out)):.1f}",
            f"{sqnr_db(outputs(model, entry.held_out), ours):.1f}", "yes" if deterministic else "NO"]


_SHORT = {"XNNPACKQuantizer": "XNNPACK", "X86InductorQuantizer": "X86"}  # the table's column names


def _stock_bits(preset: str) -> int:
    """The weight width of the stock flows preset `preset` is measured
    against (float presets: the int8 flows, shown for reference)."""
    return stock_weight_bits(presets.get_preset(preset)) if preset in INTEGER_PRESETS else 8


def _marks(rows: list, stock: dict, entry: zoo.ZooEntry, reference: torch.Tensor) -> None:
    """The `vs stock` column: an integer preset's SQNR gap to the better stock
    quantizer of its weight width with its standard error
    (stock_flows.sqnr_gap), flagged "below" past two standard errors, on that
    quantizer's coverage (where it leaves op types with weights float, ours
    is run again with them float too, as the model suite does: "on X86
    coverage"), and the `compared coverage` column: what each side of that
    comparison quantizes, counted from its converted graph; fp8 below
    w8a8."""
    by_preset = {r["preset"]: r for r in rows}
    for r in rows:
        bits = _stock_bits(r["preset"])
        ran = [q for q in STOCK_QUANTIZERS if (q, bits) in stock]
        best = max(ran, key=lambda q: sqnr_db(reference, stock[q, bits][0]), default=None)
        if r["preset"] in INTEGER_PRESETS and best is not None:
            theirs, their_coverage = stock[best, bits]
            ours, our_coverage, where = r["outputs"], r["coverage"], ""
            float_types = their_coverage.float_op_types()
            if float_types:
                config = on_stock_coverage(r["preset"], float_types)
                converted = pipeline.quantize(entry.model, entry.example, config, calibration=entry.calibration,
                                              progress=False)
                ours, our_coverage = outputs(converted, entry.held_out), coverage(converted)
                where = f" on {_SHORT[best]} coverage"
            gap, error = sqnr_gap(reference, ours, theirs, len(entry.held_out))
            r["mark"] = f"{gap:+.1f} ± {error:.1f}" + (" below" if gap < -2 * error else "") + where
            r["compared"] = f"ours {our_coverage}; {_SHORT[best]} {their_coverage}"
        elif r["preset"] == "fp8" and "w8a8" in by_preset and r["sqnr"] < by_preset["w8a8"]["sqnr"]:
            r["mark"] = f"below w8a8 by {by_preset['w8a8']['sqnr'] - r['sqnr']:.1f} dB"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torchao

    return (f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} thread(s); torch {torch.__version__}, "
            f"torchao {torchao.__version__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=zoo.NAMES, default=list(zoo.NAMES))
    parser.add_argument("--presets", nargs="+", choices=PRESETS, default=list(PRESETS))
    parser.add_argument("--qat-models", nargs="+", choices=zoo.NAMES, default=None,
                        help="models of the QAT table (default: --models)")
    parser.add_argument("--qat-steps", type=int, default=10)
    parser.add_argument("--tables", nargs="+", choices=("ptq", "qat"), default=["ptq", "qat"])
    parser.add_argument("--quick", action="store_true", help="no ONNX stages, 5 timing repeats")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    assert set(PRESETS) <= set(presets.PRESETS)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    qat_steps = args.qat_steps
    repeats = 5 if args.quick else 20
    ptq_rows, qat_rows = [], []
    with tempfile.TemporaryDirectory() as folder:
        ptq_models = args.models if "ptq" in args.tables else ()
        widths = sorted({_stock_bits(p) for p in args.presets}, reverse=True)
        stock_runs = [(q, bits) for bits in widths for q in STOCK_QUANTIZERS]
        bar = tqdm(total=len(ptq_models) * (len(args.presets) + len(stock_runs)), desc="PTQ", unit="run")
        for name in ptq_models:
            entry = zoo.build(name)
            reference = outputs(entry.model, entry.held_out)
            stock = {}
            for q, bits in stock_runs:
                bar.set_postfix_str(f"{name} {q} int{bits}")
                try:
                    converted = stock_quantize(entry.model, entry.example, entry.calibration, q, bits)
                    stock[q, bits] = outputs(converted, entry.held_out), coverage(converted)
                except Exception as e:  # noqa: BLE001  (a stock flow that fails on a model is reported)
                    tqdm.write(f"{name}: {q} int{bits} {_failed(e)}")
                bar.update(1)
            rows = []
            for preset in args.presets:
                bar.set_postfix_str(f"{name} {preset}")
                rows.append({"model": name, "preset": preset,
                             **ptq_row(entry, preset, reference, folder, onnx=not args.quick)})
                bar.update(1)
            _marks(rows, stock, entry, reference)
            for r in rows:
                ptq_rows.append([name, r["preset"], f"{r['sqnr']:.1f}",
                                 *(f"{sqnr_db(reference, stock[q, bits][0]):.1f}" if (q, bits) in stock else "failed"
                                   for bits in [_stock_bits(r["preset"])] for q in STOCK_QUANTIZERS),
                                 r.get("mark", ""), r.get("compared", ""), *(r.get(s, "") for s in STAGES)])
                tqdm.write(" | ".join(ptq_rows[-1]))
        bar.close()
        qat_models = (args.qat_models or args.models) if "qat" in args.tables else ()
        for name in tqdm(qat_models, desc="QAT", unit="model"):
            qat_rows.append(qat_row(zoo.build(name), qat_steps, 5 if args.quick else 10, repeats, folder))
            tqdm.write(" | ".join(map(str, qat_rows[-1])))
    print(f"\n{machine()}")
    if ptq_rows:
        print(f"PTQ: SQNR (dB) of the converted model's outputs against float on {zoo.HELD_OUT_BATCHES} held-out "
              f"batches; {zoo.CALIBRATION_BATCHES} calibration batches; stage times in seconds")
        print("XNNPACK, X86: the stock flow at the preset's weight width (int4 for a 4-bit preset, int8 otherwise)")
        print("compared coverage: weights (W) and activation inputs (A) of conv, linear, addmm, matmul, einsum and "
              "embedding that each side of `vs stock` quantizes, of the graph's totals")
        print(tabulate(ptq_rows, headers=["model", "preset", "SQNR", *(_SHORT[q] for q in STOCK_QUANTIZERS), "vs stock",
                                          "compared coverage", *[f"{s} s" for s in STAGES]], disable_numparse=True))
    if not qat_rows:
        return
    print(f"\nQAT w8a8: step time median of {5 if args.quick else 10} interleaved steps; inference median of "
          f"{repeats}; .pt2 drift after {qat_steps} steps (inf: bit for bit)")
    print(tabulate(qat_rows, headers=["model", "steps", "float step ms", "QAT step ms", "QAT / float",
                                      "float infer ms", "converted infer ms", "converted / float",
                                      "convert s", "convert_pt2e s",
                                      "SQNR .pt2 vs converted", "SQNR converted vs float", "deterministic"],
                   disable_numparse=True))


if __name__ == "__main__":
    main()
