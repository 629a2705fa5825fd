"""The monitor: a daemon thread of each rank that reads the node's progress words and ends the
process on a hang.

A thread, not a process: it starts in microseconds (the watchdog is on in every fit), reads the
words from memory, and needs the GIL only once a second for a few microseconds. Every wait a
rank hangs in that we know of releases the GIL (a gloo or NCCL collective, a sleep, a blocked
read, write or fsync, a lock, a stopped writer process); a rank stopped whole (SIGSTOP) or stuck
in C code that holds the GIL cannot run its own monitor, and the monitor of another rank on its
node reports it instead and kills it (engine.watchdog.verdict says who is to blame).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Protocol

from engine.watchdog.settings import Watchdog
from engine.watchdog.outcomes import record_outcome
from engine.watchdog.phases import BACKWARD, HANG_EXIT_CODE
from engine.watchdog.remote import RemoteBoard
from engine.watchdog.report import AppendOnly, HangReport, own_stacks, process_state, publish
from engine.watchdog.stragglers import StragglerWatch, report as report_straggler
from engine.watchdog.tracker import PhaseTracker
from engine.watchdog.verdict import Hang, judge
from engine.watchdog.word import REPORTED, Word

_GRACE_S = 2.0  # how long a rank waits for a hung rank on its node to report itself
# Phases of a rank's own work that may also be a wait for the other ranks: DDP all-reduces the
# gradients inside backward. A local rank stalled there is judged again with the other nodes'
# words: the rank it waits for, stopped on another node, is the one to name.
_MAY_WAIT_FOR_OTHERS = frozenset({BACKWARD})


class Board(Protocol):
    def words(self) -> list[Word]: ...


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not): only to skip a rank that died, which torchrun sees."""
    state = process_state(pid)
    return state is not None and state != "a zombie"


def stopped(pid: int) -> bool:
    state = process_state(pid)
    return state is not None and state.startswith("stopped")


def _runs(word: Word) -> bool:
    return alive(word.pid)


def _is_stopped(word: Word) -> bool:
    return stopped(word.pid)


class Monitor:
    """Watches ``board`` every ``policy.poll_seconds`` on a daemon thread; on a hang, publishes
    the report (this rank's if it is the culprit, or the node's lowest waiting rank's for a rank
    that cannot report itself) and calls ``on_hang`` (by default: end the process with
    :data:`HANG_EXIT_CODE`)."""

    def __init__(self, policy: Watchdog, tracker: PhaseTracker, board: Board, storage: AppendOnly | None,
                 on_hang: Callable[[], None] | None = None, remote: RemoteBoard | None = None) -> None:
        self._policy = policy
        self._tracker = tracker
        self._board = board
        self._remote = remote  # the other nodes' words (a job on several nodes), else None
        self._storage = storage
        self._on_hang = on_hang if on_hang is not None else end_process
        self._host = socket.gethostname()
        self._said = ""  # the last line this monitor said: the launcher's outcome repeats it
        self._first_seen: dict[int, int] = {}
        self._looked_at: BaseException | None = None  # the last error end_if_a_peer_hung looked at
        self._stragglers = (None if policy.straggler_factor is None
                            else StragglerWatch(policy.straggler_factor, policy.straggler_window, policy.warmup))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="splitloop-watchdog", daemon=True)
        # How old another node's last publication is when that node counts as stopped publishing.
        self._silence_s = _GRACE_S + 2 * policy.poll_seconds

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._policy.poll_seconds):
            if self.check(time.monotonic_ns()):
                return

    def check(self, now_ns: int) -> bool:
        """Look once; True when a hang was acted on."""
        local = self._board.words()
        if self._stragglers is not None and local and self._tracker.rank == min(word.rank for word in local):
            for straggler in self._stragglers.look(local):
                report_straggler(straggler, self._host, self._storage)
        if self._remote is not None:
            self._remote.publish(local, now_ns)
        hang = judge(local, now_ns, _runs, _is_stopped)
        if hang is not None and self._remote is not None and (hang.culprit is None or
                                                               hang.culprit.phase in _MAY_WAIT_FOR_OTHERS):
            hang = self._across_nodes(local, now_ns)
        if hang is None:
            self._first_seen.clear()
            return False
        return self._act(hang, now_ns)

    def _across_nodes(self, local: list[Word], now_ns: int) -> Hang | None:
        """Every local rank waits in a collective (or the one blamed is in backward, where DDP
        waits for every rank): judge again with the other nodes' words, so that the rank they
        wait for is named (or the wait is found to be within its timeout)."""
        assert self._remote is not None
        remote = self._remote.read(local, now_ns)
        if not remote:
            return judge(local, now_ns, _runs, _is_stopped)  # the store does not answer: culprit unknown
        # Told apart by rank: another node's pids are not this node's (and may equal them).
        elsewhere = {item.word.rank for item in remote}
        # A node that no longer publishes (its lowest rank's monitor thread publishes every poll,
        # whatever its main thread does) is stopped whole, or cut off: its ranks count as stopped.
        silent = {item.word.rank for item in remote if item.age_s > self._silence_s}
        return judge([*local, *(item.word for item in remote)], now_ns,
                     lambda word: word.rank in elsewhere or alive(word.pid),
                     lambda word: word.rank in silent if word.rank in elsewhere else stopped(word.pid))

    def _act(self, hang: Hang, now_ns: int) -> bool:
        culprit, own = hang.culprit, self._tracker.rank
        local_ranks = {word.rank for word in hang.waiting if self._remote is None or word.rank not in self._remote.hosts}
        if culprit is not None and culprit.rank != own and self._remote is not None and \
                culprit.rank in self._remote.hosts:
            return self._act_on_another_node(hang, culprit, own, local_ranks | {own}, now_ns)
        if culprit is not None and culprit.rank == own:
            self._report(hang, stacks=own_stacks())
            self._tracker.set_flag(REPORTED)
            if self._remote is not None:  # the other nodes read the flag, should this exit break their collectives
                self._remote.publish(self._board.words(), now_ns)
        elif culprit is None:
            if own == min(word.rank for word in hang.waiting):
                self._report(hang)
        elif culprit.flags & REPORTED or not alive(culprit.pid):
            self._say(f"rank {culprit.rank} hung and reported it; rank {own} ends too")
        else:
            first = self._first_seen.setdefault(culprit.rank, now_ns)
            if (now_ns - first) / 1e9 < _GRACE_S + 2 * self._policy.poll_seconds:
                return False  # give the culprit's own monitor the time to report it with its stacks
            if own == min(word.rank for word in hang.waiting):
                self._report(hang, state=process_state(culprit.pid))
                _kill(culprit.pid)
        record_outcome(HANG_EXIT_CODE, self._said or f"rank {own} ends: {hang.describe()}")
        self._on_hang()
        return True

    def end_if_a_peer_hung(self, error: BaseException) -> None:
        """Called by the main thread with the exception ending its fit: when another rank hung and
        reported it, that rank's exit is what broke this rank's collective ("connection closed by
        peer"), so this rank ends as its monitor would have a moment later (the hang's line, the
        hang exit code), not with the collective's error (exit 1, which torchrun may name as the
        job's first failure, hiding the hang). Returns when no peer reported a hang (the error is
        the run's own) and for an interrupt (KeyboardInterrupt, SystemExit)."""
        if not isinstance(error, Exception) or error is self._looked_at:
            return
        self._looked_at = error  # the run's exception path and the watch's both ask: one store read
        own = self._tracker.rank
        local = self._board.words()
        peers = [word for word in local if word.rank != own and word.flags & REPORTED]
        if not peers and self._remote is not None:
            peers = [item.word for item in self._remote.read(local, time.monotonic_ns()) if item.word.flags & REPORTED]
        if not peers:
            return
        culprit = min(peers, key=lambda word: word.rank)
        where = f" on {self._remote.hosts[culprit.rank]}" if self._remote is not None and culprit.rank in self._remote.hosts else ""
        self._say(f"rank {culprit.rank}{where} hung and reported it; rank {own} ends too "
                  f"(its own wait ended with {type(error).__name__}: {str(error)[:200]})")
        record_outcome(HANG_EXIT_CODE, self._said)
        self._stop.set()
        self._on_hang()

    def _act_on_another_node(self, hang: Hang, culprit: Word, own: int, local_ranks: set[int], now_ns: int) -> bool:
        """The rank this node waits for is on another node: that node's monitors report it (with
        its stacks) and end it; this node's lowest rank says which rank it waited for, and every
        local rank ends so that the group restarts."""
        assert self._remote is not None
        host = self._remote.hosts.get(culprit.rank, "another node")
        if not culprit.flags & REPORTED:
            first = self._first_seen.setdefault(culprit.rank, now_ns)
            if (now_ns - first) / 1e9 < _GRACE_S + 2 * self._policy.poll_seconds:
                return False  # give the culprit's node the time to report it with its stacks
        if own == min(local_ranks):
            age = self._remote.ages.get(culprit.rank, 0.0)
            silent = age > self._silence_s
            self._report(hang, state=f"on {host}, whose node stopped publishing its words {age:.0f} s ago (stopped "
                                     "whole, or cut off)" if silent else f"on {host}, whose own monitors report its stacks")
        record_outcome(HANG_EXIT_CODE, self._said or f"rank {own} ends: rank {culprit.rank} on {host} hung")
        self._on_hang()
        return True

    def _report(self, hang: Hang, stacks: str | None = None, state: str | None = None) -> None:
        report = HangReport(hang, self._tracker.rank, self._host, HANG_EXIT_CODE, stacks, state)
        self._said = report.line()
        publish(report, self._storage)

    def _say(self, text: str) -> None:
        self._said = f"splitloop watchdog: {text}"
        sys.stderr.write(f"splitloop watchdog: {text}; exiting with {HANG_EXIT_CODE}\n")
        sys.stderr.flush()


def _kill(pid: int) -> None:
    """A rank that cannot report itself cannot stop itself either (a stopped process keeps
    torchrun's SIGTERM pending): end it, so that the group restarts at once."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def end_process() -> None:
    """End this process with :data:`HANG_EXIT_CODE`, from the monitor thread: the main thread is
    stuck, nothing is committed from the hung state. Its child processes (a checkpoint writer
    process, which may be the one that hangs and holds the run dir's lease) end first."""
    for pid in _children():
        _kill(pid)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(HANG_EXIT_CODE)


def _children() -> list[int]:
    """This process's child processes, from /proc (every thread's children)."""
    found: list[int] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children", encoding="ascii") as handle:
                found += [int(pid) for pid in handle.read().split()]
        except (OSError, ValueError):
            continue
    return found
