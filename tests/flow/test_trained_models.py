"""The trained-model suite (benchmarks/trained_models.py): the checkpoints
that ship in packages load and behave as trained models, the evaluation
data keep their sources apart, the metrics agree with hand computations,
and the preset defaults (int8 edges, GPTQ, bias correction) improve a
4-bit preset on a trained model. Reduced sizes; the full table is
benchmarks/bench_trained.py."""

import sys
from pathlib import Path

import pytest
import torch
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import trained_models as tm  # noqa: E402

from pt2e_fq.cli import pipeline  # noqa: E402


def test_classifier_metrics_by_hand():
    reference = torch.tensor([[3.0, 1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 2.0, 1.0, 0.0, 0.0, 0.0]])
    logits = torch.tensor([[1.0, 3.0, 0.0, 0.0, 0.0, 0.0], [0.0, 2.5, 1.0, 0.0, 0.0, 0.0]])
    m = tm.classifier_metrics(reference, logits)
    assert m["top1"].value == 50.0 and m["top5"].value == 100.0
    p, q = reference.softmax(-1), logits.softmax(-1)
    assert m["kl"].value == pytest.approx((p * (p / q).log()).sum(-1).mean().item(), rel=1e-5)
    noise = (reference - logits).pow(2).sum()
    assert m["sqnr"].value == pytest.approx((10 * torch.log10(reference.pow(2).sum() / noise)).item(), rel=1e-6)


def test_embedding_metrics_by_hand():
    g = torch.Generator().manual_seed(0)
    reference = torch.randn(24, 8, generator=g)
    assert tm.embedding_metrics(reference, reference * 2)["cosine"].value == pytest.approx(1.0)
    rotation = torch.linalg.qr(torch.randn(8, 8, generator=g))[0]
    rotated = reference @ rotation  # every pairwise cosine kept, each embedding moved
    m = tm.embedding_metrics(reference, rotated)
    want = torch.nn.functional.cosine_similarity(reference, rotated).mean().item()
    assert m["cosine"].value == pytest.approx(want, rel=1e-5) and want < 0.9
    assert m["spearman"].value == pytest.approx(1.0) and m["nn"].value == 100.0


def test_data_split_by_source():
    assert not set(tm.CALIBRATION_IMAGES) & set(tm.HELD_OUT_IMAGES)
    assert not set(tm.CALIBRATION_MODULES) & set(tm.HELD_OUT_MODULES)
    calibration = tm._sentence_set(tm.CALIBRATION_MODULES, 64, tm.CALIBRATION_SEED)
    held_out = tm._sentence_set(tm.HELD_OUT_MODULES, 64, tm.HELD_OUT_SEED)
    assert calibration == tm._sentence_set(tm.CALIBRATION_MODULES, 64, tm.CALIBRATION_SEED)  # fixed seeds
    assert len(set(calibration)) == 64 and all(6 <= len(s.split()) <= 40 for s in held_out)


@pytest.mark.slow
def test_efficientnet_lite0_recognises_the_photographs():
    model = tm.efficientnet_lite0()
    with torch.no_grad():
        top5 = {s: set(model(tm.center_crop(s)).topk(5).indices[0].tolist()) for s in ("coffee", "chelsea")}
    assert top5["coffee"] & {504, 967, 968}  # coffee mug, espresso, cup
    assert top5["chelsea"] & {281, 282, 285}  # tabby, tiger cat, Egyptian cat


@pytest.mark.slow
def test_minilm_embeds_a_paraphrase_closer_than_an_unrelated_sentence():
    encoder = tm.minilm()
    enc = encoder.tokenizer(["The cat sat on the mat.", "A cat was sitting on a rug.",
                             "Interest rates rose sharply last quarter."], padding=True, return_tensors="pt")
    with torch.no_grad():
        e = torch.nn.functional.normalize(encoder(enc["input_ids"], enc["attention_mask"]), dim=-1)
    assert e[0] @ e[1] > e[0] @ e[2] + 0.3


@pytest.mark.slow
def test_preset_defaults_improve_w4a8_on_minilm():
    """pipeline.quantize's defaults (GPTQ and bias correction for w4a8) bring
    the quantized sentence embeddings closer to the float ones than
    round-to-nearest, on held-out sentences of other modules."""
    torch.set_num_threads(1)  # GPTQ's column loop of small ops: threads only wait on a busy machine
    encoder = tm.minilm()
    calibration, held_out = tm.sentence_data(encoder.tokenizer, 16, 16, batch=16)
    reference = tm.outputs(encoder, held_out)
    cosine = {}
    for algorithms in (False, True):
        converted = pipeline.quantize(encoder, calibration[0], "w4a8", calibration=calibration, progress=False,
                                      algorithms=algorithms)
        cosine[algorithms] = tm.embedding_metrics(reference, tm.outputs(converted, held_out))["cosine"].value
    assert cosine[True] > cosine[False] + 0.005, cosine


@pytest.mark.slow
def test_activation_bias_brings_efficientnet_lite0_w8a8_closer_to_float():
    """calib.correct_activation_bias (the mean output error of every layer,
    activation points included, removed in graph order) raises the logit
    SQNR of EfficientNet-Lite0 under w8a8 on held-out crops of other
    photographs."""
    from pt2e_fq import FakeQuantize
    from pt2e_fq.calib import correct_activation_bias

    torch.set_num_threads(1)
    model = tm.efficientnet_lite0()
    calibration, held_out = tm.image_data(8, 16, batch=8)
    reference = tm.outputs(model, held_out)
    prepared = pipeline.prepare(model, calibration[0], "w8a8")
    pipeline.calibrate(prepared, calibration, progress=False)
    for m in prepared.modules():
        if isinstance(m, FakeQuantize):
            m.enable_observer(False)
    before = tm.sqnr(reference, tm.outputs(prepared, held_out)).value
    correct_activation_bias(prepared, calibration)
    after = tm.sqnr(reference, tm.outputs(prepared, held_out)).value
    assert after > before + 0.5, (before, after)
