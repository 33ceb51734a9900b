"""The package's shape: the import graph of pt2e_fq and quantizers, read from
the source (every import statement, module level or inside a function), has
no cycle and runs one way, down the layers below. A module imports only
modules of its own layer or lower ones; an import that goes up fails here,
and so does a module that no layer names (place a new module first)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pt2e_fq", "quantizers")

# Lowest first. A name covers the module and everything under it, unless a
# longer name places a submodule elsewhere (ops.blocks sits under the op
# wrappers that use it; spec.format_kinds and spec.qspec above observers).
LAYERS = (
    # values and block arithmetic, no torch.ops; files: atomic writes
    ("pt2e_fq.spec", "pt2e_fq.spec.formats", "pt2e_fq.spec.granularity", "pt2e_fq.spec.schemes",
     "pt2e_fq.spec.qparams", "pt2e_fq.ops.blocks", "pt2e_fq.files"),
    # the op wrappers; the reference (tests only) defines the same semantics from the same block arithmetic
    ("pt2e_fq.ops", "pt2e_fq.reference"),
    # observers and the one collective a static observer makes
    ("pt2e_fq.observers", "pt2e_fq._observer_sync"),
    # how each format family computes its qparams and calls its op (observers' ranges), the point spec,
    # and the batch norms' eps record with the eval-mode check that FakeQuantize.convert runs
    ("pt2e_fq.spec.format_kinds", "pt2e_fq.spec.qspec", "pt2e_fq.eval_mode"),
    ("pt2e_fq.fake_quantize", "pt2e_fq.distributed"),
    ("pt2e_fq.graph",),
    # the per-point table, the stock-flow fixes, the post-calibration algorithms (GPTQ, bias correction),
    # distillation QAT
    ("pt2e_fq.report", "pt2e_fq.flow", "pt2e_fq.calib", "pt2e_fq.qat"),
    ("pt2e_fq.export",),
    ("pt2e_fq.plugins",),
    # the public API gathers the runtime's names (and quiets torchao's import through plugins.torchao)
    ("pt2e_fq",),
    # the Quantizer works with the public API
    ("quantizers",),
    # the command, the pipeline sugar and the demo: the only part of pt2e_fq that imports quantizers
    ("pt2e_fq.cli", "pt2e_fq.__main__"),
)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _project_module(name: str, modules: set) -> str:
    """The longest project module `name` starts with, or ""."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def _imports(path: Path, module: str, modules: set) -> set:
    """The project modules `path` imports: for `from package import name`,
    the submodule where `name` is one, else the package (whose namespace
    gives the name)."""
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
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            name = _project_module(name, modules)
            if name and name != module:
                found.add(name)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set]:
    files = {_module_name(p, root): p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")}
    modules = set(files)
    return {m: _imports(p, m, modules) for m, p in files.items()}


def layer_of(module: str, layers=LAYERS):
    """The index of the layer whose longest name covers `module`, or None."""
    best, found = -1, None
    for i, names in enumerate(layers):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, found = len(name), i
    return found


def upward_imports(graph: dict, layers=LAYERS) -> list[str]:
    """Every import from a module to one of a higher layer, as text."""
    found = []
    for m, deps in sorted(graph.items()):
        for n in sorted(deps):
            if layer_of(n, layers) > layer_of(m, layers):
                found.append(f"{m} (layer {layer_of(m, layers)}) imports {n} (layer {layer_of(n, layers)})")
    return found


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


def test_the_import_graph_has_no_cycle():
    assert _cycle(import_graph()) == []


def test_every_module_has_a_layer():
    graph = import_graph()
    assert "pt2e_fq.spec.formats" in graph and "pt2e_fq.cli.command" in graph
    assert sorted(m for m in graph if layer_of(m) is None) == []


def test_no_import_goes_up_a_layer():
    assert upward_imports(import_graph()) == []


def test_the_runtime_never_imports_quantizers_or_the_application_layer():
    graph = import_graph()
    runtime = [m for m in graph if m.startswith("pt2e_fq") and not m.startswith(("pt2e_fq.cli", "pt2e_fq.__main__"))]
    assert "pt2e_fq" in runtime and "pt2e_fq.ops" in runtime
    offenders = {m: sorted(n for n in graph[m] if n.startswith(("quantizers", "pt2e_fq.cli"))) for m in runtime}
    assert {m: v for m, v in offenders.items() if v} == {}


def test_only_the_application_layer_imports_quantizers():
    graph = import_graph()
    importers = {m for m, deps in graph.items() if any(n.startswith("quantizers") for n in deps)}
    assert {m for m in importers if not m.startswith("quantizers")} <= {m for m in graph if m.startswith("pt2e_fq.cli")}


def test_production_code_uses_the_reference_for_nothing():
    """pt2e_fq.reference is the tests' independent reference; shared pure math
    lives in modules named for it (ops.blocks, ops.float_cast)."""
    graph = import_graph()
    assert sorted(m for m, deps in graph.items() if "pt2e_fq.reference" in deps) == []


@pytest.mark.parametrize("source, edges, cycle", [
    ("a", {"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ("a", {"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_the_cycle_finder_finds_cycles(source, edges, cycle):
    assert _cycle(edges) == cycle


def test_an_upward_import_fails_and_a_downward_one_passes():
    """A synthetic graph: formats importing fake_quantize goes up (layer 0 to
    4); fake_quantize importing formats and qspec importing observers go down;
    a submodule placed lower than its package counts at its own layer."""
    graph = {"pt2e_fq.spec.formats": {"pt2e_fq.fake_quantize"},
             "pt2e_fq.fake_quantize": {"pt2e_fq.spec.formats", "pt2e_fq.ops.blocks"},
             "pt2e_fq.spec.qspec": {"pt2e_fq.observers"},
             "pt2e_fq.export.pt2": {"pt2e_fq.graph", "pt2e_fq.plugins.torchvision"}}
    assert upward_imports(graph) == [
        "pt2e_fq.export.pt2 (layer 7) imports pt2e_fq.plugins.torchvision (layer 8)",
        "pt2e_fq.spec.formats (layer 0) imports pt2e_fq.fake_quantize (layer 4)",
    ]
    assert layer_of("pt2e_fq.ops.blocks") == 0 and layer_of("pt2e_fq.ops.fake_quant") == 1
    assert layer_of("pt2e_fq.export.onnx.check") == layer_of("pt2e_fq.export") and layer_of("elsewhere") is None


def test_the_walk_sees_imports_inside_functions_and_names_the_submodule(tmp_path):
    """A function-level import in a runtime module is an edge; `from package
    import submodule` is an edge to the submodule, `from package import name`
    to the package. Walked from real files: a low module importing the
    command line upward is found."""
    files = {
        "pt2e_fq/__init__.py": "",
        "pt2e_fq/spec/__init__.py": "",
        "pt2e_fq/spec/formats.py": "def f():\n    from quantizers import presets\n    from ..cli import command\n",
        "pt2e_fq/graph.py": "from . import report\nfrom pt2e_fq import QSpec\n",
        "pt2e_fq/report.py": "",
        "pt2e_fq/cli/__init__.py": "",
        "pt2e_fq/cli/command.py": "",
        "quantizers/__init__.py": "",
        "quantizers/presets.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path)
    assert graph["pt2e_fq.spec.formats"] == {"quantizers.presets", "pt2e_fq.cli.command"}
    assert graph["pt2e_fq.graph"] == {"pt2e_fq.report", "pt2e_fq"}
    assert upward_imports(graph) == [
        "pt2e_fq.graph (layer 5) imports pt2e_fq (layer 9)",
        "pt2e_fq.graph (layer 5) imports pt2e_fq.report (layer 6)",
        "pt2e_fq.spec.formats (layer 0) imports pt2e_fq.cli.command (layer 11)",
        "pt2e_fq.spec.formats (layer 0) imports quantizers.presets (layer 10)",
    ]
