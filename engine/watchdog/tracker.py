"""The rank's side: mark each phase, time the phase that ends, publish the word.

The loops, the run and the checkpoint waits call :func:`mark` (a module function, like
``engine.faults.reach``: one comparison when no watchdog runs); a mark of the phase the rank is
already in changes nothing, so a wait that polls may mark on every turn.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from typing import TYPE_CHECKING, Iterator

from engine.watchdog.settings import Watchdog
from engine.watchdog import word as words
from engine.watchdog.phases import CODE_OF, COLLECTIVE, STARTING, WAITS
from engine.watchdog.statistics import WRITE, PhaseStatistics

if TYPE_CHECKING:
    from engine.watchdog.report import AppendOnly

_SMOOTHING = 0.2  # weight of the newest split in the moving average of the busy time
# How much longer than its own deadline the monitor waits before it ends a process whose wait
# abandons what it waits for (engine.watchdog.abandon): the wait acts first.
_ABANDON_GRACE_S = 2.0


class PhaseTracker:
    """Publishes this rank's progress word; see the module docstring."""

    def __init__(self, policy: Watchdog, buffer: mmap.mmap, rank: int, storage: AppendOnly | None = None) -> None:
        self.statistics = PhaseStatistics(policy)
        self._first_timeout_s = max(policy.min_timeout_s, policy.first_timeout_s)
        # The current phase has its first allowance whatever was learned (a wait for a writer
        # started anew: it imports and maps its slots before it answers).
        self.fresh = False
        # Where a wait that abandons a hung writer reports it (the run dir's hangs.jsonl).
        self.storage = storage
        # Added to the published timeout of a wait that abandons by itself at its deadline.
        self.grace_s = max(_ABANDON_GRACE_S, 4 * policy.poll_seconds)
        self.abandons = False
        self.buffer = buffer
        self.rank = rank
        self.pid = os.getpid()
        self.thread = threading.get_ident()  # the thread whose phases the word shows: the fit's
        self.phase = STARTING
        self.detail = ""
        self.splits = 0
        self.flags = 0
        self.sequence = 0
        self.busy_s = 0.0
        self._busy = 0.0
        self.started_ns = time.monotonic_ns()
        self._encoded_for, self._encoded_detail = "", b""  # the detail, encoded once per change
        # The word is published from the fit's thread, and a flag from the monitor's or the
        # writer's: one publication at a time, each of a consistent set of fields.
        self._lock = threading.Lock()
        self._peer_waits = 0  # writer threads waiting for peers now (an abandoned one may still be)
        self._publish()

    def mark(self, phase: str, detail: str = "", abandons: bool = False, fresh: bool = False,
             since: float | None = None) -> None:
        """Enter ``phase`` (no change when already in it with the same detail). ``abandons``:
        the caller's wait gives up by itself at :meth:`deadline` (engine.watchdog.abandon), so the
        monitor waits :attr:`grace_s` longer before it calls the process hung. ``fresh``: the
        phase has its first allowance (what it waits for has just started). ``since``: when
        (``time.monotonic()``) what the phase waits for began, if earlier (the write a wait for
        the writer waits for): the phase's time counts from then."""
        since_ns = self.started_ns if since is None else min(int(since * 1e9), time.monotonic_ns())
        if (phase == self.phase and detail == self.detail and abandons == self.abandons and fresh == self.fresh
                and (since is None or since_ns == self.started_ns)):
            return
        with self._lock:
            self._end_phase(record=not self.fresh)  # a fresh start's wait is not a usual duration
            if since is not None:
                self.started_ns = since_ns
            self.phase, self.detail, self.abandons, self.fresh = phase, detail, abandons, fresh
            self._publish()

    def write_took(self, seconds: float) -> None:
        """A checkpoint write ended after ``seconds``: what the waits for the writer are timed by
        (engine.watchdog.statistics). Called from the writer's thread."""
        self.statistics.add(WRITE, seconds)

    def restart_phase(self, detail: str) -> None:
        """Start the current phase over with ``detail``, not counting the time spent in it so far
        (a wait that was abandoned: its length says nothing of the phase's usual durations), with
        its first allowance (what it waits for next starts anew)."""
        with self._lock:
            self.started_ns = time.monotonic_ns()
            self.detail, self.abandons, self.fresh = detail, False, True
            self._publish()

    def timeout(self) -> float:
        """The current phase's timeout (engine.watchdog.statistics; its first allowance when fresh)."""
        learned = self.statistics.timeout(self.phase, self.splits)
        return max(learned, self._first_timeout_s) if self.fresh else learned

    def deadline(self) -> float:
        """When (``time.monotonic()``) the current phase reaches its timeout."""
        return self.started_ns / 1e9 + self.timeout()

    def _end_phase(self, record: bool = True) -> None:
        now = time.monotonic_ns()
        seconds = (now - self.started_ns) / 1e9
        if record:
            self.statistics.add(self.phase, seconds)
        if self.phase not in WAITS:
            self._busy += seconds
        self.started_ns = now

    def split_done(self, phase: str) -> None:
        """A split completed: count it, and enter ``phase`` (the boundary's work)."""
        with self._lock:
            self.splits += 1
            self._end_phase()
            self.busy_s = self._busy if self.busy_s == 0.0 else (1 - _SMOOTHING) * self.busy_s + _SMOOTHING * self._busy
            self._busy = 0.0
            self.phase, self.detail, self.abandons, self.fresh = phase, "", False, False
            self._publish()

    def resumed_at(self, splits: int) -> None:
        """The run resumed with ``splits`` units of step work completed: the word counts the run's
        splits, not this process's (the report's last split is the run's; ranks compare equal)."""
        with self._lock:
            self.splits = splits
            self._publish()

    def set_flag(self, flag: int) -> None:
        with self._lock:
            self.flags |= flag
            self._publish()

    def writer_waits_for_peers(self, waits: bool) -> None:
        """A writer thread of this process starts (True) or ends (False) waiting for other ranks
        in a collective: flagged :data:`~engine.watchdog.word.WRITER_WAITS_FOR_PEERS` while one does."""
        with self._lock:
            self._peer_waits += 1 if waits else -1
            flags = self.flags | words.WRITER_WAITS_FOR_PEERS if self._peer_waits > 0 else \
                self.flags & ~words.WRITER_WAITS_FOR_PEERS
            if flags != self.flags:
                self.flags = flags
                self._publish()

    def _publish(self) -> None:
        """Write the word (with :attr:`_lock` held, but at construction)."""
        self.sequence += 1
        quantiles = self.statistics.quantiles(self.phase) or (0.0, 0.0)
        timeout = self.timeout() + (self.grace_s if self.abandons else 0.0)
        if self.detail != self._encoded_for:
            self._encoded_for, self._encoded_detail = self.detail, words.encode_detail(self.detail)
        words.write_fields(self.buffer, self.sequence, self.splits, self.started_ns, timeout, quantiles[0], quantiles[1],
                           self.busy_s, self.pid, self.rank, CODE_OF[self.phase], self.flags, self._encoded_detail)


_tracker: PhaseTracker | None = None


def mark(phase: str, detail: str = "", abandons: bool = False, fresh: bool = False, since: float | None = None) -> None:
    """This process enters ``phase`` (nothing when no watchdog runs); ``abandons``, ``fresh``
    and ``since``: see :meth:`PhaseTracker.mark`."""
    if _tracker is not None:
        _tracker.mark(phase, detail, abandons, fresh, since)


@contextlib.contextmanager
def waiting_for_peers(on_the_fits_thread: bool = True) -> Iterator[None]:
    """The body waits for other ranks that all take part at once (a checkpoint's gather and
    announcement, a ring of point-to-point transfers as the memory tier's peer copies): on the
    fit's thread the phase is :data:`COLLECTIVE` during it, then the phase the rank was in again
    (unless ``on_the_fits_thread`` is False: a commit's gather there stays in the checkpoint's
    phase, so that a rank that skipped a collective of the fit and went on to its checkpoint is
    past the rank still waiting in it, and blamed); on a writer thread the word is flagged
    ``WRITER_WAITS_FOR_PEERS`` during it (the training thread's phase is left alone; while it
    waits for that writer it waits for the peers too). So a rank that never answers is blamed,
    not the ranks that wait for it (engine.watchdog.verdict)."""
    tracker = _tracker
    if tracker is None or (not on_the_fits_thread and threading.get_ident() == tracker.thread):
        yield
        return
    if threading.get_ident() != tracker.thread:
        tracker.writer_waits_for_peers(True)
        try:
            yield
        finally:
            tracker.writer_waits_for_peers(False)
        return
    phase, detail = tracker.phase, tracker.detail
    tracker.mark(COLLECTIVE)
    try:
        yield
    finally:
        tracker.mark(phase, detail)


def write_took(seconds: float) -> None:
    """A checkpoint write of this process ended after ``seconds`` (nothing when no watchdog runs)."""
    tracker = _tracker
    if tracker is not None:
        tracker.write_took(seconds)


def split_done(phase: str) -> None:
    """This process completed a split and enters ``phase`` (nothing when no watchdog runs)."""
    if _tracker is not None:
        _tracker.split_done(phase)


def resumed_at(splits: int) -> None:
    """The run resumed with ``splits`` splits completed (nothing when no watchdog runs)."""
    if _tracker is not None:
        _tracker.resumed_at(splits)


def install(tracker: PhaseTracker | None) -> None:
    """Make ``tracker`` the one :func:`mark` writes to (None: none)."""
    global _tracker
    _tracker = tracker


def current() -> PhaseTracker | None:
    return _tracker
