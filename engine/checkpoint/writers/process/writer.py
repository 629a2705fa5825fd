"""``CheckpointConfig(writer="process")``: checkpoints written by a writer
process, so that a checkpoint costs the training process one copy of its tensors.

The training process encodes the state's description (engine.checkpoint.format.codec), copies the
tensors in bulk into a slot of shared memory (engine.checkpoint.writers.process.arena) and sends the
writer process a message naming the slot (engine.checkpoint.writers.process.channel). The writer process
(engine.checkpoint.writers.process.main, started with ``subprocess`` as ``python -m``: never forked from
a process that holds CUDA, never a ``multiprocessing`` spawn that re-imports the user's
``__main__``) does the rest through the same commit path as the in-process writers.

* **Lease**: the writer process inherits the lease's lock descriptor (``pass_fds``): the flock
  holds while either process lives, and the writer checks the fence before each commit as
  today. The lease records that a writer process is in use, so a restart of a killed run waits
  (bounded, with a line on stderr) for that process to finish its last commit.
* **Slots**: ``max_in_flight`` slots with ``when_behind="wait"`` (a snapshot waits for a free
  one); two more with ``"skip"``, where a snapshot not yet taken up is replaced by a newer one
  ("latest wins") and the training process never waits.
* **The training process killed**: the writer process sees its stdin close (or its parent
  change), commits the newest complete snapshot it received, releases the lease and exits.
* **The writer process dies**: noticed at the next checkpoint (or split boundary check); one
  line on stderr, and a new writer process is started once, which is handed every snapshot
  not yet committed whose slot still holds it (even one whose files the dead writer had
  written already: a slot is overwritten only by a newer snapshot, and one that must be kept
  holds its slot until committed), and the metrics lines not yet committed. A second death
  fails the checkpoint (CheckpointWriteError, under ``on_io_error``).
* **The writer process hangs** (stopped, or in a storage write that never returns) with
  ``on_io_error="warn"`` in a process alone (``abandon_hung``): a wait for it that reaches the
  watchdog's deadline reports it (engine.watchdog.abandon: its pid and the checkpoint), SIGKILLs
  it, counts that checkpoint as not written (CheckpointWriteError, a warning under "warn") and
  starts a new writer process, handed the other snapshots as after a death (not counted as one).
  A killed process can do nothing late. Without ``abandon_hung`` (``"raise"``), the watchdog ends
  the training process (a hang exit) as for any other hang.

* **Under torchrun** every rank has a writer process; they commit together in a group of their
  own (engine.distributed.writer_processes, named to the writer process in its configuration).
  One that dies is not restarted (its group cannot take a newcomer in): the rank's next
  checkpoint fails, and a restart of the group resumes.

Local run directories only, for now (the writer process rebuilds the storage from its path).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import fcntl
import math
import os
import select
import subprocess
import sys
import time
from typing import Any

from engine import faults
from engine.checkpoint.format.codec import EncodedState
from engine.checkpoint.store.lease import WriterLease, close_in_forked_children
from engine.checkpoint.store.metrics_log import MetricsLog
from engine.checkpoint.store.retention import Retention
from engine.checkpoint.store.storage import Storage
from engine.checkpoint.writers.pending import PendingCheckpoint
from engine.checkpoint.writers.process.arena import (ArenaDirectory, SharedSnapshotBuffers, make_arena_directory,
                                                     remove_orphaned_arena_directories)
from engine.checkpoint.writers.process.channel import WRITER_IGNORED_SIGNALS, FrameReader, encode_message, write_all
from engine.checkpoint.writers.process.messages import CloseMessage, Message, SnapshotMessage, WriterConfig
from engine.checkpoint.writers.worker import BackgroundWork
from engine.data.workers import preemption_signals_blocked
from engine.errors import CheckpointWriteError, WriterConflict
from engine.watchdog import WRITER, abandon, mark as mark_phase, write_took
from engine.watchdog.report import process_state

# How long the training process waits for the writer process to answer before it checks that
# the process still lives (a wait itself is unbounded only while the process lives).
_POLL_SECONDS = 0.2
_MAX_RESTARTS = 1
# Descriptors of pipes to writer processes: a forked child (a DataLoader worker) must not keep
# a writer's stdin open, or the writer would not see the training process die.
_PIPE_DESCRIPTORS: set[int] = set()


@dataclasses.dataclass
class _Published:
    """A snapshot sent to the writer process and not yet committed (or failed, or superseded)."""

    message: SnapshotMessage
    slot: int
    # False once its slot was taken for a newer snapshot (until then a restarted writer
    # process can still commit it from there, even after its files were written once).
    slot_holds_it: bool = True
    # The writer process released the slot (its bytes are in the checkpoint's files): a
    # snapshot that must be kept still holds its slot until it is committed.
    read: bool = False
    # The splits the run had completed when it was handed over (None without a watchdog).
    split: int | None = None
    # When it was handed to the current writer process (time.monotonic()).
    sent_at: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def keep(self) -> bool:
        """Never replaced by a newer snapshot (a forced one, or one recording a monitored value)."""
        return self.message.keep


class ProcessWriter:
    """The training process's side of a writer process (see the module docstring); used by
    engine.checkpoint.policy.RunCheckpointer like the in-process writers."""

    def __init__(self, launched: "LaunchedWriter", storage: Storage, lease: WriterLease, retention: Retention,
                 metrics: MetricsLog, max_in_flight: int, when_behind: str, abandon_hung: bool = False,
                 group: dict[str, Any] | None = None) -> None:
        self._storage = storage
        # A torchrun rank: how its writer process joins the others' (engine.distributed.writer_processes).
        # Such a writer process is never restarted: its group cannot take a newcomer in.
        self._group = group
        # A wait that reaches the watchdog's deadline kills a hung writer process and starts
        # another (see the module docstring); the checkpoints abandoned so.
        self._abandons = abandon_hung
        self.abandoned = 0
        # A writer process restarted (after a death or a hang) that has not ended a commit yet:
        # the waits for it have the watchdog's first allowance (it imports and maps its slots
        # first, and its first retention verifies checkpoints it did not write, importing torch).
        self._fresh = False
        self._lease = lease
        self._retention = retention
        self._metrics = metrics
        self._when_behind = when_behind
        self._arena = launched.arena
        count = max_in_flight + (2 if when_behind == "skip" else 0)
        self._slots = [SharedSnapshotBuffers(self._arena.path, index) for index in range(count)]
        self._free = list(range(count))
        self._occupant: dict[int, int] = {}  # slot -> the id of the snapshot copied into it last
        self._published: dict[int, _Published] = {}
        self._next_id = 0
        self._errors: list[BaseException] = []
        self._committed_metrics = metrics.committed_bytes  # metrics.jsonl's length at the last commit
        self._handed = bytearray()  # metrics bytes handed over since then (a new writer needs them)
        self.last_name: str | None = None
        self.last_end = -math.inf
        self._write_ended = -math.inf  # when the writer process ended its last write (its own reading)
        self.skipped = 0
        self._carried = b""  # metrics bytes for the next message (after a restart)
        self._restarts = 0
        self._closing = False
        self._lease_lost: WriterConflict | None = None  # reported by the writer process, which then stopped
        self._configure(launched)

    # ---- the process ----------------------------------------------------------------------
    def _configure(self, launched: "LaunchedWriter") -> None:
        """Take ``launched`` as this run's writer process and send it its configuration."""
        self._launched = launched
        self._process, self._input, self._events = launched.process, launched.input, launched.events
        self._reader = FrameReader()
        self._outbox: collections.deque[Message] = collections.deque()
        self._unsent = bytearray()  # the part of a message the pipe did not take yet
        os.set_blocking(self._input, False)
        retention = self._retention
        self._send(WriterConfig(self._storage.root, self._lease.handover(), self._arena.path, self._committed_metrics,
                                retention.keep_last, retention.keep_best, retention.monitor, sorted(retention.abandoned),
                                self._when_behind, self._group))

    def _stop_pipes(self) -> None:
        self._launched.close_pipes()

    def _writer_died(self) -> None:
        """The writer process ended without being asked: restart it once, handing it what it
        had not committed; a second time, fail. One that stopped because the run lost its
        lease (it reported WriterConflict) is not restarted: that error is raised."""
        code = self._process.wait()
        self._drain_events()
        self._stop_pipes()
        if self._lease_lost is not None:
            self._closing = True  # it stopped on purpose: another job owns the run dir; a new one would too
            raise self._lease_lost
        restarts = 0 if self._group is not None else _MAX_RESTARTS
        print(f"splitloop: the checkpoint writer process (pid {self._process.pid}) exited with code {code}; "
              + ("restarting it" if self._restarts < restarts else "no checkpoint is written from now on"),
              file=sys.stderr, flush=True)
        if self._restarts >= restarts:
            self._closing = True
            if self._group is not None:
                raise CheckpointWriteError(
                    f"the checkpoint writer process of rank {self._group['rank']} died (exit code {code}); under torchrun "
                    "it is not restarted (the ranks' writer processes commit together): earlier checkpoints are intact, "
                    "and a restart of the group resumes from them")
            raise CheckpointWriteError(f"the checkpoint writer process died {self._restarts + 1} times (last exit "
                                       f"code {code}); earlier checkpoints are intact")
        self._restarts += 1
        self._configure(LaunchedWriter(self._lease, inherit_faults=False, arena=self._arena))
        self._fresh = True
        self._hand_over_again()

    def _hand_over_again(self) -> None:
        """Send the new writer process the snapshots still in their slots, and the metrics
        lines handed over since the last commit (with the first message sent)."""
        carried = bytes(self._handed)
        held = {published.slot for published in self._published.values() if published.slot_holds_it}
        self._free = [slot for slot in range(len(self._slots)) if slot not in held]
        base = self._committed_metrics
        for identifier in sorted(self._published):
            published = self._published[identifier]
            if not published.slot_holds_it:
                del self._published[identifier]  # a newer snapshot, already sent or to come, supersedes it
                continue
            published.message.metrics, published.message.metrics_base, carried = carried, base, b""
            base += len(published.message.metrics)
            published.sent_at = time.monotonic()
            self._send(published.message)
        self._carried = carried

    def _alive(self) -> bool:
        return self._process.poll() is None

    # ---- events -----------------------------------------------------------------------------
    def _drain_events(self) -> bool:
        """Apply every event the writer process sent; False at end of file (it exited)."""
        while True:
            try:
                data = os.read(self._events, 1 << 16)
            except BlockingIOError:
                return True
            except OSError as error:
                if error.errno == errno.EBADF:
                    return False
                raise
            if not data:
                return False
            for event in self._reader.feed(data):
                self._apply(event)

    def _apply(self, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        if kind in ("committed", "failed"):
            self._fresh = False  # a commit's whole path ran once (its first retention may import torch)
        if kind == "released":
            self._release_slot(event["slot"], event["id"])
            return
        published = self._published.pop(event["id"], None)
        if "took" in event:  # a write ended, timed by the writer process (what its waits are timed by)
            write_took(event["took"])
            self._write_ended = event["ended"]
        self.last_end = time.monotonic()
        if kind == "superseded":
            self.skipped += 1
            self._release_slot(event["slot"], event["id"])
        elif kind == "committed":
            self._settle(published, event["id"])
            self.last_name = event["name"]
            del self._handed[:max(0, event["metrics_bytes"] - self._committed_metrics)]
            self._committed_metrics = event["metrics_bytes"]  # lower after a rollback
            self._metrics.committed(event["metrics_bytes"])
        elif kind == "failed":
            self._settle(published, event["id"])
            error_type = WriterConflict if event["error"] == "WriterConflict" else CheckpointWriteError
            error = error_type(f"checkpoint writer process: {event['message']}")
            if isinstance(error, WriterConflict):
                self._lease_lost = error
            self._errors.append(error)

    def _release_slot(self, slot: int, identifier: int) -> None:
        """The writer is done reading snapshot ``identifier`` in ``slot``: free the slot, unless
        a newer snapshot took it back already (see :meth:`_take_back_slot`), or the snapshot
        must be kept and is not committed yet (a writer process that dies before its commit
        point leaves it to the next one, which reads it from its slot again)."""
        if self._occupant.get(slot) != identifier:
            return
        published = self._published.get(identifier)
        if published is not None and published.keep:
            published.read = True  # freed by its commit (or failure): see _settle
            return
        if slot not in self._free:
            self._free.append(slot)

    def _settle(self, published: _Published | None, identifier: int) -> None:
        """Snapshot ``identifier`` is committed or failed: free the slot a kept one still held."""
        if published is not None and published.read:
            self._release_slot(published.slot, identifier)  # no longer in self._published: freed

    def _wait_for_events(self) -> None:
        """Wait a little for events, then apply them; restart a writer process that died, and
        (``abandon_hung``) abandon one that hangs past the watchdog's deadline."""
        mark_phase(WRITER, f"writer process {self._process.pid}, {len(self._published)} snapshot(s) in flight",
                   abandons=self._abandons, fresh=self._fresh, since=self._writing_since())
        select.select([self._events], [], [], abandon.remaining(_POLL_SECONDS) if self._abandons else _POLL_SECONDS)
        if not self._drain_events() or not self._alive():
            self._writer_died()
        elif self._abandons and abandon.past_deadline():
            self._abandon_process()

    def _writing_since(self) -> float | None:
        """When the writer process began the write it is in (it writes its snapshots in order:
        the oldest in flight, from when it was sent or the one before it ended, whichever came
        later); None when it has none."""
        if not self._published:
            return None
        return max(self._published[min(self._published)].sent_at, self._write_ended)

    def _abandon_if_overdue(self) -> None:
        """``when_behind="skip"`` never waits for the writer process: at each check, abandon it
        when it has had its oldest snapshot for a wait's whole timeout
        (engine.watchdog.abandon.writer_timeout)."""
        limit = abandon.writer_timeout()
        if limit is None or not self._published:
            return
        since = self._writing_since()
        assert since is not None
        writing_s = time.monotonic() - since
        if writing_s >= limit:
            self._abandon_process(writing_s)

    def _abandon_process(self, writing_s: float | None = None) -> None:
        """The writer process has not answered by the watchdog's deadline: report it (its pid,
        the oldest checkpoint in its hands: the one it writes), SIGKILL it, count that checkpoint
        as not written, and start a new writer process with the rest (as after a death)."""
        process = self._process
        stuck = min(self._published) if self._published else None
        split = "?" if stuck is None or self._published[stuck].split is None else self._published[stuck].split
        what = "no checkpoint" if stuck is None else f"checkpoint of split {split}"
        abandon.report("the writer process is killed (SIGKILL) and a new one started; the checkpoint it was writing "
                       "is not written (on_io_error='warn') and training goes on",
                       f"writer process {process.pid}, {what}", process_state(process.pid), writing_s)
        process.kill()
        process.wait()
        self._drain_events()  # what it said before it stopped
        self._stop_pipes()
        if stuck is not None and stuck in self._published:  # not committed after all
            del self._published[stuck]
            self.abandoned += 1
            self._errors.append(CheckpointWriteError(
                f"the checkpoint of split {split} was abandoned: the checkpoint writer process (pid {process.pid}) had "
                "not finished it within the watchdog's timeout and was killed (see hangs.jsonl)"))
        self._configure(LaunchedWriter(self._lease, inherit_faults=False, arena=self._arena))
        self._fresh = True
        self._hand_over_again()

    # ---- what the checkpointer calls -------------------------------------------------------
    def submit(self, pending: PendingCheckpoint, force: bool = False) -> bool:
        """Copy the snapshot's tensors into a free slot and send it; always True (a snapshot
        replaced by a newer one is counted in :attr:`skipped` when the writer says so)."""
        self.check()
        slot = self._take_slot()
        self._overwrite(slot)
        buffers = self._slots[slot]
        encoded = pending.encoded
        identifier = self._next_id
        self._occupant[slot] = identifier
        try:
            buffers.capture(encoded.tensors, encoded.layout)
            buffers.wait_until_copied()
        except BaseException:
            self._occupant.pop(slot, None)
            self._free.append(slot)
            buffers.publish(-1)  # holds no snapshot
            raise
        buffers.publish(identifier)
        self._send_snapshot(pending, encoded, slot, buffers.path, keep=force or pending.monitor is not None)
        return True

    def _overwrite(self, slot: int) -> None:
        """``slot`` is about to take a new snapshot: the one it held can no longer be handed over."""
        for published in self._published.values():
            if published.slot == slot:
                published.slot_holds_it = False

    def _take_slot(self) -> int:
        """A slot to copy the next snapshot into, locked: a free one; with "skip", else one
        whose snapshot the writer has not taken up (latest wins); else wait for one."""
        while True:
            if self._free:
                slot = self._free.pop()
                self._slots[slot].lock()
                return slot
            if self._when_behind == "skip":
                taken_back = self._take_back_slot()
                if taken_back is not None:
                    return taken_back
            self._wait_for_events()

    def _take_back_slot(self) -> int | None:
        """The slot of the oldest replaceable snapshot the writer process has not taken up
        (its lock is free), locked; the writer will find a newer generation there and report
        that snapshot superseded. None when every slot is taken up or must be kept."""
        # Only a slot's last occupant can be taken back: a walk over the slots, not over every
        # snapshot queued while a writer process starts (the training process pays for each).
        for identifier in sorted(self._occupant.values()):
            published = self._published.get(identifier)
            if published is None or published.keep or not published.slot_holds_it:
                continue
            if self._withdraw_unsent(identifier):
                self._slots[published.slot].lock()
                return published.slot
            if self._slots[published.slot].lock(wait=False):
                return published.slot
        return None

    def _send_snapshot(self, pending: PendingCheckpoint, encoded: EncodedState, slot: int, path: str,
                       keep: bool) -> None:
        handed = self._metrics.hand_over()
        self._handed += handed
        carried, self._carried = self._carried, b""
        # Where the lines start in metrics.jsonl: the writer starts over there when it is not
        # where its own lines end (the run rolled back and cut the file).
        base = self._metrics.committed_bytes - len(handed) - len(carried)
        monitor = pending.monitor
        message = SnapshotMessage(self._next_id, slot, path, encoded.tensor_bytes, encoded.header, pending.progress_bytes,
                                  None if pending.cursor is None else pending.cursor.to_dict(), carried + handed, base,
                                  pending.metrics_bytes, keep,
                                  None if monitor is None else [monitor.name, monitor.mode, monitor.value],
                                  pending.anchor, pending.durable, pending.digest)
        self._published[self._next_id] = _Published(message, slot, split=abandon.splits_done())
        self._next_id += 1
        self._send(message)

    def _send(self, message: Message) -> None:
        """Queue ``message`` and send what the pipe takes without blocking: a writer process
        still starting (importing torch) must not stall training once the pipe is full."""
        self._outbox.append(message)
        self._send_queued()

    def _send_queued(self) -> None:
        while True:
            if not self._unsent:
                if not self._outbox:
                    return
                self._unsent = bytearray(encode_message(self._outbox.popleft().to_dict()))
            try:
                written = os.write(self._input, self._unsent)
            except BlockingIOError:
                return
            except BrokenPipeError:  # the writer died: the next check restarts it and hands it all over
                self._outbox.clear()
                self._unsent = bytearray()
                return
            del self._unsent[:written]

    def _withdraw_unsent(self, identifier: int) -> bool:
        """Take back snapshot ``identifier`` if its message is still queued here (never seen by
        the writer process); its metrics lines go with the next message."""
        for message in self._outbox:
            if isinstance(message, SnapshotMessage) and message.id == identifier:
                self._outbox.remove(message)
                self._carried = message.metrics + self._carried
                del self._published[identifier]
                self.skipped += 1
                return True
        return False

    def _send_everything(self) -> None:
        """Block until every queued message is in the pipe (or the writer process is gone; or,
        with ``abandon_hung``, it hangs past the watchdog's deadline: then it is replaced)."""
        self._send_queued()
        while (self._unsent or self._outbox) and self._alive():
            mark_phase(WRITER, f"writer process {self._process.pid}, sending it a snapshot", abandons=self._abandons,
                       fresh=self._fresh, since=self._writing_since())
            select.select([], [self._input], [], abandon.remaining(_POLL_SECONDS) if self._abandons else _POLL_SECONDS)
            self._send_queued()
            if self._abandons and (self._unsent or self._outbox) and abandon.past_deadline():
                self._abandon_process()

    def background_work(self) -> BackgroundWork:
        """:meth:`wrote_since`: the writer process's work competes with training."""
        return self.wrote_since

    def wrote_since(self, since: float) -> bool:
        """Whether a snapshot was in the writer process's hands at any moment after ``since``
        (its work competes with training for the CPU and the memory bandwidth)."""
        if self._drain_events() is False:
            return True
        return bool(self._published) or self.last_end >= since

    def check(self) -> None:
        """Apply the writer's events; restart it if it died; raise the first error it reported."""
        if self._closing:
            return self._raise_reported()
        if not self._drain_events() or not self._alive():
            self._writer_died()
        elif self._abandons and self._when_behind == "skip":
            self._abandon_if_overdue()
        self._send_queued()
        self._raise_reported()

    def _raise_reported(self) -> None:
        if self._errors:
            raise self._errors.pop(0)

    def flush(self) -> None:
        """Wait until every snapshot sent is committed (or failed, or superseded)."""
        self.check()
        if self._closing:  # no writer process any more (its errors are raised): nothing to wait for
            return
        self._send_everything()
        while self._published:
            self._wait_for_events()
        self._raise_reported()

    def _wait_for_exit(self) -> None:
        """Wait for the writer process to exit once told to; with ``abandon_hung``, kill it
        past the watchdog's deadline (everything it was given is committed by then)."""
        if not self._abandons:
            self._process.wait()
            return
        while True:
            try:
                self._process.wait(abandon.remaining(_POLL_SECONDS))
                return
            except subprocess.TimeoutExpired:
                mark_phase(WRITER, f"writer process {self._process.pid}, exiting", abandons=True)
                if abandon.past_deadline():
                    abandon.report("the writer process, which had nothing left to write, is killed (SIGKILL)",
                                   f"writer process {self._process.pid}, exiting")
                    self._process.kill()
                    self._process.wait()
                    return

    def close(self) -> None:
        """Let the writer process commit what it holds and exit; wait for it."""
        try:
            if not self._closing:
                self.flush()
                self._closing = True
                self._send(CloseMessage())
                self._send_everything()
                self._wait_for_exit()
                self._drain_events()
                self._stop_pipes()
        finally:
            self._closing = True
            if self._process.poll() is None:  # an error above: do not leave it behind
                self._process.kill()
                self._process.wait()
            self._arena.remove()
        self._raise_reported()


class LaunchedWriter:
    """A writer process started early (once the lease is taken: its start overlaps the run's
    own start), waiting for its configuration on stdin. It inherits the lease's lock
    descriptor, the arena's owner descriptor and the write end of its events pipe; nothing
    else. The first one of a run makes the run's arena (``arena``: a restarted one takes over
    the run's), after removing those that both their processes left behind."""

    def __init__(self, lease: WriterLease, inherit_faults: bool = True, arena: ArenaDirectory | None = None) -> None:
        descriptor = lease.handover()["lock_descriptor"]
        if arena is None:
            remove_orphaned_arena_directories()
        self.arena = make_arena_directory() if arena is None else arena
        events_read, events_write = os.pipe()
        environment = dict(os.environ)
        if not inherit_faults:  # fault injection arms the first writer process only
            environment.pop(faults.ENVIRONMENT_VARIABLE, None)
        passed = [events_write, self.arena.owner_descriptor] + ([descriptor] if descriptor is not None else [])
        try:
            with preemption_signals_blocked(WRITER_IGNORED_SIGNALS):  # until the process ignores them
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "engine.checkpoint.writers.process.main", str(events_write)],
                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, pass_fds=passed, env=environment)
        except BaseException:
            os.close(events_read)
            if arena is None:
                self.arena.remove()
            raise
        finally:
            os.close(events_write)
        assert self.process.stdin is not None
        self.input = self.process.stdin.fileno()
        try:  # room for many snapshot messages while the process starts (the system's cap)
            fcntl.fcntl(self.input, fcntl.F_SETPIPE_SZ, 1 << 20)
        except OSError:
            pass
        self.events = events_read
        os.set_blocking(events_read, False)
        _PIPE_DESCRIPTORS.update((self.input, self.events))

    def close_pipes(self) -> None:
        """Close this side's pipes (the process, if still running, then ends: stdin at EOF)."""
        _PIPE_DESCRIPTORS.difference_update((self.input, self.events))
        assert self.process.stdin is not None
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            os.close(self.events)
        except OSError:
            pass

    def abandon(self) -> None:
        """The run ends before it wrote anything: let the process go (it exits at EOF)."""
        self.close_pipes()
        self.process.wait()
        self.arena.remove()


close_in_forked_children(_PIPE_DESCRIPTORS)
