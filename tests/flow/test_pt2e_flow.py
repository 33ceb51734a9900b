"""The PT2E flow end to end with a small hand-written Quantizer: export,
prepare_pt2e / prepare_qat_pt2e, calibrate or train, convert_pt2e, export
again, save, load in a fresh process; torch.compile; state_dict."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torchao.quantization.pt2e as tao
from tests.models.simple_quantizer import ConvBnReluLinear, ConvLinear, LinearConvQuantizer
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e, prepare_qat_pt2e

import pt2e_fq as q
from pt2e_fq import reference

FQ_OP = torch.ops.pt2e_fq.fake_quantize_affine.default

CONFIGS = {
    "int8": LinearConvQuantizer(
        activation=q.QSpec(q.INT8, scheme="asymmetric"),
        weight=q.QSpec(q.INT8, q.PerChannel(0), "symmetric_narrow"),
    ),
    "int4-dynamic": LinearConvQuantizer(
        activation=q.QSpec(q.INT8, q.PerToken(), "asymmetric", dynamic=True),
        weight=q.QSpec(q.INT4, q.PerGroup(4), "asymmetric", "minval", observer=q.MSEObserver(num_candidates=8)),
        output=q.QSpec(q.UINT8, scheme="asymmetric", observer=q.MovingAverageMinMaxObserver(0.5)),
    ),
}


def batch(seed, n=2, dtype=torch.float32):
    return torch.randn(n, 3, 6, 6, generator=torch.Generator().manual_seed(seed)).to(dtype)


def points(gm) -> dict[str, q.FakeQuantize]:
    return {name: m for name, m in gm.named_modules() if isinstance(m, q.FakeQuantize)}


def prepared(quantizer, model=None, example=None, qat=False, dynamic_shapes=None):
    torch.manual_seed(0)
    model = model or ConvLinear().eval()
    example = batch(0) if example is None else example
    gm = torch.export.export(model, (example,), dynamic_shapes=dynamic_shapes).module()
    return (prepare_qat_pt2e if qat else prepare_pt2e)(gm, quantizer)


def calibrated(quantizer, seeds=range(1, 5), **kwargs):
    gm = prepared(quantizer, **kwargs)
    dtype = kwargs.get("example", batch(0)).dtype
    for s in seeds:
        gm(batch(s, dtype=dtype))
    return gm


# ---------------------------------------------------------------------------
# PTQ: convert, re-export, save, load elsewhere


def test_ptq_flow_round_trips_through_a_saved_program_bit_for_bit(tmp_path):
    x = batch(100)
    outputs, paths = {}, {}
    for name, quantizer in CONFIGS.items():
        gm = calibrated(quantizer)
        gm.apply(tao.disable_observer)
        y_prepared = gm(x)
        fqs = points(gm)
        assert len(fqs) == 6  # input, weight, output of conv and of linear

        converted = convert_pt2e(gm)
        y_converted = converted(x)
        assert torch.equal(y_converted, y_prepared)

        ep = torch.export.export(converted, (x,))
        calls = [n for n in ep.graph.nodes if n.op == "call_function" and "pt2e_fq" in str(n.target)]
        assert [n.target for n in calls] == [FQ_OP] * len(fqs)  # one op per point, nothing else of ours
        # The program's buffers are exactly the static points' qparams.
        expected = {f"{p}.{b}" for p, m in fqs.items() if not m.qspec.dynamic
                    for b in m.qspec.kind.qparam_names(m.qspec)}
        assert set(ep.graph_signature.inputs_to_buffers.values()) == expected
        assert expected  # (the dynamic config still has static weights and outputs)

        outputs[name] = ep.module()(x)
        assert torch.equal(outputs[name], y_converted)
        paths[name] = tmp_path / f"{name}.pt2"
        torch.export.save(ep, paths[name])
    torch.save(x, tmp_path / "x.pt")

    script = textwrap.dedent(f"""
        import torch, pt2e_fq
        x = torch.load({str(tmp_path / 'x.pt')!r})
        for name, path in {({k: str(v) for k, v in paths.items()})!r}.items():
            torch.save(torch.export.load(path).module()(x), path + ".out")
    """)
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, timeout=300)
    for name, path in paths.items():
        loaded = torch.load(str(path) + ".out")
        assert torch.equal(loaded.view(torch.int32), outputs[name].view(torch.int32)), name


def test_converted_program_with_a_dynamic_batch_dimension():
    """Per-tensor and per-token points work with a symbolic batch (the first
    export must be dynamic too: its shape guards stay in the prepared graph)."""
    dynamic = ({0: torch.export.Dim("batch")},)
    for quantizer in CONFIGS.values():
        converted = convert_pt2e(calibrated(quantizer, dynamic_shapes=dynamic))
        ep = torch.export.export(converted, (batch(0),), dynamic_shapes=dynamic)
        x = batch(7, n=5)
        assert torch.equal(ep.module()(x), converted(x))
    assert torch.equal(ep.module()(x), converted(x))


def test_bf16_model_flow_keeps_fp32_qparams():
    quantizer = CONFIGS["int8"]
    gm = calibrated(quantizer, model=ConvLinear().eval().to(torch.bfloat16), example=batch(0, dtype=torch.bfloat16))
    converted = convert_pt2e(gm)
    x = batch(9, dtype=torch.bfloat16)
    ep = torch.export.export(converted, (x,))
    y = ep.module()(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, converted(x))
    assert all(m.scale.dtype == torch.float32 for m in points(converted).values())


# ---------------------------------------------------------------------------
# Uncalibrated points


def test_convert_without_calibration_lists_every_point():
    gm = prepared(CONFIGS["int8"])
    with pytest.raises(q.UncalibratedError) as err:
        convert_pt2e(gm)
    text = str(err.value)
    assert "6 fake-quant point(s) never saw data" in text
    for path in points(gm):
        assert f"  {path}: " in text
    assert "between 'x' and ['conv2d']" in text


def test_convert_lists_only_the_points_that_saw_no_data():
    gm = prepared(CONFIGS["int8"])
    linear = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default)
    around_linear = {n.target for n in gm.graph.nodes if n.op == "call_module" and (linear in n.users or n.args[0] is linear)}
    assert len(around_linear) == 3
    for path in around_linear:  # switched off: they see nothing during calibration
        gm.get_submodule(path).disable_observer()
        gm.get_submodule(path).disable_fake_quant()
    gm(batch(1))
    with pytest.raises(q.UncalibratedError, match="3 fake-quant point") as err:
        convert_pt2e(gm)
    listed = {line.split(":")[0].strip() for line in str(err.value).splitlines()[1:]}
    assert listed == around_linear


# ---------------------------------------------------------------------------
# state_dict


def test_state_dict_round_trip_of_prepared_and_converted_models():
    quantizer = CONFIGS["int4-dynamic"]
    a = calibrated(quantizer)
    fresh = prepared(quantizer)
    fresh.load_state_dict(a.state_dict())
    for gm in (a, fresh):
        gm.apply(tao.disable_observer)
    x = batch(50)
    assert torch.equal(fresh(x), a(x))

    converted_a = convert_pt2e(a)
    converted_fresh = convert_pt2e(fresh)  # calibrated by the loaded state: converts
    other = convert_pt2e(calibrated(quantizer, seeds=[11, 12]))  # different data, different qparams
    assert not torch.equal(other(x), converted_a(x))
    other.load_state_dict(converted_a.state_dict())
    assert torch.equal(other(x), converted_a(x)) and torch.equal(converted_fresh(x), converted_a(x))
    fq_keys = {k for k in converted_a.state_dict() if k.startswith("activation_post_process")}
    assert {k.rsplit(".", 1)[1] for k in fq_keys} == {"scale", "zero_point", "minval"}


# ---------------------------------------------------------------------------
# QAT


def _qat_model():
    quantizer = LinearConvQuantizer(
        activation=q.QSpec(q.INT8, scheme="asymmetric", observer=q.MovingAverageMinMaxObserver(0.1)),
        weight=q.QSpec(q.INT8, q.PerChannel(0), "symmetric_narrow", observer=q.CurrentMinMaxObserver()),
    )
    torch.manual_seed(0)
    x = torch.randn(16, 3, 8, 8)
    gm = prepared(quantizer, model=ConvBnReluLinear().train(), example=x, qat=True)
    return gm, x, torch.randint(0, 4, (16,))


def _train(gm, x, target, steps):
    opt = torch.optim.SGD(gm.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(gm(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_qat_trains_and_moving_average_observers_update_until_disabled():
    gm, x, target = _qat_model()
    # The linear's output: it changes as the model trains (the input x does not).
    linear = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default)
    act = gm.get_submodule(next(n.target for n in linear.users if n.op == "call_module"))
    assert isinstance(act.qspec.observer, q.MovingAverageMinMaxObserver)
    gm(x)
    first_range = (act.min_val.clone(), act.max_val.clone())
    losses = _train(gm, x, target, steps=8)
    assert losses[-1] < 0.8 * losses[0]
    assert not torch.equal(act.max_val, first_range[1]) or not torch.equal(act.min_val, first_range[0])

    gm.apply(tao.disable_observer)
    frozen = {k: v.clone() for k, v in gm.state_dict().items() if k.startswith("activation_post_process")}
    weights = gm.fc.weight.clone()
    _train(gm, x, target, steps=2)
    assert not torch.equal(gm.fc.weight, weights)  # training goes on
    for k, v in gm.state_dict().items():  # the observers do not
        if k in frozen:
            assert torch.equal(v, frozen[k]), k


def test_qat_weight_gradient_is_the_straight_through_estimator():
    gm, x, target = _qat_model()
    _train(gm, x, target, steps=2)
    gm.apply(tao.disable_observer)
    with torch.no_grad():
        gm.fc.weight.mul_(1.5)  # past the frozen range: some weights now clamp
    node = next(n for n in gm.graph.nodes if n.op == "call_module" and getattr(n.args[0], "target", None) == "fc.weight")
    fq = gm.get_submodule(node.target)
    dy = []

    def keep_output_grad(module, inputs, output):
        output.register_hook(dy.append)

    fq.register_forward_hook(keep_output_grad)
    gm.zero_grad()
    nn.functional.cross_entropy(gm(x), target).backward()
    _, mask = reference.fake_quantize_affine(gm.fc.weight.detach(), (1, gm.fc.weight.shape[1]), fq.scale,
                                             fq.zero_point, -127, 127)
    assert 0 < mask.sum() < mask.numel()
    assert torch.equal(gm.fc.weight.grad, torch.where(mask, dy[0], torch.zeros_like(dy[0])))


# ---------------------------------------------------------------------------
# torch.compile


@pytest.mark.slow
def test_compile_fullgraph_of_prepared_model_with_observers_off_and_of_converted_model():
    gm = calibrated(CONFIGS["int4-dynamic"])
    gm.apply(tao.disable_observer)
    x = batch(60)
    # fullgraph=True raises on any graph break.
    assert torch.equal(torch.compile(gm, fullgraph=True, backend="aot_eager")(x), gm(x))
    converted = convert_pt2e(gm)
    compiled = torch.compile(converted, fullgraph=True)
    torch.testing.assert_close(compiled(x), converted(x))


def test_compile_fullgraph_of_a_qat_step_with_observers_off():
    gm, x, target = _qat_model()
    gm(x)
    gm.apply(tao.disable_observer)
    # Every train-mode forward updates the BN running stats, which the QAT
    # conv-bn pattern uses: run both steps from the same state.
    state = copy.deepcopy(gm.state_dict())
    step = torch.compile(lambda: nn.functional.cross_entropy(gm(x), target), fullgraph=True, backend="aot_eager")
    step().backward()
    compiled_grad = gm.fc.weight.grad.clone()
    gm.load_state_dict(state)
    gm.zero_grad()
    nn.functional.cross_entropy(gm(x), target).backward()
    assert torch.equal(compiled_grad, gm.fc.weight.grad)


# ---------------------------------------------------------------------------
# A torchao trap, documented in DESIGN.md


def test_torchao_merges_an_output_and_the_next_input_whatever_their_qspecs():
    """prepare shares one observer between an output and the next op's input
    when dtype, quant range, qscheme, ch_axis and is_dynamic agree; it never
    compares observer_or_fake_quant_ctr, so the input's QSpec is dropped."""
    quantizer = LinearConvQuantizer(
        activation=q.QSpec(q.INT8, observer=q.MSEObserver()),
        weight=q.QSpec(q.INT8, q.PerChannel(0)),
        output=q.QSpec(q.INT8, observer=q.MovingAverageMinMaxObserver()),
    )
    gm = prepared(quantizer, model=nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).eval(), example=torch.randn(2, 4))
    observers = sorted(type(m.qspec.observer).__name__ for m in points(gm).values() if m.qspec.granularity == q.PerTensor())
    # 4 annotated activation edges (2 inputs, 2 outputs) but 3 modules: linear_1's MSE input is gone.
    assert observers == ["MSEObserver", "MovingAverageMinMaxObserver", "MovingAverageMinMaxObserver"]
