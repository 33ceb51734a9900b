"""check_lowered judges the float outputs too.

The presets leave a model's outputs float (no point produces the logits),
so a check of quantized outputs only passed anything. Float outputs are
judged by their SQNR against the converted model (lowering/check.py
MIN_FLOAT_SQNR_DB, 30 dB). On the demo CNN (the digits CNN, w8a8) and a transformer block
(w8a8): the correct lowering passes; a lowered program with a q/dq scale or
zero point off, a weight changed, another model's weights, or a function
returning zeros fails. The command exits 1 with one line when the check
fails.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tests.conftest import cli_main
from tests.models.quantizer import single_thread  # noqa: F401 (an autouse fixture: one thread)

from pt2e_fq.cli import digits, pipeline
from benchmarks.models import EncoderBlock
from pt2e_fq.export import check_lowered, to_qdq
from pt2e_fq.export.lowering import check as lowered_check

qd = torch.ops.quantized_decomposed


def _demo_cnn(seed):
    """The demo's CNN after 20 steps of training (at random init its logits
    are mostly the classifier's bias, whatever the image)."""
    torch.manual_seed(seed)
    data = digits.load()
    model = digits.DigitsCNN().train()
    optimizer = torch.optim.Adam(model.parameters(), 1e-2)
    for images, labels in data.batches("train", 64, seed=seed)[:20]:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
    images = data.x_train
    batches = [(images[i:i + 16],) for i in range(0, 64, 16)]
    return pipeline.quantize(model.eval(), batches[0], "w8a8", calibration=batches,
                             progress=False), (data.x_test[:32],)


def _encoder_block(seed):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randn(2, 6, 32, generator=g),) for _ in range(4)]
    return pipeline.quantize(EncoderBlock().eval(), batches[0], "w8a8", calibration=batches,
                             progress=False), (torch.randn(4, 6, 32, generator=g),)


MODELS = {"demo_cnn": _demo_cnn, "encoder_block": _encoder_block}


@pytest.fixture(scope="module", params=list(MODELS))
def lowered(request):
    """(name, the converted model, its inputs, its generic q/dq program)."""
    model, x = MODELS[request.param](0)
    return request.param, model, x, to_qdq(model, x, target="generic")


def _first_activation_quantize(program):
    return next(n for n in program.graph.nodes if n.target == qd.quantize_per_tensor.default)


def _wrong_scale(program):
    """The first activation's quantize with twice its dequantize's scale."""
    node = _first_activation_quantize(program)
    node.args = (node.args[0], node.args[1] * 2, *node.args[2:])


def _wrong_zero_point(program):
    """The first activation's quantize with a zero point 10 codes from its dequantize's."""
    node = _first_activation_quantize(program)
    zero_point = node.args[2]
    node.args = (*node.args[:2], zero_point - 10 if zero_point > 0 else zero_point + 10, *node.args[3:])


def _int8_weights(program) -> list:
    return [t for t in (*program.state_dict.values(), *program.constants.values())
            if isinstance(t, torch.Tensor) and t.dtype == torch.int8]


def _wrong_weight(program):
    """The last layer's int8 weight codes negated."""
    _int8_weights(program)[-1].neg_()


MUTATIONS = {"scale": _wrong_scale, "zero_point": _wrong_zero_point, "weight": _wrong_weight}


def test_the_correct_lowering_passes(lowered):
    name, model, x, program = lowered
    check = check_lowered(program, model, x)
    assert [o.max_steps for o in check.outputs] == [None]  # a float output: the check before judged nothing
    assert check.ok and check.problems() == [], str(check)


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_wrong_scale_zero_point_or_weight_fails(lowered, mutation):
    name, model, x, program = lowered
    wrong = copy.deepcopy(program)
    MUTATIONS[mutation](wrong)
    wrong.graph_module.recompile()
    check = check_lowered(wrong, model, x)
    assert not check.ok, f"{name}, {mutation}:\n{check}"
    (problem,) = check.problems()
    assert problem.startswith("output 0 has an SQNR of ") and problem.endswith(" dB against ours (at least 30 dB)")
    assert check.outputs[0].sqnr_db < lowered_check.MIN_FLOAT_SQNR_DB - 3, str(check)  # not a near miss


def test_another_model_or_zeros_fail(lowered):
    name, model, x, _ = lowered
    other, _ = MODELS[name](1)
    assert not check_lowered(to_qdq(other, x, target="generic"), model, x).ok
    assert not check_lowered(lambda t: torch.zeros_like(model(t)), model, x).ok


def test_min_sqnr_db_sets_the_bound(lowered):
    name, model, x, program = lowered
    wrong = copy.deepcopy(program)
    _wrong_weight(wrong)
    sqnr = check_lowered(wrong, model, x).outputs[0].sqnr_db
    assert check_lowered(wrong, model, x, min_sqnr_db=sqnr - 1).ok
    assert not check_lowered(wrong, model, x, min_sqnr_db=sqnr + 1).ok
    with pytest.raises(TypeError, match="check_lowered: min_sqnr_db must be a number of dB, got '30'"):
        check_lowered(program, model, x, min_sqnr_db="30")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_a_nan_where_ours_is_a_number_fails(bad):
    model, x = _encoder_block(0)

    def nan_in_one_element(t):
        out = model(t).clone()
        out[0, 0, 0] = bad
        return out

    check = check_lowered(nan_in_one_element, model, x)
    assert check.problems() == ["output 0 is NaN or infinite where ours is a number, or the reverse"]


QUANTIZE = ["quantize", "--model", "tests.models.cli:tiny_mlp", "--example-input", "8x16", "--no-progress",
            "--preset", "w8a8"]


def _negated_weights(real):
    """to_qdq, then each int8 weight's codes negated: a lowering made wrong on purpose."""

    def lower(*args, **kwargs):
        result = real(*args, **kwargs)
        for t in _int8_weights(result[0] if isinstance(result, tuple) else result):  # to_qdq(..., summary=True)
            t.neg_()
        return result

    return lower


@pytest.mark.parametrize("flag", ["--target", "--pte"])
def test_cli_exits_1_with_one_line_when_the_check_fails(flag, capsys, tmp_path, monkeypatch):
    """The command prints the table, then one line, and exits 1."""
    import pt2e_fq.export as export
    from pt2e_fq.export.lowering import executorch

    if flag == "--target":
        monkeypatch.setattr(export, "to_qdq", _negated_weights(export.to_qdq))
        path, args = tmp_path / "m.pt2", ["--target", "xnnpack", "--out", str(tmp_path / "m.pt2")]
        what = f"the xnnpack q/dq program in {path}"
    else:
        pytest.importorskip("executorch.runtime", reason="executorch is not installed; pip install 'pt2e_fq[executorch]'")
        monkeypatch.setattr(executorch, "to_qdq", _negated_weights(executorch.to_qdq))
        path, args = tmp_path / "m.pte", ["--pte", str(tmp_path / "m.pte")]
        what = f"the ExecuTorch program {path}"
    rc, out, err = cli_main(capsys, *QUANTIZE, *args)
    assert rc == 1, err
    assert "SQNR dB" in out and path.is_file()  # the table; the file is kept
    # ExecuTorch's runtime logs lines of its own ("[cpuinfo_utils.cpp:71] ...").
    lines = [line for line in err.splitlines() if not line.startswith("[")]
    assert len(lines) == 1 and lines[0].startswith(
        f"pt2e-fq quantize: error: {what} differs from the fake-quant graph: output 0 "), err
    assert lines[0].endswith("(the file is written; the table above has each output)"), err


def test_cli_target_exits_0_when_the_check_passes(capsys, tmp_path):
    rc, out, err = cli_main(capsys, *QUANTIZE, "--target", "xnnpack", "--out", str(tmp_path / "m.pt2"))
    assert rc == 0 and err == "", err
