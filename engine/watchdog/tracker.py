"""The rank's side: mark each phase, time the phase that ends, publish the word.

The loops, the run and the checkpoint waits call :func:`mark` (a module function, like
``engine.faults.reach``: one comparison when no watchdog runs); a mark of the phase the rank is
already in changes nothing, so a wait that polls may mark on every turn.
"""

from __future__ import annotations

import mmap
import os
import time

from engine.watchdog.settings import Watchdog
from engine.watchdog import word as words
from engine.watchdog.phases import CODE_OF, STARTING, WAITS

_SMOOTHING = 0.2  # weight of the newest split in the moving average of the busy time
from engine.watchdog.statistics import PhaseStatistics


class PhaseTracker:
    """Publishes this rank's progress word; see the module docstring."""

    def __init__(self, policy: Watchdog, buffer: mmap.mmap, rank: int) -> None:
        self.statistics = PhaseStatistics(policy)
        self.buffer = buffer
        self.rank = rank
        self.pid = os.getpid()
        self.phase = STARTING
        self.detail = ""
        self.splits = 0
        self.flags = 0
        self.sequence = 0
        self.busy_s = 0.0
        self._busy = 0.0
        self.started_ns = time.monotonic_ns()
        self._publish()

    def mark(self, phase: str, detail: str = "") -> None:
        """Enter ``phase`` (no change when already in it with the same detail)."""
        if phase == self.phase and detail == self.detail:
            return
        self._end_phase()
        self.phase, self.detail = phase, detail
        self._publish()

    def _end_phase(self) -> None:
        now = time.monotonic_ns()
        seconds = (now - self.started_ns) / 1e9
        self.statistics.add(self.phase, seconds)
        if self.phase not in WAITS:
            self._busy += seconds
        self.started_ns = now

    def split_done(self, phase: str) -> None:
        """A split completed: count it, and enter ``phase`` (the boundary's work)."""
        self.splits += 1
        self._end_phase()
        self.busy_s = self._busy if self.busy_s == 0.0 else (1 - _SMOOTHING) * self.busy_s + _SMOOTHING * self._busy
        self._busy = 0.0
        self.phase, self.detail = phase, ""
        self._publish()

    def resumed_at(self, splits: int) -> None:
        """The run resumed with ``splits`` units of step work completed: the word counts the run's
        splits, not this process's (the report's last split is the run's; ranks compare equal)."""
        self.splits = splits
        self._publish()

    def set_flag(self, flag: int) -> None:
        self.flags |= flag
        self._publish()

    def _publish(self) -> None:
        self.sequence += 1
        quantiles = self.statistics.quantiles(self.phase) or (0.0, 0.0)
        words.write(self.buffer, words.Word(self.sequence, self.splits, self.started_ns,
                                            self.statistics.timeout(self.phase, self.splits), quantiles[0], quantiles[1], self.busy_s, self.pid,
                                            self.rank, CODE_OF[self.phase], self.flags, self.detail))


_tracker: PhaseTracker | None = None


def mark(phase: str, detail: str = "") -> None:
    """This process enters ``phase`` (nothing when no watchdog runs)."""
    if _tracker is not None:
        _tracker.mark(phase, detail)


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
