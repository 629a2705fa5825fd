"""Short one-line descriptions of nested user values (a batch, a hidden state, what
``configure_optimizers`` returned) for error messages: the containers' structure, with each
leaf described by the caller."""

from __future__ import annotations

from typing import Any, Callable

# How many items of a container, and how many levels, a description shows.
_ITEMS = 4
_DEPTH = 3


def describe_nested(value: Any, leaf: Callable[[Any], str], depth: int = 0) -> str:
    """``list[tensor(2, 3), ...]``-style: tuples, lists and dicts spelled out (their first items,
    a few levels deep), anything else described by ``leaf``."""
    if depth < _DEPTH and isinstance(value, (tuple, list)):
        inner = ", ".join(describe_nested(item, leaf, depth + 1) for item in value[:_ITEMS])
        return f"{type(value).__name__}[{inner}{', ...' if len(value) > _ITEMS else ''}]"
    if depth < _DEPTH and isinstance(value, dict):
        inner = ", ".join(f"{key!r}: {describe_nested(item, leaf, depth + 1)}" for key, item in list(value.items())[:_ITEMS])
        return f"dict{{{inner}{', ...' if len(value) > _ITEMS else ''}}}"
    return leaf(value)
