"""Every Python block of README.md and docs/*.md runs as written: the blocks
of one file in order, in one namespace, in a temporary directory (the files
they write land there). A block marked `<!-- not-run: reason -->` on the
line before it (GPU-only, benchmark-sized) is skipped with that reason.
The config examples load and mean what their comments say."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from quantizers import QuantizerConfig

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^(?:<!-- not-run: (?P<reason>.+?) -->\n)?```python\n(?P<code>.*?)^```", re.S | re.M)


def python_blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, code, not-run reason or None) of every ```python block."""
    text = path.read_text()
    return [(text.count("\n", 0, m.start("code")) + 1, m["code"], m["reason"]) for m in _BLOCK.finditer(text)]


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", [p for p in DOCS if python_blocks(p)], ids=_name)
def test_every_python_block_runs(path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    scope: dict = {"__name__": "__doc__"}
    for line, code, reason in python_blocks(path):
        if reason is not None:
            continue
        try:
            exec(compile(code, f"{_name(path)}:{line}", "exec"), scope)
        except Exception as e:
            raise AssertionError(f"{_name(path)}, the block at line {line}: {type(e).__name__}: {e}") from e


def test_not_run_blocks_say_why():
    """The blocks marked not-run, each with its reason (a skip lists them)."""
    skipped = [f"{_name(p)}:{line} ({reason})" for p in DOCS for line, _, reason in python_blocks(p) if reason]
    if skipped:
        pytest.skip(f"{len(skipped)} block(s) not run: " + "; ".join(skipped))


def test_the_block_marker_is_read():
    text = "a\n<!-- not-run: needs a GPU -->\n```python\nx = 1\n```\n```python\ny = 2\n```\n"
    found = [(m["code"], m["reason"]) for m in _BLOCK.finditer(text)]
    assert found == [("x = 1\n", "needs a GPU"), ("y = 2\n", None)]


def test_the_config_example_loads_and_means_what_its_comments_say():
    text = (ROOT / "docs" / "quantizers.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", text, flags=re.S) if "head\\." in b]
    config = QuantizerConfig.from_dict(yaml.safe_load(block))
    linear = config.module_type[torch.nn.Linear]
    assert linear.weight.format.bits == 4 and linear.weight.granularity.group_size == 32
    assert config.global_config.weight.format.bits == 8
    assert config.module_name_regex[r"head\..*"] is None


def test_the_user_guide_s_dynamic_batch_files_take_any_batch_size(tmp_path, monkeypatch):
    """The user guide's flow exports with `Dim("batch")`: its `.pt2` computes
    what the converted model computes, bit for bit (no batch norm, so
    folding changes nothing), and its ONNX file passes check_onnx, every
    point bit for bit, at other batch sizes."""
    import pt2e_fq
    from pt2e_fq.export import check_onnx

    path = ROOT / "docs" / "user_guide.md"
    (line, code, _), = [b for b in python_blocks(path) if 'Dim("batch")' in b[1]]
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, f"docs/user_guide.md:{line}", "exec"), scope)
    converted, loaded = scope["converted"], pt2e_fq.load(tmp_path / "model.pt2").module()
    for size in (1, 2, 3, 17):
        xb = torch.randn(size, 16)
        with torch.no_grad():
            assert torch.equal(loaded(xb), converted(xb)), size
        # w8a8: the input, the relu into the second linear, 2 weights; the logits stay float (quantizers.presets).
        assert check_onnx(tmp_path / "model.onnx", converted, (xb,)).points == 4


def test_make_docs_names_a_public_callable_without_its_sections():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    gen_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_api)

    def bare(x):
        """Does something."""

    def documented(x):
        """Does something.

        Args:
            x: a value.

        Returns:
            Nothing useful.

        Raises:
            ValueError: never.
        """

    class Configured:
        """A class.

        Args:
            size: how big.
        """

        def __init__(self, size):
            self.size = size

    assert gen_api.missing(bare) == ["Args:", "Returns:", "Raises:"]
    assert gen_api.missing(documented) == []
    assert gen_api.missing(Configured) == []
    assert gen_api.missing(type("Undocumented", (), {"__init__": lambda self, n: None})) == ["a docstring"]
    assert gen_api.missing(ValueError) == []  # exceptions and enumerations need a docstring only
    assert all(not gen_api.missing(obj) for _, obj in gen_api.public_names())  # what make docs checks
