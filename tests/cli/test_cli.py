"""The pt2e-fq command: argument errors (a message, an exit status, never a
traceback), quantize runs on small models, and the demo end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.models import cli as cli_models
from tests.conftest import cli_main
import pytest
import torch
from tests.models.quantizer import sqnr_db, single_thread  # noqa: F401 (an autouse fixture: one thread)

import pt2e_fq
from pt2e_fq.cli import command

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args, script=False):
    """`python -m pt2e_fq ARGS` (script: the installed `pt2e-fq` console
    script) in a fresh process, from the repository root (so --model
    tests.models.cli:... imports)."""
    command = [str(Path(sys.executable).parent / "pt2e-fq")] if script else [sys.executable, "-m", "pt2e_fq"]
    env = dict(os.environ, PYTHONPATH="")
    return subprocess.run([*command, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


QUANTIZE = ["quantize", "--model", "tests.models.cli:tiny_mlp", "--example-input", "8x16", "--no-progress"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, args, status, message",
    [
        (False, ["quantize", "--model", "tests.models.cli:tiny_mlp", "--example-input", "8x16", "--preset", "w9"], 2,
         "pt2e-fq quantize: error: --preset: unknown preset 'w9'; allowed: w8a8, w4a8, w4a16, w8a16, fp8, mxfp8"),
        (True, ["quantize", "--model", "tests.models.cli:tiny_mlp"], 2, "required: --example-input"),
        (False, ["quantize", "--model", "tests.models.cli:broken", "--example-input", "8x16", "--preset", "w8a8"], 1,
         "pt2e-fq quantize: error: RuntimeError: boom: the factory failed"),
    ],
    ids=["usage", "argparse-console-script", "failure"],
)
def test_errors_in_a_fresh_process_have_no_traceback(script, args, status, message):
    result = run_cli(*args, script=script)
    assert result.returncode == status
    assert message in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_traceback_flag_shows_the_traceback(capsys):
    rc, _, err = cli_main(capsys, "quantize", "--model", "tests.models.cli:broken", "--example-input", "8x16",
                       "--preset", "w8a8", "--traceback")
    assert rc == 1
    assert "Traceback" in err and "boom: the factory failed" in err


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "tiny_mlp", "--example-input", "8x16", "--preset", "w8a8"],
         "--model: expected MODULE:FACTORY (e.g. mypkg.models:build), got 'tiny_mlp'"),
        (["--model", "no_such_module_xyz:build", "--example-input", "8x16", "--preset", "w8a8"],
         "--model: cannot import module 'no_such_module_xyz'"),
        (["--model", "tests.models.cli:missing", "--example-input", "8x16", "--preset", "w8a8"],
         "--model: module 'tests.models.cli' has no attribute 'missing'"),
        (["--model", "tests.models.cli:not_a_model", "--example-input", "8x16", "--preset", "w8a8"],
         "--model: tests.models.cli:not_a_model() returned a str, not a torch.nn.Module"),
        (["--model", "tests.models.cli:tiny_mlp", "--example-input", "8x", "--preset", "w8a8"],
         "--example-input: '8x' is neither a .pt file nor shapes"),
        (["--model", "tests.models.cli:tiny_mlp", "--example-input", "missing.pt", "--preset", "w8a8"],
         "--example-input: no such file 'missing.pt'"),
        (["--model", "tests.models.cli:tiny_mlp", "--example-input", "8x17", "--preset", "w8a8"],
         "--example-input: the model fails on inputs of shapes [(8, 17)]: RuntimeError"),
        (["--model", "tests.models.cli:tiny_mlp", "--example-input", "1x16", "--preset", "w8a8"],
         "--example-input: a batch (dimension 0) of 1, which torch.export fixes at 1: the program takes batch 1 "
         "only"),
        (["--model", "tests.models.cli:tiny_mlp", "--example-input", "8x16", "--config", "missing.yaml"],
         "--config: no such file 'missing.yaml'"),
        (["--model", "tests.models.cli:tiny_mlp", "--example-input", "8x16", "--preset", "w8a8", "--out", "m.onnx"],
         "--out: expected a .pt2 file name, got 'm.onnx'"),
        (["--model", "tests.models.cli:tiny_mlp", "--example-input", "8x16", "--preset", "w8a8", "--onnx", "m.pt2"],
         "--onnx: expected a .onnx file name, got 'm.pt2'"),
    ],
)
def test_quantize_argument_errors(capsys, args, message):
    rc, out, err = cli_main(capsys, "quantize", *args)
    assert rc == 2
    assert f"pt2e-fq quantize: error: {message}" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "w8a8", "--config", "c.yaml"], "argument --config: not allowed with argument --preset"),
        (["--qat-steps", "-1", "--preset", "w8a8"], "argument --qat-steps: expected an integer >= 0, got '-1'"),
        (["--qat-steps", "ten", "--preset", "w8a8"], "argument --qat-steps: expected an integer >= 0, got 'ten'"),
        (["--qat-loss", "l1", "--preset", "w8a8"], "argument --qat-loss: invalid choice: 'l1'"),
        ([], "one of the arguments --preset --config is required"),
        (["--preset", "w8a8", "--lr", "-0.1"],
         "argument --lr: expected a number > 0 and at most 3.403e+38 (float32), got '-0.1'"),
        (["--preset", "w8a8", "--lr", "1e39"],
         "argument --lr: expected a number > 0 and at most 3.403e+38 (float32), got '1e39'"),
    ],
)
def test_quantize_argparse_errors(capsys, args, message):
    rc, out, err = cli_main(capsys, *QUANTIZE, *args)
    assert rc == 2
    assert message in err


def test_config_file_errors(capsys, tmp_path):
    bad_key = _write(tmp_path / "bad.yaml", "global:\n  weight: {format: int8, granularty: per_tensor}\n")
    rc, _, err = cli_main(capsys, *QUANTIZE, "--config", bad_key)
    assert rc == 2 and "--config:" in err and "global.weight: unknown key 'granularty'" in err
    bad_suffix = _write(tmp_path / "config.txt", "global: null\n")
    rc, _, err = cli_main(capsys, *QUANTIZE, "--config", bad_suffix)
    assert rc == 2 and "unknown suffix '.txt'; allowed: .yaml, .yml, .json" in err
    bad_yaml = _write(tmp_path / "broken.yaml", "global: [unclosed\n")
    rc, _, err = cli_main(capsys, *QUANTIZE, "--config", bad_yaml)
    assert rc == 2 and f"--config: cannot read {bad_yaml!r}" in err


def test_calib_data_errors(capsys, tmp_path):
    path = tmp_path / "calib.pt"
    torch.save({"x": torch.zeros(2, 16)}, path)
    rc, _, err = cli_main(capsys, *QUANTIZE, "--preset", "w8a8", "--calib-data", str(path))
    assert rc == 2 and "holds a dict; expected a tensor or a non-empty list of batches" in err
    torch.save([torch.zeros(2, 16), "text"], path)
    rc, _, err = cli_main(capsys, *QUANTIZE, "--preset", "w8a8", "--calib-data", str(path))
    assert rc == 2 and "a model input must be a tensor or a tuple of tensors" in err
    path.write_text("not a torch file")
    rc, _, err = cli_main(capsys, *QUANTIZE, "--preset", "w8a8", "--calib-data", str(path))
    assert rc == 2 and "is not a torch file" in err


@pytest.mark.parametrize(
    "batches, message",
    [
        ([torch.zeros(4, 15)], "batch 0 of {path!r} has inputs [(4, 15) float32]; the model takes [(any, 16) float32]"),
        ([torch.zeros(4, 16), torch.zeros(4, 16, dtype=torch.float64)],
         "batch 1 of {path!r} has inputs [(4, 16) float64]; the model takes [(any, 16) float32]"),
        ([(torch.zeros(4, 16), torch.zeros(4, 16))],
         "batch 0 of {path!r} has inputs [(4, 16) float32, (4, 16) float32]; the model takes [(any, 16) float32]"),
        (torch.zeros(20, 3), "batch 0 of {path!r} has inputs [(8, 3) float32]; the model takes [(any, 16) float32]"),
    ],
    ids=["shape", "dtype", "count", "one-tensor"],
)
def test_calib_batches_must_match_the_example_but_for_the_batch_size(capsys, tmp_path, batches, message):
    path = tmp_path / "calib.pt"
    torch.save(batches, path)
    rc, _, err = cli_main(capsys, *QUANTIZE, "--preset", "w8a8", "--calib-data", str(path))
    assert rc == 2
    assert f"pt2e-fq quantize: error: --calib-data: {message.format(path=str(path))}" in err


def test_example_input_shapes():
    x, y = command.example_inputs("2x3,4")
    assert x.shape == (2, 3) and y.shape == (4,) and x.dtype == torch.float32


def test_calibration_tensor_is_split_into_example_sized_batches(tmp_path):
    path = tmp_path / "calib.pt"
    torch.save(torch.arange(20.0).reshape(20, 1), path)
    batches = command.batches_file(str(path), (torch.zeros(8, 1),))
    assert [b[0].shape[0] for b in batches] == [8, 8, 4]
    assert torch.equal(torch.cat([b[0] for b in batches]), torch.arange(20.0).reshape(20, 1))


def test_quantize_two_inputs_with_calibration_batches_and_qat(capsys, tmp_path):
    path = tmp_path / "calib.pt"
    g = torch.Generator().manual_seed(0)
    torch.save([(torch.randn(4, 8, generator=g), torch.randn(4, 6, generator=g)) for _ in range(3)], path)
    rc, out, err = cli_main(capsys, "quantize", "--model", "tests.models.cli:two_inputs", "--example-input", "4x8,4x6",
                         "--preset", "w4a8", "--calib-data", str(path), "--qat-steps", "3", "--no-progress")
    assert rc == 0, err


def test_quantize_writes_pt2_and_onnx_and_report_reads_the_pt2(capsys, tmp_path):
    """tiny_mlp (linear -> relu -> linear), calibrated on one tensor whose
    values run from -3 to 5: the input point's asymmetric int8 scale is
    (5 - (-3)) / 255."""
    calib, pt2, onnx_path = tmp_path / "calib.pt", tmp_path / "m.pt2", tmp_path / "m.onnx"
    torch.save(torch.linspace(-3, 5, 20 * 16).reshape(20, 16), calib)
    rc, out, err = cli_main(capsys, *QUANTIZE, "--preset", "w8a8", "--calib-data", str(calib),
                         "--out", str(pt2), "--onnx", str(onnx_path))
    assert rc == 0, err
    assert "weight of linear" in out and "output of relu, input of linear_1" in out
    assert f"saved {pt2}" in out and f"saved {onnx_path}" in out and "bit-exact" in out
    program = pt2e_fq.load(pt2)
    input_scale = next(v for k, v in program.state_dict.items() if k == "activation_post_process_0.scale")
    assert input_scale.item() == pytest.approx(8 / 255, rel=1e-6)
    x = torch.randn(5, 16)  # another batch size than the example's
    with torch.no_grad():
        reference, y = cli_models.tiny_mlp()(x), program.module()(x)
    assert sqnr_db(reference, y) > 30

    rc, out, err = cli_main(capsys, "report", str(pt2))
    assert rc == 0, err
    # Points: the input, two weights, relu's output (linear_1's input); the logits stay float (quantizers.presets).
    assert out.count("activation_post_process_") == 4
    assert "INT8 [-127, 127]" in out and "PerChannel(axis=0)" in out

    rc, out, err = cli_main(capsys, "report", str(pt2), "--example-input", "3x16")  # the batch is dynamic
    assert rc == 0 and out.count("activation_post_process_") == 4, err
    rc, _, err = cli_main(capsys, "report", str(pt2), "--example-input", "8x15")
    assert rc == 2
    assert "--example-input: the example has inputs [(8, 15) float32]; the model takes [(any, 16) float32]" in err


def test_report_errors(capsys, tmp_path):
    rc, _, err = cli_main(capsys, "report", str(tmp_path / "missing.pt2"))
    assert rc == 2 and "no such file" in err
    rc, _, err = cli_main(capsys, "report", "model.onnx")
    assert rc == 2 and "expected a .pt2 file name, got 'model.onnx'" in err
    bad = tmp_path / "bad.pt2"
    bad.write_text("not a program")
    rc, _, err = cli_main(capsys, "report", str(bad))
    assert rc == 2 and f"{str(bad)!r} is not a .pt2 archive (torch.export.save writes a zip file)" in err
    with zipfile.ZipFile(bad, "w") as archive:  # a zip, but no program in it
        archive.writestr("hello.txt", "hi")
    rc, _, err = cli_main(capsys, "report", str(bad))
    assert rc == 2 and f"cannot load {str(bad)!r} as a torch.export program" in err


@pytest.mark.slow
def test_report_load_failure_prints_no_traceback(tmp_path):
    # torch.export.load logs a traceback (a logging warning) before it raises.
    bad = tmp_path / "bad.pt2"
    with zipfile.ZipFile(bad, "w") as archive:
        archive.writestr("hello.txt", "hi")
    result = run_cli("report", str(bad))
    assert result.returncode == 2
    assert "cannot load" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_demo_end_to_end(tmp_path):
    """The demo, shorter (3 float epochs, 1 QAT epoch): a float CNN that
    learns the digits, PTQ w8a8 and QAT w4a8 close to it, the table and its
    files."""
    result = run_cli("demo", "--out", str(tmp_path), "--float-epochs", "3", "--qat-epochs", "1", "--no-progress")
    assert result.returncode == 0, result.stderr
    rows = {(r["model"], r["runs_in"]): r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    float_row = rows["float", "torch"]
    assert float_row["accuracy"] > 0.95  # 10 classes: chance is 0.1
    for model, floor in [("PTQ w8a8", 0.02), ("QAT w4a8", 0.03)]:
        assert rows[model, "torch"]["accuracy"] >= float_row["accuracy"] - floor
        # ONNX Runtime: the same predictions but where a float kernel's last bit moves a rounding.
        assert abs(rows[model, "ONNX Runtime"]["accuracy"] - rows[model, "torch"]["accuracy"]) <= 0.01
        assert (tmp_path / f"{model.lower().replace(' ', '_')}.pt2").is_file()
    # int8 / int4 weights in the ONNX files: well under the float file.
    assert rows["PTQ w8a8", "torch"]["onnx_bytes"] < 0.6 * float_row["onnx_bytes"]
    assert rows["QAT w4a8", "torch"]["onnx_bytes"] < rows["PTQ w8a8", "torch"]["onnx_bytes"]
    assert rows["QAT w4a8", "torch"]["step_ms"] > 0 and float_row["step_ms"] > 0
    table = (tmp_path / "results.md").read_text()
    assert table in result.stdout and "x float" in table
    assert "points bit-exact in ONNX Runtime" in result.stdout
    assert "weight of conv2d" in (tmp_path / "qat_w4a8_report.txt").read_text()


# -- every error is one line naming the argument, found before any work ----------


class DataDependent(torch.nn.Module):
    """torch.export cannot export it: a branch on a tensor's value."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return self.fc(-x)


class Opaque:
    """Not a tensor: torch.load(weights_only=True) refuses it."""


def _one_line_error(capsys, status, *args) -> str:
    rc, _, err = cli_main(capsys, *args)
    assert rc == status, err
    assert err.endswith("\n") and err.count("\n") == 1 and "Traceback" not in err, err
    return err[:-1]


def _saved(tmp_path, name, value) -> str:
    path = tmp_path / name
    torch.save(value, path)
    return str(path)


def test_example_input_errors_are_one_line_before_any_work(capsys, tmp_path):
    """tests.models.cli:broken (its factory raises) shows that no model was built."""
    broken = ["quantize", "--model", "tests.models.cli:broken", "--preset", "w8a8"]
    err = _one_line_error(capsys, 2, *broken, "--example-input", "0x16")
    assert err == ("pt2e-fq quantize: error: --example-input: '0x16' has a dimension of size 0 (an empty input, "
                   "nothing to calibrate on); every dimension must be >= 1")
    err = _one_line_error(capsys, 2, *broken, "--example-input", "100000000x100000000")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert err == (f"pt2e-fq quantize: error: --example-input: '100000000x100000000' needs {4 * 10**16:,} bytes of "
                   f"float32, more than this machine's {memory:,} bytes of memory; give smaller shapes")
    empty = _saved(tmp_path, "empty.pt", (torch.zeros(0, 16),))
    err = _one_line_error(capsys, 2, *broken, "--example-input", empty)
    assert err == (f"pt2e-fq quantize: error: --example-input: input 0 of {empty!r} is empty (shape (0, 16)); "
                   "every dimension must be >= 1")
    opaque = _saved(tmp_path, "opaque.pt", {"x": Opaque()})
    err = _one_line_error(capsys, 2, *broken, "--example-input", opaque)
    assert err == (f"pt2e-fq quantize: error: --example-input: {opaque!r} holds a {__name__}.Opaque; the file may "
                   "hold only tensors, in tuples, lists or dicts (it is read with torch.load(weights_only=True), "
                   "which runs no code from it)")
    assert "weights_only=False" not in err


@pytest.mark.parametrize(
    "value, message",
    [
        (torch.zeros(0, 16), "batch 0 of {path!r} is empty (shapes [(0, 16)]); calibration needs at least one sample "
                             "per batch"),
        ([torch.ones(4, 16), torch.zeros(0, 16)],
         "batch 1 of {path!r} is empty (shapes [(0, 16)]); calibration needs at least one sample per batch"),
        (torch.tensor(1.0), "{path!r} holds a 0-dim tensor (one number); expected a tensor whose first dimension is "
                            "the batch, or a list of batches"),
        (torch.ones(16, 16).index_put_((torch.tensor([1, 2, 9]), torch.tensor([0, 5, 5])),
                                       torch.tensor([float("nan"), float("inf"), -float("inf")])),
         "batch 0 of {path!r} holds 2 NaN or infinite value(s); calibration data must be finite"),
    ],
    ids=["empty-tensor", "empty-batch", "0-dim", "non-finite"],
)
def test_calib_data_errors_are_one_line(capsys, tmp_path, value, message):
    """Each was a ZeroDivisionError, a split error or a NaN `scale` error
    from deep in the flow. (The non-finite tensor splits into batches of 8:
    rows 1 and 2 in batch 0, row 9 in batch 1; the first is reported.)"""
    path = _saved(tmp_path, "calib.pt", value)
    err = _one_line_error(capsys, 2, *QUANTIZE, "--preset", "w8a8", "--calib-data", path)
    assert err == f"pt2e-fq quantize: error: --calib-data: {message.format(path=path)}"


def test_qat_validation_is_checked_like_calib_data(capsys, tmp_path):
    """--qat-validation needs --qat-steps (found before any work) and its
    file gets --calib-data's checks, named by its own flag."""
    good = _saved(tmp_path, "good.pt", torch.randn(16, 16))
    err = _one_line_error(capsys, 2, *QUANTIZE, "--preset", "w8a8", "--qat-validation", good)
    assert err == "pt2e-fq quantize: error: --qat-validation: it scores QAT; give --qat-steps N (N > 0) with it"
    bad = _saved(tmp_path, "bad.pt", torch.tensor([[float("nan")] * 16]))
    err = _one_line_error(capsys, 2, *QUANTIZE, "--preset", "w8a8", "--qat-steps", "2", "--qat-validation", bad)
    assert err == (f"pt2e-fq quantize: error: --qat-validation: batch 0 of {bad!r} holds 16 NaN or infinite "
                   "value(s); validation data must be finite")


def test_qat_validation_keeps_the_best_scored_state(capsys, tmp_path):
    """A QAT run at a rate that overshoots (--lr 0.05) with --qat-validation
    says which step's state it kept and the validation losses at the start and at the end."""
    g = torch.Generator().manual_seed(0)
    calib = _saved(tmp_path, "calib.pt", torch.randn(16, 16, generator=g))
    validation = _saved(tmp_path, "validation.pt", torch.randn(32, 16, generator=g))
    args = [a for a in QUANTIZE if a != "--no-progress"]
    rc, out, err = cli_main(capsys, *args, "--preset", "w4a8", "--calib-data", calib, "--qat-steps", "20",
                            "--lr", "0.05", "--qat-validation", validation)
    assert rc == 0, err
    kept = re.search(r"QAT: the state after step (\d+) of 20 kept: validation loss (\S+) \(at the start (\S+), "
                     r"after the last step (\S+)\)", out + err)
    assert kept, out + err
    best, start, last = map(float, kept.groups()[1:])
    assert best <= min(start, last)


def test_a_diverging_lr_is_named(capsys):
    """Was a `scale must be finite` ValueError from a fake-quant op."""
    err = _one_line_error(capsys, 2, *QUANTIZE, "--preset", "w8a8", "--qat-steps", "5", "--lr", "1e30")
    assert re.fullmatch(r"pt2e-fq quantize: error: --lr: QAT diverged \(QAT: (the loss became (nan|inf)|parameter "
                        r"\S+ became NaN or infinite) at step \d+\) at --lr 1e\+30; give a smaller --lr", err), err


@pytest.mark.parametrize("flag, name", [("--out", "m.pt2"), ("--onnx", "m.onnx")])
def test_output_paths_are_checked_before_any_work(capsys, tmp_path, flag, name):
    broken = ["quantize", "--model", "tests.models.cli:broken", "--example-input", "8x16", "--preset", "w8a8"]
    missing = tmp_path / "no" / name
    err = _one_line_error(capsys, 2, *broken, flag, str(missing))
    assert err == (f"pt2e-fq quantize: error: {flag}: cannot write {str(missing)!r}: no folder "
                   f"{str(missing.parent)!r}; create it first")
    folder = tmp_path / name
    folder.mkdir()
    err = _one_line_error(capsys, 2, *broken, flag, str(folder))
    assert err == f"pt2e-fq quantize: error: {flag}: cannot write {str(folder)!r}: it is a folder; give a file name"


def test_model_errors_are_one_line(capsys, tmp_path, monkeypatch):
    err = _one_line_error(capsys, 2, "quantize", "--model", "..x:y", "--example-input", "8x16", "--preset", "w8a8")
    assert err == ("pt2e-fq quantize: error: --model: expected MODULE:FACTORY, each a dotted Python name "
                   "(e.g. mypkg.models:build), got '..x:y'")
    (tmp_path / "raises_at_import.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.chdir(tmp_path)  # the current folder is importable
    err = _one_line_error(capsys, 2, "quantize", "--model", "raises_at_import:build", "--example-input", "8x16",
                          "--preset", "w8a8")
    assert err == ("pt2e-fq quantize: error: --model: importing 'raises_at_import' failed: RuntimeError: "
                   "boom at import")


@pytest.mark.slow
def test_a_model_torch_export_rejects_is_one_line_in_a_fresh_process():
    """torch.export printed the partial graph (twice) and a multi-line report."""
    result = run_cli("quantize", "--model", "tests.cli.test_cli:DataDependent", "--example-input", "8x16", "--preset", "w8a8",
                     "--no-progress")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "def forward" not in result.stderr, result.stderr
    assert result.stderr.startswith(
        f"pt2e-fq quantize: error: --model: torch.export cannot export DataDependent at {Path(__file__)}:")
    assert "(if x.sum() > 0:): GuardOnDataDependentSymNode: Could not guard on data-dependent expression" in (
        result.stderr)


def test_demo_out_naming_a_file_is_refused_before_any_work(capsys, tmp_path):
    path = tmp_path / "results.txt"
    path.write_text("keep me")
    err = _one_line_error(capsys, 2, "demo", "--out", str(path))
    assert err == (f"pt2e-fq demo: error: --out: {str(path)!r} is a file; give a folder for the demo's files "
                   "(created if missing)")
    assert path.read_text() == "keep me"


def test_argparse_and_yaml_errors_are_one_line(capsys, tmp_path):
    err = _one_line_error(capsys, 2, *QUANTIZE, "--preset", "w8a8", "--qat-steps", "x")
    assert err == ("pt2e-fq quantize: error: argument --qat-steps: expected an integer >= 0, got 'x' "
                   "(see pt2e-fq quantize --help)")
    err = _one_line_error(capsys, 2)
    assert err == "pt2e-fq: error: the following arguments are required: COMMAND (see pt2e-fq --help)"
    bad = _write(tmp_path / "bad.yaml", "global:\n  weight: {format: int8\n  bad: [\n")
    err = _one_line_error(capsys, 2, *QUANTIZE, "--config", bad)
    assert err == (f"pt2e-fq quantize: error: --config: cannot read {bad!r}: expected ',' or '}}', but got ':' "
                   "at line 3, column 6 (while parsing a flow mapping)")


def test_any_other_failure_is_one_line_with_exit_status_1(capsys):
    err = _one_line_error(capsys, 1, "quantize", "--model", "tests.models.cli:broken", "--example-input", "8x16",
                          "--preset", "w8a8")
    assert err == "pt2e-fq quantize: error: RuntimeError: boom: the factory failed (--traceback for details)"


def test_a_plain_preset_runs_its_defaults(capsys, tmp_path):
    """`quantize --preset w4a8` on a CNN is pipeline.quantize's preset
    default, as the one-call Python entry: the first conv, the depthwise
    conv and the classifier keep int8 weights (presets.int8_edges), the
    pointwise conv has int4 groups."""
    calib = tmp_path / "calib.pt"
    torch.save(torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0)), calib)
    rc, out, err = cli_main(capsys, "quantize", "--model", "tests.models.cli:tiny_cnn", "--example-input", "2x3x8x8",
                            "--no-progress", "--preset", "w4a8", "--calib-data", str(calib))
    assert rc == 0, err
    formats = {m.group(1): m.group(2) for m in re.finditer(r"weight of (\w+)\s+(INT\d)", out)}
    assert formats == {"conv2d": "INT8", "conv2d_1": "INT8", "conv2d_2": "INT4", "linear": "INT8"}, out


def test_a_batch_of_one_with_static_batch_quantizes_a_program_of_that_batch(capsys, tmp_path):
    out = tmp_path / "m.pt2"
    rc, _, err = cli_main(capsys, "quantize", "--model", "tests.models.cli:tiny_mlp", "--example-input", "1x16",
                          "--preset", "w8a8", "--static-batch", "--no-progress", "--out", str(out))
    assert rc == 0, err
    program = pt2e_fq.load(out)
    assert program.module()(torch.randn(1, 16)).shape == (1, 4)
