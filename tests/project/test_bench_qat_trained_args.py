"""benchmarks/bench_qat_trained's command line: --lr and --steps reach
every model's run (the weights' rate and the QAT steps of each flow) and
are refused, naming the value, when they are not a rate above 0 or a
count of at least one."""

from __future__ import annotations

import pytest

from benchmarks import bench_qat_trained


@pytest.fixture
def runs(monkeypatch) -> list:
    """(model, lr, steps) of each run main starts; the runs themselves do nothing."""
    seen = []

    def fake_run(name, quick, flows, lr=None, steps=None):
        seen.append((name, lr, steps))
        return []

    monkeypatch.setattr(bench_qat_trained, "run", fake_run)
    return seen


def test_lr_reaches_every_models_run(runs):
    bench_qat_trained.main(["--lr", "3e-5", "--flows", "ours", "--threads", "1"])
    assert runs == [(name, 3e-5, None) for name in bench_qat_trained.MODELS]
    bench_qat_trained.main(["--models", "minilm", "--flows", "ours", "--threads", "1"])
    assert runs[-1] == ("minilm", None, None)  # each model's own SETUPS rate and steps


@pytest.mark.parametrize("lr", ["0", "-1e-4"])
def test_lr_must_be_above_zero(lr, capsys):
    with pytest.raises(SystemExit):
        bench_qat_trained.main([f"--lr={lr}"])
    assert f"--lr must be a rate > 0, got {float(lr)}" in capsys.readouterr().err


def test_steps_reaches_every_models_run(runs):
    bench_qat_trained.main(["--steps", "900", "--flows", "ours", "--threads", "1"])
    assert runs == [(name, None, 900) for name in bench_qat_trained.MODELS]


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_steps_must_be_at_least_one(steps, capsys):
    with pytest.raises(SystemExit):
        bench_qat_trained.main([f"--steps={steps}"])
    assert f"--steps must be at least 1, got {int(steps)}" in capsys.readouterr().err
