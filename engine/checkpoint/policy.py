"""A run's checkpointing policy: every "when" and "which" decision about checkpoints.

When to save (split cadence, epoch end), which checkpoint to resume from, the writer lease,
the (a)synchronous writer, and what to do when a write fails. The run hands it snapshots
(:class:`engine.run.state.RunSnapshot`); it never calls back into the run.
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable

from engine.checkpoint.abandoned import describe_names, read_abandoned, write_abandoned
from engine.checkpoint.budget import OverheadBudget
from engine.checkpoint.codec import encode_state
from engine.checkpoint.lease import WriterLease
from engine.checkpoint.store import CheckpointStore
from engine.checkpoint.tiers import FastTier, TierWriter, latest_across, load_named, stores_newest_first
from engine.checkpoint.writer import BackgroundWriter, PendingCheckpoint, SyncWriter
from engine.config import CheckpointConfig
from engine.checkpoint.manifest import MonitorRecord
from engine.checkpoint.retention import Retention
from engine.checkpoint.store import LoadedCheckpoint
from engine.errors import CheckpointCorrupt, CheckpointNotFound, CheckpointWriteError, ConfigError, WriterConflict
from engine.checkpoint.metrics_log import METRICS_FILE, MetricsLog
from engine.checkpoint.storage import Storage
from progress import Cursor

if TYPE_CHECKING:
    from engine.distributed.commit import GroupCommit
    from engine.run.state import RunSnapshot

BoundaryMark = tuple[int, int]
StateValidator = Callable[[str, Any], None]


class RunCheckpointer:
    def __init__(self, storage: Storage, policy: CheckpointConfig, metrics: MetricsLog,
                 group: GroupCommit | None = None) -> None:
        self.store = CheckpointStore(storage)
        # A distributed run: rank 0 holds the one lease of the job and commits (engine.distributed).
        self._group = group
        self.policy = policy
        self._storage = storage
        self._metrics = metrics
        self._lease = WriterLease(storage, stale_after=policy.lease_expiry_seconds)
        self._writer: SyncWriter | BackgroundWriter | None = None
        self._last_save_time = time.monotonic()
        self._steps_at_last_save = 0
        self._mark_of_last_save: BoundaryMark | None = None
        self._fresh_monitor: MonitorRecord | None = None
        self._budget = OverheadBudget(policy.max_overhead) if policy.every_n_splits == "auto" else None
        self._units_at_last_save = 0
        # "auto" timing: when the split being timed started, when due_at_split said yes, and
        # whether background checkpoint work ran since a given time (None: none runs).
        self._split_started = time.monotonic()
        self._due_since: float | None = None
        self._wrote_since: Callable[[float], bool] | None = None
        self._resumed_name: str | None = None
        if policy.local_tier is not None and group is not None:
            raise ConfigError("CheckpointConfig.local_tier is not supported with several processes yet; "
                              "leave it unset under torchrun")
        self._fast = FastTier(policy.local_tier, storage) if policy.local_tier is not None else None
        self._tiers: TierWriter | None = None
        self._last_durable_time = time.monotonic()
        self._units_at_last_durable = 0

    @property
    def last_name(self) -> str | None:
        return None if self._writer is None else self._writer.last_name

    def acquire(self) -> None:
        """Take the writer lease (WriterConflict if another live process holds it) and clean
        up what crashed writers left. Call before reading checkpoints to resume."""
        if self._group is None or self._group.is_writer:
            self._lease.acquire(minimum_generation=self.store.newest_generation(),
                                committed_sequence=self._takeover_sequence)
            self._metrics.fence = self._lease.verify
            self.store.remove_temporaries()
            if self._fast is not None:
                self._fast.claim(self._lease.previous_generation, self._lease.generation)
        if self._group is not None:
            self._group.after_acquire(self.store)

    def _takeover_sequence(self) -> int:
        """The highest sequence committed when this writer takes the lease over (its takeover
        fence): in the run dir, and in a fast tier holding the previous writer's checkpoints
        (a candidate best one among them is copied into the run dir by this writer)."""
        sequence = self.store.newest_committed_sequence()
        if self._fast is not None:
            sequence = max(sequence, self._fast.newest_sequence_of(self._lease.previous_generation))
        return sequence

    def _stores(self) -> list[CheckpointStore]:
        """The stores resume reads: the run dir, then the fast tier when its fence matches."""
        if self._fast is not None and self._fast.usable:
            return [self.store, self._fast.store]
        return [self.store]

    def select(self, resume: str, validate: StateValidator) -> LoadedCheckpoint | None:
        """The checkpoint to resume from (``resume`` as in ``Trainer.fit``), or None to start
        fresh. "auto"/"latest" take the newest that verifies and whose state passes
        ``validate``; a run dir whose every checkpoint is invalid is refused, never restarted
        silently."""
        if self._group is not None:
            loaded = self._group.select(functools.partial(self._select, resume, validate), self.store, validate)
        else:
            loaded = self._select(resume, validate)
        self._resumed_name = None if loaded is None else loaded.name
        return loaded

    def _select(self, resume: str, validate: StateValidator) -> LoadedCheckpoint | None:
        if resume == "off":
            return None
        stores = self._stores()
        if resume not in ("auto", "latest"):
            return load_named(stores, resume, validate)
        abandoned = self._skipped_as_abandoned(stores)
        latest = self.store.latest(validate, abandoned) if len(stores) == 1 else latest_across(stores, validate, abandoned)
        if latest is not None:
            return latest
        existing = [name for store in stores for name in store.committed_names()]
        if existing:
            raise CheckpointCorrupt(
                f"{len(existing)} checkpoint(s) in {self._storage.url} and none verifies; "
                "refusing to start over silently (pass resume='off' to start a fresh run)"
            )
        if resume == "latest":
            raise CheckpointNotFound(f"resume='latest' but {self._storage.url} holds no checkpoint")
        return None

    def _skipped_as_abandoned(self, stores: list[CheckpointStore]) -> frozenset[str]:
        """The abandoned checkpoints "auto"/"latest" leaves out, with a warning naming those
        still present."""
        abandoned = read_abandoned(self._storage)
        present = sorted({name for store in stores for name in store.committed_names()} & abandoned)
        if present:
            warnings.warn(f"resume: skipping {describe_names(present)}: a run resumed from an older checkpoint "
                          f"abandoned them ({self._storage.url}/abandoned.json); resume one by name to return to it",
                          stacklevel=4)
        return abandoned

    def abandon_newer_than(self, name: str) -> list[str]:
        """Resuming by name from ``name``: record the checkpoints newer than it as abandoned
        (engine.checkpoint.abandoned) before any commit; returns their names, oldest first."""
        names = [entry for _, entry in stores_newest_first(self._stores())]
        newer = sorted(set(names[:names.index(name)])) if name in names else []
        if self._group is None or self._group.is_writer:
            recorded = read_abandoned(self._storage)
            abandoned = (recorded - {name}) | set(newer)
            if abandoned != recorded:
                write_abandoned(self._storage, abandoned)
        return newer

    def start(self, optimizer_steps: int, resumed_mark: BoundaryMark | None) -> None:
        """Start the writer (after any resume); ``resumed_mark`` is the boundary of the
        checkpoint resumed from, which therefore needs no new checkpoint."""
        self._steps_at_last_save = optimizer_steps
        self._mark_of_last_save = resumed_mark
        if self._fast is not None and self._resumed_name is not None and \
                self._resumed_name not in self.store.committed_names():
            # Resumed from a checkpoint only the fast tier holds (its copy to the durable tier
            # died with the process): the boundary is not held durably, so the run's last
            # checkpoint is written again even at this boundary, and reaches the durable tier.
            self._mark_of_last_save = None
        self._units_at_last_save = resumed_mark[0] if resumed_mark is not None else 0
        also_sync = (lambda: [METRICS_FILE]) if self._storage.is_local else (lambda: [])
        policy = self.policy
        abandoned = read_abandoned(self._storage) if self._group is None or self._group.is_writer else frozenset()
        retention = Retention(policy.keep_last, policy.keep_best if policy.monitor else 0, policy.monitor, abandoned)
        if policy.asynchronous:
            self._writer = BackgroundWriter(self.store, self._lease, retention, also_sync,
                                            policy.max_in_flight, policy.when_behind, self._group)
        else:
            self._writer = SyncWriter(self.store, self._lease, retention, also_sync, self._group)
        if self._fast is not None:
            self._units_at_last_durable = resumed_mark[0] if resumed_mark is not None else 0
            self._tiers = TierWriter(self._fast.store, self.store, retention, also_sync,
                                     self._lease.verify, self._lease.generation)
            self._writer.tiers = self._tiers
        self._wrote_since = self._background_work_detector()
        self._split_started = time.monotonic()

    def _background_work_detector(self) -> Callable[[float], bool] | None:
        """What tells "auto" whether a split overlapped background checkpoint work: the
        background writer's writes, and the fast tier's copies into the durable tier (both
        compete with training). None when nothing runs in the background."""
        detectors = []
        if isinstance(self._writer, BackgroundWriter):
            detectors.append(self._writer.wrote_since)
        if self._tiers is not None:
            detectors.append(self._tiers.promoter.copied_since)
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
        if self._budget is not None:
            return self._budget.interval
        every = self.policy.every_n_splits
        return every if isinstance(every, int) else None

    @property
    def auto_interval(self) -> int | None:
        """The interval ``every_n_splits="auto"`` chose so far (None without "auto")."""
        return None if self._budget is None else self._budget.interval

    def due_at_epoch_end(self) -> bool:
        """Whether a checkpoint is due after this epoch's end-of-epoch work: the policy asks for
        one after each epoch, or the epoch end produced a monitored value (its record belongs to
        a checkpoint of this boundary's weights, see :meth:`offer_metrics`)."""
        return self.policy.at_epoch_end or self._fresh_monitor is not None

    def due_at_split(self, units_completed: int, optimizer_steps: int) -> bool:
        """Whether the policy asks for a checkpoint at this split boundary."""
        if self._budget is not None:
            now = self._time_split()
            due = units_completed - self._units_at_last_save >= self._budget.interval or \
                self._due_by_steps_or_time(optimizer_steps)
            self._due_since = now if due else None  # a "yes" the ranks did not agree on is dropped
            return due
        every = self.policy.every_n_splits
        if isinstance(every, int) and units_completed % every == 0:
            return True
        return self._due_by_steps_or_time(optimizer_steps)

    def _time_split(self) -> float:
        """With "auto": hand the split that just ended to the budget (its time, and whether a
        background write overlapped it); the next one starts now. The per-split cost of
        "auto": one clock read and a few comparisons."""
        assert self._budget is not None
        now = time.monotonic()
        started, wrote_since = self._split_started, self._wrote_since
        self._budget.note_split(now - started, wrote_since is not None and wrote_since(started))
        self._split_started = now
        return now

    def _due_by_steps_or_time(self, optimizer_steps: int) -> bool:
        policy = self.policy
        if policy.every_n_steps is not None and optimizer_steps // policy.every_n_steps > self._steps_at_last_save // policy.every_n_steps:
            return True
        return policy.every_seconds is not None and time.monotonic() - self._last_save_time >= policy.every_seconds

    def offer_metrics(self, values: dict[str, float]) -> None:
        """New metric values were produced (a validation pass, an epoch's aggregates) at the
        current boundary: the checkpoint saved at this boundary records the monitored one, which
        makes it a candidate best checkpoint. The record belongs to that checkpoint only: the
        next :meth:`save` takes it whatever becomes of it, so it never lands on later weights."""
        monitor = self.policy.monitor
        if monitor is not None and monitor in values and math.isfinite(values[monitor]):
            self._fresh_monitor = MonitorRecord(monitor, self.policy.mode, float(values[monitor]))

    def save(self, snapshot: RunSnapshot, cursor: Cursor | None, optimizer_steps: int, mark: BoundaryMark,
             force: bool) -> bool:
        """Commit (or queue) ``snapshot`` with the metrics lines buffered so far (written by the
        commit, after its fence check); False when it was skipped or failed under
        ``on_io_error="warn"``."""
        assert self._writer is not None, "start() before save()"
        save_started = time.monotonic() if self._budget is not None else 0.0
        monitor, self._fresh_monitor = self._fresh_monitor, None
        try:
            metrics_bytes = self._metrics.snapshot()
            if metrics_bytes != snapshot.state["metrics_bytes"]:
                raise CheckpointWriteError(f"metrics.jsonl will hold {metrics_bytes} bytes, the snapshot recorded "
                                           f"{snapshot.state['metrics_bytes']}")
            if self._group is None:
                encoded, digest = encode_state(snapshot.state), None
            else:
                encoded, digest = self._group.encode(snapshot.state, snapshot.progress_bytes)
                force = True  # every rank must write every agreed checkpoint: none is skipped
            pending = PendingCheckpoint(encoded, snapshot.progress_bytes, cursor,
                                        publish_metrics=functools.partial(self._metrics.write_until, metrics_bytes),
                                        durable=self._durable_due(mark, force) or monitor is not None,
                                        monitor=monitor,
                                        digest=digest)
            written = self._writer.submit(pending, force=force)
        except WriterConflict:
            raise
        except (CheckpointWriteError, OSError) as error:
            if self._budget is not None:
                self._budget_after_save(False, save_started)
            self._handle_io_error(error)
            return False
        if written and pending.durable and self._fast is not None:
            self._last_durable_time = time.monotonic()
            self._units_at_last_durable = mark[0]
        if self._budget is not None:
            self._budget_after_save(written, save_started)
        if written:
            self._units_at_last_save = mark[0]
            self._last_save_time = time.monotonic()
            self._steps_at_last_save = optimizer_steps
            self._mark_of_last_save = mark
        return written

    def _budget_after_save(self, written: bool, save_started: float) -> None:
        """With "auto": the budget records what this checkpoint blocked: since due_at_split said
        yes, or, for a save the run asked for (validation, epoch end, stop), since this call;
        there, the time since the last split was timed (epoch-end work, a validation pass) is
        no split's and is dropped. The next split starts now."""
        assert self._budget is not None
        ended = time.monotonic()
        if written:
            self._budget.record(ended - (self._due_since if self._due_since is not None else save_started))
        self._due_since = None
        self._split_started = ended

    def _durable_due(self, mark: BoundaryMark, force: bool) -> bool:
        """With a fast tier: whether this checkpoint also goes to the run dir (forced ones, the
        last of a run and a preemption's, always do; so do candidate best ones, see save)."""
        policy = self.policy
        if self._fast is None or force:
            return True
        every = policy.durable_every_n_splits
        if every is not None and mark[0] // every > self._units_at_last_durable // every:
            return True
        return policy.durable_every_seconds is not None and \
            time.monotonic() - self._last_durable_time >= policy.durable_every_seconds

    def check(self) -> None:
        """Surface a background write error on the training thread."""
        if self._writer is None:
            return
        try:
            self._writer.check()
            if self._tiers is not None:
                self._tiers.check()
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
        way up) every error of this cleanup becomes a warning, so that the original one is the
        error the user sees; otherwise the first write error is raised once all is released."""
        try:
            # The writer first (its last checkpoint reaches the fast tier), then the fast tier's
            # newest checkpoint reaches the durable tier, even when the writer failed.
            closers = [closer for closer in (self._writer, self._tiers) if closer is not None]
            self._tiers = None
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
        for release in (self.store.close, self._lease.release, *([self._fast.release] if self._fast else [])):
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
