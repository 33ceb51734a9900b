"""Calibrated, converted test models for the export and report tests."""

from __future__ import annotations

import copy
import functools
import itertools
import math
import subprocess
import sys
import textwrap

import torch
import torch.nn as nn
import torchao.quantization.pt2e as tao
from tests.models.simple_quantizer import ConvBnReluLinear, ConvLinear, LinearConvQuantizer
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e, prepare_qat_pt2e

import pt2e_fq as q
from pt2e_fq import reference
from pt2e_fq.cli import pipeline

QAT_SHAPE = (8, 3, 8, 8)


def batch(seed, shape=(2, 3, 6, 6)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def ptq(activation, weight, output=None, model=None, shape=(2, 3, 6, 6), dynamic_shapes=None, convert=True):
    """`model` (default ConvLinear) exported, prepared with LinearConvQuantizer,
    calibrated on 4 batches and converted."""
    torch.manual_seed(0)
    model = (model or ConvLinear()).eval()
    gm = torch.export.export(model, (batch(0, shape),), dynamic_shapes=dynamic_shapes).module()
    gm = prepare_pt2e(gm, LinearConvQuantizer(activation, weight, output))
    for s in range(1, 5):
        gm(batch(s, shape))
    return convert_pt2e(gm) if convert else gm


def min_max_reference(spec: q.QSpec, x: torch.Tensor) -> torch.Tensor:
    """x fake-quantized by an integer `spec` with the qparams of x's own
    per-block range (what a dynamic point computes), from the definitions:
    each block's min and max by a loop over the blocks, the qparams of that
    range (tests/fake_quantize/test_observers.py checks them against hand
    values), then reference.fake_quantize_affine. For finite x."""
    bs = spec.granularity.block_size(x.shape)
    red = [math.ceil(s / b) if b else 1 for s, b in zip(x.shape, bs)]  # a block of 0 spans an empty dimension
    lo, hi = torch.empty(red), torch.empty(red)
    for idx in itertools.product(*map(range, red)):
        block = x[tuple(slice(i * b, (i + 1) * b) for i, b in zip(idx, bs))]
        # An empty block has the empty range (lo > hi), whose qparams are [0, 0]'s.
        lo[idx], hi[idx] = (block.min(), block.max()) if block.numel() else (math.inf, -math.inf)
    p = spec.kind.qparams_from_range(spec, lo, hi, x.dtype)
    qmin, qmax = spec.quant_range
    return reference.fake_quantize_affine(x, bs, p["scale"], p.get("zero_point"), qmin, qmax, p.get("minval"))[0]


QAT_SPECS = (
    q.QSpec(q.INT8, scheme="asymmetric", observer=q.MovingAverageMinMaxObserver(0.1)),
    q.QSpec(q.INT8, q.PerChannel(0), "symmetric_narrow", observer=q.CurrentMinMaxObserver()),
)


class ConvBnNoBias(nn.Module):
    """conv (no bias) -> bn -> relu -> linear."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


@functools.lru_cache(maxsize=None)
def _qat_prepared(conv_bias: bool) -> torch.fx.GraphModule:
    torch.manual_seed(0)
    model = (ConvBnReluLinear() if conv_bias else ConvBnNoBias()).train()
    x = batch(0, QAT_SHAPE)
    gm = prepare_qat_pt2e(torch.export.export(model, (x,)).module(), LinearConvQuantizer(*QAT_SPECS))
    opt = torch.optim.SGD(gm.parameters(), lr=0.05)
    for s in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(gm(batch(s, QAT_SHAPE)), torch.arange(8) % 4).backward()
        opt.step()
    gm.apply(tao.disable_observer)
    tao.move_exported_model_to_eval(gm)
    return gm


def qat_prepared(conv_bias: bool = True) -> torch.fx.GraphModule:
    """A conv-bn-relu-linear model after prepare_qat_pt2e and 3 SGD steps,
    observers off, in eval mode (a fresh copy on every call)."""
    return copy.deepcopy(_qat_prepared(conv_bias))


@functools.lru_cache(maxsize=None)
def _qat_converted() -> torch.fx.GraphModule:
    # pipeline.convert: convert_pt2e's graph without torchao's conv-bn fold
    # search (~30 s here, 96 q/dq patterns, none of which can match our
    # fake-quant nodes; tests/cli/test_pipeline.py checks the graphs agree).
    converted = pipeline.convert(qat_prepared())
    tao.move_exported_model_to_eval(converted)
    return converted


def qat_converted() -> torch.fx.GraphModule:
    """qat_prepared() converted, in eval mode (a fresh copy)."""
    return copy.deepcopy(_qat_converted())


def run_in_fresh_process(paths: dict, inputs: dict) -> dict:
    """Loads each .pt2 file (name -> path) in a fresh Python that imports only
    torch and pt2e_fq, runs it on its input (name -> tensor) and returns the
    outputs by name."""
    for name, path in paths.items():
        torch.save(inputs[name], f"{path}.in")
    script = textwrap.dedent(f"""
        import torch, pt2e_fq
        for path in {[str(p) for p in paths.values()]!r}:
            torch.save(pt2e_fq.load(path).module()(torch.load(path + ".in")), path + ".out")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {name: torch.load(f"{path}.out") for name, path in paths.items()}


def fake_quant_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_module" and "activation_post_process" in n.target]


class FloatFormatModel(nn.Module):
    """conv -> flatten -> linear with the float-format fake-quant ops called
    directly, on hand-picked edge cases (float_format_input): static FP8 scales
    ("fp8": activations per tensor, weights per output channel), or MX blocks
    of 32 along the reduction axes ("mx"): the conv's 40 channels and the
    linear's 48 in-features (ragged last blocks). The linear's input is a
    relu's output: the case of ORT's ReluQuantRewrite bug."""

    def __init__(self, kind: str, dtype: torch.dtype = torch.float8_e4m3fn):
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.dtype = kind, dtype
        self.conv = nn.Conv2d(40, 3, 1)
        self.fc = nn.Linear(48, 5)
        fmax = reference.FLOAT_FORMATS[dtype][0]
        self.register_buffer("x_scale", torch.tensor([[[[3.0 / fmax]]]]))
        self.register_buffer("conv_scale", self.conv.weight.detach().abs().amax((1, 2, 3), keepdim=True) / fmax)
        self.register_buffer("fc_scale", self.fc.weight.detach().abs().amax(1, keepdim=True) / fmax)

    def _fq(self, t, scale, block_size):
        if self.kind == "fp8":
            return q.ops.fake_quantize_float(t, block_size, scale, self.dtype)
        return q.ops.fake_quantize_mx(t, self.dtype, 32, 1)  # axis 1: conv channels, linear in-features

    def forward(self, x):  # x: (n, 40, 2, 2)
        x = self._fq(x, self.x_scale, list(x.shape))
        y = nn.functional.conv2d(x, self._fq(self.conv.weight, self.conv_scale, [1, 40, 1, 1]), self.conv.bias)
        y = self._fq(torch.relu(y.flatten(1).repeat(1, 4)), self.x_scale.reshape(1, 1), [y.shape[0], 48])  # (n, 48)
        return nn.functional.linear(y, self._fq(self.fc.weight, self.fc_scale, [1, 48]), self.fc.bias)


def float_format_input(seed: int, n: int = 3) -> torch.Tensor:
    """(n, 40, 2, 2) with the MX edge cases: an all-zero block, exact powers
    of two as block maxima, tiny and huge magnitudes."""
    x = batch(seed, (n, 40, 2, 2))
    x[0, :32] = 0.0
    x[1, :32] = torch.exp2(torch.randint(-20, 20, (32, 2, 2), generator=torch.Generator().manual_seed(seed)).float())
    x[2, 32:] *= 1e-30
    x[-1, :8] *= 1e4
    return x
