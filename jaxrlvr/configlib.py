"""YAML and ``key=value`` overrides -> frozen dataclasses, with one-line errors naming the key.

The config classes themselves live next to the code they configure (``ModelConfig`` in model/,
``PolicyLossConfig`` in algos/, ...); this module only fills them. It knows the field types from
the annotations: ``int``, ``float``, ``bool``, ``str``, ``Literal[...]``, ``X | None``,
``tuple[T, ...]`` and nested dataclasses. Validation beyond types stays in each class's
``__post_init__`` (a run's ``TrainConfig`` runs ``config.check_config`` there); its message is
prefixed with the dotted key of the section.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union

import yaml


class ConfigKeyError(ValueError):
    """A config file or override names an unknown key or gives a value of the wrong type."""


class PreflightError(ValueError):
    """A command's input (a path, a server, the run directory) is missing or unusable; the
    message is one line naming the key or flag (``preflight``, ``hub``, ``rundir``)."""


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp, key: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigKeyError(f"{key}={value!r}: expected one of {list(allowed)}")
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigKeyError(f"{key}=null: expected {_type_name(tp)}")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key)
            except ConfigKeyError as e:
                errors.append(str(e))
        raise ConfigKeyError(f"{key}={value!r}: expected {_type_name(tp)}")
    if origin in (tuple, Sequence, list) or tp in (tuple, list):
        args = typing.get_args(tp)
        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise ConfigKeyError(f"{key}={value!r}: expected a list")
        elem = args[0] if args else Any
        return tuple(_convert(v, elem, f"{key}[{i}]") for i, v in enumerate(value))
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigKeyError(f"{key}={value!r}: expected a mapping")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigKeyError(f"{key}={value!r}: expected a mapping of {tp.__name__} fields")
        return build(tp, value, prefix=key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigKeyError(f"{key}={value!r}: expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigKeyError(f"{key}={value!r}: expected an integer")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigKeyError(f"{key}={value!r}: expected a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigKeyError(f"{key}={value!r}: expected a string")
    return value


def build(cls, data: Mapping[str, Any] | None, *, prefix: str = ""):
    """Builds dataclass ``cls`` from a nested mapping; unknown keys and bad values are errors."""
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in fields:
            allowed = ", ".join(sorted(fields))
            raise ConfigKeyError(f"unknown config key {key!r} (allowed here: {allowed})")
        kwargs[name] = _convert(value, hints[name], key)
    try:
        return cls(**kwargs)
    except ConfigKeyError:
        raise
    except (ValueError, TypeError) as e:
        where = prefix or cls.__name__
        raise ConfigKeyError(f"{where}: {e}") from None


def to_dict(obj) -> Any:
    """A dataclass tree as plain YAML/JSON-able data (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {
            f.name: to_dict(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if f.init and f.repr
        }
    if isinstance(obj, tuple | list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a","b","c"], value parsed as YAML)."""
    if "=" not in text:
        raise ConfigKeyError(f"override {text!r}: expected key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigKeyError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Sets dotted keys in a nested dict (copying as needed)."""
    data = _deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigKeyError(f"override {text!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return data


def deep_merge(base: dict, over: dict) -> dict:
    """``over`` merged into a copy of ``base``; nested mappings merge, everything else replaces."""
    out = _deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = _deepcopy(value)
    return out


def _deepcopy(d):
    if isinstance(d, dict):
        return {k: _deepcopy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deepcopy(v) for v in d]
    return d


def load_yaml(path: str) -> dict:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigKeyError(f"{path}: config file not found") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigKeyError(f"{path}:{where} invalid YAML") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigKeyError(f"{path}: top level must be a mapping of sections")
    return data
