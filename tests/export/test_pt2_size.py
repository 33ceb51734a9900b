"""A saved .pt2 holds only the bytes it needs.

torch.export.save writes the whole storage behind each tensor: an example
batch that is a torch.split piece of a large calibration tensor used to
carry all of it, and so did a parameter, buffer or constant that is a view
into a larger tensor. The bound: at most 1.1x the program's parameter,
buffer and constant bytes, plus the example inputs' own bytes, plus 1 MiB
(the archive's JSON and zip overhead).
"""

from __future__ import annotations

import torch
from tests.models.quantizer import single_thread  # noqa: F401 (an autouse fixture: one thread)

import pt2e_fq
from pt2e_fq.cli import pipeline
from benchmarks.models import CNN

MIB = 1 << 20


def _bound(tensors, example) -> int:
    return int(1.1 * sum(t.nbytes for t in tensors)) + sum(t.nbytes for t in example) + MIB


def test_an_example_batch_split_from_a_large_calibration_tensor_is_saved_as_its_own_bytes(tmp_path):
    torch.manual_seed(0)
    crops = torch.randn(512, 3, 32, 32, generator=torch.Generator().manual_seed(1))  # 6 MiB
    batches = [(b,) for b in torch.split(crops, 4)[:4]]
    example = batches[0]
    converted = pipeline.quantize(CNN(channels=8).eval(), example, "w8a8", calibration=batches, progress=False)
    path = tmp_path / "cnn.pt2"
    saved = pt2e_fq.save(converted, example, path)

    bound = _bound(converted.state_dict().values(), example)
    assert path.stat().st_size <= bound, (path.stat().st_size, bound, crops.nbytes)
    loaded = pt2e_fq.load(path)
    (args, kwargs) = loaded.example_inputs
    assert torch.equal(args[0], example[0]) and not kwargs
    assert torch.equal(loaded.module()(example[0]), converted(example[0]))
    # The program save gives back keeps the caller's example as it was (a view of the crops).
    assert saved.example_inputs[0][0].untyped_storage().data_ptr() == crops.untyped_storage().data_ptr()


class _Views(torch.nn.Module):
    """A parameter, a buffer and a constant, each a small view into a 4 MB tensor."""

    def __init__(self):
        super().__init__()
        store = torch.randn(1000, 1000, generator=torch.Generator().manual_seed(2))
        self.weight = torch.nn.Parameter(store[:4, :8])
        self.register_buffer("shift", store[5, :4])
        self.table = store[6:8, :4]  # a plain tensor attribute: a constant of the program

    def forward(self, x):
        return x @ self.weight.t() + self.shift + self.table.sum()


def test_parameters_buffers_and_constants_that_are_views_are_saved_as_their_own_bytes(tmp_path):
    model = _Views()
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(3))
    path = tmp_path / "views.pt2"
    pt2e_fq.save(model, (x,), path)
    assert path.stat().st_size <= _bound([model.weight, model.shift, model.table], (x,)), path.stat().st_size
    with torch.no_grad():
        # Within float32 rounding: the matmul of a contiguous weight sums in another order than the strided view's.
        torch.testing.assert_close(pt2e_fq.load(path).module()(x), model(x))
    assert model.weight.untyped_storage().nbytes() == 4_000_000  # the model is left as it was
