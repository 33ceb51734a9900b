"""A QSpec as a plain dict (for YAML and JSON config files) and back.

    {"format": "int4", "granularity": {"type": "per_group", "group_size": 32, "axis": 1},
     "scheme": "asymmetric", "formulation": "minval", "observer": "current_min_max", "dynamic": false,
     "learnable": false, "grad_factor": null, "scale_dtype": "float32"}

A granularity or observer without arguments may be written as its bare name.
`qspec_to_dict` writes every field, so a dict read back gives an equal QSpec
and writing it again gives the same dict. Every unknown key or value is an
error that names it and lists what is allowed.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from pt2e_fq import (
    CurrentMinMaxObserver,
    FloatFormat,
    HistogramObserver,
    IntFormat,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MSEObserver,
    PerBlock,
    PerChannel,
    PerGroup,
    PerTensor,
    PerToken,
    QSpec,
)

GRANULARITY_NAMES = {
    "per_tensor": PerTensor,
    "per_channel": PerChannel,
    "per_group": PerGroup,
    "per_block": PerBlock,
    "per_token": PerToken,
}
OBSERVER_NAMES = {
    "min_max": MinMaxObserver,
    "moving_average_min_max": MovingAverageMinMaxObserver,
    "mse": MSEObserver,
    "histogram": HistogramObserver,
    "current_min_max": CurrentMinMaxObserver,
}
QSPEC_KEYS = ("format", "granularity", "scheme", "formulation", "observer", "dynamic", "learnable", "grad_factor",
              "scale_dtype")
_INT_FORMAT = re.compile(r"(u?)int(\d+)")


class ConfigError(ValueError):
    """A config dict or file has an unknown key or value; the message says where."""


def _allowed(names) -> str:
    return ", ".join(names)


def check_keys(where: str, given, allowed) -> None:
    """Raises ConfigError naming the first key of `given` that is not in `allowed`."""
    if not isinstance(given, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(given).__name__} {given!r}")
    for key in given:
        if key not in allowed:
            if not allowed:  # an empty list after "allowed:" reads as a truncated message
                raise ConfigError(f"{where}: unknown key {key!r}; it takes no arguments")
            raise ConfigError(f"{where}: unknown key {key!r}; allowed: {_allowed(allowed)}")


def format_name(fmt) -> str:
    return fmt.name.lower() if isinstance(fmt, FloatFormat) else fmt.name


def _format_from(where: str, value):
    if isinstance(value, str):
        name = value.lower()
        m = _INT_FORMAT.fullmatch(name)
        if m:
            try:
                return IntFormat(int(m.group(2)), signed=not m.group(1))
            except ValueError as e:
                raise ConfigError(f"{where}: {e}") from None
        for fmt in FloatFormat:
            if fmt.name.lower() == name:
                return fmt
    floats = _allowed(f.name.lower() for f in FloatFormat)
    raise ConfigError(f"{where}: unknown format {value!r}; allowed: int2 .. int16, uint2 .. uint15, {floats}")


def _named_dataclass_to(value, names: dict) -> Any:
    """A granularity or observer: its bare name when it has no fields, else
    {"type": name, field: value, ...}."""
    name = next(n for n, cls in names.items() if type(value) is cls)
    fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if not fields:
        return name
    return {"type": name, **{k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}}


def _named_dataclass_from(where: str, what: str, value, names: dict):
    if isinstance(value, str):
        name, args = value, {}
    elif isinstance(value, dict) and "type" in value:
        name, args = value["type"], {k: v for k, v in value.items() if k != "type"}
    else:
        raise ConfigError(
            f"{where}: a {what} is a name or a mapping with a 'type' key, got {value!r}; "
            f"allowed types: {_allowed(names)}"
        )
    if not isinstance(name, str):  # a list or mapping is unhashable: `name in names` would be a bare TypeError
        raise ConfigError(
            f"{where}.type: a {what} type is one name, got {type(name).__name__} {name!r}; allowed: {_allowed(names)}"
        )
    if name not in names:
        raise ConfigError(f"{where}: unknown {what} {name!r}; allowed: {_allowed(names)}")
    cls = names[name]
    check_keys(f"{where} ({name})", args, [f.name for f in dataclasses.fields(cls)])
    try:
        return cls(**args)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def qspec_to_dict(spec: QSpec) -> dict:
    return {
        "format": format_name(spec.format),
        "granularity": _named_dataclass_to(spec.granularity, GRANULARITY_NAMES),
        "scheme": spec.scheme.value,
        "formulation": spec.formulation.value,
        "observer": None if spec.observer is None else _named_dataclass_to(spec.observer, OBSERVER_NAMES),
        "dynamic": spec.dynamic,
        "learnable": spec.learnable,
        "grad_factor": spec.grad_factor,
        "scale_dtype": str(spec.scale_dtype).removeprefix("torch."),
    }


def qspec_from_dict(where: str, d) -> QSpec:
    """The QSpec a dict describes; `where` (e.g. "global.weight") prefixes errors.
    Missing keys take QSpec's defaults; "format" is required."""
    check_keys(where, d, QSPEC_KEYS)
    if "format" not in d:
        raise ConfigError(f"{where}: missing key 'format'")
    kwargs = {"format": _format_from(f"{where}.format", d["format"])}
    if "granularity" in d:
        kwargs["granularity"] = _named_dataclass_from(f"{where}.granularity", "granularity", d["granularity"],
                                                      GRANULARITY_NAMES)
    if d.get("observer") is not None:
        kwargs["observer"] = _named_dataclass_from(f"{where}.observer", "observer", d["observer"], OBSERVER_NAMES)
    # scale_dtype by name: QSpec takes a dtype's name ("bfloat16") and checks it.
    for key in ("scheme", "formulation", "dynamic", "learnable", "grad_factor", "scale_dtype"):
        if key in d:
            kwargs[key] = d[key]
    try:
        return QSpec(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None
