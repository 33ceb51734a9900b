"""w4a8-dyn and w8a8-dyn through the stock QAT flow (prepare_qat_pt2e with our
quantizer) on a small Llama-style decoder: a point on the input and the
weight of every linear, the LM head included, and nothing else; the prepared
model against torchao's own 8da4w QAT on the same weights; one pt2e_fq op
per point in the converted program."""

import copy
import dataclasses

import pytest
import torch
from torchao.quantization import Int8DynamicActivationIntxWeightConfig, MappingType, PerGroup, quantize_
from torchao.quantization.qat import QATConfig

from benchmarks.models import LlamaDecoder
from pt2e_fq import FakeQuantize, PerToken, convert_pt2e
from pt2e_fq.cli import pipeline
from quantizers import presets
from tests.models.quantizer import single_thread, sqnr_db  # noqa: F401 (an autouse fixture)


def _decoder():
    torch.manual_seed(0)
    return LlamaDecoder(vocab=96, dim=64, layers=2, heads=2, max_seq=16), torch.randint(0, 96, (2, 16))


@pytest.mark.parametrize("preset", presets.DYNAMIC_ACTIVATION_PRESETS)
def test_every_linear_gets_a_per_token_input_and_a_weight_point(preset):
    model, tokens = _decoder()
    prepared = pipeline.prepare(model, (tokens,), preset, qat=True)
    linears = [n for n in prepared.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert len(linears) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer; the LM head
    points = {n.target: prepared.get_submodule(n.target) for n in prepared.graph.nodes
              if n.op == "call_module" and isinstance(prepared.get_submodule(n.target), FakeQuantize)}
    # Nothing but the linears' weights and inputs (one point where q, k and v, or gate and up,
    # read one tensor).
    assert len(points) == len(linears) + len({linear.args[0] for linear in linears}) == 15 + 9
    for linear in linears:
        x, w = (prepared.get_submodule(a.target) for a in linear.args[:2])
        assert isinstance(x.qspec.granularity, PerToken) and x.qspec.dynamic
        assert x.qspec.quant_range == (-128, 127) and w.qspec == presets.get_preset(preset).global_config.weight


def test_w4a8_dyn_qat_matches_torchaos_8da4w_qat():
    model, tokens = _decoder()
    ours = pipeline.prepare(copy.deepcopy(model), (tokens,), "w4a8-dyn", qat=True)
    theirs = copy.deepcopy(model)
    quantize_(theirs, QATConfig(Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4, weight_granularity=PerGroup(32), weight_mapping_type=MappingType.SYMMETRIC),
        step="prepare"))
    reference = theirs(tokens).detach()
    # The same fake quantization up to rounding ties (tests/fake_quantize/test_torchao_8da4w_parity.py):
    # far closer to torchao's than the float model is.
    assert sqnr_db(reference, ours(tokens).detach()) > sqnr_db(reference, model(tokens).detach()) + 15
    # One SGD step each from the same weights: the same update, up to those ties and to torchao's
    # gradient through its scales (its qparams are differentiable; ours are straight-through).
    for m in (ours, theirs):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.5)
        torch.nn.functional.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten()).backward()
        optimizer.step()
    moved = {n: p.detach() - dict(model.named_parameters())[n].detach() for n, p in theirs.named_parameters()}
    ours_moved = {n.replace(".", "_"): p.detach() for n, p in ours.named_parameters()}
    for name, delta in moved.items():
        ours_delta = ours_moved[name.replace(".", "_")] - dict(model.named_parameters())[name].detach()
        assert sqnr_db(delta, ours_delta) > 10, name


def test_the_converted_program_has_one_op_per_point():
    model, tokens = _decoder()
    prepared = pipeline.prepare(model, (tokens,), "w4a8-dyn", qat=True)
    prepared(tokens)
    points = sum(isinstance(m, FakeQuantize) for m in prepared.modules())
    program = torch.export.export(convert_pt2e(prepared), (tokens,))
    ops = [n for n in program.graph.nodes if n.op == "call_function" and getattr(n.target, "namespace", None) == "pt2e_fq"]
    assert len(ops) == points == 24


@pytest.mark.parametrize("preset", presets.DYNAMIC_ACTIVATION_PRESETS)
def test_the_one_call_form_adds_no_int8_edges_and_no_rounding_step(preset):
    # On a convolutional network w4a8's one-call form keeps the classifier at int8 weights and
    # runs GPTQ; the -dyn presets quantize as get_preset gives them, round to nearest.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 10)).eval()
    batches = [(torch.randn(4, 3, 6, 6),) for _ in range(2)]
    default = pipeline.quantize(model, batches[0], preset, calibration=batches, progress=False)
    plain = pipeline.quantize(model, batches[0], preset, calibration=batches, progress=False, algorithms=False)
    x = torch.randn(4, 3, 6, 6)
    assert torch.equal(default(x), plain(x))
    weights = [m.qspec for m in default.modules() if isinstance(m, FakeQuantize) and not m.qspec.dynamic]
    assert [w.quant_range for w in weights] == [presets.get_preset(preset).global_config.weight.quant_range] * 2


@pytest.mark.parametrize("qat", [False, True])
def test_the_xnnpack_target_stores_int4_group_scales_in_bfloat16(qat):
    # ExecuTorch's XNNPACK keeps per-group scales in bfloat16 and per-channel ones in fp32
    # (pt2e_fq.spec.qparams.SCALE_DTYPES); the other targets store fp32 scales.
    xnnpack = {p: presets.get_preset(p, target="xnnpack", qat=qat).global_config for p in presets.DYNAMIC_ACTIVATION_PRESETS}
    assert xnnpack["w4a8-dyn"].weight.scale_dtype is torch.bfloat16
    assert xnnpack["w8a8-dyn"].weight.scale_dtype is torch.float32
    for preset in presets.DYNAMIC_ACTIVATION_PRESETS:
        assert presets.get_preset(preset, qat=qat).global_config.weight.scale_dtype is torch.float32
        assert xnnpack[preset].input_activation.scale_dtype is torch.float32  # XNNPACK computes them in fp32
    # Nothing else changes.
    plain = presets.get_preset("w4a8-dyn", qat=qat).global_config.weight
    assert xnnpack["w4a8-dyn"].weight == dataclasses.replace(plain, scale_dtype=torch.bfloat16)
