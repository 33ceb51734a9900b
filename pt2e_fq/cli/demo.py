"""`pt2e-fq demo`: the whole flow on a real data set, in seconds on a CPU
(measured: benchmarks/README.md).

scikit-learn's 8x8 digits (shipped inside the package, no download) train a
small CNN in float; PTQ with the w8a8 preset; QAT with w4a8 from the float
weights, a few epochs with a progress bar; convert; .pt2 and ONNX files of
each model; the quantized ONNX files run in ONNX Runtime on the test split.
Then (`deploy`, the default) the PT2E runtimes: the float model, PTQ w8a8 and
QAT w4a8 under Inductor (int8: to_qdq + compile_x86) and as ExecuTorch XNNPACK
`.pte` files (when the executorch extra is installed), with their latency per
batch against the float model run the same way. QAT w4a8's int4 group weights
are stored as their fake-quantized floats there (unsupported="float"): the
runtimes take per-channel weights with int8 activations.
It ends with a table: accuracy, file bytes, training step time and inference
latency.
"""

from __future__ import annotations

import copy
import io
import json
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from tabulate import tabulate

from quantizers import presets

from . import digits, pipeline
from ..export import check_onnx, compile_x86, ort_session, run_pte, save, to_executorch, to_onnx, to_qdq
from ..export.lowering.executorch import require_executorch
from ..files import write_bytes, write_text
from ..report import report
from .step_time import step_times

BATCH = 64


@dataclass
class Row:
    """One model of the demo's table: where it ran, its test accuracy, the
    bytes of its files and its training step time."""

    model: str
    runs_in: str
    accuracy: float
    pt2_bytes: Optional[int] = None
    onnx_bytes: Optional[int] = None
    step_ms: Optional[float] = None
    batch_ms: Optional[float] = None  # inference latency of one batch of BATCH images
    float_batch_ms: Optional[float] = None  # the float model's, run the same way


@dataclass
class DemoResult:
    rows: list[Row] = field(default_factory=list)
    seconds: float = 0.0
    # (config, accuracy with fixed weight ranges, with learned ones); empty
    # unless run with learned_ranges=True.
    learned_ranges: list[tuple[str, float, float]] = field(default_factory=list)

    def table(self) -> str:
        float_ms = self.rows[0].step_ms
        body = []
        for r in self.rows:
            step = "" if r.step_ms is None else f"{r.step_ms:.1f}"
            if r.step_ms is not None and r is not self.rows[0] and float_ms:
                step += f" ({r.step_ms / float_ms:.1f}x float)"
            latency = "" if r.batch_ms is None else f"{r.batch_ms:.2f}"
            if r.batch_ms is not None and r.float_batch_ms:
                latency += f" ({r.float_batch_ms / r.batch_ms:.1f}x float's speed)"
            body.append([r.model, r.runs_in, f"{100 * r.accuracy:.1f}%",
                         "" if r.pt2_bytes is None else f"{r.pt2_bytes:,}",
                         "" if r.onnx_bytes is None else f"{r.onnx_bytes:,}", step, latency])
        return tabulate(body, headers=["model", "runs in", "test accuracy", ".pt2 bytes", "ONNX bytes",
                                       "train step ms", f"batch of {BATCH} ms"])


def _epoch_batches(data: digits.Digits, seed: int):
    return lambda epoch: data.batches("train", BATCH, seed=seed + epoch)


def _onnx_runtime(path: Path):
    """The ONNX file as a function of image tensors, in ONNX Runtime."""
    session = ort_session(path)
    name = session.get_inputs()[0].name
    return lambda images: torch.from_numpy(session.run(None, {name: images.numpy()})[0])


def _files(out: Path, name: str, model, example: tuple, batch) -> tuple[Path, Path]:
    """`name`.pt2 and `name`.onnx of a float or converted model, any batch size."""
    pt2, onnx_path = out / f"{name}.pt2", out / f"{name}.onnx"
    save(model, example, pt2, dynamic_shapes=batch)
    to_onnx(model, example, onnx_path, dynamic_shapes=batch)
    return pt2, onnx_path


def _fixed_batch(fn):
    """fn, which takes batches of exactly BATCH images (a .pte, a model
    compiled for that shape), as a function of any batch: the last, short
    batch is padded with zeros and its outputs cut."""

    def run(images):
        n = len(images)
        if n == BATCH:
            return fn(images)
        padded = torch.cat([images, images.new_zeros((BATCH - n, *images.shape[1:]))])
        return fn(padded)[:n]

    return run


def _latency_ms(fn, images, repeats: int = 20) -> float:
    """Median milliseconds of fn(images), after a warm-up call."""
    fn(images)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(images)
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[len(times) // 2]


def _deploy_rows(out: Path, models: dict, data: digits.Digits, example: tuple, log) -> list[Row]:
    """The float model and each converted model under Inductor and in
    ExecuTorch (XNNPACK), with accuracy and latency against the float model
    run the same way."""
    x_test, y_test = data.x_test, data.y_test
    images = x_test[:BATCH]
    model = models.pop("float")
    runtimes = {"Inductor": lambda m: _inductor(m, example)}
    try:
        require_executorch()
        runtimes["ExecuTorch XNNPACK"] = lambda m: _executorch(out, m, example)
    except ImportError as e:
        log(f"ExecuTorch rows left out: {e}")
    rows = []
    for runtime, lower in runtimes.items():
        float_fn, _ = lower(("float", model))
        float_ms = _latency_ms(float_fn, images)
        rows.append(Row("float", runtime, digits.accuracy(float_fn, x_test, y_test, BATCH), batch_ms=float_ms))
        for name, converted in models.items():
            fn, runs_in = lower((name, converted))
            rows.append(Row(name, f"{runtime} {runs_in}", digits.accuracy(fn, x_test, y_test, BATCH),
                            batch_ms=_latency_ms(fn, images), float_batch_ms=float_ms))
    return rows


def _lowering(name: str) -> str:
    # w4a8's int4 group weights: the runtimes take per-channel weights, so they stay fake-quantized floats.
    return "float" if "w4a8" in name else "error"


def _inductor(named, example):
    name, model = named
    if name == "float":
        with torch._inductor.config.patch(freezing=True):
            compiled = torch.compile(model)

        def run(images):
            with torch._inductor.config.patch(freezing=True), torch.no_grad():
                return compiled(images)

        return _fixed_batch(run), ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the warning lists the float weights, which the row names
        program = to_qdq(model, example, target="x86_inductor", unsupported=_lowering(name))
    return _fixed_batch(compile_x86(program)), "int8" if _lowering(name) == "error" else "int8 act, float w"


def _executorch(out: Path, named, example):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    name, model = named
    path = out / f"{name.lower().replace(' ', '_')}.pte"
    if name == "float":
        edge = to_edge_transform_and_lower(torch.export.export(model, example), partitioner=[XnnpackPartitioner()])
        write_bytes(path, edge.to_executorch().buffer)
        runs_in = ""
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            to_executorch(model, example, path, unsupported=_lowering(name))
        runs_in = "int8" if _lowering(name) == "error" else "int8 act, float w"
    return _fixed_batch(lambda images: run_pte(path, (images,))[0]), runs_in


def run(
    out: Path | str = "demo-out",
    *,
    float_epochs: int = 8,
    qat_epochs: int = 3,
    calibration_batches: int = 8,
    seed: int = 0,
    threads: int = 1,
    progress: bool = True,
    deploy: bool = True,
    learned_ranges: bool = False,
    log=print,
) -> DemoResult:
    """Runs the demo with `threads` torch threads (the CNN is tiny: one
    thread is about as fast as several, and on a busy machine several
    OpenMP threads mostly wait for each other), writes its files under `out`
    and returns the table's rows. learned_ranges: also QAT with w4a8, w3a8
    and w2a8 weights, fixed ranges against learned ones (LSQ), a second
    table (`learned_ranges.md`, and `DemoResult.learned_ranges`)."""
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(Path(out), float_epochs, qat_epochs, calibration_batches, seed, progress, deploy, learned_ranges,
                    log)
    finally:
        torch.set_num_threads(previous_threads)


LEARNED_RANGE_BITS = (4, 3, 2)


def low_bit_config(bits: int, learnable: bool):
    """w{bits}a8: symmetric weights with one range per output channel, as
    LSQ learns them (the w4a8 preset's groups of 32 input channels give the
    first conv, which has one input channel, a range per weight: nothing
    left to learn), int8 asymmetric activations; the weights' ranges fixed
    (current min / max) or learned (LSQ)."""
    from quantizers import OpConfig, QuantizerConfig

    from .. import CurrentMinMaxObserver, INT8, IntFormat, PerChannel, PerTensor, QSpec

    weight = QSpec(IntFormat(bits, True), PerChannel(0), "symmetric", observer=CurrentMinMaxObserver(),
                   learnable=learnable)
    activation = QSpec(INT8, PerTensor(), "asymmetric")
    return QuantizerConfig(OpConfig(input_activation=activation, weight=weight, output_activation=activation))


def compare_learned_ranges(model, float_state, data, example, *, qat_epochs, calibration_batches, seed,
                           progress) -> list[tuple[str, float, float]]:
    """(config, accuracy with fixed weight ranges, with learned ones) for
    w4a8, w3a8, w2a8. Both start from the float weights and observe the same
    calibration batches; then the fixed ranges keep following the weights
    (current min / max) while the learned ones train with everything else
    (same optimizer, same steps)."""
    rows = []
    for bits in LEARNED_RANGE_BITS:
        accuracies = []
        for learnable in (False, True):
            model.load_state_dict(float_state)
            qat = pipeline.prepare(model, example, low_bit_config(bits, learnable), qat=True)
            pipeline.calibrate(qat, [x for x, _ in data.batches("train", BATCH, seed=seed)][:calibration_batches],
                               progress=progress)
            pipeline.start_learning_ranges(qat)  # the optimizer owns the learned ranges now
            torch.manual_seed(seed)
            # The demo's QAT optimizer for both; the learned qparams are two
            # more parameters to it (measured: a separate, smaller rate for
            # them changed nothing beyond one or two test images).
            optimizer = torch.optim.Adam([p for p in qat.parameters() if p.requires_grad], lr=5e-4)
            pipeline.train(qat, _epoch_batches(data, seed + 1000), F.cross_entropy, optimizer, epochs=qat_epochs,
                           desc=f"QAT w{bits}a8 {'learned' if learnable else 'fixed'}", progress=progress)
            pipeline.freeze_qat(qat, data.x_train[:256])
            accuracies.append(digits.accuracy(pipeline.convert(qat), data.x_test, data.y_test))
        rows.append((f"w{bits}a8", *accuracies))
    return rows


def learned_ranges_table(rows) -> str:
    body = [[name, f"{100 * fixed:.1f}%", f"{100 * learned:.1f}%", f"{100 * (learned - fixed):+.1f}"]
            for name, fixed, learned in rows]
    return tabulate(body, headers=["QAT weights", "fixed ranges (min/max)", "learned ranges (LSQ)",
                                   "learned - fixed, points"], disable_numparse=True)


def _run(out: Path, float_epochs, qat_epochs, calibration_batches, seed, progress, deploy, learned_ranges,
         log) -> DemoResult:
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    result = DemoResult()
    data = digits.load(seed=seed)
    x_test, y_test = data.x_test, data.y_test
    example = (data.x_train[:BATCH],)
    batch = pipeline.batch_dynamic_shapes(example)
    log(f"digits: {len(data.x_train)} training and {len(x_test)} test images of 8x8 pixels, {digits.CLASSES} classes")

    # Float training.
    torch.manual_seed(seed)
    model = digits.DigitsCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    pipeline.train(model.train(), _epoch_batches(data, seed), F.cross_entropy, optimizer,
                   epochs=float_epochs, desc="float", progress=progress)
    model.eval()
    pt2, onnx_path = _files(out, "float", model, example, batch)
    float_row = Row("float", "torch", digits.accuracy(model, x_test, y_test), pt2.stat().st_size,
                    onnx_path.stat().st_size)
    result.rows.append(float_row)
    float_state = copy.deepcopy(model.state_dict())

    # PTQ w8a8: calibrate on a few training batches. The preset on every
    # tensor (presets.every_point), here and for QAT: the same models go to
    # ExecuTorch XNNPACK, which delegates int8 ops with int8 outputs only
    # (target="xnnpack": output points after the activations XNNPACK fuses
    # only; the CNN's ReLUs are, so Inductor gets the same points).
    ptq = pipeline.prepare(model, example, presets.every_point("w8a8", target="xnnpack"))
    pipeline.calibrate(ptq, [x for x, _ in data.batches("train", BATCH, seed=seed)][:calibration_batches],
                       progress=progress)
    ptq = pipeline.convert(ptq)
    pt2, onnx_path = _files(out, "ptq_w8a8", ptq, example, batch)
    result.rows.append(Row("PTQ w8a8", "torch", digits.accuracy(ptq, x_test, y_test), pt2.stat().st_size,
                           onnx_path.stat().st_size))
    result.rows.append(Row("PTQ w8a8", "ONNX Runtime", digits.accuracy(_onnx_runtime(onnx_path), x_test, y_test),
                           onnx_bytes=onnx_path.stat().st_size))

    # QAT w4a8 from the float weights; first the step time against float.
    model.load_state_dict(float_state)
    qat = pipeline.prepare(model, example, presets.every_point("w4a8", target="xnnpack", qat=True), qat=True)
    ms = step_times({"float": model.train(), "qat": qat}, example, data.y_train[:BATCH], F.cross_entropy)
    float_row.step_ms = ms["float"]
    optimizer = torch.optim.Adam([p for p in qat.parameters() if p.requires_grad], lr=5e-4)
    pipeline.train(qat, _epoch_batches(data, seed + 1000), F.cross_entropy, optimizer,
                   epochs=qat_epochs, desc="QAT w4a8", progress=progress)
    pipeline.freeze_qat(qat, data.x_train[:256])
    qat = pipeline.convert(qat)
    pt2, onnx_path = _files(out, "qat_w4a8", qat, example, batch)  # conv-bn folded on export
    result.rows.append(Row("QAT w4a8", "torch", digits.accuracy(qat, x_test, y_test), pt2.stat().st_size,
                           onnx_path.stat().st_size, step_ms=ms["qat"]))
    result.rows.append(Row("QAT w4a8", "ONNX Runtime", digits.accuracy(_onnx_runtime(onnx_path), x_test, y_test),
                           onnx_bytes=onnx_path.stat().st_size))
    check = check_onnx(onnx_path, qat, (x_test[:BATCH],))
    log(f"check_onnx {onnx_path.name}: {check.points} points bit-exact in ONNX Runtime; outputs within "
        f"{check.max_abs_diff_optimized:.3g} of torch (one quantization step: {check.tolerance:.3g})")
    text = io.StringIO()
    report(qat, example, file=text)
    write_text(out / "qat_w4a8_report.txt", text.getvalue())
    if deploy:
        # A fresh float model: `model`'s parameters are the QAT graph's (export shares them).
        float_model = digits.DigitsCNN()
        float_model.load_state_dict(float_state)
        result.rows += _deploy_rows(out, {"float": float_model.eval(), "PTQ w8a8": ptq, "QAT w4a8": qat}, data,
                                    example, log)

    if learned_ranges:
        result.learned_ranges = compare_learned_ranges(
            model, float_state, data, example, qat_epochs=qat_epochs, calibration_batches=calibration_batches,
            seed=seed, progress=progress)
        table = learned_ranges_table(result.learned_ranges)
        write_text(out / "learned_ranges.md", table + "\n")
        log(table)

    result.seconds = time.perf_counter() - start
    write_text(out / "results.json", json.dumps(
        {"rows": [asdict(r) for r in result.rows], "seconds": result.seconds}, indent=2) + "\n")
    table = result.table()
    write_text(out / "results.md", table + "\n")
    log(table)
    log(f"files in {out}/ (.pt2, .onnx, .pte, qat_w4a8_report.txt, results.md, results.json); {result.seconds:.0f} s")
    return result
