"""benchmarks.models.LlamaDecoder writes attention as Meta's reference
Llama does (matmul, softmax, matmul under an additive causal mask built
once per forward), which ExecuTorch's XNNPACK delegate runs; it must compute
what torch's fused causal attention (F.scaled_dot_product_attention with
is_causal=True) computes with the same weights."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.models import LlamaDecoder, causal_mask, rotate_half


def _reference_logits(model: LlamaDecoder, tokens: torch.Tensor) -> torch.Tensor:
    """The decoder's forward with each layer's attention as
    F.scaled_dot_product_attention(is_causal=True), from the module's weights."""
    b, t = tokens.shape
    cos, sin = model.cos[:t], model.sin[:t]
    x = model.embed(tokens)
    for layer in model.layers:
        a = layer.attn
        h = layer.attn_norm(x)
        d = h.shape[-1]
        q, k, v = (lin(h).view(b, t, a.heads, d // a.heads).transpose(1, 2) for lin in (a.q, a.k, a.v))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + a.o(y.transpose(1, 2).reshape(b, t, d))
        x = x + layer.mlp(layer.mlp_norm(x))
    return model.lm_head(model.norm(x))


def test_causal_mask_is_zero_on_and_below_the_diagonal_and_minus_inf_above():
    inf = math.inf
    expected = torch.tensor([[0.0, -inf, -inf], [0.0, 0.0, -inf], [0.0, 0.0, 0.0]])
    mask = causal_mask(3, torch.zeros(1, dtype=torch.bfloat16))
    assert mask.dtype == torch.bfloat16
    assert torch.equal(mask.float(), expected)


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 3), seq=st.integers(1, 24), heads=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**16))
def test_the_decoder_computes_what_fused_causal_attention_computes(batch, seq, heads, seed):
    torch.manual_seed(seed)
    model = LlamaDecoder(vocab=64, dim=32, layers=2, heads=heads, max_seq=24).eval()
    tokens = torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ours, reference = model(tokens), _reference_logits(model, tokens)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("position", [0, 5, 11])
def test_a_token_changes_no_logits_before_it(position):
    torch.manual_seed(0)
    model = LlamaDecoder(vocab=64, dim=32, layers=2, heads=2, max_seq=16).eval()
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, position] = (changed[:, position] + 1) % 64
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :position], b[:, :position])
    assert not torch.equal(a[:, position], b[:, position])
