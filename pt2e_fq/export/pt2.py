"""`.pt2` files: torch.export.save / load of a quantized model.

A saved program holds one torch.ops.pt2e_fq node per quantization point with
its qparams as buffers. Loading it needs the pt2e_fq operators registered,
which `import pt2e_fq` does; `load` is torch.export.load after that import
and after importing the modules that register the program's input and
output types (a transformers ModelOutput, say) as pytree nodes.
The file is written atomically (files.py): a failed write leaves any file
already at the path as it was.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import json
import os
import zipfile
from typing import Any, Iterator, Optional, Union

import torch
import torch.utils._pytree as pytree

from ..files import atomic_write, check_writable
from ..graph import check_finite_qparams
from .program import exported_program


def save(
    model_or_program,
    example_inputs,
    path: Union[str, os.PathLike],
    *,
    dynamic_shapes: Optional[Any] = None,
    fold_bn: bool = True,
) -> torch.export.ExportedProgram:
    """Exports a converted model (or takes an ExportedProgram), folds its QAT
    conv-bn patterns unless fold_bn=False, saves it to `path` (.pt2) and
    returns the saved program. The file is replaced only once it is
    complete; a failed write is a pt2e_fq.files.WriteError."""
    check_writable(path)  # before the export's work
    ep = exported_program(model_or_program, example_inputs, dynamic_shapes=dynamic_shapes, fold_bn=fold_bn)
    check_finite_qparams(ep, "save")
    _check_loadable_types(ep)
    with atomic_write(path) as temporary:
        # Serialized in memory first: torch's C++ archive writer aborts the
        # whole process (SIGABRT) when a write to disk fails, e.g. on a full disk.
        buffer = io.BytesIO()
        torch.export.save(ep, buffer)
        temporary.write_bytes(buffer.getvalue())
    return ep


def load(path: Union[str, os.PathLike]) -> torch.export.ExportedProgram:
    """Loads a `.pt2` file saved by `save` (or torch.export.save); call
    `.module()` on the result to run it. The modules that define the
    program's input and output types (a transformers ModelOutput) are
    imported by name first; installed modules only, nothing from the file
    is executed."""
    _register_archive_types(path)
    return torch.export.load(path)


# -- pytree types of a program's inputs and outputs -----------------------------------
#
# A .pt2 file names the container types of the program's inputs and outputs
# by their pytree serialized_type_name, and torch.export.load fails unless
# each name is registered in the loading process. A type such as
# transformers' ModelOutput registers itself, under "<its module>.<its name>",
# when its module is imported, which a fresh process has not done. So save
# checks that each name's module part is importable, and load imports it.


def _spec_types(spec: pytree.TreeSpec) -> Iterator[type]:
    if spec.is_leaf():
        return
    yield spec.type
    for child in spec.children():
        yield from _spec_types(child)


def _check_loadable_types(ep: torch.export.ExportedProgram) -> None:
    """A ValueError, before anything is written, for an input or output type
    that another process could not find by its serialized name."""
    for entry in ep.module_call_graph:
        if entry.signature is None:
            continue
        for where, spec in (("inputs", entry.signature.in_spec), ("outputs", entry.signature.out_spec)):
            for kind in _spec_types(spec):
                what = f"save: the program's {where} contain a {kind.__module__}.{kind.__qualname__}"
                name = getattr(pytree.SUPPORTED_SERIALIZED_TYPES.get(kind), "serialized_type_name", None)
                if name in (None, pytree.NO_SERIALIZED_TYPE_NAME_FOUND):
                    raise ValueError(
                        f"{what}, a pytree node registered without a serialized_type_name, which a .pt2 file "
                        "cannot name; register it with torch.utils._pytree.register_pytree_node(..., "
                        f"serialized_type_name='{kind.__module__}.{kind.__qualname__}') in an importable "
                        "module, or return tensors in tuples, lists or dicts"
                    )
                module = name.rpartition(".")[0]
                if not _importable(module):
                    raise ValueError(
                        f"{what}, registered as pytree node {name!r}, whose module {module!r} another process "
                        f"cannot import to load the file; define and register {kind.__qualname__} in an "
                        "importable module, or return tensors in tuples, lists or dicts"
                    )


def _importable(module: str) -> bool:
    if module in ("", "__main__"):
        return False
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package, or a module without a spec
        return False


def _archive_type_names(path) -> set[str]:
    """The serialized pytree type names in a .pt2 archive's module call
    graphs: the "type" of every node of each "in_spec" / "out_spec" (JSON
    strings in the archive's models/*.json). A file that is not such an
    archive names none (torch.export.load then says what is wrong)."""
    if not zipfile.is_zipfile(path):
        return set()
    names: set[str] = set()

    def walk(value):
        if isinstance(value, dict):
            for key, item in value.items():
                if key in ("in_spec", "out_spec") and isinstance(item, str):
                    walk_spec(json.loads(item)[1])  # [protocol version, root node]
                else:
                    walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    def walk_spec(node):
        if node.get("type"):
            names.add(node["type"])
        for child in node.get("children_spec", ()):
            walk_spec(child)

    with zipfile.ZipFile(path) as archive:
        for member in archive.namelist():
            if "/models/" in member and member.endswith(".json"):
                walk(json.loads(archive.read(member)))
    return names


def _register_archive_types(path) -> None:
    for name in sorted(_archive_type_names(path)):
        if name in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
            continue
        module = name.rpartition(".")[0]
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ImportError(
                f"load: {os.fspath(path)!r} takes or returns a {name}, whose module {module!r} cannot be "
                f"imported ({e}); install the package that defines it"
            ) from None
        if name not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
            raise ImportError(
                f"load: {os.fspath(path)!r} takes or returns a {name}, which importing {module!r} did not "
                "register as a pytree node; import the module that registers it before pt2e_fq.load"
            )
