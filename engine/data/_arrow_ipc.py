"""Arrow IPC stream bytes read from a checkpoint (a Hugging Face shuffle buffer's kept tables),
checked before they are decoded.

A record batch's body may be compressed (LZ4 or Zstandard), and a few kilobytes of it can
decompress to gigabytes: its row count and its compression are therefore read from each
message's metadata (a flatbuffer, parsed here with every offset bounds-checked) before any body
is decoded. The engine writes uncompressed streams only (engine.data.hf_shuffle), so a
compressed body is refused; an uncompressed one decodes without a copy, its memory bounded by
the bytes read.
"""

from __future__ import annotations

import struct
from typing import Any

_DICTIONARY_BATCH, _RECORD_BATCH = 2, 3  # MessageHeader of Arrow's Message.fbs
# Field indexes in Message.fbs: Message.header_type / .header, RecordBatch.length /
# .compression, DictionaryBatch.data.
_HEADER_TYPE, _HEADER, _LENGTH, _COMPRESSION, _DICTIONARY_DATA = 1, 2, 0, 3, 1


class IpcRefused(ValueError):
    """The bytes are not an Arrow IPC stream the engine reads back (the message says why)."""


def read_table(data: bytes, max_rows: int | None = None) -> Any:
    """The table in the IPC stream ``data``: its batches' metadata checked first (no compressed
    body, at most ``max_rows`` rows in all), then decoded. IpcRefused otherwise."""
    try:
        import pyarrow
    except ImportError as error:  # pragma: no cover - datasets depends on pyarrow
        raise ImportError("a Hugging Face stream's shuffle buffer needs pyarrow: pip install 'splitloop[hf]'") from error

    rows = 0
    try:
        for message in pyarrow.ipc.MessageReader.open_stream(pyarrow.py_buffer(data)):
            kind, length, compressed = _batch_header(message.metadata.to_pybytes())
            if compressed:
                raise IpcRefused("a record batch's body is compressed (the engine writes uncompressed tables only)")
            rows += length if kind == _RECORD_BATCH else 0
            if max_rows is not None and rows > max_rows:
                raise IpcRefused(f"they hold more than {max_rows} rows")
        return pyarrow.ipc.open_stream(pyarrow.py_buffer(data)).read_all()
    except IpcRefused:
        raise
    except (pyarrow.ArrowException, OSError, ValueError) as error:  # pyarrow's errors subclass these
        raise IpcRefused(f"not an Arrow IPC stream: {type(error).__name__}: {error}") from error


def _batch_header(metadata: bytes) -> tuple[int, int, bool]:
    """(message header type, rows, compressed) from a message's flatbuffer metadata; rows and
    compression are those of a record batch, or of a dictionary batch's data."""
    root = _read("<I", metadata, 0)
    kind_at = _field(metadata, root, _HEADER_TYPE)
    kind = 0 if kind_at is None else _read("<B", metadata, kind_at)
    header = _child(metadata, root, _HEADER)
    if kind == _DICTIONARY_BATCH and header is not None:
        header = _child(metadata, header, _DICTIONARY_DATA)
    if kind not in (_DICTIONARY_BATCH, _RECORD_BATCH) or header is None:
        return kind, 0, False
    length_at = _field(metadata, header, _LENGTH)
    rows = 0 if length_at is None else _read("<q", metadata, length_at)
    if rows < 0:
        raise IpcRefused(f"a record batch has {rows} rows")
    return kind, rows, _field(metadata, header, _COMPRESSION) is not None


def _read(layout: str, data: bytes, position: int) -> Any:
    if position < 0 or position + struct.calcsize(layout) > len(data):
        raise IpcRefused(f"a message's metadata points at offset {position}, outside its {len(data)} bytes")
    return struct.unpack_from(layout, data, position)[0]


def _field(data: bytes, table: int, index: int) -> int | None:
    """Where field ``index`` of the flatbuffer table at ``table`` lies, or None when absent."""
    vtable = table - _read("<i", data, table)
    if 4 + 2 * index + 2 > _read("<H", data, vtable):
        return None
    offset = _read("<H", data, vtable + 4 + 2 * index)
    return table + offset if offset else None


def _child(data: bytes, table: int, index: int) -> int | None:
    """The table field ``index`` of the table at ``table`` refers to, or None when absent."""
    position = _field(data, table, index)
    return None if position is None else position + _read("<I", data, position)
