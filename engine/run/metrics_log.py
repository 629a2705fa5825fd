"""``metrics.jsonl``: one JSON line per completed split, exactly once across restarts.

Lines are buffered and written at each checkpoint (and at the end); a checkpoint records the
file's committed length. On resume the file is cut back to that length, so lines of splits
that ran after the checkpoint, and will run again, are never duplicated.
"""

from __future__ import annotations

import json
import warnings

from engine.checkpoint.storage import Storage
from progress import Cursor

METRICS_FILE = "metrics.jsonl"
# Where each resume happened (one JSON row per resumed process). Kept out of metrics.jsonl so that
# file stays byte-identical to the one of a run that was never interrupted.
RESUMES_FILE = "resumes.jsonl"
_FLUSH_EVERY_LINES = 256


class MetricsLog:
    def __init__(self, storage: Storage | None) -> None:
        self._storage = storage
        self._buffer: list[str] = []
        self.committed_bytes = 0
        self._append_failed = False

    def start_fresh(self) -> None:
        if self._storage is None:
            return
        if self._storage.exists(METRICS_FILE) and self._storage.size(METRICS_FILE) > 0:
            warnings.warn(f"starting a fresh run: {METRICS_FILE} of an earlier run in {self._storage.url} is replaced", stacklevel=3)
        self._storage.write(METRICS_FILE, [], durable=False)
        self.committed_bytes = 0

    def resume_at(self, committed_bytes: int) -> None:
        """Drop whatever was written after the checkpoint being resumed."""
        self.committed_bytes = committed_bytes
        if self._storage is None:
            return
        size = self._storage.size(METRICS_FILE) if self._storage.exists(METRICS_FILE) else 0
        if size < committed_bytes:
            warnings.warn(
                f"{METRICS_FILE} holds {size} bytes but the checkpoint recorded {committed_bytes}: "
                "lines written before the checkpoint are missing from it",
                stacklevel=3,
            )
            self.committed_bytes = size
        elif size > committed_bytes:
            self._storage.truncate(METRICS_FILE, committed_bytes)

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
        if self._storage is None:
            return
        self._buffer.append(json.dumps(record))
        if len(self._buffer) >= _FLUSH_EVERY_LINES:
            try:
                self.flush()
            except OSError:
                pass  # the lines stay buffered; the next checkpoint's flush reports the error

    def record_resume(self, checkpoint: str, cursor: Cursor | None, optimizer_steps: int, wall_time: float) -> None:
        """Append a row to resumes.jsonl: this process resumed from ``checkpoint``."""
        if self._storage is None:
            return
        row: dict[str, object] = {"checkpoint": checkpoint, "step": optimizer_steps, "time": round(wall_time, 3)}
        if cursor is not None:
            row.update(epoch=cursor.epoch, batch=cursor.batch, split=cursor.split)
        self._storage.append(RESUMES_FILE, (json.dumps(row) + "\n").encode())

    def length_after_flush(self) -> int:
        """The file's committed length once the buffered lines are written."""
        return self.committed_bytes + sum(len(line.encode()) + 1 for line in self._buffer)

    def flush(self) -> int:
        """Write buffered lines (page cache only: a checkpoint commit fsyncs the file in its
        own batch); returns the written length in bytes."""
        if self._buffer and self._storage is not None:
            data = ("\n".join(self._buffer) + "\n").encode()
            if self._append_failed:
                # A failed append (ENOSPC, EIO) may have left part of a line behind.
                self._storage.truncate(METRICS_FILE, self.committed_bytes)
            self._append_failed = True
            self._storage.append(METRICS_FILE, data)
            self._append_failed = False
            self.committed_bytes += len(data)
        self._buffer.clear()
        return self.committed_bytes
