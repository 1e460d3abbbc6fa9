"""Typed values in plain containers and back: :func:`to_plain` writes a dataclass (fields by name, enums by value,
tuples as lists, a mapping with other than string or enum keys as ``[key, value]`` pairs), and :func:`from_plain`
reads that form back from the dataclass's type hints, refusing anything of another shape."""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from enum import Enum
from typing import Any

from lightning_comp.errors import ConfigError

__all__ = ["from_plain", "to_plain"]


def to_plain(value: Any) -> Any:
    """``value`` (a dataclass, or anything inside one) in plain types, as a checkpoint holds it.

    Dataclasses become dicts of their fields, enums their values, tuples lists; a mapping whose keys are all strings
    or enums a dict keyed by those strings, any other mapping a list of ``[key, value]`` pairs.
    """
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in fields(value) if f.init}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Mapping):
        if all(isinstance(key, (str, Enum)) for key in value):
            return {to_plain(key): to_plain(item) for key, item in value.items()}
        return [[to_plain(key), to_plain(item)] for key, item in value.items()]
    if isinstance(value, (list, tuple)):
        return [to_plain(item) for item in value]
    return value


def from_plain(kind: Any, data: Any) -> Any:
    """Read :func:`to_plain`'s form of a value of type ``kind`` (a dataclass, enum, container or plain type).

    Raises:
        ConfigError: where ``data`` does not have the form of ``kind``, naming the value, the type and what differs.
    """
    try:
        return _from_plain(kind, data)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ConfigError(f"cannot read {data!r} as {kind!r}: {err}.") from None


def _from_plain(kind: Any, data: Any) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any:
        return data
    if origin in (typing.Union, types.UnionType):
        if data is None:
            return None
        options = [arg for arg in args if arg is not type(None)]
        if any(isinstance(arg, type) and type(data) is arg for arg in options):
            return data  # e.g. float | int: already the plain value
        return _from_plain(options[0], data)
    if origin in (dict, Mapping):
        key_kind, item_kind = args
        items = data.items() if isinstance(data, Mapping) else data
        return {_from_plain(key_kind, key): _from_plain(item_kind, item) for key, item in items}
    if origin is list:
        return [_from_plain(args[0], item) for item in data]
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_from_plain(args[0], item) for item in data)
        return tuple(_from_plain(arg, item) for arg, item in zip(args, data, strict=True))
    if isinstance(kind, type) and is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        known = {f.name for f in fields(kind) if f.init}
        unknown, missing = sorted(set(data) - known), sorted(known - set(data))
        if unknown or missing:
            raise ConfigError(f"{kind.__name__} has the fields {sorted(known)}: unknown keys {unknown}, missing keys"
                              f" {missing}")
        return kind(**{name: _from_plain(hints[name], data[name]) for name in known})
    if isinstance(kind, type) and issubclass(kind, Enum):
        return kind(data)
    if kind in (int, float, str, bool):
        if not isinstance(data, (int, float, str, bool)):
            raise ConfigError(f"expected a {kind.__name__}")
        return data  # as written (a count averaged over ranks may be a float)
    raise ConfigError(f"no plain form for {kind!r}")
