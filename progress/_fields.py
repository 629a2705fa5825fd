"""Derive ``to_dict``/``from_dict`` from a dataclass's fields, strictly.

Deriving both directions from ``dataclasses.fields`` means a new field cannot be forgotten by
the serializer; ``from_dict`` refuses missing and unknown keys so a stale or foreign record is
an error, never a silent partial restore.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, TypeVar

from progress.errors import ProgressSchemaError

T = TypeVar("T")


def fields_to_dict(record: Any, encode_value: Callable[[Any], Any]) -> dict[str, Any]:
    """Map each dataclass field name of ``record`` to ``encode_value(value)``."""
    return {name: encode_value(getattr(record, name)) for name in field_names(type(record))}


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def field_names(cls: type) -> tuple[str, ...]:
    """The field names of the dataclass ``cls``, in order (fixed when the class is made; every
    checkpoint encodes the progress tree, and ``dataclasses.fields`` rebuilds its answer per call)."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(field.name for field in dataclasses.fields(cls))
    return names


def check_keys(cls: type, data: Mapping[str, Any], optional: frozenset[str] = frozenset()) -> None:
    """Raise ProgressSchemaError unless ``data`` has exactly the field names of ``cls`` (those
    in ``optional``, added after the first version, may be missing)."""
    if not isinstance(data, Mapping):
        raise ProgressSchemaError(f"{cls.__name__}: expected a mapping, got {type(data).__name__}")
    expected = {f.name for f in dataclasses.fields(cls)}
    missing = sorted(expected - set(data) - optional)
    unknown = sorted(set(data) - expected, key=str)
    if missing:
        raise ProgressSchemaError(f"{cls.__name__}: missing keys {missing}")
    if unknown:
        raise ProgressSchemaError(f"{cls.__name__}: unknown keys {unknown}")


def require_int(owner: str, name: str, value: Any) -> int:
    """Return ``value`` if it is a non-negative int (bool excluded), else raise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProgressSchemaError(f"{owner}.{name}: expected a non-negative int, got {value!r}")
    return value
