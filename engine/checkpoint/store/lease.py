"""The writer lease: one process at a time writes checkpoints into a run directory.

Liveness never depends on process ids (a restarted container is PID 1 again, and a process in
another PID namespace on the same host has an unrelated PID):

* **local disks**: the holder keeps an ``flock`` on ``<run dir>/writer.lock`` for its whole
  life. The kernel drops it when the process dies, however it dies, so a restart takes over at
  once, and a live holder, wherever its PID namespace, is never taken over.
* **other filesystems** (object stores, ``memory://``): the holder rewrites
  ``writer.lease`` with a new ``beat`` every ``stale_after / 3`` seconds from a heartbeat
  thread. A newcomer that finds a lease not marked released watches it with its *own*
  monotonic clock: if the content changes within ``stale_after`` seconds the holder is alive
  (:class:`WriterConflict`); if it stays the same that long, the holder is gone and is taken
  over. No wall-clock time of another host is ever compared with ours.

``<run dir>/writer.lease`` (JSON) names the holder (a random token, the generation, pid and
host for messages) and survives the run marked ``released``, so generations only grow. It also
carries the *takeover fences*: for each generation G, the highest checkpoint sequence committed
when G took the lease. A checkpoint of an older generation with a higher sequence was committed
by a writer that had already lost the lease, and is never resumed from (see :func:`read_fences`). Each
acquisition takes generation ``max(previous lease, newest checkpoint) + 1``; every checkpoint
records it, and :meth:`WriterLease.verify` (the fence) is checked before a commit's metrics,
again immediately before its commit point, and before retention.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import socket
import sys
import threading
import time
from typing import Any, Callable

from engine.checkpoint.format.manifest import MAX_GENERATION
from engine.checkpoint.store.file_lock import try_lock
from engine.checkpoint.store.storage import Storage
from engine.errors import CheckpointWriteError, WriterConflict

LEASE_FILE = "writer.lease"
LOCK_FILE = "writer.lock"
# Held (flock) by the training process alone while its lease hands commits to a writer process,
# which shares the lease's lock: a newcomer that finds writer.lock taken tells a live training
# process (refused at once) from the writer process of a killed one finishing (waited for).
TRAINER_LOCK_FILE = "trainer.lock"
_LEASE_TEMPORARY = re.compile(r"writer\.lease\.[0-9]+\.tmp", re.ASCII)
# How long a new writer waits for the writer process of a killed run (engine.checkpoint.
# writer_process) to commit the last snapshot it received and exit, before WriterConflict.
WRITER_PROCESS_DRAIN_SECONDS = 60.0
_MAX_FENCES = 1000  # one per takeover; the oldest are dropped beyond this
# Far above a lease with _MAX_FENCES fences; a longer file is read only this far (and then
# does not parse): a lease replaced by a huge file or a device must not exhaust memory.
MAX_LEASE_BYTES = 1 << 20


def _is_count(value: Any) -> bool:
    """A generation or sequence a manifest can hold (a larger one is malformed, like a string)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_GENERATION


def _fences_of(lease: dict[str, Any] | None) -> list[tuple[int, int]]:
    raw = lease.get("fences") if lease else None
    if not isinstance(raw, list):
        return []
    return [(pair[0], pair[1]) for pair in raw
            if isinstance(pair, list) and len(pair) == 2 and _is_count(pair[0]) and _is_count(pair[1])]


def read_fences(storage: Storage) -> list[tuple[int, int]]:
    """The takeover fences recorded in ``writer.lease``: ``(generation, sequence)`` pairs. A
    checkpoint of a generation below ``generation`` whose sequence is above ``sequence`` was
    committed after that generation took over (by a stale writer). Malformed entries are
    ignored; a missing or unreadable lease has none."""
    try:
        data = json.loads(storage.read(LEASE_FILE, MAX_LEASE_BYTES))
    except (OSError, ValueError):
        return []
    return _fences_of(data if isinstance(data, dict) else None)


class WriterLease:
    """Take, hold (fence) and release a run directory's writer lease; see the module docstring.

    Args:
        storage: the run directory.
        stale_after: on filesystems without ``flock``, how many seconds (measured here) a
            lease must stay unchanged before it counts as abandoned.
    """

    def __init__(self, storage: Storage, stale_after: float = 60.0, uses_writer_process: bool = False) -> None:
        self._storage = storage
        self._stale_after = stale_after
        self._token = secrets.token_hex(16)
        self._host = socket.gethostname()
        self.generation = 0
        self.previous_generation = 0
        self._lock_descriptor: int | None = None
        self._trainer_descriptor: int | None = None
        self._beat = 0
        self._fences: list[tuple[int, int]] = []
        self._heartbeat: threading.Thread | None = None
        self._stop_heartbeat = threading.Event()
        self._write_lock = threading.Lock()
        # Whether this writer hands its commits to a writer process (recorded in the lease: a
        # newcomer then waits for that process to finish instead of failing at once).
        self.uses_writer_process = uses_writer_process

    # ---- the lease file -------------------------------------------------------------------
    def _read_raw(self) -> bytes | None:
        try:
            return self._storage.read(LEASE_FILE, MAX_LEASE_BYTES)
        except FileNotFoundError:
            return None
        except OSError:
            return b""  # unreadable: holds nothing

    @staticmethod
    def _parse(raw: bytes | None) -> dict[str, Any] | None:
        if raw is None:
            return None
        try:
            data = json.loads(raw)
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    def _read(self) -> dict[str, Any] | None:
        return self._parse(self._read_raw())

    @staticmethod
    def _describe(lease: dict[str, Any] | None) -> str:
        if not lease:
            return "another writer"
        return f"generation {lease.get('generation')} (pid {lease.get('pid')} on {lease.get('host')})"

    def _record(self, released: bool = False) -> bytes:
        record = {"token": self._token, "generation": self.generation, "pid": os.getpid(),
                  "host": self._host, "beat": self._beat, "released": released,
                  "writer_process": self.uses_writer_process,
                  "fences": [list(fence) for fence in self._fences]}
        return json.dumps(record).encode()

    def _write(self, released: bool = False) -> None:
        with self._write_lock:
            self._beat += 1
            self._storage.replace(LEASE_FILE, self._record(released))

    def _remove_stale_temporaries(self) -> None:
        """``writer.lease.<pid>.tmp`` left by a writer killed (or out of space) mid-replace."""
        try:
            names = self._storage.list_names("")
        except OSError:
            return
        for name in names:
            if _LEASE_TEMPORARY.fullmatch(name) and name != f"{LEASE_FILE}.{os.getpid()}.tmp":
                try:
                    self._storage.remove_file(name)
                except OSError:
                    pass

    # ---- taking the lease -----------------------------------------------------------------
    def acquire(self, minimum_generation: int = 0, committed_sequence: Callable[[], int] | None = None) -> int:
        """Take the lease or raise WriterConflict; returns this writer's generation (one above
        both the previous holder's and ``minimum_generation``). ``committed_sequence()``, asked
        once the lease is free, gives the highest sequence committed so far: the takeover fence
        recorded for this generation."""
        if self._storage.is_local:
            self._lock_locally()
            current = self._read()
        else:
            current = self._wait_until_abandoned()
        previous = current.get("generation", 0) if current else 0
        previous = previous if _is_count(previous) else 0
        self.previous_generation = previous  # the last holder's (a fast tier must name it)
        self.generation = max(previous, minimum_generation) + 1
        if self.generation > MAX_GENERATION:
            self._unlock()
            raise CheckpointWriteError(
                f"{self._storage.url}: the newest writer generation recorded there (in {LEASE_FILE} or a "
                f"checkpoint's manifest) is {self.generation - 1}, the largest a manifest holds; this writer's "
                "checkpoints could never be read back. No real run gets there: remove the checkpoint or lease "
                "that records it, or start in a new directory"
            )
        fence = committed_sequence() if committed_sequence is not None else 0
        self._fences = [*_fences_of(current), (self.generation, fence)][-_MAX_FENCES:]
        try:
            self._write()
            self.verify()  # on an object store, a writer racing us would have replaced the file
        except BaseException:
            self._unlock()
            raise
        self._remove_stale_temporaries()
        if not self._storage.is_local:
            self._start_heartbeat()
        return self.generation

    def _lock_locally(self) -> None:
        path = self._storage.writable_path(LOCK_FILE)
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            self._lock_or_wait_for_writer_process(descriptor)
        except OSError as error:
            os.close(descriptor)
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise WriterConflict(
                f"{self._storage.url} is being written by {self._describe(self._read())}, a live "
                f"process holding {LOCK_FILE}; two writers would interleave checkpoints. Stop the "
                "other job first (the lock goes away with its process)"
            ) from None
        self._lock_descriptor = descriptor
        _LOCK_DESCRIPTORS.add(descriptor)
        if self.uses_writer_process:
            self._trainer_descriptor = self._lock_trainer_file()

    def _lock_trainer_file(self) -> int | None:
        """Lock :data:`TRAINER_LOCK_FILE` for this process alone (never passed to the writer
        process; closed in forked children); None where it cannot be locked (the newcomer then
        waits, as for a killed run)."""
        descriptor = try_lock(self._storage.writable_path(TRAINER_LOCK_FILE),
                              os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, fcntl.LOCK_EX)
        if descriptor is not None:
            _LOCK_DESCRIPTORS.add(descriptor)
        return descriptor

    def _training_process_lives(self) -> bool:
        """Whether the holder's training process still holds :data:`TRAINER_LOCK_FILE`."""
        try:
            descriptor = os.open(self._storage.writable_path(TRAINER_LOCK_FILE),
                                 os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # none: a holder of an earlier version, or it never locked one
            return False
        try:
            fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as error:
            return error.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
        finally:
            os.close(descriptor)  # drops the shared lock taken to test it
        return False

    def _lock_or_wait_for_writer_process(self, descriptor: int) -> None:
        """Take the flock; when a holder recorded a writer process (which outlives a killed
        training process to commit its last snapshot), wait for it, bounded, with one line on
        stderr. Raises the OSError of the last attempt."""
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as error:
            holder = self._read()
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or not holder \
                    or holder.get("writer_process") is not True or holder.get("released") is True \
                    or self._training_process_lives():
                raise
        print(f"splitloop: {self._storage.url} is held by {self._describe(holder)}, which writes through a writer "
              f"process; waiting up to {WRITER_PROCESS_DRAIN_SECONDS:.0f} s for it to commit its last checkpoint",
              file=sys.stderr, flush=True)
        deadline = time.monotonic() + WRITER_PROCESS_DRAIN_SECONDS
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)

    def handover(self) -> dict[str, Any]:
        """What a writer process needs to write under this lease (:meth:`adopt`): plain data."""
        return {"token": self._token, "generation": self.generation, "previous_generation": self.previous_generation,
                "stale_after": self._stale_after, "lock_descriptor": self._lock_descriptor}

    @classmethod
    def adopt(cls, storage: Storage, handover: dict[str, Any]) -> "WriterLease":
        """The lease of the process that started this writer process, from :meth:`handover`;
        its lock descriptor was inherited (the flock is shared while either process lives)."""
        lease = cls(storage, stale_after=float(handover["stale_after"]), uses_writer_process=True)
        lease._token = str(handover["token"])
        lease.generation = int(handover["generation"])
        lease.previous_generation = int(handover["previous_generation"])
        descriptor = handover["lock_descriptor"]
        lease._lock_descriptor = None if descriptor is None else int(descriptor)
        return lease

    def _wait_until_abandoned(self) -> dict[str, Any] | None:
        """Watch a lease that is not released until it stays unchanged for ``stale_after``
        seconds of our own monotonic clock; WriterConflict as soon as it changes."""
        raw = self._read_raw()
        lease = self._parse(raw)
        if not lease or lease.get("released") is True:
            return lease
        started = time.monotonic()
        poll = min(1.0, self._stale_after / 10)
        while time.monotonic() - started < self._stale_after:
            time.sleep(poll)
            now = self._read_raw()
            if now != raw:
                newer = self._parse(now)
                if newer is None or (newer and newer.get("released") is True):
                    return newer  # released (or removed) while we watched
                raise WriterConflict(
                    f"{self._storage.url} is being written by {self._describe(newer)}: its lease "
                    "heartbeat moved while this process watched it; two writers would interleave "
                    "checkpoints. Stop the other job first"
                )
        return lease

    # ---- holding it ----------------------------------------------------------------------
    def verify(self) -> None:
        """The fence: raise WriterConflict unless the lease is still this writer's."""
        current = self._read()
        if not current or current.get("token") != self._token or current.get("released") is True:
            holder = self._describe(current) if current else "nobody (the lease file is gone)"
            raise WriterConflict(
                f"{self._storage.url}: the writer lease now belongs to {holder}; this writer "
                f"(generation {self.generation}) stops without committing"
            )
        if self._lock_descriptor is not None and not self._still_locked_file():
            raise WriterConflict(
                f"{self._storage.url}: {LOCK_FILE} was removed or replaced while this writer "
                f"(generation {self.generation}) held it; it stops without committing"
            )

    def _still_locked_file(self) -> bool:
        assert self._lock_descriptor is not None
        try:
            on_disk = os.stat(self._storage.path(LOCK_FILE), follow_symlinks=False)
        except FileNotFoundError:
            return False
        held = os.fstat(self._lock_descriptor)
        return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)

    def _start_heartbeat(self) -> None:
        self._stop_heartbeat.clear()
        self._heartbeat = threading.Thread(target=self._beat_until_stopped, name="splitloop-lease-heartbeat",
                                           daemon=True)
        self._heartbeat.start()

    def _beat_until_stopped(self) -> None:
        while not self._stop_heartbeat.wait(self._stale_after / 3):
            try:
                self.verify()  # never overwrite a lease that someone else took over
                self._write()
            except Exception:  # noqa: BLE001 - a lost or unwritable lease surfaces at the next fence
                return

    # ---- releasing it --------------------------------------------------------------------
    def release(self) -> None:
        """Mark the lease released (its generation stays on record) and drop the lock."""
        self._stop_heartbeat.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        try:
            current = self._read()
            if current and current.get("token") == self._token and self.generation:
                self._write(released=True)
        finally:
            self._unlock()

    def _unlock(self) -> None:
        if self._trainer_descriptor is not None:
            descriptor, self._trainer_descriptor = self._trainer_descriptor, None
            _LOCK_DESCRIPTORS.discard(descriptor)
            os.close(descriptor)
        if self._lock_descriptor is not None:
            descriptor, self._lock_descriptor = self._lock_descriptor, None
            _LOCK_DESCRIPTORS.discard(descriptor)
            os.close(descriptor)  # closing the last descriptor drops the flock


# A forked child (a DataLoader worker) inherits the lock's descriptor, and the flock lives as long
# as any process holds one: a worker outliving a killed writer would keep the next writer out.
# Forked children close them at once; only the writer itself holds the lock.
_LOCK_DESCRIPTORS: set[int] = set()


def close_in_forked_children(descriptors: set[int]) -> None:
    """Have every forked child close the descriptors ``descriptors`` holds at the fork (a set
    its owner keeps up to date), so that none outlives its owner's intent in a child."""
    def close_all() -> None:
        for descriptor in list(descriptors):
            try:
                os.close(descriptor)
            except OSError:
                pass
        descriptors.clear()

    os.register_at_fork(after_in_child=close_all)


close_in_forked_children(_LOCK_DESCRIPTORS)
