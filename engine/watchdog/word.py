"""The progress word: where a rank is, in a few bytes another thread or process reads without it.

One fixed-size record per rank (:data:`LAYOUT`): a sequence number written first and last (a
reader that finds them different read a torn record and reads again), the splits completed, the
phase code, the moving average of the rank's own work per split (engine.watchdog.stragglers), when the phase began (``CLOCK_MONOTONIC`` in ns: one clock for every process of the
node), the timeout the rank publishes for it (engine.watchdog.statistics), the phase's p50/p99,
the pid, the rank, flags, and a short detail (the writer's pid and checkpoint).

Where the records live (:mod:`engine.watchdog.board`): an anonymous mapping for one process,
files in ``/dev/shm`` shared by the ranks of a torchrun job on a node.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct

from engine.watchdog.phases import PHASES

LAYOUT = struct.Struct("<QqqddddiiiI96sQ")
SIZE = 256  # bytes per record (the layout, padded)
DETAIL_BYTES = 96

REPORTED = 1  # the rank's own monitor reported it hung (its stacks are in the report)
FINISHED = 2  # the rank's fit ended: its word no longer moves, and that is no hang
# The rank's checkpoint writer thread waits for other ranks in a collective (a commit's gather or
# announcement, the memory tier's peer copy): a rank waiting for that writer waits for others too.
WRITER_WAITS_FOR_PEERS = 4


@dataclasses.dataclass(frozen=True)
class Word:
    """One rank's record as read."""

    sequence: int
    splits: int
    started_ns: int
    timeout_s: float
    p50_s: float
    p99_s: float
    busy_s: float  # moving average of the time per split spent in the rank's own work (no waits)
    pid: int
    rank: int
    phase_code: int
    flags: int
    detail: str

    @property
    def phase(self) -> str:
        return PHASES[self.phase_code] if 0 <= self.phase_code < len(PHASES) else f"phase {self.phase_code}"

    def stalled_s(self, now_ns: int) -> float:
        """Seconds since the phase began."""
        return (now_ns - self.started_ns) / 1e9


def new_buffer() -> mmap.mmap:
    """An anonymous record, for a process that trains alone."""
    return mmap.mmap(-1, SIZE)


def write(buffer: mmap.mmap, word: Word) -> None:
    """Publish ``word`` in ``buffer`` (one copy: a concurrent reader sees a torn record as such)."""
    write_fields(buffer, word.sequence, word.splits, word.started_ns, word.timeout_s, word.p50_s, word.p99_s,
                 word.busy_s, word.pid, word.rank, word.phase_code, word.flags, encode_detail(word.detail))


def encode_detail(detail: str) -> bytes:
    return detail.encode("utf-8", "replace")[:DETAIL_BYTES]


def write_fields(buffer: mmap.mmap, sequence: int, splits: int, started_ns: int, timeout_s: float, p50_s: float,
                 p99_s: float, busy_s: float, pid: int, rank: int, phase_code: int, flags: int, detail: bytes) -> None:
    """:func:`write` without a :class:`Word` (the tracker publishes at every phase change: no
    object built each time); ``detail`` as :func:`encode_detail` gives it."""
    LAYOUT.pack_into(buffer, 0, sequence, splits, started_ns, timeout_s, p50_s, p99_s, busy_s, pid, rank, phase_code,
                     flags, detail, sequence)


def read(buffer: mmap.mmap | bytes, attempts: int = 100) -> Word | None:
    """The record in ``buffer``; None when it was never written (or stayed torn)."""
    for _ in range(attempts):
        (sequence, splits, started, timeout, p50, p99, busy, pid, rank, phase, flags, detail,
         closing) = LAYOUT.unpack_from(buffer, 0)
        if sequence == closing:
            if sequence == 0:
                return None
            return Word(sequence, splits, started, timeout, p50, p99, busy, pid, rank, phase, flags,
                        detail.rstrip(b"\0").decode("utf-8", "replace"))
    return None
