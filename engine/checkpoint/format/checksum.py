"""Checksums of checkpoint files.

New checkpoints record CRC-32C (Castagnoli), computed by the ``crc32c`` package with the CPU's
CRC instruction where there is one (SSE 4.2 on x86-64, the CRC extension on ARMv8) and its own
table-driven code elsewhere, without holding the GIL on large buffers: about 4-6x zlib's
CRC-32 on the machines we measured, which matters when a 300 MB state is checksummed every
split (docs/performance.md). Checkpoints written before recorded zlib's CRC-32; a manifest names
the algorithm of each file (its record's key), and both verify.
"""

from __future__ import annotations

import zlib
from typing import BinaryIO, Callable, Iterable

import crc32c

CRC32C = "crc32c"
CRC32 = "crc32"
# The algorithm new checkpoints use.
DEFAULT = CRC32C
ALGORITHMS: dict[str, Callable[..., int]] = {CRC32C: crc32c.crc32c, CRC32: zlib.crc32}


def checksum(chunks: Iterable[bytes | bytearray | memoryview], algorithm: str = DEFAULT) -> int:
    """The checksum of the concatenated ``chunks``."""
    update = ALGORITHMS[algorithm]
    value = 0
    for chunk in chunks:
        value = update(chunk, value)
    return value


def updater(algorithm: str = DEFAULT) -> Callable[..., int]:
    """``update(chunk, value) -> value``, to checksum while writing."""
    return ALGORITHMS[algorithm]


def write_chunks(handle: BinaryIO, chunks: Iterable[bytes | memoryview], checksum: bool) -> tuple[int, int]:
    """Write ``chunks`` to the open file ``handle``; (size, CRC-32C), the CRC 0 without ``checksum``."""
    size = 0
    crc = 0
    update = updater()
    for chunk in chunks:
        handle.write(chunk)
        if checksum:
            crc = update(chunk, crc)
        size += len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
    return size, crc
