"""What a `.pt2` archive may hold before `torch.export.load` reads it.

torch.export.load trusts its file: it unpickles weights and constants
marked "use_pickle" (torch.load with weights_only=False) and "opaque"
constants (pickle.loads), retries the sample inputs with weights_only=False
when the safe load fails, loads TorchBind objects and compiled AOTInductor
libraries from the archive, passes each shape expression ("expr_str") to
sympy.sympify (which evaluates Python), and imports the modules a pytree
context names (an Enum's "fqn", a defaultdict's "default_factory_module").
A program saved by pt2e_fq.save needs none of these, so `check_archive`
refuses each of them, naming the member and what it holds, before torch
reads the file: an UnsafeArchiveError. It reads the archive's JSON, and
its sample inputs with torch.load(weights_only=True), which unpickles
tensors and containers only.

A node's call target can name any attribute of `torch`, `math` or
`operator` (torch resolves it with getattr and the graph calls it). Newer
torch releases refuse one that is not an operator in their verifier, torch
2.11 in another way; `check_archive` refuses it itself, whatever the
release: a target must resolve, as torch resolves it, to an operator
overload, a higher-order operator or one of the symbolic-shape functions
torch's serializer writes.
"""

from __future__ import annotations

import ast
import builtins
import io
import json
import math
import operator
import os
import re
import zipfile
from typing import Any, Iterator

import sympy
import torch
import torch.export.pt2_archive.constants as layout
from torch._export.serde.serialize import _SYM_OPS


class UnsafeArchiveError(ValueError):
    """A .pt2 file holds something torch.export.load would execute or
    unpickle.
    `member` is the archive member, `what` says what it holds."""

    def __init__(self, path, member: str, what: str):
        self.path, self.member, self.what = os.fspath(path), member, what
        super().__init__(
            f"load: {self.path!r}: {member} {what}, which loading would run as code; pt2e_fq.load reads only "
            "tensors, JSON and shape expressions, so the file was not loaded (torch.export.load(path) would load "
            "it: use that only for files whose source you trust)"
        )


def _folders(archive: zipfile.ZipFile, path) -> Iterator[dict[str, str]]:
    """Per top folder of the archive, its members' names inside the folder
    ("models/model.json") -> full names. torch reads the folder of the
    first member; each is checked. A top-level "version" member is torch's
    older archive format, which torch falls back to (unpickling its
    payloads with weights_only=False) when the newer layout fails to load."""
    names = archive.namelist()
    if "version" in names:
        raise UnsafeArchiveError(path, "'version'", "marks torch's older archive format, whose payloads are pickled")
    folders: dict[str, dict[str, str]] = {}
    for name in names:
        folder, slash, inside = name.partition("/")
        if slash:
            folders.setdefault(folder, {})[inside] = name
    yield from folders.values()


def check_archive(path) -> dict[str, str]:
    """An UnsafeArchiveError for the first thing in the .pt2 archive at
    `path` that torch.export.load would execute or unpickle. Returns the
    pytree type names of the programs' inputs and outputs, each with where
    it is first found ("<member>: <field>"), for the caller to register.
    A file that is not a zip archive names none (torch.export.load then
    says what is wrong). Reads JSON members and the sample inputs
    (weights_only)."""
    if not zipfile.is_zipfile(path):
        return {}
    types: dict[str, str] = {}
    with zipfile.ZipFile(path) as archive:
        for members in _folders(archive, path):
            _check_folder(path, archive, members, types)
    return types


def _check_folder(path, archive: zipfile.ZipFile, members: dict[str, str], types: dict[str, str]) -> None:
    """One top folder of the archive (members: names inside it -> full names)."""
    for name, full in members.items():
        if name.startswith(layout.AOTINDUCTOR_DIR):
            raise UnsafeArchiveError(path, full, "is compiled AOTInductor code")
    models = [name[len(layout.MODELS_DIR):-len(".json")] for name in members
              if name.startswith(layout.MODELS_DIR) and name.endswith(".json")]
    for model in models:
        for legacy in (f"{layout.WEIGHTS_DIR}{model}.pt", f"{layout.CONSTANTS_DIR}{model}.pt"):
            if legacy in members:
                raise UnsafeArchiveError(path, members[legacy], "is a pickled file of torch's older archive "
                                         "layout")
        for config, constants in ((layout.WEIGHTS_CONFIG_FILENAME_FORMAT.format(model), False),
                                  (layout.CONSTANTS_CONFIG_FILENAME_FORMAT.format(model), True)):
            if config in members:
                _check_payloads(path, members[config], _json(archive, members[config], path), constants)
        inputs = layout.SAMPLE_INPUTS_FILENAME_FORMAT.format(model)
        if inputs in members:
            _check_sample_inputs(path, members[inputs], archive.read(members[inputs]))
        description = members[f"{layout.MODELS_DIR}{model}.json"]
        try:
            _check_model(path, description, json.loads(archive.read(description)), types)
        except UnsafeArchiveError:
            raise
        except (ValueError, TypeError, AttributeError, IndexError, KeyError) as e:
            raise ValueError(f"load: {os.fspath(path)!r}: {description} is not a torch.export model description "
                             f"({type(e).__name__}: {e})") from None


def _json(archive: zipfile.ZipFile, member: str, path) -> Any:
    try:
        return json.loads(archive.read(member))
    except ValueError as e:
        raise ValueError(f"load: {os.fspath(path)!r}: {member} is not JSON ({e})") from None


def _check_payloads(path, member: str, config: Any, constants: bool) -> None:
    """A weights or constants config: every payload a raw tensor record."""
    entries = config.get("config") if isinstance(config, dict) else None
    if not isinstance(entries, dict):
        raise ValueError(f"load: {os.fspath(path)!r}: {member} is not a torch.export payload config")
    for name, entry in entries.items():
        if not isinstance(entry, dict):
            raise ValueError(f"load: {os.fspath(path)!r}: {member}: entry {name!r} is not a payload description")
        if entry.get("use_pickle"):
            raise UnsafeArchiveError(path, member, f"marks {name!r} as pickled")
        record = entry.get("path_name")
        if constants and not (isinstance(record, str) and record.startswith(layout.TENSOR_CONSTANT_FILENAME_PREFIX)):
            raise UnsafeArchiveError(path, member, f"gives constant {name!r} as {record!r}, a pickled object (only "
                                     "tensor constants are read)")


def _check_sample_inputs(path, member: str, data: bytes) -> None:
    """torch retries sample inputs that fail weights_only with a full
    unpickle; they must load as tensors and containers only."""
    if not data:
        return
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever weights_only refuses
        named = re.search(r"GLOBAL ([\w.]+)", str(e))  # torch's message names the object it refused
        why = f"it names {named.group(1)}" if named else f"torch.load(weights_only=True) refuses it: {type(e).__name__}"
        raise UnsafeArchiveError(path, member, f"holds objects other than tensors and containers ({why})") from None


def _check_model(path, member: str, model: Any, types: dict[str, str]) -> None:
    for key, value in _items(model):
        if key == "expr_str":
            _check_expression(path, member, value)
        elif key == "target" and isinstance(value, str):
            _check_target(path, member, value)
        elif key in ("in_spec", "out_spec") and isinstance(value, str):
            _check_spec(path, member, json.loads(value)[1], f"{member}: {key}", types)  # [protocol version, root]


# The modules torch's deserializer resolves a target in, by its first name.
_TARGET_ROOTS = {"torch": torch, "_operator": operator, "math": math}


def _check_target(path, member: str, target: str) -> None:
    """A node's call target, resolved as torch.export.load resolves it
    (getattr from the root its first name names; nothing is called)."""
    root, *names = target.split(".")
    resolved = _TARGET_ROOTS.get(root)
    for name in names if resolved is not None else ():
        resolved = getattr(resolved, name, None)
    if isinstance(resolved, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)) or any(
            resolved is op for op in _SYM_OPS):  # identity: whatever getattr found may not be hashable
        return
    raise UnsafeArchiveError(path, member, f"calls {target!r}, not an operator")


def _items(value) -> Iterator[tuple[str, Any]]:
    """Every (key, value) pair of nested JSON dicts and lists."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield key, item
            yield from _items(item)
    elif isinstance(value, list):
        for item in value:
            yield from _items(item)


# -- pytree contexts ---------------------------------------------------------------------
#
# A spec node's context is JSON that torch decodes with a hook importing the
# module an Enum's "fqn" names, or (for a defaultdict) with importlib on its
# "default_factory_module". A defaultdict's factory is kept to these
# builtins; no program output of pt2e_fq's holds an Enum.
_DEFAULT_FACTORIES = frozenset({"list", "dict", "set", "int", "float", "str", "tuple", "bool", "frozenset", "bytes"})


def _check_spec(path, member: str, node: Any, where: str, types: dict[str, str]) -> None:
    """One node of a pytree spec and its children: its type name goes into
    `types`; its context must name no module."""
    if node.get("type"):
        types.setdefault(node["type"], where)
    context = node.get("context")
    if isinstance(context, str):  # JSON text, or (a type's own context format) any JSON value
        try:
            context = json.loads(context)
        except ValueError:
            context = None  # torch's own decoding fails on it, importing nothing
    if context is not None:
        for key, value in _items({"": context}):
            if key == "__enum__":
                raise UnsafeArchiveError(path, member, "holds a pytree context naming an Enum class, whose module "
                                         "loading would import")
            if key == "default_factory_module" and value != "builtins":
                raise UnsafeArchiveError(path, member, f"holds a defaultdict whose factory's module {value!r} "
                                         "loading would import")
            if key == "default_factory_name" and value not in _DEFAULT_FACTORIES:
                raise UnsafeArchiveError(path, member, f"holds a defaultdict whose factory is {value!r} (allowed: "
                                         f"{', '.join(sorted(_DEFAULT_FACTORIES))})")
    for child in node.get("children_spec", ()):
        _check_spec(path, member, child, where, types)


# -- shape expressions -------------------------------------------------------------------
#
# torch writes each symbolic size with sympy.srepr ("Mul(Integer(2),
# Symbol('s0', positive=True, integer=True))") and reads it back with
# sympy.sympify, i.e. Python's eval. Only calls of sympy's and torch's
# symbolic classes, numbers, arithmetic and a symbol's name pass.
def _expression_names() -> frozenset[str]:
    import torch.utils._sympy.functions as functions

    names = {name for name in dir(functions) if isinstance(getattr(functions, name), type)
             and issubclass(getattr(functions, name), sympy.Basic)}
    names |= {"Symbol", "Dummy", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Max", "Min", "Mod", "Abs",
              "floor", "ceiling", "sqrt", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "Equality", "Unequality",
              "StrictLessThan", "StrictGreaterThan", "LessThan", "GreaterThan", "And", "Or", "Not", "Xor", "true",
              "false", "BooleanTrue", "BooleanFalse", "Piecewise", "ExprCondPair", "oo", "zoo", "nan", "Infinity",
              "NegativeInfinity", "NaN", "One", "Zero", "NegativeOne", "Half", "S", "pi", "E"}
    return frozenset(names - {"S"})  # S("...") would sympify a string again


_EXPRESSION_NAMES = _expression_names()
_SYMBOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_EXPRESSION_NODES = (ast.Expression, ast.Call, ast.Name, ast.Load, ast.Constant, ast.keyword, ast.BinOp, ast.UnaryOp,
                     ast.BoolOp, ast.Compare, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow,
                     ast.USub, ast.UAdd, ast.Not, ast.And, ast.Or, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _check_expression(path, member: str, text: Any) -> None:
    def refuse(why: str):
        return UnsafeArchiveError(path, member, f"holds the shape expression {str(text)[:80]!r} ({why})")

    if not isinstance(text, str):
        raise refuse("not a string")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise refuse("not an expression") from None
    for node in ast.walk(tree):
        if not isinstance(node, _EXPRESSION_NODES):
            raise refuse(f"{type(node).__name__} is not part of a symbolic size")
        if isinstance(node, ast.Name) and node.id not in _EXPRESSION_NAMES and not (
                _SYMBOL_NAME.fullmatch(node.id) and not node.id.startswith("_")
                and node.id not in vars(sympy) and node.id not in vars(builtins)):
            raise refuse(f"{node.id!r} is not a symbolic-size class or a symbol")
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name):
                raise refuse("a call of something other than a symbolic-size class")
            for argument in node.args:
                if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                    if not _string_argument(node.func.id, argument.value):
                        raise refuse(f"the string {argument.value[:40]!r} is not a symbol's name or a number")
            for keyword in node.keywords:
                if keyword.arg is None or not isinstance(keyword.value, ast.Constant) or isinstance(
                        keyword.value.value, str):
                    raise refuse("a keyword argument that is not a number or a flag")
        if isinstance(node, ast.Constant) and isinstance(node.value, (bytes, complex)):
            raise refuse("a constant that is not a number")


def _string_argument(function: str, value: str) -> bool:
    """Strings appear in srepr only as a Symbol's name and a Float's digits."""
    if function in ("Symbol", "Dummy"):
        return bool(_SYMBOL_NAME.fullmatch(value))
    if function == "Float":
        try:
            float(value)
        except ValueError:
            return False
        return True
    return False


__all__ = ["UnsafeArchiveError", "check_archive"]
