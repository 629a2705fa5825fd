"""A run's checkpointing: when to save, the writer lease, the (a)synchronous writer, and what
to do when a write fails."""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable

from engine.checkpoint.codec import encode_state
from engine.checkpoint.lease import WriterLease
from engine.checkpoint.store import CheckpointStore
from engine.checkpoint.writer import BackgroundWriter, PendingCheckpoint, SyncWriter
from engine.config import CheckpointConfig
from engine.errors import CheckpointWriteError, WriterConflict
from engine.run.metrics_log import METRICS_FILE, MetricsLog
from engine.checkpoint.storage import Storage
from progress import Cursor


class RunCheckpointer:
    def __init__(self, storage: Storage, policy: CheckpointConfig, metrics: MetricsLog) -> None:
        self.store = CheckpointStore(storage)
        self.policy = policy
        self._storage = storage
        self._metrics = metrics
        self._lease = WriterLease(storage)
        self._writer: SyncWriter | BackgroundWriter | None = None
        self._last_save_time = time.monotonic()
        self._steps_at_last_save = 0

    @property
    def last_name(self) -> str | None:
        return None if self._writer is None else self._writer.last_name

    def acquire(self) -> None:
        """Take the writer lease (WriterConflict if another live process holds it) and clean
        up what crashed writers left. Call before reading checkpoints to resume."""
        self._lease.acquire(minimum_generation=self.store.newest_generation())
        self.store.remove_temporaries()

    def start(self, optimizer_steps: int) -> None:
        """Start the writer (after any resume)."""
        self._steps_at_last_save = optimizer_steps
        also_sync = (lambda: [METRICS_FILE]) if self._storage.is_local else (lambda: [])
        if self.policy.asynchronous:
            self._writer = BackgroundWriter(self.store, self._lease, self.policy.keep_last, also_sync,
                                            self.policy.max_in_flight, self.policy.when_behind)
        else:
            self._writer = SyncWriter(self.store, self._lease, self.policy.keep_last, also_sync)

    def due(self, units_completed: int, optimizer_steps: int) -> bool:
        """Whether the policy asks for a checkpoint at this split boundary."""
        policy = self.policy
        if policy.every_n_splits is not None and units_completed % policy.every_n_splits == 0:
            return True
        if policy.every_n_steps is not None and optimizer_steps // policy.every_n_steps > self._steps_at_last_save // policy.every_n_steps:
            return True
        return policy.every_seconds is not None and time.monotonic() - self._last_save_time >= policy.every_seconds

    def save(self, state_tree_for: Callable[[int], dict[str, Any]], progress_bytes: bytes, cursor: Cursor | None,
             optimizer_steps: int, force: bool) -> bool:
        """Flush metrics.jsonl, then commit (or queue) the checkpoint built by
        ``state_tree_for(committed metrics bytes)``; False when it was skipped or failed under
        ``on_io_error="warn"``."""
        try:
            committed_bytes = self._metrics.flush()
            pending = PendingCheckpoint(encode_state(state_tree_for(committed_bytes)), progress_bytes, cursor)
            written = self._writer.submit(pending, force=force)
        except WriterConflict:
            raise
        except (CheckpointWriteError, OSError) as error:
            self._handle_io_error(error)
            return False
        if written:
            self._last_save_time = time.monotonic()
            self._steps_at_last_save = optimizer_steps
        return written

    def check(self) -> None:
        """Surface a background write error on the training thread."""
        if self._writer is None:
            return
        self._lease.heartbeat_if_due()
        try:
            self._writer.check()
        except WriterConflict:
            raise
        except CheckpointWriteError as error:
            self._handle_io_error(error)

    def _handle_io_error(self, error: BaseException) -> None:
        if self.policy.on_io_error == "raise":
            if isinstance(error, CheckpointWriteError):
                raise error
            raise CheckpointWriteError(f"checkpoint not written: {error}; earlier checkpoints are intact") from error
        warnings.warn(f"checkpoint not written, training goes on (on_io_error='warn'): {error}", stacklevel=4)

    def close(self, failing: bool) -> None:
        """Flush pending writes and release the lease. With ``failing`` (an exception is on its
        way up) write errors become warnings so they do not hide the original one."""
        try:
            if self._writer is not None:
                self._writer.close()
        except (WriterConflict, CheckpointWriteError) as error:
            if failing:
                warnings.warn(f"pending checkpoint write failed while stopping: {error}", stacklevel=3)
            elif isinstance(error, WriterConflict):
                raise
            else:
                self._handle_io_error(error)
        finally:
            self._lease.release()
