"""pt2e_fq.save / pt2e_fq.load: a .pt2 file loads in a fresh process where
only pt2e_fq was imported and runs bit for bit like the model."""

from __future__ import annotations

import pytest
import torch
from tests.models.quantized import (
    QAT_SHAPE,
    FloatFormatModel,
    batch,
    float_format_input,
    min_max_reference,
    ptq,
    qat_converted,
    run_in_fresh_process,
)

import pt2e_fq as q

PTQ = {
    "int8": (q.QSpec(q.INT8, scheme="asymmetric"), q.QSpec(q.INT8, q.PerChannel(0), "symmetric_narrow")),
    "int4-minval-dynamic": (
        q.QSpec(q.INT8, q.PerToken(), "asymmetric", dynamic=True),
        q.QSpec(q.INT4, q.PerGroup(16), "asymmetric", "minval"),
    ),
}


def test_saved_programs_load_in_a_fresh_process_and_run_bit_for_bit(tmp_path):
    expected, paths, inputs = {}, {}, {}
    dynamic = ({0: torch.export.Dim("batch")},)
    for name, (act, weight) in PTQ.items():
        model = ptq(act, weight, dynamic_shapes=dynamic)
        paths[name] = tmp_path / f"{name}.pt2"
        q.save(model, (batch(0),), paths[name], dynamic_shapes=dynamic)
        inputs[name] = batch(10, (5, 3, 6, 6))  # another batch size than the example's
        expected[name] = model(inputs[name])
    for kind in ("fp8", "mx"):  # float-format ops (called directly)
        model = FloatFormatModel(kind).eval()
        paths[kind] = tmp_path / f"{kind}.pt2"
        q.save(model, (float_format_input(0),), paths[kind])
        inputs[kind] = float_format_input(1)
        expected[kind] = model(inputs[kind])
    # QAT conv-bn: saved folded; the reference is the program save returns.
    model = qat_converted()
    paths["qat"] = tmp_path / "qat.pt2"
    inputs["qat"] = batch(11, QAT_SHAPE)
    ep = q.save(model, (inputs["qat"],), paths["qat"])
    assert not any(n.target == torch.ops.aten.batch_norm.default for n in ep.graph.nodes)
    expected["qat"] = ep.module()(inputs["qat"])

    loaded = run_in_fresh_process(paths, inputs)
    for name in paths:
        assert torch.equal(loaded[name].view(torch.int32), expected[name].view(torch.int32)), name


def test_a_saved_program_has_one_pt2e_fq_node_per_point_and_only_qparam_buffers(tmp_path):
    model = ptq(*PTQ["int8"])
    ep = q.save(model, batch(0), tmp_path / "m.pt2")
    loaded = q.load(tmp_path / "m.pt2")
    ops = [n for n in loaded.graph.nodes if n.op == "call_function" and str(n.target).startswith("pt2e_fq.")]
    assert len(ops) == 6  # input, weight, output of the conv and of the linear
    buffers = set(loaded.graph_signature.inputs_to_buffers.values())
    assert {b.rsplit(".", 1)[1] for b in buffers} == {"scale", "zero_point"}
    assert torch.equal(loaded.module()(batch(3)), ep.module()(batch(3)))


def test_save_refuses_a_model_that_is_not_converted(tmp_path):
    prepared = ptq(*PTQ["int8"], convert=False)
    with pytest.raises(ValueError, match="convert_pt2e"):
        q.save(prepared, (batch(0),), tmp_path / "m.pt2")


def test_save_names_the_bad_argument(tmp_path):
    model = ptq(*PTQ["int8"])
    with pytest.raises(TypeError, match="example_inputs must be a tensor or a tuple"):
        q.save(model, {"x": batch(0)}, tmp_path / "m.pt2")
    with pytest.raises(TypeError, match="model_or_program must be a torch.nn.Module or"):
        q.save("model.pt", (batch(0),), tmp_path / "m.pt2")
    with pytest.raises(TypeError, match="fold_bn must be True or False"):
        q.save(model, (batch(0),), tmp_path / "m.pt2", fold_bn="yes")


class _MaskOutput(torch.nn.Module):
    """One per-channel point on 4 features that also returns its clamp mask:
    the packed mask has ceil(4 * batch / 8) bytes, 1 at batch 1 and 2."""

    def forward(self, x):
        y, mask = q.ops.fake_quantize_affine_with_mask(x, [x.shape[0], 1], torch.full((4,), 0.1), None, -8, 7)
        return y, q.ops.unpack_mask(mask, x.shape)


def test_a_dynamic_batch_program_runs_at_every_batch_size(tmp_path):
    # A converted model (mask unused) and a program that uses the mask, saved
    # with a dynamic batch as the CLI writes it (Dim.AUTO) and as the user
    # guide does (Dim("batch")); each must run at any batch size, 0 included.
    models = {
        "converted": ptq(
            *PTQ["int8"], model=torch.nn.Sequential(torch.nn.Linear(16, 4)), shape=(8, 16),
            dynamic_shapes=({0: torch.export.Dim("batch")},),
        ),
        "mask_used": _MaskOutput(),
    }
    # Dynamic points reduce over the batch in the program itself: per-tensor
    # FP8 (the fp8 preset's activations: amax of |x|) and per-tensor int8
    # (min and max).
    linear = lambda: torch.nn.Sequential(torch.nn.Linear(16, 4))  # noqa: E731
    for name, act, weight in (
        ("fp8_dynamic", q.QSpec(q.FP8_E4M3, q.PerTensor(), dynamic=True), q.QSpec(q.FP8_E4M3, q.PerChannel(0))),
        ("int8_dynamic", q.QSpec(q.INT8, q.PerTensor(), "asymmetric", dynamic=True), PTQ["int8"][1]),
    ):
        models[name] = ptq(act, weight, model=linear(), shape=(8, 16),
                           dynamic_shapes=({0: torch.export.Dim("batch")},))
    failures = []
    for name, model in models.items():
        for i, dim in enumerate((torch.export.Dim.AUTO, torch.export.Dim("batch"))):
            path = tmp_path / f"{name}-{i}.pt2"
            try:
                example = (torch.randn(8, 4 if name == "mask_used" else 16),)
                saved = q.save(model, example, path, dynamic_shapes=({0: dim},))
            except Exception as e:  # noqa: BLE001 - collected: every combination is reported
                failures.append(f"{name} {dim}: save: {str(e).splitlines()[0]}")
                continue
            loaded = q.load(path)
            for b in (0, 1, 2, 3, 7, 8, 9, 1000):
                x = torch.randn(b, 4 if name == "mask_used" else 16, generator=torch.Generator().manual_seed(b))
                expected = model(x)
                for program in (saved, loaded):
                    try:
                        got = program.module()(x)
                    except Exception as e:  # noqa: BLE001
                        failures.append(f"{name} {dim} batch {b}: {str(e).splitlines()[0]}")
                        continue
                    assert all(torch.equal(g, e) for g, e in zip(torch.utils._pytree.tree_leaves(got),
                                                                 torch.utils._pytree.tree_leaves(expected)))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("granularity", [q.PerBlock((2, 8)), q.PerBlock((3, 16)), q.PerBlock((16, 1)),
                                         q.PerChannel(1)], ids=repr)
def test_a_dynamic_point_blocked_along_the_batch_runs_at_every_batch_size(granularity, tmp_path):
    # Blocks of 2, 3 and 16 rows (more than the example's 8) along a dynamic
    # batch: comparing the batch with its block while tracing guarded the
    # program to the example's answer (batch >= 2, batch % 2 == 0), so it
    # refused batch 0, 1 and odd sizes, and Dim("batch") failed to save.
    # Per channel, each block is the whole batch: reducing over it guarded
    # batch != 1.
    act = q.QSpec(q.INT8, granularity, "asymmetric", dynamic=True)
    weight = q.QSpec(q.INT8, q.PerChannel(0), "symmetric_narrow")
    linear = torch.nn.Linear(16, 4)
    weight_q = min_max_reference(weight, linear.weight.detach())
    model = ptq(act, weight, model=torch.nn.Sequential(linear), shape=(8, 16),
                dynamic_shapes=({0: torch.export.Dim("batch")},))
    for i, dim in enumerate((torch.export.Dim.AUTO, torch.export.Dim("batch"))):
        path = tmp_path / f"m-{i}.pt2"
        saved = q.save(model, (torch.randn(8, 16),), path, dynamic_shapes=({0: dim},))
        for b in (0, 1, 2, 5, 8, 20):
            x = torch.randn(b, 16, generator=torch.Generator().manual_seed(b))
            # The input and output points are dynamic; the weight point's range is the weight's.
            hidden = torch.nn.functional.linear(min_max_reference(act, x), weight_q, linear.bias)
            expected = min_max_reference(act, hidden)
            for program in (saved, q.load(path)):
                assert torch.equal(program.module()(x), expected), (dim, b)


@pytest.mark.needs_torch("2.13", "torch 2.11's export of attention with a length from 1 calls numel() on a symbolic size inside aten.linear (RuntimeError)")
def test_attention_with_a_dynamic_length_from_1_saves_and_runs_at_every_length(tmp_path):
    # torch's matmul of 4-D operands (q @ k.transpose(2, 3)) reshapes them to
    # 3-D; export with size-oblivious reasoning guards a length != 1 there and
    # refused the range [1, 16], which the plain export takes.
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from benchmarks.models import LlamaDecoder
    from quantizers import FakeQuantQuantizer, presets

    torch.manual_seed(0)
    model = LlamaDecoder(vocab=32, dim=32, layers=1, heads=2, max_seq=16).eval()
    dims = ({0: torch.export.Dim("batch", min=1, max=4), 1: torch.export.Dim("seq", min=1, max=16)},)
    example = (torch.randint(0, 32, (2, 8)),)
    prepared = prepare_pt2e(torch.export.export(model, example, dynamic_shapes=dims).module(),
                            FakeQuantQuantizer(presets.get_preset("w8a8-dyn")))
    prepared(*example)
    converted = convert_pt2e(prepared)
    saved = q.save(converted, example, tmp_path / "m.pt2", dynamic_shapes=dims)
    for b, t in ((1, 1), (4, 16), (3, 5)):
        x = torch.randint(0, 32, (b, t), generator=torch.Generator().manual_seed(t))
        assert torch.equal(saved.module()(x), converted(x)), (b, t)
