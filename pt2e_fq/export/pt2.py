"""`.pt2` files: torch.export.save / load of a quantized model.

A saved program holds one torch.ops.pt2e_fq node per quantization point with
its qparams as buffers. Loading it needs the pt2e_fq operators registered,
which `import pt2e_fq` does; `load` is torch.export.load after that import
and after importing the modules that register the program's input and
output types (a transformers ModelOutput, say) as pytree nodes: only
modules on TRUSTED_MODULES or named by the caller, never one because the
file names it (importing a module runs its code). Before torch reads the
file, pt2_archive.check_archive refuses whatever torch.export.load would
run as code (pickled payloads, compiled libraries, shape expressions that
are not symbolic sizes, pytree contexts naming modules), and torch's
verifier refuses a graph that calls anything but operators.
The file is written atomically (files.py): a failed write leaves any file
already at the path as it was.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
from collections.abc import Iterable
from typing import Any, Iterator, Optional, Union

import torch
import torch.utils._pytree as pytree

from ..eval_mode import check_eval_mode
from ..files import atomic_write, check_writable
from ..graph import check_finite_qparams
from .program import exported_program
from .pt2_archive import check_archive

# The modules `load` imports when a file names a pytree type of theirs that
# is not registered yet: exact names, each the home of transformers
# ModelOutput types (a ModelOutput subclass registers itself as a pytree
# node, under "<its module>.<its name>", when its module is imported).
TRUSTED_MODULES = frozenset({
    "transformers.modeling_outputs",
    "transformers.models.bert.modeling_bert",
    "transformers.models.gpt2.modeling_gpt2",
})


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
    complete; a failed write is a pt2e_fq.files.WriteError.

    Args:
        model_or_program: a converted model (a GraphModule from convert_pt2e) or an ExportedProgram of one.
        example_inputs: a tensor or a tuple of positional arguments.
        path: the `.pt2` file to write.
        dynamic_shapes: as torch.export takes them (the export before prepare must declare the same dimensions).
        fold_bn: fold the QAT conv-bn patterns (True) or keep them.

    Returns:
        The saved torch.export.ExportedProgram.

    Raises:
        ValueError: a point is not converted, has non-finite qparams, or an input or output type cannot be loaded
            by name; or torchao's eval switch changed the model (call pt2e_fq.move_exported_model_to_eval).
        pt2e_fq.files.WriteError: the file cannot be written; a file already at `path` is left as it was.
    """
    check_writable(path)  # before the export's work
    check_eval_mode(model_or_program, "save")
    ep = exported_program(model_or_program, example_inputs, dynamic_shapes=dynamic_shapes, fold_bn=fold_bn)
    check_finite_qparams(ep, "save")
    _check_loadable_types(ep)
    with atomic_write(path) as temporary:
        # Serialized in memory first: torch's C++ archive writer aborts the
        # whole process (SIGABRT) when a write to disk fails, e.g. on a full disk.
        buffer = io.BytesIO()
        with _compact_tensors(ep):
            torch.export.save(ep, buffer)
        temporary.write_bytes(buffer.getvalue())
    return ep


def _compact(value):
    """A tensor whose storage holds more than its own elements (a slice, a
    torch.split piece of a calibration batch) as a copy holding only them;
    anything else as it is."""
    if not isinstance(value, torch.Tensor) or value.untyped_storage().nbytes() <= value.numel() * value.element_size():
        return value
    copy = value.detach().clone()  # a dense piece keeps its strides, a strided slice comes out contiguous
    return torch.nn.Parameter(copy, requires_grad=value.requires_grad) if isinstance(value, torch.nn.Parameter) else copy


@contextlib.contextmanager
def _compact_tensors(ep: torch.export.ExportedProgram) -> Iterator[None]:
    """torch.export.save writes the whole storage behind each tensor it
    saves: inside this block, the program's example inputs, parameters,
    buffers and constants are compact copies where they are views into
    larger storages. The program is given back as it was."""
    kept = ep._example_inputs, ep._state_dict, ep._constants
    try:
        if ep._example_inputs is not None:
            ep._example_inputs = pytree.tree_map(_compact, ep._example_inputs)
        ep._state_dict = {name: _compact(t) for name, t in ep._state_dict.items()}
        ep._constants = {name: _compact(t) for name, t in ep._constants.items()}
        yield
    finally:
        ep._example_inputs, ep._state_dict, ep._constants = kept


def load(path: Union[str, os.PathLike], *, trusted_modules: Iterable[str] = ()) -> torch.export.ExportedProgram:
    """Loads a `.pt2` file saved by `save` (or torch.export.save); call
    `.module()` on the result to run it.

    The file names the pytree types of the program's inputs and outputs (a
    transformers ModelOutput, say), which must be registered before
    torch.export.load. A type not registered yet is registered by importing
    its module, only where that module is on TRUSTED_MODULES (exact names:
    transformers.modeling_outputs and the transformers model modules
    pt2e_fq supports) or in `trusted_modules` (exact module names the
    caller trusts, e.g. ["mypackage.outputs"]); any other is an
    UntrustedModuleError naming the type and the file, before anything is
    imported or loaded. So nothing the file names is executed unless you
    said so; importing the module yourself before load also does.
    Nor is anything else in the file: a pickled weight, constant or sample
    input, a TorchBind or opaque constant, compiled AOTInductor code, a
    shape expression other than a symbolic size (torch evaluates them as
    Python) or a pytree context naming a module is an UnsafeArchiveError
    naming the member, before torch reads the file; a graph node calling
    anything but an operator is refused by torch's verifier while loading.
    pt2e_fq.save never writes any of them.

    Args:
        path: a `.pt2` file.
        trusted_modules: exact names of further modules that may be imported to register the program's
            input and output types.

    Returns:
        The torch.export.ExportedProgram; `.module()` runs it.

    Raises:
        TypeError, ValueError: trusted_modules is not a list of dotted module names.
        UntrustedModuleError: the file names a type whose module is not trusted.
        UnsafeArchiveError: the file holds something loading would run as code (a ValueError).
        ImportError: a trusted module cannot be imported, or does not register the type.
    """
    trusted = _trusted_modules(trusted_modules)
    _register_archive_types(path, check_archive(path), trusted)
    return torch.export.load(path)


class UntrustedModuleError(ImportError):
    """A .pt2 file names a pytree type whose module is not trusted: neither
    on TRUSTED_MODULES nor in load's `trusted_modules`, nor imported yet.
    `type_name` is the name in the file, `module` its module part."""

    def __init__(self, path, type_name: str, module: str):
        self.path, self.type_name, self.module = os.fspath(path), type_name, module
        super().__init__(
            f"load: {self.path!r} takes or returns a {type_name}, whose module {module!r} is not trusted, so it "
            f"was not imported (importing runs its code); if you trust it, pass "
            f"load(path, trusted_modules=[{module!r}]) or import it before load"
        )


# -- pytree types of a program's inputs and outputs -----------------------------------
#
# A .pt2 file names the container types of the program's inputs and outputs
# by their pytree serialized_type_name, and torch.export.load fails unless
# each name is registered in the loading process. A type such as
# transformers' ModelOutput registers itself, under "<its module>.<its name>",
# when its module is imported, which a fresh process has not done. So save
# checks that each name's module part is importable, and load imports it
# where it is trusted (a file can name any module, and importing runs it).


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


def _is_dotted(name: str) -> bool:
    return all(part.isidentifier() for part in name.split("."))


def _trusted_modules(names: Iterable[str]) -> frozenset[str]:
    """TRUSTED_MODULES and the caller's exact module names, each checked."""
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        raise TypeError(f"load: trusted_modules must be a list of module names, got {type(names).__name__} {names!r}")
    names = list(names)
    for name in names:
        if not (isinstance(name, str) and _is_dotted(name)):
            raise ValueError(f"load: trusted_modules: {name!r} is not a module name; give exact dotted names such as "
                             "'mypackage.outputs'")
    return TRUSTED_MODULES | frozenset(names)


def _register_archive_types(path, names: dict[str, str], trusted: frozenset[str]) -> None:
    """Imports the trusted module of each type the file names (`names`:
    type name -> where in the file) that is not registered yet; an
    UntrustedModuleError, before any import, for a module that is not
    trusted."""
    missing = sorted(n for n in names if n not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE)
    for name in missing:
        module = name.rpartition(".")[0]
        if not (module and _is_dotted(name)):
            raise ValueError(
                f"load: {os.fspath(path)!r}: {names[name]} names the pytree type {name!r}, which is neither "
                "registered nor a dotted name module.Type; the file is damaged or was not written by "
                "torch.export.save"
            )
        if module not in trusted:
            raise UntrustedModuleError(path, name, module)
    for name in missing:
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
