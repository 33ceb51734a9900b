"""Loading a .pt2 file runs nothing its payloads hold.

torch.export.load unpickles pickled weights, constants and sample inputs,
evaluates shape expressions with sympy.sympify (Python's eval) and imports
the modules a pytree context names. Each tampered file here carries one
payload that creates a marker file when it runs. Every case first shows
that plain torch.export.load runs it (so the payload is live), then that
pt2e_fq.load refuses the file, naming the member, without running it.
"""

from __future__ import annotations

import builtins
import io
import json
import pickle
import secrets
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
import torch.export.pt2_archive.constants as layout

import pt2e_fq
from pt2e_fq.export import UnsafeArchiveError


class _Affine(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.linear(x).reshape(-1)  # a size 2 * batch: a shape expression in the file


@pytest.fixture(scope="module")
def model() -> _Affine:
    torch.manual_seed(0)
    return _Affine()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, model) -> Path:
    """A program with a dynamic batch, saved by pt2e_fq.save."""
    path = tmp_path_factory.mktemp("saved") / "affine.pt2"
    pt2e_fq.save(model, (torch.ones(4, 3),), path, dynamic_shapes=({0: torch.export.Dim("batch")},))
    return path


class _Opens:
    """Unpickled, calls builtins.open(path, "w"): the marker file appears."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return builtins.open, (self.path, "w")


def _pickled(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _tampered(source: Path, target: Path, change) -> Path:
    """A copy of `source` whose members (names inside the archive's folder
    -> bytes) are change(members), as anyone can write with a zip tool."""
    with zipfile.ZipFile(source) as archive:
        folder = archive.namelist()[0].partition("/")[0]
        members = {info.filename.partition("/")[2]: archive.read(info) for info in archive.infolist()}
    with zipfile.ZipFile(target, "w") as out:
        for name, data in change(members).items():
            out.writestr(f"{folder}/{name}", data)
    return target


def _model_json(change):
    """A change of the members that applies change(description) to models/model.json."""
    def apply(members):
        members["models/model.json"] = json.dumps(change(json.loads(members["models/model.json"]))).encode()
        return members
    return apply


def _first(value, key):
    """The first dict in nested JSON that has `key`."""
    if isinstance(value, dict):
        if key in value:
            return value
        value = list(value.values())
    if isinstance(value, list):
        for item in value:
            found = _first(item, key)
            if found is not None:
                return found
    return None


def _pickled_sample_inputs(marker):
    def change(members):
        members["data/sample_inputs/model.pt"] = _pickled(_Opens(marker))
        return members
    return change


def _pickled_weight(marker):
    def change(members):
        config = json.loads(members["data/weights/model_weights_config.json"])
        entry = config["config"]["linear.bias"]
        entry["use_pickle"] = True
        members["data/weights/model_weights_config.json"] = json.dumps(config).encode()
        members[f"data/weights/{entry['path_name']}"] = _pickled(_Opens(marker))
        return members
    return change


def _opaque_constant(marker):
    def change(members):
        members["data/constants/model_constants_config.json"] = json.dumps({"config": {"c": {
            "path_name": "opaque_obj_0", "is_param": False, "use_pickle": True, "tensor_meta": None}}}).encode()
        members["data/constants/opaque_obj_0"] = pickle.dumps(_Opens(marker))
        return members
    return change


def _shape_expression(marker):
    def change(model):
        holder = _first(model, "expr_str")
        holder["expr_str"] = f"Add(__import__('builtins').open({str(marker)!r}, 'w').close() or 0, {holder['expr_str']})"
        return model
    return _model_json(change)


CASES = {
    # case: (the tampered file's change, the member named, what it says)
    "pickled sample inputs": (_pickled_sample_inputs, "archive/data/sample_inputs/model.pt",
                              "holds objects other than tensors and containers (it names io.open)"),
    "pickled weight": (_pickled_weight, "archive/data/weights/model_weights_config.json",
                       "marks 'linear.bias' as pickled"),
    "opaque constant": (_opaque_constant, "archive/data/constants/model_constants_config.json", "marks 'c' as pickled"),
    "shape expression": (_shape_expression, "archive/models/model.json", "holds the shape expression \"Add(__import__("),
}


@pytest.mark.parametrize("case", CASES)
def test_torch_runs_the_payload_and_pt2e_fq_load_refuses_it(saved, tmp_path, case):
    make, member, what = CASES[case]
    marker = tmp_path / "ran"
    path = _tampered(saved, tmp_path / "tampered.pt2", make(marker))
    with pytest.raises(UnsafeArchiveError) as error:
        pt2e_fq.load(path)
    assert not marker.exists()
    assert error.value.member == member and error.value.what.startswith(what), error.value
    assert str(error.value).startswith(f"load: {str(path)!r}: {member} {what}")
    if case == "opaque constant" and not hasattr(layout, "OPAQUE_OBJ_FILENAME_PREFIX"):
        return  # torch 2.11 reads no opaque constants: refusing the member is all there is to check
    try:
        torch.export.load(path)
    except Exception:  # noqa: BLE001 - the payload runs before torch finds the file unusable
        pass
    assert marker.exists(), f"the {case} payload did not run in torch.export.load: the case tests nothing"


EVIL = textwrap.dedent("""
    import enum
    import pathlib

    pathlib.Path(__file__).with_name("evil_ran").write_text("imported")


    class E(enum.Enum):
        A = 1


    def factory():
        return 0
""")


def _context(kind: str, module: str):
    """A change of the input spec's root node (the tuple (args, kwargs)) that makes its context name `module`."""
    def change(model):
        holder = _first(model, "in_spec")
        spec = json.loads(holder["in_spec"])
        if kind == "enum":
            spec[1]["context"] = json.dumps({"__enum__": True, "fqn": f"{module}:E", "name": "A"})
        else:
            spec[1] = {"type": "builtins.tuple", "context": "null", "children_spec": [spec[1], {
                "type": "collections.defaultdict", "children_spec": [],
                "context": {"default_factory_module": module, "default_factory_name": "factory", "dict_context": []}}]}
        holder["in_spec"] = json.dumps(spec)
        return model
    return _model_json(change)


@pytest.mark.parametrize("kind, what", [
    ("enum", "holds a pytree context naming an Enum class"),
    ("defaultdict", "holds a defaultdict whose factory's module"),
])
def test_a_pytree_context_naming_a_module_is_refused_before_torch_imports_it(saved, tmp_path, monkeypatch, kind, what):
    name = f"evil_{secrets.token_hex(4)}"
    (tmp_path / f"{name}.py").write_text(EVIL)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _tampered(saved, tmp_path / "tampered.pt2", _context(kind, name))
    with pytest.raises(UnsafeArchiveError) as error:
        pt2e_fq.load(path)
    assert error.value.member == "archive/models/model.json" and error.value.what.startswith(what)
    assert name not in sys.modules and not (tmp_path / "evil_ran").exists()
    try:
        torch.export.load(path)
    except Exception:  # noqa: BLE001 - the import happens before torch finds the spec unusable
        pass
    assert (tmp_path / "evil_ran").exists(), f"torch.export.load did not import {name}: the case tests nothing"
    sys.modules.pop(name, None)


def _add(name, data):
    def change(members):
        members[name] = data
        return members
    return change


def _custom_object_constant(members):
    members["data/constants/model_constants_config.json"] = json.dumps({"config": {"c": {
        "path_name": "custom_obj_0", "is_param": False, "use_pickle": False, "tensor_meta": None}}}).encode()
    return members


@pytest.mark.parametrize("change, member, what", [
    (_add("data/aotinductor/model/model.so", b"\x7fELF"), "archive/data/aotinductor/model/model.so",
     "is compiled AOTInductor code"),
    (_add("data/weights/model.pt", b""), "archive/data/weights/model.pt",
     "is a pickled file of torch's older archive layout"),
    (_custom_object_constant, "archive/data/constants/model_constants_config.json",
     "gives constant 'c' as 'custom_obj_0', a pickled object"),
])
def test_members_torch_would_load_as_code_are_refused(saved, tmp_path, change, member, what):
    path = _tampered(saved, tmp_path / "tampered.pt2", change)
    with pytest.raises(UnsafeArchiveError) as error:
        pt2e_fq.load(path)
    assert (error.value.member, error.value.what[:len(what)]) == (member, what)


def test_a_member_of_the_older_archive_format_is_refused(saved, tmp_path):
    """torch falls back to its older format, whose payloads it unpickles,
    when the file has a top-level "version" member."""
    path = tmp_path / "tampered.pt2"
    with zipfile.ZipFile(saved) as archive, zipfile.ZipFile(path, "w") as out:
        for info in archive.infolist():
            out.writestr(info, archive.read(info))
        out.writestr("version", "8.0")
    with pytest.raises(UnsafeArchiveError, match="'version' marks torch's older archive format"):
        pt2e_fq.load(path)


@pytest.mark.parametrize("target", ["torch.os.getcwd", "torch.ops.load_library.__call__", "builtins.exec",
                                    "torch.ops.aten.no_such_op.default"])
def test_a_call_target_that_is_not_an_operator_is_refused(saved, tmp_path, target):
    """The file can name any attribute of torch as a call target (torch
    resolves it with getattr and the graph calls it). torch's own verifier
    refuses some of these in ways that differ between releases; the archive
    check refuses each, naming it, before torch reads the file."""
    def change(model):
        node = _first(model, "target")
        assert node["target"].startswith("torch.ops.")
        node["target"] = target
        return model

    path = _tampered(saved, tmp_path / "tampered.pt2", _model_json(change))
    with pytest.raises(UnsafeArchiveError) as error:
        pt2e_fq.load(path)
    assert error.value.member == "archive/models/model.json"
    assert error.value.what == f"calls {target!r}, not an operator"


def test_the_saved_program_loads_and_runs_at_another_batch(saved, model):
    """The checks pass pt2e_fq.save's own file, shape expressions included."""
    x = torch.randn(7, 3)
    assert torch.equal(pt2e_fq.load(saved).module()(x), model(x))


def test_the_cli_report_refuses_a_tampered_file_without_running_it(saved, tmp_path):
    marker = tmp_path / "ran"
    path = _tampered(saved, tmp_path / "tampered.pt2", _pickled_sample_inputs(marker))
    result = subprocess.run([sys.executable, "-m", "pt2e_fq", "report", str(path)], capture_output=True, text=True,
                            timeout=300)
    assert not marker.exists()
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1].startswith(
        f"pt2e-fq report: error: {str(path)!r}: archive/data/sample_inputs/model.pt holds objects other than tensors "
        "and containers")
