"""The op as PT2 sees it: opcheck on every variant and device, one node
through torch.export (re-export, run_decompositions, save/load, a dynamic
batch dimension) and no graph break under torch.compile."""

import io

import pytest
import torch

from tests.conftest import DEVICES, FLOAT_DTYPES, assert_bits_equal, make_case, to_device
from pt2e_fq import ops, reference

FQ_OP = torch.ops.pt2e_fq.fake_quantize_affine.default

# (id, shape, block_size, formulation) of each granularity and formulation.
VARIANTS = [
    ("per_tensor", (6, 10), (6, 10), "random"),
    ("per_channel_axis0", (4, 6, 10), (1, 6, 10), "random"),
    ("per_channel_axis1", (4, 6, 10), (4, 1, 10), "random"),
    ("per_channel_axis2", (4, 6, 10), (4, 6, 1), "random"),
    ("per_block_2d", (8, 12), (4, 4), "random"),
    ("ragged_blocks", (7, 45), (3, 16), "random"),
    ("per_group_ragged", (5, 70), (1, 32), "random"),
    ("minval", (6, 40), (1, 8), "minval"),
    ("zero_point_none", (6, 40), (2, 8), "none"),
    ("ragged_blocks_minval", (7, 45), (3, 16), "minval"),
    ("per_tensor_zero_point_none", (6, 10), (6, 10), "none"),
]


def variant_case(variant, dtype):
    _, shape, block_size, zp = variant
    return make_case(shape, block_size, dtype, (-8, 7), zp=zp)


def variant_params():
    return [
        pytest.param(v, d, id=f"{v[0]}-{str(d).removeprefix('torch.')}")
        for v in VARIANTS
        for d in FLOAT_DTYPES
    ]


def op_args(case):
    return (*case.args(), case.minval)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant,dtype", variant_params())
def test_opcheck_fake_quantize_affine(variant, dtype, device):
    case = variant_case(variant, dtype).to(device)
    case.x.requires_grad_()
    torch.library.opcheck(FQ_OP, op_args(case))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_opcheck_ste_grad(dtype, device):
    mask = torch.rand(5, 13) < 0.5
    grad = torch.randn(5, 13).to(dtype)
    torch.library.opcheck(torch.ops.pt2e_fq.ste_grad.default, to_device((grad, reference.pack_mask(mask)), device))


class FakeQuant(torch.nn.Module):
    """fake_quantize_affine with the qparams as buffers, as a FakeQuantize
    module holds them."""

    def __init__(self, case):
        super().__init__()
        self.block_size, self.quant_min, self.quant_max = case.block_size, case.quant_min, case.quant_max
        self.register_buffer("scale", case.scale)
        self.register_buffer("zero_point", case.zero_point)
        self.register_buffer("minval", case.minval)

    def forward(self, x):
        return ops.fake_quantize_affine(
            x, self.block_size, self.scale, self.zero_point, self.quant_min, self.quant_max,
            minval=self.minval,
        )


def fq_nodes(ep):
    return [n for n in ep.graph.nodes if n.op == "call_function" and n.target == FQ_OP]


def roundtrip(ep):
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    return torch.export.load(buf)


@pytest.mark.parametrize("variant,dtype", variant_params())
def test_one_node_through_export(variant, dtype):
    case = variant_case(variant, dtype)
    module = FakeQuant(case)
    expected = reference.fake_quantize_affine(*case.args(), minval=case.minval)[0]
    ep = torch.export.export(module, (case.x,))
    stages = {
        "export": ep,
        "re-export": torch.export.export(ep.module(), (case.x,)),
        "run_decompositions": ep.run_decompositions(),
    }
    stages["save/load"] = roundtrip(stages["run_decompositions"])
    for name, program in stages.items():
        assert len(fq_nodes(program)) == 1, name
        assert_bits_equal(program.module()(case.x), expected)


def test_export_with_dynamic_batch():
    # Per-channel on the last axis with the batch dimension symbolic: the
    # block size of the batch dimension is the (symbolic) batch size.
    class PerChannel(torch.nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.register_buffer("scale", scale)

        def forward(self, x):
            return ops.fake_quantize_affine(x, [x.shape[0], 1], self.scale, None, -128, 127)

    module = PerChannel(torch.rand(1, 16) + 0.01)
    batch = torch.export.Dim("batch", min=1)
    ep = torch.export.export(module, (torch.randn(4, 16),), dynamic_shapes=({0: batch},))
    ep = roundtrip(ep.run_decompositions())
    assert len(fq_nodes(ep)) == 1
    for n in (1, 3, 9):
        x = torch.randn(n, 16) * 10
        expected = reference.fake_quantize_affine(x, [n, 1], module.scale, None, -128, 127)[0]
        assert_bits_equal(ep.module()(x), expected)


def test_compile_dynamic_batch_compiles_once():
    scale = torch.rand(1, 16) + 0.01

    def per_channel(x):
        return ops.fake_quantize_affine(x, [x.shape[0], 1], scale, None, -128, 127)

    torch._dynamo.reset()
    compiled = torch.compile(per_channel, fullgraph=True, dynamic=True, backend="aot_eager")
    for i, n in enumerate((2, 3, 9)):
        x = torch.randn(n, 16) * 10
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            y = compiled(x)
        assert_bits_equal(y, reference.fake_quantize_affine(x, [n, 1], scale, None, -128, 127)[0])


class Surrounded(torch.nn.Module):
    """The op between pointwise ops, so inductor generates (C++) kernels
    around it rather than only a call."""

    def __init__(self, fq):
        super().__init__()
        self.fq = fq

    def forward(self, x):
        return self.fq(x * 2.0).relu() - 1.0


def compile_params():
    # With a cold cache inductor compiles C++ for every graph (measured here:
    # 30 s for the first variant, 7 s for the next), so it sees two variants
    # and aot_eager all four.
    picked = [VARIANTS[0], VARIANTS[2], VARIANTS[5], VARIANTS[7]]
    return [
        pytest.param(v, backend, id=f"{v[0]}-{backend}", marks=[pytest.mark.slow] if backend == "inductor" else [])
        for v in picked
        for backend in (["aot_eager", "inductor"] if v in picked[::2] else ["aot_eager"])
    ]


@pytest.mark.parametrize("variant,backend", compile_params())
def test_compile_fullgraph_forward_and_backward(variant, backend):
    case = variant_case(variant, torch.float32)
    module = Surrounded(FakeQuant(case))
    compiled = torch.compile(module, fullgraph=True, backend=backend)
    dy = torch.randn(case.x.shape)
    results = []
    for fn in (module, compiled):
        x = case.x.detach().clone().requires_grad_()
        y = fn(x)
        y.backward(dy)
        results.append((y.detach(), x.grad))
    (y_eager, g_eager), (y_compiled, g_compiled) = results
    assert_bits_equal(y_compiled, y_eager)
    assert_bits_equal(g_compiled, g_eager)
