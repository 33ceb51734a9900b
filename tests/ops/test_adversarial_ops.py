"""The ops under hostile use: forward-mode AD and torch.func,
empty tensors, absurd block sizes, qparams that require grad, bad arguments
under torch.compile, and unpack_mask's shape. Expected values come from ATen,
pt2e_fq.reference or hand computation, never from the op under test."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from pt2e_fq import ops, reference
from pt2e_fq.ops import _qparam_grad

G = torch.Generator().manual_seed(0)
X = torch.randn(4, 8, generator=G) * 0.6  # about a third of it clamps at scale 0.05, [-8, 7]
SCALE = torch.tensor(0.05)
ZP = torch.tensor(0, dtype=torch.int32)
T = torch.randn(4, 8, generator=G)  # a tangent / cotangent


def fq(x):
    return ops.fake_quantize_affine(x, [4, 8], SCALE, ZP, -8, 7)


def ref_mask():
    _, mask = reference.fake_quantize_affine(X, [4, 8], SCALE, ZP, -8, 7)
    assert mask.any() and not mask.all()
    return mask


def ste(t):
    return torch.where(ref_mask(), t, torch.zeros_like(t))


# --- item 1: forward-mode AD gives the straight-through tangent, never zeros


def test_forward_ad_tangent_is_the_straight_through_one():
    with fwAD.dual_level():
        y = fq(fwAD.make_dual(X, T))
        y_primal, y_tangent = fwAD.unpack_dual(y)
    assert torch.equal(y_primal, reference.fake_quantize_affine(X, [4, 8], SCALE, ZP, -8, 7)[0])
    assert torch.equal(y_tangent, ste(T))


def test_func_jvp_and_jacfwd_match_jacrev_and_the_mask():
    _, tangent = torch.func.jvp(fq, (X,), (T,))
    assert torch.equal(tangent, ste(T))
    expected = torch.diag(ref_mask().flatten().float())
    assert torch.equal(torch.func.jacfwd(fq)(X).reshape(32, 32), expected)
    assert torch.equal(torch.func.jacrev(fq)(X).reshape(32, 32), expected)


@pytest.mark.parametrize("kind", ["float", "mx", "nvfp4"])
def test_forward_ad_of_the_float_formats(kind):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)) * 100
    t = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    if kind == "float":
        fn = lambda v: ops.fake_quantize_float(v, [4, 64], torch.tensor(0.05), torch.float8_e4m3fn)  # noqa: E731
        _, mask = reference.fake_quantize_float(x, [4, 64], torch.tensor(0.05), torch.float8_e4m3fn)
    elif kind == "mx":
        fn = lambda v: ops.fake_quantize_mx(v, torch.float4_e2m1fn_x2)  # noqa: E731
        _, mask, _ = reference.fake_quantize_mx(x, torch.float4_e2m1fn_x2)
    else:
        fn = ops.fake_quantize_nvfp4
        _, mask, _, _ = reference.fake_quantize_nvfp4(x)
    assert not mask.all()
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(fn(fwAD.make_dual(x, t))).tangent
    assert torch.equal(tangent, torch.where(mask, t, torch.zeros_like(t)))


def test_nested_derivatives_are_the_straight_through_ones():
    # d/dx of loss = sum(fq(x)^2) is 2 * fq(x) * mask; its derivative again
    # is 2 * mask on the diagonal: by autograd.grad with create_graph and by
    # every nesting of torch.func transforms (the op's Autograd kernel runs
    # at every level, as ATen's do).
    loss = lambda v: fq(v).square().sum()  # noqa: E731
    twice_mask = 2 * ref_mask().float()
    x = X.clone().requires_grad_()
    (g,) = torch.autograd.grad(loss(x), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    assert torch.equal(gg, twice_mask)
    assert torch.equal(torch.func.grad(lambda v: torch.func.grad(loss)(v).sum())(X), twice_mask)
    hessian = torch.diag(twice_mask.flatten())
    assert torch.equal(torch.func.hessian(loss)(X).reshape(32, 32), hessian)
    assert torch.equal(torch.func.jacfwd(torch.func.jacrev(loss))(X).reshape(32, 32), hessian)


# --- item 18: torch.func.grad / vjp work; qparams that require grad warn


def test_func_grad_and_vmap_of_grad():
    loss = lambda v: (fq(v) * T).sum()  # noqa: E731
    assert torch.equal(torch.func.grad(loss)(X), ste(T))
    batched = torch.func.vmap(torch.func.grad(lambda v: fq(v).sum()))(X[None].expand(3, 4, 8))
    assert torch.equal(batched, ref_mask().float()[None].expand(3, 4, 8))


def test_a_qparam_that_requires_grad_warns_once_at_the_callers_line(monkeypatch):
    monkeypatch.setattr(_qparam_grad, "_warned_qparam_grad", False)
    scale = SCALE.clone().requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ops.fake_quantize_affine(X, [4, 8], scale, ZP, -8, 7)
        torch.ops.pt2e_fq.fake_quantize_affine(X, [4, 8], scale, ZP, -8, 7, None)
        with torch.no_grad():
            ops.fake_quantize_affine(X, [4, 8], scale, ZP, -8, 7)
    assert len(caught) == 1
    (w,) = caught
    assert "pt2e_fq.fake_quantize_affine: scale has requires_grad=True but gets no gradient" in str(w.message)
    assert "\n" not in str(w.message)
    assert w.filename == __file__


def test_bad_argument_under_compile_fullgraph_gives_the_ops_message():
    bad_scale = torch.full((3,), 0.05)
    with pytest.raises(ValueError) as eager:
        fq_bad = ops.fake_quantize_affine(X, [4, 8], bad_scale, ZP, -8, 7)  # noqa: F841
    compiled = torch.compile(lambda x: ops.fake_quantize_affine(x, [4, 8], bad_scale, ZP, -8, 7), fullgraph=True)
    with pytest.raises(Exception) as traced:
        compiled(X)
    text = str(traced.value)
    assert str(eager.value) in text
    assert "Observed exception" not in text


# --- item 9: unpack_mask takes x's real shape only


@pytest.mark.parametrize(
    "shape,exc,text",
    [
        ((-1, 64), ValueError, "shape[0] must be >= 0"),
        ((4, 65), ValueError, "too few for shape (4, 65)"),
        ((4.0, 8), TypeError, "shape[0] must be an int"),
        (32, TypeError, "shape must be a sequence of ints"),
    ],
)
def test_unpack_mask_rejects_a_shape_that_is_not_x_shape(shape, exc, text):
    packed = reference.pack_mask(torch.ones(4, 64, dtype=torch.bool))
    with pytest.raises(exc) as info:
        ops.unpack_mask(packed, shape)
    assert text in str(info.value) and "pt2e_fq.unpack_mask" in str(info.value)


def test_unpack_mask_round_trips_the_reference_packing():
    mask = torch.rand(3, 7, generator=G) < 0.5
    assert torch.equal(ops.unpack_mask(reference.pack_mask(mask), (3, 7)), mask)


# --- item 13: empty in, empty out; per-tensor `block_size = x.shape` on an empty x


@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 3), (0,)])
def test_empty_x_with_the_per_tensor_recipe(shape):
    x = torch.randn(shape).requires_grad_()
    y = ops.fake_quantize_affine(x, x.shape, SCALE, ZP, -128, 127)
    assert y.shape == x.shape and y.dtype == x.dtype
    y.sum().backward()
    assert x.grad.shape == x.shape
    y = ops.fake_quantize_float(x.detach(), x.shape, SCALE, torch.float8_e4m3fn)
    assert y.shape == x.shape


def test_empty_x_per_channel_keeps_the_channel_scales():
    x = torch.randn(0, 16)
    block = [x.shape[0], 1]  # per-channel on axis 1: the whole (empty) axis 0
    y, packed = ops.fake_quantize_affine_with_mask(x, block, torch.full((16,), 0.1), None, -8, 7)
    assert y.shape == (0, 16) and packed.numel() == 0


def test_the_raw_op_takes_the_same_empty_recipe():
    x = torch.randn(0, 16)
    y, packed = torch.ops.pt2e_fq.fake_quantize_affine(x, [0, 16], SCALE, ZP, -8, 7, None)
    assert y.shape == (0, 16) and packed.numel() == 0


@pytest.mark.parametrize("block", [[0, 16], [1, 0]])
def test_block_size_zero_only_on_an_empty_dimension(block):
    with pytest.raises(ValueError, match=r"block_size\[\d\] must be >= 1 \(or 0 on a dimension of size 0\)"):
        ops.fake_quantize_affine(torch.randn(2, 16), block, SCALE, ZP, -8, 7)


def test_block_reductions_of_an_empty_x_are_the_reductions_identity():
    # What an observer would compute on an empty batch with the per-tensor
    # recipe: one block, no element, so amax is -inf and amin +inf (the
    # identities of the reductions).
    from pt2e_fq.ops.blocks import reduce_blocks

    x = torch.randn(0, 4)
    assert torch.equal(reduce_blocks(x, x.shape, torch.amax, float("-inf")), torch.full((1, 1), float("-inf")))
    assert torch.equal(reduce_blocks(x, [1, 1], torch.amin, float("inf")), torch.empty(0, 4))


def test_empty_x_through_the_block_scaled_formats():
    x = torch.randn(0, 64)
    y, scales = ops.fake_quantize_mx_with_scales(x, torch.float8_e4m3fn)
    assert y.shape == (0, 64) and scales.shape == (0, 2)
    y, block_scales, _ = ops.fake_quantize_nvfp4_with_scales(x, torch.tensor(1.0))
    assert y.shape == (0, 64) and block_scales.shape == (0, 4)


def test_the_ops_on_an_empty_batch_under_compile_and_export():
    class M(torch.nn.Module):
        def forward(self, x):
            return ops.fake_quantize_affine(x, [x.shape[0], 16], SCALE, ZP, -8, 7)

    x = torch.randn(0, 16)
    assert torch.compile(M(), fullgraph=True)(x).shape == (0, 16)
    assert torch.export.export(M(), (x,)).module()(x).shape == (0, 16)


# --- item 15: the MX block is clamped to the axis; absurd sizes are refused


@pytest.mark.parametrize("block_size", [2**30, 2**40, 2**63 - 1])
def test_a_block_longer_than_the_axis_is_one_block_of_the_axis(block_size):
    x = torch.randn(2, 256, generator=G) * 10
    y, scales = ops.fake_quantize_mx_with_scales(x, torch.float8_e4m3fn, block_size)
    ref_y, _, ref_scales = reference.fake_quantize_mx(x, torch.float8_e4m3fn, 256)
    assert torch.equal(y, ref_y) and torch.equal(scales, ref_scales)
    y, _, scales = torch.ops.pt2e_fq.fake_quantize_mx(x, "e4m3", block_size, -1)
    assert torch.equal(y, ref_y) and torch.equal(scales, ref_scales)


def test_an_mx_block_beyond_int64_names_the_argument():
    with pytest.raises(ValueError, match=r"pt2e_fq.fake_quantize_mx: block_size must be at most 2\*\*63 - 1, got 9223372036854775808"):
        ops.fake_quantize_mx(torch.randn(4, 32), torch.float8_e4m3fn, 2**63)



def test_a_converted_model_on_an_empty_batch_gives_what_the_float_model_gives():
    # The whole item 13 path: static per-tensor / per-channel and dynamic
    # per-token points, their FakeQuantize modules and the ops, at batch 0.
    import pt2e_fq as q
    from tests.models.quantized import batch, ptq
    from tests.models.simple_quantizer import ConvLinear

    empty = batch(0, (0, 3, 6, 6))
    float_out = ConvLinear().eval()(empty)
    for act, weight in [
        (q.QSpec(q.INT8, scheme="asymmetric"), q.QSpec(q.INT8, q.PerChannel(0), "symmetric_narrow")),
        (q.QSpec(q.INT8, q.PerToken(), "asymmetric", dynamic=True), q.QSpec(q.INT4, q.PerGroup(16), "asymmetric", "minval")),
    ]:
        out = ptq(act, weight, dynamic_shapes=({0: torch.export.Dim("batch")},))(empty)
        assert out.shape == float_out.shape and out.dtype == float_out.dtype
