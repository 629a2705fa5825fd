"""Checkpoint writers: synchronous, or in a background thread with bounded snapshots.

Both take an :class:`EncodedState` (see codec) and commit it through the store. Both check
the writer lease (the fence) before appending the checkpoint's metrics lines, again immediately
before the commit point, and before retention: a writer that lost the lease appends nothing,
commits nothing and deletes nothing. The background writer copies the
tensors into reusable buffers on the training thread (the only blocking part), then writes,
checksums and commits them in its own thread.

This module imports no torch: the writer process (engine.checkpoint.writer_main) commits through
:class:`SyncWriter` without it. :class:`SnapshotBuffers`, on the training side, imports torch
where it uses it.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import TYPE_CHECKING, Callable

from engine.checkpoint.commit import CheckpointFiles, CommitRequest, Committer, SingleCommitter
from engine.checkpoint.encoded_state import EncodedState
from engine.checkpoint.lease import WriterLease
from engine.checkpoint.manifest import MonitorRecord
from engine.checkpoint.retention import Retention
from engine.checkpoint.store import CheckpointStore
from engine.checkpoint.tiers import TierWriter
from engine.checkpoint.worker import BackgroundWorker
from engine.errors import CheckpointError, CheckpointWriteError
from progress import Cursor

if TYPE_CHECKING:
    import torch

    from engine.checkpoint.metrics_log import MetricsLog
    from engine.checkpoint.snapshot_buffer import BulkCopy, StructureKey


@dataclasses.dataclass
class PendingCheckpoint:
    encoded: EncodedState
    progress_bytes: bytes
    cursor: Cursor | None
    buffers: "SnapshotBuffers | None" = None
    # The length metrics.jsonl has once the lines this checkpoint counts are appended (after
    # the fence, by the writer's metrics log); 0: none to publish.
    metrics_bytes: int = 0
    # With a fast tier: whether this checkpoint must also reach the durable tier.
    durable: bool = True
    # The monitored metric's fresh value this checkpoint is taken for (best checkpoints).
    monitor: MonitorRecord | None = None
    # Resumable on another world size (the manifest's ``anchor``).
    anchor: bool = False
    # A distributed run's digest of its replicated state (compared across ranks at commit).
    digest: dict[str, int] | None = None


class SnapshotBuffers:
    """One CPU buffer laid out as tensors.bin, reused from one snapshot to the next
    (reallocated only when the layout changes, e.g. a hidden state appearing after the first
    split). The tensors are copied into their typed views of the buffer in bulk
    (engine.checkpoint.snapshot_buffer: one ``torch._foreach_copy_``, not one call per tensor),
    so that the writer writes and checksums one contiguous chunk, padding included (zeros,
    never written).

    A CUDA tensor is copied into a *pinned* buffer with a non-blocking copy, and a CUDA event is
    recorded after the copies on the stream that runs them: the training thread only launches
    the copies, and the next optimizer step, queued behind them on the same stream, cannot
    change a tensor before it is copied. The writer thread calls :meth:`wait_until_copied`
    before it reads the buffers. CPU tensors are copied synchronously, as before."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._key: StructureKey | None = None
        self._copy: BulkCopy | None = None
        self._cuda_devices: set[torch.device] = set()
        self._copied: list[torch.cuda.Event] = []

    @property
    def flat(self) -> torch.Tensor | None:
        """The buffer of the last :meth:`capture` (None before the first)."""
        return self._flat

    def capture(self, tensors: list[torch.Tensor], layout: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Copy ``tensors`` into the buffer at ``layout``'s (offset, nbytes); their views."""
        # Imported here, as torch in _allocate: the writer process imports this module without torch.
        from engine.checkpoint.snapshot_buffer import BulkCopy, structure_key

        # The layout follows from the dtypes and shapes (engine.checkpoint.codec.encode_state).
        key = structure_key(tensors)
        if key != self._key or self._copy is None:
            self._key, self._copy = None, None  # an allocation that fails leaves no half layout behind
            from_cuda = key[2]
            self._allocate(tensors, layout, pinned=any(from_cuda))
            self._copy = BulkCopy(self._views, from_cuda)
            self._cuda_devices = {tensor.device for tensor in tensors if tensor.is_cuda}
            self._key = key
        self._copy.copy(tensors)
        self._copied = [self._record_event(device) for device in self._cuda_devices]
        return list(self._views)

    def _allocate(self, tensors: list[torch.Tensor], layout: list[tuple[int, int]], pinned: bool) -> None:
        import torch

        total = layout[-1][0] + layout[-1][1] if layout else 0
        self._flat = None  # the old buffer may be large: free it before allocating the new one
        flat = torch.zeros(total, dtype=torch.uint8, pin_memory=pinned)
        self._views = [flat[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
                       for tensor, (offset, nbytes) in zip(tensors, layout)]
        self._flat = flat

    @staticmethod
    def _record_event(device: torch.device) -> torch.cuda.Event:
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def wait_until_copied(self) -> None:
        """Block until the device-to-host copies of the last :meth:`capture` are done."""
        for event in self._copied:
            event.synchronize()
        self._copied = []


class _WriterBase:
    """What both writers do with a pending checkpoint. ``committer`` is how this process takes
    part in the commit (default: alone; a distributed run's ranks: engine.distributed.commit)."""

    def __init__(self, store: CheckpointStore, lease: WriterLease | None, retention: Retention,
                 also_sync: Callable[[], list[str]], committer: Committer | None = None,
                 metrics: "MetricsLog | None" = None) -> None:
        self.store = store
        self.committer: Committer = committer if committer is not None else SingleCommitter()
        self.metrics = metrics  # publishes each checkpoint's metrics lines
        self.lease = lease
        self.retention = retention
        self.also_sync = also_sync
        self.last_name: str | None = None
        # Set for a fast local tier (engine.checkpoint.tiers): commits go there first.
        self.tiers: TierWriter | None = None

    def commit(self, pending: PendingCheckpoint) -> None:
        """Write ``pending`` and take part in its commit (see Committer)."""
        request = self.committer.prepare(self.store, self._request(pending))
        if not self.committer.commits:
            self.last_name = self.committer.write(self.store, pending, request)
            return
        try:
            name = self._commit_as_writer(pending, request)
        except BaseException as error:
            self.committer.settle(self.store, error)
            raise
        self.committer.settle(self.store, name)
        self.last_name = name
        if self.metrics is not None:
            self.metrics.committed(pending.metrics_bytes)  # the loggers may send these rows now

    def _request(self, pending: PendingCheckpoint) -> CommitRequest:
        return CommitRequest(CheckpointFiles.of_state(pending.encoded, pending.progress_bytes), pending.cursor,
                             self.lease.generation if self.lease is not None else 0,
                             on_data_written=lambda: self.release(pending),
                             fence=self.lease.verify if self.lease is not None else None, monitor=pending.monitor,
                             anchor=pending.anchor)

    def _commit_as_writer(self, pending: PendingCheckpoint, request: CommitRequest) -> str:
        """Fence, publish the metrics lines, write and commit, apply retention; the name."""
        fence = request.fence
        if fence is not None:
            fence()
        if self.metrics is not None:
            self.metrics.write_until(pending.metrics_bytes)
        if self.tiers is not None:  # a fast local tier (single process only: see RunCheckpointer)
            def write(store: CheckpointStore, sequence: int) -> str:
                return store.write(dataclasses.replace(request, sequence=sequence))

            return self.tiers.commit(write, pending.durable, fence, best_candidate=pending.monitor is not None)
        request = dataclasses.replace(request, also_sync=self.also_sync())
        name = self.committer.write(self.store, pending, request)
        if fence is not None:
            fence()  # a writer fenced off after its commit point deletes nothing
        self.retention.apply(self.store, request.generation if self.lease is not None else None)
        return name

    def release(self, pending: PendingCheckpoint) -> None:
        """The snapshot's tensors are no longer needed (their bytes are written)."""
        raise NotImplementedError


class SyncWriter(_WriterBase):
    """Writes on the calling thread."""

    def release(self, pending: PendingCheckpoint) -> None:
        pass

    def submit(self, pending: PendingCheckpoint, force: bool = False) -> bool:
        self.commit(pending)
        return True

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass


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
                 committer: Committer | None = None, metrics: "MetricsLog | None" = None) -> None:
        _WriterBase.__init__(self, store, lease, retention, also_sync, committer, metrics)
        BackgroundWorker.__init__(self, threading.Condition(), "splitloop-checkpoint-writer")
        self._free = [SnapshotBuffers() for _ in range(max_in_flight)]
        self._queue: collections.deque[PendingCheckpoint] = collections.deque()
        self._when_behind = when_behind
        self._busy = False
        self.skipped = 0
        self._start_thread()

    def submit(self, pending: PendingCheckpoint, force: bool = False) -> bool:
        """Snapshot and queue; returns False when the checkpoint was skipped."""
        self.check()
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
                self._condition.wait()
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
        return self._queue.popleft()

    def _run(self, pending: PendingCheckpoint) -> None:
        if pending.buffers is not None:
            pending.buffers.wait_until_copied()
        self.commit(pending)

    def _after(self, pending: PendingCheckpoint) -> None:
        self.release(pending)

    def _idle_locked(self) -> None:
        self._busy = False

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
        """Raise, on the training thread, an error the background writer met."""
        if self._error is not None:
            with self._condition:
                self._raise_pending_locked()

    def flush(self) -> None:
        """Wait until every queued snapshot is committed (or failed)."""
        with self._condition:
            while self._queue or self._busy:
                self._condition.wait()

    def close(self) -> None:
        self.flush()
        self._stop_thread()
        self.check()
