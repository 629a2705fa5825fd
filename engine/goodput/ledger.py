"""The writing side: one attempt's rows in its rank's ledger file (engine.goodput.rows).

Rows are written at phase changes and commits, never per split: per split the run pays one
clock read (:meth:`Ledger.beat_if_due`), which writes a ``beat`` row at most every
``beat_s`` seconds so that a killed attempt's last instant is known to within that. A row
that cannot be written costs the ledger a row, never the run (a warning). On a local run dir
each row is appended at once; elsewhere (object stores, where an append rewrites the object)
rows are kept and written together every ``beat_s`` and at phase changes.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from typing import Any, Iterable

from engine.goodput import clock, sample_ids
from engine.goodput.rows import (BEAT, COMMIT, END, RESTORED, SCHEMA_VERSION, START, TRAINING, VALIDATION,
                                 LedgerStorage, encode, rank_file, LEDGER_DIRECTORY)
from engine.errors import warn

BEAT_SECONDS = 1.0
OBJECT_STORE_BEAT_SECONDS = 10.0


class Ledger:
    """One attempt's ledger (``storage`` None: nothing is written). ``rank``/``world_size``: this
    process's place in its group."""

    def __init__(self, storage: LedgerStorage | None, rank: int, world_size: int,
                 beat_s: float | None = None) -> None:
        self._storage = storage
        self._file = rank_file(rank)
        self._rank, self._world_size = rank, world_size
        self._attempt = uuid.uuid4().hex[:16]
        self._seq = 0
        self._immediate = storage is not None and bool(getattr(storage, "is_local", False))
        self.beat_s = beat_s if beat_s is not None else (BEAT_SECONDS if self._immediate else OBJECT_STORE_BEAT_SECONDS)
        self._kept: list[bytes] = []
        self._next_beat = time.monotonic() + self.beat_s
        self._stall_s = 0.0  # blocking time of saves that committed nothing, carried to the next row
        self._prefix = b""

    @property
    def attempt(self) -> str:
        return self._attempt

    def started(self, group_ready: dict[str, float]) -> None:
        """The attempt is about to restore a checkpoint (or start fresh)."""
        if self._storage is None:
            return
        self._prefix = self._fresh_line_prefix()
        start_wall, start_mono = clock.process_start()
        imported_wall, imported_mono = clock.IMPORTED
        self._write(START, {"host": socket.gethostname(), "pid": os.getpid(), "rank": self._rank,
                            "world_size": self._world_size, "beat_s": self.beat_s,
                            "process_start": {"wall": start_wall, "mono": start_mono},
                            "imported": {"wall": max(imported_wall, start_wall), "mono": max(imported_mono, start_mono)},
                            "group_ready": group_ready}, flush=True)

    def restored(self, resumed_from: str | None, units: int, steps: int, epoch_samples: int | None,
                 id_kind: str) -> None:
        """The checkpoint is loaded (``resumed_from`` None: a fresh start) at ``units`` of step work."""
        self._write(RESTORED, {"resumed_from": resumed_from, "units": units, "steps": steps,
                               "epoch_samples": epoch_samples, "id_kind": id_kind}, flush=True)

    def training(self) -> None:
        self._write(TRAINING, {}, flush=True)

    def commit(self, written: bool, blocking_s: float, units: int, epochs: int, steps: int,
               drawn: Iterable[tuple[int, list[int]]]) -> None:
        """A save at the boundary ``units``/``epochs`` blocked training for ``blocking_s``;
        ``written``: it committed (or queued) a checkpoint holding the batches ``drawn``."""
        if not written:
            self._stall_s += blocking_s
            return
        stall, self._stall_s = self._stall_s + blocking_s, 0.0
        self._write(COMMIT, {"blocking_s": stall, "units": units, "epochs": epochs, "steps": steps,
                             "ids": sample_ids.encode(drawn)}, flush=False)

    def validated(self, seconds: float) -> None:
        self._write(VALIDATION, {"seconds": seconds}, flush=False)

    def beat_if_due(self, units: int) -> None:
        """Per split: a ``beat`` row when ``beat_s`` passed since the last one (one clock read)."""
        now = time.monotonic()
        if now < self._next_beat:
            return
        self._next_beat = now + self.beat_s
        self._write(BEAT, {"units": units}, flush=False)
        if self._kept:
            self._flush()

    def ended(self, cause: str, flush_s: float, units: int, error: str | None = None,
              committed_units: int | None = None, drawn: Iterable[tuple[int, list[int]]] = ()) -> None:
        """The attempt ends by ``cause`` after ``flush_s`` waiting for its checkpoint writes.
        ``committed_units``/``drawn``: a checkpoint the exception path committed, and the batches it holds."""
        self._write(END, {"cause": cause, "flush_s": flush_s + self._stall_s, "units": units, "error": error,
                          "committed_units": committed_units, "ids": sample_ids.encode(drawn)}, flush=True)

    def _write(self, event: str, fields: dict[str, Any], flush: bool) -> None:
        if self._storage is None:
            return
        row = {"v": SCHEMA_VERSION, "attempt": self._attempt, "seq": self._seq, "event": event, **clock.now(), **fields}
        self._seq += 1
        self._kept.append(encode(row))
        if flush or self._immediate:
            self._flush()

    def _flush(self) -> None:
        assert self._storage is not None
        data, self._kept = self._prefix + b"".join(self._kept), []
        try:
            self._storage.append(self._file, data)
            self._prefix = b""
        except Exception as error:  # noqa: BLE001 - any storage failure; the ledger must not end the run
            warn(f"could not append to the goodput ledger {self._file}: {type(error).__name__}: {error}")

    def _fresh_line_prefix(self) -> bytes:
        """A newline when the file's last line was cut short by a kill, so that the first row
        of this attempt starts on a line of its own."""
        assert self._storage is not None
        try:
            self._storage.makedirs(LEDGER_DIRECTORY)
            if not self._storage.exists(self._file):
                return b""
            data = self._storage.read(self._file)
        except Exception as error:  # noqa: BLE001
            warn(f"could not read the goodput ledger {self._file}: {type(error).__name__}: {error}")
            return b"\n"
        return b"\n" if data and not data.endswith(b"\n") else b""
