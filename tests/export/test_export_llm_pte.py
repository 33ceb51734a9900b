"""An LLM decoder with dynamic per-token int8 activations (w4a8-dyn,
w8a8-dyn) as an ExecuTorch .pte: every linear runs in XNNPACK's dynamically
quantized linear, the file takes a dynamic batch and sequence length up to
its declared maxima, and its logits stay within check_lowered's SQNR bound
of the converted fake-quant model, which a wrong weight scale, group or
zero point in the file fails.

A tighter bound per token: the median token's logits at EXACT_TOKEN_DB or
more. With the xnnpack target's bfloat16 group scales (the scales XNNPACK
stores) a token's logits are 130 dB or more from ours (measured, torch 2.13,
executorch 1.5.1, x86-64): XNNPACK's per-token qparams and codes are ours,
and only its float arithmetic differs. Where such a last-bit difference
moves an activation across a rounding boundary, that token and the later
ones of its sequence (through attention) fall to 40 to 60 dB: a few tokens,
never the median. fp32 group scales in the model, which the .pte rounds,
put every token at about 40 dB, as do the wrong files below."""

from __future__ import annotations

import collections
import functools

import pytest
import torch
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from benchmarks.models import LlamaDecoder, vary_group_ranges
from pt2e_fq.export import check_lowered, run_pte, to_executorch
from pt2e_fq.export.lowering import qdq
from pt2e_fq.export.lowering.check import MIN_FLOAT_SQNR_DB
from pt2e_fq.report import sqnr_db
from quantizers import FakeQuantQuantizer, presets
from tests.export.test_export_executorch import needs_executorch

# Each test lowers a decoder and runs it in ExecuTorch: 20 to 40 s of CPU apiece.
pytestmark = [pytest.mark.slow, needs_executorch]

VOCAB, MAX_BATCH, MAX_SEQ = 128, 4, 32
DIMS = ({0: torch.export.Dim("batch", min=1, max=MAX_BATCH), 1: torch.export.Dim("seq", min=1, max=MAX_SEQ)},)
# Width 64: two groups of 32 per row. Seven linears per layer, and the LM head.
LINEARS_PER_LAYER = 7
EXACT_TOKEN_DB = 100.0


def _tokens(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@functools.lru_cache(maxsize=None)
def _converted(preset: str, layers: int = 2, target: str = "xnnpack") -> torch.fx.GraphModule:
    """The decoder through the stock flow with the preset for `target`:
    export with a dynamic batch and sequence length, prepare, one forward,
    convert."""
    torch.manual_seed(0)
    model = LlamaDecoder(vocab=VOCAB, dim=64, layers=layers, heads=2, max_seq=MAX_SEQ).eval()
    vary_group_ranges(model)
    example = (_tokens(2, 16),)
    prepared = prepare_pt2e(torch.export.export(model, example, dynamic_shapes=DIMS).module(),
                            FakeQuantQuantizer(presets.get_preset(preset, target=target)))
    prepared(*example)
    return convert_pt2e(prepared)


@pytest.mark.parametrize("preset", presets.DYNAMIC_ACTIVATION_PRESETS)
def test_every_linear_is_delegated_and_the_pte_takes_dynamic_batch_and_length_within_the_bound(preset, tmp_path):
    converted = _converted(preset)
    result = to_executorch(converted, (_tokens(2, 16),), tmp_path / f"{preset}.pte", dynamic_shapes=DIMS)
    linears = 2 * LINEARS_PER_LAYER + 1
    assert result.delegated_linears == linears, str(result)
    # Each linear's input: torchao's per-token choose_qparams / quantize / dequantize, in the delegate.
    assert result.delegated.get("torchao_choose_qparams_affine_default") == linears, result.delegated
    assert not any("quantize" in op or "linear" in op for op in result.outside), result.outside
    # What stays outside (embedding, reshapes, the causal mask...) has one line each, with a reason.
    lines = result.why_outside().splitlines()
    assert len(lines) == len(result.outside_nodes) > 0
    assert all(reason for _, _, reason in result.outside_nodes)
    assert any("embedding" in line for line in lines), lines
    _check_outside(result, layers=2)
    for batch in (1, MAX_BATCH):
        for seq in (1, 7, MAX_SEQ):
            x = _tokens(batch, seq, seed=seq)
            check = check_lowered(result.path, converted, (x,))
            assert check.ok, f"batch {batch}, sequence {seq}:\n{check}"
            assert check.outputs[0].sqnr_db >= MIN_FLOAT_SQNR_DB
            assert _median_token_sqnr(result.path, converted, x) >= EXACT_TOKEN_DB, (batch, seq)


# Per layer, left to the portable kernels: the reshapes and slices to the
# dynamic batch and length (q, k, v into heads and the 3-D batched matmuls'
# views, attention's output, each RMSNorm's split of the channels for its
# 4-D mean and back), the rotary halves. ExecuTorch runs the views as views
# (no copy). Once per forward: the embedding, the final RMSNorm's views, the
# rotary tables' slices and the causal mask's construction, the sizes they
# are computed from. RMSNorm's mean and attention's matmuls run in XNNPACK.
OUTSIDE_PER_LAYER = {"aten.view_copy.default": 12, "aten.slice_copy.Tensor": 4}
OUTSIDE_ONCE = {"aten.embedding.default": 1, "aten.view_copy.default": 2, "aten.slice_copy.Tensor": 2,  # cos, sin
                "aten.full.default": 1, "aten.arange.start_step": 2, "aten.unsqueeze_copy.default": 4,
                "aten.sub.Tensor": 1, "aten.ge.Scalar": 1, "aten.scalar_tensor.default": 1, "aten.where.self": 1,
                "aten.sym_size.int": 2, "operator.mul": 1}
# XNNPACK subgraphs (one delegate call each per forward), split at the ops above.
SUBGRAPHS_PER_LAYER, SUBGRAPHS_ONCE = 8, 3


def _check_outside(result, layers: int) -> None:
    """The ops left outside the delegate are the decoder's reshapes, slices and
    means, each with its reason, and the causal mask is built once for all
    layers (F.scaled_dot_product_attention's decomposition built it in every
    layer, with a masked softmax of 6 more portable ops)."""
    expected = collections.Counter(OUTSIDE_ONCE)
    expected.update({op: n * layers for op, n in OUTSIDE_PER_LAYER.items()})
    found = collections.Counter(op for _, op, _ in result.outside_nodes)
    assert found == expected, result.why_outside()
    assert result.delegated_subgraphs == SUBGRAPHS_PER_LAYER * layers + SUBGRAPHS_ONCE, str(result)
    reasons = {op: {r for _, o, r in result.outside_nodes if o == op} for op in found}
    assert all("dynamic size" in r for r in reasons["aten.view_copy.default"]), reasons["aten.view_copy.default"]
    assert all("dynamic size" in r or "SymInt" in r for r in reasons["aten.slice_copy.Tensor"]), reasons


def _median_token_sqnr(path, converted, x) -> float:
    """The median over tokens of the .pte's logits' SQNR against ours."""
    with torch.no_grad():
        ours = converted(x)
    (theirs,) = run_pte(path, (x,))
    return float(torch.tensor([sqnr_db(a, b) for a, b in zip(ours.flatten(0, 1), theirs.flatten(0, 1))]).median())


def _off_scale(stem, t):
    return t * 1.25 if stem == "scale" else t


def _swapped_groups(stem, t):
    # Each row's two groups exchange scales: the codes of group 0 read group 1's scale.
    return t.flip(1) if stem == "scale" else t


def _off_zero_point(stem, t):
    # Codes one step off: as if stored against a zero point one away from the dequantize's.
    return (t + 1).clamp(-8, 7) if stem == "weight" else t


def _unchanged(stem, t):
    return t


@pytest.mark.parametrize("mutate", [_unchanged, _off_scale, _swapped_groups, _off_zero_point])
def test_a_wrong_scale_group_or_zero_point_fails_the_bound(mutate, tmp_path, monkeypatch):
    converted = _converted("w4a8-dyn", layers=1)
    x = _tokens(2, 9, seed=3)
    # The lowering writes each weight's codes, scales and zero points through _Emitter.constant.
    constant = qdq._Emitter.constant
    monkeypatch.setattr(qdq._Emitter, "constant", lambda self, t, stem: constant(self, mutate(stem, t), stem))
    path = to_executorch(converted, x, tmp_path / "m.pte").path
    check = check_lowered(path, converted, x)
    if mutate is _unchanged:
        assert check.ok, str(check)
        assert _median_token_sqnr(path, converted, x) >= EXACT_TOKEN_DB
    else:
        assert not check.ok and check.outputs[0].sqnr_db < MIN_FLOAT_SQNR_DB, str(check)
        assert _median_token_sqnr(path, converted, x) < EXACT_TOKEN_DB


def test_fp32_group_scales_which_the_pte_rounds_fail_the_per_token_bound(tmp_path):
    # The generic target's w4a8-dyn keeps fp32 group scales; XNNPACK stores them in bfloat16.
    converted = _converted("w4a8-dyn", layers=1, target="generic")
    x = _tokens(2, 9, seed=3)
    path = to_executorch(converted, x, tmp_path / "m.pte").path
    assert check_lowered(path, converted, x).ok  # within the 30 dB of any correct lowering
    assert _median_token_sqnr(path, converted, x) < 60
