"""pt2e_fq.calib.equalization: activation-weight equalisation on small prepared
models. The float function stays the same (the prepared model with its
fake-quant points off, before and after); an input channel whose outlier
range costs a per-tensor int8 grid its resolution is moved into the weight,
which raises the quantized model's output SQNR by what the outlier costs;
the folds happen only where the producing op absorbs the scale exactly;
the user's model keeps its parameters."""

import copy

import pytest
import torch
from torch import nn

from pt2e_fq import FakeQuantize, calib
from pt2e_fq.calib import equalization as eq
from pt2e_fq.cli import pipeline


class _Attention(nn.Module):
    """Pre-LN self-attention without the residual: LayerNorm -> q, k, v;
    v -> heads -> SDPA -> out projection."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(d)
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        return self.attend(self.norm(x))

    def attend(self, y):
        b, length, d = y.shape
        q, k, v = (p(y).view(b, length, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(a.transpose(1, 2).reshape(b, length, d))


class _PostNorm(_Attention):
    """The same block with BERT's residual after the LayerNorm: its output
    also feeds the add, which no channel scale passes exactly."""

    def forward(self, x):
        y = self.norm(x)
        return self.attend(y) + y


def _attention(seed=0):
    torch.manual_seed(seed)
    model = _Attention().eval()
    with torch.no_grad():  # outlier channels, as trained transformers have them
        model.norm.weight[3] = 25.0
        model.v.weight[5] *= 15.0
    return model


def _batches(seed=1, count=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 12, 32, generator=g) for _ in range(count)]


def _outputs(prepared, x, fake_quant: bool):
    for m in prepared.modules():
        if isinstance(m, FakeQuantize):
            m.enable_fake_quant(fake_quant)
    with torch.no_grad():
        out = prepared(x)
    for m in prepared.modules():
        if isinstance(m, FakeQuantize):
            m.enable_fake_quant(True)
    return out


def _sqnr_db(reference, other):
    return (10 * torch.log10(reference.pow(2).sum() / (reference - other).pow(2).sum())).item()


def _prepared(model, preset, batches):
    prepared = pipeline.prepare(model, batches[0], preset)
    pipeline.calibrate(prepared, batches, progress=False)
    return prepared


class _TiedGain(_Attention):
    """The LayerNorm's scale also read, under a second name, as the gain of
    a residual branch (tied weights)."""

    def __init__(self):
        super().__init__()
        self.gain = self.norm.weight

    def forward(self, x):
        return self.attend(self.norm(x)) + x * self.gain


def test_equalize_leaves_a_tensor_read_through_two_get_attrs():
    """A tensor read through two get_attr nodes (tied weights under two
    names; a rotation's matrix is read so too) is shared, though each node
    has one reader: scaling it for the LayerNorm group would scale the
    residual's gain too. Export reads the tied scale through one get_attr,
    so the graph is given the second one by hand."""
    torch.manual_seed(0)
    model, batches = _TiedGain().eval(), _batches()
    with torch.no_grad():
        model.norm.weight[3] = 25.0
    prepared = _prepared(model, "w8a8", batches)
    shared = next(n for n in prepared.graph.nodes if n.op == "get_attr" and n.target == "norm.weight")
    gain = next(n for n in prepared.graph.nodes if n.op == "get_attr" and n.target == "gain")
    assert prepared.gain is prepared.norm.weight  # one tensor, two names
    (mul,) = [u for u in shared.users if u.target is torch.ops.aten.mul.Tensor]
    mul.replace_input_with(shared, gain)
    prepared.recompile()
    assert list(shared.users) != [] and list(gain.users) == [mul]
    # Only the value -> out projection group: the LayerNorm's scale is not its own.
    assert [g.producer.target for g in eq.find_groups(prepared)] == [torch.ops.aten.linear.default]
    scale = prepared.norm.weight.detach().clone()
    before = _outputs(prepared, batches[0], fake_quant=False)
    calib.equalize(prepared, batches)
    assert torch.equal(prepared.norm.weight, scale) and prepared.gain is prepared.norm.weight
    torch.testing.assert_close(_outputs(prepared, batches[0], fake_quant=False), before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["w8a8", "w4a16", "nvfp4"])
def test_equalize_keeps_the_float_function(preset):
    model, batches = _attention(), _batches()
    prepared = _prepared(model, preset, batches)
    groups = eq.find_groups(prepared)
    # LayerNorm -> q, k, v (one scale for the three) and v -> through the heads and SDPA -> out.
    assert [len(g.consumers) for g in groups] == [3, 1]
    before = _outputs(prepared, batches[0], fake_quant=False)
    results = calib.equalize(prepared, batches)
    assert all(r.scale != "none" for r in results), results
    after = _outputs(prepared, batches[0], fake_quant=False)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_equalize_moves_an_outlier_channel_into_the_weight():
    """One LayerNorm channel 25x the others sets the per-tensor int8 input
    grid of q, k, v: the other channels get about 1/25 of its 256 steps.
    Scaling that channel down by about sqrt(25) on the input and up on
    the weight's column (per-channel int8 grid) gives them about 5x the
    steps back: about 14 dB less input noise, most of the output error."""
    model, batches = _attention(), _batches()
    held_out = _batches(seed=7, count=1)[0]
    reference = model(held_out).detach()
    rtn = _prepared(model, "w8a8", batches)
    equalized = _prepared(model, "w8a8", batches)
    results = calib.equalize(equalized, batches)
    gain = _sqnr_db(reference, _outputs(equalized, held_out, True)) - _sqnr_db(reference, _outputs(rtn, held_out, True))
    assert gain > 8.0, (gain, results)
    # The search's own figure (calibration rows) agrees: the LayerNorm group gains about as much.
    assert results[0].after_db - results[0].before_db > 8.0, results


def test_equalize_compensates_a_norm_that_also_feeds_a_residual():
    """In a post-LN block the LayerNorm's output is also added to the
    attention's output: equalised, the add gets it back through one float
    mul by s; with compensate=False only the value -> out projection group
    is equalised. The float function stays the same either way."""
    torch.manual_seed(0)
    model, batches = _PostNorm().eval(), _batches()
    with torch.no_grad():
        model.norm.weight[3] = 25.0
    prepared = _prepared(model, "w8a8", batches)
    linear = torch.ops.aten.linear.default
    assert [(g.producer.target, len(g.consumers)) for g in eq.find_groups(prepared, compensate=False)] == [(linear, 1)]
    assert [len(g.consumers) for g in eq.find_groups(prepared)] == [3, 1]
    before = _outputs(prepared, batches[0], fake_quant=False)
    results = calib.equalize(prepared, batches)
    assert results[0].scale != "none", results
    muls = [n for n in prepared.graph.nodes if n.target is torch.ops.aten.mul.Tensor]
    assert len(muls) == 1 and [u.target for u in muls[0].users] == [torch.ops.aten.add.Tensor]
    torch.testing.assert_close(_outputs(prepared, batches[0], fake_quant=False), before, rtol=1e-5, atol=1e-5)


def test_apply_equalizes_in_one_call_and_leaves_the_user_model():
    model, batches = _attention(), _batches()
    state = copy.deepcopy(model.state_dict())
    prepared = _prepared(model, "w8a8", batches)
    report = calib.apply(prepared, batches, equalization=True)
    assert report.algorithms == ("equalization", "gptq", "bias_correction")
    assert list(report.stage_seconds) == ["equalization", "statistics", "rounding"]
    assert [r.consumers for r in report.equalized] == [("linear", "linear_1", "linear_2"), ("linear_3",)]
    assert "equalized: producer" in str(report)
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name
    # Every point holds qparams of the scaled tensors: convert runs and the output stays close.
    converted = pipeline.convert(prepared)
    held_out = _batches(seed=7, count=1)[0]
    assert _sqnr_db(model(held_out).detach(), converted(held_out).detach()) > 30


@pytest.mark.parametrize("kwargs, message", [
    (dict(alphas=()), "alphas must be a non-empty sequence of numbers in (0, 1]"),
    (dict(alphas=(0.5, 1.5)), "alphas must be a non-empty sequence of numbers in (0, 1]"),
    (dict(max_rows=0), "max_rows must be an int >= 1, got 0"),
])
def test_equalize_bad_arguments(kwargs, message):
    batches = _batches()
    prepared = _prepared(_attention(), "w8a8", batches)
    with pytest.raises(ValueError) as e:
        calib.equalize(prepared, batches, **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="batches holds no batch"):
        calib.equalize(prepared, [])
    with pytest.raises(TypeError, match="prepared must be the GraphModule of prepare_pt2e, got _Attention"):
        calib.equalize(_attention(), batches)


@pytest.mark.slow
def test_equalization_improves_w4a16_on_minilm():
    """On the trained sentence encoder (post-LN BERT: LayerNorms feed the
    residual adds, compensated) equalisation alone, round-to-nearest int4
    weights, brings the quantized embeddings of held-out sentences closer
    to the float ones. Reduced sizes; bench_trained.py has the full table."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import trained_models as tm

    torch.set_num_threads(1)
    encoder = tm.minilm()
    calibration, held_out = tm.sentence_data(encoder.tokenizer, 16, 16, batch=16)
    reference = tm.outputs(encoder, held_out)
    cosine = {}
    for equalized in (False, True):
        prepared = _prepared(encoder, "w4a16", calibration)
        if equalized:
            results = calib.equalize(prepared, calibration)
            assert len(results) == 18, results  # per layer: LN -> q, k, v; v -> out; LN -> FFN in
        cosine[equalized] = tm.embedding_metrics(reference, tm.outputs(prepared, held_out))["cosine"].value
    assert cosine[True] > cosine[False] + 0.005, cosine
