"""The messages between a training process and its writer process
(engine.checkpoint.writers.process.writer): msgpack maps, each framed by its length (4 bytes,
little-endian), over pipes. No pickle: a message holds plain data only (bytes, numbers,
strings, lists, maps).

Training process -> writer process (the writer's stdin): first a ``config`` message (the run
dir, the lease handed over, retention, the arena; the process's only argument is the descriptor
of its events pipe), then one ``snapshot`` message per checkpoint, sent once the slot's bytes
are copied (a reader never sees a torn snapshot: the message is the generation number, written
last), and ``close`` at the end.
Writer process -> training process (an inherited pipe): ``released`` (a slot may be reused),
``superseded`` (a snapshot replaced by a newer one), ``committed`` and ``failed``.
"""

from __future__ import annotations

import os
import signal
import struct
from typing import Any

import msgpack

_LENGTH = struct.Struct("<I")
# The writer process ends when the training process closes its stdin (or SIGKILL), never of a
# signal sent to the whole job (scancel's SIGTERM, Ctrl-C, SIGUSR1 to the process group): the
# training process needs it to commit its preemption checkpoint. It starts with them blocked and
# ignores them.
WRITER_IGNORED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


def encode_message(message: dict[str, Any]) -> bytes:
    """One framed message."""
    payload = msgpack.packb(message, use_bin_type=True)
    return _LENGTH.pack(len(payload)) + payload


def write_all(descriptor: int, data: bytes) -> None:
    """Write every byte (a pipe may take a large message in several writes)."""
    view = memoryview(data)
    while view:
        written = os.write(descriptor, view)
        view = view[written:]


class FrameReader:
    """Splits the bytes read from a pipe into messages."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """The messages completed by ``data`` (a partial one waits for the rest)."""
        self._buffer += data
        messages = []
        while len(self._buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer)
            end = _LENGTH.size + length
            if len(self._buffer) < end:
                break
            message = msgpack.unpackb(bytes(self._buffer[_LENGTH.size:end]), raw=False, strict_map_key=False)
            del self._buffer[:end]
            if isinstance(message, dict):
                messages.append(message)
        return messages
