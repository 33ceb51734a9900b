"""pt2e_fq.calib.weight_ranges: the per-block range search against a
brute-force search written here with plain torch ops (the integer grid by
hand, NVFP4 by the pure-torch reference), and its guarantee: no block's
importance-weighted error is above min-max's."""

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pt2e_fq import INT4, NVFP4, CurrentMinMaxObserver, FakeQuantize, PerChannel, PerGroup, QSpec, reference
from pt2e_fq.calib import weight_ranges
from pt2e_fq.calib.layers import LINEAR, Layer

ROWS, COLUMNS, GROUP = 6, 64, 32
FACTORS = torch.tensor([1.0, 0.95, 0.9, 0.85, 0.8, 0.7])


def _problem(seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(ROWS, COLUMNS, generator=g) * torch.rand(1, COLUMNS, generator=g)
    w[:, ::7] *= 4  # outliers: clipping them pays
    x = torch.randn(200, COLUMNS, generator=g) * torch.rand(COLUMNS, generator=g) * 3
    return w, x.T @ x / len(x)


def _layer(spec: QSpec, w: torch.Tensor) -> Layer:
    point = FakeQuantize(spec)
    point(w)  # calibrates: min-max per block
    point.enable_observer(False)
    return Layer(SimpleNamespace(target=LINEAR), "w", point, w.shape)


def _int4_grid(w, lo, hi, minval: bool):
    """Hand-written int4 fake-quant of one group for the range [lo, hi]:
    MINVAL [lo, hi] onto [0, 15]; else symmetric no-clip onto [-8, 7]."""
    if minval:
        scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).eps)
        return torch.round((w - lo) / scale).clamp(0, 15) * scale + lo
    scale = torch.maximum(-lo.clamp(max=0) / 8, hi.clamp(min=0) / 7).clamp(min=torch.finfo(torch.float32).eps)
    return torch.round(w / scale).clamp(-8, 7) * scale


def _brute_force(w, h, minval: bool):
    """Per (row, group): the quantized group of least sum(diag(H) * err^2)
    over every pair of end factors (one factor for both ends if symmetric;
    the first best, factors ordered widest first)."""
    d = h.diagonal()
    out = torch.empty_like(w)
    pairs = [(a, b) for a in FACTORS for b in FACTORS] if minval else [(a, a) for a in FACTORS]
    for r in range(ROWS):
        for start in range(0, COLUMNS, GROUP):
            cols = slice(start, start + GROUP)
            group = w[r, cols]
            lo, hi = group.min(), group.max()
            candidates = [_int4_grid(group, lo * a, hi * b, minval) for a, b in pairs]
            errors = torch.stack([(d[cols] * (q - group) ** 2).sum() for q in candidates])
            out[r, cols] = candidates[int(torch.argmin(errors))]
    return out


def _spec(minval: bool) -> QSpec:
    if minval:
        return QSpec(INT4, PerGroup(GROUP, 1), "asymmetric", "minval", observer=CurrentMinMaxObserver())
    return QSpec(INT4, PerGroup(GROUP, 1), "symmetric_no_clip", observer=CurrentMinMaxObserver())


def _weighted_block_errors(q, w, h):
    return (h.diagonal() * (q - w) ** 2).reshape(ROWS, COLUMNS // GROUP, GROUP).sum(-1)


def test_integer_search_matches_a_brute_force_search():
    for minval in (False, True):
        w, h = _problem(0)
        layer = _layer(_spec(minval), w)
        assert weight_ranges.search(layer, w, h.diagonal()[None], FACTORS) is None
        got = layer.point(w)  # the point's stored qparams are the chosen ones
        want = _brute_force(w, h, minval)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), minval=st.booleans())
def test_no_block_gets_worse_than_min_max(seed, minval):
    w, h = _problem(seed)
    layer = _layer(_spec(minval), w)
    min_max = layer.point(w)
    weight_ranges.search(layer, w, h.diagonal()[None], FACTORS)
    searched = layer.point(w)
    assert (_weighted_block_errors(searched, w, h) <= _weighted_block_errors(min_max, w, h) * (1 + 1e-6)).all()


def test_the_search_lowers_the_layer_output_error():
    """On the whole layer's output error (H-weighted, cross terms included),
    which the search does not compute itself."""
    w, h = _problem(1)
    for minval in (False, True):
        layer = _layer(_spec(minval), w)
        output_error = lambda q: torch.einsum("ri,ij,rj->", q - w, h, q - w).item()  # noqa: E731
        before = output_error(layer.point(w))
        weight_ranges.search(layer, w, h.diagonal()[None])
        assert output_error(layer.point(w)) < 0.95 * before


def test_per_channel_search_covers_the_whole_row():
    w, h = _problem(2)
    spec = QSpec(INT4, PerChannel(0), "symmetric_no_clip", observer=CurrentMinMaxObserver())
    layer = _layer(spec, w)
    min_max = layer.point(w)
    weight_ranges.search(layer, w, h.diagonal()[None], FACTORS)
    searched = layer.point(w)
    d = h.diagonal()
    assert ((d * (searched - w) ** 2).sum(1) <= (d * (min_max - w) ** 2).sum(1) * (1 + 1e-6)).all()
    assert layer.point.scale.shape == (ROWS, 1)


def test_nvfp4_bound_matches_a_brute_force_search_with_the_reference_op():
    w, h = _problem(3)
    spec = QSpec(NVFP4, PerGroup(16, 1), observer=CurrentMinMaxObserver())
    layer = _layer(spec, w)
    bound = weight_ranges.search(layer, w, h.diagonal()[None], FACTORS)
    g, d = layer.point.global_scale, h.diagonal()
    want = torch.empty_like(w)
    for r in range(ROWS):
        for start in range(0, COLUMNS, 16):
            cols = slice(start, start + 16)
            block, amax = w[r:r + 1, cols], w[r, cols].abs().max()
            candidates = [reference.fake_quantize_nvfp4(block.clamp(-amax * f, amax * f), g)[0] for f in FACTORS]
            errors = torch.stack([(d[cols] * (q - block) ** 2).sum() for q in candidates])
            want[r, cols] = amax * FACTORS[int(torch.argmin(errors))]
    torch.testing.assert_close(bound, want, atol=0, rtol=1e-6)
    assert (bound < w.abs().reshape(ROWS, -1, 16).amax(-1).repeat_interleave(16, 1)).any()  # some blocks clipped
