"""Distillation QAT on the trained checkpoints (benchmarks/trained_models.py):
pt2e_fq.qat.distill from the pipeline's default w4a8 PTQ, with and without
learnable ranges, against torchao's stock QAT, on the same data, steps,
loss and optimizer.

Flows, each from the float model:
- "ours": the one-call PTQ of w4a8 (pipeline.quantize's preset default:
  int8 edges on a CNN, calibration, equalisation, GPTQ, bias correction,
  activation bias correction on a CNN), made ready for QAT by
  pipeline.start_qat_from_ptq (observers off, the weights GPTQ rounded to
  nearest given their float values back: the same outputs), then
  `qat.distill`; batch norms are folded into the convs by prepare_pt2e.
  Its "PTQ start" is the PTQ default's result, and "gap closed" is the
  share of the gap between float (100 % agreement, cosine 1) and that PTQ
  default that a flow's QAT closes;
- "ours learnable": the same with presets.learnable_ranges (LSQ scales,
  LSQ+ offsets of the asymmetric activations, their own learning rate);
- "ours rotated": the same with QuantizerConfig.set_input_rotation (the
  input of every linear and conv with groups 1 rotated in Hadamard blocks,
  folded into its weight; blocks of up to 128 on MiniLM, of 8 on
  EfficientNet-Lite0, whose PTQ start is lower with larger blocks);
  "ours rotated, asymmetric int4": that on int4 groups with a zero point
  each;
- "XNNPACKQuantizer QAT": torchao's prepare_qat_pt2e on a train-mode export
  with XNNPACKQuantizer().set_global(get_symmetric_quantization_config(
  is_per_channel=True, is_qat=True, weight_qmin=-8, weight_qmax=7)), batch
  norms frozen before calibration (torchao's recipe freezes them; before
  calibration so that the calibration forwards do not move them), the same
  distill call, then the eval switch and torchao's convert_pt2e. It
  exports a copy of the float model: XNNPACKQuantizer's prepared graph
  keeps the exported module's parameters, so training it would train the
  teacher (and the model every later flow starts from) too.

Calibration uses the calibration draw; QAT trains on its own data, disjoint
from the held-out set: crops of the calibration images and another
photograph (trained_models.qat_image_data; 2400 crops, one per training
sample), each batch augmented (trained_models.augment_images: random-resized
crops, flips, colour jitter, mixup), and sentences of every standard-library
module but the held-out ones (trained_models.qat_sentence_data; 6400 of a
pool of about 6500). The held-out
metric is top-1 agreement with the float model (EfficientNet-Lite0) or
mean cosine to its embeddings (MiniLM), ± one standard error. Loss: KL at a
temperature on logits, 1 - cosine on embeddings; Adam with a cosine decay.

    python benchmarks/bench_qat_trained.py            # the documented table
    python benchmarks/bench_qat_trained.py --quick    # fewer steps and samples
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
from pathlib import Path

import torch
import torchao
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trained_models as tm  # noqa: E402

from pt2e_fq import qat  # noqa: E402
from pt2e_fq.cli import pipeline  # noqa: E402
from pt2e_fq.flow import convert_pt2e, move_exported_model_to_eval  # noqa: E402
from quantizers import presets  # noqa: E402

MODELS = ("efficientnet_lite0", "minilm")
PRESET = "w4a8"
# Per model: the metric, the distillation loss, and (full, quick) sizes: calibration samples, QAT
# samples, held-out samples, steps. Learning rates: weights `lr`, learnable ranges `qparam_lr`.
# `batch`: calibration and held-out batches; `qat_batch` (default `batch`): the QAT batches.
# `rotation_block`: the "ours rotated" flows' QuantizerConfig.set_input_rotation.
SETUPS = {
    "efficientnet_lite0": dict(metric="top1", loss="kl", temperature=2.0, lr=1e-4, qparam_lr=1e-5,
                               full=(64, 2400, 256, 300), quick=(32, 128, 32, 20), batch=8, rotation_block=8),
    "minilm": dict(metric="cosine", loss="cosine", temperature=1.0, lr=1e-4, qparam_lr=1e-5,
                   full=(128, 6400, 512, 500), quick=(64, 256, 64, 40), batch=16, qat_batch=64,
                   rotation_block=128),
}
DIGITS = {"top1": 1, "cosine": 4}
FLOAT = {"top1": 100.0, "cosine": 1.0}  # the float model's own score


def _data(name: str, model, quick: bool):
    setup = SETUPS[name]
    calibration_n, qat_n, held_n, steps = setup["quick" if quick else "full"]
    if name == "efficientnet_lite0":
        calibration, held_out = tm.image_data(calibration_n, held_n, batch=setup["batch"])
        return calibration, tm.qat_image_data(qat_n, batch=setup["batch"]), held_out, tm.classifier_metrics, steps
    calibration, held_out = tm.sentence_data(model.tokenizer, calibration_n, held_n, batch=setup["batch"])
    qat_data = tm.qat_sentence_data(model.tokenizer, qat_n, batch=setup.get("qat_batch", setup["batch"]))
    return calibration, qat_data, held_out, tm.embedding_metrics, steps


def _image_augment(seed: int):
    """distill's augment hook for images: trained_models.augment_images drawn from its own seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return lambda inputs: (tm.augment_images(inputs[0], g),)


def _stock_qat(model, data):
    from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e
    from torchao.testing.pt2e._xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config

    config = get_symmetric_quantization_config(is_per_channel=True, is_qat=True, weight_qmin=-8, weight_qmax=7)
    # The export of a module holds that module's own parameters and XNNPACKQuantizer's prepare keeps
    # them, so QAT of an export of `model` would train the teacher too: the student trains a copy.
    prepared = prepare_qat_pt2e(pipeline.export(copy.deepcopy(model).train(), data[0]),
                                XNNPACKQuantizer().set_global(config))
    qat.freeze_batch_norms(prepared)
    pipeline.calibrate(prepared, data, progress=False)
    return prepared


def _stock_convert(prepared):
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e as torchao_convert

    return torchao_convert(move_exported_model_to_eval(copy.deepcopy(prepared)))


def _ours(model, data, flow: str, rotation_block: int):
    config = presets.int8_edges(presets.get_preset(PRESET), model)
    if flow == "ours learnable":
        presets.learnable_ranges(config)
    if flow.startswith("ours rotated"):
        config.set_input_rotation(rotation_block)
    if flow == "ours rotated, asymmetric int4":  # w4a8's int4 groups with a zero point each
        weight = config.global_config.weight
        config.set_global(dataclasses.replace(config.global_config, weight=dataclasses.replace(
            weight, scheme="asymmetric")))
    prepared = pipeline.prepare(model, data[0], config)
    pipeline.calibrate(prepared, data, progress=False)
    return pipeline.start_qat_from_ptq(prepared, model, data, PRESET)


def _ours_convert(prepared):
    return convert_pt2e(copy.deepcopy(prepared))


def run(name: str, quick: bool, flows, lr: float = None, steps: int = None) -> list:
    """The table's rows of model `name`; `lr`: the weights' rate instead of
    SETUPS[name]["lr"]; `steps`: the QAT steps instead of the setup's."""
    model = tm.efficientnet_lite0() if name == "efficientnet_lite0" else tm.minilm()
    setup = SETUPS[name] if lr is None else dict(SETUPS[name], lr=lr)
    calibration, qat_data, held_out, metrics, setup_steps = _data(name, model, quick)
    steps = setup_steps if steps is None else steps
    reference = tm.outputs(model, held_out)
    key, digits = setup["metric"], DIGITS[setup["metric"]]

    def metric(converted):
        return metrics(reference, tm.outputs(converted, held_out))[key]

    rows, ptq_default = [], None
    for flow in flows:
        torch.manual_seed(0)
        if flow == "XNNPACKQuantizer QAT":
            prepared, convert = _stock_qat(model, calibration), _stock_convert
        else:
            prepared, convert = _ours(model, calibration, flow, setup["rotation_block"]), _ours_convert
        start = metric(convert(prepared))
        if flow == "ours":
            ptq_default = start.value
        augment = _image_augment(tm.QAT_SEED) if name == "efficientnet_lite0" else None
        history = qat.distill(prepared, model, qat_data, steps=steps, loss=setup["loss"],
                              temperature=setup["temperature"], lr=setup["lr"], qparam_lr=setup["qparam_lr"],
                              freeze_observers_after=0, augment=augment,
                              progress=False, desc=f"{name} {flow}")
        after = metric(convert(prepared))
        losses = history.losses
        rows.append([name, flow, PRESET, f"{setup['lr']:g}", steps, format(start, f".{digits}f"), format(after, f".{digits}f"),
                     after.value, f"{sum(losses[:5]) / 5:.4g} -> {sum(losses[-5:]) / 5:.4g}",
                     f"{history.seconds:.0f}"])
        print("  " + " | ".join(map(str, rows[-1])), flush=True)
    for row in rows:  # the share of the float - PTQ default gap closed, once the default is known
        row[7] = "-" if ptq_default is None else f"{(row[7] - ptq_default) / (FLOAT[key] - ptq_default):.0%}"
    return rows


FLOWS = ("XNNPACKQuantizer QAT", "ours", "ours learnable", "ours rotated", "ours rotated, asymmetric int4")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--flows", nargs="+", default=FLOWS, choices=FLOWS)
    parser.add_argument("--quick", action="store_true", help="fewer samples and steps (a smoke run)")
    parser.add_argument("--lr", type=float, default=None,
                        help="the weights' learning rate of every flow and model (default: each model's SETUPS lr)")
    parser.add_argument("--steps", type=int, default=None,
                        help="QAT steps of every flow and model (default: each model's SETUPS steps)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.lr is not None and not args.lr > 0:
        parser.error(f"--lr must be a rate > 0, got {args.lr}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    torch.set_num_threads(args.threads)
    rows = []
    start = time.perf_counter()
    for name in args.models:
        rows += run(name, args.quick, args.flows, args.lr, args.steps)
    print(f"\ntorch {torch.__version__}, torchao {torchao.__version__}, {torch.get_num_threads()} thread(s), "
          f"{time.perf_counter() - start:.0f} s")
    print(tabulate(rows, headers=("model", "flow", "preset", "lr", "steps", "PTQ start", "after QAT", "gap closed",
                                  "train loss (first 5 -> last 5)", "QAT s"), tablefmt="github"))


if __name__ == "__main__":
    main()
