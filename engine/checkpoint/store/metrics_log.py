"""``metrics.jsonl``: one JSON line per completed split, exactly once across restarts.

Lines are buffered and written at each checkpoint (and at the end); a checkpoint records the
file's committed length. On resume the file is cut back to that length, so lines of splits
that ran after the checkpoint, and will run again, are never duplicated.

With checkpoints on, lines reach the file only inside a commit, after the writer checked that it
still holds the lease (the fence): the training thread takes a :meth:`MetricsLog.snapshot`
(the length the file will have), the checkpoint writer calls :meth:`MetricsLog.write_until`
once its fence check passed, and checks the fence again itself after reading the file's
length, right before changing it. A writer that lost the lease therefore never appends. Bytes
found beyond this writer's own length (a torn append, or a stale writer's) are cut before
appending, by the writer that holds the lease.

On an object store (S3) an append rewrites the whole object, so a writer that lost the lease
between its fence check and its write could still replace the new holder's lines with its own
view of the file. There each write is a conditional ``PutObject``: the object is read with its
version (ETag), the fence is checked, and the new content is written only if the object is still
that version (``If-Match``). A stale writer's write then fails with WriterConflict and changes
nothing.

Loggers (``TrainerConfig.loggers``, engine.loggers) get every row as it is added, on the writer
rank only; at each start they are told what the file holds (nothing, or the rows the resumed
checkpoint committed) and at each snapshot they flush. Once a checkpoint committed the lines a
snapshot sealed, :meth:`MetricsLog.committed` tells them how many rows are committed (loggers
that cannot take a row back send only those); without checkpoints a row is committed as it is
added (:meth:`MetricsLog.rows_final_when_added`).

Where the lines go is a :class:`MetricsFile`: :class:`StoredMetricsFile` in the run dir, or
:class:`NullMetricsFile` for a process that writes none (no run dir, or a rank other than the
writer's), whose rows are final as they are added.
"""

from __future__ import annotations

import json
import threading
import warnings
from typing import Callable, Mapping, Protocol

from engine.checkpoint.store.storage import Storage
from engine.errors import CheckpointWriteError, WriterConflict
from engine.loggers.base import LoggerSet
from progress import Cursor

METRICS_FILE = "metrics.jsonl"
# Where each resume happened (one JSON row per resumed process). Kept out of metrics.jsonl so that
# file stays byte-identical to the one of a run that was never interrupted.
RESUMES_FILE = "resumes.jsonl"
_FLUSH_EVERY_LINES = 256


class MetricsLog:
    """The run's ``metrics.jsonl``; see the module docstring."""

    def __init__(self, storage: Storage | None, loggers: LoggerSet | None = None) -> None:
        self._file: MetricsFile = StoredMetricsFile(storage) if storage is not None else NullMetricsFile()
        self._loggers = loggers if loggers is not None else LoggerSet([])
        self._lines: list[str] = []          # the training thread's, since the last snapshot
        self._unwritten = bytearray()        # snapshotted, not yet in the file
        self.committed_bytes = 0             # the file's length as this writer left it
        self._lock = threading.Lock()        # snapshot (training thread) vs write (writer thread)
        self._fence: Callable[[], None] | None = None  # while a writer lease guards the file
        self._rows = 0                       # rows added, counted from the file's start
        self._sealed_rows: list[tuple[int, int]] = []  # (file length, rows) of each snapshot not yet committed
        self._rows_final = not self._file.kept   # no checkpoint will ever take a row back

    def rows_final_when_added(self) -> None:
        """No checkpoint commits the rows (a run without checkpoints): tell the loggers each row
        is committed as it is added."""
        self._rows_final = True

    def committed(self, metrics_bytes: int) -> None:
        """A checkpoint committed the file up to ``metrics_bytes``: tell the loggers how many
        rows that is (called by the checkpoint writer after each commit)."""
        with self._lock:
            done = [rows for length, rows in self._sealed_rows if length <= metrics_bytes]
            self._sealed_rows = [(length, rows) for length, rows in self._sealed_rows if length > metrics_bytes]
        if done and self._loggers:
            self._loggers.committed(done[-1])

    def fence_with(self, fence: Callable[[], None]) -> None:
        """From now on a writer lease guards the file: ``fence`` (it raises once the lease is
        lost) is checked before every change, and lines reach the file only through a flush or a
        checkpoint's commit. Call once the lease is held."""
        self._fence = fence

    def start_fresh(self) -> None:
        self._rows = 0
        self._loggers.start_fresh()
        self._file.start_fresh()
        self.committed_bytes = 0

    def roll_back_to(self, committed_bytes: int, resumed_step: int) -> None:
        """A rollback in the same process: drop the lines buffered since, and what was written
        after the checkpoint restored (at optimizer step ``resumed_step``; the replay writes them
        again), and tell the loggers."""
        with self._lock:
            self._lines.clear()
            self._unwritten.clear()
            self._sealed_rows.clear()
        self.resume_at(committed_bytes, resumed_step)

    def resume_at(self, committed_bytes: int, resumed_step: int = 0) -> None:
        """Drop whatever was written after the checkpoint being resumed (at optimizer step
        ``resumed_step``), and tell the loggers which rows it committed."""
        self.committed_bytes = self._file.cut_to(committed_bytes)
        self._rows = 0
        if self._loggers:
            rows = self._committed_rows()
            self._rows = len(rows)
            self._loggers.resume(rows, resumed_step)

    def _committed_rows(self) -> list[dict[str, object]]:
        """The rows the resumed checkpoint committed, for the loggers (a file that does not parse
        is a warning: the loggers are not worth stopping the resume for)."""
        if self.committed_bytes == 0:
            return []
        try:
            data = self._file.read(self.committed_bytes)
            return [json.loads(line) for line in data.decode().splitlines() if line.strip()]
        except (OSError, ValueError) as error:
            warnings.warn(f"the loggers cannot be given the rows of {METRICS_FILE} the checkpoint committed "
                          f"({type(error).__name__}: {error}); they start again from the resumed step", stacklevel=4)
            return []

    def append(self, cursor: Cursor, losses: list[float], optimizer_steps: int,
               logged: dict[str, float] | None = None) -> None:
        """The row of a completed training split."""
        record: dict[str, object] = {
            "stage": "train",
            "epoch": cursor.epoch,
            "batch": cursor.batch,
            "split": cursor.split,
            "loss": losses[0] if len(losses) == 1 else sum(losses),
            "step": optimizer_steps,
        }
        if len(losses) > 1:
            record["losses"] = losses
        if logged:
            record["metrics"] = logged
        self._add(record)

    def append_aggregate(self, stage: str, cursor: Cursor | None, optimizer_steps: int, values: dict[str, float]) -> None:
        """The row of a validation pass (``stage="val"``) or of a training epoch's aggregates
        (``stage="train_epoch"``), at the training position where it was computed."""
        record: dict[str, object] = {"stage": stage}
        if cursor is not None:
            record.update(epoch=cursor.epoch, batch=cursor.batch, split=cursor.split)
        record.update(step=optimizer_steps, metrics=values)
        self._add(record)

    def _add(self, record: dict[str, object]) -> None:
        if self._file.kept:
            self._lines.append(json.dumps(record))  # before the loggers see the row
        self._loggers.log_row(record)
        self._rows += 1
        if self._rows_final:
            self._loggers.committed(self._rows)
        if len(self._lines) >= _FLUSH_EVERY_LINES and self._fence is None:
            try:
                self.flush()
            except OSError:
                pass  # the lines stay buffered; the next flush reports the error

    def snapshot(self) -> int:
        """Seal the buffered lines for the next write; returns the length the file will have
        once they are written (what a checkpoint records as ``metrics_bytes``)."""
        self._loggers.flush()
        with self._lock:
            if self._lines:
                self._unwritten += ("\n".join(self._lines) + "\n").encode()
                self._lines.clear()
            length = self.committed_bytes + len(self._unwritten)
            if self._loggers and not self._rows_final:
                self._sealed_rows.append((length, self._rows))
            return length

    def write_until(self, length: int) -> None:
        """Append sealed bytes until the file is ``length`` long (page cache only: a checkpoint
        commit fsyncs the file in its own batch). Call after the fence check. On an error the
        bytes stay sealed, and the next call first cuts what a torn append left."""
        with self._lock:
            count = length - self.committed_bytes
            if count <= 0:
                return
            self._file.append_after(self.committed_bytes, bytes(self._unwritten[:count]), self._check_fence)
            del self._unwritten[:count]
            self.committed_bytes += count

    def _check_fence(self) -> None:
        if self._fence is not None:
            self._fence()

    def close_loggers(self) -> None:
        """``fit`` ends: close the loggers (after the last snapshot flushed them)."""
        self._loggers.close()

    def record_resume(self, checkpoint: str, cursor: Cursor | None, optimizer_steps: int, wall_time: float,
                      world_size_before: int | None = None, world_size: int = 1,
                      notes: Mapping[str, object] | None = None) -> None:
        """Append a row to resumes.jsonl: this process resumed from ``checkpoint`` (on another
        world size than it was written with: ``world_size_before`` -> ``world_size``), with
        ``notes`` (how the checkpoint was chosen) added to the row."""
        row: dict[str, object] = {"checkpoint": checkpoint, "step": optimizer_steps, "time": round(wall_time, 3)}
        if cursor is not None:
            row.update(epoch=cursor.epoch, batch=cursor.batch, split=cursor.split)
        if world_size_before is not None:
            row.update(world_size_before=world_size_before, world_size=world_size)
        row.update(notes or {})
        self._file.record_resume((json.dumps(row) + "\n").encode())

    def hand_over(self) -> bytes:
        """The sealed bytes not yet handed over, counted as written from now on: a writer
        process (engine.checkpoint.writers.process.writer) writes them, in its own :meth:`receive`."""
        with self._lock:
            data = bytes(self._unwritten)
            self._unwritten.clear()
            self.committed_bytes += len(data)
            return data

    def receive_at(self, base: int, data: bytes) -> None:
        """Sealed bytes handed over by the training process (:meth:`hand_over`), which start at
        ``base`` in the file. Where this log's own bytes end elsewhere, the training process
        rolled back (and cut the file there): start over at ``base``."""
        with self._lock:
            if base != self.committed_bytes + len(self._unwritten):
                self._unwritten.clear()
                self.committed_bytes = base
            self._unwritten += data

    def length_after_flush(self) -> int:
        """The file's length once every buffered line is written (what :meth:`snapshot`
        will return, computed without sealing anything)."""
        with self._lock:
            pending = sum(len(line.encode()) + 1 for line in self._lines)
            return self.committed_bytes + len(self._unwritten) + pending

    def flush(self) -> int:
        """Write every buffered line now (a run without checkpoints); returns the length."""
        length = self.snapshot()
        self._check_fence()
        self.write_until(length)
        return length


class MetricsFile(Protocol):
    """Where a :class:`MetricsLog`'s lines go."""

    # Whether the lines are kept (in the run dir, where a checkpoint's resume cuts them back).
    kept: bool

    def start_fresh(self) -> None:
        """A fresh run: empty the file."""

    def cut_to(self, committed_bytes: int) -> int:
        """A resume: drop what lies beyond ``committed_bytes``; returns the file's length after."""

    def read(self, limit: int) -> bytes:
        """The file's first ``limit`` bytes."""

    def append_after(self, length: int, data: bytes, check_fence: Callable[[], None]) -> None:
        """Append ``data`` where this writer's ``length`` bytes end, cutting whatever lies beyond
        them; ``check_fence`` is called after the file's state was read, right before changing it."""

    def record_resume(self, row: bytes) -> None:
        """Append a row to resumes.jsonl."""


class StoredMetricsFile:
    """``metrics.jsonl`` (and ``resumes.jsonl``) in the run dir ``storage``."""

    kept = True

    def __init__(self, storage: Storage) -> None:
        self._storage = storage

    def start_fresh(self) -> None:
        storage = self._storage
        if storage.exists(METRICS_FILE) and storage.size(METRICS_FILE) > 0:
            warnings.warn(f"starting a fresh run: {METRICS_FILE} of an earlier run in {storage.url} is replaced",
                          stacklevel=4)
        storage.write(METRICS_FILE, [], durable=False)

    def cut_to(self, committed_bytes: int) -> int:
        size = self._storage.size(METRICS_FILE) if self._storage.exists(METRICS_FILE) else 0
        if size < committed_bytes:
            warnings.warn(
                f"{METRICS_FILE} holds {size} bytes but the checkpoint recorded {committed_bytes}: "
                "lines written before the checkpoint are missing from it",
                stacklevel=4,
            )
            return size
        if size > committed_bytes:
            self._storage.truncate(METRICS_FILE, committed_bytes)
        return committed_bytes

    def read(self, limit: int) -> bytes:
        return self._storage.read(METRICS_FILE, limit=limit)

    def append_after(self, length: int, data: bytes, check_fence: Callable[[], None]) -> None:
        if self._storage.exclusive_create:
            self._replace_if_unchanged(length, data, check_fence)
        else:
            self._cut_and_append(length, data, check_fence)

    def record_resume(self, row: bytes) -> None:
        self._storage.append(RESUMES_FILE, row)

    def _cut_and_append(self, length: int, data: bytes, check_fence: Callable[[], None]) -> None:
        storage = self._storage
        size = storage.size(METRICS_FILE) if storage.exists(METRICS_FILE) else 0
        check_fence()  # after the read: what is cut beyond our length is a stale writer's
        if size > length:
            storage.truncate(METRICS_FILE, length)
        storage.append(METRICS_FILE, data)

    def _replace_if_unchanged(self, length: int, data: bytes, check_fence: Callable[[], None]) -> None:
        """Object stores: one conditional rewrite of the object (see the module docstring)."""
        storage = self._storage
        size, version = storage.version(METRICS_FILE)
        check_fence()  # after the read: the version read is still this writer's to replace
        if size < length:
            raise CheckpointWriteError(
                f"{METRICS_FILE} in {storage.url} holds {size} bytes, fewer than the {length} this "
                "writer wrote: it was changed outside this run; nothing was appended")
        if not storage.replace_prefix_if_unchanged(METRICS_FILE, length, data, version):
            raise WriterConflict(
                f"{METRICS_FILE} in {storage.url} changed while this writer appended to it: another writer took "
                "the run over; this writer changes nothing and stops")


class NullMetricsFile:
    """No file: a process that writes no metrics (no run dir, or not the writer rank)."""

    kept = False

    def start_fresh(self) -> None:
        pass

    def cut_to(self, committed_bytes: int) -> int:
        return committed_bytes

    def read(self, limit: int) -> bytes:
        return b""

    def append_after(self, length: int, data: bytes, check_fence: Callable[[], None]) -> None:
        pass

    def record_resume(self, row: bytes) -> None:
        pass
