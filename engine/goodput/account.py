"""What a run's ledger says: buckets of time that add up to the wall time, failures by cause,
the mean time between failures, and the samples trained, skipped and seen twice.

The buckets partition the time from the first process start to the last attempt's end:

- start-up: process start to the restore, and the restore's end to the first split;
- restore: loading the checkpoint (or starting fresh);
- checkpoint stall: the time saves blocked training, and the flush at the attempt's end;
- validation: validation passes;
- productive: the rest of the training time up to the commit the next attempt resumed from;
- work lost: training time after that commit (splits computed, then redone);
- hang detection: a hang's time from the last progress to its report (``hangs.jsonl``);
- down: from an attempt's end to the next one's process start (requeue wait, restarts).

An attempt with no ``end`` row ended by a hang (a ``hangs.jsonl`` row within it) or was killed.
A killed attempt's end is written nowhere: it is placed one beat (the ledger writes a row at
least every ``beat_s`` while splits are shorter) and one split after its last row, and never
after the next attempt's process start. docs/goodput.md has the definitions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from engine.goodput import sample_ids
from engine.goodput.attempts import Attempt, attempts_of, read_hangs
from engine.goodput.rows import (COMMIT, EXCEPTION, FINISHED, HANG, INTERRUPTED, KILLED, PREEMPTED, VALIDATION,
                                 LedgerStorage, ranks_with_files, read_rank)

BUCKETS = ("productive", "validation", "checkpoint_stall", "startup", "restore", "work_lost", "hang_detection", "down")
FAILURES = (EXCEPTION, HANG, KILLED)
CAUSES = (FINISHED, PREEMPTED, INTERRUPTED, EXCEPTION, HANG, KILLED)


@dataclasses.dataclass
class Account:
    """A run's goodput (see the module docstring); times in seconds."""

    wall_s: float
    buckets: dict[str, float]
    attempts: list[Attempt]
    causes: dict[str, int]
    samples: sample_ids.SampleCount
    id_kind: str
    commits: int
    ended: bool                   # the last attempt wrote its end

    @property
    def goodput(self) -> float:
        return self.buckets["productive"] / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def failures(self) -> int:
        return sum(self.causes.get(cause, 0) for cause in FAILURES)

    @property
    def mtbf_s(self) -> float | None:
        """Time the attempts ran (process start to end), per failure; None without failures."""
        running = sum(attempt.ended_at - attempt.process_start for attempt in self.attempts)
        return running / self.failures if self.failures else None

    @property
    def training_mtbf_s(self) -> float | None:
        """Training time (first split to end) per failure: the rate the model draws failures at."""
        training = sum(attempt.ended_at - attempt.training for attempt in self.attempts if attempt.training is not None)
        return training / self.failures if self.failures else None

    def to_dict(self) -> dict[str, Any]:
        return {"wall_s": self.wall_s, "goodput": self.goodput, "buckets": dict(self.buckets),
                "attempts": len(self.attempts), "causes": dict(self.causes), "failures": self.failures,
                "mtbf_s": self.mtbf_s, "commits": self.commits, "ended": self.ended,
                "samples": {"trained": self.samples.trained, "skipped": self.samples.skipped,
                            "seen_twice": self.samples.seen_twice, "ids": self.id_kind},
                "timeline": [attempt.timeline() for attempt in self.attempts]}


def account(storage: LedgerStorage) -> Account | None:
    """The account of the run in ``storage`` (None: it has no ledger). Times come from rank 0
    (the lowest rank with a file); samples from every rank."""
    ranks = ranks_with_files(storage)
    if not ranks:
        return None
    hangs = read_hangs(storage)
    samples = sample_ids.SampleCount()
    timelines: list[list[Attempt]] = []
    commits = 0
    for rank in ranks:
        attempts = attempts_of(read_rank(storage, rank))
        place(attempts, hangs)
        samples.add(count_samples(attempts))
        timelines.append(attempts)
    attempts = next((found for found in timelines if found), [])
    if not attempts:
        return None
    for other in timelines[1:]:
        _take_the_first_cause(attempts, other)
    commits = sum(1 for attempt in attempts for _, row in attempt.rows if row.get("event") == COMMIT)
    buckets = dict.fromkeys(BUCKETS, 0.0)
    for attempt in attempts:
        for name, seconds in attempt.buckets.items():
            buckets[name] += seconds
    causes: dict[str, int] = {}
    for attempt in attempts:
        causes[attempt.cause] = causes.get(attempt.cause, 0) + 1
    wall = attempts[-1].ended_at - attempts[0].process_start
    return Account(wall, buckets, attempts, causes, samples, attempts[0].id_kind, commits,
                   ended=attempts[-1].end is not None)


def _take_the_first_cause(attempts: list[Attempt], other: list[Attempt]) -> None:
    """A group's attempt ends when its first rank does: SIGKILL one rank and torchrun stops the
    others (SIGTERM), which then end by a preemption or an exception of their own. Each attempt
    takes the cause of the rank that ended first (a killed rank ends after its last row, another
    rank at its end row). The ranks' attempts are paired in order (each group start starts every
    rank); ranks with another number of attempts are not paired."""
    if len(other) != len(attempts):
        return
    for mine, theirs in zip(attempts, other):
        if _earliest_end(theirs) < _earliest_end(mine):
            mine.cause = theirs.cause


def _earliest_end(attempt: Attempt) -> float:
    return attempt.ended_at if attempt.end is not None else attempt.last_row


def place(attempts: list[Attempt], hangs: list[dict[str, Any]]) -> None:
    """Give each attempt its cause, end, the instant its kept work ends, and its buckets."""
    for index, attempt in enumerate(attempts):
        if index and attempt.process_start < attempts[index - 1].last_row:
            # Another fit in the same process: its start-up begins where the earlier one ended.
            attempt.process_start = attempts[index - 1].last_row
        following = attempts[index + 1] if index + 1 < len(attempts) else None
        limit = following.process_start if following is not None else None
        if following is not None and following.process_start < attempt.last_row:
            limit = following.process_start = attempt.last_row
        _place_end(attempt, hangs, limit)
        attempt.kept_until = _kept_until(attempt, following)
        attempt.buckets = _buckets(attempt, limit)


def _place_end(attempt: Attempt, hangs: list[dict[str, Any]], limit: float | None) -> None:
    if attempt.end is not None:
        attempt.ended_at, attempt.cause = attempt.end[0], str(attempt.end[1].get("cause"))
        return
    upper = limit if limit is not None else float("inf")
    hang = next((row for row in hangs if attempt.restore_begin <= float(row["time"]) <= upper), None)
    if hang is not None:
        attempt.cause, attempt.ended_at = HANG, min(float(hang["time"]), upper)
        attempt.hang_s = max(0.0, min(float(hang.get("stalled_s") or 0.0), attempt.ended_at - attempt.last_row))
        return
    attempt.cause = KILLED
    if limit is None:  # the last attempt, killed or still running: its last row is all that is known
        attempt.ended_at = attempt.last_row
        return
    attempt.ended_at = min(limit, attempt.last_row + attempt.beat_s + _unit_seconds(attempt))


def _unit_seconds(attempt: Attempt) -> float:
    """The attempt's mean time per unit of step work (split, or batch without TBPTT)."""
    marks = [(time, int(row["units"])) for time, row in attempt.rows if "units" in row]
    if attempt.training is None or not marks or marks[-1][1] <= attempt.resumed_units:
        return 0.0
    return (marks[-1][0] - attempt.training) / (marks[-1][1] - attempt.resumed_units)


def _kept_until(attempt: Attempt, following: Attempt | None) -> float:
    """The end of the work the run kept: the attempt's end when it finished or handed over all
    it did, else the last commit at or before the units the next attempt resumed from."""
    if attempt.training is None:
        return attempt.ended_at
    end_row = attempt.end[1] if attempt.end is not None else {}
    if following is None:
        if attempt.end is not None and end_row.get("cause") in (FINISHED, PREEMPTED):
            return attempt.ended_at
        return _last_commit_at_or_before(attempt, None)
    resumed = following.resumed_units
    committed = end_row.get("committed_units")
    if end_row.get("cause") in (FINISHED, PREEMPTED) or (committed is not None and committed <= resumed
                                                             and committed >= _last_units(attempt)):
        return attempt.ended_at
    return _last_commit_at_or_before(attempt, resumed)


def _last_units(attempt: Attempt) -> int:
    units = [int(row["units"]) for _, row in attempt.rows if row.get("event") == COMMIT]
    return units[-1] if units else attempt.resumed_units


def _last_commit_at_or_before(attempt: Attempt, units: int | None) -> float:
    assert attempt.training is not None
    kept = attempt.training
    for time, row in attempt.rows:
        if row.get("event") == COMMIT and (units is None or int(row["units"]) <= units):
            kept = time
    return min(kept, attempt.ended_at)


def _buckets(attempt: Attempt, limit: float | None) -> dict[str, float]:
    end = attempt.ended_at
    restored = min(attempt.restored if attempt.restored is not None else end, end)
    training = min(attempt.training if attempt.training is not None else end, end)
    kept = min(max(attempt.kept_until, training), end)
    stall_kept = stall_lost = validation_kept = validation_lost = 0.0
    for time, row in attempt.rows:
        if time > end:
            continue
        seconds = float(row.get("blocking_s", 0.0)) if row.get("event") == COMMIT else \
            float(row.get("seconds", 0.0)) if row.get("event") == VALIDATION else 0.0
        if row.get("event") == COMMIT:
            stall_kept, stall_lost = (stall_kept + seconds, stall_lost) if time <= kept else (stall_kept, stall_lost + seconds)
        elif row.get("event") == VALIDATION:
            if time <= kept:
                validation_kept += seconds
            else:
                validation_lost += seconds
    flush = float(attempt.end[1].get("flush_s", 0.0)) if attempt.end is not None else 0.0
    stall, validation = stall_kept + stall_lost + flush, validation_kept + validation_lost
    # A row's time is its interval's end: the interval cannot reach before the training began.
    productive = max(0.0, (kept - training) - stall_kept - validation_kept)
    lost_span = end - kept
    hang = min(attempt.hang_s, lost_span)
    lost = max(0.0, lost_span - hang - stall_lost - validation_lost - (flush if kept < end else 0.0))
    if kept >= end:
        productive = max(0.0, productive - flush)
    buckets = {"startup": (attempt.restore_begin - attempt.process_start) + (training - restored),
               "restore": restored - attempt.restore_begin, "checkpoint_stall": stall, "validation": validation,
               "productive": productive, "work_lost": lost, "hang_detection": hang,
               "down": max(0.0, limit - end) if limit is not None else 0.0}
    return buckets


def count_samples(attempts: list[Attempt]) -> sample_ids.SampleCount:
    """The samples of one rank's committed rows: each attempt's commits up to the work the
    next attempt kept (see :func:`_kept_until`), checked against the last progress."""
    committed: list[dict[str, Any]] = []
    epochs_completed = 0
    for attempt in attempts:
        for time, row in attempt.rows:
            if row.get("event") == COMMIT and time <= attempt.kept_until:
                committed.append(row.get("ids") or {})
                epochs_completed = int(row.get("epochs", 0))
        if attempt.end is not None and attempt.end[1].get("committed_units") is not None \
                and attempt.kept_until >= attempt.ended_at:
            committed.append(attempt.end[1].get("ids") or {})
    epoch_samples = next((attempt.epoch_samples for attempt in reversed(attempts) if attempt.epoch_samples), None)
    return sample_ids.count(committed, epochs_completed, epoch_samples)


def timeline_segments(attempts: Iterable[Attempt]) -> list[tuple[str, float, float]]:
    """(kind, start, end) of each attempt's start-up (with the restore), kept (productive) and
    lost time, and the down time between attempts, for a plot."""
    segments: list[tuple[str, float, float]] = []
    attempts = list(attempts)
    for index, attempt in enumerate(attempts):
        training = min(attempt.training if attempt.training is not None else attempt.ended_at, attempt.ended_at)
        segments.append(("start-up", attempt.process_start, training))
        segments.append(("productive", training, max(training, attempt.kept_until)))
        segments.append(("lost", attempt.kept_until, attempt.ended_at))
        if index + 1 < len(attempts):
            segments.append(("down", attempt.ended_at, attempts[index + 1].process_start))
    return segments
