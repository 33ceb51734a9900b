"""An int4 / int8 Llama-style decoder as an ExecuTorch .pte with XNNPACK:
ours (w4a8-dyn, w8a8-dyn through the stock PT2E flow and to_executorch)
against the float .pte and torchao's own 8da4w .pte, in one run.

The model: benchmarks.models.LlamaDecoder (4 layers, dim 512, 8 heads,
SwiGLU width 1408, vocabulary 4096), random init with each row's groups of
32 weights scaled by their own factor e^N(0, 0.5) (a fresh linear's groups
all span about the same range; a trained model's do not, and the SQNR check
should see a wrong group). Every .pte is exported with a dynamic batch (up
to 4) and sequence length (up to 128).

- float .pte: torch.export of the float model, XNNPACK fp32;
- ours: presets.get_preset(name, target="xnnpack") through prepare_pt2e /
  convert_pt2e (weights round-to-nearest, w4a8-dyn's group scales rounded
  to bfloat16 as XNNPACK stores them, activations per token at run time),
  to_executorch: every linear in XNNPACK's dynamically quantized linear;
- torchao 8da4w: quantize_(model, Int8DynamicActivationIntxWeightConfig(
  weight_dtype=torch.int4, weight_granularity=PerGroup(32),
  weight_mapping_type=MappingType.SYMMETRIC)), torch.export,
  to_edge_transform_and_lower with XnnpackPartitioner.

Printed per variant: the file's size; the median forward time at batch 1,
sequence 128, with the given number of XNNPACK threads, divided by 128 (ms
per token, prefill), and its speed-up over the float .pte, each timed
right after one untimed forward of the same file, as a deployed model runs
its forwards back to back ("ms/token"), and right after another file's
forward, whose weights have pushed this one's out of the caches ("after
another"; the variants take turns, so each follows every other equally
often); the linears XNNPACK runs, the XNNPACK subgraphs (a delegate call
each per forward) and the ops left to ExecuTorch's portable kernels
(dynamic sizes included); the logits' SQNR against float eager, and for
ours against the converted fake-quant model, whose bound (check_lowered's,
30 dB) the .pte must meet at every size it takes (checked at three shapes).

    python benchmarks/bench_llm_deploy.py [--repeats N] [--threads N]
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import os
import platform
import tempfile
import warnings

import torch
from bench_ops import median_ms
from models import LlamaDecoder, vary_group_ranges
from tabulate import tabulate
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from pt2e_fq.export import check_lowered, run_pte, to_executorch
from pt2e_fq.report import sqnr_db
from quantizers import FakeQuantQuantizer, presets

MAX_BATCH, MAX_SEQ, SEQ, VOCAB = 4, 128, 128, 4096
DIMS = ({0: torch.export.Dim("batch", min=1, max=MAX_BATCH), 1: torch.export.Dim("seq", min=1, max=MAX_SEQ)},)
CHECK_SHAPES = ((1, 1), (1, SEQ), (MAX_BATCH, 17))


def decoder() -> LlamaDecoder:
    torch.manual_seed(0)
    # Group ranges that differ, as a trained model's do (a wrong group's scale then shows).
    return vary_group_ranges(LlamaDecoder(vocab=VOCAB, dim=512, layers=4, heads=8, max_seq=MAX_SEQ).eval())


def tokens(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def ours(model, preset: str):
    example = (tokens(2, 16),)
    prepared = prepare_pt2e(torch.export.export(model, example, dynamic_shapes=DIMS).module(),
                            FakeQuantQuantizer(presets.get_preset(preset, target="xnnpack")))
    prepared(*example)
    return convert_pt2e(prepared)


def _lower(program, path: str) -> tuple[str, tuple[int, int, int]]:
    """Writes `program` as a .pte through XNNPACK; returns the path and the
    delegation: linears in the delegate, XNNPACK subgraphs, ops left outside."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.devtools.backend_debug import get_delegation_info
    from executorch.exir import to_edge_transform_and_lower

    edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    info = get_delegation_info(edge.exported_program().graph_module)
    linears = info.delegation_by_operator.get("aten_linear_default")
    outside = sum(b.non_delegated for op, b in info.delegation_by_operator.items() if op != "getitem")
    with open(path, "wb") as f:
        f.write(edge.to_executorch().buffer)
    return path, (linears.delegated if linears else 0, info.num_delegated_subgraphs, outside)


def torchao_8da4w(model, path: str) -> tuple[str, tuple[int, int, int]]:
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerGroup, quantize_
    from torchao.quantization.quant_primitives import MappingType

    model = copy.deepcopy(model)
    quantize_(model, Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4, weight_granularity=PerGroup(32), weight_mapping_type=MappingType.SYMMETRIC))
    return _lower(torch.export.export(model, (tokens(2, 16),), dynamic_shapes=DIMS), path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2, help="XNNPACK's thread pool")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool
    from executorch.runtime import Runtime

    import torchao

    model = decoder()
    x = tokens(1, SEQ, seed=5)
    with torch.no_grad():
        reference = model(x)
    rows, runners, checks = [], {}, {}
    with tempfile.TemporaryDirectory() as folder:
        path = lambda name: os.path.join(folder, f"{name}.pte")  # noqa: E731
        files, delegation, converted = {}, {}, {}
        files["float .pte"], delegation["float .pte"] = _lower(
            torch.export.export(model, (tokens(2, 16),), dynamic_shapes=DIMS), path("float"))
        for name in presets.DYNAMIC_ACTIVATION_PRESETS:
            converted[name] = ours(model, name)
            result = to_executorch(converted[name], (tokens(2, 16),), path(name), dynamic_shapes=DIMS)
            files[f"ours {name}"] = result.path
            delegation[f"ours {name}"] = (result.delegated_linears, result.delegated_subgraphs, sum(result.outside.values()))
            checks[f"ours {name}"] = [check_lowered(result.path, converted[name], (tokens(b, s, seed=b + s),))
                                      for b, s in CHECK_SHAPES]
        files["torchao 8da4w"], delegation["torchao 8da4w"] = torchao_8da4w(model, path("torchao_8da4w"))
        _unsafe_reset_threadpool(args.threads)
        for name, file in files.items():
            method = Runtime.get().load_program(file).load_method("forward")
            runners[name] = (lambda m: lambda: m.execute([x])[0])(method)
        ms = dict(zip(runners, median_ms(list(runners.values()), args.repeats, "cpu", warm=True)))
        cold_ms = dict(zip(runners, median_ms(list(runners.values()), args.repeats, "cpu")))
        base, cold_base = ms["float .pte"], cold_ms["float .pte"]
        for name, file in files.items():
            (logits,) = run_pte(file, (x,))
            fq = ""
            if name in checks:
                worst = min(c.outputs[0].sqnr_db for c in checks[name])
                ok = all(c.ok for c in checks[name])
                fq = f"{worst:.1f}{'' if ok else ' (fails)'}"
            rows.append([name, f"{os.path.getsize(file) / 2**20:.2f}", f"{ms[name] / SEQ:.4f}", f"{base / ms[name]:.2f}x",
                         f"{cold_ms[name] / SEQ:.4f}", f"{cold_base / cold_ms[name]:.2f}x",
                         *delegation[name], f"{sqnr_db(reference, logits):.1f}", fq])
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU(s); torch {torch.__version__}, "
          f"torchao {torchao.__version__}, executorch {importlib.metadata.version('executorch')}; "
          f"{args.threads} XNNPACK thread(s); median of {args.repeats}; batch 1, sequence {SEQ}")
    print(tabulate(rows, headers=["variant", "MiB", "ms/token", "speed-up", "ms/token after another", "speed-up after another",
                                  "linears in XNNPACK", "XNNPACK subgraphs",
                                  "ops outside", "SQNR vs float dB",
                                  f"SQNR vs fake-quant dB (min of {len(CHECK_SHAPES)} shapes)"]))


if __name__ == "__main__":
    main()
