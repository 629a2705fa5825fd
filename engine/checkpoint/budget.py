"""``CheckpointConfig(every_n_splits="auto", max_overhead=...)``: checkpoint as often as an
overhead budget allows.

What a checkpoint costs training, measured online (as CheckFreq does), is the sum of:

* the seconds it *blocks* the training thread (capture, encoding, the copy into the writer's
  buffers, a wait for a free buffer, or the whole write when synchronous);
* the seconds its background write *slows* the splits that run while it is in flight (the
  writer thread competes with training for the GIL, the CPU and the memory bandwidth): the
  time of each split that overlapped a write, minus the *baseline* split time.

The baseline is the time of a split that overlapped no write, a running estimate taken from
such splits only. Between two checkpoints (a *cycle*) the automatic cadence (``AutoCadence`` in engine.checkpoint.cadence) times every split
(one clock read) and tells :meth:`OverheadBudget.note_split` whether a write was in flight
during it; at each checkpoint :meth:`OverheadBudget.record` closes the cycle: the cost of the
checkpoint that opened it is its blocking time plus the extra time of the cycle's overlapped
splits, and the next interval is the smallest number of splits N with
``cost / (N * baseline) <= max_overhead``, between 1 and :data:`AUTO_MAX_INTERVAL`.

Robustness, with no knob:

* The cost is the median of the last :data:`_WINDOW` checkpoints' costs: one slow split (a GC
  pause, a burst of disk latency) moves the interval not at all; a lasting change takes over
  at the third checkpoint.
* The baseline is the *smallest* of the last :data:`_WINDOW` cycles' means of write-free
  splits: interference (another process, a GC pause, page-cache writeback) only ever adds
  time to a split, so a low estimate is the robust one, and erring low counts more of an
  overlapped split as checkpoint cost (a longer interval, the budget's safe side). A lasting
  slowdown of training raises the baseline after :data:`_WINDOW` checkpoints. Overlapped
  splits faster than the baseline show it too high (its only samples were slow): the next
  interval is one split longer, to time a write-free split.
* Start: the first split of a run (first-call costs, data loader start) is not a sample. The
  first checkpoint comes after it; until both a baseline and a cost are known the interval
  grows by one split per checkpoint (1, 2, 3, ...), so that a split runs free of the write and
  is timed: usually the second checkpoint (after split 3) knows both. The first checkpoint's
  cost includes one-time work (buffer allocation, directories), which errs on the side of a
  longer interval until the median has three samples.
* A baseline that has had no sample for :data:`_BASELINE_MAX_AGE` cycles (every split overlaps
  a write) is refreshed: each next interval is one split longer until a split runs free.

With a failure rate (``CheckpointConfig(mtbf_seconds=...)``, the mean time between failures of
the job), the interval is also the one that minimizes the expected waste per second of training,
checkpoint cost plus the work a failure loses (half an interval on average): Young's
``sqrt(2 x cost x MTBF)`` seconds to first order (Daly's higher order: :func:`young_daly_interval`). The
cadence takes the longer of the two (the budget caps how often checkpoints happen; a rare
failure makes checkpoints rarer still), and never more than :data:`AUTO_MAX_INTERVAL` splits (the
most a kill may lose). docs/performance.md says which wins when.

Background work is the background writer's writes and a fast tier's copies into the durable
tier (``DurablePromoter.copied_since`` in engine.checkpoint.tiers.fast); a synchronous writer without a fast tier has none:
every split is a baseline split and the cost is the blocking time. Only *when* checkpoints happen depends on these timings, never a training
number: a run resumes exactly wherever its checkpoints fell.
"""

from __future__ import annotations

import collections
import math
import statistics
from typing import Callable, Iterable

# The longest interval "auto" ever chooses, in splits: a kill loses at most this many splits.
AUTO_MAX_INTERVAL = 64
# How many recent cycles the baseline and the cost are estimated from.
_WINDOW = 5
# Checkpoints without a write-free split after which one is made (the next interval + 1).
_BASELINE_MAX_AGE = 8


class _Recent:
    """A statistic (``median`` or ``min``) of the last :data:`_WINDOW` samples (None before
    the first)."""

    def __init__(self, statistic: Callable[[Iterable[float]], float]) -> None:
        self._samples: collections.deque[float] = collections.deque(maxlen=_WINDOW)
        self._statistic = statistic
        self.value: float | None = None

    def add(self, sample: float) -> None:
        self._samples.append(sample)
        self.value = self._statistic(self._samples)


class OverheadBudget:
    """The checkpoint interval that keeps the whole cost of checkpoints (blocking plus the
    slowdown of overlapped splits) within ``max_overhead`` of training time.

    Example: between two checkpoints, the write of the first slows one split from 10 ms to
    16 ms; the first blocked training for 2 ms, so it cost 8 ms::

        budget.note_split(0.016, overlapped=True)    # a write was in flight during it
        budget.note_split(0.010, overlapped=False)   # the baseline
        interval = budget.record(blocked_seconds=0.001)  # the second checkpoint
    """

    def __init__(self, max_overhead: float, mtbf_seconds: float | None = None) -> None:
        self.max_overhead = max_overhead
        self.mtbf_seconds = mtbf_seconds
        self.interval = 1  # the first checkpoints measure the cost
        self._baseline = _Recent(min)
        self._cost = _Recent(statistics.median)
        self._warming_up = True  # the run's first split is not a sample
        self._opening_blocked: float | None = None  # blocking time of the checkpoint that opened this cycle
        self._cycles_without_baseline = 0
        self._reset_cycle()

    def _reset_cycle(self) -> None:
        self._free_seconds = 0.0
        self._free_splits = 0
        self._overlapped_seconds = 0.0
        self._overlapped_splits = 0

    def note_split(self, seconds: float, overlapped: bool) -> None:
        """One split took ``seconds`` of training (boundary work and checkpoints excluded);
        ``overlapped``: a background write was in flight at some moment of it. Per split:
        keep it cheap."""
        if self._warming_up:
            self._warming_up = False
        elif overlapped:
            self._overlapped_seconds += seconds
            self._overlapped_splits += 1
        else:
            self._free_seconds += seconds
            self._free_splits += 1

    def record(self, blocked_seconds: float) -> int:
        """A checkpoint was written and blocked training for ``blocked_seconds``: it closes
        the cycle of splits noted since the previous one. Returns the new interval."""
        baseline = self._update_baseline()
        if self._opening_blocked is not None and baseline is not None:
            extra = max(0.0, self._overlapped_seconds - self._overlapped_splits * baseline)
            self._cost.add(self._opening_blocked + extra)
        self._opening_blocked = blocked_seconds
        self._reset_cycle()
        self.interval = self._next_interval(baseline, self._cost.value)
        return self.interval

    def _update_baseline(self) -> float | None:
        """Take the cycle's write-free splits as a baseline sample; the baseline."""
        if self._free_splits:
            self._baseline.add(self._free_seconds / self._free_splits)
            self._cycles_without_baseline = 0
            return self._baseline.value
        self._cycles_without_baseline += 1
        baseline = self._baseline.value
        if baseline is not None and self._overlapped_seconds < self._overlapped_splits * baseline:
            # Overlapped splits ran faster than the baseline, which a write cannot cause: its
            # samples were slow splits. Time a write-free split again now.
            self._cycles_without_baseline = _BASELINE_MAX_AGE
        return baseline

    def _next_interval(self, baseline: float | None, cost: float | None) -> int:
        if baseline is None or cost is None or baseline <= 0:
            wanted = self.interval + 1  # not measured yet: leave room for a write-free split
        else:
            wanted = math.ceil(cost / (self.max_overhead * baseline))
            if self.mtbf_seconds is not None:
                wanted = max(wanted, round(young_daly_interval(cost, self.mtbf_seconds) / baseline))
            if self._cycles_without_baseline >= _BASELINE_MAX_AGE:  # longer until a split runs free
                wanted = max(wanted, self.interval + 1)
        return max(1, min(AUTO_MAX_INTERVAL, wanted))


def young_daly_interval(checkpoint_s: float, job_mtbf_s: float) -> float:
    """The compute time between checkpoints that minimizes the expected waste: each checkpoint
    costs ``checkpoint_s`` and a failure, every ``job_mtbf_s`` on average, loses the work since
    the last one. Young's (1974) first order is ``sqrt(2 * checkpoint_s * job_mtbf_s)`` (waste
    per second ``cost / T + T / (2 MTBF)``); this is Daly's (2006) higher-order optimum, which
    stays right when checkpoints are long against the MTBF (one per MTBF past ``2 x MTBF``)."""
    if checkpoint_s <= 0:
        return 0.0
    if checkpoint_s >= 2 * job_mtbf_s:
        return job_mtbf_s
    ratio = checkpoint_s / (2 * job_mtbf_s)
    return math.sqrt(2 * checkpoint_s * job_mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - checkpoint_s
