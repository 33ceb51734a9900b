"""Real architectures at toy sizes, random init, nothing downloaded: the
model suite of the tests (tests/flow/test_model_suite.py) and of the accuracy
benchmark (benchmarks/bench_accuracy.py).

| name | built from | input |
| --- | --- | --- |
| resnet18 | torchvision `resnet18(num_classes=10)` | images 3x32x32 |
| mobilenet_v3_small | torchvision `mobilenet_v3_small(num_classes=10)` | images 3x32x32 |
| efficientnet_b0 | torchvision `efficientnet_b0(num_classes=10)` | images 3x32x32 |
| vit_tiny | timm `vit_tiny_patch16_224` at img_size 32, patch 4, depth 4 | images 3x32x32 |
| llama | transformers `LlamaForCausalLM`, 2 layers, width 64 | token ids (batch, 16) < 256 |
| bert | transformers `BertForSequenceClassification`, 2 layers, width 32, 5 labels | token ids (batch, 12) < 100 |
| gpt2 | transformers `GPT2LMHeadModel`, 2 layers, width 32 | token ids (batch, 16) < 64 |

The vision models are the libraries' own classes at full depth (the ViT at
4 of its 12 blocks, to keep the suite's time); only the classifier and the
image size are small. Every entry is deterministic: the weights from a
fixed seed, then the batch norms' running statistics settled on
calibration-like data (a random-init torchvision model has mean 0 and
variance 1 everywhere, which a trained one never has), and the inputs from
their own generators. The Hugging Face models return their logits as one
tensor (a ModelOutput would do for pt2e_fq, but not for SQNR or ONNX
Runtime comparisons).

    from benchmarks import zoo           # from the repository root
    entry = zoo.build("resnet18")      # .model (eval mode), .example, .calibration, .held_out
    pt2e-fq quantize --model benchmarks.zoo:resnet18 --example-input 2x3x32x32 --preset w8a8

torchvision, timm: `pip install "pt2e_fq[models]"`; transformers is in the
dev extra.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from pt2e_fq.plugins.torchvision import allow_torchvision_import, import_torchvision

IMAGE_BATCH, IMAGE_SIZE, CLASSES = 8, 32, 10
TOKEN_BATCH = 8
CALIBRATION_BATCHES, HELD_OUT_BATCHES = 4, 16


@dataclass(frozen=True)
class ZooEntry:
    """A model in eval mode with its inputs: `example` (one batch, the
    export's example), `calibration` and `held_out` (lists of batches, each
    a tuple of positional arguments; held_out is never calibrated on)."""

    name: str
    model: nn.Module
    example: tuple
    calibration: list
    held_out: list


@dataclass(frozen=True)
class _Spec:
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple]
    settle_batch_norms: bool = False


def _images(g: torch.Generator) -> tuple:
    return (torch.randn(IMAGE_BATCH, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g),)


def _tokens(vocab: int, length: int) -> Callable[[torch.Generator], tuple]:
    return lambda g: (torch.randint(0, vocab, (TOKEN_BATCH, length), generator=g),)


def resnet18() -> nn.Module:
    return import_torchvision().models.resnet18(num_classes=CLASSES)


def mobilenet_v3_small() -> nn.Module:
    return import_torchvision().models.mobilenet_v3_small(num_classes=CLASSES)


def efficientnet_b0() -> nn.Module:
    return import_torchvision().models.efficientnet_b0(num_classes=CLASSES)


def vit_tiny() -> nn.Module:
    import_torchvision()  # timm imports it
    import timm

    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=IMAGE_SIZE, patch_size=4, depth=4,
                             num_classes=CLASSES)


class Logits(nn.Module):
    """A Hugging Face model's logits as one tensor (return_dict=False, no KV cache)."""

    def __init__(self, model: nn.Module, **kwargs):
        super().__init__()
        self.model, self.kwargs = model, kwargs

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, return_dict=False, **self.kwargs)[0]


def llama() -> nn.Module:
    allow_torchvision_import()  # transformers' modeling_utils imports torchvision where it is installed
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Logits(transformers.LlamaForCausalLM(config), use_cache=False)


def bert() -> nn.Module:
    allow_torchvision_import()  # transformers' modeling_utils imports torchvision where it is installed
    import transformers

    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, num_labels=5)
    return Logits(transformers.BertForSequenceClassification(config))


def gpt2() -> nn.Module:
    allow_torchvision_import()  # transformers' modeling_utils imports torchvision where it is installed
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    return Logits(transformers.GPT2LMHeadModel(config), use_cache=False)


_SPECS = {
    "resnet18": _Spec(resnet18, _images, settle_batch_norms=True),
    "mobilenet_v3_small": _Spec(mobilenet_v3_small, _images, settle_batch_norms=True),
    "efficientnet_b0": _Spec(efficientnet_b0, _images, settle_batch_norms=True),
    "vit_tiny": _Spec(vit_tiny, _images),
    "llama": _Spec(llama, _tokens(256, 16)),
    "bert": _Spec(bert, _tokens(100, 12)),
    "gpt2": _Spec(gpt2, _tokens(64, 16)),
}
NAMES = tuple(_SPECS)
VISION = ("resnet18", "mobilenet_v3_small", "efficientnet_b0", "vit_tiny")


def _settle_batch_norms(model: nn.Module, batches: list) -> None:
    """Each batch norm's running statistics set to the mean and variance of
    its input over `batches` (train-mode forwards without gradients,
    momentum None: the cumulative average), then eval mode."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    with torch.no_grad():
        for batch in batches:
            model(*batch)
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum
    model.eval()


def build(name: str, seed: int = 0) -> ZooEntry:
    """The zoo's model `name` (one of NAMES) with its inputs, the same
    weights and batches for the same seed."""
    if name not in _SPECS:
        raise ValueError(f"zoo.build: unknown model {name!r}; the zoo has {', '.join(NAMES)}")
    spec = _SPECS[name]
    torch.manual_seed(seed)
    model = spec.build().eval()
    g = torch.Generator().manual_seed(seed + 1)
    calibration = [spec.batch(g) for _ in range(CALIBRATION_BATCHES)]
    held_out = [spec.batch(g) for _ in range(HELD_OUT_BATCHES)]
    if spec.settle_batch_norms:
        _settle_batch_norms(model, calibration)
    return ZooEntry(name, model, calibration[0], calibration, held_out)
