"""`quantize --preset NAME --mixed-budget BITS --save-config FILE`: the
sensitivity and choice tables, a budget every layer fits in float, the
saved config as what was quantized, and the argument errors."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import cli_main
from tests.models.quantizer import single_thread  # noqa: F401 (an autouse fixture: one thread)

from quantizers import QuantizerConfig

QUANTIZE = ["quantize", "--model", "tests.models.cli:tiny_mlp", "--example-input", "8x16", "--no-progress"]


def test_a_budget_of_32_bits_keeps_every_layer_float_and_saves_that_config(capsys, tmp_path):
    path = tmp_path / "mixed.yaml"
    rc, out, _ = cli_main(capsys, *QUANTIZE, "--preset", "w4a8", "--mixed-budget", "32",
                          "--save-config", str(path))
    assert rc == 0
    assert "sensitivity: each point alone quantized" in out and "w4a8 dB" in out and "w8a8 dB" in out
    assert "mixed precision within 32 bits per weight" in out and "average 32.000 bits" in out
    config = QuantizerConfig.load(path)
    # tiny_mlp's two linears, float; nothing else in those modules
    assert config.module_name_operator_type == {"0": {"linear": None}, "2": {"linear": None}}


def test_a_budget_of_int4_weights_chooses_the_preset_everywhere(capsys, tmp_path):
    path = tmp_path / "mixed.json"
    # tiny_mlp: (32, 16) and (4, 32) weights, int4 groups of 32 (16 wide: one group per row): 4 + 16 / 16, 4.5.
    budget = (32 * 16 * 5 + 4 * 32 * 4.5) / (32 * 16 + 4 * 32)
    rc, out, _ = cli_main(capsys, *QUANTIZE, "--preset", "w4a8", "--mixed-budget", str(budget),
                          "--save-config", str(path))
    assert rc == 0
    config = QuantizerConfig.load(path)
    weight = config.global_config.weight
    chosen = config.module_name_operator_type
    assert chosen["0"]["linear"].weight == weight and chosen["2"]["linear"].weight == weight


@pytest.mark.parametrize("args, message", [
    (["--config", "c.yaml", "--mixed-budget", "5"], "--mixed-budget: give the base format with --preset"),
    (["--preset", "w4a8", "--mixed-budget", "2"], "--mixed-budget: mixed_precision: budget_bits 2.0 is below"),
    (["--preset", "w4a8", "--save-config", "c.txt"], "--save-config: expected a .yaml, .yml or .json file name"),
])
def test_argument_errors_are_one_line(capsys, args, message):
    rc, _, err = cli_main(capsys, *QUANTIZE, *args)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err
