"""QuantizerConfig: which op config applies to which op.

An OpConfig holds the QSpecs of one op's tensors (input activations, weight,
bias, output activation; None leaves that tensor in float). A QuantizerConfig
holds a global OpConfig and overrides by op type, by module type and by
module name (exact, or a regular expression that must match the whole
name), and by op type inside a named module. The most specific wins: module
name and op type > module name > module type > op type > global, and among
modules the innermost one that has an entry. An entry of None leaves the op
in float. A module name and op type entry ({"block1": {"linear": ...}})
covers only that op type in that module (and the modules inside it): the
module's other ops resolve as if the entry were not there, so a residual
add in a block whose linear gets its own config keeps the policy of the
entries above it (quantizers.mixed_precision writes its choices that way).
The path "" names the model itself, the outermost module of every op: an
entry for it covers the model's own ops and every op that no entry
naming an inner module takes.

It round-trips through dicts, YAML and JSON files:

    global: {input_activation: {...qspec...}, weight: {...}, bias: null, output_activation: {...}}
    operator_type: {conv2d: {...op config...}}
    module_type: {torch.nn.Linear: null}
    module_name: {head: null}
    module_name_regex: {'blocks\\.\\d+\\.attn\\..*': {...}}
    module_name_operator_type: {blocks.0: {linear: {...op config...}}}
    model_output: false
    fuse_conv_add: false
    fuse_activations: [relu, relu6, hardtanh, gelu, silu, hardswish, sigmoid, tanh, leaky_relu, elu]

`model_output` says whether the model's outputs are quantized: with false
(the default), an op's output point whose only readers are the model's
outputs (a classifier's logits) is left out, as torchao's XNNPACK and X86
quantizers do; a tensor the model also reads keeps its point. A point there
caps the accuracy of the whole model for no deployment gain (the consumer
of the logits is float code); docs/quantizers.md has what it costs a BERT
classifier. The presets place no output points at all (quantizers.presets).

`fuse_conv_add` says whether a conv2d whose output goes only into a residual
add (conv -> [bn] -> add -> [relu], quantizers.patterns.residual_add) keeps
that output in float and quantizes the add's other input and its output
instead, as torchao's X86InductorQuantizer does: Inductor then runs conv,
add and relu as one int8 oneDNN call. It applies where the add is quantized
(`presets.every_point` layouts; the presets leave adds float). Default false:
XNNPACK quantizes a conv only with its output quantized, so under ExecuTorch
such a conv would run in float (docs/quantizers.md).

`fuse_activations` names the activations (quantizers.patterns.ACTIVATIONS)
quantized together with the op before them: an op followed by one of them
gets its output point after the activation (linear -> gelu -> point), by
any other right after the op (linear -> point -> gelu). Default: all of
them. It matters where op outputs are quantized (`presets.every_point`):
XNNPACK runs a linear or conv in int8 only with its output quantized
directly or after a ReLU or clamp it fuses, so its layout is
`presets.every_point(name, target="xnnpack")`, which keeps only those
(pt2e_fq.export.XNNPACK_FUSED_ACTIVATIONS).
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from pt2e_fq import QSpec
from pt2e_fq.calib.rotation import check_block_size
from pt2e_fq.files import write_text

from .patterns import ACTIVATIONS, OP_TYPES
from .qspec_dict import ConfigError, check_keys, qspec_from_dict, qspec_to_dict

OP_CONFIG_KEYS = ("input_activation", "weight", "bias", "output_activation")
_SECTIONS = ("operator_type", "module_type", "module_name", "module_name_regex")
CONFIG_KEYS = ("global", *_SECTIONS, "module_name_operator_type", "model_output", "fuse_conv_add",
               "fuse_activations", "input_rotation")
FILE_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass(frozen=True)
class OpConfig:
    """The QSpecs of one op's tensors; None leaves that tensor in float.

    Args:
        input_activation: the QSpec of the op's activation inputs.
        weight: the QSpec of its weight.
        bias: the QSpec of its bias.
        output_activation: the QSpec of its output.

    Raises:
        TypeError: a field that is not a QSpec or None.
    """

    input_activation: Optional[QSpec] = None
    weight: Optional[QSpec] = None
    bias: Optional[QSpec] = None
    output_activation: Optional[QSpec] = None

    def __post_init__(self):
        for name in OP_CONFIG_KEYS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, QSpec):
                raise TypeError(f"OpConfig: {name} must be a pt2e_fq.QSpec or None, got {type(value).__name__}")

    def to_dict(self) -> dict:
        return {k: None if getattr(self, k) is None else qspec_to_dict(getattr(self, k)) for k in OP_CONFIG_KEYS}

    @classmethod
    def from_dict(cls, d, where: str = "op config") -> "OpConfig":
        check_keys(where, d, OP_CONFIG_KEYS)
        return cls(**{k: None if v is None else qspec_from_dict(f"{where}.{k}", v) for k, v in d.items()})


def _op_config_or_none(where: str, value) -> Optional[OpConfig]:
    if value is not None and not isinstance(value, OpConfig):
        raise TypeError(f"{where}: expected an OpConfig or None (leave in float), got {type(value).__name__}")
    return value


def module_type_name(cls: type) -> str:
    """How the exported graph's nn_module_stack names a module class."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _short_type_name(cls: type) -> str:
    """torch.nn.Linear rather than torch.nn.modules.linear.Linear, where it is the same class."""
    return f"torch.nn.{cls.__name__}" if getattr(torch.nn, cls.__name__, None) is cls else module_type_name(cls)


def _import_module_type(where: str, name: str) -> type:
    """The class a module_type entry names. Its module is imported as
    written: a config is trusted input, like the code that loads it."""
    if not all(part.isidentifier() for part in name.split(".")):
        # importlib takes a leading "." as a relative import and fails with a TypeError.
        raise ConfigError(f"{where}: {name!r} is not a dotted class name; write the module and the class, "
                          "e.g. torch.nn.Linear or mypackage.models.Block")
    # A class nested in another (`pkg.mod.Outer.Block`, as save writes its __qualname__) is an attribute
    # path after its module: the longest importable prefix is the module, the rest is looked up on it.
    parts, cls = name.split("."), None
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for attr in parts[split:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        cls = obj
        break
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise ConfigError(
            f"{where}: {name!r} is not an importable torch.nn.Module subclass; write its dotted path, "
            "e.g. torch.nn.Linear or mypackage.models.Block"
        )
    return cls


def _bool(where: str, value, error=TypeError) -> bool:
    if not isinstance(value, bool):
        raise error(f"{where}: expected true or false, got {type(value).__name__} {value!r}")
    return value


def _activation_names(where: str, names, error=TypeError) -> tuple[str, ...]:
    """`names` as a tuple in ACTIVATIONS' order, each checked."""
    if isinstance(names, str) or not isinstance(names, (list, tuple, set, frozenset)):
        raise error(f"{where}: expected a list of activation names, got {type(names).__name__} {names!r}")
    not_names = [n for n in names if not isinstance(n, str)]
    if not_names:  # a list or dict inside is unhashable: `n in ACTIVATIONS` would raise a bare TypeError
        raise error(f"{where}: expected a list of activation names, got {type(not_names[0]).__name__} "
                    f"{not_names[0]!r} in {names!r}; allowed: {', '.join(ACTIVATIONS)}")
    unknown = [n for n in names if n not in ACTIVATIONS]
    if unknown:
        raise ConfigError(f"{where}: unknown activation {unknown[0]!r}; allowed: {', '.join(ACTIVATIONS)}")
    return tuple(n for n in ACTIVATIONS if n in set(names))


def _block_size_or_none(where: str, value) -> Optional[int]:
    return None if value is None else check_block_size(where, value)


@dataclass
class Resolution:
    """The op config chosen for an op and the rule that chose it."""

    config: Optional[OpConfig]
    rule: str
    # (section, key) of the entry that chose it, as in to_dict; None: the global config.
    entry: Optional[tuple[str, str]] = None


class QuantizerConfig:
    """Global, op-type, module-type and module-name op configs; see the module doc.

    Args:
        global_config: the OpConfig of every supported op no more specific entry names; None: float.
        model_output: quantize the model's outputs where an op config gives them an output point.
        fuse_conv_add: a conv2d whose output goes only into a residual add keeps it float, the add's
            other input and output quantized (Inductor's conv-add-relu in one int8 call).
        fuse_activations: the activations quantized together with the op before them.
        input_rotation: the Hadamard block size the inputs of linears and convolutions (groups 1) are
            rotated in, or None (off).

    Raises:
        TypeError: global_config not an OpConfig or None, a flag not a bool, fuse_activations not a list,
            input_rotation not an int or None.
        ConfigError: an unknown activation name.
        ValueError: input_rotation not a power of two >= 2.
    """

    def __init__(self, global_config: Optional[OpConfig] = None, model_output: bool = False,
                 fuse_conv_add: bool = False, fuse_activations: Sequence[str] = tuple(ACTIVATIONS),
                 input_rotation: Optional[int] = None):
        self.global_config = _op_config_or_none("QuantizerConfig", global_config)
        self.model_output = _bool("QuantizerConfig: model_output", model_output)
        self.fuse_conv_add = _bool("QuantizerConfig: fuse_conv_add", fuse_conv_add)
        self.fuse_activations = _activation_names("QuantizerConfig: fuse_activations", fuse_activations)
        self.input_rotation = _block_size_or_none("QuantizerConfig: input_rotation", input_rotation)
        self.operator_type: dict[str, Optional[OpConfig]] = {}
        self.module_type: dict[type, Optional[OpConfig]] = {}
        self.module_name: dict[str, Optional[OpConfig]] = {}
        self.module_name_regex: dict[str, Optional[OpConfig]] = {}
        self.module_name_operator_type: dict[str, dict[str, Optional[OpConfig]]] = {}

    # -- fluent setters -------------------------------------------------------

    def set_global(self, config: Optional[OpConfig]) -> "QuantizerConfig":
        self.global_config = _op_config_or_none("set_global", config)
        return self

    def set_model_output(self, quantize: bool) -> "QuantizerConfig":
        """Whether the model's outputs are quantized (see the module doc)."""
        self.model_output = _bool("set_model_output: quantize", quantize)
        return self

    def set_fuse_conv_add(self, fuse: bool) -> "QuantizerConfig":
        """Whether conv2d -> [bn] -> add -> [relu] leaves the conv's output in
        float, for Inductor's fused int8 conv-add (see the module doc)."""
        self.fuse_conv_add = _bool("set_fuse_conv_add: fuse", fuse)
        return self

    def set_fuse_activations(self, names: Sequence[str]) -> "QuantizerConfig":
        """The activations (names of quantizers.patterns.ACTIVATIONS: "relu",
        "gelu", ...) quantized together with the op before them; [] puts
        every op's output point right after the op (see the module doc)."""
        self.fuse_activations = _activation_names("set_fuse_activations: names", names)
        return self

    def set_input_rotation(self, block_size: Optional[int]) -> "QuantizerConfig":
        """Rotates the inputs of linears and convolutions (groups 1) in
        Hadamard blocks of `block_size` channels (a power of two), or not
        (None); see the module doc."""
        self.input_rotation = _block_size_or_none("set_input_rotation: block_size", block_size)
        return self

    def set_operator_type(self, op_type: str, config: Optional[OpConfig]) -> "QuantizerConfig":
        """op_type: one of OP_TYPES ("linear", "conv2d", "matmul", "add", "cat", ...)."""
        if op_type not in OP_TYPES:
            raise ConfigError(f"set_operator_type: unknown op type {op_type!r}; allowed: {', '.join(OP_TYPES)}")
        self.operator_type[op_type] = _op_config_or_none("set_operator_type", config)
        return self

    def set_module_type(self, module_type: type, config: Optional[OpConfig]) -> "QuantizerConfig":
        """module_type: a torch.nn.Module subclass (e.g. torch.nn.Linear)."""
        if not (isinstance(module_type, type) and issubclass(module_type, torch.nn.Module)):
            raise TypeError(f"set_module_type: module_type must be a torch.nn.Module subclass, got {module_type!r}")
        self.module_type[module_type] = _op_config_or_none("set_module_type", config)
        return self

    def set_module_name(self, name: Union[str, re.Pattern], config: Optional[OpConfig]) -> "QuantizerConfig":
        """name: a module's path in the model ("encoder.fc1"; it covers the
        modules inside it too), or a compiled regular expression that must
        match a whole path (re.compile(r"blocks\\.\\d+\\.fc"))."""
        config = _op_config_or_none("set_module_name", config)
        if isinstance(name, re.Pattern):
            self.module_name_regex[name.pattern] = config
        elif isinstance(name, str):
            self.module_name[name] = config
        else:
            raise TypeError(f"set_module_name: name must be a str or a compiled re.Pattern, got {type(name).__name__}")
        return self

    def set_module_name_operator_type(self, name: str, op_type: str,
                                      config: Optional[OpConfig]) -> "QuantizerConfig":
        """The op config of the ops of `op_type` (one of OP_TYPES) inside the
        module at path `name` (and the modules inside it); its other ops
        resolve as if this entry were not there (see the module doc)."""
        if not isinstance(name, str):
            raise TypeError(f"set_module_name_operator_type: name must be a module path (str), got "
                            f"{type(name).__name__}")
        if op_type not in OP_TYPES:
            raise ConfigError(f"set_module_name_operator_type: unknown op type {op_type!r}; allowed: "
                              f"{', '.join(OP_TYPES)}")
        self.module_name_operator_type.setdefault(name, {})[op_type] = _op_config_or_none(
            "set_module_name_operator_type", config)
        return self

    # -- resolution -------------------------------------------------------------

    def resolve(self, op_type: str, module_stack: Sequence[tuple[str, str]]) -> Resolution:
        """The op config of an op of `op_type` called inside `module_stack`
        ((path, type name) pairs, outermost first, as in an exported node's
        nn_module_stack)."""
        inner_first = list(reversed(module_stack))
        for path, _ in inner_first:
            if op_type in self.module_name_operator_type.get(path, {}):
                return Resolution(self.module_name_operator_type[path][op_type],
                                  f"module name {path!r}, op type {op_type!r}",
                                  ("module_name_operator_type", f"{path}: {op_type}"))
            if path in self.module_name:
                return Resolution(self.module_name[path], f"module name {path!r}", ("module_name", path))
            for pattern, config in self.module_name_regex.items():
                if re.fullmatch(pattern, path):
                    return Resolution(config, f"module name regex {pattern!r}", ("module_name_regex", pattern))
        for path, type_name in inner_first:
            for cls, config in self.module_type.items():
                if module_type_name(cls) == type_name:
                    return Resolution(config, f"module type {cls.__name__}", ("module_type", _short_type_name(cls)))
        if op_type in self.operator_type:
            return Resolution(self.operator_type[op_type], f"op type {op_type!r}", ("operator_type", op_type))
        return Resolution(self.global_config, "global")

    def op_configs(self) -> list[tuple[str, object, Optional[OpConfig]]]:
        """(section, key, OpConfig or None) of every op config: the global one
        (key None), then each section's entries; a module_name_operator_type
        entry's key is (module path, op type)."""
        entries: list = [("global", None, self.global_config)]
        for section in _SECTIONS:
            entries += [(section, key, c) for key, c in getattr(self, section).items()]
        entries += [("module_name_operator_type", (path, t), c)
                    for path, by_type in self.module_name_operator_type.items() for t, c in by_type.items()]
        return entries

    def replace_op_config(self, section: str, key, config: Optional[OpConfig]) -> None:
        """Puts `config` in the place op_configs() names by (section, key)."""
        if section == "global":
            self.global_config = config
        elif section == "module_name_operator_type":
            self.module_name_operator_type[key[0]][key[1]] = config
        else:
            getattr(self, section)[key] = config

    def model_entries(self) -> list[tuple[str, str]]:
        """(section, key) of the entries that name parts of a model (module
        names, regular expressions, module types), as in to_dict."""
        return ([("module_name", k) for k in self.module_name]
                + [("module_name_regex", k) for k in self.module_name_regex]
                + [("module_type", _short_type_name(k)) for k in self.module_type]
                + [("module_name_operator_type", f"{path}: {op_type}")
                   for path, entries in self.module_name_operator_type.items() for op_type in entries])

    # -- dicts and files ------------------------------------------------------------

    def to_dict(self) -> dict:
        as_dict = lambda c: None if c is None else c.to_dict()  # noqa: E731
        return {
            "global": as_dict(self.global_config),
            "operator_type": {k: as_dict(v) for k, v in self.operator_type.items()},
            "module_type": {_short_type_name(k): as_dict(v) for k, v in self.module_type.items()},
            "module_name": {k: as_dict(v) for k, v in self.module_name.items()},
            "module_name_regex": {k: as_dict(v) for k, v in self.module_name_regex.items()},
            "module_name_operator_type": {path: {t: as_dict(v) for t, v in entries.items()}
                                          for path, entries in self.module_name_operator_type.items()},
            "model_output": self.model_output,
            "fuse_conv_add": self.fuse_conv_add,
            "fuse_activations": list(self.fuse_activations),
            "input_rotation": self.input_rotation,
        }

    @classmethod
    def from_dict(cls, d) -> "QuantizerConfig":
        check_keys("QuantizerConfig", d, CONFIG_KEYS)
        op_config = lambda where, v: None if v is None else OpConfig.from_dict(v, where)  # noqa: E731
        config = cls(op_config("global", d.get("global")))
        if "model_output" in d:
            config.model_output = _bool("model_output", d["model_output"], ConfigError)
        if "fuse_conv_add" in d:
            config.fuse_conv_add = _bool("fuse_conv_add", d["fuse_conv_add"], ConfigError)
        if "fuse_activations" in d:
            config.fuse_activations = _activation_names("fuse_activations", d["fuse_activations"], ConfigError)
        if "input_rotation" in d:
            try:
                config.input_rotation = _block_size_or_none("input_rotation", d["input_rotation"])
            except (TypeError, ValueError) as e:
                raise ConfigError(str(e)) from None
        for section in _SECTIONS:
            # Only a missing section or null is empty: [], 0, false or "" are no mapping and are refused.
            entries = d.get(section)
            entries = {} if entries is None else entries
            if not isinstance(entries, dict):
                raise ConfigError(f"{section}: expected a mapping, got {type(entries).__name__} {entries!r}")
            for key, value in entries.items():
                where = f"{section}[{key!r}]"
                if not isinstance(key, str):
                    # YAML reads `0:` as an int: a key that would never match a module path, type or op
                    raise ConfigError(f"{where}: keys of {section} are strings (quote it in YAML: "
                                      f"'{key}'), got {type(key).__name__}")
                entry = op_config(where, value)
                if section == "operator_type":
                    if key not in OP_TYPES:
                        raise ConfigError(f"{where}: unknown op type {key!r}; allowed: {', '.join(OP_TYPES)}")
                    config.operator_type[key] = entry
                elif section == "module_type":
                    config.module_type[_import_module_type(where, key)] = entry
                elif section == "module_name":
                    config.module_name[key] = entry
                else:
                    try:
                        re.compile(key)
                    except re.error as e:
                        raise ConfigError(f"{where}: not a regular expression ({e})") from None
                    config.module_name_regex[key] = entry
        _module_op_types(config, d.get("module_name_operator_type"), op_config)
        return config

    def save(self, path: Union[str, Path]) -> None:
        """Writes YAML (.yaml, .yml) or JSON (.json), by the file's suffix,
        atomically (pt2e_fq.files: a failed write leaves an old file as it
        was and raises WriteError)."""
        path = Path(path)
        kind = _file_kind(path)
        if kind == "json":
            text = json.dumps(self.to_dict(), indent=2) + "\n"
        else:
            import yaml

            text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        write_text(path, text)

    @classmethod
    def load(cls, path: Union[str, Path]) -> "QuantizerConfig":
        path = Path(path)
        kind = _file_kind(path)
        if kind == "json":
            return cls.from_dict(json.loads(path.read_text()))
        import yaml

        return cls.from_dict(yaml.safe_load(path.read_text()))

    def __eq__(self, other) -> bool:
        return isinstance(other, QuantizerConfig) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"QuantizerConfig({self.to_dict()!r})"


def _module_op_types(config: QuantizerConfig, entries, op_config) -> None:
    """The module_name_operator_type section: {module path: {op type: op config}}."""
    section = "module_name_operator_type"
    entries = {} if entries is None else entries
    if not isinstance(entries, dict):
        raise ConfigError(f"{section}: expected a mapping of module paths to mappings of op types, got "
                          f"{type(entries).__name__} {entries!r}")
    for path, by_type in entries.items():
        if not isinstance(path, str):
            raise ConfigError(f"{section}[{path!r}]: module paths are strings (quote it in YAML: '{path}'), got "
                              f"{type(path).__name__}")
        if not isinstance(by_type, dict):
            raise ConfigError(f"{section}[{path!r}]: expected a mapping of op types to op configs, got "
                              f"{type(by_type).__name__} {by_type!r}")
        for op_type, value in by_type.items():
            where = f"{section}[{path!r}][{op_type!r}]"
            if op_type not in OP_TYPES:
                raise ConfigError(f"{where}: unknown op type {op_type!r}; allowed: {', '.join(OP_TYPES)}")
            config.module_name_operator_type.setdefault(path, {})[op_type] = op_config(where, value)


def _file_kind(path: Path) -> str:
    if path.suffix.lower() not in FILE_SUFFIXES:
        raise ConfigError(f"QuantizerConfig file {str(path)!r}: unknown suffix {path.suffix!r}; "
                          f"allowed: {', '.join(FILE_SUFFIXES)}")
    return "json" if path.suffix.lower() == ".json" else "yaml"
