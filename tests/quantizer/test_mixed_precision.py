"""Average weight bits, per-point sensitivity and budgeted mixed precision
(quantizers.mixed_precision): bits against values computed by hand for
each format, a point's noise against the model run with that weight
fake-quantized by hand, the budgeted choice against an exhaustive search,
and the chosen config through a YAML file."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

import pt2e_fq as q
from quantizers import FakeQuantQuantizer, QuantizerConfig, presets
from quantizers import mixed_precision as mp

W = (64, 128)  # a linear weight (out, in): 8192 elements


def _weight(preset: str) -> q.QSpec:
    return presets.get_preset(preset).global_config.weight


@pytest.mark.parametrize("spec, shape, bits", [
    (_weight("w4a8"), W, 4 * 8192 + 16 * 64 * 4),  # int4, groups of 32: 4.5 per weight
    (_weight("nvfp4"), W, 4 * 8192 + 8 * 64 * 8 + 32),  # E2M1, an E4M3 per 16, one fp32 global: 4.5 + 32 / 8192
    (_weight("mxfp4"), W, 4 * 8192 + 8 * 64 * 4),  # E2M1, an E8M0 per 32: 4.25
    (_weight("w8a8"), W, 8 * 8192 + 16 * 64),  # int8 per channel: 8 + 16 / 128
    (_weight("w4a16"), W, 4 * 8192 + 16 * 256 + 16 * 256),  # int4 groups of 32, MINVAL: a float offset each: 5.0
    (q.QSpec(q.INT4, q.PerGroup(32, 1), "asymmetric"), W, 4 * 8192 + 16 * 256 + 4 * 256),  # int4 zero points: 4.625
    (_weight("w4a8"), (2, 40), 4 * 80 + 16 * 2 * 2),  # a ragged last group still has a scale
    (_weight("fp8"), W, 8 * 8192 + 16 * 64),  # fp8 per channel
    (None, W, 32 * 8192),  # float
], ids=["w4a8", "nvfp4", "mxfp4", "w8a8", "w4a16_minval", "int4_zero_point", "ragged", "fp8", "float"])
def test_weight_bits_are_code_scale_and_zero_point_bits(spec, shape, bits):
    assert mp.weight_bits(spec, shape) == bits


def test_the_issue_figures_per_weight():
    assert mp.weight_bits(_weight("w4a8"), W) / 8192 == 4.5
    assert mp.weight_bits(_weight("mxfp4"), W) / 8192 == 4.25
    assert mp.weight_bits(_weight("nvfp4"), W) / 8192 == pytest.approx(4.5, abs=1e-2)
    assert mp.weight_bits(None, W) / 8192 == 32


class _Net(nn.Module):
    """An embedding and an added parameter (not counted), a depthwise conv (int4 groups span its
    3x3 kernel: 9 weights per scale), a conv and two linears."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.position = nn.Parameter(torch.randn(6, 6))  # 2-D, added (as BERT's position embeddings): not counted
        self.dw = nn.Conv2d(8, 8, 3, groups=8, padding=1)
        self.pw = nn.Conv2d(8, 32, 1)
        self.fc = nn.Linear(32, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x, ids):
        x = x + self.embed(ids).mean(1)[:, :, None, None] + self.position
        x = torch.relu(self.pw(torch.relu(self.dw(x))))
        return self.head(torch.relu(self.fc(x.mean((2, 3)))))


def _inputs(seed: int, n: int = 4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, 6, 6, generator=g), torch.randint(0, 10, (n, 3), generator=g)


def _prepare(model, config):
    gm = torch.export.export(model, _inputs(0)).module()
    return prepare_pt2e(gm, FakeQuantQuantizer(config))


def test_average_weight_bits_of_a_prepared_model_by_hand():
    torch.manual_seed(0)
    model = _Net().eval()
    config = presets.get_preset("w4a8").set_module_name("fc", None)
    got = mp.average_weight_bits(_prepare(model, config))
    dw = 4 * 72 + 16 * 8  # (8, 1, 3, 3): one scale per 9 weights
    pw = 4 * 256 + 16 * 32  # (32, 8, 1, 1): a group is the 8 input channels, one scale per output channel
    fc = 32 * 2048  # float
    head = 4 * 640 + 16 * 10 * 2  # (10, 64): two groups of 32 per row
    assert got == (dw + pw + fc + head) / (72 + 256 + 2048 + 640)


# -- sensitivity ----------------------------------------------------------------


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


@pytest.fixture(scope="module")
def measured():
    torch.manual_seed(0)
    model = _MLP().eval()
    g = torch.Generator().manual_seed(1)
    calibration = [torch.randn(16, 32, generator=g) for _ in range(2)]
    evaluation = [torch.randn(16, 32, generator=g) for _ in range(2)]
    gm = torch.export.export(model, (calibration[0],)).module()
    s = mp.sensitivity(gm, calibration, evaluation, ("w4a8", "w8a8"), progress=False)
    return model, calibration, evaluation, s


def test_a_weight_points_noise_is_the_model_with_that_weight_fake_quantized_by_hand(measured):
    model, _, evaluation, s = measured
    row = next(p for p in s.points if p["candidate"] == "w8a8" and p["module"] == "fc2" and "weight" in p["role"])
    w = model.fc2.weight.detach()
    scale = w.abs().amax(1, keepdim=True) / 127  # int8 symmetric narrow per output channel
    w_q = torch.round(w / scale).clamp(-127, 127) * scale
    original = model.fc2.weight.data.clone()
    with torch.no_grad():
        reference = torch.cat([model(x) for x in evaluation]).double()
        model.fc2.weight.data = w_q
        quantized = torch.cat([model(x) for x in evaluation]).double()
        model.fc2.weight.data = original
    expected = ((reference - quantized) ** 2).sum() / (reference ** 2).sum()
    assert row["noise"] == pytest.approx(float(expected), rel=1e-4)
    assert row["noise"] > 0


def test_int4_weights_cost_more_than_int8_and_float_nothing(measured):
    s = measured[3]
    assert set(s.layers) == {"fc1", "fc2", "fc3"}
    for layer in s.layers.values():
        assert layer.noise["w4a8"] > layer.noise["w8a8"] > 0 == layer.noise["float"]
        assert layer.bits["w4a8"] < layer.bits["w8a8"] < layer.bits["float"]
    text = s.table()
    assert "fc2" in text and "w4a8 dB" in text and "w8a8 dB" in text


def _budgets_config_bits(model, calibration, config) -> float:
    gm = torch.export.export(model, (calibration[0],)).module()
    return mp.average_weight_bits(prepare_pt2e(gm, FakeQuantQuantizer(config)))


@pytest.mark.parametrize("budget", [4.5, 5.0, 6.0, 8.2, 40.0])
def test_the_chosen_config_keeps_to_the_budget_and_round_trips_through_yaml(measured, budget, tmp_path):
    model, calibration, evaluation, s = measured
    chosen = mp.mixed_precision(s, budget)
    path = tmp_path / "mixed.yaml"
    chosen.config.save(path)
    loaded = QuantizerConfig.load(path)
    assert loaded == chosen.config
    bits = _budgets_config_bits(model, calibration, loaded)
    assert bits == pytest.approx(chosen.average_bits, rel=1e-12)
    assert bits <= budget
    if budget >= 32:
        assert set(chosen.choices.values()) == {"float"}
    x = calibration[0]
    a = _prepare_mlp(model, x, chosen.config)
    b = _prepare_mlp(model, x, loaded)
    assert torch.equal(a(x), b(x))


def _prepare_mlp(model, x, config):
    prepared = prepare_pt2e(torch.export.export(model, (x,)).module(), FakeQuantQuantizer(config))
    with torch.no_grad():
        prepared(x)
    return prepared


def test_a_budget_below_the_smallest_formats_is_an_error(measured):
    with pytest.raises(ValueError, match=r"budget_bits 4.0 is below 4\.5"):
        mp.mixed_precision(measured[3], 4.0, allow_float=False)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), budget=st.floats(4.0, 33.0))
def test_the_choice_is_the_exhaustive_searchs_best(seed, budget):
    g = torch.Generator().manual_seed(seed)
    layers = {}
    for i in range(4):
        n = int(torch.randint(1, 5000, (), generator=g))
        layer = mp.Layer(f"l{i}", "linear", [(f"l{i}", "torch.nn.modules.linear.Linear")], n)
        noise = torch.rand(2, generator=g).sort(descending=True).values.tolist()
        layer.bits = {"w4a8": 4.5 * n, "w8a8": (8 + 0.125) * n, "float": 32.0 * n}
        layer.noise = {"w4a8": noise[0], "w8a8": noise[1] * 0.1, "float": 0.0}
        layers[layer.name] = layer
    s = mp.Sensitivity(("w4a8", "w8a8"), [], layers, 1)
    total = sum(layer.elements for layer in layers.values())
    options = ("w4a8", "w8a8", "float")
    feasible = [c for c in itertools.product(options, repeat=4)
                if sum(layers[f"l{i}"].bits[o] for i, o in enumerate(c)) <= budget * total]
    if not feasible:
        with pytest.raises(ValueError):
            mp.mixed_precision(s, budget)
        return
    best = min(sum(layers[f"l{i}"].noise[o] for i, o in enumerate(c)) for c in feasible)
    chosen = mp.mixed_precision(s, budget)
    assert chosen.average_bits <= budget
    noise = sum(layers[n].noise[c] for n, c in chosen.choices.items())
    # The knapsack rounds bits up to 1/2**17 of the budget: a choice within that of the budget may be missed.
    slack = [c for c in feasible if sum(layers[f"l{i}"].bits[o] for i, o in enumerate(c))
             <= budget * total * (1 - 4 / 2**17)]
    if slack:
        assert noise <= min(sum(layers[f"l{i}"].noise[o] for i, o in enumerate(c)) for c in slack) + 1e-12
    assert noise >= best - 1e-12
    assert math.isclose(chosen.predicted_sqnr_db, -10 * math.log10(noise)) if noise > 0 else True


def test_average_weight_bits_of_a_weight_read_through_a_view():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.W = nn.Parameter(torch.randn(32, 64))  # (out, in)

        def forward(self, x):
            return x @ self.W.t()

    x = torch.randn(4, 64)
    prepared = prepare_pt2e(torch.export.export(M().eval(), (x,)).module(),
                            FakeQuantQuantizer(presets.get_preset("w8a8")))
    # int8 codes plus one fp16 scale per output channel (32 of them) over 2048 weights.
    assert mp.average_weight_bits(prepared) == 8 + 16 * 32 / 2048


class _RootWeights(nn.Module):
    """Weights read in the model's own forward (module path ""): a linear's and, with `matmul`, a matmul's."""

    def __init__(self, matmul: bool = False):
        super().__init__()
        self.matmul = matmul
        self.root_w = nn.Parameter(torch.randn(256, 64) / 8)
        self.root_m = nn.Parameter(torch.randn(256, 256) / 16)
        self.fc = nn.Linear(256, 10)

    def forward(self, x):
        h = torch.relu(nn.functional.linear(x, self.root_w))
        if self.matmul:
            h = h @ self.root_m
        return self.fc(h)


@pytest.mark.parametrize("matmul", [False, True], ids=["linear", "linear_and_matmul"])
@pytest.mark.parametrize("budget", [5.0, 8.5, 32.0])
def test_weights_read_by_the_model_itself_count_in_the_budget(budget, matmul):
    torch.manual_seed(0)
    model = _RootWeights(matmul).eval()
    data = [torch.randn(16, 64) for _ in range(4)]
    measured = mp.sensitivity(torch.export.export(model, (data[0],)).module(), data[:2], data[2:],
                              ("w4a8", "w8a8"), progress=False)
    chosen = mp.mixed_precision(measured, budget_bits=budget)
    prepared = prepare_pt2e(torch.export.export(model, (data[0],)).module(), FakeQuantQuantizer(chosen.config))
    actual = mp.average_weight_bits(prepared)
    assert actual <= budget
    assert chosen.average_bits == pytest.approx(actual, rel=1e-12)
    _assert_the_weights_formats_are_the_choices(
        prepared, chosen, {"root_w": "", "fc.weight": "fc", **({"root_m": ""} if matmul else {})})


def _attr(module, path: str):
    for name in path.split("."):
        module = getattr(module, name)
    return module


def _weight_points(prepared) -> dict:
    """{weight name: the FakeQuantize its value reaches through views, or None (float)} of the weights the
    graph reads, read off the graph."""
    views = {torch.ops.aten.t.default, torch.ops.aten.permute.default, torch.ops.aten.transpose.int}
    found = {}
    for node in prepared.graph.nodes:
        if node.op != "get_attr" or not node.users or _attr(prepared, node.target).dim() < 2:  # biases are 1-D
            continue
        found[node.target], frontier = None, [node]
        while frontier:
            n = frontier.pop()
            for user in n.users:
                if user.op == "call_module" and isinstance(prepared.get_submodule(user.target), q.FakeQuantize):
                    found[node.target] = prepared.get_submodule(user.target)
                elif user.op == "call_function" and user.target in views:
                    frontier.append(user)
    return found


class _Gram(nn.Module):
    """A matmul of two activations (attention's q @ k^T, then the weights times v)."""

    def forward(self, h):
        return torch.softmax(h @ h.t() / 16, -1) @ h


class _RootMatmul(nn.Module):
    """A weight the model itself reads (`read`: torch.matmul(x, W), x @ W.t() or F.linear(x, W)), a child
    that multiplies activations and a child linear."""

    def __init__(self, read: str):
        super().__init__()
        self.read = read
        self.weight = nn.Parameter(torch.randn((64, 256) if read == "matmul" else (256, 64)) / 8)
        self.attn, self.fc = _Gram(), nn.Linear(256, 10)

    def forward(self, x):
        if self.read == "matmul":
            h = torch.matmul(x, self.weight)
        elif self.read == "matmul_t":
            h = x @ self.weight.t()
        else:
            h = nn.functional.linear(x, self.weight)
        return self.fc(self.attn(torch.relu(h)))


def _activation_matmul_points(prepared) -> list:
    """(dtype, quant_min, quant_max) of the points read by the matmuls inside `attn`, in graph order."""
    found = []
    for node in prepared.graph.nodes:
        paths = [path for path, _ in node.meta.get("nn_module_stack", {}).values()]
        if node.op == "call_function" and node.target == torch.ops.aten.matmul.default and paths[-1:] == ["attn"]:
            for arg in node.args:
                if arg.op == "call_module" and isinstance(prepared.get_submodule(arg.target), q.FakeQuantize):
                    m = prepared.get_submodule(arg.target)
                    found.append((m.dtype, m.quant_min, m.quant_max))
                else:
                    found.append(None)
    return found


@pytest.mark.parametrize("read", ["matmul", "matmul_t", "linear"])
@pytest.mark.parametrize("candidates", [("w8a8", "w4a8"), ("w4a8", "w8a8")], ids=["w8a8_first", "w4a8_first"])
@pytest.mark.parametrize("budget, allow_float", [(4.6, False), (40.0, True)], ids=["int4", "float"])
def test_a_weight_the_model_itself_reads_gets_the_chosen_format(read, candidates, budget, allow_float, tmp_path):
    """At 4.6 bits without float only int4 everywhere fits; at 40 bits float everywhere is the least noise
    (so the model's own weight gets the second candidate's format, or float). The prepared model has each
    weight's point as chosen, the chosen bits, and its activation matmuls as in the first candidate's
    preset (as sensitivity measured them)."""
    torch.manual_seed(0)
    model = _RootMatmul(read).eval()
    data = [torch.randn(16, 64) for _ in range(4)]
    export = lambda: torch.export.export(model, (data[0],)).module()  # noqa: E731
    measured = mp.sensitivity(export(), data[:2], data[2:], candidates, progress=False)
    assert set(measured.layers) == {"", "fc"}
    chosen = mp.mixed_precision(measured, budget_bits=budget, allow_float=allow_float)
    assert set(chosen.choices.values()) == {"w4a8" if budget < 8 else "float"}
    for suffix in ("yaml", "json"):
        path = tmp_path / f"mixed.{suffix}"
        chosen.config.save(path)
        loaded = QuantizerConfig.load(path)
        assert loaded == chosen.config
        prepared = prepare_pt2e(export(), FakeQuantQuantizer(loaded))
        _assert_the_weights_formats_are_the_choices(prepared, chosen, {"weight": "", "fc.weight": "fc"})
        assert mp.average_weight_bits(prepared) == pytest.approx(chosen.average_bits, rel=1e-12)
        preset = prepare_pt2e(export(), FakeQuantQuantizer(presets.get_preset(candidates[0])))
        assert _activation_matmul_points(prepared) == _activation_matmul_points(preset) != [None] * 4


def test_a_weighted_op_without_a_module_stack_keeps_the_first_candidate_and_says_so():
    """A graph whose own matmul carries no nn_module_stack (not from torch.export): no config entry can
    reach that op by module, so the choice for it is the first candidate's, with a warning naming it."""
    torch.manual_seed(0)
    model = _RootMatmul("matmul").eval()
    data = [torch.randn(16, 64) for _ in range(4)]

    def export():
        gm = torch.export.export(model, (data[0],)).module()
        for node in gm.graph.nodes:
            if node.target == torch.ops.aten.matmul.default and node.args[1].op == "get_attr":
                del node.meta["nn_module_stack"]
        return gm

    measured = mp.sensitivity(export(), data[:2], data[2:], ("w8a8", "w4a8"), progress=False)
    with pytest.warns(UserWarning, match=r"the matmul ops of 'the model itself' have no module stack"):
        chosen = mp.mixed_precision(measured, budget_bits=40.0)
    assert chosen.choices == {"": "w8a8", "fc": "float"}
    prepared = prepare_pt2e(export(), FakeQuantQuantizer(chosen.config))
    _assert_the_weights_formats_are_the_choices(prepared, chosen, {"weight": "", "fc.weight": "fc"})
    assert mp.average_weight_bits(prepared) == pytest.approx(chosen.average_bits, rel=1e-12)


# What each candidate's weight point is, by hand: int4 in the full signed range, int8 in the narrow one.
_WEIGHT_POINT = {"w4a8": (torch.int4, -8, 7), "w8a8": (torch.int8, -127, 127)}


def _assert_the_weights_formats_are_the_choices(prepared, chosen, layer_of: dict):
    """Each weight's point is that of the candidate chosen for its layer (`layer_of`: weight -> layer), and
    a weight of a layer chosen float has none."""
    points = _weight_points(prepared)
    assert set(points) == set(layer_of)
    for weight, layer in layer_of.items():
        point, choice = points[weight], chosen.choices[layer]
        got = None if point is None else (point.dtype, point.quant_min, point.quant_max)
        assert got == _WEIGHT_POINT.get(choice), (weight, choice)


class _ResidualBlock(nn.Module):
    """A block whose own forward reads a weight and adds the residual."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 32) / 6)

    def forward(self, x):
        return x + torch.relu(nn.functional.linear(x, self.w))


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.b1, self.fc = nn.Linear(16, 32), _ResidualBlock(), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc(self.b1(self.inp(x)))


def _points_by_op(prepared) -> dict:
    """{op target name: number of fake-quant points reading or read by it}."""
    counts: dict = {}
    for node in prepared.graph.nodes:
        if node.op == "call_module" and isinstance(prepared.get_submodule(node.target), q.FakeQuantize):
            for neighbour in [*node.users, *(a for a in node.args if isinstance(a, torch.fx.Node))]:
                if neighbour.op == "call_function":
                    name = neighbour.target.__name__
                    counts[name] = counts.get(name, 0) + 1
    return counts


@pytest.mark.parametrize("candidate", ["w8a8", "w4a8"])
def test_the_chosen_config_keeps_the_presets_policy_for_a_layers_other_ops(candidate):
    """Every layer chosen as one preset: the prepared model has the points
    of that preset itself, the block's residual add left float as the
    preset leaves it (and as sensitivity measured it)."""
    torch.manual_seed(0)
    model = _Residual().eval()
    data = [torch.randn(8, 16) for _ in range(4)]
    export = lambda: torch.export.export(model, (data[0],)).module()  # noqa: E731
    measured = mp.sensitivity(export(), data[:2], data[2:], (candidate,), progress=False)
    chosen = mp.mixed_precision(measured, budget_bits=20.0, allow_float=False)
    assert set(chosen.choices.values()) == {candidate} and set(chosen.choices) == {"inp", "b1", "fc"}
    mixed = prepare_pt2e(export(), FakeQuantQuantizer(chosen.config))
    preset = prepare_pt2e(export(), FakeQuantQuantizer(presets.get_preset(candidate)))
    assert _points_by_op(mixed) == _points_by_op(preset)
    x = data[0]
    with torch.no_grad():
        mixed(x), preset(x)
        assert torch.equal(mixed(x), preset(x))
