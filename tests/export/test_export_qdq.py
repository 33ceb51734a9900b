"""to_qdq / check_lowered / compile_x86: lowering fake-quant points to the
PT2E runtimes' quantize / dequantize ops.

References: the converted model itself (our fake-quant graph) and its
FakeQuantize modules run on the float weights; the output steps are read
from the model's own output point."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
from tests.models.quantized import QAT_SHAPE, batch, ptq, qat_prepared
from tests.models.simple_quantizer import ConvLinear
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

import pt2e_fq as q
from pt2e_fq.cli import pipeline
from benchmarks.models import CNN, EncoderBlock
from pt2e_fq.export import UnsupportedPointError, check_lowered, compile_x86, to_qdq
from pt2e_fq.export.lowering import qdq
from pt2e_fq.fake_quantize import FakeQuantize
from quantizers import OpConfig, QuantizerConfig, presets

qd = torch.ops.quantized_decomposed
ACT = q.QSpec(q.INT8, q.PerTensor(), "asymmetric")
WEIGHTS = {
    "per_tensor": q.QSpec(q.INT8, q.PerTensor(), "symmetric"),
    "per_channel": q.QSpec(q.INT8, q.PerChannel(0), "symmetric_narrow"),
    "per_group": q.QSpec(q.INT4, q.PerGroup(16, 1), "symmetric", observer=q.CurrentMinMaxObserver()),
}
DEQUANTIZE = (qd.dequantize_per_tensor.default, qd.dequantize_per_channel.default,
              torch.ops.torchao.dequantize_affine.default)


def _output_point(model: torch.fx.GraphModule) -> FakeQuantize:
    """The FakeQuantize module producing the converted model's (single) output."""
    out = next(n for n in model.graph.nodes if n.op == "output").args[0]
    node = out[0] if isinstance(out, (tuple, list)) else out
    return model.get_submodule(node.target)


def _skip_without_vnni() -> None:
    """oneDNN's int8 kernels match the q/dq reference within a step only
    with a VNNI (or AMX) int8 dot product: AVX2's u8 x s8 multiply-add
    (vpmaddubsw) saturates each pair of products at int16. Measured on an
    AVX2-only AMD EPYC: up to 3 steps off, and 0.17 on the encoder block."""
    if not (qdq.cpu_flags() or frozenset()) & qdq.INT8_DOT_PRODUCT_FLAGS:
        pytest.skip("this CPU has no VNNI/AMX int8 dot product (no avx512_vnni, avx_vnni or amx_int8 in "
                    "/proc/cpuinfo): oneDNN's AVX2 int8 kernels saturate pairs of products at int16, so the "
                    "compiled int8 model is not within a step of its q/dq program here")


def _within_one_step(lowered_out, model, x):
    ref = model(x)
    step = _output_point(model).scale.float()
    diff = (lowered_out - ref).abs()
    assert (diff <= step * (1 + 1e-3)).all(), f"max diff {diff.max().item()} vs step {step.max().item()}"
    return diff


def _weights_as_the_model_fake_quantizes_them(model: torch.fx.GraphModule) -> dict:
    """{weight shape: the weight point's FakeQuantize applied to the float weight}."""
    out = {}
    for node in model.graph.nodes:
        if node.op == "call_module" and isinstance(model.get_submodule(node.target), FakeQuantize):
            src = node.args[0]
            if src.op == "get_attr":
                w = getattr(model, src.target) if "." not in src.target else model.get_parameter(src.target)
                with torch.no_grad():
                    out[tuple(w.shape)] = model.get_submodule(node.target)(w)
    return out


def _dequantized_weights(program: torch.export.ExportedProgram) -> dict:
    """{shape: value} of each dequantize of a constant in the lowered program."""
    gm = program.module()
    out = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in DEQUANTIZE and node.args[0].op == "get_attr":
            args, kwargs = torch.fx.node.map_arg(
                (node.args, node.kwargs), lambda n: getattr(gm, n.target) if n.op == "get_attr" else n)
            y = node.target(*args, **kwargs)
            out[tuple(y.shape)] = y
    return out


@pytest.mark.parametrize(
    "granularity, target",
    [(g, t) for g in ("per_tensor", "per_channel") for t in ("generic", "xnnpack", "x86_inductor")]
    + [("per_group", "generic")],
)
def test_lowered_weights_dequantize_to_the_fake_quantized_weights_bit_for_bit(granularity, target):
    model = ptq(ACT, WEIGHTS[granularity])
    x = batch(9)
    program, summary = to_qdq(model, x, target=target, summary=True)
    expected = _weights_as_the_model_fake_quantizes_them(model)
    got = _dequantized_weights(program)
    assert set(got) == set(expected) == {(4, 3, 3, 3), (5, 64)}
    for shape in expected:
        assert torch.equal(got[shape], expected[shape]), shape
    points = [n for n in model.graph.nodes if n.op == "call_module"
              and isinstance(model.get_submodule(n.target), FakeQuantize)]
    assert not summary.kept and len(summary.lowered) == len(points) == 6  # 2 weights, 4 activations
    _within_one_step(program.module()(x), model, x)


def test_no_pt2e_fq_op_and_no_float_weight_is_left():
    model = ptq(ACT, WEIGHTS["per_channel"])
    program = to_qdq(model, batch(9), target="xnnpack")
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not any(t.startswith("pt2e_fq.") for t in targets), targets
    # Only the biases stay float parameters; the weights are int8 codes.
    assert sorted(n for n, _ in program.named_parameters()) == ["conv.bias", "fc.bias"]
    codes = [t for t in program.state_dict.values() if t.dtype == torch.int8]
    assert sorted(tuple(t.shape) for t in codes) == [(4, 3, 3, 3), (5, 64)]


def test_the_codes_are_the_kernels_where_torchs_quantize_rounds_ties_the_other_way():
    # int4 per group of 32 on a 64 x 1024 weight: x * (1/scale) and x / scale
    # round differently on some exact ties (DESIGN.md); the lowering stores our codes.
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(1024, 64)).eval()
    spec = q.QSpec(q.INT4, q.PerGroup(32, 1), "symmetric", observer=q.CurrentMinMaxObserver())
    model = ptq(ACT, spec, model=lin, shape=(2, 1024))
    program = to_qdq(model, batch(9, (2, 1024)))
    (expected,) = _weights_as_the_model_fake_quantizes_them(model).values()
    (got,) = _dequantized_weights(program).values()
    assert torch.equal(got, expected)
    w = next(p for p in model.parameters() if p.dim() == 2)
    point = next(m for m in model.modules() if isinstance(m, FakeQuantize) and m.scale.shape == (64, 32))
    s = point.scale.repeat_interleave(32, 1)
    torch_codes = torch.round(w * (1 / s)).clamp(-8, 7)
    ours = torch.round(w / s).clamp(-8, 7)
    assert (torch_codes != ours).any(), "no tie in this weight: the test would not tell the two apart"


# The XNNPACK layout (every tensor quantized, the output too: docs/export.md),
# which every target lowers and the tests compare with the output point's step.
def _cnn_w8a8(dynamic=True):
    torch.manual_seed(0)
    model = CNN(channels=8).eval()
    batches = [(torch.randn(4, 3, 8, 8),) for _ in range(4)]
    return pipeline.quantize(model, batches[0], presets.every_point("w8a8"), calibration=batches,
                             progress=False)


def _encoder_w8a8():
    torch.manual_seed(0)
    model = EncoderBlock().eval()
    batches = [(torch.randn(2, 6, 32),) for _ in range(4)]
    return pipeline.quantize(model, batches[0], presets.every_point("w8a8"), calibration=batches,
                             progress=False)


def _encoder_w8a8_preset():
    """The w8a8 preset (no output points): Inductor fuses each residual add into a linear."""
    torch.manual_seed(0)
    model = EncoderBlock().eval()
    batches = [(torch.randn(2, 6, 32),) for _ in range(4)]
    return pipeline.quantize(model, batches[0], "w8a8", calibration=batches, progress=False)


def _qat_conv_bn():
    return convert_pt2e(qat_prepared())


MODELS = {
    "cnn_residual": (_cnn_w8a8, (4, 3, 8, 8)),
    "encoder_block": (_encoder_w8a8, (2, 6, 32)),
    "qat_conv_bn_folded": (_qat_conv_bn, QAT_SHAPE),
}


@pytest.mark.parametrize("target", ["generic", "xnnpack", "x86_inductor"])
@pytest.mark.parametrize("name", list(MODELS))
def test_lowered_models_are_within_one_step_of_the_fake_quant_graph(name, target):
    build, shape = MODELS[name]
    model = build()
    x = batch(11, shape)
    program = to_qdq(model, x, target=target)
    _within_one_step(program.module()(x), model, x)
    check = check_lowered(program, model, x)
    assert check.ok and check.outputs[0].numel == model(x).numel(), str(check)


def test_x86_inductor_activations_are_uint8_with_the_zero_point_shifted_by_128():
    model = ptq(ACT, WEIGHTS["per_channel"])
    program = to_qdq(model, batch(9), target="x86_inductor")
    quantizes = [n for n in program.graph.nodes if n.target == qd.quantize_per_tensor.default]
    points = [m for m in model.modules() if isinstance(m, FakeQuantize) and m.scale.numel() == 1]
    assert quantizes and all(n.args[5] == torch.uint8 and (n.args[3], n.args[4]) == (0, 255) for n in quantizes)
    expected = sorted(int(p.zero_point) + 128 for p in points)
    assert sorted({n.args[2] for n in quantizes}) == sorted(set(expected))


@pytest.mark.parametrize("target", ["xnnpack", "x86_inductor"])
def test_runtime_pairs_are_repeated_after_views_and_each_dequantize_has_one_user(target):
    model = _cnn_w8a8()  # relu(conv2 + y): y feeds conv2 and the add; pool -> [point] -> flatten -> linear
    x = batch(9, (4, 3, 8, 8))
    program = to_qdq(model, x, target=target)
    for node in program.graph.nodes:
        if node.target in (torch.ops.aten.linear.default, torch.ops.aten.conv2d.default):
            assert node.args[0].target == qd.dequantize_per_tensor.default, node.format_node()
        if node.target == qd.dequantize_per_tensor.default:
            assert len(node.users) == 1, node.format_node()
    _within_one_step(program.module()(x), model, x)


def test_a_dynamic_batch_program_keeps_its_dynamic_batch():
    model = _cnn_w8a8()
    x = batch(3, (4, 3, 8, 8))
    program = to_qdq(model, x, dynamic_shapes=({0: torch.export.Dim.AUTO},), target="x86_inductor")
    lowered = to_qdq(q.export.exported_program(model, x, dynamic_shapes=({0: torch.export.Dim.AUTO},)), x)
    for b in (1, 7):
        xb = batch(b, (b, 3, 8, 8))
        _within_one_step(program.module()(xb), model, xb)
        _within_one_step(lowered.module()(xb), model, xb)


@pytest.mark.parametrize("flags, warns", [
    (frozenset({"sse4_2", "avx2", "fma"}), True),  # an AVX2-only x86 CPU
    (frozenset({"avx2", "avx512f", "avx512_vnni"}), False),
    (frozenset({"avx2", "avx_vnni"}), False),
    (frozenset({"avx2", "amx_int8"}), False),
    (frozenset({"asimd", "asimddp"}), False),  # not x86: no oneDNN AVX2 kernels
    (None, False),  # flags unknown (no /proc/cpuinfo)
])
def test_compile_x86_warns_on_a_cpu_without_an_int8_dot_product(monkeypatch, flags, warns):
    import warnings

    monkeypatch.setattr(qdq, "cpu_flags", lambda: flags)
    program = to_qdq(_cnn_w8a8(), batch(5, (2, 3, 8, 8)), target="x86_inductor")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compile_x86(program)  # torch.compile compiles at the first call: nothing runs here
    messages = [str(w.message) for w in caught if "int8 dot product" in str(w.message)]
    assert len(messages) == warns, messages
    if warns:
        assert "avx512_vnni" in messages[0] and "check_lowered" in messages[0]


@pytest.mark.slow
def test_compiled_with_freezing_inductor_runs_onednn_int8_kernels():
    from torch._inductor.utils import run_and_get_code

    model = _cnn_w8a8()
    x = batch(5, (4, 3, 8, 8))
    program = to_qdq(model, x, target="x86_inductor")
    compiled = compile_x86(program)
    out, code = run_and_get_code(compiled, x)
    kernels = re.findall(r"torch\.ops\.onednn\.(q\w+)", "\n".join(code))
    # Two convs and the linear, as quantized oneDNN kernels (not float ones on dequantized values).
    assert kernels.count("qconv_pointwise") + kernels.count("qconv2d_pointwise") >= 2, kernels
    assert any(k.startswith("qlinear") for k in kernels), kernels
    _skip_without_vnni()
    _within_one_step(out, model, x)
    assert check_lowered(compiled, model, x).ok


@pytest.mark.slow
def test_compiled_encoder_block_leaves_its_input_alone():
    from torch._inductor.utils import run_and_get_code

    model = _encoder_w8a8_preset()
    x = batch(8, (2, 6, 32))
    before = x.clone()
    compiled = compile_x86(to_qdq(model, x, target="x86_inductor"))
    out, code = run_and_get_code(compiled, x)
    # The residual adds fused into the linears with oneDNN's in-place "sum" post-op,
    # which writes into its float operand: here the block's input.
    assert re.search(r"qlinear_pointwise\.binary\w*\(.*'sum'", "\n".join(code)), "\n".join(code)
    assert torch.equal(x, before)
    assert out.data_ptr() != x.data_ptr()
    with torch.no_grad():
        again = compiled(x)
    assert torch.equal(x, before) and torch.equal(again, out)
    _skip_without_vnni()
    # The result is the lowered program's, run eagerly (same q/dq ops; oneDNN's
    # int32 accumulation and requantization may move a value by a float ulp).
    torch.testing.assert_close(out, to_qdq(model, x, target="x86_inductor").module()(before), atol=1e-5, rtol=0)


def _inductor_calls(compiled, x) -> list:
    from torch._inductor.utils import run_and_get_code

    _, code = run_and_get_code(compiled, x)
    return sorted(re.findall(r"(torch\.ops\.onednn\.\w+\.\w+|extern_kernels\.\w+|_scaled_dot_product\w+)\(",
                             "\n".join(code)))


@pytest.mark.slow
def test_the_x86_inductor_preset_compiles_the_block_as_the_stock_flow_does():
    from benchmarks.stock_flows import stock_quantize

    torch.manual_seed(0)
    block = EncoderBlock().eval()
    batches = [(torch.randn(2, 6, 32),) for _ in range(4)]
    x = batch(8, (2, 6, 32))
    stock = stock_quantize(block, batches[0], batches, "X86InductorQuantizer")
    with torch._inductor.config.patch(freezing=True), torch.no_grad():
        stock_calls = _inductor_calls(torch.compile(torch.export.export(stock, (x,)).module()), x.clone())
    ours = {}
    for target in ("generic", "x86_inductor"):
        torch._dynamo.reset()
        model = pipeline.quantize(block, batches[0], presets.get_preset("w8a8", target), calibration=batches,
                                  progress=False)
        ours[target] = _inductor_calls(compile_x86(to_qdq(model, x, target="x86_inductor")), x)
    # The stock layout leaves attention's matmuls float: Inductor fuses them and the
    # softmax into its flash attention. The x86_inductor preset gives the same calls;
    # the generic preset's points around the matmuls leave two float bmm.
    assert any("flash_attention" in c for c in stock_calls), stock_calls
    assert ours["x86_inductor"] == stock_calls, (ours["x86_inductor"], stock_calls)
    assert ours["generic"].count("extern_kernels.bmm") == 2 and not any("flash" in c for c in ours["generic"])


# -- what cannot be lowered ---------------------------------------------------------


def test_an_unconverted_model_is_refused():
    prepared = ptq(ACT, WEIGHTS["per_channel"], convert=False)
    with pytest.raises(ValueError, match="not converted.*convert_pt2e"):
        to_qdq(prepared, batch(9))


def test_bad_target_and_unsupported_values_name_the_allowed_ones():
    model = ptq(ACT, WEIGHTS["per_channel"])
    with pytest.raises(ValueError, match="target must be one of 'generic', 'xnnpack', 'x86_inductor', got 'tpu'"):
        to_qdq(model, batch(9), target="tpu")
    with pytest.raises(ValueError, match="unsupported must be one of 'error', 'keep', 'float', got 'skip'"):
        to_qdq(model, batch(9), unsupported="skip")


@pytest.mark.parametrize(
    "target, activation, weight, where, why",
    [
        ("xnnpack", q.QSpec(q.INT16, q.PerTensor(), "asymmetric"), WEIGHTS["per_channel"],
         r"conv: input of conv2d", "XNNPACK takes int8 per-tensor activations"),
        ("x86_inductor", ACT, q.QSpec(q.INT8, q.PerChannel(0), "asymmetric"),
         r"conv: weight of conv2d", "symmetric int8 weights"),
        ("generic", q.QSpec(q.FP8_E4M3, q.PerTensor()), WEIGHTS["per_channel"],
         r"conv: input of conv2d", "FP8_E4M3 is not an integer format"),
        ("xnnpack", ACT, WEIGHTS["per_group"], r"conv: weight of conv2d", "per-block weight qparams"),
    ],
)
def test_an_unsupported_point_is_an_error_naming_module_role_and_reason(target, activation, weight, where, why):
    model = ptq(activation, weight)
    with pytest.raises(UnsupportedPointError, match=f"{where}.*{why}"):
        to_qdq(model, batch(9), target=target)


def test_unsupported_keep_leaves_our_op_and_says_so():
    model = ptq(q.QSpec(q.INT16, q.PerTensor(), "asymmetric"), WEIGHTS["per_channel"])
    x = batch(9)
    with pytest.warns(UserWarning, match=r"kept as pt2e_fq ops\n  kept .*input of conv2d.*int8 per-tensor"):
        program, summary = to_qdq(model, x, target="xnnpack", unsupported="keep", summary=True)
    kept_ops = [n for n in program.graph.nodes if str(n.target).startswith("pt2e_fq.")]
    int16_points = [m for m in model.modules() if isinstance(m, FakeQuantize) and m.quant_min == -(2**15)]
    assert len(kept_ops) == len(summary.kept) == len(int16_points) == 4
    _within_one_step(program.module()(x), model, x)


def test_unsupported_float_stores_the_fake_quantized_weight():
    model = ptq(ACT, WEIGHTS["per_group"])
    x = batch(9)
    with pytest.warns(UserWarning, match=r"2 weight\(s\) stored as float"):
        program, summary = to_qdq(model, x, target="xnnpack", unsupported="float", summary=True)
    expected = _weights_as_the_model_fake_quantizes_them(model)
    stored = {tuple(t.shape): t for n, t in program.state_dict.items() if "fake_quantized_weight" in n}
    assert set(stored) == set(expected)
    for shape in expected:
        assert torch.equal(stored[shape], expected[shape])
    _within_one_step(program.module()(x), model, x)
    # An activation the target cannot take has no float fallback.
    int16 = ptq(q.QSpec(q.INT16, q.PerTensor(), "asymmetric"), WEIGHTS["per_channel"])
    with pytest.raises(UnsupportedPointError, match="input of conv2d"):
        to_qdq(int16, x, target="xnnpack", unsupported="float")


class SharedInputLinears(nn.Module):
    """Two linears reading one input (as attention's q, k, v do), then a third."""

    def __init__(self, d=64):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 8)

    def forward(self, x):
        return self.c(self.a(x) * self.b(x))


def _dynamic(config, model, shape=(2, 5, 64)):
    """`model` quantized with `config` (a preset name or a QuantizerConfig) by pipeline.quantize."""
    torch.manual_seed(0)
    return pipeline.quantize(model.eval(), batch(0, shape), config, calibration=[batch(1, shape)], progress=False)


@pytest.mark.parametrize("preset, weight_dequantize", [("w4a8-dyn", "torchao.dequantize_affine"),
                                                         ("w8a8-dyn", "dequantize_per_channel")])
def test_dynamic_per_token_activations_become_one_torchao_chain_per_linear(preset, weight_dequantize):
    model = _dynamic(preset, SharedInputLinears())
    x = batch(9, (3, 5, 64))  # pipeline.quantize exports a dynamic batch only
    program, summary = to_qdq(model, x, target="xnnpack", summary=True)
    calls = [n for n in program.graph.nodes if n.op == "call_function"]
    choose = [n for n in calls if n.target == torch.ops.torchao.choose_qparams_affine.default]
    linears = [n for n in calls if n.target == torch.ops.aten.linear.default]
    # The shared input's point gives each of its two linears its own chain, directly in front of it.
    assert len(choose) == len(linears) == 3
    for linear in linears:
        dq = linear.args[0]
        assert dq.target == torch.ops.torchao.dequantize_affine.default
        assert dq.args[1] == [1, 1, 64] and dq.args[4:7] == (torch.int8, -128, 127)
        assert dq.args[0].target == torch.ops.torchao.quantize_affine.default
        assert dq.args[2].args[0] in choose  # scale: getitem of a choose_qparams_affine
    assert all(p.lowered_as == "choose_qparams_affine/quantize_affine/dequantize_affine"
               for p in summary.lowered if p.role.startswith("input"))
    assert all(p.lowered_as.endswith(weight_dequantize) for p in summary.lowered if p.role.startswith("weight"))
    expected = _weights_as_the_model_fake_quantizes_them(model)
    got = _dequantized_weights(program)
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    # torchao's per-token ops in eager against the fake-quant graph (its qparams follow torchao's).
    check = check_lowered(program, model, x)
    assert check.ok and check.outputs[0].sqnr_db > 40, str(check)


def test_a_dynamic_activation_xnnpack_cannot_run_is_refused_naming_why():
    act = q.QSpec(q.INT8, q.PerToken(), "asymmetric", dynamic=True)
    weight = q.QSpec(q.INT4, q.PerGroup(32, 1), "symmetric", observer=q.CurrentMinMaxObserver())
    # Dynamic points on attention's matmuls too: XNNPACK has no dynamically quantized matmul.
    config = QuantizerConfig(OpConfig(input_activation=act, weight=weight))
    model = _dynamic(config, EncoderBlock(d=64, heads=2, hidden=64))
    x = batch(9, (2, 5, 64))
    why = r"input of (add|matmul)\).*only as the input of a linear with a quantized weight; this one is read by"
    with pytest.raises(UnsupportedPointError, match=why):
        to_qdq(model, x, target="xnnpack")
    with pytest.warns(UserWarning, match="kept as pt2e_fq ops"):
        _, summary = to_qdq(model, x, target="x86_inductor", unsupported="keep", summary=True)
    assert any("(a dynamic point); Inductor's x86 int8 kernels take static ones" in p.reason for p in summary.kept)
    # Per-group int4 weights with static activations: XNNPACK's group weights are for dynamic ones only.
    static = ptq(ACT, weight, model=nn.Sequential(nn.Linear(64, 8)), shape=(2, 64))
    with pytest.raises(UnsupportedPointError, match="weight of linear.*per-block weight qparams"):
        to_qdq(static, batch(9, (2, 64)), target="xnnpack")

