"""The demo's data, model, accuracy and step timing helpers."""

from __future__ import annotations

import pytest
import torch
from tests.models.quantizer import single_thread  # noqa: F401 (an autouse fixture: one thread)
import torch.nn as nn

from pt2e_fq.cli import digits
from pt2e_fq.cli.step_time import step_times


def test_load_splits_all_1797_images_keeping_the_classes():
    data = digits.load()
    assert data.x_train.shape == (1347, 1, 8, 8) and data.x_test.shape == (450, 1, 8, 8)
    assert data.x_train.dtype == torch.float32 and data.y_train.dtype == torch.int64
    assert float(data.x_train.min()) == 0.0 and float(data.x_train.max()) == 1.0  # 0..16 / 16
    train_share = torch.bincount(data.y_train, minlength=10) / len(data.y_train)
    test_share = torch.bincount(data.y_test, minlength=10) / len(data.y_test)
    assert torch.allclose(train_share, test_share, atol=0.01)  # stratified
    with pytest.raises(ValueError, match="unknown split 'val'; allowed: train, test"):
        data.split("val")


def test_batches_cover_the_split_once():
    data = digits.load()
    batches = data.batches("test", 64, seed=3)
    assert [len(x) for x, _ in batches] == [64] * 7 + [2]
    images = torch.cat([x for x, _ in batches])
    assert not torch.equal(images, data.x_test)  # shuffled
    assert torch.equal(images.sum(0), data.x_test.sum(0))
    assert torch.equal(torch.cat([y for _, y in data.batches("test", 64)]), data.y_test)  # no seed: in order


def test_accuracy_counts_argmax_hits():
    y = torch.tensor([0, 1, 2, 3, 4])
    predicted = torch.tensor([0, 1, 2, 0, 0])  # 3 of 5 right
    logits = nn.functional.one_hot(predicted, 10).float()
    assert digits.accuracy(lambda x: logits[x[:, 0, 0, 0].long()], torch.arange(5.0).reshape(5, 1, 1, 1), y,
                           batch_size=2) == pytest.approx(3 / 5)


def test_cnn_shapes():
    model = digits.DigitsCNN(channels=8)
    assert model(torch.zeros(3, 1, 8, 8)).shape == (3, digits.CLASSES)


def test_step_times_leave_the_models_alone():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ms = step_times({"a": model, "b": model}, (torch.randn(8, 4),), torch.randn(8, 2), nn.functional.mse_loss,
                    steps=3, warmup=1)
    assert set(ms) == {"a", "b"} and all(v > 0 for v in ms.values())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="steps must be >= 1"):
        step_times({"a": model}, (torch.randn(8, 4),), torch.randn(8, 2), nn.functional.mse_loss, steps=0)
