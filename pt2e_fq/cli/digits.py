"""The demo's data and model: scikit-learn's 8x8 handwritten digits (1797
images shipped inside the scikit-learn package, no download) and a small
CNN with conv-bn-relu blocks.

    data = load()                          # train / test split, pixels in [0, 1]
    model = DigitsCNN()
    for x, y in data.batches("train", 64, seed=0): ...
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

CLASSES = 10


@dataclass
class Digits:
    """Images (N, 1, 8, 8) float32 in [0, 1] and labels (N,) int64."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    def split(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if name == "train":
            return self.x_train, self.y_train
        if name == "test":
            return self.x_test, self.y_test
        raise ValueError(f"Digits.split: unknown split {name!r}; allowed: train, test")

    def batches(self, split: str, batch_size: int, seed: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(images, labels) batches of `split`, shuffled when a seed is given."""
        x, y = self.split(split)
        order = torch.arange(len(x)) if seed is None else torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
        return [(x[i], y[i]) for i in order.split(batch_size)]


def load(test_fraction: float = 0.25, seed: int = 0) -> Digits:
    """The digits, split into train and test with the class proportions kept."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as e:
        raise ImportError(f"the digits data needs scikit-learn ({e}): pip install 'pt2e_fq[demo]' "
                          "(make demo installs it)") from None

    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=test_fraction, random_state=seed, stratify=labels
    )
    as_images = lambda a: torch.tensor(a, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0  # noqa: E731
    as_labels = lambda a: torch.tensor(a, dtype=torch.int64)  # noqa: E731
    return Digits(as_images(x_train), as_labels(y_train), as_images(x_test), as_labels(y_test))


class DigitsCNN(nn.Module):
    """Three conv-bn-relu blocks (the second followed by 2x2 max pooling),
    global average pooling and a linear classifier."""

    def __init__(self, channels: int = 32):
        super().__init__()

        def block(c_in, c_out):
            return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU())

        self.features = nn.Sequential(
            block(1, channels), block(channels, channels), nn.MaxPool2d(2), block(channels, 2 * channels)
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(2 * channels, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pool(self.features(x)).flatten(1))


def accuracy(model, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256) -> float:
    """Share of images whose largest logit is the label; `model` is any
    callable from images to logits (torch model, ONNX Runtime session wrapper)."""
    correct = 0
    with torch.no_grad():
        for xb, yb in zip(x.split(batch_size), y.split(batch_size)):
            correct += int((torch.as_tensor(model(xb)).argmax(1) == yb).sum())
    return correct / len(x)
