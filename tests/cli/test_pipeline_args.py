"""Models whose forward gathers its inputs in *args (common wrappers of HF
models), through pipeline and the CLI, and the CLI's --static-batch.
The factories here are also `--model tests.cli.test_pipeline_args:...`."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from tests.conftest import cli_main
from tests.models.quantizer import single_thread, sqnr_db  # noqa: F401 (an autouse fixture)

import pt2e_fq
from pt2e_fq.cli import pipeline


class _StarArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(6, 4)

    def forward(self, *args):
        return self.a(args[0]) + self.b(args[1])


class _FirstThenStar(_StarArgs):
    def forward(self, x, *rest):
        return self.a(x) + self.b(rest[0])


def star_args() -> nn.Module:
    torch.manual_seed(0)
    return _StarArgs()


def first_then_star() -> nn.Module:
    torch.manual_seed(0)
    return _FirstThenStar()


def _inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 6, generator=g)


@pytest.mark.parametrize("factory", [star_args, first_then_star])
def test_pipeline_quantizes_a_star_args_model_for_any_batch_size(factory):
    model = factory().eval()
    converted = pipeline.quantize(model, _inputs(4), "w8a8", calibration=[_inputs(256, s) for s in range(3)],
                                  progress=False)
    x = _inputs(7, seed=5)  # another batch size than the example's
    with torch.no_grad():
        assert sqnr_db(model(*x), converted(*x)) > 30


def test_batch_dynamic_shapes_follows_the_forward_s_parameters():
    """torch.export's own check is the reference: it takes these and
    exports a program whose batch dimension is dynamic."""
    args = _inputs(4)
    for model in (star_args(), first_then_star()):
        program = torch.export.export(model, args, dynamic_shapes=pipeline.batch_dynamic_shapes(args, model))
        x = _inputs(9)
        torch.testing.assert_close(program.module()(*x), model(*x))


QUANTIZE = ["quantize", "--model", "tests.cli.test_pipeline_args:star_args", "--example-input", "4x8,4x6", "--preset", "w8a8",
            "--no-progress"]


def test_cli_quantizes_a_star_args_model(capsys, tmp_path):
    calib = tmp_path / "calib.pt"
    torch.save([_inputs(256, s) for s in range(3)], calib)
    rc, out, err = cli_main(capsys, *QUANTIZE, "--calib-data", str(calib), "--out", str(tmp_path / "m.pt2"))
    assert rc == 0, err
    x = _inputs(5, seed=3)
    with torch.no_grad():
        assert sqnr_db(star_args()(*x), pt2e_fq.load(tmp_path / "m.pt2").module()(*x)) > 30


def test_cli_static_batch_saves_a_program_for_the_example_s_batch_size(capsys, tmp_path):
    pt2 = tmp_path / "m.pt2"
    rc, out, err = cli_main(capsys, *QUANTIZE, "--static-batch", "--out", str(pt2))
    assert rc == 0, err
    program = pt2e_fq.load(pt2)
    shapes = [tuple(n.meta["val"].shape) for n in program.graph.nodes
              if n.op == "placeholder" and n.name in program.graph_signature.user_inputs]
    assert shapes == [(4, 8), (4, 6)]  # plain ints: static
    rc, _, err = cli_main(capsys, "report", str(pt2), "--example-input", "3x8,3x6")
    assert rc == 2 and "the model takes [(4, 8) float32, (4, 6) float32]" in err


def test_cli_static_batch_needs_calibration_batches_of_the_example_s_size(capsys, tmp_path):
    calib = tmp_path / "calib.pt"
    torch.save([_inputs(4), _inputs(3)], calib)
    rc, _, err = cli_main(capsys, *QUANTIZE, "--static-batch", "--calib-data", str(calib))
    assert rc == 2
    assert "--calib-data: batch 1 of" in err and "has inputs [(3, 8) float32, (3, 6) float32]; the model takes " \
        "[(4, 8) float32, (4, 6) float32]" in err
    rc, _, err = cli_main(capsys, *QUANTIZE, "--calib-data", str(calib))  # a dynamic batch takes both
    assert rc == 0, err


def test_an_example_batch_of_one_is_named_by_a_warning_and_the_program_takes_batch_one_only():
    """torch.export fixes a dimension of size 1: the warning says so before
    a later batch fails on the program's guard."""
    model = nn.Linear(8, 4)
    with pytest.warns(UserWarning, match=r"export: example_inputs have a batch \(dimension 0\) of 1, which "
                                         r"torch.export fixes at 1"):
        gm = pipeline.export(model, torch.randn(1, 8))
    gm(torch.randn(1, 8))
    with pytest.raises(Exception, match="Guard failed"):
        gm(torch.randn(3, 8))


class _Add(nn.Module):
    def forward(self, x, y):
        return x + y


@pytest.mark.parametrize("example", [(torch.randn(3, 8), torch.randn(3, 8)), (torch.randn(3, 8), torch.randn(1, 8))],
                         ids=["batch_3", "a_broadcast_input_beside_batch_3"])
def test_an_example_batch_of_more_than_one_is_not_warned_about(example, recwarn):
    pipeline.export(_Add(), example)
    assert not [w for w in recwarn if "torch.export fixes at 1" in str(w.message)]
