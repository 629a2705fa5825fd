"""``CheckpointConfig(every_n_splits="auto", max_overhead=...)``: checkpoint as often as an
overhead budget allows.

Measured online, as CheckFreq does: the seconds each checkpoint blocks the training thread
(capture, encoding, the copy, a wait for the writer, or the whole write when synchronous)
against the seconds of training per split since the previous checkpoint. The interval (in
splits) is the smallest that keeps blocking / training under ``max_overhead``, between 1 and
:data:`AUTO_MAX_INTERVAL`. Only *when* checkpoints happen depends on these timings, never a
training number: a run resumes exactly wherever its checkpoints fell.
"""

from __future__ import annotations

import math

# The longest interval "auto" ever chooses, in splits: a kill loses at most this many splits.
AUTO_MAX_INTERVAL = 64
# Weight of the newest measurement in the running estimates (older ones decay).
_SMOOTHING = 0.5


class OverheadBudget:
    """The checkpoint interval that keeps checkpoint blocking within ``max_overhead`` of training."""

    def __init__(self, max_overhead: float) -> None:
        self.max_overhead = max_overhead
        self.interval = 1  # the first checkpoints measure the cost
        self._cost: float | None = None
        self._split_seconds: float | None = None

    def record(self, blocked_seconds: float, trained_seconds: float, splits: int) -> int:
        """One checkpoint blocked ``blocked_seconds`` after ``splits`` splits that trained for
        ``trained_seconds``; returns the new interval."""
        if splits <= 0 or trained_seconds <= 0:
            return self.interval
        per_split = trained_seconds / splits
        self._cost = blocked_seconds if self._cost is None else \
            _SMOOTHING * blocked_seconds + (1 - _SMOOTHING) * self._cost
        self._split_seconds = per_split if self._split_seconds is None else \
            _SMOOTHING * per_split + (1 - _SMOOTHING) * self._split_seconds
        wanted = math.ceil(self._cost / (self.max_overhead * self._split_seconds))
        self.interval = max(1, min(AUTO_MAX_INTERVAL, wanted))
        return self.interval
