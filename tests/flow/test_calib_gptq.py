"""pt2e_fq.calib: GPTQ rounding and bias correction on small synthetic
layers, against hand-written torch references (the optimal-brain-surgeon
form of GPTQ with an explicit inverse Hessian, the mean output error by
direct products), and calib.apply on a small prepared model."""

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

from pt2e_fq import FP8_E4M3, INT4, INT8, MXFP4, NVFP4, CurrentMinMaxObserver, FakeQuantize, PerChannel, PerGroup, QSpec, calib
from pt2e_fq.cli import pipeline
from pt2e_fq.calib.bias_correction import bias_correction
from pt2e_fq.calib.gptq import act_order, gptq, residual_power
from pt2e_fq.calib.layers import LINEAR, Layer


def _grid(scale: float):
    """Round to nearest on a fixed int4 grid, by hand: quantize(columns, j) for gptq."""
    def quantize(columns, j):
        return (columns[:, j] / scale).round().clamp(-8, 7) * scale
    return quantize


def _reference_gptq(w: torch.Tensor, h: torch.Tensor, scale: float, damp: float) -> torch.Tensor:
    """GPTQ as optimal brain surgeon: column by column, error / [H^-1]_jj fed
    back through row j of the explicit inverse Hessian, then column j
    eliminated from the inverse (float64)."""
    w = w.double().clone()
    h = h.double() + damp * h.diagonal().mean() * torch.eye(h.shape[0], dtype=torch.float64)
    hinv = torch.linalg.inv(h)
    for j in range(w.shape[1]):
        q = (w[:, j] / scale).round().clamp(-8, 7) * scale
        err = (w[:, j] - q) / hinv[j, j]
        w[:, j:] -= err[:, None] * hinv[j, j:][None, :]
        w[:, j] = q
        hinv = hinv - hinv[:, j:j + 1] @ hinv[j:j + 1, :] / hinv[j, j]
    return w.float()


def _layer(seed: int, rows=12, n=40, tokens=400):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(n, n, generator=g) / n ** 0.5 + torch.eye(n)  # correlated inputs: feedback matters
    x = torch.randn(tokens, n, generator=g) @ mix + 0.5
    w = torch.randn(rows, n, generator=g) * 0.1
    return x, w


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gptq_matches_the_optimal_brain_surgeon_form(seed):
    x, w = _layer(seed)
    h = x.T @ x / len(x)
    scale = w.abs().max().item() / 7
    got = gptq(w.unsqueeze(0), h.unsqueeze(0), _grid(scale), block=16)[0]  # lazy batches of 16 of 40 columns
    want = _reference_gptq(w, h, scale, damp=0.01)
    assert (got - want).abs().max() < 1e-4 * scale or (got != want).float().mean() < 0.01  # a rare tie may flip
    on_grid = got / scale
    assert torch.allclose(on_grid, on_grid.round(), atol=1e-4)


@pytest.mark.parametrize("seed", [0, 1])
def test_act_order_is_gptq_on_the_permuted_problem(seed):
    """order=act_order(h): the optimal-brain-surgeon reference run on the
    columns permuted by decreasing diag(H), permuted back."""
    x, w = _layer(seed)
    x = x * torch.linspace(0.2, 3.0, x.shape[1])  # input powers that differ: the order matters
    h = x.T @ x / len(x)
    order = act_order(h[None])
    perm = torch.argsort(h.diagonal(), descending=True)
    assert torch.equal(order[0], perm)
    scale = w.abs().max().item() / 7
    got = gptq(w[None], h[None], _grid(scale), block=16, order=order)[0]
    want = _reference_gptq(w[:, perm], h[perm][:, perm], scale, damp=0.01)[:, torch.argsort(perm)]
    assert (got - want).abs().max() < 1e-4 * scale or (got != want).float().mean() < 0.01  # a rare tie may flip
    natural = gptq(w[None], h[None], _grid(scale), block=16)[0]
    assert not torch.equal(got, natural)


@pytest.mark.parametrize("ordered", [False, True], ids=["natural", "act_order"])
def test_residual_power_is_the_schur_complement_of_the_later_columns(ordered):
    """1 / [(H_{j:,j:})^-1]_jj in the rounding order (the damped H), by
    explicit inverses of the trailing blocks."""
    x, w = _layer(5, n=12)
    x = x * torch.linspace(0.3, 2.0, x.shape[1])
    h = x.T @ x / len(x)
    order = act_order(h[None]) if ordered else None
    perm = order[0] if ordered else torch.arange(12)
    damped = h.double()[perm][:, perm] + 0.01 * h.diagonal().double().mean() * torch.eye(12, dtype=torch.float64)
    want = torch.stack([1 / torch.linalg.inv(damped[j:, j:])[0, 0] for j in range(12)])
    got = residual_power(h[None], 0.01, order)[0]
    torch.testing.assert_close(got[perm].double(), want, rtol=1e-5, atol=0)


def test_gptq_reduces_the_output_error_of_round_to_nearest():
    x, w = _layer(3)
    h = x.T @ x / len(x)
    scale = w.abs().max().item() / 7
    nearest = (w / scale).round().clamp(-8, 7) * scale
    rounded = gptq(w.unsqueeze(0), h.unsqueeze(0), _grid(scale))[0]
    error = lambda q: ((x @ w.T - x @ q.T) ** 2).mean().item()  # noqa: E731
    assert error(rounded) < 0.7 * error(nearest)


def test_gptq_groups_are_independent_problems():
    """A batch of groups (a grouped conv) gives each group what it gets alone."""
    problems = [_layer(10 + i, rows=4, n=9) for i in range(3)]
    ws = torch.stack([w for _, w in problems])
    hs = torch.stack([x.T @ x / len(x) for x, _ in problems])
    together = gptq(ws, hs, _grid(0.02))
    for i in range(3):
        alone = gptq(ws[i:i + 1], hs[i:i + 1], _grid(0.02))
        torch.testing.assert_close(together[i:i + 1], alone)


def test_gptq_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="gptq: weight"):
        gptq(torch.zeros(1, 4, 8), torch.zeros(1, 7, 7), _grid(1.0))
    with pytest.raises(ValueError, match="gptq: order must be a permutation"):
        gptq(torch.zeros(1, 4, 8), torch.zeros(1, 8, 8), _grid(1.0), order=torch.arange(7)[None])


def test_bias_correction_zeroes_the_mean_output_error():
    x, w = _layer(4)
    scale = w.abs().max().item() / 7
    q = (w / scale).round().clamp(-8, 7) * scale
    b = torch.randn(w.shape[0])
    delta = bias_correction(w.unsqueeze(0), q.unsqueeze(0), x.mean(0).unsqueeze(0))
    float_out, quant_out = x @ w.T + b, x @ q.T + b + delta
    assert (float_out - x @ q.T - b).mean(0).abs().max() > 1e-2  # there was a mean error
    torch.testing.assert_close((float_out - quant_out).mean(0), torch.zeros(w.shape[0]), atol=1e-5, rtol=0)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.pw = nn.Conv2d(16, 32, 1)
        self.fc = nn.Linear(32, 10, bias=False)

    def forward(self, x):
        x = torch.relu(self.dw(torch.relu(self.stem(x))))
        return self.fc(torch.relu(self.pw(x)).mean((2, 3)))


def _sqnr(a, b):
    return (10 * torch.log10(a.pow(2).sum() / (a - b).pow(2).sum())).item()


@pytest.mark.parametrize("options", [{}, {"weight_ranges": True, "act_order": True}], ids=["plain", "ranges_act_order"])
@pytest.mark.parametrize("preset", ["w4a16", "nvfp4"])
def test_apply_improves_the_model_and_leaves_the_float_model_alone(preset, options):
    torch.manual_seed(0)
    model = _Net().eval()
    before = copy.deepcopy(model.state_dict())
    batches = [torch.randn(8, 3, 12, 12) for _ in range(4)]

    def quantized(algorithms):
        prepared = pipeline.prepare(model, batches[0], preset)
        pipeline.calibrate(prepared, batches, progress=False)
        report = calib.apply(prepared, batches, **options) if algorithms else None
        return convert_pt2e(prepared), report

    plain, _ = quantized(False)
    tuned, report = quantized(True)
    with torch.no_grad():
        ref = torch.cat([model(b) for b in batches])
        assert _sqnr(ref, torch.cat([tuned(b) for b in batches])) > _sqnr(ref, torch.cat([plain(b) for b in batches]))
    for name, value in model.state_dict().items():  # the float model shares nothing that was rewritten
        assert torch.equal(value, before[name]), name
    assert [r.name for r in report.layers] == ["stem.weight", "dw.weight", "pw.weight", "fc.weight"]
    # The stages that ran are timed, and their times make up the whole.
    assert list(report.stage_seconds) == ["statistics", "rounding"]
    assert sum(report.stage_seconds.values()) <= report.seconds
    assert "statistics" in str(report) and "rounding" in str(report)
    assert all(r.after_db > r.before_db for r in report.layers if preset == "w4a16")
    # The converted weight points keep the grid the weights were rounded on: a weight is its own rounding.
    for node in tuned.graph.nodes:
        if node.op == "call_module" and node.args[0].op == "get_attr":
            w = tuned.get_parameter(node.args[0].target)
            torch.testing.assert_close(tuned.get_submodule(node.target)(w), w, atol=0, rtol=0)


def test_apply_gives_a_bias_to_a_layer_without_one():
    torch.manual_seed(1)
    model = _Net().eval()
    batches = [torch.randn(4, 3, 8, 8) + 1.0 for _ in range(2)]
    prepared = pipeline.prepare(model, batches[0], "w4a16")
    pipeline.calibrate(prepared, batches, progress=False)
    calib.apply(prepared, batches, gptq_rounding=False)
    linear = [n for n in prepared.graph.nodes if n.target is torch.ops.aten.linear.default][0]
    assert len(linear.args) == 3 and linear.args[2].op == "get_attr"
    converted = convert_pt2e(prepared)
    with torch.no_grad():
        converted(batches[0])  # the graph runs with the new bias


def test_apply_rejects_a_module_that_is_not_a_graph():
    with pytest.raises(TypeError, match="calib.apply: prepared must be the GraphModule"):
        calib.apply(nn.Linear(2, 2), [])


@pytest.mark.parametrize("spec", [
    QSpec(INT4, PerGroup(32, 1), "asymmetric", "minval", observer=CurrentMinMaxObserver()),
    QSpec(INT8, PerChannel(0), "symmetric_narrow", observer=CurrentMinMaxObserver()),
    QSpec(FP8_E4M3, PerChannel(0), observer=CurrentMinMaxObserver()),
    QSpec(NVFP4, PerGroup(16, 1), observer=CurrentMinMaxObserver()),
    QSpec(MXFP4, PerGroup(32, 1), dynamic=True),
    QSpec(INT4, PerGroup(32, 1), "asymmetric", learnable=True, observer=CurrentMinMaxObserver()),
    QSpec(INT4, PerGroup(32, 1), "asymmetric", "minval", learnable=True, observer=CurrentMinMaxObserver()),
], ids=str)
@pytest.mark.parametrize("permuted", [False, True], ids=["natural", "permuted"])
def test_column_quantizer_is_the_op_on_the_whole_weight(spec, permuted):
    """GPTQ's column-by-column rounding gives, column for column, what the
    weight point's op gives on the whole weight (ragged last group included),
    also with the columns given in another order (act_order) and, for NVFP4,
    with the weight clamped to a bound (calib.weight_ranges). A learnable
    point's op is the learnable one, on trained qparams off the integer grid
    (a floating zero point, as LSQ+ leaves it)."""
    torch.manual_seed(0)
    point = FakeQuantize(spec)
    w = torch.randn(24, 80)
    point(w)
    point.enable_observer(False)
    if spec.learnable:
        with torch.no_grad():
            q = point.calculate_qparams()
            q["scale"].mul_(1.1)
            q.get("zero_point", q.get("minval")).add_(0.37 if "zero_point" in q else -0.01)
            assert point.is_learning
    layer = Layer(SimpleNamespace(target=LINEAR), "w", point, w.shape)
    order = torch.randperm(w.shape[1])[None] if permuted else None
    bound = (torch.rand(w.shape) + 0.5)[None] if spec.format == NVFP4 else None
    quantize = layer.column_quantizer(order, bound)
    natural = torch.arange(w.shape[1]) if order is None else order[0]
    columns = w.T[natural].unsqueeze(0).contiguous()
    got = torch.empty_like(w)
    for i, j in enumerate(natural.tolist()):
        got[:, j] = quantize(columns, i)[0]
    clamped = w if bound is None else torch.maximum(torch.minimum(w, bound[0]), -bound[0])
    torch.testing.assert_close(got, point(clamped), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("preset", ["w4a16", "w8a8"])
def test_a_half_precision_model_keeps_its_dtype_through_the_algorithms(dtype, preset):
    """The algorithms compute in fp32; what they write back (rounded
    weights, corrected and new biases) is in the model's dtype, so the
    converted model runs on its own inputs, close to the float model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False)).eval().to(dtype)
    batches = [(torch.randn(16, 16, dtype=dtype),) for _ in range(3)]
    converted = pipeline.quantize(model, batches[0], preset, calibration=batches, progress=False)
    assert {p.dtype for p in converted.parameters()} == {dtype}
    with torch.no_grad():
        out, ref = converted(*batches[0]), model(*batches[0])
    assert out.dtype == dtype
    assert _sqnr(ref.float(), out.float()) > 15


class _Twice(nn.Module):
    """One linear (weight and bias) called twice, and a linear of its own."""

    def __init__(self):
        super().__init__()
        self.shared, self.head = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.shared(torch.relu(self.shared(x))))


def test_a_weight_two_ops_read_is_left_as_it_was_and_named():
    """Each use would round the shared weight for its own inputs and add its
    own correction to the shared bias: apply leaves both uses at round to
    nearest (bit for bit the plain conversion) and says so."""
    torch.manual_seed(0)
    model = _Twice().eval()
    batches = [torch.randn(32, 16) + 2.0 for _ in range(3)]

    def quantized(algorithms):
        prepared = pipeline.prepare(model, batches[0], "w4a16")
        pipeline.calibrate(prepared, batches, progress=False)
        if not algorithms:
            return convert_pt2e(prepared), None
        with pytest.warns(UserWarning, match=r"calib.apply: 2 layer\(s\) left as they were: linear \(shared.weight "
                                             r"and shared.bias read by another op too\); linear_1 \(shared.weight"):
            report = calib.apply(prepared, batches)
        return convert_pt2e(prepared), report

    plain, _ = quantized(False)
    tuned, report = quantized(True)
    assert [r.name for r in report.layers] == ["head.weight"] and set(report.skipped) == {"linear", "linear_1"}
    assert "left as they were" in str(report)
    assert torch.equal(tuned.get_parameter("shared.weight"), plain.get_parameter("shared.weight"))
    assert torch.equal(tuned.get_parameter("shared.bias"), plain.get_parameter("shared.bias"))


class _Conv(nn.Module):
    def __init__(self, kernel, padding):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(4, 8, kernel, padding=padding), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


def _tuned_conv(model, batches):
    prepared = pipeline.prepare(model, batches[0], "w4a16")
    pipeline.calibrate(prepared, batches, progress=False)
    report = calib.apply(prepared, batches)
    return prepared, report


def test_a_conv_with_padding_same_is_rounded_as_the_same_conv_with_numbers():
    """nn.Conv2d(padding="same") calls aten.conv2d.padding: with an odd
    kernel it is the conv with padding (k - 1) / 2, and the algorithms give
    it the same weights and bias bit for bit."""
    torch.manual_seed(0)
    by_name = _Conv(3, "same").eval()
    by_number = _Conv(3, 1).eval()
    by_number.load_state_dict(by_name.state_dict())
    batches = [torch.randn(4, 4, 10, 10) + 0.5 for _ in range(3)]
    (a, report), (b, _) = _tuned_conv(by_name, batches), _tuned_conv(by_number, batches)
    assert [r.name for r in report.layers] == ["conv.weight", "fc.weight"]
    for name in ("conv.weight", "conv.bias"):
        assert torch.equal(a.get_parameter(name), b.get_parameter(name)), name


def test_a_conv_with_uneven_padding_same_is_left_as_it_was_and_named():
    torch.manual_seed(0)
    batches = [torch.randn(4, 4, 10, 10) for _ in range(2)]
    with pytest.warns(UserWarning, match=r'calib.apply: 1 layer\(s\) left as they were: conv2d \(padding="same" with '
                                         r"an even kernel"):
        _, report = _tuned_conv(_Conv(2, "same").eval(), batches)
    assert [r.name for r in report.layers] == ["fc.weight"]
