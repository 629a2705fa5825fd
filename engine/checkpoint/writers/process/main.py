"""The writer process: ``python -m engine.checkpoint.writers.process.main`` (started by
engine.checkpoint.writers.process.writer, never by hand).

It reads its configuration and then the snapshots from stdin (engine.checkpoint.writers.process.channel),
maps the shared-memory slot each snapshot names (engine.checkpoint.writers.process.arena), and commits
it through the same path as the in-process writers (engine.checkpoint.writers.writer.SyncWriter: the
fence, the metrics lines, CheckpointStore's commit protocol, retention) under the training
process's lease, whose lock descriptor it inherited. With ``when_behind="skip"`` a snapshot
not yet taken up is replaced by a newer one ("latest wins"), unless it must be kept (a forced
one, or one that records a monitored value).

It imports neither torch nor NumPy (tests/checkpoint/writers/test_torch_free_writer.py): a slot's bytes
are one ``memoryview`` written as they are, and the process starts in a fraction of a second
of CPU instead of torch's import, which a short run would wait for at its end.

One rank of a torchrun job: it first joins the other ranks' writer processes (the module its
configuration names: engine.distributed.writer_processes, which imports torch), and commits as
the rank's writer thread would; orphaned, it commits nothing more (see that module).

It ends when the training process says ``close`` (after committing every snapshot received),
or when the training process is gone (stdin at EOF, or a new parent): then it commits the
newest complete snapshot it received, releases the lease and exits.
"""

from __future__ import annotations

import collections
import importlib
import os
import select
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

from engine import faults
from engine.checkpoint.format.encoded_state import EncodedState
from engine.checkpoint.format.manifest import MonitorRecord
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.lease import WriterLease
from engine.checkpoint.store.metrics_log import METRICS_FILE, MetricsLog
from engine.checkpoint.store.retention import Retention
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.writers.pending import PendingCheckpoint
from engine.checkpoint.writers.process.arena import SlotFile, remove_arena_directory
from engine.checkpoint.writers.process.channel import WRITER_IGNORED_SIGNALS, FrameReader, encode_message, write_all
from engine.checkpoint.writers.process.messages import CloseMessage, SnapshotMessage, WriterConfig, kind_of
from engine.checkpoint.writers.committer import Committer
from engine.checkpoint.writers.writer import SyncWriter
from engine.errors import CheckpointWriteError, WriterConflict
from progress import Cursor

_PARENT_POLL_SECONDS = 0.5


class Events:
    """The pipe back to the training process (several threads send on it)."""

    def __init__(self, descriptor: int) -> None:
        self._descriptor = descriptor
        self._lock = threading.Lock()
        self.broken = False

    def send(self, **message: Any) -> None:
        with self._lock:
            if self.broken:
                return
            try:
                write_all(self._descriptor, encode_message(message))
            except OSError:  # the training process is gone: what is left is committed anyway
                self.broken = True


class SlotWriter(SyncWriter):
    """The in-process synchronous writer, telling the training process when a slot's bytes
    are written (it may reuse the slot from then on)."""

    def __init__(self, events: Events, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._events = events
        # id() of a pending checkpoint -> (its slot file, locked; the slot; the snapshot's id)
        self._held: dict[int, tuple[SlotFile, int, int]] = {}

    def hold(self, pending: PendingCheckpoint, slot_file: SlotFile, slot: int, identifier: int) -> None:
        """``pending``'s bytes are ``slot_file``'s (locked) until :meth:`release`."""
        self._held[id(pending)] = (slot_file, slot, identifier)

    def release(self, pending: PendingCheckpoint) -> None:
        held = self._held.pop(id(pending), None)
        if held is not None:
            slot_file, slot, identifier = held
            slot_file.unlock()
            self._events.send(kind="released", slot=slot, id=identifier)


class Inbox:
    """The snapshots received and not yet taken up, filled by a reader thread."""

    def __init__(self, input_descriptor: int, reader: FrameReader, events: Events, metrics: MetricsLog,
                 latest_wins: bool) -> None:
        self._input = input_descriptor
        self._metrics = metrics
        self._events = events
        self._latest_wins = latest_wins
        self._condition = threading.Condition()
        self._queue: collections.deque[SnapshotMessage] = collections.deque()
        self.closing = False
        self.orphaned = False
        self._parent = os.getppid()
        self._reader = reader
        self._thread = threading.Thread(target=self._read_until_end, name="splitloop-writer-inbox", daemon=True)

    def start(self, received: list[dict[str, Any]]) -> None:
        """Start reading (``received``: messages read with the configuration)."""
        for message in received:
            if not self._accept(message):
                return
        self._thread.start()

    def _read_until_end(self) -> None:
        while True:
            ready, _, _ = select.select([self._input], [], [], _PARENT_POLL_SECONDS)
            if not ready:
                if os.getppid() != self._parent:
                    break
                continue
            data = os.read(self._input, 1 << 20)
            if not data:
                break
            for message in self._reader.feed(data):
                if not self._accept(message):
                    return
        with self._condition:  # the training process is gone (a partial message is dropped)
            self.orphaned = True
            self._condition.notify_all()

    def _accept(self, received: dict[str, Any]) -> bool:
        with self._condition:
            if kind_of(received) == CloseMessage.KIND:
                CloseMessage.from_dict(received)
                self.closing = True
                self._condition.notify_all()
                return False
            message = SnapshotMessage.from_dict(received)
            # In the order sent, whatever becomes of the snapshot: a later one counts its lines.
            self._metrics.receive_at(message.metrics_base, message.metrics)
            if self._latest_wins:
                for queued in [queued for queued in self._queue if not queued.keep]:
                    self._queue.remove(queued)
                    self._events.send(kind="superseded", id=queued.id, slot=queued.slot)
            self._queue.append(message)
            self._condition.notify_all()
            return True

    def take(self, orphan_commits: bool = True) -> SnapshotMessage | None:
        """The next snapshot to commit; None once there is none and none will come (nor, when
        the training process is gone and not ``orphan_commits``, any more)."""
        with self._condition:
            while not self._queue and not (self.closing or self.orphaned):
                self._condition.wait()
            if self.orphaned and not orphan_commits:
                return None
            return self._queue.popleft() if self._queue else None


class WriterProcess:
    """Commits the snapshots of the :class:`Inbox` one at a time."""

    def __init__(self, config: WriterConfig, input_descriptor: int, reader: FrameReader, events: Events) -> None:
        self._events = events
        storage = Storage(config.run_dir)
        self._lease = WriterLease.adopt(storage, config.lease)
        self._arena = config.arena
        # One rank of a torchrun job: it commits with the other ranks' writer processes.
        committer: Committer | None = None
        self._leave_group: Callable[[], None] | None = None
        if config.group is not None:
            exit_when_orphaned(config.arena)  # before the join, which waits for every rank's
            committer, self._leave_group = join_group(config.group, storage)
        self._in_group = committer is not None
        metrics = MetricsLog(storage if committer is None or committer.commits else None)
        metrics.committed_bytes = config.metrics_bytes
        metrics.fence_with(self._lease.verify)
        retention = Retention(config.keep_last, config.keep_best, config.monitor, frozenset(config.abandoned))
        also_sync = [METRICS_FILE] if storage.is_local else []
        self._store = CheckpointStore(storage)
        self._writer = SlotWriter(self._events, self._store, self._lease, retention, lambda: also_sync, committer, metrics)
        self._metrics = metrics
        self._slot_files: dict[int, SlotFile] = {}
        self._inbox = Inbox(input_descriptor, reader, self._events, metrics, latest_wins=config.when_behind == "skip")

    def run(self, received: list[dict[str, Any]]) -> None:
        self._inbox.start(received)
        # A rank's writer process whose training process is gone commits nothing more: the other
        # ranks' hold other snapshots by then, and each commit needs all of them.
        while (message := self._inbox.take(orphan_commits=not self._in_group)) is not None:
            if not self._commit(message):
                break
        self._store.close()
        if self._inbox.orphaned:  # nobody else will: the slot files and the lease are ours to clean up
            remove_arena_directory(self._arena)
            self._lease.release()
        if self._leave_group is not None:
            self._leave_group()

    def _commit(self, message: SnapshotMessage) -> bool:
        """Commit one snapshot and report it; False when this writer must stop (lease lost)."""
        pending = self._take_up(message)
        if pending is None:
            return True
        # How long the write took and when it ended (time.monotonic(): one clock for every process
        # of the machine), what the training process's watchdog times its waits for this writer by.
        began = time.monotonic()
        try:
            self._writer.commit_one(pending)
        except WriterConflict as error:
            self._events.send(kind="failed", id=message.id, error="WriterConflict", message=str(error))
            return False
        except Exception as error:  # reported to the training process, which applies on_io_error
            ended = time.monotonic()
            self._events.send(kind="failed", id=message.id, error=type(error).__name__, message=str(error),
                              took=ended - began, ended=ended)
        else:
            ended = time.monotonic()
            self._events.send(kind="committed", id=message.id, name=self._writer.last_name,
                              metrics_bytes=message.metrics_bytes, took=ended - began, ended=ended)
        finally:
            self._writer.release(pending)
        return True

    def _take_up(self, message: SnapshotMessage) -> PendingCheckpoint | None:
        """Lock the snapshot's slot and check that it still holds it; the checkpoint to commit
        (its slot locked until released), or None when a newer snapshot replaced it there."""
        try:
            slot_file = self._slot_file(message.slot, message.path, message.size)
        except FileNotFoundError:  # the slot was taken back and laid out again: a newer one is coming
            self._events.send(kind="superseded", id=message.id, slot=message.slot)
            return None
        slot_file.lock()
        if slot_file.generation != message.id:
            slot_file.unlock()
            self._events.send(kind="superseded", id=message.id, slot=message.slot)
            return None
        encoded = EncodedState(message.header, [], [(0, message.size)], flat=slot_file.flat)
        cursor = None if message.cursor is None else Cursor.from_dict(message.cursor)
        monitor = None if message.monitor is None else MonitorRecord(*message.monitor)
        pending = PendingCheckpoint(encoded, message.progress, cursor, metrics_bytes=message.metrics_bytes,
                                    durable=message.durable, monitor=monitor, anchor=message.anchor,
                                    digest=message.digest)
        self._writer.hold(pending, slot_file, message.slot, message.id)
        return pending

    def _slot_file(self, slot: int, path: str, size: int) -> SlotFile:
        """The slot's file, mapped once per layout (a new layout is a new file)."""
        known = self._slot_files.get(slot)
        if known is None or known.path != path:
            if known is not None:
                known.close()
            known = self._slot_files[slot] = SlotFile(path, size, create=False)
        return known


def exit_when_orphaned(arena: str) -> None:
    """A rank's writer process (torchrun) ends as soon as its training process is gone (a new
    parent), whatever its main thread is in: its group's join, or a collective that waits for a
    writer process that will never answer (stopped, or waiting for its own training process).
    It commits nothing after that anyway (engine.distributed.writer_processes), and a kill at
    any moment leaves each checkpoint whole or absent; the lease's lock goes with the process,
    as after a SIGKILL. Without this, such a wait would last the group's timeout (30 minutes)
    and keep the lease's lock from the restarted group that long."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_SECONDS)
        remove_arena_directory(arena)
        sys.stderr.flush()
        os._exit(0)

    threading.Thread(target=watch, name="splitloop-writer-orphaned", daemon=True).start()


def join_group(spec: dict[str, Any], storage: Storage) -> tuple[Committer, Callable[[], None]]:
    """Join the writer processes of the other ranks of a torchrun job: the committer that takes
    over this rank's commits, and what leaves the group at the end. ``spec["module"]``
    (engine.distributed.writer_processes, named by the training process: this package imports
    nothing of the layers above it) does both, and imports torch (the writer process of a
    process alone never does)."""
    name = spec.get("module")
    if not isinstance(name, str) or not name.startswith("engine."):
        raise CheckpointWriteError(f"writer process: a group spec names the module {name!r}, not one of the engine's")
    module = importlib.import_module(name)
    committer: Committer = module.join_writer_group(spec, storage)
    return committer, module.leave_writer_group


def read_configuration(input_descriptor: int, reader: FrameReader) -> list[dict[str, Any]]:
    """The messages up to the configuration (first) and any read with it; [] at end of file."""
    received: list[dict[str, Any]] = []
    while not received:
        data = os.read(input_descriptor, 1 << 16)
        if not data:
            return []
        received = reader.feed(data)
    return received


def main(argv: list[str]) -> int:
    """``argv``: the descriptor of the events pipe (engine.checkpoint.writers.process.writer)."""
    for number in WRITER_IGNORED_SIGNALS:  # blocked since the start; ignored, a pending one is dropped
        signal.signal(number, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, WRITER_IGNORED_SIGNALS)
    faults.arm_from_environment()  # the fault points of the commit path (tests, engine.testing)
    events = Events(int(argv[0]))
    input_descriptor, reader = sys.stdin.fileno(), FrameReader()
    received = read_configuration(input_descriptor, reader)
    if not received or kind_of(received[0]) != WriterConfig.KIND:
        return 0  # the run ended before it wrote anything
    try:
        WriterProcess(WriterConfig.from_dict(received[0]), input_descriptor, reader, events).run(received[1:])
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    status = main(sys.argv[1:])
    # Everything is committed, closed and reported by now; the interpreter's teardown (about
    # 20 ms) would only delay the end of fit, which waits for this process to exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
