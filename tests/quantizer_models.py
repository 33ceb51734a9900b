"""Models for the quantizer tests, built from torch.nn parts, and helpers
shared by the test_quantizer_* files."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e, prepare_qat_pt2e

import pt2e_fq as q


class MLP(nn.Module):
    def __init__(self, d_in=16, hidden=32, d_out=4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(hidden, hidden)
        self.act2 = nn.GELU()
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.head(self.act2(self.fc2(self.act1(self.fc1(x)))))


class CNN(nn.Module):
    """conv-bn-relu, conv-bn, a residual add and relu, global average pool, linear."""

    def __init__(self, channels=8, classes=4):
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(channels)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)) + y)
        return self.fc(self.pool(y).flatten(1))


class Attention(nn.Module):
    def __init__(self, d=32, heads=2):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape
        split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * (d // self.heads) ** -0.5, dim=-1)
        return self.out(torch.matmul(scores, v).transpose(1, 2).reshape(b, t, d))


class EncoderBlock(nn.Module):
    """Pre-norm transformer encoder block: attention (matmul, softmax), layer
    norm, GELU MLP, two residual adds."""

    def __init__(self, d=32, heads=2, hidden=64):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class EmbeddingHead(nn.Module):
    def __init__(self, vocab=64, d=32, classes=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens):
        return self.head(self.emb(tokens))


def example_batch(model_name: str, seed: int, n: int = 16):
    g = torch.Generator().manual_seed(seed)
    if model_name == "mlp":
        return torch.randn(n, 16, generator=g)
    if model_name == "cnn":
        return torch.randn(n, 3, 8, 8, generator=g)
    if model_name == "encoder":
        return torch.randn(n, 8, 32, generator=g)
    return torch.randint(0, 64, (n, 8), generator=g)


MODELS = {"mlp": MLP, "cnn": CNN, "encoder": EncoderBlock, "embedding": EmbeddingHead}


def build(model_name: str, train: bool = False, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = MODELS[model_name]()
    return model.train(train)


def export(model: nn.Module, example) -> torch.fx.GraphModule:
    return torch.export.export(model, (example,)).module()


def prepare(model: nn.Module, example, quantizer, qat: bool = False) -> torch.fx.GraphModule:
    return (prepare_qat_pt2e if qat else prepare_pt2e)(export(model, example), quantizer)


def fake_quant_modules(gm: torch.nn.Module) -> list[q.FakeQuantize]:
    """Distinct FakeQuantize instances (a shared one is registered under several names)."""
    return [m for m in gm.modules() if isinstance(m, q.FakeQuantize)]


def sqnr_db(reference: torch.Tensor, y: torch.Tensor) -> float:
    noise = (reference - y).float().pow(2).sum()
    return float(10 * torch.log10(reference.float().pow(2).sum() / noise))


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """These models are tiny: one thread is faster, and on a busy 2-core
    machine two OpenMP threads per process spin and run many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
