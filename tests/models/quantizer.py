"""The quantizer tests' models (from benchmarks.models) by name, and helpers
shared by the test_quantizer_* files."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e, prepare_qat_pt2e

import pt2e_fq as q
from benchmarks.models import CNN, MLP, EmbeddingHead, EncoderBlock


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
