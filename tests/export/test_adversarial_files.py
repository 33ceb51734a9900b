"""The files pt2e_fq writes, under hostile conditions.

A full disk, a failing writer, a folder or a missing
folder at the path, a symbolic link. A failed write is one clear error (the
CLI: one line, exit status 1, no traceback, no abort) and a good file
already at the path survives; a successful write replaces the file whole.
/dev/full (every write fails with ENOSPC) stands in for a full disk, reached
through a link with the file name the API expects.

A .pt2 whose program returns a transformers ModelOutput
loads in a fresh process; an output type no other process could find is
refused at save time.
"""

from __future__ import annotations

import errno
import re
import os
import textwrap
import stat
import subprocess
import sys
from pathlib import Path

from tests.models import cli as cli_models
import pytest
import torch
import torch.utils._pytree as pytree
from tests.models.quantizer import single_thread  # noqa: F401 (an autouse fixture: one thread)

import pt2e_fq
from pt2e_fq.cli import command, pipeline
from pt2e_fq.export import to_onnx
from pt2e_fq.files import WriteError, write_bytes

ROOT = Path(__file__).resolve().parents[2]
OLD = b"a good file from an earlier run"
FULL = Path("/dev/full")
needs_dev_full = pytest.mark.skipif(not FULL.is_char_device(), reason="no /dev/full on this system")
ENOSPC = os.strerror(errno.ENOSPC)
KEPT = "the file already there is unchanged"


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
    with pytest.raises(WriteError, match=rf"^cannot write {str(path)!r}: {ENOSPC}; {KEPT}$"):
        pt2e_fq.save(model, (x,), path)
    assert path.read_bytes() == OLD
    assert _entries(tmp_path) == {"model.pt2"}  # no temporary file left behind


def test_a_failed_onnx_write_keeps_the_old_file(converted, tmp_path, monkeypatch):
    model, x = converted
    path = _old_file(tmp_path / "model.onnx")
    monkeypatch.setattr(torch.onnx.ONNXProgram, "save", _failing_writer(".onnx"))
    with pytest.raises(WriteError, match=rf"^cannot write {str(path)!r}: {ENOSPC}; {KEPT}$"):
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


@pytest.mark.slow
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


needs_name_max_255 = pytest.mark.skipif(os.pathconf("/tmp", "PC_NAME_MAX") != 255 if hasattr(os, "pathconf") else True,
                                        reason="file names of other lengths on this system")


@needs_name_max_255
def test_a_file_name_near_the_limit_is_written_and_one_past_it_refused_first(converted, tmp_path):
    """251 bytes is a valid name: the temporary file beside it must fit too.
    256 bytes is refused before the export, naming the length."""
    model, x = converted
    path = _old_file(tmp_path / ("m" * 247 + ".pt2"))
    pt2e_fq.save(model, (x,), path)
    assert _entries(tmp_path) == {path.name}
    with torch.no_grad():
        assert torch.equal(pt2e_fq.load(path).module()(x), model(x))
    write_bytes(tmp_path / ("é" * 125 + ".txt"), b"ok")  # 254 bytes in UTF-8, 129 characters
    assert (tmp_path / ("é" * 125 + ".txt")).read_bytes() == b"ok"

    class Unexportable(torch.nn.Module):
        def forward(self, x):
            return x.item()

    too_long = tmp_path / ("m" * 252 + ".pt2")
    with pytest.raises(WriteError, match=rf"^cannot write {str(too_long)!r}: the file name is 256 bytes long, the "
                                         "folder takes names of at most 255 bytes; give a shorter name$"):
        pt2e_fq.save(Unexportable(), (torch.randn(1),), too_long)


def test_a_failed_clean_up_does_not_replace_the_write_error(converted, tmp_path, monkeypatch):
    model, x = converted
    path = _old_file(tmp_path / "model.pt2")
    monkeypatch.setattr(torch.export, "save", _failing_writer(".pt2"))

    def unlink_fails(self, missing_ok=False):
        raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(self))

    monkeypatch.setattr(Path, "unlink", unlink_fails)
    with pytest.raises(WriteError, match=rf"^cannot write {str(path)!r}: {ENOSPC}; {KEPT}$"):
        pt2e_fq.save(model, (x,), path)
    assert path.read_bytes() == OLD


def _run_cli(*args):
    env = dict(os.environ, PYTHONPATH="")
    return subprocess.run([sys.executable, "-m", "pt2e_fq", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
@needs_dev_full
@pytest.mark.parametrize("flag, name", [("--out", "model.pt2"), ("--onnx", "model.onnx")])
def test_cli_quantize_to_a_full_disk_exits_1_with_one_line(flag, name, tmp_path):
    link = _link_to_dev_full(tmp_path, name)
    result = _run_cli("quantize", "--model", "tests.models.cli:tiny_mlp", "--example-input", "8x16", "--preset", "w8a8",
                      "--no-progress", flag, str(link))
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr == f"pt2e-fq quantize: error: cannot write {str(link)!r}: {ENOSPC}\n"


def test_cli_quantize_failed_write_keeps_the_old_file(tmp_path, monkeypatch, capsys):
    path = _old_file(tmp_path / "model.pt2")
    monkeypatch.setattr(torch.export, "save", _failing_writer(".pt2"))
    rc = command.main(["quantize", "--model", "tests.models.cli:tiny_mlp", "--example-input", "8x16", "--preset", "w8a8",
                   "--no-progress", "--out", str(path)])
    err = capsys.readouterr().err
    assert rc == 1
    assert err == f"pt2e-fq quantize: error: cannot write {str(path)!r}: {ENOSPC}; {KEPT}\n"
    assert path.read_bytes() == OLD and _entries(tmp_path) == {"model.pt2"}


@pytest.mark.slow
@needs_dev_full
def test_demo_to_a_full_disk_exits_1_with_one_line(tmp_path):
    link = _link_to_dev_full(tmp_path, "float.pt2")  # the demo's first file
    result = _run_cli("demo", "--out", str(tmp_path), "--float-epochs", "1", "--qat-epochs", "1", "--no-progress")
    assert result.returncode == 1
    assert result.stderr == f"pt2e-fq demo: error: cannot write {str(link)!r}: {ENOSPC}\n"


# -- programs another process must load -----------------------------------------------


def _tiny_bert():
    """A BERT of one layer from a config (no download), and token ids."""
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16)
    torch.manual_seed(0)
    return BertModel(config).eval(), torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))


@pytest.mark.slow
def test_a_transformers_model_output_program_loads_in_a_fresh_process(tmp_path):
    """torch.export.load of a program returning a ModelOutput failed in a
    fresh process ("... in pytree is not registered"): the type registers
    only when transformers.modeling_outputs is imported. pt2e_fq.load
    imports it; the loaded program returns the same ModelOutput with the
    values the saving process computed, for the float and the w8a8 model."""
    model, ids = _tiny_bert()
    converted = pipeline.quantize(model, (ids,), "w8a8", progress=False)
    expected = {}
    for name, m in [("float", model), ("w8a8", converted)]:
        pt2e_fq.save(m, (ids,), tmp_path / f"{name}.pt2")
        with torch.no_grad():
            out = m(ids)
        expected[name] = (type(out).__module__ + "." + type(out).__name__, out.last_hidden_state, out.pooler_output)
    torch.save({"ids": ids, "expected": expected}, tmp_path / "expected.pt")
    script = textwrap.dedent(f"""
        import sys, torch, pt2e_fq
        assert "transformers" not in sys.modules  # pt2e_fq.load must import what the file needs
        data = torch.load({str(tmp_path / "expected.pt")!r})
        for name, (kind, hidden, pooled) in data["expected"].items():
            out = pt2e_fq.load({str(tmp_path)!r} + f"/{{name}}.pt2").module()(data["ids"])
            assert type(out).__module__ + "." + type(out).__name__ == kind, type(out)
            assert torch.equal(out.last_hidden_state, hidden) and torch.equal(out.pooler_output, pooled), name
            print("loaded", name, kind)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    kind = "transformers.modeling_outputs.BaseModelOutputWithPoolingAndCrossAttentions"
    assert result.stdout.splitlines() == [f"loaded float {kind}", f"loaded w8a8 {kind}"]


class _Pair:
    def __init__(self, a, b):
        self.a, self.b = a, b


class _PairModel(torch.nn.Module):
    def forward(self, x):
        return _Pair(x + 1, x * 2)


@pytest.mark.parametrize(
    "module, serialized_type_name, message",
    [
        ("__main__", "__main__._Pair",
         "save: the program's outputs contain a __main__._Pair, registered as pytree node '__main__._Pair', whose "
         "module '__main__' another process cannot import to load the file; define and register _Pair in an "
         "importable module, or return tensors in tuples, lists or dicts"),
        ("no_such_package_xyz.outputs", "no_such_package_xyz.outputs._Pair",
         "save: the program's outputs contain a no_such_package_xyz.outputs._Pair, registered as pytree node "
         "'no_such_package_xyz.outputs._Pair', whose module 'no_such_package_xyz.outputs' another process cannot "
         "import"),
        ("mymodels", None,
         "save: the program's outputs contain a mymodels._Pair, a pytree node registered without a "
         "serialized_type_name, which a .pt2 file cannot name; register it with "
         "torch.utils._pytree.register_pytree_node(..., serialized_type_name='mymodels._Pair') in an importable "
         "module"),
    ],
    ids=["script", "missing-module", "no-serialized-name"],
)
def test_save_refuses_an_output_type_another_process_cannot_find(module, serialized_type_name, message, tmp_path,
                                                                  monkeypatch):
    """Such a file would save and then fail to load anywhere else: refused
    before anything is written."""
    monkeypatch.setattr(_Pair, "__module__", module)
    pytree.register_pytree_node(_Pair, lambda p: ([p.a, p.b], None), lambda values, _: _Pair(*values),
                                serialized_type_name=serialized_type_name)
    try:
        with pytest.raises(ValueError, match="^" + re.escape(message)):
            pt2e_fq.save(_PairModel(), (torch.randn(2, 3),), tmp_path / "pair.pt2")
    finally:
        pytree._deregister_pytree_node(_Pair)
    assert _entries(tmp_path) == set()


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_failed_config_write_keeps_the_old_file(tmp_path, monkeypatch, suffix):
    """QuantizerConfig.save goes through pt2e_fq.files too: a write that fails
    half-way leaves the old config as it was."""
    from quantizers.presets import get_preset

    path = _old_file(tmp_path / f"config{suffix}")

    def half_written(self, data):
        with open(self, "wb") as f:
            f.write(data[:7])
        raise OSError(errno.ENOSPC, ENOSPC)

    monkeypatch.setattr(Path, "write_bytes", half_written)
    with pytest.raises(WriteError, match=rf"^cannot write {str(path)!r}: {ENOSPC}; {KEPT}$"):
        get_preset("w8a8").save(path)
    assert path.read_bytes() == OLD and _entries(tmp_path) == {f"config{suffix}"}
