"""pt2e_fq.convert_pt2e: torchao's convert_pt2e without its QAT conv-bn
fold's pattern search, which finds nothing in a graph of pt2e_fq points.
The reference is torchao's convert_pt2e itself: the same graph, the same
outputs. The fold is skipped by replacing torchao's private
`qat_utils._fold_conv_bn_qat_helper`, so torchao's minor version is pinned
and a test fails where that name is gone."""

from __future__ import annotations

import copy
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
import torchao.quantization.pt2e as tao
from tests.models.stock_flow import batches, calibrate, qat_prepared
from tests.models.quantizer import single_thread  # noqa: F401 (an autouse fixture)
from torchao.quantization.pt2e import qat_utils
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e as torchao_convert_pt2e

import pt2e_fq
from pt2e_fq import FakeQuantize

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_torchao_s_private_fold_helper_is_still_there():
    assert callable(getattr(qat_utils, "_fold_conv_bn_qat_helper", None)), (
        "torchao.quantization.pt2e.qat_utils._fold_conv_bn_qat_helper is gone: pt2e_fq.flow.convert_pt2e "
        "skips torchao's conv-bn fold by replacing it")


def test_torchao_is_pinned_to_the_tested_minor_version():
    (requirement,) = [d for d in tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
                      if d.startswith("torchao")]
    low, high = re.fullmatch(r"torchao>=(\d+\.\d+),<(\d+\.\d+)", requirement).groups()
    installed = tuple(map(int, version("torchao").split(".")[:2]))
    assert tuple(map(int, low.split("."))) <= installed < tuple(map(int, high.split(".")))
    assert int(high.split(".")[1]) == int(low.split(".")[1]) + 1  # one minor version


@pytest.fixture(scope="module")
def prepared():
    model = pt2e_fq.move_exported_model_to_eval(qat_prepared("conv_bn_cnn"))
    calibrate(model, batches(2))
    return model


@pytest.mark.slow  # torchao's convert_pt2e searches its conv-bn patterns: about 40 s on a 2-core CPU
def test_convert_gives_torchao_s_graph(prepared):
    ours, theirs = pt2e_fq.convert_pt2e(copy.deepcopy(prepared)), torchao_convert_pt2e(copy.deepcopy(prepared))
    assert ours.code == theirs.code
    assert "num_batches_tracked" not in ours.code  # torchao's clean-up ran
    x = batches(1, seed=9)[0]
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))


def test_convert_skips_the_fold_s_search_and_puts_the_helper_back(prepared, monkeypatch):
    calls = []
    monkeypatch.setattr(qat_utils, "_fold_conv_bn_qat_helper", lambda m, *a, **k: calls.append(1) or m)
    helper = qat_utils._fold_conv_bn_qat_helper
    pt2e_fq.convert_pt2e(copy.deepcopy(prepared))
    assert calls == [] and qat_utils._fold_conv_bn_qat_helper is helper


def test_convert_runs_torchao_s_fold_when_a_point_is_not_ours(prepared, monkeypatch):
    model = copy.deepcopy(prepared)
    name = next(n for n, m in model.named_modules() if isinstance(m, FakeQuantize))
    setattr(model, name, tao.FakeQuantize())  # a stock torchao point
    calls = []
    monkeypatch.setattr(qat_utils, "_fold_conv_bn_qat_helper", lambda m, *a, **k: calls.append(1) or m)
    pt2e_fq.convert_pt2e(model)
    assert calls


def test_the_helper_is_put_back_when_convert_fails(prepared):
    helper = qat_utils._fold_conv_bn_qat_helper
    model = copy.deepcopy(prepared)
    for m in model.modules():
        if isinstance(m, FakeQuantize) and m.qspec.dynamic is False:
            m.scale.fill_(float("nan"))
            break
    with pytest.raises(pt2e_fq.NonFiniteQParamsError):
        pt2e_fq.convert_pt2e(model)
    assert qat_utils._fold_conv_bn_qat_helper is helper


def test_the_drop_ins_take_torchao_s_arguments():
    import inspect

    from torchao.quantization.pt2e import move_exported_model_to_eval

    for ours, theirs in ((pt2e_fq.convert_pt2e, torchao_convert_pt2e),
                         (pt2e_fq.move_exported_model_to_eval, move_exported_model_to_eval)):
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters)
        assert [p.default for p in inspect.signature(ours).parameters.values()] == \
            [p.default for p in inspect.signature(theirs).parameters.values()]
