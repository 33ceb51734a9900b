"""Writes docs/api.md, the API reference, from the docstrings of the public
names (`pt2e_fq.__all__`, `quantizers.__all__`, and the public functions of
`pt2e_fq.ops` and `pt2e_fq.export` that the user guide names), and fails,
listing each, where one lacks what its kind needs:

- a function: `Args:` (where it takes arguments), `Returns:` and `Raises:`;
- a class: `Args:` where its constructor takes arguments (exceptions and
  enumerations: a docstring);
- a module or a value: a docstring (a value is listed with its repr).

    python docs/gen_api.py            # writes docs/api.md (make docs)
    python docs/gen_api.py --check    # fails where docs/api.md is not up to date
"""

from __future__ import annotations

import argparse
import enum
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "api.md"
# Functions of submodules on the public surface beside the packages' __all__.
EXPORT_FUNCTIONS = ("to_onnx", "check_onnx", "to_qdq", "to_executorch")


def _public(module) -> list[tuple[str, object]]:
    return [(f"{module.__name__}.{name}", getattr(module, name)) for name in module.__all__]


def public_names() -> list[tuple[str, object]]:
    sys.path.insert(0, str(ROOT))
    import pt2e_fq
    import pt2e_fq.export
    import pt2e_fq.ops
    import quantizers

    names = _public(pt2e_fq) + _public(quantizers)
    names += [(f"pt2e_fq.export.{n}", getattr(pt2e_fq.export, n)) for n in EXPORT_FUNCTIONS]
    names += [(f"pt2e_fq.ops.{n}", f) for n, f in vars(pt2e_fq.ops).items()
              if inspect.isfunction(f) and not n.startswith("_") and f.__module__ == pt2e_fq.ops.__name__]
    seen, unique = set(), []
    for name, obj in names:
        if id(obj) not in seen or not callable(obj):
            seen.add(id(obj))
            unique.append((name, obj))
    return unique


def _takes_arguments(obj) -> bool:
    try:
        parameters = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name not in ("self", "cls") for p in parameters)


def missing(obj) -> list[str]:
    """What the docstring of `obj` lacks for its kind."""
    doc = inspect.getdoc(obj) if (callable(obj) or inspect.ismodule(obj)) else None
    if inspect.isfunction(obj):
        need = (["Args:"] if _takes_arguments(obj) else []) + ["Returns:", "Raises:"]
    elif inspect.isclass(obj) and not issubclass(obj, (BaseException, enum.Enum)):
        need = ["Args:"] if _takes_arguments(obj) else []
    elif inspect.isclass(obj) or inspect.ismodule(obj):
        need = []
    else:
        return []  # a value: its repr is its documentation
    if not doc:
        return ["a docstring"]
    return [section for section in need if section not in doc.splitlines() and f"\n{section}" not in doc]


def _signature(name: str, obj) -> str:
    if inspect.isfunction(obj) or (inspect.isclass(obj) and not issubclass(obj, enum.Enum)):
        try:
            return f"{name}{inspect.signature(obj)}"
        except (TypeError, ValueError):
            pass
    return name


def page(names) -> str:
    lines = ["# API reference", "",
             "Written by `make docs` (docs/gen_api.py) from the docstrings; edit those, not this page.", ""]
    for name, obj in names:
        lines.append(f"## `{name.rsplit('.', 1)[-1]}`" if callable(obj) or inspect.ismodule(obj) else f"## `{name}`")
        lines.append("")
        if not callable(obj) and not inspect.ismodule(obj):
            lines += [f"`{name} = {obj!r}`", ""]
            continue
        lines += ["```", _signature(name, obj), "```", ""]  # a signature, not a runnable block
        lines += [inspect.getdoc(obj) or "", ""]
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail where docs/api.md is not up to date")
    args = parser.parse_args()
    names = public_names()
    problems = [f"{name}: no {', '.join(m)}" for name, obj in names if (m := missing(obj))]
    if problems:
        print(f"docs/gen_api.py: {len(problems)} public name(s) lack docstring sections:", *problems,
              sep="\n  ", file=sys.stderr)
        return 1
    text = page(names)
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print("docs/gen_api.py: docs/api.md is not up to date; run make docs", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}: {len(names)} names")
    return 0


if __name__ == "__main__":
    sys.exit(main())
