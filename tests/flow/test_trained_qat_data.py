"""The QAT data of the trained-model suite (benchmarks/trained_models.py):
the QAT sentence pool and images never reach into the held-out data, are
the same on every call and large enough for the benchmark's training runs,
and the image augmentation keeps a batch's shape and dtype, is fixed by its
generator and does what it says with its randomness pinned."""

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import trained_models as tm  # noqa: E402

MEAN = torch.tensor(tm.IMAGENET_MEAN).view(1, 3, 1, 1)
STD = torch.tensor(tm.IMAGENET_STD).view(1, 3, 1, 1)


def _held_out_sentences() -> set:
    """Every sentence any held-out draw can take: the held-out modules' pools."""
    return {s for m in tm.HELD_OUT_MODULES for s in tm._sentences(m)}


def test_qat_sentence_pool_is_large_disjoint_from_held_out_and_fixed():
    pool = tm.qat_sentence_pool()
    # the benchmark's 500 steps of 16 sentences see each sentence about once
    assert len(pool) >= 6400 and len(set(pool)) == len(pool)
    assert not set(pool) & _held_out_sentences()
    calibration = {s for m in tm.CALIBRATION_MODULES for s in tm._sentences(m)}
    assert len(set(pool) - calibration) > 5 * len(calibration)  # far beyond the calibration modules
    tm._QAT_POOL.clear()  # rebuilt in a fresh child interpreter
    assert tm.qat_sentence_pool() == pool


@pytest.mark.slow
def test_qat_sentence_batches_share_no_row_with_the_held_out_batches():
    tokenizer = tm.minilm().tokenizer
    _, held_out = tm.sentence_data(tokenizer, 8, tm.HELD_OUT_SENTENCES)
    qat = tm.qat_sentence_data(tokenizer, 6400, batch=64)
    assert sum(len(ids) for ids, _ in qat) == 6400
    rows = {tuple(r.tolist()) for ids, _ in held_out for r in ids}
    assert not any(tuple(r.tolist()) in rows for ids, _ in qat for r in ids)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(qat, tm.qat_sentence_data(tokenizer, 6400, batch=64)))
    with pytest.raises(ValueError, match="sentences=100000 exceeds the QAT pool"):
        tm.qat_sentence_data(tokenizer, 100000)


def test_qat_images_come_from_no_held_out_photograph():
    qat_sources = tm.CALIBRATION_IMAGES + tm.QAT_EXTRA_IMAGES
    assert not set(qat_sources) & set(tm.HELD_OUT_IMAGES)
    held_out = [tm._load_image(s) for s in tm.HELD_OUT_IMAGES]
    for source in tm.QAT_EXTRA_IMAGES:  # by content too: no held-out picture under another name
        image = tm._load_image(source)
        assert image.shape[0] == 3 and min(image.shape[1:]) >= tm.IMAGE_SIZE
        assert not any(h.shape == image.shape and torch.allclose(h, image, atol=0.05) for h in held_out)
    first, second = tm.qat_image_data(18, batch=8), tm.qat_image_data(18, batch=8)
    assert [b.shape[0] for b in first] == [8, 8, 2]
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 5), seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_augment_images_keeps_shape_dtype_and_range_and_follows_its_generator(n, seed, dtype):
    x = ((torch.rand(n, 3, 24, 40, generator=torch.Generator().manual_seed(seed)) - MEAN) / STD).to(dtype)
    y = tm.augment_images(x, torch.Generator().manual_seed(seed))
    assert y.shape == x.shape and y.dtype == dtype
    pixels = y * STD.to(dtype) + MEAN.to(dtype)  # back in [0, 1]
    assert pixels.min() >= -1e-5 and pixels.max() <= 1 + 1e-5
    assert torch.equal(y, tm.augment_images(x, torch.Generator().manual_seed(seed)))
    assert not torch.equal(y, tm.augment_images(x, torch.Generator().manual_seed(seed + 1)))


def test_augment_images_without_crop_jitter_or_mixup_only_flips():
    x = (torch.rand(16, 3, 20, 30, generator=torch.Generator().manual_seed(0)) - MEAN) / STD
    y = tm.augment_images(x, torch.Generator().manual_seed(1), scale=(1, 1), ratio=(1, 1), jitter=0, mixup=0)
    kept = [torch.allclose(a, b, atol=1e-5) for a, b in zip(x, y)]
    flipped = [torch.allclose(a.flip(-1), b, atol=1e-5) for a, b in zip(x, y)]
    assert all(k or f for k, f in zip(kept, flipped)) and any(kept) and any(flipped)


def test_augment_images_mixup_blends_each_image_with_another_by_at_most_half():
    levels = torch.linspace(0.1, 0.9, 6)
    x = (levels.view(6, 1, 1, 1).expand(6, 3, 8, 8) - MEAN) / STD  # flat grey images, one level each
    y = tm.augment_images(x, torch.Generator().manual_seed(3), scale=(1, 1), ratio=(1, 1), jitter=0, mixup=1)
    mixed = (y * STD + MEAN)[:, 0, 0, 0]
    assert torch.allclose(y * STD + MEAN, mixed.view(6, 1, 1, 1).expand(6, 3, 8, 8), atol=1e-5)  # still flat
    others = [levels[torch.arange(6) != i] for i in range(6)]
    # mixed = (1 - w) * own + w * other with w in [0, 0.5]: some other level within reach, never past the midpoint
    assert all(any(abs(m - ((1 - w) * levels[i] + w * o)) < 1e-4
                   for o in others[i] for w in [((m - levels[i]) / (o - levels[i])).item()] if 0 <= w <= 0.5)
               for i, m in enumerate(mixed))
    assert not torch.allclose(mixed, levels, atol=1e-3)  # mixup=1: the images did mix
