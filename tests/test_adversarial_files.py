"""Hostile file-system conditions for every file pt2e_fq writes (issue 16,
item 16): a full disk, a failing writer, a folder or a missing folder at the
path, a symbolic link. A failed write is one clear error (the CLI: one line,
exit status 1, no traceback, no abort) and a good file already at the path
survives; a successful write replaces the file whole.

/dev/full (every write fails with ENOSPC) stands in for a full disk, reached
through a link with the file name the API expects.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
from pathlib import Path

import cli_models
import pytest
import torch
from quantizer_models import single_thread  # noqa: F401 (an autouse fixture: one thread)

import pt2e_fq
from pt2e_fq.app import cli, pipeline
from pt2e_fq.export import to_onnx
from pt2e_fq.files import WriteError

TESTS = Path(__file__).parent
OLD = b"a good file from an earlier run"
FULL = Path("/dev/full")
needs_dev_full = pytest.mark.skipif(not FULL.is_char_device(), reason="no /dev/full on this system")
ENOSPC = os.strerror(errno.ENOSPC)


@pytest.fixture(scope="module")
def converted():
    """(tiny_mlp quantized w8a8 and converted, its example input)."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    return pipeline.quantize(cli_models.tiny_mlp(), (x,), "w8a8", progress=False), x


def _old_file(path: Path) -> Path:
    path.write_bytes(OLD)
    return path


def _entries(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def _link_to_dev_full(tmp_path: Path, name: str) -> Path:
    link = tmp_path / name
    link.symlink_to(FULL)
    return link


def _failing_writer(what):
    """A writer that writes the start of a file, then fails as a full disk
    does: it takes a path or a file object, as torch.export.save and
    ONNXProgram.save do."""

    def write(*args, **kwargs):
        destination = next(a for a in args if isinstance(a, (str, os.PathLike)) or hasattr(a, "write"))
        if hasattr(destination, "write"):
            destination.write(b"PK\x03\x04 truncated " + what.encode())
        else:
            Path(destination).write_bytes(b"PK\x03\x04 truncated " + what.encode())
        raise OSError(errno.ENOSPC, ENOSPC)

    return write


def test_a_failed_pt2_write_keeps_the_old_file(converted, tmp_path, monkeypatch):
    model, x = converted
    path = _old_file(tmp_path / "model.pt2")
    monkeypatch.setattr(torch.export, "save", _failing_writer(".pt2"))
    with pytest.raises(WriteError, match=rf"^cannot write {str(path)!r}: {ENOSPC}; the file already there is unchanged$"):
        pt2e_fq.save(model, (x,), path)
    assert path.read_bytes() == OLD
    assert _entries(tmp_path) == {"model.pt2"}  # no temporary file left behind


def test_a_failed_onnx_write_keeps_the_old_file(converted, tmp_path, monkeypatch):
    model, x = converted
    path = _old_file(tmp_path / "model.onnx")
    monkeypatch.setattr(torch.onnx.ONNXProgram, "save", _failing_writer(".onnx"))
    with pytest.raises(WriteError, match=rf"^cannot write {str(path)!r}: {ENOSPC}; the file already there is unchanged$"):
        to_onnx(model, (x,), path)
    assert path.read_bytes() == OLD
    assert _entries(tmp_path) == {"model.onnx"}


def test_an_exception_in_the_writer_propagates_and_leaves_nothing(converted, tmp_path, monkeypatch):
    """Not a write failure (a bug, an interrupt): the exception itself, and
    still no truncated file."""
    model, x = converted
    path = _old_file(tmp_path / "model.pt2")

    def interrupted(ep, f, **kwargs):
        f.write(b"PK\x03\x04")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch.export, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pt2e_fq.save(model, (x,), path)
    assert path.read_bytes() == OLD and _entries(tmp_path) == {"model.pt2"}


@needs_dev_full
def test_save_to_a_full_disk_is_an_error_not_an_abort(tmp_path):
    """torch's archive writer aborts the process (SIGABRT) on a failed disk
    write; pt2e_fq.save must raise instead. In a fresh process, so that an
    abort cannot take the test run with it."""
    link = _link_to_dev_full(tmp_path, "model.pt2")
    script = (
        "import torch, pt2e_fq\n"
        "from pt2e_fq.files import WriteError\n"
        "try:\n"
        f"    pt2e_fq.save(torch.nn.Linear(4, 2), (torch.randn(2, 4),), {str(link)!r})\n"
        "except WriteError as e:\n"
        "    print('WriteError:', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"WriteError: cannot write {str(link)!r}: {ENOSPC}" in result.stdout


@needs_dev_full
def test_to_onnx_to_a_full_disk_is_a_write_error(converted, tmp_path):
    model, x = converted
    link = _link_to_dev_full(tmp_path, "model.onnx")
    with pytest.raises(WriteError, match=rf"^cannot write {str(link)!r}: {ENOSPC}$"):
        to_onnx(model, (x,), link)
    assert link.is_symlink() and FULL.is_char_device()  # the device is written into, never replaced


def test_save_replaces_the_file_whole_keeping_its_permissions_and_links(converted, tmp_path):
    model, x = converted
    path = _old_file(tmp_path / "model.pt2")
    path.chmod(0o640)
    link = tmp_path / "latest.pt2"
    link.symlink_to(path.name)
    pt2e_fq.save(model, (x,), link)
    assert link.is_symlink() and os.readlink(link) == path.name  # the link still points at the file
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert _entries(tmp_path) == {"model.pt2", "latest.pt2"}
    with torch.no_grad():
        assert torch.equal(pt2e_fq.load(path).module()(x), model(x))


def test_a_new_file_gets_the_umask_permissions(converted, tmp_path):
    model, x = converted
    umask = os.umask(0o022)
    try:
        pt2e_fq.save(model, (x,), tmp_path / "model.pt2")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "model.pt2").stat().st_mode) == 0o644


@pytest.mark.parametrize("writer", ["save", "to_onnx"])
def test_a_folder_or_a_missing_folder_is_refused_before_the_export(writer, tmp_path):
    """Checked first: a model torch.export cannot export shows that no work was done."""

    class Unexportable(torch.nn.Module):
        def forward(self, x):
            return x.item()

    write = pt2e_fq.save if writer == "save" else to_onnx
    with pytest.raises(WriteError, match=rf"^cannot write {str(tmp_path)!r}: it is a folder; give a file name$"):
        write(Unexportable(), (torch.randn(1),), tmp_path)
    missing = tmp_path / "no" / "model.file"
    with pytest.raises(WriteError, match=rf"^cannot write {str(missing)!r}: no folder {str(missing.parent)!r}; "
                                         "create it first$"):
        write(Unexportable(), (torch.randn(1),), missing)


def _run_cli(*args):
    env = dict(os.environ, PYTHONPATH="")
    return subprocess.run([sys.executable, "-m", "pt2e_fq", *args], cwd=TESTS, env=env, capture_output=True,
                          text=True, timeout=600)


@needs_dev_full
@pytest.mark.parametrize("flag, name", [("--out", "model.pt2"), ("--onnx", "model.onnx")])
def test_cli_quantize_to_a_full_disk_exits_1_with_one_line(flag, name, tmp_path):
    link = _link_to_dev_full(tmp_path, name)
    result = _run_cli("quantize", "--model", "cli_models:tiny_mlp", "--example-input", "8x16", "--preset", "w8a8",
                      "--no-progress", flag, str(link))
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr == f"pt2e-fq quantize: error: cannot write {str(link)!r}: {ENOSPC}\n"


def test_cli_quantize_failed_write_keeps_the_old_file(tmp_path, monkeypatch, capsys):
    path = _old_file(tmp_path / "model.pt2")
    monkeypatch.setattr(torch.export, "save", _failing_writer(".pt2"))
    rc = cli.main(["quantize", "--model", "cli_models:tiny_mlp", "--example-input", "8x16", "--preset", "w8a8",
                   "--no-progress", "--out", str(path)])
    err = capsys.readouterr().err
    assert rc == 1
    assert err == f"pt2e-fq quantize: error: cannot write {str(path)!r}: {ENOSPC}; the file already there is unchanged\n"
    assert path.read_bytes() == OLD and _entries(tmp_path) == {"model.pt2"}


@needs_dev_full
def test_demo_to_a_full_disk_exits_1_with_one_line(tmp_path):
    link = _link_to_dev_full(tmp_path, "float.pt2")  # the demo's first file
    result = _run_cli("demo", "--out", str(tmp_path), "--float-epochs", "1", "--qat-epochs", "1", "--no-progress")
    assert result.returncode == 1
    assert result.stderr == f"pt2e-fq demo: error: cannot write {str(link)!r}: {ENOSPC}\n"
