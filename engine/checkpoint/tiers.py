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

The fast tier is fenced by ``tier.json``, which names the run dir and the writer generation
that last wrote it. A new writer uses the fast tier's checkpoints only when ``tier.json`` names
this run dir and the previous holder of the run dir's writer lease; otherwise (another run, a
writer that has been superseded, a tier from another node's history) its checkpoints are
deleted unread. It then records its own generation there before writing. A tier that names
another run whose writer is live on this node is refused (ConfigError), not taken over.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import threading
import time
import warnings
from typing import Any, Callable, Collection

from engine.checkpoint.lease import LOCK_FILE
from engine.checkpoint.retention import Retention
from engine.checkpoint.store import CHECKPOINT_DIR, CheckpointStore, LoadedCheckpoint, _NAME, _TEMPORARY
from engine.checkpoint.storage import Storage
from engine.errors import CheckpointError, CheckpointNotFound, CheckpointWriteError, ConfigError

MARKER_FILE = "tier.json"

StateValidator = Callable[[str, Any], None]


class FastTier:
    """The fast tier's directory: its marker (the fence) and its checkpoint store."""

    def __init__(self, path: str, run_storage: Storage) -> None:
        self.storage = Storage(path)
        if not self.storage.is_local:
            raise ConfigError(f"CheckpointConfig.local_tier: {path!r} is not a local path; the fast tier "
                              "lives on this node (e.g. /dev/shm/<run> or a node-local disk)")
        self._owner = os.path.realpath(run_storage.root) if run_storage.is_local else run_storage.url
        if run_storage.is_local and os.path.realpath(self.storage.root) == self._owner:
            raise ConfigError(f"CheckpointConfig.local_tier: {path!r} is the run directory itself; "
                              "give the fast tier a directory of its own")
        self.store = CheckpointStore(self.storage, durable=False)
        self.usable = False

    def claim(self, previous_generation: int, generation: int) -> bool:
        """Decide whether this tier's checkpoints belong to this run's previous writer (kept) or
        not (deleted), then record ``generation`` as its writer. Call holding the run's lease."""
        try:
            marker = json.loads(self.storage.read(MARKER_FILE))
        except (OSError, ValueError):
            marker = None
        self.usable = marker == {"run_dir": self._owner, "generation": previous_generation}
        other_run = marker.get("run_dir") if isinstance(marker, dict) else None
        if isinstance(other_run, str) and other_run != self._owner and _has_a_live_writer(other_run):
            raise ConfigError(f"CheckpointConfig.local_tier: {self.storage.url!r} is the fast tier of another run, "
                              f"{other_run!r}, whose writer is running now; its checkpoints are left alone. Give "
                              "each run a fast tier of its own (e.g. /dev/shm/<run name>)")
        for entry in self.storage.list_names(CHECKPOINT_DIR):
            if (not self.usable and _NAME.fullmatch(entry)) or _TEMPORARY.fullmatch(entry):
                self.storage.remove_tree(f"{CHECKPOINT_DIR}/{entry}")
        if marker is not None and not self.usable:
            warnings.warn(f"ignoring the fast checkpoint tier {self.storage.url}: it was written for "
                          f"{marker!r}, not for {self._owner} after writer generation {previous_generation}",
                          stacklevel=3)
        self.storage.replace(MARKER_FILE, json.dumps({"run_dir": self._owner, "generation": generation}).encode())
        return self.usable


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
    for store, name in stores_newest_first(stores):
        if name in skip:
            continue
        try:
            return store.load(name, validate)
        except CheckpointError as error:
            warnings.warn(f"skipping checkpoint {name} in {store.storage.url}: {error}", stacklevel=3)
    return None


def load_named(stores: list[CheckpointStore], name: str, validate: StateValidator) -> LoadedCheckpoint:
    """Checkpoint ``name`` from the first store that holds it."""
    for store in stores[:-1]:
        try:
            return store.load(name, validate)
        except CheckpointNotFound:
            continue
    return stores[-1].load(name, validate)


class DurablePromoter:
    """Copies fast-tier checkpoints into the durable tier in a background thread. Requests
    coalesce: when the thread is busy, only the newest requested checkpoint waits."""

    def __init__(self, fast: CheckpointStore, durable: CheckpointStore, retention: Retention,
                 also_sync: Callable[[], list[str]], fence: Callable[[], None] | None, generation: int | None) -> None:
        self._fast = fast
        self._durable = durable
        self._retention = retention
        self._also_sync = also_sync
        self._fence = fence
        self._generation = generation
        self._condition = threading.Condition()
        self._wanted: str | None = None
        self._busy: str | None = None
        self._closing = False
        self._error: BaseException | None = None
        self.last_durable: str | None = None
        self._thread = threading.Thread(target=self._work, name="splitloop-durable-tier", daemon=True)
        self._thread.start()

    def request(self, name: str) -> None:
        with self._condition:
            self._wanted = name
            self._condition.notify_all()

    def protected(self) -> frozenset[str]:
        """Names the fast tier's retention must keep (queued or being copied)."""
        with self._condition:
            return frozenset(name for name in (self._wanted, self._busy) if name is not None)

    def _work(self) -> None:
        while True:
            with self._condition:
                while self._wanted is None and not self._closing:
                    self._condition.wait()
                if self._wanted is None:
                    return
                name = self._busy = self._wanted  # _busy before _wanted drops: see copied_since
                self._wanted = None
            try:
                if self._fence is not None:
                    self._fence()
                self._durable.copy_from(self._fast, name, also_sync=self._also_sync(), fence=self._fence)
                if self._fence is not None:
                    self._fence()  # a writer fenced off after its commit point deletes nothing
                self._retention.apply(self._durable, self._generation)
                self.last_durable = name
            except BaseException as error:  # surfaces on the training thread at its next boundary
                with self._condition:
                    if self._error is None:
                        self._error = error
            finally:
                with self._condition:
                    self.last_copy_end = time.monotonic()  # before _busy drops: see copied_since
                    self._busy = None
                    self._condition.notify_all()

    # When the last copy ended (time.monotonic()); -inf before the first.
    last_copy_end = -math.inf

    def copied_since(self, since: float) -> bool:
        """Whether a copy into the durable tier was requested or running at any moment after
        ``since`` (a ``time.monotonic()`` reading): whether a split that started at ``since``
        overlapped one. Lock-free (once per split): read in the reverse order of the writes in
        :meth:`_work`."""
        return self._wanted is not None or self._busy is not None or self.last_copy_end >= since

    def check(self) -> None:
        """Raise, on the calling thread, an error the background copy met."""
        if self._error is None:
            return
        with self._condition:
            error, self._error = self._error, None
        if error is None:
            return
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointWriteError(f"copying a checkpoint to the durable tier failed: {error}") from error

    def close(self, newest: str | None) -> None:
        """Make ``newest`` durable (unless it already is), wait, stop the thread, then raise
        any error met."""
        with self._condition:
            if newest is not None and newest != self.last_durable and self._busy != newest:
                self._wanted = newest
            self._closing = True
            self._condition.notify_all()
        self._thread.join()
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

    def commit(self, write: Callable[[CheckpointStore, int], str], durable: bool,
               fence: Callable[[], None] | None) -> str:
        """``write(store, sequence)`` commits to the fast tier; then its retention, and the
        request to make the checkpoint durable when ``durable``."""
        self.promoter.check()
        name = write(self._fast, self._next_sequence)
        self._next_sequence += 1
        self.newest = name
        if durable:
            self.promoter.request(name)
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
