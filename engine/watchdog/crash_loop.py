"""Crash loops: a job restarted again and again without progress stops being restarted.

Each ``fit`` of a run with a run dir records its attempts in ``attempts.jsonl`` (rank 0): a
``start`` row naming the checkpoint it resumed from, a ``failed`` row (the split and the error)
when an exception ends it, an ``end`` row when it returns (finished or preempted) or a Ctrl-C ends it. The start row
is written where training begins (a process killed while it starts up is no attempt); a process
that dies after it (SIGKILL, a hang the watchdog ended) leaves a start with no end. At the next
start, before any training:

* the last ``max_restarts`` attempts an exception ended since the last end all resumed from the
  checkpoint this start resumes from (no new checkpoint committed in between; an attempt killed
  from outside, which leaves a start with no end, does not count), or
* the last two failures happened at the same split with the same exception

is a crash loop: one verdict line on stderr and the process exits with
:data:`~engine.watchdog.phases.CRASH_LOOP_EXIT_CODE`, "do not requeue" (docs/faults.md).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable, Protocol

from engine.errors import warn
from engine.watchdog.outcomes import record_outcome
from engine.watchdog.phases import CRASH_LOOP_EXIT_CODE, START_BARRIER, STARTING
from engine.watchdog.tracker import mark

ATTEMPTS_FILE = "attempts.jsonl"
_ERROR_CHARACTERS = 300


class AttemptStorage(Protocol):
    def append(self, relative: str, data: bytes) -> None: ...

    def exists(self, relative: str) -> bool: ...

    def read(self, relative: str, limit: int | None = None) -> bytes: ...


def read_attempts(storage: AttemptStorage) -> list[dict[str, Any]]:
    """The rows of ``attempts.jsonl`` (a torn last line, from a process killed mid-write, is skipped)."""
    if not storage.exists(ATTEMPTS_FILE):
        return []
    rows = []
    for line in storage.read(ATTEMPTS_FILE).decode("utf-8", "replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def verdict(rows: list[dict[str, Any]], resumed_from: str | None, max_restarts: int) -> str | None:
    """Why this start is a crash loop (the verdict line's text), or None (see the module docstring)."""
    since_end: list[dict[str, Any]] = []
    for row in reversed(rows):
        if row.get("event") == "end":
            break
        since_end.append(row)
    since_end.reverse()
    failures = [row for row in since_end if row.get("event") == "failed"]
    if len(failures) >= 2:
        last, before = failures[-1], failures[-2]
        if last.get("at") is not None and (last.get("at"), last.get("error")) == (before.get("at"), before.get("error")):
            return (f"deterministic failure at split {last.get('at')}: the same exception twice ({last.get('error')}); "
                    "if a batch causes it, TrainerConfig(anomaly=engine.Rollback(...)) skips it, else fix the code")
    recent = failed_attempts(since_end)[-max_restarts:]
    if max_restarts > 0 and len(recent) == max_restarts and all(row.get("from") == resumed_from for row in recent):
        where = resumed_from if resumed_from is not None else "a fresh start"
        return (f"restarted {max_restarts} times from {where} without committing a new checkpoint; the job fails the "
                "same way each time (see attempts.jsonl and hangs.jsonl in the run dir)")
    return None


def failed_attempts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The start rows of the attempts an exception ended (a ``failed`` row before the next start).
    An attempt killed from outside (SIGKILL, a preemption without grace, the OOM killer) leaves no
    row after its start and does not count: a job killed again and again before it commits is
    unlucky, not looping, and must be requeued."""
    counted: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for row in rows:
        if row.get("event") == "start":
            current = row
        elif row.get("event") == "failed" and current is not None:
            counted.append(current)
            current = None
    return counted


def failure_row(resumed_from: str | None, at: str | None, error: BaseException) -> dict[str, Any]:
    text = f"{type(error).__name__}: {error}"[:_ERROR_CHARACTERS]
    return {"event": "failed", "from": resumed_from, "at": at, "error": text, "time": time.time()}


def record(storage: AttemptStorage | None, row: dict[str, Any]) -> None:
    """Append ``row`` to the attempts file. A row that cannot be written (a full disk, a store
    down) costs the crash-loop rule one row, never the run: a warning, not an error that would
    replace the exception that ended the attempt."""
    if storage is None:
        return
    try:
        storage.append(ATTEMPTS_FILE, (json.dumps(row, sort_keys=True) + "\n").encode())
    except Exception as error:  # noqa: BLE001 - any storage failure; the run's own error matters more
        warn(f"could not record the attempt's {row.get('event')!r} row in {ATTEMPTS_FILE}: {error}")


def stop_the_loop(text: str) -> SystemExit:
    """Say the verdict (one write) and the exception that ends the process with the crash-loop code."""
    line = f"splitloop: crash loop: {text}; exiting with {CRASH_LOOP_EXIT_CODE} (do not requeue)"
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    record_outcome(CRASH_LOOP_EXIT_CODE, line)
    return SystemExit(CRASH_LOOP_EXIT_CODE)


class Attempts:
    """The crash-loop rule for one ``fit`` (see the module docstring). ``storage``: the run dir
    (None: nothing recorded, no rule); ``writes``: whether this process appends the rows (rank 0);
    ``max_restarts``: ``Watchdog.max_restarts`` (None: no rule)."""

    def __init__(self, storage: AttemptStorage | None, writes: bool, max_restarts: int | None) -> None:
        self._storage = storage if max_restarts is not None else None
        self._writes = writes
        self._max_restarts = max_restarts or 0
        self._resumed_from: str | None = None
        self._started = False

    def begin(self, resumed_from: str | None, barrier: Callable[[], object]) -> None:
        """Stop here (SystemExit with the crash-loop code) if this start is a crash loop, else
        record it. ``barrier``: every rank has read the rows before rank 0 appends this start."""
        if self._storage is None:
            return
        self._resumed_from = resumed_from
        text = verdict(read_attempts(self._storage), resumed_from, self._max_restarts)
        mark(STARTING, START_BARRIER)  # arrived: the launcher's arrival watch
        barrier()
        if text is not None:
            raise stop_the_loop(text)
        self._started = True
        if self._writes:
            record(self._storage, {"event": "start", "from": resumed_from, "time": time.time()})

    def ended_by(self, error: BaseException, at: str | None) -> None:
        """``error`` ends the attempt after split ``at``: an exception is a failure; a Ctrl-C
        ends it (a person stopped it: no crash); the crash-loop verdict itself records nothing."""
        if not self._writes or not self._started:
            return
        if isinstance(error, Exception):
            record(self._storage, failure_row(self._resumed_from, at, error))
        elif isinstance(error, KeyboardInterrupt):
            record(self._storage, {"event": "end", "interrupted": True, "time": time.time()})

    def ended(self) -> None:
        if self._writes and self._started:
            record(self._storage, {"event": "end", "time": time.time()})
