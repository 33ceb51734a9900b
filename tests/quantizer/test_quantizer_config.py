"""QuantizerConfig: precedence, dict / YAML / JSON round trips, error messages."""

from __future__ import annotations

import re

import pytest
import torch.nn as nn

import pt2e_fq as q
from quantizers import ConfigError, OpConfig, QuantizerConfig, presets

A8 = q.QSpec(q.INT8, q.PerTensor(), "asymmetric")
W8 = q.QSpec(q.INT8, q.PerChannel(0), "symmetric_narrow", observer=q.CurrentMinMaxObserver())
W4 = q.QSpec(q.INT4, q.PerGroup(32, 1), "asymmetric", "minval", observer=q.MSEObserver(8, 0.5))
GLOBAL, BY_OP, BY_TYPE, BY_NAME, BY_REGEX = (
    OpConfig(A8, W8, None, A8), OpConfig(weight=W4), OpConfig(A8), OpConfig(output_activation=A8), OpConfig(weight=W8)
)


def _config():
    return (
        QuantizerConfig(GLOBAL)
        .set_operator_type("conv2d", BY_OP)
        .set_module_type(nn.Linear, BY_TYPE)
        .set_module_name("blocks.0.fc", BY_NAME)
        .set_module_name(re.compile(r"blocks\.\d+\.proj"), BY_REGEX)
        .set_module_name("head", None)
    )


LINEAR = "torch.nn.modules.linear.Linear"


@pytest.mark.parametrize(
    "op_type, stack, expected, rule",
    [
        ("add", [("", "m.Net")], GLOBAL, "global"),
        ("conv2d", [("", "m.Net"), ("stem", "torch.nn.modules.conv.Conv2d")], BY_OP, "op type 'conv2d'"),
        ("linear", [("", "m.Net"), ("fc", LINEAR)], BY_TYPE, "module type Linear"),
        # a module name beats the module type, an exact name beats a regex
        ("linear", [("blocks.0", "m.Block"), ("blocks.0.fc", LINEAR)], BY_NAME, "module name 'blocks.0.fc'"),
        ("linear", [("blocks.1", "m.Block"), ("blocks.1.proj", LINEAR)], BY_REGEX,
         "module name regex 'blocks\\\\.\\\\d+\\\\.proj'"),
        # the regex must match the whole name
        ("linear", [("blocks.1", "m.Block"), ("blocks.1.proj2", LINEAR)], BY_TYPE, "module type Linear"),
        # a name covers what is inside it; None leaves the op in float
        ("matmul", [("head", "m.Head"), ("head.inner", "m.Inner")], None, "module name 'head'"),
    ],
)
def test_resolution_precedence(op_type, stack, expected, rule):
    resolution = _config().resolve(op_type, stack)
    assert resolution.config == expected
    assert resolution.rule == rule


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_every_preset_and_a_custom_config_round_trip_through_files(tmp_path, suffix):
    for name, config in [*presets.PRESETS.items(), ("custom", _config())]:
        path = tmp_path / f"{name}{suffix}"
        config.save(path)
        loaded = QuantizerConfig.load(path)
        # compared field by field with the objects the config was built from
        assert loaded.global_config == config.global_config
        assert loaded.operator_type == config.operator_type
        assert loaded.module_type == config.module_type
        assert loaded.module_name == config.module_name
        assert loaded.module_name_regex == config.module_name_regex
        assert QuantizerConfig.from_dict(loaded.to_dict()).to_dict() == loaded.to_dict()


def test_a_hand_written_yaml_file_reads_as_the_fluent_config(tmp_path):
    path = tmp_path / "config.yml"
    path.write_text(
        """
global:
  input_activation: {format: int8, scheme: asymmetric}
  weight:
    format: INT8
    granularity: {type: per_channel, axis: 0}
    scheme: symmetric_narrow
    observer: current_min_max
  output_activation: {format: int8, granularity: per_tensor, scheme: asymmetric}
operator_type:
  conv2d:
    weight: {format: int4, granularity: {type: per_group, group_size: 32, axis: 1}, scheme: asymmetric,
             formulation: minval, observer: {type: mse, num_candidates: 8, min_fraction: 0.5}}
module_type:
  torch.nn.Linear: {input_activation: {format: int8, scheme: asymmetric}}
module_name:
  blocks.0.fc: {output_activation: {format: int8, scheme: asymmetric}}
  head: null
module_name_regex:
  'blocks\\.\\d+\\.proj': {weight: {format: int8, granularity: {type: per_channel, axis: 0},
                                     scheme: symmetric_narrow, observer: current_min_max}}
"""
    )
    loaded, expected = QuantizerConfig.load(path), _config()
    assert loaded.global_config == expected.global_config
    assert loaded.operator_type == expected.operator_type
    assert loaded.module_type == expected.module_type
    assert loaded.module_name == expected.module_name
    assert loaded.module_name_regex == expected.module_name_regex


def test_get_preset_returns_an_independent_copy():
    config = presets.get_preset("w8a8").set_module_name("head", None)
    assert "head" in config.module_name
    assert "head" not in presets.PRESETS["w8a8"].module_name
    with pytest.raises(ValueError, match="unknown preset 'w9a9'; allowed: w8a8, w4a8, w4a16, w8a16, fp8, mxfp8"):
        presets.get_preset("w9a9")


_QSPEC = {"format": "int8"}


@pytest.mark.parametrize(
    "d, message",
    [
        ({"globals": None}, "QuantizerConfig: unknown key 'globals'; allowed: global, operator_type, module_type, "
                            "module_name, module_name_regex"),
        ({"global": {"weights": _QSPEC}}, "global: unknown key 'weights'; allowed: input_activation, weight, bias, "
                                          "output_activation"),
        ({"global": {"weight": {"format": "int3x"}}}, "global.weight.format: unknown format 'int3x'; allowed: int2 .. "
                                                      "int16, uint2 .. uint15, fp8_e4m3, fp8_e5m2, fp4_e2m1"),
        ({"global": {"weight": {"format": "int17"}}}, "global.weight.format: IntFormat: bits must be 2..16"),
        ({"global": {"weight": {"scheme": "sym"}}}, "global.weight: missing key 'format'"),
        ({"global": {"weight": {"format": "int8", "scheme": "sym"}}},
         "global.weight: QSpec: scheme must be one of SYMMETRIC, SYMMETRIC_NARROW, SYMMETRIC_NO_CLIP, ASYMMETRIC"),
        ({"global": {"weight": {"format": "int8", "granularity": "per_row"}}},
         "global.weight.granularity: unknown granularity 'per_row'; allowed: per_tensor, per_channel, per_group, "
         "per_block, per_token"),
        ({"global": {"weight": {"format": "int8", "granularity": {"type": "per_group", "size": 32}}}},
         "global.weight.granularity (per_group): unknown key 'size'; allowed: group_size, axis"),
        ({"global": {"weight": {"format": "int8", "observer": {"type": "mse", "candidates": 3}}}},
         "global.weight.observer (mse): unknown key 'candidates'; allowed: num_candidates, min_fraction"),
        ({"global": {"weight": {"format": "int8", "observer": "percentile"}}},
         "global.weight.observer: unknown observer 'percentile'; allowed: min_max, moving_average_min_max, mse, "
         "histogram, current_min_max"),
        ({"operator_type": {"softmax": None}}, "operator_type['softmax']: unknown op type 'softmax'; allowed: linear, "
                                               "conv1d, conv2d, conv3d, conv_transpose1d, conv_transpose2d, matmul"),
        ({"module_type": {"torch.nn.Linea": None}}, "module_type['torch.nn.Linea']: 'torch.nn.Linea' is not an "
                                                    "importable torch.nn.Module subclass"),
        ({"module_name_regex": {"fc(": None}}, "module_name_regex['fc(']: not a regular expression"),
        ({"module_type": {"..a.B": None}}, "module_type['..a.B']: '..a.B' is not a dotted class name; write the "
                                            "module and the class, e.g. torch.nn.Linear or mypackage.models.Block"),
        ({"module_type": {".B": None}}, "module_type['.B']: '.B' is not a dotted class name"),
        ({"module_type": {"torch.nn.": None}}, "module_type['torch.nn.']: 'torch.nn.' is not a dotted class name"),
        ({"module_type": {"Linear": None}}, "module_type['Linear']: 'Linear' is not an importable torch.nn.Module "
                                            "subclass"),
        ({"module_name": ["head"]}, "module_name: expected a mapping, got list"),
    ],
)
def test_unknown_keys_and_values_are_named_with_what_is_allowed(d, message):
    with pytest.raises(ConfigError) as err:
        QuantizerConfig.from_dict(d)
    assert message in str(err.value)


def test_setter_and_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="set_operator_type: unknown op type 'relu'; allowed: linear, conv1d"):
        QuantizerConfig().set_operator_type("relu", None)
    with pytest.raises(TypeError, match="set_module_type: module_type must be a torch.nn.Module subclass"):
        QuantizerConfig().set_module_type("Linear", None)
    with pytest.raises(TypeError, match="set_global: expected an OpConfig or None"):
        QuantizerConfig().set_global(A8)
    with pytest.raises(TypeError, match="OpConfig: weight must be a pt2e_fq.QSpec or None"):
        OpConfig(weight="int8")
    with pytest.raises(ConfigError, match="unknown suffix '.toml'; allowed: .yaml, .yml, .json"):
        QuantizerConfig().save(tmp_path / "c.toml")


@pytest.mark.parametrize("section", ["module_name", "module_name_regex", "operator_type", "module_type"])
def test_a_yaml_key_that_is_not_a_string_is_refused(tmp_path, section):
    # YAML reads `0:` as the int 0, a key that would never match the module
    # path "0" (nn.Sequential's first child): the layer would be quantized
    # against the config.
    path = tmp_path / "config.yaml"
    path.write_text(f"{section}:\n  0: null\n")
    with pytest.raises(ConfigError, match=rf"{section}\[0\]: keys of {section} are strings \(quote it in YAML: '0'\), got int"):
        QuantizerConfig.load(path)
    path.write_text(f"{section}:\n  '0': null\n")
    if section in ("module_name", "module_name_regex"):  # quoted, it is the module path "0"
        resolution = QuantizerConfig.load(path).resolve("linear", [("0", "torch.nn.Linear")])
        assert resolution.config is None and resolution.rule.endswith("'0'")


# ---------------------------------------------------------------------------
# A type that is not a name; static qparams on a dynamic dimension


@pytest.mark.parametrize("field, kind, allowed", [
    ("granularity", "granularity", "per_tensor, per_channel, per_group, per_block, per_token"),
    ("observer", "observer", "min_max, moving_average_min_max, mse, histogram, current_min_max"),
])
@pytest.mark.parametrize("value", [["per_tensor"], {"name": "x"}, 3])
def test_a_type_that_is_not_a_name_is_a_config_error(tmp_path, field, kind, allowed, value):
    d = {"global": {"input_activation": {"format": "int8", field: {"type": value}}}}
    with pytest.raises(ConfigError) as err:
        QuantizerConfig.from_dict(d)
    assert str(err.value) == (f"global.input_activation.{field}.type: a {kind} type is one name, got "
                              f"{type(value).__name__} {value!r}; allowed: {allowed}")


class _Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x)


@pytest.mark.parametrize("granularity, qparams", [(q.PerChannel(0), "(*, 1)"), (q.PerGroup(2, 0), "(*, 8)"),
                                                  (q.PerBlock((2, 8)), "(*, 1)")])
def test_static_qparams_on_the_dynamic_batch_axis_fail_validation(granularity, qparams):
    import torch
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    from quantizers import FakeQuantQuantizer, UnsupportedQuantizationError

    x = torch.randn(4, 8)
    gm = torch.export.export(_Linear(), (x,), dynamic_shapes=({0: torch.export.Dim("batch")},)).module()
    spec = q.QSpec(q.INT8, granularity)
    with pytest.raises(UnsupportedQuantizationError) as err:
        prepare_pt2e(gm, FakeQuantQuantizer(QuantizerConfig(OpConfig(input_activation=spec))))
    assert (f"input 'x' of node 'linear' (aten.linear.default) in module 'fc' (Linear): {spec} is static, but its "
            f"qparams (shape {qparams}) follow the dynamic dimension(s) [0] of the tensor (shape (*, 8)), so it "
            "would fail at another size") in str(err.value)


@pytest.mark.parametrize("spec", [q.QSpec(q.INT8, q.PerTensor()), q.QSpec(q.INT8, q.PerChannel(1)),
                                  q.QSpec(q.INT8, q.PerToken(), dynamic=True)])
def test_qparams_that_do_not_follow_the_dynamic_axis_run_at_every_batch_size(spec):
    import torch
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    from quantizers import FakeQuantQuantizer

    gm = torch.export.export(_Linear(), (torch.randn(4, 8),), dynamic_shapes=({0: torch.export.Dim("batch")},)).module()
    prepared = prepare_pt2e(gm, FakeQuantQuantizer(QuantizerConfig(OpConfig(input_activation=spec))))
    for batch in (4, 3, 9):
        assert prepared(torch.randn(batch, 8)).shape == (batch, 4)


@pytest.mark.parametrize("value, bad", [([["relu"]], "list ['relu']"), ([{"relu": 1}], "dict {'relu': 1}")])
def test_a_nested_value_in_fuse_activations_is_named_with_what_is_allowed(value, bad):
    d = dict(presets.get_preset("w8a8").to_dict(), fuse_activations=value)
    with pytest.raises(ConfigError, match=re.escape(f"fuse_activations: expected a list of activation names, got {bad}")
                       + ".*allowed: relu, relu6, hardtanh"):
        QuantizerConfig.from_dict(d)
    with pytest.raises(TypeError, match=re.escape("fuse_activations: expected a list of activation names")):
        QuantizerConfig(fuse_activations=value)


@pytest.mark.parametrize("d, message", [
    ({"type": "per_tensor", "axis": 0}, "global.weight.granularity (per_tensor): unknown key 'axis'; it takes no arguments"),
    ({"type": "per_token", "axis": 0}, "global.weight.granularity (per_token): unknown key 'axis'; it takes no arguments"),
])
def test_an_argument_to_a_type_without_arguments_says_so(d, message):
    with pytest.raises(ConfigError, match=re.escape(message) + "$"):
        QuantizerConfig.from_dict({"global": {"weight": {"format": "int8", "granularity": d}}})


@pytest.mark.parametrize("value", [[], 0, False, "", ["head"]])
@pytest.mark.parametrize("section", ["operator_type", "module_type", "module_name", "module_name_regex"])
def test_a_section_that_is_not_a_mapping_is_refused(section, value):
    with pytest.raises(ConfigError, match=re.escape(f"{section}: expected a mapping, got {type(value).__name__} {value!r}")):
        QuantizerConfig.from_dict(dict(presets.get_preset("w8a8").to_dict(), **{section: value}))


class Outer:
    class Block(nn.Module):
        pass


def test_a_module_type_nested_in_a_class_round_trips_through_a_file(tmp_path):
    config = presets.get_preset("w8a8").set_module_type(Outer.Block, None)
    config.save(tmp_path / "c.yaml")
    assert f"{__name__}.Outer.Block: null" in (tmp_path / "c.yaml").read_text()
    loaded = QuantizerConfig.load(tmp_path / "c.yaml")
    assert loaded == config and Outer.Block in loaded.module_type


def _with_module_op_types():
    return (_config()
            .set_module_name_operator_type("blocks.0", "add", BY_TYPE)
            .set_module_name_operator_type("head", "matmul", BY_OP))


@pytest.mark.parametrize(
    "op_type, stack, expected, rule",
    [
        # the op type in the named module
        ("add", [("", "m.Net"), ("blocks.0", "m.Block")], BY_TYPE, "module name 'blocks.0', op type 'add'"),
        # another op type there resolves as if the entry were not there
        ("matmul", [("", "m.Net"), ("blocks.0", "m.Block")], GLOBAL, "global"),
        ("conv2d", [("", "m.Net"), ("blocks.0", "m.Block")], BY_OP, "op type 'conv2d'"),
        # it covers the modules inside, and beats the module's own name entry
        ("matmul", [("head", "m.Head"), ("head.inner", "m.Inner")], BY_OP, "module name 'head', op type 'matmul'"),
        ("add", [("head", "m.Head")], None, "module name 'head'"),
        # an inner module's name entry still wins
        ("linear", [("blocks.0", "m.Block"), ("blocks.0.fc", LINEAR)], BY_NAME, "module name 'blocks.0.fc'"),
    ],
)
def test_a_module_name_and_op_type_entry_covers_only_that_op_type(op_type, stack, expected, rule):
    resolution = _with_module_op_types().resolve(op_type, stack)
    assert (resolution.config, resolution.rule) == (expected, rule)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_module_name_and_op_type_entries_round_trip_through_files(tmp_path, suffix):
    config = _with_module_op_types()
    path = tmp_path / f"c{suffix}"
    config.save(path)
    loaded = QuantizerConfig.load(path)
    assert loaded.module_name_operator_type == {"blocks.0": {"add": BY_TYPE}, "head": {"matmul": BY_OP}}
    assert loaded == config


@pytest.mark.parametrize(
    "op_type, stack, expected, rule",
    [
        # the model's own op (quantizers.mixed_precision writes its choice for a weight read there so)
        ("linear", [("", "m.Net")], BY_REGEX, "module name '', op type 'linear'"),
        # an op in a module no module entry names, module type entries included
        ("linear", [("", "m.Net"), ("fc", LINEAR)], BY_REGEX, "module name '', op type 'linear'"),
        # an entry naming an inner module wins
        ("linear", [("", "m.Net"), ("blocks.0", "m.Block"), ("blocks.0.fc", LINEAR)], BY_NAME,
         "module name 'blocks.0.fc'"),
    ],
)
@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_an_entry_for_the_model_itself_covers_every_op_no_inner_module_entry_takes(op_type, stack, expected, rule,
                                                                                    suffix, tmp_path):
    config = _config().set_module_name_operator_type("", "linear", BY_REGEX)
    config.save(tmp_path / f"c{suffix}")
    loaded = QuantizerConfig.load(tmp_path / f"c{suffix}")
    assert loaded == config
    resolution = loaded.resolve(op_type, stack)
    assert (resolution.config, resolution.rule) == (expected, rule)


def test_a_hand_written_module_name_and_op_type_section_reads_as_the_fluent_config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("module_name_operator_type:\n  blocks.0:\n    linear: null\n    add:\n"
                    "      input_activation: {format: int8, scheme: asymmetric}\n")
    loaded = QuantizerConfig.load(path)
    assert loaded == (QuantizerConfig().set_module_name_operator_type("blocks.0", "linear", None)
                      .set_module_name_operator_type("blocks.0", "add", OpConfig(A8)))


@pytest.mark.parametrize("section, message", [
    ({"b": {"lineer": None}}, "module_name_operator_type['b']['lineer']: unknown op type 'lineer'; allowed: linear, "),
    ({"b": ["linear"]}, "module_name_operator_type['b']: expected a mapping of op types to op configs, got list"),
    (["b"], "module_name_operator_type: expected a mapping of module paths to mappings of op types, got list"),
    ({0: {"linear": None}}, "module_name_operator_type[0]: module paths are strings (quote it in YAML: '0'), got int"),
])
def test_a_bad_module_name_and_op_type_section_is_named(section, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        QuantizerConfig.from_dict({"module_name_operator_type": section})


def test_set_module_name_operator_type_checks_its_arguments():
    with pytest.raises(ConfigError, match="set_module_name_operator_type: unknown op type 'relu'; allowed: linear"):
        QuantizerConfig().set_module_name_operator_type("b", "relu", None)
    with pytest.raises(TypeError, match=r"set_module_name_operator_type: name must be a module path \(str\), got "
                                        "Pattern"):
        QuantizerConfig().set_module_name_operator_type(re.compile("b"), "linear", None)
