"""A run's checkpointing policy: every "when" and "which" decision about checkpoints.

When to save (split cadence, epoch end), which checkpoint to resume from, the writer lease,
the (a)synchronous writer, and what to do when a write fails. The run hands it snapshots
(:class:`~engine.checkpoint.checkpointing.Snapshot`, e.g. engine.run.state.RunSnapshot); it never
calls back into the run.

What varies is chosen once, in the constructor: the cadence (engine.checkpoint.cadence: fixed or
"auto"), the tiering (engine.checkpoint.tiers.tiering: one tier or two) and this process's side of the
commit (:class:`CommitSide`: alone, or one rank of a torchrun group). The choice of the
checkpoint to resume from is engine.checkpoint.resume_choice's.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Callable, Protocol

from engine.checkpoint.cadence import Cadence, choose_cadence
from engine.checkpoint.checkpointing import BoundaryMark, Snapshot
from engine.checkpoint.format.codec import EncodedState, encode_state
from engine.checkpoint.format.manifest import MonitorRecord
from engine.checkpoint.plan import CheckpointPlan
from engine.checkpoint.resume_choice import (AUTOMATIC, AnchorFallback, choose_checkpoint, fall_back_to_anchor,
                                             newer_than, record_abandoned)
from engine.checkpoint.store.abandoned import read_abandoned
from engine.checkpoint.store.checkpoint_store import CheckpointStore, LoadedCheckpoint, StateValidator
from engine.checkpoint.store.lease import WriterLease
from engine.checkpoint.store.metrics_log import METRICS_FILE, MetricsLog
from engine.checkpoint.store.retention import Retention
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.tiers.node import NodeTier
from engine.checkpoint.tiers.tiering import Tiering, choose_tiering
from engine.checkpoint.writers.choice import WriterParts, choose_writer
from engine.checkpoint.writers.committer import Committer
from engine.checkpoint.writers.pending import PendingCheckpoint
from engine.checkpoint.writers.protocol import Writer
from engine.checkpoint.writers.worker import BackgroundWork
from engine.errors import CheckpointWriteError, WriterConflict
from progress import Cursor


class RunCheckpointer:
    """A run's checkpoints (see the module docstring): its cadence (fixed or automatic) and its
    tiering (one tier or two) are objects chosen here, once."""

    def __init__(self, storage: Storage, plan: CheckpointPlan, metrics: MetricsLog,
                 group: RankGroup | None = None) -> None:
        plan.refuse_where(distributed=group is not None, run_dir_url=storage.url, run_dir_is_local=storage.is_local)
        self.store = CheckpointStore(storage)
        # A torchrun job's memory tier: every rank's committer writes into node memory first.
        node = None if group is None else group.node_tier
        # A distributed run: rank 0 holds the one lease of the job and commits (engine.distributed).
        self._group = group
        self._side: CommitSide = _Alone() if group is None else _InGroup(group)
        self.plan = plan
        self._storage = storage
        self._metrics = metrics
        # The writer, chosen once: synchronous, a background thread or a writer process.
        self._writer_kind = choose_writer(plan.writer.kind)
        self._lease = WriterLease(storage, stale_after=plan.writer.lease_expiry_seconds,
                                  uses_writer_process=self._writer_kind.uses_process)
        self._writer: Writer | None = None
        self._mark_of_last_save: BoundaryMark | None = None
        self._fresh_monitor: MonitorRecord | None = None
        self._cadence: Cadence = choose_cadence(plan.cadence)
        self._resumed_name: str | None = None
        # Set by select() on rank 0 when "auto" went back to an anchor (another world size).
        self.anchor_fallback: AnchorFallback | None = None
        self._tiering: Tiering = choose_tiering(plan.tiers, storage, self.store, node)

    @property
    def last_name(self) -> str | None:
        return None if self._writer is None else self._writer.last_name

    def acquire(self) -> None:
        """Take the writer lease (WriterConflict if another live process holds it) and clean
        up what crashed writers left. Call before reading checkpoints to resume."""
        if self._side.is_writer:
            self._lease.acquire(minimum_generation=self.store.newest_generation(),
                                committed_sequence=self._takeover_sequence)
            self._metrics.fence_with(self._lease.verify)
            self.store.remove_temporaries()
            self._tiering.claim(self._lease)
        if self._side.is_writer or self._group is not None:  # under torchrun, every rank has its writer process
            self._writer_kind.launch(self._storage, self._lease)
        self._side.after_acquire(self.store)

    def _takeover_sequence(self) -> int:
        """The highest sequence committed when this writer takes the lease over (its takeover
        fence), across the tiers."""
        return self._tiering.takeover_sequence(self.store.newest_committed_sequence(), self._lease)

    def select(self, resume: str, validate: StateValidator,
               needs_an_anchor: Callable[[LoadedCheckpoint], bool] | None = None) -> LoadedCheckpoint | None:
        """The checkpoint to resume from (``resume`` as in ``Trainer.fit``), or None to start
        fresh. "auto"/"latest" take the newest that verifies and whose state passes
        ``validate``; a run dir whose every checkpoint is invalid is refused, never restarted
        silently. When ``needs_an_anchor`` says the newest cannot be resumed where it stands
        (another world size, inside a batch), they take the newest anchor instead and record
        the fallback in :attr:`anchor_fallback` (engine.checkpoint.resume_choice)."""
        choose = functools.partial(self._select, resume, validate, needs_an_anchor)
        loaded = self._side.select(choose, self.store, validate, newest_wanted=resume in AUTOMATIC)
        self._resumed_name = None if loaded is None else loaded.name
        return loaded

    def select_with(self, choose: Callable[[], LoadedCheckpoint | None],
                    validate: StateValidator) -> LoadedCheckpoint | None:
        """The checkpoint ``choose()`` picks (on rank 0 of a distributed run, the others load
        the same one and take their own part), or None."""
        return self._side.select(choose, self.store, validate)

    def _select(self, resume: str, validate: StateValidator,
                needs_an_anchor: Callable[[LoadedCheckpoint], bool] | None) -> LoadedCheckpoint | None:
        stores = self._tiering.stores()
        loaded = choose_checkpoint(resume, validate, stores, self._storage)
        if loaded is None or needs_an_anchor is None or resume not in AUTOMATIC:
            return loaded
        loaded, self.anchor_fallback = fall_back_to_anchor(loaded, stores, validate, self._storage, needs_an_anchor)
        return loaded

    def abandon_newer_than(self, name: str) -> list[str]:
        """Resuming by name from ``name``: record the checkpoints newer than it as abandoned
        (engine.checkpoint.store.abandoned) before any commit; returns their names, oldest first."""
        newer = newer_than(name, self._tiering.stores())
        if self._side.is_writer:
            record_abandoned(self._storage, name, newer)
        return newer

    def existing_names(self) -> list[str]:
        """The names of the checkpoints committed to the run dir, oldest first."""
        return sorted(self.store.committed_names())

    def start(self, optimizer_steps: int, resumed_mark: BoundaryMark | None) -> None:
        """Start the writer (after any resume); ``resumed_mark`` is the boundary of the
        checkpoint resumed from, which therefore needs no new checkpoint."""
        self._mark_of_last_save = resumed_mark
        if self._resumed_name is not None and not self._tiering.holds_durably(self._resumed_name):
            # Resumed from a checkpoint only the fast tier holds (its copy to the durable tier
            # died with the process): the boundary is not held durably, so the run's last
            # checkpoint is written again even at this boundary, and reaches the durable tier.
            self._mark_of_last_save = None
        units = resumed_mark[0] if resumed_mark is not None else 0
        also_sync = (lambda: [METRICS_FILE]) if self._storage.is_local else (lambda: [])
        kept, writer = self.plan.retention, self.plan.writer
        abandoned = read_abandoned(self._storage) if self._side.is_writer else frozenset()
        retention = Retention(kept.keep_last, kept.keep_best, kept.monitor, abandoned)
        tier = self._tiering.start(retention, also_sync, self._lease, units)
        # A hung writer is abandoned under "warn" in a process alone; under torchrun it stays a hang
        # of the group (the ranks' writers commit together: docs/faults.md, "A hung writer").
        abandon_hung = writer.on_io_error == "warn" and self._group is None
        self._writer = self._writer_kind.build(WriterParts(self.store, self._storage, self._lease, retention, also_sync,
                                                           self._metrics, self._group, tier, writer.max_in_flight,
                                                           writer.when_behind, abandon_hung,
                                                           None if self._group is None else self._group.writer_process_spec))
        self._cadence.start(optimizer_steps, units, self._background_work())

    def _background_work(self) -> BackgroundWork | None:
        """What tells "auto" whether a split overlapped background checkpoint work: the
        background writer's writes, and the tiers' own work (both compete with training).
        None when nothing runs in the background."""
        writes = None if self._writer is None else self._writer.background_work()
        detectors = [detector for detector in (writes, self._tiering.background_work()) if detector is not None]
        if len(detectors) < 2:
            return detectors[0] if detectors else None
        wrote_since, copied_since = detectors
        return lambda since: wrote_since(since) or copied_since(since)

    def holds(self, mark: BoundaryMark) -> bool:
        """Whether the last checkpoint saved (or resumed from) was taken at boundary ``mark``."""
        return self._mark_of_last_save == mark

    @property
    def checkpoint_interval(self) -> int | None:
        """Splits between checkpoints: the one "auto" reached, the configured one, or None."""
        return self._cadence.interval

    @property
    def auto_interval(self) -> int | None:
        """The interval ``every_n_splits="auto"`` chose so far (None without "auto")."""
        return self._cadence.auto_interval

    def due_at_epoch_end(self, asked: bool = False) -> bool:
        """Whether a checkpoint is due after this epoch's end-of-epoch work: the run ``asked``
        for one (to stop), the policy asks for one after each epoch, or the epoch end produced a
        monitored value (its record belongs to a checkpoint of this boundary's weights, see
        :meth:`offer_metrics`)."""
        return asked or self.plan.cadence.at_epoch_end or self._fresh_monitor is not None

    def due_at_split(self, units_completed: int, optimizer_steps: int, asked: bool = False) -> bool:
        """Whether a checkpoint is due at this split boundary: the run ``asked`` for one (to
        stop, or after a validation; the cadence then does not time this split), or the
        cadence says so."""
        return asked or self._cadence.due_at_split(units_completed, optimizer_steps)

    def offer_metrics(self, values: dict[str, float]) -> None:
        """New metric values were produced (a validation pass, an epoch's aggregates) at the
        current boundary: the checkpoint saved at this boundary records the monitored one, which
        makes it a candidate best checkpoint. The record belongs to that checkpoint only: the
        next :meth:`save` takes it whatever becomes of it, so it never lands on later weights."""
        monitor = self.plan.retention.monitor
        if monitor is not None and monitor in values and math.isfinite(values[monitor]):
            self._fresh_monitor = MonitorRecord(monitor, self.plan.retention.mode, float(values[monitor]))

    def save(self, snapshot: Snapshot, cursor: Cursor | None, optimizer_steps: int, mark: BoundaryMark,
             force: bool) -> bool:
        """Commit (or queue) ``snapshot`` with the metrics lines buffered so far (written by the
        commit, after its fence check); False when it was skipped or failed under
        ``on_io_error="warn"``."""
        assert self._writer is not None, "start() before save()"
        self._cadence.save_starting()
        monitor, self._fresh_monitor = self._fresh_monitor, None
        try:
            encoded, digest = self._side.encode(snapshot.state, snapshot.progress_bytes)
            durable = self._tiering.durable_due(mark[0], force) or monitor is not None
            # A distributed run: every rank must write every agreed checkpoint, none is skipped.
            force = force or self._side.writes_every_save
            pending = PendingCheckpoint(encoded, snapshot.progress_bytes, cursor,
                                        metrics_bytes=snapshot.metrics_bytes,
                                        durable=durable,
                                        monitor=monitor,
                                        anchor=snapshot.anchor,
                                        digest=digest)
            written = self._writer.submit(pending, force=force)
        except WriterConflict:
            raise
        except (CheckpointWriteError, OSError) as error:
            self._cadence.save_ended(False, mark[0], optimizer_steps)
            self._handle_io_error(error)
            return False
        self._tiering.saved(written and pending.durable, mark[0])
        self._cadence.save_ended(written, mark[0], optimizer_steps)
        if written and (pending.durable or self._tiering.makes_newest_durable_at_close):
            # Otherwise (a torchrun job's memory tier) the run's end saves its boundary again, durably.
            self._mark_of_last_save = mark
        return written

    def flush(self) -> None:
        """Wait until every queued checkpoint is committed (a rollback chooses among them),
        then surface any write error."""
        if self._writer is not None:
            self._writer.flush()
        self.check()

    def check(self) -> None:
        """Surface a background write error on the training thread."""
        if self._writer is None:
            return
        try:
            self._writer.check()
            self._tiering.check()
        except WriterConflict:
            raise
        except CheckpointWriteError as error:
            self._handle_io_error(error)

    def _handle_io_error(self, error: BaseException) -> None:
        if self.plan.writer.on_io_error == "raise":
            if isinstance(error, CheckpointWriteError):
                raise error
            raise CheckpointWriteError(f"checkpoint not written: {error}; earlier checkpoints are intact") from error
        warnings.warn(f"checkpoint not written, training goes on (on_io_error='warn'): {error}", stacklevel=4)

    def close(self, failing: bool) -> None:
        """Flush pending writes and release the lease. With ``failing`` (an exception is on its
        way up) every error of this cleanup becomes a warning, so that the original one is the
        error the user sees; otherwise the first write error is raised once all is released."""
        try:
            # The writer first (its last checkpoint reaches the fast tier), then the fast tier's
            # newest checkpoint reaches the durable tier, even when the writer failed.
            closers = ([] if self._writer is None else [self._writer]) + self._tiering.closers()
            for closer in closers:
                try:
                    closer.close()
                except Exception as error:
                    if failing:
                        warnings.warn(f"pending checkpoint write failed while stopping: {error}", stacklevel=3)
                    elif isinstance(error, WriterConflict) or not isinstance(error, CheckpointWriteError):
                        raise
                    else:
                        self._handle_io_error(error)
        except BaseException:
            self._release(failing=True)  # the error above is the one to see
            raise
        self._release(failing)

    def _release(self, failing: bool) -> None:
        """Close the store, release the lease and the fast tier, each even when one before it
        failed. With ``failing``, their errors are warnings (they must not replace the error on
        its way up); otherwise the first is raised."""
        first: Exception | None = None
        self._writer_kind.abandon()  # what it launched, when the run ended before its writer was built
        for release in (self.store.close, self._lease.release, self._tiering.release):
            try:
                release()
            except Exception as error:
                if not failing:
                    first = first or error
                    continue
                warnings.warn(f"cleaning up the checkpointer while stopping failed: {type(error).__name__}: {error}",
                              stacklevel=4)
        if first is not None:
            raise first


class TakesPart(Protocol):
    """How a process takes part in choosing the checkpoint to resume from and in encoding what it
    writes: alone, or one rank of a group."""

    @property
    def is_writer(self) -> bool:
        """Whether this process holds the lease and commits (alone, or rank 0 of a group)."""
        ...

    def after_acquire(self, store: CheckpointStore) -> None:
        """The lease is held (by rank 0): the other ranks may read the run dir."""
        ...

    def select(self, choose: Callable[[], LoadedCheckpoint | None], store: CheckpointStore,
               validate: StateValidator, newest_wanted: bool = False) -> LoadedCheckpoint | None:
        """The checkpoint ``choose`` returns (rank 0's choice, loaded by every rank), or with
        ``newest_wanted`` (resume="auto"/"latest") a newer one a memory tier assembles."""
        ...

    def encode(self, state: dict[str, Any], progress_bytes: bytes) -> tuple[EncodedState, dict[str, int] | None]:
        """What this process writes, and the digest of its replicated state (None: alone)."""
        ...


class CommitSide(TakesPart, Protocol):
    """This process's side of choosing and committing checkpoints (engine.distributed.commit
    for a group's)."""

    @property
    def writes_every_save(self) -> bool:
        """Whether every save is forced (the ranks must all write every agreed checkpoint)."""
        ...


class RankGroup(Committer, TakesPart, Protocol):
    """One rank's part in the checkpoints of a torchrun group: it commits with the other ranks
    (a :class:`Committer`), and rank 0 chooses the checkpoint all ranks resume from. Implemented
    by engine.distributed.commit.GroupCommit; this package never imports engine.distributed."""

    @property
    def node_tier(self) -> NodeTier | None:
        """This rank's memory tier when its committer writes into node memory first
        (engine.distributed.memory_commit); None: the run dir only."""
        ...

    def writer_process_spec(self) -> dict[str, Any]:
        """What this rank's writer process (``writer="process"``) joins the other ranks' writer
        processes with and takes over its commits from, once the start is agreed: plain data."""
        ...


class _Alone:
    """A single process chooses, encodes and commits by itself."""

    is_writer = True
    writes_every_save = False

    def after_acquire(self, store: CheckpointStore) -> None:
        pass

    def select(self, choose: Callable[[], LoadedCheckpoint | None], store: CheckpointStore,
               validate: StateValidator, newest_wanted: bool = False) -> LoadedCheckpoint | None:
        return choose()

    def encode(self, state: dict[str, Any], progress_bytes: bytes) -> tuple[EncodedState, dict[str, int] | None]:
        return encode_state(state), None


class _InGroup:
    """One rank of a torchrun job (a :class:`RankGroup`)."""

    writes_every_save = True

    def __init__(self, group: RankGroup) -> None:
        self._group = group

    @property
    def is_writer(self) -> bool:
        return self._group.is_writer

    def after_acquire(self, store: CheckpointStore) -> None:
        self._group.after_acquire(store)

    def select(self, choose: Callable[[], LoadedCheckpoint | None], store: CheckpointStore,
               validate: StateValidator, newest_wanted: bool = False) -> LoadedCheckpoint | None:
        return self._group.select(choose, store, validate, newest_wanted)

    def encode(self, state: dict[str, Any], progress_bytes: bytes) -> tuple[EncodedState, dict[str, int] | None]:
        return self._group.encode(state, progress_bytes)
