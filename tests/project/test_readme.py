"""The README's config example is a valid config and means what its comments say;
the user guide's dynamic-batch flow runs as written."""

import re
from pathlib import Path

import pytest
import torch
import yaml

from quantizers import QuantizerConfig

README = Path(__file__).resolve().parents[2] / "README.md"


def _yaml_blocks() -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_config_example_loads():
    (block,) = _yaml_blocks()
    config = QuantizerConfig.from_dict(yaml.safe_load(block))
    linear = config.module_type[torch.nn.Linear]
    assert linear.weight.format.bits == 4 and linear.weight.granularity.group_size == 32
    assert config.global_config.weight.format.bits == 8
    assert config.module_name_regex[r"head\..*"] is None


USER_GUIDE = README.parent / "docs" / "user_guide.md"


def _python_block_containing(path: Path, text: str) -> str:
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S) if text in b]
    return block


# w8a8: the input, the relu into the second linear, 2 weights; the logits stay float (quantizers.presets).
@pytest.mark.parametrize("preset, points", [("w8a8", 4), ("w4a16", 2)])
def test_user_guide_dynamic_batch_flow_runs_as_written(preset, points, tmp_path, monkeypatch):
    """The user guide's whole flow, with
    `dynamic_shapes=({0: torch.export.Dim("batch")},)`, runs as written (its
    `...` is a statement; w4a16 swaps the preset) and its files take any
    batch size: the loaded .pt2 computes what the converted model computes,
    bit for bit (no batch norm, so folding changes nothing), and the ONNX
    file passes check_onnx, every point bit for bit, at other batch sizes."""
    import pt2e_fq
    from pt2e_fq.export import check_onnx

    block = _python_block_containing(USER_GUIDE, 'Dim("batch")')
    assert block.count('"w8a8"') == 1
    block = block.replace('"w8a8"', f'"{preset}"')
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    calibration_batches = [torch.randn(8, 16) for _ in range(3)]
    scope = {"model": model, "x": x, "calibration_batches": calibration_batches}
    monkeypatch.chdir(tmp_path)
    exec(block, scope)

    converted, loaded = scope["converted"], pt2e_fq.load(tmp_path / "model.pt2").module()
    for size in (1, 2, 3, 17):
        xb = torch.randn(size, 16)
        with torch.no_grad():
            assert torch.equal(loaded(xb), converted(xb)), size
        assert check_onnx(tmp_path / "model.onnx", converted, (xb,)).points == points
