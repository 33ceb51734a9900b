"""The model suite: real architectures
from torchvision, timm and transformers at toy sizes (benchmarks/zoo.py),
every preset through the pipeline, as a user runs them.

- PTQ, every preset on resnet18 and Llama, w8a8 on every model, fp8 on the
  ones where it is cheap (the full matrix: benchmarks/bench_accuracy.py):
  convert; the outputs on held-out batches above the floor against float (below); save; load in a fresh process (all
  files in one subprocess) and reproduce the converted model bit for bit.
- Parity with torchao's stock quantizers: each integer preset
  at least the better of XNNPACKQuantizer and X86InductorQuantizer (their
  int8 configs; for a 4-bit preset the same with int4 per-channel weights,
  stock_flows.stock_weight_bits; same weights, same calibration) on the stock
  quantizer's coverage: not below it by more than two standard errors of the paired
  per-batch SQNR difference over the 16 held-out batches
  (stock_flows.sqnr_gap), and quantizing at least the weights (and, with
  activations quantized, the activation inputs) the stock flow does,
  counted from both converted graphs (stock_flows.coverage); fp8 at least
  w8a8. Where ours is below, the case is
  xfail(strict=True) with the measured gap, so the day it holds the mark
  must go.
- ONNX: to_onnx and check_onnx (every point bit for bit in ONNX Runtime on
  torch's inputs, the outputs within check_onnx's documented end-to-end
  bound or a cascade it explains) for w8a8 on every model, a float format
  on ViT (fp8: dynamic points reading a parameter), a
  weight-only preset on EfficientNet (w8a16: a float output through 81
  convolutions), and a QAT model with folded batch norms.
- QAT through the stock flow (prepare_qat_pt2e; w8a8 on every model but
  mobilenet_v3_small; w4a8 on resnet18), 3 steps of distillation: freeze,
  convert; two runs equal; the .pt2 loaded in
  a fresh process equals the saved program bit for bit; the saved program
  equals the converted model where nothing is folded, and stays within a
  documented bound of it where batch norms are.

The floor against float: the SQNR of predicting all zeros is 0 dB, so a
model above 0 dB carries information about the float outputs; a broken
scale or a dropped op gives far less. The stock int8 flows are above it on
every zoo model (2.8 to 41 dB, benchmarks/README.md). 4-bit presets on the
random-init CNNs are not held to it (random init is chaotic: a deep CNN
amplifies 4-bit noise past the signal; measured resnet18 w4a8 0.3 dB,
mxfp4 -0.8 dB, nvfp4 -2.1 dB); their outputs must still point the float
outputs' way: a cosine similarity above 3 / sqrt(n), three standard
deviations of the cosine of an unrelated output of n elements (0.24 for the
CNNs' 160 logits; measured 0.30 to 0.61).

What the full matrix costs beyond this (every preset through ONNX, QAT on
every model with timings): benchmarks/bench_accuracy.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tests.models.quantized import fake_quant_nodes

try:
    from benchmarks import zoo

    zoo.import_torchvision()
    import timm  # noqa: F401
    import transformers  # noqa: F401
except ImportError as e:
    pytest.skip(f"the model suite needs the models and dev extras: {e}", allow_module_level=True)
pytest.importorskip("onnxruntime", reason="the ONNX checks need the onnx extra")

import pt2e_fq
from pt2e_fq import qat
from pt2e_fq.cli import pipeline
from pt2e_fq.graph import as_args
from benchmarks.stock_flows import (
    STOCK_QUANTIZERS,
    Coverage,
    coverage,
    on_stock_coverage,
    outputs,
    sqnr_db,
    sqnr_gap,
    stock_quantize,
    stock_weight_bits,
)
from pt2e_fq.export import check_onnx, to_onnx
from quantizers import presets

# Real architectures through every stage: minutes; one worker builds the suite.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("model_suite")]

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ("w8a8", "w4a8", "w4a16", "w8a16", "fp8", "mxfp8", "mxfp4", "nvfp4")
INTEGER_PRESETS = ("w8a8", "w4a8", "w4a16", "w8a16")
FOUR_BIT = ("w4a8", "w4a16", "mxfp4", "nvfp4")
CNNS = ("resnet18", "mobilenet_v3_small", "efficientnet_b0")
# Every preset on a CNN and a transformer; w8a8 on the others, and fp8 on
# those where it is cheap (fp8's dynamic points make mobilenet_v3_small's and
# efficientnet_b0's prepare and save the slowest cases: bench_accuracy has them).
FULL = ("resnet18", "llama")
PTQ_CASES = [(m, p) for m in zoo.NAMES
             for p in (PRESETS if m in FULL else ("w8a8",) if m in ("mobilenet_v3_small", "efficientnet_b0")
                       else ("w8a8", "fp8"))]
# BERT w4a8: its int4 weights' rounding ties (SYMMETRIC_NO_CLIP); mobilenet
# w4a16: depthwise weights in 4 bits (integer groups across kernel positions).
PTQ_CASES += [("bert", "w4a8"), ("mobilenet_v3_small", "w4a16")]
# efficientnet_b0 for the CNNs with batch norm eps 1e-3 and stochastic depth.
QAT_CASES = [(m, "w8a8") for m in zoo.NAMES if m != "mobilenet_v3_small"] + [("resnet18", "w4a8")]
# fp8 on ViT: dynamic points reading a parameter (the position embedding);
# w8a16 on EfficientNet: a weight-only float output through 81 convolutions
# (check_onnx's float64 bound).
ONNX_CASES = [(m, "w8a8") for m in zoo.NAMES] + [("vit_tiny", "fp8"), ("efficientnet_b0", "w8a16")]
QAT_STEPS = 3

# Measured below the better stock quantizer of the preset's weight width:
# ours against the better stock SQNR, dB, on this suite's held-out batches
# (torch 2.13.0+cpu, torchao 0.18.0).
# XNNPACKQuantizer fails on the HF decoders (it quantizes an index tensor of
# their mask code) and X86InductorQuantizer on resnet18 ("Input partition has
# more than one output node", its conv-add-relu annotation): the other one
# is the reference there.
BELOW_STOCK = {}
# fp8 measured below w8a8 (the goal: fp8 at least as good as w8a8), dB on
# the 16 held-out batches. The formats' arithmetic, not the flow: E4M3 keeps
# 3 mantissa bits, a rounding error up to 2**-4 of each value wherever it
# lies (about 31 dB on any Gaussian-like tensor), where int8 over a
# calibrated range keeps about 40 dB (tests/quantizer/test_fp8_against_int8.py checks
# both, and that fp8 wins where a tensor has outlier channels); random-init
# models have none. Trained checkpoints, where the claim is usually made,
# cannot be downloaded here.
FP8_BELOW_W8A8 = {
    "resnet18": "fp8 7.0, w8a8 17.0",
    "vit_tiny": "fp8 22.2, w8a8 32.5",
    "llama": "fp8 25.2, w8a8 34.8",
    "bert": "fp8 27.2, w8a8 36.5",
    "gpt2": "fp8 28.7, w8a8 40.1",
}
# check_onnx fails on these, not yet explained.
ONNX_FAILS = {}


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Small models: one thread is faster, and two OpenMP threads per process
    spin on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Stock:
    outputs: torch.Tensor  # on the held-out batches
    coverage: Coverage  # what its converted graph quantizes


@dataclass
class Result:
    sqnr: float
    cosine: float
    path: Path
    outputs: torch.Tensor  # the converted model's, on the held-out batches
    repeat_equal: bool  # a second run of the converted model gave the same bits
    saved_outputs: torch.Tensor  # the saved program's (in this process)
    coverage: Coverage  # what the converted graph quantizes
    converted: object = None  # kept for the ONNX cases only


class Suite:
    """Everything the tests share, computed once per session on first use:
    the zoo's models, their float outputs, the stock SQNRs, and the PTQ and
    QAT results (each converted model is dropped once its outputs and file
    are taken, except those the ONNX tests need)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._entries, self._references, self._stock, self.ptq_results, self.qat_results = {}, {}, {}, {}, {}

    def entry(self, name: str) -> zoo.ZooEntry:
        if name not in self._entries:
            self._entries[name] = zoo.build(name)
        return self._entries[name]

    def reference(self, name: str) -> torch.Tensor:
        if name not in self._references:
            e = self.entry(name)
            self._references[name] = outputs(e.model, e.held_out)
        return self._references[name]

    def stock(self, name: str, weight_bits: int) -> dict[str, object]:
        """Per stock quantizer (with `weight_bits`-wide weights) that runs on
        the model, its outputs on the held-out batches and its coverage
        (torchao's own annotations fail on some models: those map to the
        error)."""
        if (name, weight_bits) not in self._stock:
            e, found = self.entry(name), {}
            for q in STOCK_QUANTIZERS:
                try:
                    converted = stock_quantize(e.model, e.example, e.calibration, q, weight_bits)
                    found[q] = Stock(outputs(converted, e.held_out), coverage(converted))
                except Exception as error:  # noqa: BLE001  (recorded, and the test says so when none runs)
                    found[q] = error
            self._stock[name, weight_bits] = found
        return self._stock[name, weight_bits]

    def _result(self, name, preset, converted, tag, keep) -> Result:
        e = self.entry(name)
        ours, ref = outputs(converted, e.held_out), self.reference(name)
        path = self.folder / f"{name}_{preset}_{tag}.pt2"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            saved = pt2e_fq.save(converted, e.example, path)
        cosine = float(torch.nn.functional.cosine_similarity(ref.flatten(), ours.flatten(), dim=0))
        return Result(sqnr_db(ref, ours), cosine, path, ours, torch.equal(ours, outputs(converted, e.held_out)),
                      outputs(saved.module(), e.held_out), coverage(converted), converted if keep else None)

    def ptq(self, name: str, preset: str, float_op_types: tuple = ()) -> Result:
        """PTQ with a preset; with float_op_types, the preset with those op
        types left float (to compare with a stock quantizer on its coverage,
        Coverage.float_op_types)."""
        key = (name, preset, tuple(float_op_types))
        if key not in self.ptq_results:
            e, config = self.entry(name), on_stock_coverage(preset, float_op_types)
            converted = pipeline.quantize(e.model, e.example, config, calibration=e.calibration, progress=False)
            tag = "_".join(("ptq",) + tuple(float_op_types))
            keep = (name, preset) in ONNX_CASES and not float_op_types
            self.ptq_results[key] = self._result(name, preset, converted, tag, keep)
        return self.ptq_results[key]

    def qat(self, name: str, preset: str) -> Result:
        if (name, preset) not in self.qat_results:
            e = self.entry(name)
            # The stock QAT flow (prepare_qat_pt2e: conv-bn kept for training, folded at save and
            # ONNX export), not pipeline.quantize's QAT, which starts from the PTQ with folded batch norms.
            batches = [as_args(b) for b in e.calibration]
            prepared = pipeline.prepare(e.model, e.example, preset, qat=True)
            pipeline.calibrate(prepared, batches, progress=False)
            qat.distill(prepared, e.model, batches, steps=QAT_STEPS, lr=1e-4, progress=False)
            pipeline.freeze_qat(prepared, batches[0])
            converted = pipeline.convert(prepared)
            self.qat_results[name, preset] = self._result(name, preset, converted, "qat",
                                                          (name, preset) == ("resnet18", "w8a8"))
        return self.qat_results[name, preset]


@pytest.fixture(scope="session")
def suite(tmp_path_factory) -> Suite:
    return Suite(tmp_path_factory.mktemp("model_suite"))


def _check_floor(result: Result, name: str, preset: str) -> None:
    assert not math.isnan(result.sqnr)
    if preset in FOUR_BIT and name in CNNS:
        unrelated = 3 / math.sqrt(result.outputs.numel())  # 3 standard deviations of an unrelated output's cosine
        assert result.cosine > unrelated, f"{name} {preset}: cosine {result.cosine:.3f}, SQNR {result.sqnr:.1f} dB"
    else:
        assert result.sqnr > 0, f"{name} {preset}: SQNR {result.sqnr:.1f} dB against float"


# -- PTQ ---------------------------------------------------------------------------


@pytest.mark.parametrize("name, preset", PTQ_CASES)
def test_ptq_converts_above_the_floor_and_saves_what_it_computes(suite, name, preset):
    result = suite.ptq(name, preset)
    _check_floor(result, name, preset)
    # The saved program (the .pt2's, in this process) is the converted model, bit for bit.
    assert torch.equal(result.saved_outputs, result.outputs)


def _parity_cases():
    for name, preset in PTQ_CASES:
        if preset in INTEGER_PRESETS:
            why = BELOW_STOCK.get((name, preset))
            marks = [pytest.mark.xfail(strict=True, reason=f"below the better stock quantizer: {why}")] if why else []
            yield pytest.param(name, preset, marks=marks, id=f"{name}-{preset}")


@pytest.mark.parametrize("name, preset", list(_parity_cases()))
def test_integer_presets_match_the_better_stock_quantizer(suite, name, preset):
    """Not below the better stock quantizer by more than two standard errors
    of the paired per-batch difference (stock_flows.sqnr_gap: equally good
    quantizers differ by a few tenths of a dB in which values flip), on the
    stock quantizer's coverage (X86InductorQuantizer leaves GPT-2's addmm
    projections float and quantizes its LM head alone: ours is compared
    with the projections float too, a comparison of that one layer;
    docs/benchmarks.md has every flow's counts). Coverage is counted from
    both converted graphs (stock_flows.coverage): ours must quantize at
    least as many weights as the stock flow, and as many activation inputs
    where the preset quantizes activations, so that no flow passes by
    leaving layers float."""
    found = suite.stock(name, stock_weight_bits(presets.get_preset(preset)))
    stock = {q: s for q, s in found.items() if isinstance(s, Stock)}
    if not stock:
        pytest.skip(f"no stock quantizer runs on {name}: {found}")
    reference, batches = suite.reference(name), len(suite.entry(name).held_out)
    best = max(stock, key=lambda q: sqnr_db(reference, stock[q].outputs))
    ours = suite.ptq(name, preset, tuple(stock[best].coverage.float_op_types()))
    gap, error = sqnr_gap(reference, ours.outputs, stock[best].outputs, batches)
    figure = (f"{name} {preset}: {gap:+.2f} dB against {best} (standard error {error:.2f} dB); coverage ours "
              f"{ours.coverage}, {best} {stock[best].coverage}")
    print(figure)
    activations = presets.get_preset(preset).global_config.input_activation is not None
    assert ours.coverage.covers(stock[best].coverage, activations), f"unequal coverage: {figure}"
    assert gap >= -2 * error, figure


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=f"fp8 below w8a8: "
                                                                              f"{FP8_BELOW_W8A8[n]}")]
                                               if n in FP8_BELOW_W8A8 else [])
                                  for n in zoo.NAMES if (n, "fp8") in PTQ_CASES])
def test_fp8_is_at_least_as_good_as_w8a8(suite, name):
    fp8, w8a8 = suite.ptq(name, "fp8").sqnr, suite.ptq(name, "w8a8").sqnr
    assert fp8 >= w8a8, f"{name}: fp8 {fp8:.1f} dB, w8a8 {w8a8:.1f} dB"


# -- ONNX --------------------------------------------------------------------------


@pytest.mark.parametrize("name, preset", [
    pytest.param(*case, marks=[pytest.mark.xfail(strict=True, raises=AssertionError, reason=ONNX_FAILS[case])]
                 if case in ONNX_FAILS else [])
    for case in ONNX_CASES])
def test_onnx_export_checks_in_onnx_runtime(suite, name, preset, tmp_path):
    e, converted = suite.entry(name), suite.ptq(name, preset).converted
    path = tmp_path / f"{name}_{preset}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        to_onnx(converted, e.example, path)
        check = check_onnx(path, converted, e.example)  # raises past its bound
    assert check.points == len(fake_quant_nodes(converted)) > 0
    assert check.cascade is None or check.cascade.explained


def test_onnx_export_of_a_qat_model_with_folded_batch_norms(suite, tmp_path):
    e, converted = suite.entry("resnet18"), suite.qat("resnet18", "w8a8").converted
    path = tmp_path / "resnet18_qat.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        to_onnx(converted, e.example, path)
        check = check_onnx(path, converted, e.example)
    assert check.points == len(fake_quant_nodes(converted)) > 0 and (check.cascade is None or check.cascade.explained)


# -- QAT ---------------------------------------------------------------------------


@pytest.mark.parametrize("name, preset", QAT_CASES)
def test_qat_converts_deterministically_above_the_floor(suite, name, preset):
    result = suite.qat(name, preset)
    _check_floor(result, name, preset)
    assert result.repeat_equal, "two runs of the converted QAT model differ: train-only randomness survived"


@pytest.mark.parametrize("name, preset", QAT_CASES)
def test_the_saved_qat_program_reproduces_the_converted_model(suite, name, preset):
    """Without batch norms the saved program is the converted model, bit for
    bit. With them, save folds conv-bn, whose fp32 rounding can move a
    folded weight across a rounding boundary of its fake quantization and
    the flip cascades (measured bit for bit on some runs,
    39.9 dB on resnet18 after 10 steps, benchmarks/README.md). The bound
    until then: the saved program's difference from the converted model at
    least 10 dB below the quantization error itself (the converted model
    against float), so that saving costs under a tenth of what quantizing
    does."""
    result = suite.qat(name, preset)
    drift = sqnr_db(result.outputs, result.saved_outputs)
    if name not in CNNS:
        assert torch.equal(result.saved_outputs, result.outputs), f"SQNR against the converted model: {drift:.1f} dB"
    else:
        assert drift >= result.sqnr + 10, f"saved vs converted {drift:.1f} dB, converted vs float {result.sqnr:.1f} dB"


# -- every .pt2 file, loaded in one fresh process --------------------------------------

_LOADER = textwrap.dedent("""
    import json, sys, torch, pt2e_fq
    torch.set_num_threads(1)
    jobs = json.loads(sys.argv[1])
    inputs = torch.load(jobs["inputs"])
    out = {}
    for key, path in jobs["files"].items():
        module = pt2e_fq.load(path).module()
        with torch.no_grad():
            out[key] = torch.cat([module(*batch) for batch in inputs[key.split("|")[0]]])
    torch.save(out, jobs["out"])
""")


def test_every_saved_file_loads_in_a_fresh_process_and_reproduces_its_program(suite, tmp_path):
    """All the suite's .pt2 files (PTQ every model and preset, QAT) in one
    subprocess that imports only pt2e_fq: each loaded program's outputs on the
    held-out batches equal, bit for bit, those of the program as saved."""
    for name, preset in PTQ_CASES:
        suite.ptq(name, preset)
    for name, preset in QAT_CASES:
        suite.qat(name, preset)
    results = {f"{n}|{p}|{'_'.join(('ptq',) + f)}": r for (n, p, f), r in suite.ptq_results.items()}
    results.update({f"{n}|{p}|qat": r for (n, p), r in suite.qat_results.items()})
    inputs_path, out_path = tmp_path / "inputs.pt", tmp_path / "out.pt"
    torch.save({n: suite.entry(n).held_out for n in zoo.NAMES}, inputs_path)
    jobs = {"inputs": str(inputs_path), "out": str(out_path), "files": {k: str(r.path) for k, r in results.items()}}
    run = subprocess.run([sys.executable, "-c", _LOADER, json.dumps(jobs)], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    loaded = torch.load(out_path)
    differ = [k for k, r in results.items() if not torch.equal(loaded[k], r.saved_outputs)]
    assert not differ, f"{len(differ)} of {len(results)} files differ from their program after loading: {differ}"
