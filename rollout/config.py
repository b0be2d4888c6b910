"""Config plumbing shared by every component: frozen dataclasses built from YAML dicts.

Each component defines one frozen dataclass and validates its fields in
``__post_init__`` by raising :class:`ConfigError` with the field's dotted path and,
where the field takes a fixed set of values, the allowed values. ``from_dict`` rejects
unknown keys (typos are the most common config bug) and builds nested dataclasses.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value is missing, unknown or out of range; the message names the field."""

    def __init__(self, field: str, message: str, allowed: typing.Iterable[Any] | None = None):
        self.field = field
        text = f"config field '{field}': {message}"
        if allowed is not None:
            text += f" (allowed: {', '.join(map(str, allowed))})"
        super().__init__(text)

    def __reduce__(self):  # rebuilt from its message and fields (the default would call __init__(text))
        return _rebuild_error, (type(self), self.args, self.__dict__)


def _rebuild_error(cls: type, args: tuple, state: dict) -> Exception:
    """An exception of ``cls`` with ``args`` and attributes ``state``, without its ``__init__``:
    how a ConfigError crosses a pickle (Ray's errors from an actor)."""
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(state)
    return err


class ConfigFileError(ConfigError):
    """A config file is missing, not YAML or not a mapping; the message names the file."""

    def __init__(self, path: str | Path, message: str):
        super().__init__(str(path), message)
        self.args = (f"config file '{path}': {message}",)


def is_int(value: Any) -> bool:
    """An integer that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_int(name: str, value: Any, low: int = 1) -> None:
    """Refuse ``value`` unless it is an integer >= ``low`` (the numeric range check of every config)."""
    if not is_int(value) or value < low:
        what = {0: "a non-negative integer", 1: "a positive integer"}.get(low, f"an integer >= {low}")
        raise ConfigError(name, f"must be {what}, got {value!r}")


def check_number(name: str, value: Any, low: float, high: float | None = None, *,
                 low_open: bool = False, high_open: bool = False, finite: bool = False) -> None:
    """Refuse ``value`` unless it is a number (not NaN; finite with ``finite``) from ``low`` to
    ``high`` (None: no upper bound), each end closed unless ``*_open`` (the numeric range check
    of every config)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    ok = ok and (math.isfinite(value) or not finite) and (value > low if low_open else value >= low) and (
        high is None or (value < high if high_open else value <= high))
    if ok:
        return
    if high is None:
        where = f"{'>' if low_open else '>='} {low}"
    else:
        where = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    raise ConfigError(name, f"must be a {'finite ' if finite else ''}number {where}, got {value!r}")


def _nested_dataclass(tp: Any) -> type | None:
    """The dataclass inside ``tp`` (``X`` or ``X | None``), or None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if dataclasses.is_dataclass(arg):
                return arg
    return None


def _allows_none(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}" if value is not None else "null"


def check_leaf(path: str, tp: Any, value: Any) -> None:
    """Refuse a YAML scalar of the wrong kind for a field typed ``float``, ``int``, ``str`` or
    ``bool`` (optionally ``| None``): a bool is not a number, a number is not a string, and a
    float must be finite (YAML's ``.inf`` / ``.nan`` are never a meaningful setting here).
    Containers and other types are left to the dataclass's own ``__post_init__``."""
    if value is None and _allows_none(tp):
        return
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            return
        tp = args[0]
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"must be a number, got {_describe(value)}")
        if not math.isfinite(value):
            raise ConfigError(path, f"must be a finite number, got {value!r}")
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"must be an integer, got {_describe(value)}")
    elif tp is str:
        if isinstance(value, bool):  # YAML 1.1: unquoted off/on/yes/no/true/false are booleans
            word = "off" if value is False else "on"
            raise ConfigError(path, f"must be a string, got {_describe(value)} (YAML reads an unquoted {word}, "
                              f"yes, no, true or false as a boolean: quote it, e.g. '{word}')")
        if not isinstance(value, str):
            raise ConfigError(path, f"must be a string, got {_describe(value)}")
    elif tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"must be true or false, got {_describe(value)}")


def from_dict(cls: type[T], data: dict[str, Any] | None, prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and bad nested values raise ConfigError."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(prefix or cls.__name__, f"expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(where, "unknown field", allowed=sorted(fields))
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        path = f"{prefix}.{name}" if prefix else name
        sub = _nested_dataclass(hints[name])
        if sub is not None and isinstance(value, dict):
            value = from_dict(sub, value, path)
        elif sub is not None and not (value is None and _allows_none(hints[name])):
            raise ConfigError(path, f"must be a mapping (a config section), got {_describe(value)}")
        else:
            check_leaf(path, hints[name], value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError as err:
        if prefix and not err.field.startswith(prefix):
            raise ConfigError(f"{prefix}.{err.field}", str(err).split(": ", 1)[1]) from None
        raise


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; a missing file or a parse error raises ConfigError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigFileError(path, "not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigFileError(path, f"invalid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigFileError(path, "the top level must be a mapping")
    return data
