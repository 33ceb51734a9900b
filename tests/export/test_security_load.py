"""Loading a .pt2 file runs no code the file names.

A .pt2 names the pytree types of the program's inputs and outputs
("module.Type"). pt2e_fq.load imports a type's module only when it is on
pt2e_fq.export.TRUSTED_MODULES (exact names) or the caller passed it in
`trusted_modules`; any other is one error naming the type, the file and how
to allow it, raised before anything is imported. The tampered files here
name a module `evil` that sits beside them in the working folder (on
sys.path, as `python -m` puts it) and leaves a marker file when imported.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import secrets
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree

import pt2e_fq
from pt2e_fq.cli import command
from pt2e_fq.export import TRUSTED_MODULES, UntrustedModuleError

EVIL = textwrap.dedent("""
    import pathlib

    import torch.utils._pytree as pytree

    pathlib.Path(__file__).with_name("evil_ran").write_text("evil.py was imported")


    class Thing(tuple):
        pass


    pytree.register_pytree_node(Thing, lambda t: (list(t), None), lambda values, _: Thing(values),
                                serialized_type_name="evil.Thing")
""")


class _Pair(torch.nn.Module):
    def forward(self, x):
        return x + 1, x * 2


def _root_signature(value):
    """The signature of the root module's entry ("fqn": "") in a
    models/*.json's module call graph."""
    if isinstance(value, dict):
        if value.get("fqn") == "" and "signature" in value:
            return value["signature"]
        value = list(value.values())
    if isinstance(value, list):
        for item in value:
            found = _root_signature(item)
            if found is not None:
                return found
    return None


def _retyped(source: Path, target: Path, spec: str, old: str, new: str) -> Path:
    """A copy of the .pt2 `source` whose module call graph's `spec`
    ("in_spec" or "out_spec") names the pytree type `new` where it named
    `old`: what anyone can write into a file with a zip tool."""
    with zipfile.ZipFile(source) as archive, zipfile.ZipFile(target, "w") as out:
        for info in archive.infolist():
            data = archive.read(info)
            if info.filename.endswith("/models/model.json"):
                model = json.loads(data)
                signature = _root_signature(model)
                assert f'"type": "{old}"' in signature[spec]
                signature[spec] = signature[spec].replace(f'"type": "{old}"', f'"type": "{new}"', 1)
                data = json.dumps(model).encode()
            out.writestr(info, data)
    return target


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A program returning a tuple of two tensors, saved by pt2e_fq.save."""
    path = tmp_path_factory.mktemp("saved") / "pair.pt2"
    pt2e_fq.save(_Pair(), (torch.arange(6.0).reshape(2, 3),), path)
    return path


@pytest.fixture
def beside_evil(saved, tmp_path, monkeypatch):
    """(the working folder, on sys.path; the name of a module there). The
    folder holds the module, which is evil.py with a name of its own per
    test (a pytree type name cannot be registered twice in one process),
    and evil.pt2: the saved program with its output type renamed to the
    module's Thing."""
    name = f"evil_{secrets.token_hex(4)}"
    (tmp_path / f"{name}.py").write_text(EVIL.replace('"evil.Thing"', f'"{name}.Thing"'))
    _retyped(saved, tmp_path / "evil.pt2", "out_spec", "builtins.tuple", f"{name}.Thing")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path, name
    if name in sys.modules:
        pytree._deregister_pytree_node(sys.modules.pop(name).Thing)


def _untrusted(path, type_name: str, module: str) -> str:
    return (f"load: {os.fspath(path)!r} takes or returns a {type_name}, whose module {module!r} is not trusted, so "
            f"it was not imported (importing runs its code); if you trust it, pass "
            f"load(path, trusted_modules=[{module!r}]) or import it before load")


def test_load_does_not_import_a_module_beside_the_file(beside_evil):
    folder, name = beside_evil
    message = _untrusted("evil.pt2", f"{name}.Thing", name)
    with pytest.raises(UntrustedModuleError, match="^" + re.escape(message) + "$"):
        pt2e_fq.load("evil.pt2")
    assert name not in sys.modules
    assert not (folder / "evil_ran").exists()


def test_the_cli_report_does_not_import_a_module_beside_the_file(beside_evil):
    """The attack as a user meets it: `python -m pt2e_fq report` in the
    folder where the file (and the module it names) lies."""
    folder, name = beside_evil
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(Path(pt2e_fq.__file__).parents[1]),
                                                                    os.environ.get("PYTHONPATH")) if p)}
    result = subprocess.run([sys.executable, "-m", "pt2e_fq", "report", "evil.pt2"], cwd=folder, env=env,
                            capture_output=True, text=True, timeout=300)
    assert not (folder / "evil_ran").exists()
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"pt2e-fq report: error: 'evil.pt2' takes or returns a {name}.Thing, whose module {name!r} is not trusted, "
        f"so it was not imported; if you trust it, add --trusted-module {name}"]


def test_an_installed_module_with_import_side_effects_is_not_imported_either(saved, tmp_path, capfd):
    """`this` prints the Zen of Python when imported."""
    if "this" in sys.modules:
        pytest.skip("the module `this` was already imported in this process; its import cannot be observed")
    path = _retyped(saved, tmp_path / "this.pt2", "out_spec", "builtins.tuple", "this.Thing")
    with pytest.raises(UntrustedModuleError, match=re.escape("whose module 'this' is not trusted")):
        pt2e_fq.load(path)
    assert "this" not in sys.modules
    assert "Beautiful is better than ugly" not in capfd.readouterr().out


@pytest.mark.parametrize("type_name", ["transformers.Thing", "transformers.models.bert.Thing",
                                       "transformers.modeling_outputs.sub.Thing", "os.Thing"])
def test_only_exact_trusted_module_names_are_imported(saved, tmp_path, type_name):
    """A package of a trusted module, or a name below one, is not trusted."""
    path = _retyped(saved, tmp_path / "other.pt2", "out_spec", "builtins.tuple", type_name)
    module = type_name.rpartition(".")[0]
    with pytest.raises(UntrustedModuleError, match="^" + re.escape(_untrusted(path, type_name, module)) + "$"):
        pt2e_fq.load(path)


def test_a_module_the_caller_trusts_is_imported_and_the_program_loads(beside_evil):
    folder, name = beside_evil
    program = pt2e_fq.load("evil.pt2", trusted_modules=[name])
    assert (folder / "evil_ran").exists()
    x = torch.arange(6.0).reshape(2, 3)
    out = program.module()(x)
    assert type(out) is sys.modules[name].Thing
    assert torch.equal(out[0], x + 1) and torch.equal(out[1], x * 2)


def test_the_cli_report_imports_a_module_given_with_trusted_module(beside_evil, capsys):
    folder, name = beside_evil
    assert command.main(["report", "evil.pt2", "--trusted-module", name]) == 0, capsys.readouterr().err
    assert (folder / "evil_ran").exists()


def test_a_module_imported_before_load_needs_no_trust(beside_evil):
    folder, name = beside_evil
    importlib.import_module(name)  # the user's own import registers its Thing
    assert torch.equal(pt2e_fq.load("evil.pt2").module()(torch.zeros(2, 3))[0], torch.ones(2, 3))


def test_the_shipped_list_holds_the_hugging_face_output_modules():
    """Each trusted module exists and registers at least one pytree type of
    its own (a ModelOutput subclass) when imported: the reason it is trusted."""
    for module in sorted(TRUSTED_MODULES):
        importlib.import_module(module)
        assert any(name.rpartition(".")[0] == module for name in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE), module


@pytest.mark.parametrize(
    "trusted, error, message",
    [
        ("evil", TypeError, "load: trusted_modules must be a list of module names, got str 'evil'"),
        (["..evil"], ValueError,
         "load: trusted_modules: '..evil' is not a module name; give exact dotted names such as 'mypackage.outputs'"),
        ([3], ValueError, "load: trusted_modules: 3 is not a module name"),
    ],
)
def test_trusted_modules_must_be_module_names(beside_evil, trusted, error, message):
    with pytest.raises(error, match="^" + re.escape(message)):
        pt2e_fq.load("evil.pt2", trusted_modules=trusted)
    assert not (beside_evil[0] / "evil_ran").exists()


def test_the_cli_refuses_a_trusted_module_that_is_not_a_module_name(beside_evil, capsys):
    assert command.main(["report", "evil.pt2", "--trusted-module", "..evil"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "pt2e-fq report: error: --trusted-module: '..evil' is not a module name; give an exact dotted name such as "
        "mypackage.outputs"]


@pytest.mark.parametrize("spec, old, new", [("out_spec", "builtins.tuple", "..x.Y"), ("out_spec", "builtins.tuple", "Y"),
                                            ("in_spec", "builtins.dict", "x..Y")])
def test_a_type_name_that_is_not_a_dotted_name_is_an_error_naming_the_file_and_the_field(saved, tmp_path, spec, old,
                                                                                           new):
    path = _retyped(saved, tmp_path / "bad.pt2", spec, old, new)
    message = (f"load: {str(path)!r}: archive/models/model.json: {spec} names the pytree type {new!r}, which is "
               "neither registered nor a dotted name module.Type; the file is damaged or was not written by "
               "torch.export.save")
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        pt2e_fq.load(path)


def test_a_model_description_that_is_not_json_is_an_error_naming_the_file_and_the_member(saved, tmp_path):
    path = tmp_path / "bad.pt2"
    with zipfile.ZipFile(saved) as archive, zipfile.ZipFile(path, "w") as out:
        for info in archive.infolist():
            out.writestr(info, b"{not json" if info.filename.endswith("/models/model.json") else archive.read(info))
    with pytest.raises(ValueError, match="^" + re.escape(f"load: {str(path)!r}: archive/models/model.json is not a "
                                                         "torch.export model description (JSONDecodeError: ")):
        pt2e_fq.load(path)
