"""A wait for a checkpoint writer that gives up at the watchdog's deadline, instead of ending the
process (``CheckpointConfig(on_io_error="warn")``, docs/faults.md "A hung writer").

The training thread waits for its writer (a free snapshot slot, a flush) in engine code, so it can
wait with a deadline: the timeout the watchdog publishes for the wait (``max(min_timeout_s, factor
x p99)`` of the writer's writes, the first allowance until learned), counted from when the write it
waits for began (engine.watchdog.statistics). It marks the wait with
``abandons=True`` (the monitor then waits a grace longer before it ends the process: the wait acts
first); past :func:`deadline` the writer abandons the checkpoint it is stuck in, :func:`report`
writes the usual hang report (stderr, ``hangs.jsonl``) with what was done instead of ending the
process, and training goes on. Without a watchdog (``watchdog=None``) there is no deadline: the
wait is unbounded, as before. A writer the training process never waits for
(``when_behind="skip"``) is looked at each split boundary instead: one that has had a checkpoint
for :func:`writer_timeout` is abandoned the same way.
"""

from __future__ import annotations

import socket
import time

from engine.watchdog import tracker as trackers
from engine.watchdog import word as words
from engine.watchdog.phases import CODE_OF, WRITER
from engine.watchdog.report import HangReport, own_stacks, publish
from engine.watchdog.verdict import Hang


def splits_done() -> int | None:
    """The splits the run has completed (None without a watchdog)."""
    tracker = trackers.current()
    return None if tracker is None else tracker.splits


def deadline() -> float | None:
    """When (``time.monotonic()``) the current wait reaches its timeout; None without a watchdog."""
    tracker = trackers.current()
    return None if tracker is None else tracker.deadline()


def past_deadline() -> bool:
    """Whether the current wait has lasted its timeout (never without a watchdog)."""
    limit = deadline()
    return limit is not None and time.monotonic() >= limit


def remaining(poll_s: float | None = None) -> float | None:
    """Seconds left until :func:`deadline` (at least 0; at most ``poll_s`` when given); None
    without a watchdog and without ``poll_s``: wait without a limit."""
    limit = deadline()
    if limit is None:
        return poll_s
    left = max(0.0, limit - time.monotonic())
    return left if poll_s is None else min(left, poll_s)


def writer_timeout() -> float | None:
    """The timeout of a wait for the writer now (``max(min_timeout_s, factor x p99)`` of the
    writer's writes, the first allowance until learned); None without a watchdog. What a writer that the
    training process never waits for (``when_behind="skip"``) is given per checkpoint."""
    tracker = trackers.current()
    return None if tracker is None else tracker.statistics.timeout(WRITER, tracker.splits)


def report(action: str, detail: str, state: str | None = None, writing_s: float | None = None) -> None:
    """A writer hung and is abandoned: the hang report (this process's word, its stacks) on
    stderr and in ``hangs.jsonl``, with ``action`` (what is done instead of ending the process),
    ``detail`` (who hung: the writer's pid or thread and the checkpoint) and ``state`` (a writer
    process's state, engine.watchdog.report.process_state). Nothing without a watchdog.

    Called from a wait that reached its deadline (``writing_s`` None): the phase starts over (the
    abandoned wait is not one of its usual durations), with its first allowance (the writer that
    takes over starts anew; its waits are marked ``fresh`` until it ends a commit). Called at a
    split boundary for a writer the training process does not wait for, ``writing_s`` is how long
    it has had the checkpoint: the report names the phase ``waiting for the writer`` for that long,
    and the rank's own phase is left alone."""
    tracker = trackers.current()
    if tracker is None:
        return
    if writing_s is None:
        stalled_s, timeout_s = (time.monotonic_ns() - tracker.started_ns) / 1e9, tracker.timeout()
        tracker.restart_phase(detail)
    else:
        stalled_s, timeout_s = writing_s, tracker.statistics.timeout(WRITER, tracker.splits)
    word = words.read(tracker.buffer)
    if word is None:
        return
    phase_code = word.phase_code if writing_s is None else CODE_OF[WRITER]
    culprit = words.Word(word.sequence, word.splits, time.monotonic_ns() - int(stalled_s * 1e9), timeout_s, word.p50_s,
                         word.p99_s, word.busy_s, word.pid, word.rank, phase_code, word.flags, detail)
    publish(HangReport(Hang(culprit, stalled_s, ()), tracker.rank, socket.gethostname(), None, own_stacks(),
                       state, action), tracker.storage)
