"""The model's output point as a config choice: with
model_output false, an output point read only by the model's outputs is
left out (as torchao's XNNPACK and X86 quantizers leave logits float); a
tensor the model also reads keeps its point; describe says so; the choice
round-trips through dicts and files."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from tests.models.quantizer import single_thread, sqnr_db  # noqa: F401 (an autouse fixture)

from pt2e_fq.cli import pipeline
from quantizers import ConfigError, FakeQuantQuantizer, QuantizerConfig, presets
from quantizers.presets import every_point


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5)).eval()


def _batches(n, rows=32):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 16, generator=g),) for _ in range(n)]


def _converted(model, config, batches):
    prepared = pipeline.prepare(model, batches[0], config)
    pipeline.calibrate(prepared, batches, progress=False)
    return pipeline.convert(prepared)


def test_without_the_model_output_point_the_logits_are_the_quantized_model_s_before_its_last_point():
    """Reference: the model with the point. Its output is its last point
    applied to the float logits that the model without it returns."""
    batches = _batches(3)
    with_point = _converted(_mlp(), every_point("w8a8"), batches)
    without = _converted(_mlp(), every_point("w8a8").set_model_output(False), batches)
    (output,) = [n for n in with_point.graph.nodes if n.op == "output"]
    last_point = with_point.get_submodule(output.args[0][0].target)
    x = _batches(1, rows=7)[0][0]
    with torch.no_grad():
        logits = without(x)
        assert torch.equal(last_point(logits), with_point(x))
        assert not torch.equal(logits, with_point(x))
    modules = lambda gm: {id(m) for m in gm.modules() if type(m).__name__ == "FakeQuantize"}  # noqa: E731
    assert len(modules(without)) == len(modules(with_point)) - 1


class ReturnsHidden(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.head, self.out = nn.Linear(16, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.fc(x))  # returned and read by head
        return h, self.out(self.head(h).view(-1, 8))  # head's output reaches the outputs through a view only


def test_a_model_output_the_model_also_reads_keeps_its_point():
    gm = pipeline.export(ReturnsHidden().eval(), _batches(1)[0])
    plan = FakeQuantQuantizer(every_point("w8a8").set_model_output(False)).plan(gm)
    outputs = {n.name for n, ann in plan.annotations.items() if ann.output is not None}
    assert outputs == {"relu", "linear_1"}  # relu: read by head; linear_1 (head): read by out
    table = FakeQuantQuantizer(every_point("w8a8").set_model_output(False)).describe(gm, print_table=False)
    (out_row,) = [line for line in table.splitlines() if line.startswith("linear_2 ")]
    assert "float: a model output (model_output: false)" in out_row


def test_model_output_round_trips_and_a_bad_value_is_named(tmp_path):
    for flag in (True, False):
        config = presets.get_preset("w8a8").set_model_output(flag)
        assert config.to_dict()["model_output"] is flag
        config.save(tmp_path / "c.yaml")
        assert f"model_output: {str(flag).lower()}" in (tmp_path / "c.yaml").read_text()
        assert QuantizerConfig.load(tmp_path / "c.yaml").model_output is flag
    assert QuantizerConfig.from_dict({"global": None}).model_output is False  # the default, as torchao's
    assert QuantizerConfig().model_output is False
    assert all(presets.get_preset(name).model_output is False for name in presets.PRESETS)
    with pytest.raises(ConfigError, match=r"^model_output: expected true or false, got str 'no'$"):
        QuantizerConfig.from_dict({"model_output": "no"})
    with pytest.raises(TypeError, match=r"^set_model_output: quantize: expected true or false, got int 1$"):
        QuantizerConfig().set_model_output(1)


class BertClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        import transformers

        config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, max_position_embeddings=32, num_labels=5)
        torch.manual_seed(0)
        self.m = transformers.BertForSequenceClassification(config).eval()

    def forward(self, ids):
        return self.m(input_ids=ids, return_dict=False)[0]


def test_a_bert_classifier_calibrated_on_one_batch_gains_from_float_logits():
    """Measured (w8a8, one calibration batch of 16, 64 test sequences):
    24.4 dB with the logits' point, 29.3 dB without (docs/quantizers.md)."""
    model = BertClassifier().eval()
    g = torch.Generator().manual_seed(1)
    calibration = [(torch.randint(0, 100, (16, 12), generator=g),)]
    test = torch.randint(0, 100, (64, 12), generator=g)
    with torch.no_grad():
        reference = model(test)
        sqnr = {flag: sqnr_db(reference, pipeline.quantize(model, calibration[0],
                                                           every_point("w8a8").set_model_output(flag),
                                                           calibration=calibration, progress=False)(test))
                for flag in (True, False)}
    assert sqnr[False] > sqnr[True] + 3


def test_describe_ends_saying_whether_the_model_outputs_are_quantized():
    gm = pipeline.export(_mlp(), _batches(1)[0])
    last_line = lambda config: FakeQuantQuantizer(config).describe(gm, print_table=False).splitlines()[-1]  # noqa: E731
    assert last_line(presets.get_preset("w8a8")) == "model outputs: float (model_output: false)"
    assert last_line(every_point("w8a8")) == (
        "model outputs: quantized where an op config gives them an output point (model_output: true)")
