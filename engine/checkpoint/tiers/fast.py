"""Two checkpoint tiers: a fast node-local one written every time, the durable run dir less often.

``CheckpointConfig(local_tier=PATH, durable_every_n_splits=N, durable_every_seconds=T)``:

* every checkpoint is committed to the **fast tier** (``PATH``, e.g. under ``/dev/shm`` or a
  node-local disk) with the same files, checksums and commit protocol as the run dir, minus the
  fsyncs: it survives the death of the training process, not of the node;
* every N splits / T seconds (and always for a run's last checkpoint and a preemption
  checkpoint) a background thread copies the newest fast checkpoint into the **durable tier**
  (the run dir), verified against its manifest on the way, under the same name: one sequence
  space across both tiers;
* resume takes the newest checkpoint that verifies across both tiers, by (writer generation,
  sequence).

The fast tier is bound to one run, whatever the run dir's storage (local or ``s3://``). The
run's identity is a random id in the run dir's ``run.id``; every checkpoint the tier's store
commits records it in its manifest, and every read (resume, the durable copy) refuses one that
records another (never resumed from). A run holds an ``flock`` on the tier's ``tier.lock`` for
its whole life; the kernel drops it when the process dies.

The fast tier is fenced by ``tier.json``, which names the run dir, the run's identity and the
writer generation that last wrote it. A new writer uses the fast tier's checkpoints only when
``tier.json`` names this run and the previous holder of the run dir's writer lease; otherwise
(another run, a writer that has been superseded, a tier from another node's history) its
checkpoints are deleted unread. It then records its own generation there before writing. A tier
whose lock another live process holds (unless ``tier.json`` names that process as this run's
previous writer), or that names another run whose writer is live on this node, is refused
(ConfigError), not taken over.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import threading
import warnings
from typing import Any, Callable, Collection

from engine.checkpoint.format.names import CHECKPOINT_DIR, CHECKPOINT_NAME, STAGING_NAME
from engine.checkpoint.format.state_keys import StateValidator
from engine.checkpoint.store.catalogue import first_that_loads
from engine.checkpoint.store.checkpoint_store import CheckpointStore, LoadedCheckpoint
from engine.checkpoint.store.lease import _LOCK_DESCRIPTORS, LOCK_FILE
from engine.checkpoint.store.retention import Retention
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.writers.worker import BackgroundWorker
from engine.errors import CheckpointNotFound, CheckpointWriteError, ConfigError, WriterConflict

MARKER_FILE = "tier.json"
TIER_LOCK_FILE = "tier.lock"
RUN_ID_FILE = "run.id"  # in the run directory
_RUN_ID_LENGTH = 32
_RUN_ID = re.compile(f"[0-9a-f]{{{_RUN_ID_LENGTH}}}", re.ASCII)


class FastTier:
    """The fast tier's directory: its marker (the fence), its lock (the live run that uses it)
    and its checkpoint store, bound to one run (see the module docstring)."""

    def __init__(self, path: str, run_storage: Storage) -> None:
        self.storage = Storage(path)
        if not self.storage.is_local:
            raise ConfigError(f"CheckpointConfig.local_tier: {path!r} is not a local path; the fast tier "
                              "lives on this node (e.g. /dev/shm/<run> or a node-local disk)")
        self._owner = os.path.realpath(run_storage.root) if run_storage.is_local else run_storage.url
        if run_storage.is_local and os.path.realpath(self.storage.root) == self._owner:
            raise ConfigError(f"CheckpointConfig.local_tier: {path!r} is the run directory itself; "
                              "give the fast tier a directory of its own")
        self._run_storage = run_storage
        self.store = CheckpointStore(self.storage, durable=False)
        self.usable = False
        self._lock_descriptor: int | None = None

    def _marker(self) -> Any:
        try:
            return json.loads(self.storage.read(MARKER_FILE))
        except (OSError, ValueError):
            return None

    def newest_sequence_of(self, previous_generation: int) -> int:
        """The highest sequence this tier holds when its checkpoints are the ones this run's
        writer ``previous_generation`` committed (0 otherwise): with the run dir's, the takeover
        fence. Such a checkpoint copied later into the run dir is not a stale writer's."""
        run = _recorded_run_identity(self._run_storage)
        if run is None or self._marker() != {"run_dir": self._owner, "run": run, "generation": previous_generation}:
            return 0
        return self.store.newest_committed_sequence()

    def claim(self, previous_generation: int, generation: int) -> bool:
        """Bind the tier to this run (refused while another run uses it), decide whether its
        checkpoints belong to this run's previous writer (kept) or not (deleted), then record
        ``generation`` as its writer. Call holding the run's lease; :meth:`release` at the end."""
        run = self.store.run = _run_identity(self._run_storage)
        held_by_another_process = not self._lock()
        marker = self._marker()
        ours = {"run_dir": self._owner, "run": run}
        self.usable = marker == {**ours, "generation": previous_generation}
        other_run = marker.get("run_dir") if isinstance(marker, dict) else None
        # A process holding the lock is this run's previous writer only if the marker says so.
        if (held_by_another_process and not self.usable) or \
                (isinstance(other_run, str) and other_run != self._owner and _has_a_live_writer(other_run)):
            self.release()
            raise ConfigError(f"CheckpointConfig.local_tier: {self.storage.url!r} is the fast tier of another run, "
                              f"{other_run!r}, whose writer is running now; its checkpoints are left alone. Give "
                              "each run a fast tier of its own (e.g. /dev/shm/<run name>)")
        for entry in self.storage.list_names(CHECKPOINT_DIR):
            if (not self.usable and CHECKPOINT_NAME.fullmatch(entry)) or STAGING_NAME.fullmatch(entry):
                self.storage.remove_tree(f"{CHECKPOINT_DIR}/{entry}")
        if marker is not None and not self.usable:
            warnings.warn(f"ignoring the fast checkpoint tier {self.storage.url}: it was written for "
                          f"{marker!r}, not for {ours!r} after writer generation {previous_generation}",
                          stacklevel=3)
        self.storage.replace(MARKER_FILE, json.dumps({**ours, "generation": generation}).encode())
        return self.usable

    def _lock(self) -> bool:
        """Hold ``tier.lock`` (flock) from now until :meth:`release`, whatever the run
        directory's storage: the kernel drops it when the process dies. False (and nothing
        held) when another live process holds it."""
        descriptor = os.open(self.storage.writable_path(TIER_LOCK_FILE),
                             os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            return False
        except OSError:
            os.close(descriptor)
            raise
        self._lock_descriptor = descriptor
        _LOCK_DESCRIPTORS.add(descriptor)  # closed in forked children (DataLoader workers)
        return True

    def release(self) -> None:
        """Let another run use the tier (closing the descriptor drops the lock)."""
        if self._lock_descriptor is not None:
            descriptor, self._lock_descriptor = self._lock_descriptor, None
            _LOCK_DESCRIPTORS.discard(descriptor)
            os.close(descriptor)


def _run_identity(run_storage: Storage) -> str:
    """The run's identity, kept in ``run.id`` of its run directory (created by its first
    writer with a fast tier; call holding the lease). Copies of the run directory share it."""
    identity = _recorded_run_identity(run_storage)
    if identity is not None:
        return identity
    identity = secrets.token_hex(_RUN_ID_LENGTH // 2)
    run_storage.replace(RUN_ID_FILE, identity.encode("ascii"))
    return identity


def _recorded_run_identity(run_storage: Storage) -> str | None:
    """The identity in ``run.id`` of the run directory; None when there is none yet or it is
    unreadable or malformed (then a new one is made, and this tier's checkpoints are not used)."""
    try:
        identity = run_storage.read(RUN_ID_FILE, _RUN_ID_LENGTH + 1).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return identity if _RUN_ID.fullmatch(identity) else None


def _has_a_live_writer(run_dir: str) -> bool:
    """Whether a process on this node holds the writer lock of the local run directory
    ``run_dir`` now (a fast tier is node-local, so the run that wrote one ran here). Creates
    nothing; a run dir elsewhere (a URL) or without a lock file has none."""
    if not os.path.isabs(run_dir):
        return False
    try:
        descriptor = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(descriptor)  # drops the shared lock if it was taken
    return False


def stores_newest_first(stores: list[CheckpointStore]) -> list[tuple[CheckpointStore, str]]:
    """Every checkpoint of ``stores`` in resume order: (writer generation, sequence), newest
    first; on a tie (the same checkpoint in two tiers) the earlier store first."""
    entries = []
    for rank, store in enumerate(stores):
        listed = store.newest_first()
        newest = max((m.writer_generation for _, m in listed if m is not None), default=0)
        for name, manifest in listed:
            generation = newest if manifest is None else manifest.writer_generation
            entries.append((generation, int(name[5:]), -rank, store, name))
    entries.sort(key=lambda entry: entry[:3], reverse=True)
    return [(store, name) for *_, store, name in entries]


def latest_across(stores: list[CheckpointStore], validate: StateValidator,
                  skip: Collection[str] = ()) -> LoadedCheckpoint | None:
    """The newest checkpoint of ``stores`` that verifies and passes ``validate``, leaving out
    those in ``skip``."""
    if len(stores) == 1:
        return stores[0].latest(validate, skip)
    candidates = ((store, name) for store, name in stores_newest_first(stores) if name not in skip)
    return first_that_loads(candidates, validate, name_the_store=True, stacklevel=3)


def load_named(stores: list[CheckpointStore], name: str, validate: StateValidator) -> LoadedCheckpoint:
    """Checkpoint ``name`` from the first store that holds it."""
    for store in stores[:-1]:
        try:
            return store.load(name, validate)
        except CheckpointNotFound:
            continue
    return stores[-1].load(name, validate)


class DurablePromoter(BackgroundWorker[str]):
    """Copies fast-tier checkpoints into the durable tier in a background thread. Requests
    coalesce: when the thread is busy, only the newest requested checkpoint waits, beside the
    requests that must be kept (candidate best checkpoints: ``inspect`` and
    ``load_weights(checkpoint="best")`` read the durable tier, and the fast tier's retention
    keeps no best ones)."""

    def __init__(self, fast: CheckpointStore, durable: CheckpointStore, retention: Retention,
                 also_sync: Callable[[], list[str]], fence: Callable[[], None] | None, generation: int | None) -> None:
        self._fast = fast
        self._durable = durable
        self._retention = retention
        self._also_sync = also_sync
        self._fence = fence
        self._generation = generation
        super().__init__(threading.Condition(), "splitloop-durable-tier")
        # (name, must be kept) in request order; a newer request drops the others.
        self._wanted: list[tuple[str, bool]] = []
        self._busy: str | None = None
        self.last_durable: str | None = None
        self._start_thread()

    def request(self, name: str, keep: bool = False) -> None:
        """Copy ``name`` into the durable tier; with ``keep`` even when newer requests follow
        before the copy starts."""
        with self._condition:
            # A new list, never changed in place: copied_since reads it without the lock.
            self._wanted = [entry for entry in self._wanted if entry[1]] + [(name, keep)]
            self._condition.notify_all()

    def protected(self) -> frozenset[str]:
        """Names the fast tier's retention must keep (queued or being copied)."""
        with self._condition:
            names = [name for name, _ in self._wanted] + ([self._busy] if self._busy is not None else [])
            return frozenset(names)

    def _take_locked(self) -> str | None:
        if not self._wanted:
            return None
        name = self._busy = self._wanted[0][0]  # _busy before _wanted drops: see copied_since
        self._wanted = self._wanted[1:]
        return name

    def _run(self, name: str) -> None:
        if self._fence is not None:
            self._fence()
        self._durable.copy_from(self._fast, name, also_sync=self._also_sync(), fence=self._fence)
        if self._fence is not None:
            self._fence()  # a writer fenced off after its commit point deletes nothing
        self._retention.apply(self._durable, self._generation)
        self.last_durable = name

    def _idle_locked(self) -> None:
        self._busy = None

    def copied_since(self, since: float) -> bool:
        """Whether a copy into the durable tier was requested or running at any moment after
        ``since`` (a ``time.monotonic()`` reading): whether a split that started at ``since``
        overlapped one. Lock-free (once per split): read in the reverse order of the writes in
        BackgroundWorker._work."""
        return bool(self._wanted) or self._busy is not None or self.last_end >= since

    def check(self) -> None:
        """Raise, on the calling thread, an error the background copy met."""
        if self._error is None:
            return
        with self._condition:
            error = self._take_error_locked()
        if error is None:
            return
        if isinstance(error, (CheckpointWriteError, WriterConflict)):
            raise error
        # Reading the fast tier failed too (its checkpoint vanished, or does not verify): for the
        # run, a durable copy that could not be written, under CheckpointConfig.on_io_error.
        raise CheckpointWriteError(f"copying a checkpoint to the durable tier failed: {type(error).__name__}: "
                                   f"{error}") from error

    def close(self, newest: str | None) -> None:
        """Make ``newest`` durable (unless it already is), wait, stop the thread, then raise
        any error met."""
        with self._condition:
            waiting = [name for name, _ in self._wanted]
            if newest is not None and newest != self.last_durable and self._busy != newest and newest not in waiting:
                self._wanted = self._wanted + [(newest, False)]
                self._condition.notify_all()
        self._stop_thread()
        self.check()


class TierWriter:
    """Commits each checkpoint to the fast tier (on the writer's thread) and hands the ones due
    to the durable tier to a :class:`DurablePromoter`. One sequence space across both tiers."""

    def __init__(self, fast: CheckpointStore, durable: CheckpointStore, retention: Retention,
                 also_sync: Callable[[], list[str]], fence: Callable[[], None] | None, generation: int | None) -> None:
        self._fast = fast
        self._keep_last = retention.keep_last  # best checkpoints are kept in the durable tier
        self._generation = generation
        self._next_sequence = max(fast.next_sequence(), durable.next_sequence())
        self._fence = fence
        self.promoter = DurablePromoter(fast, durable, retention, also_sync, fence, generation)
        self.newest: str | None = None
        self._request_stranded_best_candidates(durable)

    def _request_stranded_best_candidates(self, durable: CheckpointStore) -> None:
        """Candidate best checkpoints the previous writer committed to the fast tier and died
        before copying: copied now, before this writer's fast-tier retention deletes them."""
        in_durable = set(durable.committed_names())
        for name, manifest in reversed(self._fast.newest_first()):
            if manifest is not None and manifest.monitor is not None and name not in in_durable \
                    and self._fast.verifies(name):
                self.promoter.request(name, keep=True)

    def commit(self, write: Callable[[CheckpointStore, int], str], durable: bool,
               fence: Callable[[], None] | None, best_candidate: bool = False) -> str:
        """``write(store, sequence)`` commits to the fast tier; then its retention, and the
        request to make the checkpoint durable when ``durable``. A ``best_candidate`` (it
        records a monitored value) always reaches the durable tier, where best checkpoints are
        kept: no newer request replaces it."""
        self.promoter.check()
        name = write(self._fast, self._next_sequence)
        self._next_sequence += 1
        self.newest = name
        if durable or best_candidate:
            self.promoter.request(name, keep=best_candidate)
        if fence is not None:
            fence()
        self._fast.apply_retention(self._keep_last, self._generation, protected=self.promoter.protected())
        return name

    def check(self) -> None:
        self.promoter.check()

    def close(self) -> None:
        """Make the newest checkpoint durable, wait for the durable tier, then apply the fast
        tier's retention once more: checkpoints it kept while they were being copied are no
        longer needed there."""
        self.promoter.close(self.newest)
        if self.newest is not None:
            if self._fence is not None:
                self._fence()
            self._fast.apply_retention(self._keep_last, self._generation)
        self._fast.close()
