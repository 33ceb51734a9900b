"""The package's shape: the import graph of pt2e_fq and quantizers, read from
the source (every import statement, module level or inside a function), has
no cycle and runs one way: the runtime never imports quantizers or the
application layer; only pt2e_fq.app imports quantizers."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pt2e_fq", "quantizers")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str, modules: set) -> set:
    """The project modules `path` imports (a package's submodule where
    `from package import name` names one)."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            # the longest project module the name starts with
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def import_graph() -> dict[str, set]:
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    modules = set(files)
    return {m: _imports(p, m, modules) for m, p in files.items()}


def _cycle(graph: dict) -> list:
    """One import cycle as a list of modules, or []. A package's __init__
    importing its own submodules is how packages work, and a submodule
    importing its package means importing that __init__: both are edges."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return []

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return []


def _runtime_graph(graph: dict) -> dict:
    """Edges between modules, leaving out the package __init__ files that only
    gather the public names (pt2e_fq/__init__ imports the runtime; a module
    importing `pt2e_fq` means the runtime's public names)."""
    return {m: {n for n in deps if n not in PACKAGES} for m, deps in graph.items() if m not in PACKAGES}


def test_the_import_graph_has_no_cycle():
    graph = _runtime_graph(import_graph())
    assert _cycle(graph) == []


def test_the_runtime_never_imports_quantizers_or_the_application_layer():
    graph = import_graph()
    runtime = [m for m in graph if m.startswith("pt2e_fq") and not m.startswith("pt2e_fq.app")
               and m != "pt2e_fq.__main__"]
    assert "pt2e_fq" in runtime and "pt2e_fq.ops" in runtime
    offenders = {m: sorted(n for n in graph[m] if n.startswith(("quantizers", "pt2e_fq.app"))) for m in runtime}
    assert {m: v for m, v in offenders.items() if v} == {}


def test_only_the_application_layer_imports_quantizers():
    graph = import_graph()
    importers = {m for m, deps in graph.items() if any(n.startswith("quantizers") for n in deps)}
    assert {m for m in importers if not m.startswith("quantizers")} <= {m for m in graph if m.startswith("pt2e_fq.app")}


def test_production_code_uses_the_reference_for_nothing():
    """pt2e_fq.reference is the tests' independent reference; shared pure math
    lives in modules named for it (blocks, float_cast)."""
    graph = import_graph()
    assert sorted(m for m, deps in graph.items() if "pt2e_fq.reference" in deps) == []


@pytest.mark.parametrize("source, edges, cycle", [
    ("a", {"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ("a", {"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_the_cycle_finder_finds_cycles(source, edges, cycle):
    assert _cycle(edges) == cycle


def test_the_walk_sees_imports_inside_functions(tmp_path, monkeypatch):
    """A function-level `from quantizers import ...` in a runtime module is an edge."""
    pkg = tmp_path / "pt2e_fq"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "late.py").write_text("def f():\n    from quantizers import presets\n    from .app import cli\n")
    (tmp_path / "quantizers").mkdir()
    (tmp_path / "quantizers" / "__init__.py").write_text("")
    (tmp_path / "quantizers" / "presets.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (pkg / "app").mkdir()
    (pkg / "app" / "__init__.py").write_text("")
    (pkg / "app" / "cli.py").write_text("")
    assert import_graph()["pt2e_fq.late"] == {"quantizers", "quantizers.presets", "pt2e_fq.app", "pt2e_fq.app.cli"}
