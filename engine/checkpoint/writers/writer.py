"""Checkpoint writers: synchronous, or in a background thread with bounded snapshots.

Both take an :class:`EncodedState` (see codec) and commit it through the store. Both check
the writer lease (the fence) before appending the checkpoint's metrics lines, again immediately
before the commit point, and before retention: a writer that lost the lease appends nothing,
commits nothing and deletes nothing. The background writer copies the
tensors into reusable buffers on the training thread (the only blocking part), then writes,
checksums and commits them in its own thread.

This module imports no torch: the writer process (engine.checkpoint.writers.process.main) commits through
:class:`SyncWriter` without it. :class:`~engine.checkpoint.writers.buffers.SnapshotBuffers`, on
the training side, imports torch where it uses it.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable

from engine.checkpoint.format.encoded_state import EncodedState
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.lease import WriterLease
from engine.checkpoint.store.metrics_log import MetricsLog
from engine.checkpoint.store.request import CheckpointFiles, CommitCallbacks, CommitRequest
from engine.checkpoint.store.retention import Retention
from engine.checkpoint.writers.buffers import SnapshotBuffers
from engine.checkpoint.writers.committer import Committer, SingleCommitter
from engine.checkpoint.writers.pending import PendingCheckpoint
from engine.checkpoint.writers.protocol import FastTierCommits
from engine.checkpoint.writers.worker import BackgroundWork, BackgroundWorker
from engine.errors import CheckpointError, CheckpointWriteError
from engine.watchdog import WRITER, abandon, mark as mark_phase, write_took

# How long a wait whose deadline passed with no job to abandon waits before it looks again.
_RECHECK_S = 0.05


class _WriterBase:
    """What both writers do with a pending checkpoint. ``committer`` is how this process takes
    part in the commit (default: alone; a distributed run's ranks: engine.distributed.commit)."""

    def __init__(self, store: CheckpointStore, lease: WriterLease | None, retention: Retention,
                 also_sync: Callable[[], list[str]], committer: Committer | None = None,
                 metrics: MetricsLog | None = None, tier: FastTierCommits | None = None) -> None:
        self.store = store
        self.committer: Committer = committer if committer is not None else SingleCommitter()
        # Publishes each checkpoint's metrics lines (a log without a file when none is given).
        self.metrics = metrics if metrics is not None else MetricsLog(None)
        self.lease = lease
        self.retention = retention
        self.also_sync = also_sync
        self.last_name: str | None = None
        # A fast local tier (engine.checkpoint.tiers.fast): commits go there first.
        self.tiers = tier

    def commit_one(self, pending: PendingCheckpoint) -> None:
        """One checkpoint's commit, in order: the fence (a writer that lost the lease appends
        nothing), this checkpoint's metrics lines, its data files staged, the other ranks' parts
        (a torchrun group's rank 0), the commit point (fenced again just before it), the fence
        once more (a writer fenced off after its commit point deletes nothing), retention. A rank
        that does not commit only writes its part (see Committer)."""
        request = self.committer.prepare(self.store, self._request(pending))
        callbacks = CommitCallbacks(fence=self._commit_fence(), on_data_written=lambda: self.release(pending))
        if not self.committer.commits:
            self.last_name = self.committer.write(self.store, pending, request, callbacks)
            return
        try:
            self._fence(callbacks)
            self.metrics.write_until(pending.metrics_bytes)
            if self.tiers is not None:  # a fast tier: committed there first, its own retention
                name = self._commit_to_tiers(pending, request, callbacks)
            else:
                name = self.committer.write(self.store, pending, dataclasses.replace(request, also_sync=self.also_sync()),
                                            callbacks)
                self._fence(callbacks)
                self.retention.apply(self.store, request.generation if self.lease is not None else None)
        except BaseException as error:
            self.committer.settle(self.store, error)
            raise
        self.committer.settle(self.store, name)
        if not self._still_writing():
            return  # abandoned while it committed: the writer that took over says what is committed
        self.last_name = name
        self.metrics.committed(pending.metrics_bytes)  # the loggers may send these rows now

    def _commit_fence(self) -> Callable[[], None] | None:
        """The fence of a commit made now: raises once this writer must not commit (nor delete)
        any more (the lease's check; None when there is no lease)."""
        return None if self.lease is None else self.lease.verify

    def _still_writing(self) -> bool:
        """Whether the calling thread still writes for this writer (see BackgroundWriter)."""
        return True

    def _request(self, pending: PendingCheckpoint) -> CommitRequest:
        return CommitRequest(CheckpointFiles.of_state(pending.encoded, pending.progress_bytes), pending.cursor,
                             self.lease.generation if self.lease is not None else 0, monitor=pending.monitor,
                             anchor=pending.anchor)

    @staticmethod
    def _fence(callbacks: CommitCallbacks) -> None:
        if callbacks.fence is not None:
            callbacks.fence()

    def _commit_to_tiers(self, pending: PendingCheckpoint, request: CommitRequest, callbacks: CommitCallbacks) -> str:
        """Commit to the fast tier (single process only: see RunCheckpointer), which makes the
        checkpoint durable in the run dir when due."""
        assert self.tiers is not None

        def write(store: CheckpointStore, sequence: int) -> str:
            return store.write(dataclasses.replace(request, sequence=sequence), callbacks)

        return self.tiers.commit(write, pending.durable, callbacks.fence, best_candidate=pending.monitor is not None)

    def release(self, pending: PendingCheckpoint) -> None:
        """The snapshot's tensors are no longer needed (their bytes are written)."""
        raise NotImplementedError


class SyncWriter(_WriterBase):
    """Writes on the calling thread."""

    def release(self, pending: PendingCheckpoint) -> None:
        pass

    def submit(self, pending: PendingCheckpoint, force: bool = False) -> bool:
        self.commit_one(pending)
        return True

    def check(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def background_work(self) -> BackgroundWork | None:
        """None: nothing runs beside training."""
        return None


class BackgroundWriter(_WriterBase, BackgroundWorker[PendingCheckpoint]):
    """Writes in a daemon thread. ``max_in_flight`` snapshots may hold buffers (queued, or
    being written until their files are); when none is free, ``when_behind="wait"`` blocks and
    ``"skip"`` replaces the oldest queued snapshot, or drops the new checkpoint when none can
    be replaced. A forced one (the last of a run or of a preemption, every one of a distributed
    run) always waits. One that records a monitored value (a candidate best checkpoint: its
    record belongs to its weights) is never dropped: it replaces a queued snapshot or waits; a
    queued snapshot that records a monitored value is never replaced."""

    def __init__(self, store: CheckpointStore, lease: WriterLease | None, retention: Retention,
                 also_sync: Callable[[], list[str]], max_in_flight: int, when_behind: str,
                 committer: Committer | None = None, metrics: MetricsLog | None = None,
                 tier: FastTierCommits | None = None, abandon_hung: bool = False) -> None:
        _WriterBase.__init__(self, store, lease, retention, also_sync, committer, metrics, tier)
        BackgroundWorker.__init__(self, threading.Condition(), "splitloop-checkpoint-writer")
        self._free = [SnapshotBuffers() for _ in range(max_in_flight)]
        self._queue: collections.deque[PendingCheckpoint] = collections.deque()
        self._when_behind = when_behind
        self._busy = False
        # The snapshot the thread writes (None while it is idle), and since when (time.monotonic()).
        self._current: PendingCheckpoint | None = None
        self._current_since = 0.0
        # on_io_error="warn" in a process alone: a wait past the watchdog's deadline abandons the
        # checkpoint the thread is stuck in and starts a new thread (see _abandon_locked).
        self._abandons = abandon_hung
        self.skipped = 0
        self.abandoned = 0
        self._start_thread()

    def submit(self, pending: PendingCheckpoint, force: bool = False) -> bool:
        """Snapshot and queue; returns False when the checkpoint was skipped."""
        self.check()
        pending.split = abandon.splits_done()
        with self._condition:
            while not self._free:
                # A forced one neither replaces a queued snapshot nor is dropped: a distributed
                # run's ranks must all write every checkpoint they agreed on.
                if self._when_behind == "skip" and not force:
                    if self._supersede_one_locked():
                        break
                    if pending.monitor is None:
                        self.skipped += 1
                        return False  # every snapshot is being written or must be: skip this one
                if self._wait_locked():
                    continue  # the stuck one's error is raised at the next check: this one goes on
                self._raise_pending_locked()
            buffers = self._free.pop()
        encoded = pending.encoded
        try:
            copies = buffers.capture(encoded.tensors, encoded.layout)
        except BaseException:
            with self._condition:
                self._free.append(buffers)
                self._condition.notify_all()
            raise
        pending.encoded = EncodedState(encoded.header, copies, encoded.layout, flat=buffers.flat)
        pending.buffers = buffers
        with self._condition:
            self._queue.append(pending)
            self._condition.notify_all()
        return True

    def _supersede_one_locked(self) -> bool:
        """Drop the oldest queued snapshot that records no monitored value, freeing its
        buffers; False when every queued one does (or none is queued)."""
        for index, queued in enumerate(self._queue):
            if queued.monitor is None:
                del self._queue[index]
                assert queued.buffers is not None  # a queued snapshot holds its buffers
                self._free.append(queued.buffers)
                queued.buffers = None
                self.skipped += 1
                return True
        return False

    def release(self, pending: PendingCheckpoint) -> None:
        """Hand the snapshot's buffers back as soon as its files are written, before the
        fsyncs, the rename and retention: the next snapshot waits less."""
        with self._condition:
            if pending.buffers is not None:
                self._free.append(pending.buffers)
                pending.buffers = None
                self._condition.notify_all()

    def _take_locked(self) -> PendingCheckpoint | None:
        if not self._queue:
            return None
        self._busy = True  # before the pop: wrote_since (lock-free) never sees neither
        self._current = self._queue.popleft()
        self._current_since = time.monotonic()
        return self._current

    def _run(self, pending: PendingCheckpoint) -> None:
        if pending.buffers is not None:
            pending.buffers.wait_until_copied()
        self.commit_one(pending)

    def _after(self, pending: PendingCheckpoint) -> None:
        self.release(pending)
        write_took(time.monotonic() - self._current_since)  # what a wait for this thread is timed by

    def _idle_locked(self) -> None:
        self._busy = False
        self._current = None

    # ---- a hung writer thread (on_io_error="warn") -------------------------------------------
    def _wait_locked(self) -> bool:
        """Wait (condition held) for the thread to free a snapshot or finish one. With
        ``abandon_hung`` and a watchdog, the wait ends at the watchdog's deadline for it, and the
        checkpoint the thread is stuck in is abandoned: True then."""
        # Timed from when the write it waits for began: that write is what may hang.
        mark_phase(WRITER, "the checkpoint writer thread", abandons=self._abandons,
                   since=self._current_since if self._current is not None else None)
        left = abandon.remaining() if self._abandons else None
        if left is None:
            self._condition.wait()
            return False
        if left > 0:
            self._condition.wait(left)
            return False
        if self._current is None:  # nothing being written (the thread is about to take the next)
            self._condition.wait(_RECHECK_S)
            return False
        self._abandon_locked(self._current)
        return True

    def _abandon_if_overdue_locked(self) -> None:
        """``when_behind="skip"`` never waits for the thread: at each check, abandon the
        checkpoint it has had for a wait's whole timeout (engine.watchdog.abandon.writer_timeout)."""
        stuck, limit = self._current, abandon.writer_timeout()
        if stuck is not None and limit is not None and time.monotonic() - self._current_since >= limit:
            self._abandon_locked(stuck, time.monotonic() - self._current_since)

    def _abandon_locked(self, stuck: PendingCheckpoint, writing_s: float | None = None) -> None:
        """The thread has not finished ``stuck`` by the deadline (a storage write that does not
        return: a thread in a system call cannot be stopped). Report it, count the checkpoint as
        not written (CheckpointWriteError at the next check, which ``on_io_error="warn"`` turns
        into a warning), give its buffers up to the stuck thread (a new set replaces them) and
        start a new thread for what is queued. The old thread, should it return, commits, deletes
        and publishes nothing: its fence fails (:meth:`_commit_fence`) and BackgroundWorker
        drops whatever it ends with."""
        thread = self._thread
        split = "?" if stuck.split is None else stuck.split
        detail = f"writer thread {thread.name} (tid {thread.native_id}), checkpoint of split {split}"
        abandon.report("the checkpoint it writes is abandoned (not written; on_io_error='warn'), a new writer thread "
                       "takes over and training goes on", detail, writing_s=writing_s)
        self.abandoned += 1
        if stuck.buffers is not None:  # the stuck thread may still read them
            stuck.buffers = None
            self._free.append(SnapshotBuffers())
        if self._error is None:
            self._error = CheckpointWriteError(
                f"the checkpoint of split {split} was abandoned: the writer thread {thread.name} (tid "
                f"{thread.native_id}) had not finished it within the watchdog's timeout (see hangs.jsonl)")
        self._replace_thread()

    def _commit_fence(self) -> Callable[[], None] | None:
        """The lease's fence, and a check that the calling thread was not abandoned."""
        lease_fence = _WriterBase._commit_fence(self)
        if not self._abandons:
            return lease_fence
        thread = threading.current_thread()

        def still_the_writer() -> None:
            if thread is not self._thread:
                raise CheckpointWriteError(f"the writer thread {thread.name} (tid {thread.native_id}) was abandoned "
                                           "as hung: it commits and deletes nothing")

        def fence() -> None:
            still_the_writer()
            if lease_fence is not None:
                lease_fence()  # (a read of the run dir: it may be what hangs)
                still_the_writer()
        return fence

    def _still_writing(self) -> bool:
        return self._is_current_thread()

    def background_work(self) -> BackgroundWork:
        """:meth:`wrote_since`: the writes compete with training."""
        return self.wrote_since

    def wrote_since(self, since: float) -> bool:
        """Whether a checkpoint was queued or being written at any moment after ``since`` (a
        ``time.monotonic()`` reading), given that nothing was submitted since then: whether a
        split that started at ``since`` overlapped a write. Lock-free (once per split): read in
        the reverse order of the writes in BackgroundWorker._work."""
        return bool(self._queue) or self._busy or self.last_end >= since

    def _raise_pending_locked(self) -> None:
        error = self._take_error_locked()
        if error is not None:
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointWriteError(f"background checkpoint write failed: {error}") from error

    def check(self) -> None:
        """Raise, on the training thread, an error the background writer met (and, with
        ``abandon_hung`` and ``when_behind="skip"``, abandon a checkpoint it is stuck in)."""
        if self._abandons and self._when_behind == "skip" and self._current is not None:
            with self._condition:
                self._abandon_if_overdue_locked()
        if self._error is not None:
            with self._condition:
                self._raise_pending_locked()

    def flush(self) -> None:
        """Wait until every queued snapshot is committed (or failed)."""
        with self._condition:
            while self._queue or self._busy:
                self._wait_locked()

    def close(self) -> None:
        self.flush()
        self._stop_thread()
        self.check()
