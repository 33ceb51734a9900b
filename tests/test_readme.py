"""The README's config example is a valid config and means what its comments say."""

import re
from pathlib import Path

import torch
import yaml

from quantizers import QuantizerConfig

README = Path(__file__).resolve().parent.parent / "README.md"


def _yaml_blocks() -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_config_example_loads():
    (block,) = _yaml_blocks()
    config = QuantizerConfig.from_dict(yaml.safe_load(block))
    linear = config.module_type[torch.nn.Linear]
    assert linear.weight.format.bits == 4 and linear.weight.granularity.group_size == 32
    assert config.global_config.weight.format.bits == 8
    assert config.module_name_regex[r"head\..*"] is None
