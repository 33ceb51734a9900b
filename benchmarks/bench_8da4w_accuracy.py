"""w4a8-dyn on a trained model: PTQ, then QAT, against torchao's own 8da4w QAT.

all-MiniLM-L6-v2's linears (benchmarks/trained_models.py: sentence
embeddings, mean cosine to the float model's over held-out sentences).
Flows, every one from the same float checkpoint:

- pt2e_fq: torch.export, prepare_qat_pt2e with FakeQuantQuantizer
  (presets.get_preset("w4a8-dyn", qat=True)); "PTQ" is that model before
  any step (round-to-nearest weights; nothing to calibrate: the weights'
  qparams follow the weights, the activations' each token);
- torchao 8da4w: `quantize_(model, QATConfig(Int8DynamicActivationIntxWeightConfig(
  weight_dtype=torch.int4, weight_granularity=PerGroup(32),
  weight_mapping_type=MappingType.SYMMETRIC), step="prepare"))`, the same
  numbers before any step (its fake quantization is its PTQ's).

QAT: the same steps, batches (the calibration sentences, in the same
order), optimizer (Adam, --lr) and loss for both: distillation to the
float model's embeddings (MSE). Dropout off in both (eval mode), so the
flows see the same computation. "recovered" is the share of the PTQ
drop in mean cosine that QAT wins back: (QAT - PTQ) / (1 - PTQ).

    python benchmarks/bench_8da4w_accuracy.py [--steps 40] [--lr 2e-5] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trained_models as tm  # noqa: E402

import torchao  # noqa: E402
from torchao.quantization import Int8DynamicActivationIntxWeightConfig, MappingType, PerGroup, quantize_  # noqa: E402
from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e  # noqa: E402
from torchao.quantization.qat import QATConfig  # noqa: E402

from pt2e_fq.cli import pipeline  # noqa: E402
from quantizers import FakeQuantQuantizer, presets  # noqa: E402

PRESET = "w4a8-dyn"


def torchao_8da4w_config() -> QATConfig:
    """torchao's 8da4w QAT: int8 per-token asymmetric dynamic activations,
    int4 per-group-32 symmetric weights."""
    return QATConfig(Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4, weight_granularity=PerGroup(32), weight_mapping_type=MappingType.SYMMETRIC),
        step="prepare")


def ours(model: torch.nn.Module, example) -> torch.nn.Module:
    """The stock PT2E QAT flow with our quantizer, on a copy of `model`
    (a program exported from `model` would share its parameters)."""
    gm = pipeline.export(copy.deepcopy(model).eval(), example)
    return prepare_qat_pt2e(gm, FakeQuantQuantizer(presets.get_preset(PRESET, qat=True)))


def theirs(model: torch.nn.Module) -> torch.nn.Module:
    student = copy.deepcopy(model).eval()
    quantize_(student, torchao_8da4w_config())
    return student


def train(student: torch.nn.Module, teacher_outputs: list, batches: list, steps: int, lr: float) -> float:
    """`steps` Adam steps of MSE distillation over `batches` in turn;
    returns the seconds taken."""
    optimizer = torch.optim.Adam([p for p in student.parameters() if p.requires_grad], lr=lr)
    start = time.perf_counter()
    for step in range(steps):
        i = step % len(batches)
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(student(*batches[i]), teacher_outputs[i]).backward()
        optimizer.step()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="QAT steps (default 40)")
    parser.add_argument("--lr", type=float, default=2e-5, help="Adam learning rate (default 2e-5)")
    parser.add_argument("--quick", action="store_true", help="64 training and 128 held-out sentences")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = tm.minilm()
    sizes = (64, 128) if args.quick else (tm.CALIBRATION_SENTENCES, tm.HELD_OUT_SENTENCES)
    train_batches, held_out = tm.sentence_data(model.tokenizer, *sizes)
    with torch.no_grad():
        teacher = [model(*b) for b in train_batches]
    reference = tm.outputs(model, held_out)
    flows = {"pt2e_fq " + PRESET: ours(model, train_batches[0]), "torchao 8da4w QAT": theirs(model)}
    rows = []
    for name, student in flows.items():
        ptq = tm.embedding_metrics(reference, tm.outputs(student, held_out))
        seconds = train(student, teacher, train_batches, args.steps, args.lr)
        qat = tm.embedding_metrics(reference, tm.outputs(student, held_out))
        recovered = (qat["cosine"].value - ptq["cosine"].value) / (1 - ptq["cosine"].value)
        rows.append([name, f"{ptq['cosine']:.4f}", f"{qat['cosine']:.4f}", f"{100 * recovered:.0f} %",
                     f"{ptq['sqnr']:.1f}", f"{qat['sqnr']:.1f}", f"{seconds / args.steps:.2f}"])
    print(f"all-MiniLM-L6-v2, {len(reference)} held-out sentences; QAT: {args.steps} Adam steps, lr {args.lr:g}, "
          f"MSE to the float embeddings, {len(train_batches)} batches of {len(train_batches[0][0])}; "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; "
          f"torch {torch.__version__}, torchao {torchao.__version__}")
    print(tabulate(rows, headers=["flow", "PTQ cosine", "QAT cosine", "recovered", "PTQ SQNR dB", "QAT SQNR dB",
                                  "s / step"], tablefmt="github", disable_numparse=True))


if __name__ == "__main__":
    main()
