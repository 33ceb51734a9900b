"""Files that are missing, of another kind or damaged: one error naming the
path and what is wrong.

- A `.pte` given to check_lowered or run_pte: "no such file" or "not an
  ExecuTorch program" with the path, not ExecuTorch's error codes
  ("error: 0x:22", "0x:23").
- A `--example-input` / `--calib-data` file of the command that is not a
  torch file: one line saying so, never torch's advice to retry with
  weights_only=False (which would run code from the file).
"""

from __future__ import annotations

import pickle
import re

from tests.models import cli as cli_models
import pytest
import torch
from tests.conftest import cli_main
from tests.models.quantizer import single_thread  # noqa: F401 (an autouse fixture: one thread)

from pt2e_fq.cli import pipeline
from pt2e_fq.export import check_lowered, run_pte, to_executorch

try:
    import executorch.runtime  # noqa: F401

    MISSING = None
except ImportError as e:  # make test installs the extra; a bare checkout may not have it
    MISSING = f"executorch is not installed ({e}); pip install 'pt2e_fq[executorch]'"

needs_executorch = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

X = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def converted():
    return pipeline.quantize(cli_models.tiny_mlp().eval(), (X,), "w8a8", progress=False)


@pytest.fixture(scope="module")
def pte(converted, tmp_path_factory):
    path = tmp_path_factory.mktemp("pte") / "mlp.pte"
    to_executorch(converted, (X,), path)
    return path


def _bad_pte(kind, pte, folder):
    """(the path, the error's type, its message after "<caller>: ")."""
    if kind == "missing":
        path = folder / "missing.pte"
        return path, FileNotFoundError, f"no such file {str(path)!r}"
    if kind == "folder":
        return folder, IsADirectoryError, f"{str(folder)!r} is a folder; give a .pte file"
    path = folder / f"{kind}.pte"
    data = pte.read_bytes()
    if kind == "truncated":  # ExecuTorch's identifier, half of its program
        path.write_bytes(data[: len(data) // 2])
        return path, ValueError, f"{str(path)!r} is not an ExecuTorch program, or is damaged (ExecuTorch: "
    if kind == "text":
        path.write_text("not a program")
    elif kind == "torch":
        torch.save(X, path)
    else:
        path.write_bytes(b"")
    identifier = path.read_bytes()[4:8]
    return path, ValueError, (f"{str(path)!r} is not an ExecuTorch program (a .pte file carries the identifier "
                              f"ET<version> at byte 4; this one has {identifier!r})")


KINDS = ["missing", "folder", "text", "torch", "empty", "truncated"]


@needs_executorch
@pytest.mark.parametrize("kind", KINDS)
def test_run_pte_names_a_missing_or_foreign_file(kind, pte, tmp_path):
    path, error, message = _bad_pte(kind, pte, tmp_path)
    with pytest.raises(error, match="^" + re.escape(f"run_pte: {message}")):
        run_pte(path, (X,))


@needs_executorch
@pytest.mark.parametrize("kind", KINDS)
def test_check_lowered_names_a_missing_or_foreign_pte(kind, pte, converted, tmp_path):
    path, error, message = _bad_pte(kind, pte, tmp_path)
    caller = "run_pte" if kind == "truncated" else "check_lowered"  # found by the runtime, not by the header
    with pytest.raises(error, match="^" + re.escape(f"{caller}: {message}")):
        check_lowered(path, converted, (X,))


@needs_executorch
def test_the_good_file_runs(pte, converted):
    """The reference for the cases above: the same file, whole, runs."""
    assert check_lowered(pte, converted, (X,)).outputs[0].numel == X.shape[0] * 4


def _legacy_header_then_garbage(path):
    """torch.save's legacy format starts with a pickle of its magic number."""
    path.write_bytes(pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=2) + b"garbage after the header")


@pytest.mark.parametrize("flag", ["--example-input", "--calib-data"])
@pytest.mark.parametrize(
    "write",
    [lambda p: p.write_text("garbage, not a torch file"),
     lambda p: p.write_bytes(bytes(range(256)) * 4),
     lambda p: p.write_bytes(pickle.dumps([1.0, 2.0])),
     lambda p: (torch.save(X, p), p.write_bytes(p.read_bytes()[:200]))],
    ids=["text", "bytes", "plain-pickle", "truncated-torch-file"],
)
def test_cli_a_file_that_is_not_a_torch_file_is_one_line(flag, write, capsys, tmp_path):
    path = tmp_path / "inputs.pt"
    write(path)
    args = {"--example-input": ["--example-input", str(path)],
            "--calib-data": ["--example-input", "4x16", "--calib-data", str(path)]}[flag]
    rc, _, err = cli_main(capsys, "quantize", "--model", "tests.models.cli:tiny_mlp", *args, "--preset", "w8a8",
                          "--no-progress")
    assert rc == 2
    assert err.splitlines() == [
        f"pt2e-fq quantize: error: {flag}: {str(path)!r} is not a torch file (torch.save writes a zip archive; this "
        "file is not one, or is damaged); save the inputs with torch.save"]


def test_cli_a_torch_file_the_safe_loader_refuses_names_the_reason_not_the_unsafe_retry(capsys, tmp_path):
    path = tmp_path / "inputs.pt"
    _legacy_header_then_garbage(path)
    rc, _, err = cli_main(capsys, "quantize", "--model", "tests.models.cli:tiny_mlp", "--example-input", str(path),
                          "--preset", "w8a8")
    assert rc == 2
    assert "weights_only` set to `False`" not in err and "weights_only=False" not in err
    assert re.fullmatch(re.escape(f"pt2e-fq quantize: error: --example-input: cannot load {str(path)!r} with "
                                  "torch.load(weights_only=True), which runs no code from the file: ") +
                        r"Unsupported operand \d+\n", err), err


def test_cli_a_torch_file_in_the_legacy_format_still_loads(capsys, tmp_path):
    path = tmp_path / "inputs.pt"
    torch.save(X, path, _use_new_zipfile_serialization=False)
    rc, out, err = cli_main(capsys, "quantize", "--model", "tests.models.cli:tiny_mlp", "--example-input", str(path),
                            "--preset", "w8a8", "--no-progress")
    assert rc == 0, err
