"""pt2e-fq quantize --target / --pte: the q/dq program and the ExecuTorch file
the CLI writes, run against the fake-quant .pt2 it writes beside them."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import cli_main as _main
from tests.cli.test_cli import QUANTIZE
from tests.export.test_export_executorch import needs_executorch

import pt2e_fq
from quantizers import presets

qd = torch.ops.quantized_decomposed


@pytest.mark.slow
def test_target_x86_inductor_saves_a_qdq_program_within_one_step_of_the_fake_quant_one(capsys, tmp_path):
    fq, lowered = tmp_path / "fq.pt2", tmp_path / "x86.pt2"
    # w8a8 on every tensor, so the output has a step to bound the difference by (the preset leaves it float).
    config = tmp_path / "every.yaml"
    presets.every_point("w8a8").save(config)
    rc, _, err = _main(capsys, *QUANTIZE, "--config", str(config), "--out", str(fq))
    assert rc == 0, err
    rc, out, err = _main(capsys, *QUANTIZE, "--config", str(config), "--out", str(lowered), "--target", "x86_inductor")
    assert rc == 0, err
    assert "x86_inductor q/dq program against the fake-quant graph" in out and "max diff (steps)" in out
    program, reference = pt2e_fq.load(lowered), pt2e_fq.load(fq)
    ops = {n.target for n in program.graph.nodes if n.op == "call_function"}
    assert qd.quantize_per_tensor.default in ops and not any(str(t).startswith("pt2e_fq.") for t in ops)
    x = torch.randn(5, 16)  # another batch size than the example's: the batch stays dynamic
    out_scale = reference.state_dict["activation_post_process_4.scale"]
    with torch.no_grad():
        diff = (program.module()(x) - reference.module()(x)).abs()
    assert (diff <= out_scale * (1 + 1e-3)).all()


def test_bad_target_and_pte_arguments(capsys, tmp_path):
    rc, _, err = _main(capsys, *QUANTIZE, "--preset", "w8a8", "--target", "tpu")
    assert rc == 2 and "invalid choice: 'tpu'" in err and "x86_inductor" in err
    rc, _, err = _main(capsys, *QUANTIZE, "--preset", "w8a8", "--pte", str(tmp_path / "m.onnx"))
    assert rc == 2 and "--pte: expected a .pte file name" in err
    rc, _, err = _main(capsys, *QUANTIZE, "--preset", "w4a8", "--pte", str(tmp_path / "m.pte"),
                       "--unsupported", "keep")
    if rc == 2 and "executorch" in err and "pip install" in err:
        pytest.skip(f"executorch is not installed: {err.strip()}")
    assert rc == 2 and "--unsupported keep leaves pt2e_fq ops" in err


@pytest.mark.slow
@needs_executorch
def test_pte_is_written_and_checked_in_executorch(capsys, tmp_path):
    pte = tmp_path / "m.pte"
    rc, out, err = _main(capsys, *QUANTIZE, "--preset", "w8a8", "--pte", str(pte))
    assert rc == 0, err
    assert pte.stat().st_size > 0
    # With --pte the preset goes on every tensor (presets.every_point): the logits' point makes 5.
    assert f"saved {pte}: 5 point(s) as q/dq" in out and "outside: none" in out
    assert "ExecuTorch against the fake-quant graph" in out
    # w4a8's groups of 32 cover each weight row (16 and 32 inputs): per-channel int4, which XNNPACK takes.
    rc, out, err = _main(capsys, *QUANTIZE, "--preset", "w4a8", "--pte", str(pte))
    assert rc == 0, err
    assert "5 point(s) as q/dq, 0 weight(s) in float" in out and "outside: none" in out


@pytest.mark.slow
@needs_executorch
def test_pte_puts_a_point_between_a_linear_and_its_gelu(capsys, tmp_path):
    # --pte quantizes with presets.every_point(preset, target="xnnpack"): the first
    # linear's output is quantized before the GELU (XNNPACK fuses no GELU), so
    # XNNPACK runs both linears in int8 and no weight is left in float.
    pte = tmp_path / "m.pte"
    args = ["quantize", "--model", "tests.models.cli:gelu_mlp", "--example-input", "8x16", "--no-progress"]
    rc, out, err = _main(capsys, *args, "--preset", "w8a8", "--pte", str(pte))
    assert rc == 0, err
    # input, 2 weights, linear output, GELU output (the second linear's input), the logits
    assert f"saved {pte}: 6 point(s) as q/dq, 0 weight(s) in float" in out and "outside: none" in out, out
    # The generic every-point layout (the point after the GELU) leaves the first linear in float.
    config = tmp_path / "every.yaml"
    presets.every_point("w8a8").save(config)
    rc, out, err = _main(capsys, *args, "--config", str(config), "--pte", str(pte))
    assert rc == 0, err
    assert f"saved {pte}: 4 point(s) as q/dq, 1 weight(s) in float" in out, out


def test_a_preset_is_laid_out_for_the_target():
    import argparse

    from pt2e_fq.cli.command import quantizer_config

    def config(**kw):
        return quantizer_config(argparse.Namespace(**{"preset": "w8a8", "config": None, "pte": None,
                                                      "target": "fake_quant", **kw}))

    assert config() == presets.get_preset("w8a8")
    assert config(target="generic") == presets.get_preset("w8a8")
    assert config(target="x86_inductor") == presets.get_preset("w8a8", target="x86_inductor")
    assert config(target="xnnpack") == presets.every_point("w8a8", target="xnnpack")
    assert config(pte="m.pte") == presets.every_point("w8a8", target="xnnpack")
    # XNNPACK's dynamically quantized linears have float outputs: a -dyn preset as it is, laid out
    # for XNNPACK (w4a8-dyn's group scales in bfloat16, as it stores them).
    assert config(preset="w4a8-dyn", pte="m.pte") == presets.get_preset("w4a8-dyn", target="xnnpack")
    assert config(preset="w4a8-dyn", pte="m.pte").global_config.weight.scale_dtype is torch.bfloat16
    assert config(preset="w8a8-dyn", target="xnnpack") == presets.get_preset("w8a8-dyn")


def test_report_of_a_lowered_qdq_program_lists_its_points_as_the_fake_quant_one_does(capsys, tmp_path):
    """A q/dq program has quantize / dequantize ops where the fake-quant
    program had points: the same rows and weight bytes, read from them."""
    fq, lowered = tmp_path / "fq.pt2", tmp_path / "qdq.pt2"
    rc, _, err = _main(capsys, *QUANTIZE, "--preset", "w8a8", "--out", str(fq))
    assert rc == 0, err
    rc, _, err = _main(capsys, *QUANTIZE, "--preset", "w8a8", "--out", str(lowered), "--target", "generic")
    assert rc == 0, err
    program = pt2e_fq.load(lowered)
    assert not [n for n in program.graph.nodes if str(n.target).startswith("pt2e_fq.")]
    tables = {}
    for path in (fq, lowered):
        rc, out, err = _main(capsys, "report", str(path))
        assert rc == 0, err
        tables[path] = out.strip().splitlines()
    fq_lines, qdq_lines = tables[fq], tables[lowered]
    assert qdq_lines[0].split() == fq_lines[0].split()  # the same columns
    # tiny_mlp: linears 32x16 and 4x32 with biases; int8 codes, an fp32 scale and an int8 zero point per row.
    float_bytes, quantized = (512 + 32 + 128 + 4) * 4, (512 + 128) + 36 * (4 + 1) + 36 * 4
    summary = f"weights: {float_bytes:,} bytes in float, {quantized:,} bytes quantized ({100 * quantized / float_bytes:.1f}%)"
    assert qdq_lines[-1] == fq_lines[-1] == summary
    weights = [line for line in qdq_lines if "weight of" in line]
    assert len(weights) == 2
    assert all("INT8 [-127, 127] symmetric" in line and "PerChannel(axis=0)" in line for line in weights)
    assert sum(" input of " in line for line in qdq_lines) == sum(" input of " in line for line in fq_lines) == 2
    assert qdq_lines[-2].startswith("note: n/a: 2 weight(s) held as integer codes")
