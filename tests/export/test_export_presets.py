"""Every preset of quantizers, PTQ, on the quantizer test models (an MLP, a
CNN with conv-bn-relu and a residual add, a transformer encoder block, an
embedding with a linear head): the .pt2 file runs bit for bit in a fresh
process; ONNX Runtime reproduces every point bit for bit (check_onnx) for
the presets ONNX Runtime can run, and to_onnx refuses the E2M1 ones with the
reason; the report lists every fake-quant point once."""

from __future__ import annotations

import pytest
import torch
from tests.models.quantized import run_in_fresh_process
from tests.models.quantizer import MODELS, build, example_batch, prepare, single_thread  # noqa: F401
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

import pt2e_fq as q
from pt2e_fq.export import check_onnx, to_onnx
from quantizers import FakeQuantQuantizer, presets

ONNX_PRESETS = ("w8a8", "w4a8", "w4a16", "w8a16", "fp8", "mxfp8")
E2M1_PRESETS = ("mxfp4", "nvfp4")  # ONNX Runtime has no FLOAT4E2M1 Q / DQ
WEIGHTED = {"linear", "conv2d", "embedding"}


def _converted(preset: str, model_name: str):
    model = build(model_name).eval()
    gm = prepare(model, example_batch(model_name, 0, n=4), FakeQuantQuantizer(presets.get_preset(preset)))
    for seed in (1, 2):
        gm(example_batch(model_name, seed, n=4))
    return convert_pt2e(gm)


def _points(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), q.FakeQuantize)]


# The fixture converts every preset on every model: its tests share one worker.
pytestmark = pytest.mark.xdist_group("export_presets")


@pytest.fixture(scope="module")
def converted():
    return {(p, m): _converted(p, m) for p in presets.PRESETS for m in MODELS}


def test_every_preset_round_trips_through_pt2_in_a_fresh_process(converted, tmp_path):
    paths, inputs, expected = {}, {}, {}
    for (preset, name), model in converted.items():
        key = f"{preset}-{name}"
        paths[key] = tmp_path / f"{key}.pt2"
        q.save(model, (example_batch(name, 0, n=4),), paths[key])
        inputs[key] = example_batch(name, 5, n=4)
        expected[key] = model(inputs[key])
    for key, loaded in run_in_fresh_process(paths, inputs).items():
        assert torch.equal(loaded.view(torch.int32), expected[key].view(torch.int32)), key


@pytest.mark.parametrize("preset", ONNX_PRESETS)
def test_every_preset_runs_in_onnx_runtime_like_torch(converted, preset, tmp_path):
    for name in MODELS:
        model = converted[(preset, name)]
        path = tmp_path / f"{name}.onnx"
        to_onnx(model, (example_batch(name, 0, n=4),), path)
        result = check_onnx(path, model, (example_batch(name, 6, n=4),))
        assert result.points == len(_points(model)), name  # each compared bit for bit


@pytest.mark.parametrize("preset", E2M1_PRESETS)
def test_e2m1_presets_are_refused_with_the_reason(converted, preset, tmp_path):
    for name in MODELS:
        with pytest.raises(NotImplementedError, match="neither QuantizeLinear nor DequantizeLinear for FLOAT4E2M1"):
            to_onnx(converted[(preset, name)], (example_batch(name, 0, n=4),), tmp_path / "m.onnx")


@pytest.mark.parametrize("preset", list(presets.PRESETS))
def test_the_report_lists_every_point_of_every_preset_once(converted, preset):
    # The op types the preset leaves float (quantizers.presets: embedding tables where activations
    # are quantized; convs under the linear-only -dyn presets) have no weight rows.
    config = presets.get_preset(preset)
    quantized = {t for t in WEIGHTED if config.operator_type.get(t, config.global_config) is not None}
    for name in MODELS:
        model = converted[(preset, name)]
        rows = q.report(model, (example_batch(name, 7, n=4),), file=None).rows
        assert sorted(r["point"] for r in rows) == sorted(n.target for n in _points(model)), name
        weighted = [n for n in model.graph.nodes if n.op == "call_function" and n.target.__name__.split(".")[0]
                    in quantized]
        weight_rows = [r for r in rows if r["role"].startswith("weight of ")]
        assert sorted(r["role"] for r in weight_rows) == sorted(f"weight of {n.name}" for n in weighted), name
        # Every point ran and applied scales (MX / NVFP4: the block scales; an
        # NVFP4 block of zeros has scale 0).
        assert all(r["scale"] is not None and r["scale"][1] > 0 and r["sqnr_db"] > 10 for r in rows), name
