"""Example architectures used by the tests, the benchmarks and as
`pt2e-fq quantize --model benchmarks.models:<factory>` targets: every
class here builds with its defaults, so the class itself is the factory.

Built from plain torch.nn parts, so that torch.export sees the ops real
models give and the quantizer annotates them as it would there:

- `MLP` (x of shape (batch, 16)): linear, relu, linear, gelu, linear;
- `CNN` (x of shape (batch, 3, H, W)): conv-bn-relu, conv-bn, a residual
  add and relu, global average pool, linear;
- `EncoderBlock` (x of shape (batch, seq, 32)): a pre-norm transformer
  encoder block, with `Attention` (matmul, softmax);
- `EmbeddingHead` (int64 tokens of shape (batch, seq), < 64): embedding,
  linear;
- `LlamaDecoder` (int64 tokens of shape (batch, seq), < 4096): a small
  Llama-style decoder, with `RMSNorm`, `RotaryAttention` and `SwiGLU`.

For example:

    pt2e-fq quantize --model benchmarks.models:CNN --example-input 1x3x8x8 --preset w8a8
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------
# Small models of the quantizer tests: an MLP, a CNN, a transformer encoder
# block and an embedding with a head.


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


# ---------------------------------------------------------------------------
# A small Llama-style decoder (the QAT benchmark's): token embedding, pre-norm
# blocks of RMSNorm, causal self-attention with rotary position embeddings
# and a SwiGLU MLP, a final RMSNorm and an LM head. Written the way Meta's
# reference Llama is, so that torch.export sees the ops a real one gives
# (embedding, linear, matmul, softmax, silu, mul, add, rsqrt): attention is
# matmul, softmax, matmul under one additive causal mask that the decoder
# builds once per forward for all its layers. F.scaled_dot_product_attention
# with is_causal=True computes the same, but ExecuTorch's lowering
# decomposes it with the mask built in every layer and a "safe" softmax
# (rows that are all -inf give 0: eq, any, logical_not, where) that XNNPACK
# has no kernel for; measured on the 4-layer, dim-512 decoder at sequence
# 128 (ETDump, 2 threads), those portable ops took about a fifth of the
# int4 .pte's forward. Two more choices keep ops in XNNPACK's delegate
# (docs/export.md, "Where the time goes"): the matmuls are 3-D batched
# matmuls over (batch x heads), and RMSNorm's mean is a 4-D mean.


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # The statistics in fp32, as Llama does, whatever x's dtype.
        xf = x.float()
        # The mean of squares as a 4-D mean over the last two dims (the channels
        # split in two): XNNPACK averages only that way, so the mean runs in
        # the delegate rather than in ExecuTorch's portable kernel.
        squares = xf.pow(2).unflatten(-1, (2, -1))
        mean_square = squares.mean((-2, -1), keepdim=True).flatten(-2)
        return (xf * torch.rsqrt(mean_square + self.eps)).to(x.dtype) * self.weight


def rotary_tables(head_dim: int, max_seq: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (max_seq, head_dim), halves repeated (the rotate-half layout)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x):
    # Slices, as transformers' Llama writes it: x.chunk(2, -1) exports as a
    # split whose list output ExecuTorch's edge verifier measures with len(),
    # which pinned a dynamic batch to the example's size.
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def causal_mask(t: int, like: torch.Tensor) -> torch.Tensor:
    """(t, t) additive mask in `like`'s dtype and device: 0 where a query may read a key (key <= query), -inf elsewhere."""
    return torch.full((t, t), float("-inf"), dtype=like.dtype, device=like.device).triu(1)


class RotaryAttention(nn.Module):
    """Causal self-attention with rotary position embeddings, no biases."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, cos, sin, mask):
        b, t, d = x.shape
        head_dim = d // self.heads

        def split(y):
            return y.view(b, t, self.heads, head_dim)

        def heads(y, *order):
            # (b, t, heads, head_dim) -> contiguous (b * heads, ...) with (t,
            # head_dim) in `order`, for 3-D batched matmuls: a 4-D matmul
            # exports as expand_copy + bmm, and ExecuTorch runs those expands
            # outside XNNPACK (a copy and one more delegate call each).
            y = y.permute(0, 2, *order)
            return y.reshape(b * self.heads, *y.shape[2:])

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        # (b * heads, t, t): the mask broadcasts over the first dim, so the
        # scores need no view back to 4-D (a view to a dynamic size splits
        # the delegate).
        scores = torch.bmm(heads(q, 1, 3), heads(k, 3, 1)) / math.sqrt(head_dim) + mask
        # The softmax in fp32, as Llama does, whatever q's dtype.
        y = torch.bmm(F.softmax(scores.float(), dim=-1).type_as(q), heads(v, 1, 3)).view(b, self.heads, t, head_dim)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(dim), RotaryAttention(dim, heads)
        self.mlp_norm, self.mlp = RMSNorm(dim), SwiGLU(dim, hidden)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class LlamaDecoder(nn.Module):
    """tokens (batch, seq) int64 -> logits (batch, seq, vocab)."""

    def __init__(self, vocab: int = 4096, dim: int = 512, layers: int = 4, heads: int = 8,
                 hidden: int | None = None, max_seq: int = 2048):
        super().__init__()
        # Llama's MLP width: 8/3 of dim, rounded up to a multiple of 64.
        hidden = hidden or 64 * math.ceil(8 * dim / 3 / 64)
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(DecoderLayer(dim, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        cos, sin = rotary_tables(dim // heads, max_seq)
        # Buffers, so that .to(device, dtype) moves them with the weights.
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        # (t, 1, head_dim): broadcast over the heads of (batch, t, heads, head_dim).
        cos, sin = self.cos[:t, None], self.sin[:t, None]
        x = self.embed(tokens)
        # Additive causal mask (0 on and below the diagonal, -inf above), built as Llama builds it.
        mask = causal_mask(t, x)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.lm_head(self.norm(x))


def vary_group_ranges(model: nn.Module, group: int = 32, seed: int = 1) -> nn.Module:
    """Scales each group of `group` weights along a row of every linear by
    its own factor (e^N(0, 0.5)): a fresh linear's groups all span about the
    same range, so one group's scale would pass for another's; a trained
    model's do not. Changes and returns `model`."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                rows, cols = m.weight.shape
                m.weight.mul_(torch.exp(0.5 * torch.randn(rows, cols // group, generator=g)).repeat_interleave(group, 1))
    return model
