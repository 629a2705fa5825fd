"""Per-phase durations learned online, and the timeout each gives.

A rank times its own phases when it marks the next one (no clock is read by anyone else); the
timeout it publishes with each phase is ``max(min_timeout_s, factor x p99)`` of that phase's
recent durations, or the first allowance while fewer than ``warmup`` were seen. Percentiles are
recomputed every few samples, not per split: the hot path stays an append.

A wait for the checkpoint writer is timed by what it waits for: the writer's writes. Its timeout
is learned from every write's duration (:data:`WRITE`, recorded by the writer as each ends, whether
or not anyone waited for it), and the wait counts from when the write it waits for began
(engine.watchdog.tracker.PhaseTracker.mark's ``since``): a write is hung when it has lasted
``factor x p99`` of the writes, however long the rank took to start waiting for it. The waits' own
durations (mostly zero: a writer faster than the splits is never waited for) would leave the
timeout at its first allowance for the whole run.
"""

from __future__ import annotations

import collections
import math

from engine.watchdog.settings import Watchdog
from engine.watchdog.phases import FIRST_ALLOWANCE, WRITER

WINDOW = 512  # recent durations kept per phase
_REFRESH_EVERY = 128  # samples between two recomputations of a phase's percentiles (a sort of the window: about 30 us)
WRITE = "write"  # the checkpoint writer's writes: not a phase a rank is in, what its writer waits are timed by
# Phases whose timeout and percentiles are those of other durations (see the module docstring).
_TIMED_BY: dict[str, str] = {WRITER: WRITE}


def percentile(sorted_values: list[float], fraction: float) -> float:
    """The ``fraction`` quantile of ``sorted_values`` (nearest rank; 0.0 for none)."""
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, max(0, math.ceil(fraction * len(sorted_values)) - 1))
    return sorted_values[index]


class PhaseStatistics:
    """Recent durations of each phase; see the module docstring."""

    def __init__(self, policy: Watchdog) -> None:
        self._policy = policy
        self._durations: dict[str, collections.deque[float]] = {}
        self._counts: dict[str, int] = {}
        self._quantiles: dict[str, tuple[float, float]] = {}
        self._timeouts: dict[str, float] = {}

    def add(self, phase: str, seconds: float) -> None:
        """One duration of ``phase`` (or of :data:`WRITE`). A phase timed by other durations
        records nothing."""
        if phase in _TIMED_BY:
            return
        durations = self._durations.get(phase)
        if durations is None:
            durations = self._durations[phase] = collections.deque(maxlen=WINDOW)
        durations.append(seconds)
        count = self._counts[phase] = self._counts.get(phase, 0) + 1
        if count == self._policy.warmup or (count > self._policy.warmup and count % _REFRESH_EVERY == 0):
            self._refresh(phase)

    def _refresh(self, phase: str) -> None:
        ordered = sorted(self._durations[phase])
        p50, p99 = percentile(ordered, 0.5), percentile(ordered, 0.99)
        self._quantiles[phase] = (p50, p99)
        self._timeouts[phase] = max(self._policy.min_timeout_s, self._policy.factor * p99)

    def timeout(self, phase: str, splits_done: int) -> float:
        """Seconds without progress after which a rank in ``phase`` is hung, ``splits_done``
        splits into the run: the phase's learned timeout; before that, the first allowance for
        the phases that are slow the first times (a start, a validation pass, the end) and in
        the first ``warmup`` splits (compilation, cold caches); else ``min_timeout_s``."""
        learned = self._timeouts.get(_TIMED_BY.get(phase, phase))
        if learned is not None:
            return learned
        if phase in FIRST_ALLOWANCE or splits_done < self._policy.warmup:
            return max(self._policy.min_timeout_s, self._policy.first_timeout_s)
        return self._policy.min_timeout_s

    def quantiles(self, phase: str) -> tuple[float, float] | None:
        """(p50, p99) of ``phase`` once learned; None before the warm-up ends."""
        return self._quantiles.get(_TIMED_BY.get(phase, phase))

    def count(self, phase: str) -> int:
        return self._counts.get(_TIMED_BY.get(phase, phase), 0)
