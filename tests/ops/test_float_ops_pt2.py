"""The float-format ops as PT2 operators: opcheck, one node through
torch.export (re-export, decompositions, save/load), torch.compile with no
graph break, the straight-through gradient, the bytes saved for backward,
and the argument errors. Opcheck and the gradient tests run on every device
in DEVICES."""

import io

import pytest
import torch

import pt2e_fq
from tests.conftest import DEVICES, requires_cuda_kernels, to_device
from pt2e_fq import ops
from pt2e_fq import reference as ref

E4M3, E5M2, E2M1 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float4_e2m1fn_x2


def variants(device="cpu"):
    """name -> fn(x) -> y, for every kind of call (x of shape 37 x 40 on `device`)."""
    g = torch.Generator().manual_seed(1)
    per_channel = (torch.rand(37, generator=g) + 0.01).to(device)
    per_block = (torch.rand(13, 5, generator=g) + 0.1).to(device)  # blocks of 3 x 8, ragged rows
    per_tensor, global_scale = torch.tensor(0.02, device=device), torch.tensor(0.003, device=device)
    return {
        "float_per_tensor_e4m3": lambda x: ops.fake_quantize_float(x, list(x.shape), per_tensor, E4M3),
        "float_per_channel_e5m2": lambda x: ops.fake_quantize_float(x, [1, 40], per_channel, E5M2),
        "float_per_block_e2m1": lambda x: ops.fake_quantize_float(x, [3, 8], per_block, E2M1),
        "mxfp8_axis_last": lambda x: ops.fake_quantize_mx(x, E4M3),
        "mxfp8_e5m2_axis0": lambda x: ops.fake_quantize_mx(x, E5M2, 32, 0),
        "mxfp4_ragged": lambda x: ops.fake_quantize_mx(x, E2M1, 12, -1),
        "nvfp4_auto": lambda x: ops.fake_quantize_nvfp4(x),
        "nvfp4_given_axis0": lambda x: ops.fake_quantize_nvfp4(x, global_scale, axis=0),
    }


VARIANTS = variants()


def sample(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(37, 40, generator=g) * 2).to(dtype)


def op_calls():
    """pytest params (op overload, args) covering every op, format and dtype."""
    fq_float, fq_mx = torch.ops.pt2e_fq.fake_quantize_float.default, torch.ops.pt2e_fq.fake_quantize_mx.default
    fq_nvfp4 = torch.ops.pt2e_fq.fake_quantize_nvfp4.default
    calls = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = sample(dtype).requires_grad_()
        d = str(dtype).removeprefix("torch.")
        for fmt in ("e4m3", "e5m2", "e2m1"):
            calls += [
                pytest.param(fq_float, (x, [37, 40], torch.tensor(0.3), fmt), id=f"float_per_tensor_{fmt}-{d}"),
                pytest.param(fq_float, (x, [1, 40], torch.linspace(0.01, 1, 37), fmt), id=f"float_per_channel_{fmt}-{d}"),
                pytest.param(fq_float, (x, [5, 8], torch.rand(8, 5) + 0.1, fmt), id=f"float_per_block_{fmt}-{d}"),
                pytest.param(fq_mx, (x, fmt, 32, 0), id=f"mx_{fmt}_axis0-{d}"),
                pytest.param(fq_mx, (x, fmt, 32, -1), id=f"mx_{fmt}_ragged-{d}"),
            ]
        calls += [
            pytest.param(fq_nvfp4, (x, None, -1), id=f"nvfp4_computed-{d}"),
            pytest.param(fq_nvfp4, (x, torch.tensor(0.01), 0), id=f"nvfp4_given_axis0-{d}"),
            pytest.param(fq_nvfp4, (x, torch.tensor(0.01), -1), id=f"nvfp4_given-{d}"),
        ]
    return calls


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op, args", op_calls())
def test_opcheck(op, args, device):
    torch.library.opcheck(op, to_device(args, device))


class Wrap(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def pt2e_nodes(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "pt2e_fq" in str(n.target)]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_export_is_one_node_through_reexport_decompositions_and_save_load(name):
    x = sample()
    fn = VARIANTS[name]
    ep = torch.export.export(Wrap(fn), (x,))
    assert len(pt2e_nodes(ep.graph_module)) == 1
    ep = torch.export.export(ep.module(), (x,))
    ep = ep.run_decompositions()
    assert len(pt2e_nodes(ep.graph_module)) == 1
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    assert len(pt2e_nodes(loaded.graph_module)) == 1
    assert torch.equal(loaded.module()(x), fn(x))


@pytest.mark.parametrize("name", ["float_per_channel_e5m2", "mxfp4_ragged", "nvfp4_auto"])
def test_compile_fullgraph_forward_and_backward(name):
    fn = VARIANTS[name]
    x = sample().requires_grad_()
    dy = torch.randn(x.shape)
    (eager_grad,) = torch.autograd.grad(fn(x), x, dy)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    (grad,) = torch.autograd.grad(y, x, dy)
    assert torch.equal(y, fn(x)) and torch.equal(grad, eager_grad)


@pytest.mark.slow
def test_compile_with_inductor():
    fn = VARIANTS["mxfp8_axis_last"]
    x = sample().requires_grad_()
    torch._dynamo.reset()
    y = torch.compile(fn, fullgraph=True)(x)
    y.sum().backward()
    assert torch.equal(y, fn(x))
    assert torch.equal(x.grad, torch.ones_like(x) * ref.fake_quantize_mx(x.detach(), E4M3)[1])


def reference_mask(name, x):
    """The mask of each variant from the reference (independent of the kernels)."""
    x = x.detach()
    if name == "float_per_tensor_e4m3":
        return ref.fake_quantize_float(x, list(x.shape), torch.tensor(0.02), E4M3)[1]
    if name == "mxfp4_ragged":
        return ref.fake_quantize_mx(x, E2M1, 12, -1)[1]
    return ref.fake_quantize_nvfp4(x)[1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["float_per_tensor_e4m3", "mxfp4_ragged", "nvfp4_auto"])
def test_gradient_is_dy_through_the_mask_and_nan_dy_at_clamped_positions_gives_zero(name, device):
    x = sample() * 300  # enough saturation in every variant
    mask = reference_mask(name, x)
    assert 0 < int(mask.sum()) < mask.numel()
    dy = torch.randn(x.shape)
    dy[~mask] = float("nan")
    xd = x.to(device).requires_grad_()
    (grad,) = torch.autograd.grad(variants(device)[name](xd), xd, dy.to(device))
    assert grad.device.type == device
    assert torch.equal(grad.cpu(), torch.where(mask, dy, torch.zeros_like(dy)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_backward_saves_only_the_packed_mask(name, device):
    x = sample().to(device).requires_grad_()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = variants(device)[name](x)
    assert [(t.dtype, t.device.type) for t in saved] == [(torch.uint8, device)]
    assert sum(t.numel() * t.element_size() for t in saved) == (x.numel() + 7) // 8
    y.sum().backward()


def test_block_scales_are_returned_and_not_differentiable():
    x = sample().requires_grad_()
    y, scales = ops.fake_quantize_mx_with_scales(x, E4M3, 32, 0)
    assert scales.shape == (2, 40) and not scales.requires_grad
    y, block_scales, global_scale = ops.fake_quantize_nvfp4_with_scales(x)
    assert block_scales.shape == (37, 3) and global_scale.shape == ()
    assert global_scale.item() == (x.detach().abs().amax() / 2688).item()


def test_public_functions_are_exported_from_the_package():
    assert pt2e_fq.fake_quantize_float is ops.fake_quantize_float
    assert pt2e_fq.fake_quantize_mx is ops.fake_quantize_mx
    assert pt2e_fq.fake_quantize_nvfp4 is ops.fake_quantize_nvfp4


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda x: ops.fake_quantize_float(x, [37, 40], torch.tensor(1.0), torch.int8), ValueError, "dtype must be one of 'e4m3' / torch.float8_e4m3fn, 'e5m2' / torch.float8_e5m2, 'e2m1' / torch.float4_e2m1fn_x2; got torch.int8"),
        (lambda x: ops.fake_quantize_float(x, [37, 40], torch.tensor(1.0), "fp8"), ValueError, "dtype must be one of 'e4m3' / torch.float8_e4m3fn"),
        (lambda x: ops.fake_quantize_float(x, [37, 40], torch.tensor(1.0), 8), TypeError, "dtype must be an element name or a torch.dtype"),
        (lambda x: ops.fake_quantize_float(x, [37], torch.tensor(1.0), E4M3), ValueError, "block_size needs one entry per dimension"),
        (lambda x: ops.fake_quantize_float(x, [0, 40], torch.tensor(1.0), E4M3), ValueError, "block_size[0] must be >= 1"),
        (lambda x: ops.fake_quantize_float(x, [1, 40], torch.ones(36), E4M3), ValueError, "scale must have shape"),
        (lambda x: ops.fake_quantize_float(x, [37, 40], torch.tensor(0.0), E4M3), ValueError, "scale must be finite and > 0"),
        (lambda x: ops.fake_quantize_float(x, [37, 40], torch.tensor(float("nan")), E4M3), ValueError, "scale must be finite and > 0"),
        (lambda x: ops.fake_quantize_float(x.int(), [37, 40], torch.tensor(1.0), E4M3), TypeError, "x must be float32, bfloat16 or float16"),
        (lambda x: ops.fake_quantize_mx(x, torch.float8_e4m3fnuz), ValueError, "elem_dtype must be one of"),
        (lambda x: ops.fake_quantize_mx(x, E4M3, 0), ValueError, "block_size must be >= 1"),
        (lambda x: ops.fake_quantize_mx(x, E4M3, 32.0), TypeError, "block_size must be an int"),
        (lambda x: ops.fake_quantize_mx(x, E4M3, 32, 2), ValueError, "axis must be in [-2, 2)"),
        (lambda x: ops.fake_quantize_mx(x.double(), E4M3), TypeError, "x must be float32, bfloat16 or float16"),
        (lambda x: ops.fake_quantize_nvfp4(x, axis=-3), ValueError, "axis must be in [-2, 2)"),
        (lambda x: ops.fake_quantize_nvfp4(x, torch.ones(2)), ValueError, "global_scale must have shape"),
        (lambda x: ops.fake_quantize_nvfp4(x, torch.tensor(-1.0)), ValueError, "global_scale must be finite and > 0"),
        (lambda x: ops.fake_quantize_nvfp4(x, torch.tensor(1)), TypeError, "global_scale must be a floating-point tensor"),
        (lambda x: ops.fake_quantize_nvfp4(torch.tensor(1.0)), ValueError, "at least one dimension"),
    ],
)
def test_bad_arguments_get_clear_errors(call, error, message):
    with pytest.raises(error) as info:
        call(sample())
    assert message in str(info.value)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda x: torch.ops.pt2e_fq.fake_quantize_float(x, [37, 40], torch.tensor(1.0), "fp8"), "fmt must be one of 'e4m3', 'e5m2', 'e2m1'"),
        (lambda x: torch.ops.pt2e_fq.fake_quantize_mx(x, "e4m3", 32, 5), "axis must be in [-2, 2)"),
        (lambda x: torch.ops.pt2e_fq.fake_quantize_mx(x, "e3m4", 32, 0), "elem_fmt must be one of"),
        (lambda x: torch.ops.pt2e_fq.fake_quantize_nvfp4(x, torch.tensor(0.0), 0), "global_scale must be finite and > 0"),
    ],
)
def test_direct_op_calls_are_checked_in_cpp(call, message):
    with pytest.raises((ValueError, RuntimeError)) as info:
        call(sample())
    assert message in str(info.value)


@requires_cuda_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_ops_equal_the_cpu_ops_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(67, 45, 5, generator=g) * 50).to(dtype)
    x.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0]).to(dtype)
    calls = [
        (torch.ops.pt2e_fq.fake_quantize_float, (x, [1, 45, 5], torch.rand(67, generator=g) + 0.01, "e4m3")),
        (torch.ops.pt2e_fq.fake_quantize_float, (x, [67, 45, 5], torch.tensor(3.0), "e2m1")),
        (torch.ops.pt2e_fq.fake_quantize_float, (x, [4, 1, 5], torch.rand(17, 45, 1, generator=g) + 0.1, "e5m2")),
    ]
    for fmt in ("e4m3", "e5m2", "e2m1"):
        calls += [(torch.ops.pt2e_fq.fake_quantize_mx, (x, fmt, 32, axis)) for axis in (-1, 0, 1)]
    calls += [(torch.ops.pt2e_fq.fake_quantize_nvfp4, (x, None, axis)) for axis in (-1, 0)]
    calls.append((torch.ops.pt2e_fq.fake_quantize_nvfp4, (x, torch.tensor(0.01), 1)))
    for op, args in calls:
        expected = op(*args)
        got = op(*[a.cuda() if isinstance(a, torch.Tensor) else a for a in args])
        for e, o in zip(expected, got):
            o = o.cpu()
            assert e.shape == o.shape and e.dtype == o.dtype
            same = (e == o) | (torch.isnan(e) & torch.isnan(o)) if e.is_floating_point() else e == o
            assert bool(same.all()), (op, args[1:], e.dtype)
