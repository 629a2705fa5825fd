"""msgpack encoding of a :class:`ProgressTree`, wrapped with a schema version."""

from __future__ import annotations

from typing import Any

import msgpack

from progress.errors import ProgressSchemaError
from progress.tree import ProgressTree

SCHEMA_VERSION = 1
_KIND = "splitloop.progress"


def encode_tree(tree: ProgressTree) -> bytes:
    """Serialize ``tree`` to msgpack bytes carrying the schema version."""
    return msgpack.packb({"kind": _KIND, "schema": SCHEMA_VERSION, "tree": tree.to_dict()})


def decode_tree(data: bytes) -> ProgressTree:
    """Parse bytes made by :func:`encode_tree`. Raises ProgressSchemaError for anything else:
    bytes that are not msgpack, msgpack extension types, another kind or schema version."""
    envelope = _unpack(data)
    if not isinstance(envelope, dict) or set(envelope) != {"kind", "schema", "tree"}:
        raise ProgressSchemaError("not a progress envelope (expected keys kind, schema, tree)")
    if envelope["kind"] != _KIND:
        raise ProgressSchemaError(f"not progress data: kind is {envelope['kind']!r}")
    if type(envelope["schema"]) is not int or envelope["schema"] != SCHEMA_VERSION:
        raise ProgressSchemaError(
            f"progress schema version {envelope['schema']!r} is not supported (this code reads {SCHEMA_VERSION})"
        )
    return ProgressTree.from_dict(envelope["tree"])


def _refuse_extension(code: int, payload: bytes) -> Any:
    raise ProgressSchemaError(f"msgpack extension type {code} is not allowed in progress data")


def _unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, ext_hook=_refuse_extension, strict_map_key=True)
    except ProgressSchemaError:
        raise
    except Exception as error:  # msgpack raises several unrelated types for bad input
        raise ProgressSchemaError(f"progress data is not valid msgpack: {type(error).__name__}: {error}") from error
