"""Learnable ranges (LSQ / LSQ+): pt2e_fq.fake_quantize_affine_learnable.

The forward is checked against the static op bit for bit; the gradients
against the float64 autograd reference of the papers' formulas
(reference.fake_quantize_affine_learnable_grads), and against torch's own
learnable fake-quant ops where the formulas coincide.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from tests.conftest import affine_cases, assert_bits_equal, make_case, requires_cuda_kernels
from pt2e_fq import ops, reference
from pt2e_fq.ops.blocks import reduce_blocks, reduced_shape

LEARNABLE = torch.ops.pt2e_fq.fake_quantize_affine_learnable.default
BACKWARD = torch.ops.pt2e_fq.fake_quantize_affine_learnable_backward.default

# (id, shape, block_size): every granularity, ragged blocks included.
GRANULARITIES = [
    ("per_tensor", (6, 70), (6, 70)),
    ("per_channel_0", (6, 70), (1, 70)),
    ("per_channel_1", (6, 70), (6, 1)),
    ("per_group_32", (6, 64), (1, 32)),
    ("per_group_ragged", (5, 70), (1, 32)),
    ("per_block_2d_ragged", (9, 70), (4, 16)),
    ("per_block_small", (4, 3, 10), (2, 3, 4)),
]
# zero point: integer (LSQ, scale only), float (LSQ+ through the zero
# point), minval (LSQ+ through the MINVAL offset), none.
OFFSETS = ("int_zp", "float_zp", "minval", "none")


def _case(shape, block, dtype, offset, qrange=(-8, 7), seed=0):
    c = make_case(shape, block, dtype, qrange, zp={"minval": "minval", "none": "none"}.get(offset, "random"),
                  seed=seed)
    zero_point = c.zero_point
    if offset == "float_zp":  # off the integers, so rounding matters
        zero_point = c.zero_point.float() + torch.rand(c.zero_point.shape, generator=torch.Generator().manual_seed(seed)) - 0.5
    return c.x, c.scale, zero_point, c.minval, c.quant_min, c.quant_max


def _sum_bound(dy, block, qmin, qmax, grad_factor):
    """A bound on the fp32 rounding of a block's sums: 1e-4 of the sum of
    the terms' magnitudes (each at most |dy| * (qmax - qmin + 1)), times
    the block's grad_factor (None: LSQ's per block)."""
    total = reduce_blocks(dy.abs().double(), block, torch.sum, 0.0)
    if grad_factor is None:
        grad_factor = reference.lsq_grad_factors(dy.shape, block, qmax)
    return total * (qmax - qmin + 1) * grad_factor * 1e-4 + 1e-30


def _assert_grads(x, block, scale, zero_point, minval, qmin, qmax, grad_factor, dy):
    dx, dscale, doffset = BACKWARD(dy, x, block, scale, zero_point, qmin, qmax, grad_factor, minval)
    rdx, rds, rdo = reference.fake_quantize_affine_learnable_grads(
        x, block, scale, zero_point, qmin, qmax, grad_factor, dy, minval
    )
    assert_bits_equal(dx, rdx.to(x.dtype))
    bound = _sum_bound(dy, block, qmin, qmax, grad_factor)
    compared = [(dscale, rds.reshape(dscale.shape), "scale")]
    if zero_point is not None or minval is not None:  # else there is no offset to differentiate
        compared.append((doffset, rdo.reshape(doffset.shape), "offset"))
    for got, want, name in compared:
        assert got.dtype == torch.float32
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan), f"d {name}: NaN blocks differ"
        err = (got.double() - want).abs()[~nan]
        assert (err <= bound.reshape(got.shape)[~nan]).all(), f"d {name}: max error {err.max()} over the bound"


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("gid,shape,block", GRANULARITIES, ids=[g[0] for g in GRANULARITIES])
def test_forward_is_the_static_op(gid, shape, block, offset, dtype):
    x, scale, zp, minval, qmin, qmax = _case(shape, block, dtype, offset)
    y = ops.fake_quantize_affine_learnable(x, block, scale, zp, qmin, qmax, minval=minval)
    # A float zero point is used rounded half to even after clamping.
    static_zp = None if zp is None else zp.float().clamp(qmin, qmax).round().to(torch.int32)
    assert_bits_equal(y, ops.fake_quantize_affine(x, block, scale, static_zp, qmin, qmax, minval=minval))


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("gid,shape,block", GRANULARITIES, ids=[g[0] for g in GRANULARITIES])
def test_gradients_match_reference(gid, shape, block, offset, dtype):
    x, scale, zp, minval, qmin, qmax = _case(shape, block, dtype, offset, seed=1)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    _assert_grads(x, list(block), scale, zp, minval, qmin, qmax, 0.37, dy)


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("gid,shape,block", GRANULARITIES, ids=[g[0] for g in GRANULARITIES])
def test_default_grad_factor_is_lsq_per_block(gid, shape, block, offset, dtype):
    # grad_factor None: 1 / sqrt(n * quant_max) with n each block's own
    # element count, so a ragged last block (per_group_ragged: 32, 32, 6
    # along the row) gets a larger factor than the full ones.
    x, scale, zp, minval, qmin, qmax = _case(shape, block, dtype, offset, seed=1)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    _assert_grads(x, list(block), scale, zp, minval, qmin, qmax, None, dy)


def test_a_ragged_block_gets_its_own_default_grad_factor():
    # Hand-computed: one row of 40, blocks of 32 and a ragged 8, int4
    # (quant_max 7), every element inside the range at v = 0.125 / 0.5 =
    # 0.25 (rounds to 0): d scale = gf * n * (0 - 0.25), gf = 1 / sqrt(n * 7).
    x = torch.full((1, 40), 0.125)
    _, dscale, _ = BACKWARD(torch.ones_like(x), x, [1, 32], torch.full((1, 2), 0.5), None, -8, 7, None, None)
    want = torch.tensor([[32 * -0.25 / (32 * 7) ** 0.5, 8 * -0.25 / (8 * 7) ** 0.5]])
    torch.testing.assert_close(dscale, want, rtol=1e-6, atol=0)


@settings(max_examples=60, deadline=None)
@given(affine_cases(max_numel=6000))
def test_gradients_match_reference_on_random_cases(c):
    dy = torch.randn(c.x.shape, generator=torch.Generator().manual_seed(c.x.numel())).to(c.x.dtype)
    _assert_grads(c.x, c.block_size, c.scale, c.zero_point, c.minval, c.quant_min, c.quant_max, 0.05, dy)
    if c.quant_max >= 1:  # LSQ's default per block, ragged blocks included
        _assert_grads(c.x, c.block_size, c.scale, c.zero_point, c.minval, c.quant_min, c.quant_max, None, dy)


@pytest.mark.parametrize("offset", ("int_zp", "float_zp", "minval"))
def test_autograd_gives_each_qparam_its_gradient(offset, dtype):
    shape, block = (6, 70), [1, 32]
    x, scale, zp, minval, qmin, qmax = _case(shape, block, dtype, offset, seed=3)
    scale = scale.reshape(-1, 3).requires_grad_()  # size-1 dimensions left out: (6, 3) for (6, 3)
    off = minval if minval is not None else zp
    if off.dtype.is_floating_point:
        off.requires_grad_()
    x = x.clone().requires_grad_()
    y = ops.fake_quantize_affine_learnable(x, block, scale, zp, qmin, qmax, minval=minval)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    y.backward(dy)
    rdx, rds, rdo = reference.fake_quantize_affine_learnable_grads(  # the default grad_factor: LSQ's per block
        x.detach(), block, scale.detach(), None if zp is None else zp.detach(), qmin, qmax, None, dy,
        None if minval is None else minval.detach())
    assert_bits_equal(x.grad, rdx.to(dtype))
    assert scale.grad.shape == scale.shape and scale.grad.dtype == scale.dtype
    torch.testing.assert_close(scale.grad.double(), rds, rtol=1e-4, atol=1e-5)
    if off.dtype.is_floating_point:
        torch.testing.assert_close(off.grad.double(), rdo, rtol=1e-4, atol=1e-5)
    else:
        assert off.grad is None


def test_deterministic_across_thread_counts():
    # 300k elements: several reduction groups per block.
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 75_000, generator=g) * 3
    dy = torch.randn(x.shape, generator=g)
    results = {}
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for block in ([4, 75_000], [1, 75_000], [4, 32]):
                scale = torch.full(reduced_shape(x.shape, block), 0.3)
                runs = [BACKWARD(dy, x, block, scale, None, -8, 7, 0.01, None) for _ in range(2)]
                results.setdefault(tuple(block), []).extend(runs)
    finally:
        torch.set_num_threads(before)
    for block, runs in results.items():
        for r in runs[1:]:
            for a, b in zip(runs[0], r):
                assert_bits_equal(a, b)


def test_nonfinite_x():
    x = torch.tensor([[0.1, float("nan"), 0.3], [float("inf"), -float("inf"), 0.2]])
    scale = torch.tensor([[0.1], [0.1]])
    dy = torch.ones_like(x)
    dx, ds, do = BACKWARD(dy, x, [1, 3], scale, None, -8, 7, 1.0, None)
    assert torch.equal(dx, torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]]))
    # NaN and +-Inf contribute nothing (the observers ignore them too): what
    # is left is round(v) - v of 0.1, 0.3 and 0.2 (v = 1, 3, 2 up to fp32
    # rounding), and nothing outside the range.
    assert ds[0, 0] == pytest.approx(0.0, abs=1e-6)
    assert ds[1, 0] == pytest.approx(0.0, abs=1e-6)
    assert torch.equal(do, torch.zeros_like(do))


@pytest.mark.parametrize("bad,match", [
    (dict(grad_factor=0.0), "grad_factor must be finite and > 0"),
    (dict(grad_factor=float("inf")), "grad_factor must be finite and > 0"),
    (dict(zero_point=torch.zeros(2, 1, dtype=torch.bool)), "zero_point must have an integer or floating dtype"),
])
def test_errors_name_the_argument(bad, match):
    args = dict(x=torch.randn(2, 4), block_size=[1, 4], scale=torch.ones(2, 1), zero_point=None, quant_min=-8,
                quant_max=7, grad_factor=0.5)
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        ops.fake_quantize_affine_learnable(**args)
    with pytest.raises((ValueError, TypeError), match=match):  # the kernel says the same to a direct call
        LEARNABLE(*args.values())


def test_backward_checks_grad():
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="grad must have x's shape"):
        BACKWARD(torch.randn(2, 3), x, [1, 4], torch.ones(2, 1), None, -8, 7, 0.5, None)
    with pytest.raises(TypeError, match="grad must have x's dtype"):
        BACKWARD(torch.randn(2, 4).half(), x, [1, 4], torch.ones(2, 1), None, -8, 7, 0.5, None)


def test_default_grad_factor_needs_positive_levels():
    with pytest.raises(ValueError, match="default grad_factor.*needs quant_max >= 1"):
        ops.fake_quantize_affine_learnable(torch.randn(4), [4], torch.ones(1), None, -8, 0)
    with pytest.raises(ValueError, match="default grad_factor.*needs quant_max >= 1"):  # the kernel's own check
        LEARNABLE(torch.randn(4), [4], torch.ones(1), None, -8, 0, None)


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("gid,shape,block", GRANULARITIES[:5], ids=[g[0] for g in GRANULARITIES[:5]])
def test_opcheck(gid, shape, block, offset):
    x, scale, zp, minval, qmin, qmax = _case(shape, block, torch.float32, offset, seed=6)
    x.requires_grad_()
    scale.requires_grad_()
    torch.library.opcheck(LEARNABLE, (x, list(block), scale, zp, qmin, qmax, 0.25, minval))
    dy = torch.randn(shape)
    torch.library.opcheck(BACKWARD, (dy, x.detach(), list(block), scale.detach(), zp, qmin, qmax, 0.25, minval))


def test_saves_x_by_reference_and_no_full_size_tensor():
    x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    scale = torch.full((64, 1), 0.05, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ops.fake_quantize_affine_learnable(x, [1, 256], scale, None, -8, 7)
    full = [t for t in saved if t.numel() == x.numel()]
    assert len(full) == 1 and full[0].data_ptr() == x.data_ptr() and full[0].dtype == torch.bfloat16
    assert sum(t.numel() for t in saved if t.numel() != x.numel()) == 64  # the scale


class _Point(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((8, 1), 0.1))
        self.minval = torch.nn.Parameter(torch.full((8, 1), -0.8))

    def forward(self, x):
        return ops.fake_quantize_affine_learnable(x, [1, x.shape[1]], self.scale, None, 0, 15, 0.01,
                                                  minval=self.minval)


def test_torch_compile_fullgraph_forward_and_backward():
    eager, compiled = _Point(), _Point()
    fn = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    x = torch.randn(8, 40)
    eager(x).square().sum().backward()
    fn(x).square().sum().backward()
    assert torch.equal(eager.scale.grad, compiled.scale.grad)
    assert torch.equal(eager.minval.grad, compiled.minval.grad)


def test_torch_export_is_one_node():
    ep = torch.export.export(_Point(), (torch.randn(8, 40),))
    calls = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert calls == [LEARNABLE]
    x = torch.randn(8, 40)
    assert torch.equal(ep.module()(x), _Point()(x))


# ---------------------------------------------------------------------------
# Against torch's learnable fake-quant ops. Where the formulas coincide
# (integer-valued zero point, the same grad_factor, no exact ties, which
# torch decides with x * (1 / scale) and we with x / scale), y and dx are the
# same bits and d scale, d zero point agree to fp32 rounding. Differences
# (the numbers are asserted below): torch's backward rounds the zero point
# as trunc(zp + 0.5) while its forward uses round half to even, so at
# zp = 2.5 its forward uses 2 and its gradients 3; torch's grad_factor is
# the caller's, and its Python module passes 1 / sqrt(numel * quant_max)
# of the whole tensor even per channel; torch's dx is dy * mask, which is
# -0.0 where a negative dy is clamped (about a quarter of the elements in
# the test below) and NaN for a NaN dy, ours a select (+0.0).


def _tie_free(x, scale):
    v = x / scale
    return torch.where((v - v.floor() - 0.5).abs() < 1e-3, x + 0.01 * scale, x)


@pytest.mark.parametrize("granularity", ("per_tensor", "per_channel"))
def test_matches_torch_learnable_ops(granularity):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(16, 200, generator=g) * 2
    dy = torch.randn(x.shape, generator=g)
    if granularity == "per_tensor":
        scale, zp, block = torch.tensor([0.2]), torch.tensor([3.0]), [16, 200]
        x = _tie_free(x, 0.2)
    else:
        scale = torch.rand(16, generator=g) * 0.3 + 0.05
        zp = torch.randint(-4, 4, (16,), generator=g).float()
        block = [1, 200]
        x = _tie_free(x, scale[:, None])
    t_args = [t.clone().requires_grad_() for t in (x, scale, zp)]
    o_args = [t.clone().requires_grad_() for t in (x, scale, zp)]
    if granularity == "per_tensor":
        yt = torch._fake_quantize_learnable_per_tensor_affine(*t_args, -8, 7, 0.5)
    else:
        yt = torch._fake_quantize_learnable_per_channel_affine(*t_args, 0, -8, 7, 0.5)
    yo = ops.fake_quantize_affine_learnable(o_args[0], block, o_args[1], o_args[2], -8, 7, 0.5)
    yt.backward(dy)
    yo.backward(dy)
    assert_bits_equal(yo, yt.detach())
    # Equal, but not the same bits: torch multiplies dy by the mask (-0.0
    # where dy < 0 is clamped), we select (+0.0, and 0 for a NaN dy).
    assert torch.equal(o_args[0].grad, t_args[0].grad)
    clamped = o_args[0].grad == 0
    assert torch.equal(t_args[0].grad[clamped].signbit(), dy[clamped].signbit())
    for ours, theirs in zip(o_args[1:], t_args[1:]):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-4)


def test_torch_learnable_rounds_the_zero_point_differently_in_backward():
    x = torch.linspace(-3, 3, 64)
    dy = torch.ones_like(x)
    t_args = [x.clone().requires_grad_(), torch.tensor([0.2], requires_grad=True),
              torch.tensor([2.5], requires_grad=True)]
    yt = torch._fake_quantize_learnable_per_tensor_affine(*t_args, -8, 7, 1.0)
    yt.backward(dy)
    # Both forwards use zp = 2 (half to even).
    assert torch.equal(yt.detach(), ops.fake_quantize_affine(x, [64], torch.tensor(0.2), torch.tensor(2), -8, 7))
    ours = [BACKWARD(dy, x, [64], torch.tensor([0.2]), torch.tensor([zp]), -8, 7, 1.0, None) for zp in (2.0, 3.0)]
    # torch's d scale is the one of zp = 3, not of the zp = 2 its forward used.
    assert float(t_args[1].grad) == pytest.approx(float(ours[1][1]), rel=1e-5)
    assert float(t_args[1].grad) != pytest.approx(float(ours[0][1]), rel=1e-2)
    # And its dx uses the mask of zp = 3: elements whose mask differs get the other gradient.
    assert not torch.equal(t_args[0].grad, ours[0][0])


# ---------------------------------------------------------------------------
# QSpec(learnable=True) through prepare_qat_pt2e, training, compile, convert.

import copy  # noqa: E402

import torchao.quantization.pt2e as tao  # noqa: E402
from tests.models.simple_quantizer import ConvLinear, LinearConvQuantizer  # noqa: E402
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_qat_pt2e  # noqa: E402

import pt2e_fq as q  # noqa: E402
from pt2e_fq.fake_quantize import FakeQuantize  # noqa: E402


def _specs(learnable):
    return (q.QSpec(q.INT8, scheme="asymmetric", learnable=learnable),
            q.QSpec(q.INT4, q.PerChannel(0), "symmetric", learnable=learnable))


def _batch(seed):
    return torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(seed))


def _prepared(learnable):
    torch.manual_seed(0)
    gm = torch.export.export(ConvLinear().train(), (_batch(0),)).module()
    gm = prepare_qat_pt2e(gm, LinearConvQuantizer(*_specs(learnable)))
    for s in range(2):  # the observers initialise the ranges
        gm(_batch(s))
    gm.apply(tao.disable_observer)
    return gm


def _train(gm, steps=3):
    opt = torch.optim.SGD(gm.parameters(), lr=0.01)
    for s in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(gm(_batch(10 + s)), torch.arange(4) % 4).backward()
        opt.step()


def test_learnable_qspec_rules():
    with pytest.raises(ValueError, match="learnable ranges need an integer format"):
        q.QSpec(q.FP8_E4M3, learnable=True)
    with pytest.raises(ValueError, match="learnable needs a static one"):
        q.QSpec(q.INT8, dynamic=True, learnable=True)
    with pytest.raises(ValueError, match="grad_factor applies to learnable ranges only"):
        q.QSpec(q.INT8, grad_factor=0.1)
    with pytest.raises(ValueError, match="grad_factor must be a finite float > 0"):
        q.QSpec(q.INT8, learnable=True, grad_factor=-1.0)


def test_config_dict_round_trip():
    from quantizers.qspec_dict import qspec_from_dict, qspec_to_dict

    spec = q.QSpec(q.INT4, q.PerChannel(0), learnable=True, grad_factor=0.02)
    assert qspec_to_dict(spec)["learnable"] is True
    assert qspec_from_dict("w", qspec_to_dict(spec)) == spec


def test_learned_qparams_are_named_parameters_that_train():
    gm = _prepared(learnable=True)
    learned = {n: p.detach().clone() for n, p in gm.named_parameters() if n.rsplit(".", 1)[-1] in
               ("scale", "zero_point", "minval")}
    # Per point: the activation's scale and zero point (asymmetric), the weight's scale (symmetric).
    points = {n.rsplit(".", 1)[0] for n in learned}
    assert len(points) >= 3 and all(isinstance(gm.get_submodule(p), FakeQuantize) for p in points)
    assert any(n.endswith(".zero_point") for n in learned) and sum(n.endswith(".scale") for n in learned) == len(points)
    _train(gm)
    changed = [n for n, p in gm.named_parameters() if n in learned and not torch.equal(p, learned[n])]
    assert set(changed) >= {n for n in learned if n.endswith(".scale")}


def test_torch_compile_fullgraph_trains_as_eager():
    eager = _prepared(learnable=True)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    for model in (eager, compiled):
        torch.nn.functional.cross_entropy(model(_batch(20)), torch.arange(4) % 4).backward()
    grads = {n: p.grad for n, p in eager.named_parameters() if n.endswith(".scale")}
    for n, p in compiled_model.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-6, atol=0)


def test_convert_freezes_into_the_static_form():
    learned, static = _prepared(learnable=True), _prepared(learnable=False)
    _train(learned)
    for gm in (learned, static):
        tao.move_exported_model_to_eval(gm)
    learned_c, static_c = convert_pt2e(learned), convert_pt2e(static)
    names = ("scale", "zero_point", "minval")
    assert not [n for n, _ in learned_c.named_parameters() if n.rsplit(".", 1)[-1] in names]
    x = _batch(30)
    programs = [torch.export.export(m, (x,)) for m in (learned_c, static_c)]

    def form(ep):
        nodes = [(n.op, str(n.target)) for n in ep.graph.nodes if n.op == "call_function"]
        buffers = {k: (v.dtype, v.shape) for k, v in ep.state_dict.items()}
        return nodes, buffers

    assert form(programs[0]) == form(programs[1])
    # The frozen point computes the static op on its (learned) buffers.
    point = next(m for m in learned_c.modules() if isinstance(m, FakeQuantize) and "zero_point" in m._buffers)
    assert point.zero_point.dtype == torch.int32


def test_freeze_qat_keeps_learned_ranges_and_convert_floors_the_scale():
    from pt2e_fq.cli import pipeline

    gm = _prepared(learnable=True)
    points = [m for m in gm.modules() if isinstance(m, FakeQuantize)]
    with torch.no_grad():
        for m in points:
            m.scale.fill_(0.5)
        points[0].scale.view(-1)[0] = -1.0  # an optimizer step past zero
    pipeline.freeze_qat(gm, _batch(40))  # observers of learnable points stay off
    assert all(torch.all(m.scale.view(-1)[1:] == 0.5) for m in points)
    converted = pipeline.convert(gm)
    frozen = [m for m in converted.modules() if isinstance(m, FakeQuantize)]
    # Frozen as the op applied it: floored at fp32 eps.
    assert float(frozen[0].scale.view(-1)[0]) == torch.finfo(torch.float32).eps



def test_no_host_sync_in_forward_and_backward():
    # A host sync (.item(), a branch on a value) cannot be traced with fake
    # tensors; the trace holds one node of each op.
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(x, scale, zero_point, dy):
        y = ops.fake_quantize_affine_learnable(x, [1, 32], scale, zero_point, -8, 7)
        return torch.autograd.grad(y, (x, scale, zero_point), dy)

    args = (torch.randn(4, 64, requires_grad=True), torch.full((4, 2), 0.1, requires_grad=True),
            torch.zeros(4, 2, requires_grad=True), torch.randn(4, 64))
    graph = make_fx(step, tracing_mode="fake")(*args).graph
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert targets.count(LEARNABLE) == 1 and targets.count(BACKWARD) == 1


@requires_cuda_kernels
def test_cuda_matches_cpu_and_makes_no_host_sync(dtype):
    x, scale, zp, _, qmin, qmax = _case((64, 96), (1, 32), dtype, "float_zp", seed=8)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(9)).to(dtype)
    cpu = BACKWARD(dy, x, [1, 32], scale, zp, qmin, qmax, 0.1, None)
    xc, sc, zc = (t.cuda().requires_grad_() for t in (x, scale, zp))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = ops.fake_quantize_affine_learnable(xc, [1, 32], sc, zc, qmin, qmax, 0.1)
        y.backward(dy.cuda())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_bits_equal(y.cpu(), ops.fake_quantize_affine_learnable(x, [1, 32], scale, zp, qmin, qmax, 0.1))
    assert_bits_equal(xc.grad.cpu(), cpu[0])
    bound = _sum_bound(dy, [1, 32], qmin, qmax, 0.1)
    assert ((sc.grad.cpu().double() - cpu[1].double()).abs() <= bound).all()
    assert ((zc.grad.cpu().double() - cpu[2].double()).abs() <= bound).all()


def test_report_reads_a_prepared_model_with_learned_ranges():
    import io

    gm = _prepared(learnable=True)
    rows = q.report(gm, (_batch(1),), file=io.StringIO()).rows
    static_rows = q.report(_prepared(learnable=False), (_batch(1),), file=io.StringIO()).rows
    # Before any training the learned qparams are the observed ones: the same rows.
    assert rows == static_rows and all(r["clipped"] is not None for r in rows)


def test_forward_mode_ad_is_refused_not_dropped():
    # Reverse mode only: a tangent through the learnable op is an error, never a silent zero.
    from torch.autograd import forward_ad

    x = torch.randn(4, 8)
    with forward_ad.dual_level(), pytest.raises(NotImplementedError, match="jvp"):
        ops.fake_quantize_affine_learnable(forward_ad.make_dual(x, torch.ones_like(x)), [4, 8], torch.tensor(0.1),
                                           None, -8, 7)


def test_torch_func_grad_and_vmap_of_grad_match_the_reference():
    # The C++ Autograd kernel runs at torch.func's level as ATen's do: the
    # gradients with respect to x and scale are the reference's.
    shape, block = (6, 70), [1, 32]
    x, scale, zp, _, qmin, qmax = _case(shape, block, torch.float32, "random", seed=5)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(6))

    def loss(x, scale):
        return (ops.fake_quantize_affine_learnable(x, block, scale, zp, qmin, qmax) * dy).sum()

    dx, dscale = torch.func.grad(loss, argnums=(0, 1))(x, scale)
    rdx, rds, _ = reference.fake_quantize_affine_learnable_grads(x, block, scale, zp, qmin, qmax, None, dy)
    rdx = rdx.to(x.dtype)
    assert_bits_equal(dx, rdx)
    torch.testing.assert_close(dscale.double(), rds.reshape(dscale.shape), rtol=1e-4, atol=1e-5)
    batched = torch.func.vmap(torch.func.grad(loss), in_dims=(0, None))(torch.stack([x, x]), scale)
    assert_bits_equal(batched, torch.stack([rdx, rdx]))
