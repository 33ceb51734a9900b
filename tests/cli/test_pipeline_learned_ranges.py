"""QAT through `pipeline.quantize` and `pt2e-fq quantize --qat-steps`
learns the ranges of learnable points: their observers go off after
calibration, so the optimizer's steps accumulate instead of being
overwritten by the observed range at every forward.

The observed scale is written by hand from the calibration data (the
model input's point: asymmetric int4, min / max over every batch)."""

from __future__ import annotations

import pytest
import torch

from tests.models import cli as cli_models
from tests.conftest import cli_main
import pt2e_fq as q
from pt2e_fq.cli import pipeline
from pt2e_fq.fake_quantize import FakeQuantize
from quantizers import OpConfig, QuantizerConfig

LR = 1e-3
STEPS = 30


def _config() -> QuantizerConfig:
    act = q.QSpec(q.INT4, q.PerTensor(), "asymmetric", learnable=True)
    return QuantizerConfig(OpConfig(input_activation=act, weight=q.QSpec(q.INT8, q.PerChannel(0), "symmetric")))


def _calibration() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 16, generator=g) for _ in range(4)]


def _observed_scale(batches) -> float:
    lo = min(0.0, min(float(b.min()) for b in batches))
    hi = max(0.0, max(float(b.max()) for b in batches))
    return (hi - lo) / 15


def _input_point_scale(prepared: torch.fx.GraphModule) -> float:
    """The scale of the point on the model's input, as trained."""
    (point,) = [prepared.get_submodule(n.target) for n in prepared.graph.nodes
                if n.op == "call_module" and n.args[0].op == "placeholder"
                and isinstance(prepared.get_submodule(n.target), FakeQuantize)]
    assert point.qspec.learnable
    return float(point.scale)


@pytest.fixture
def trained_scales(monkeypatch):
    """The input point's scale at convert, for every quantize run in the test."""
    scales = []
    convert = pipeline.convert

    def spy(prepared):
        scales.append(_input_point_scale(prepared))
        return convert(prepared)

    monkeypatch.setattr(pipeline, "convert", spy)
    return scales


def _assert_learned(scale: float, observed: float) -> None:
    # Adam moves a Parameter by about LR a step (at most ~3.2 LR): a range
    # overwritten by its observer at every forward ends one step away.
    assert abs(scale - observed) > 5 * LR, f"scale {scale} is the observed {observed} plus at most one step"


def test_pipeline_quantize_learns_learnable_ranges(trained_scales):
    batches = _calibration()
    pipeline.quantize(cli_models.tiny_mlp(), (batches[0],), _config(), calibration=batches, qat_steps=STEPS,
                      lr=LR, progress=False)
    _assert_learned(trained_scales[0], _observed_scale(batches))


def test_cli_quantize_learns_learnable_ranges(trained_scales, capsys, tmp_path):
    batches = _calibration()
    config, data = tmp_path / "learnable.yaml", tmp_path / "calib.pt"
    _config().save(config)
    torch.save(batches, data)
    rc, _, err = cli_main(capsys, "quantize", "--model", "tests.models.cli:tiny_mlp", "--example-input", "16x16",
                          "--config", str(config), "--calib-data", str(data), "--qat-steps", str(STEPS),
                          "--lr", str(LR), "--no-progress")
    assert rc == 0, err
    _assert_learned(trained_scales[0], _observed_scale(batches))
