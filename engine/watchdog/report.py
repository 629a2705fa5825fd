"""The hang report: one line (and the stacks) on stderr, one row in the run dir's ``hangs.jsonl``.

The stacks are faulthandler's dump of every thread of the hung process, taken by its own monitor
thread (it needs no help from the stuck main thread). A rank that cannot report itself (stopped
by a signal, or stuck in C code that holds the GIL) is reported by another rank of its node,
with its process state instead of its stacks.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import sys
import tempfile
import threading
import time
from typing import Any, Protocol

from engine.watchdog.verdict import Hang

HANGS_FILE = "hangs.jsonl"
_STORAGE_WAIT_S = 5.0  # a report is not held up by a run dir that hangs too


class AppendOnly(Protocol):
    """The part of the run's storage a report needs."""

    def append(self, relative: str, data: bytes) -> None: ...


class ReadableStorage(Protocol):
    def exists(self, relative: str) -> bool: ...

    def read(self, relative: str, limit: int | None = None) -> bytes: ...


@dataclasses.dataclass(frozen=True)
class HangReport:
    """What one rank says about a hang: the verdict, who says it, and the hung process's stacks
    (None when another rank reports it: ``process_state`` then says what it is)."""

    hang: Hang
    reported_by: int
    host: str
    exit_code: int | None
    stacks: str | None = None
    process_state: str | None = None
    # What was done instead of ending the process (a hung writer abandoned, engine.watchdog.abandon);
    # None: the process ends with ``exit_code``.
    action: str | None = None

    def line(self) -> str:
        by = "itself" if self.hang.culprit is not None and self.hang.culprit.rank == self.reported_by \
            else f"rank {self.reported_by}"
        state = f"; its process is {self.process_state}" if self.process_state else ""
        if self.action is not None:
            return f"splitloop watchdog: on {self.host}, {self.hang.describe()}{state} (reported by {by}); {self.action}"
        return (f"splitloop watchdog: on {self.host}, {self.hang.describe()}{state} (reported by {by}); "
                f"exiting with {self.exit_code} so that the job is restarted from its newest checkpoint")

    def row(self) -> dict[str, Any]:
        culprit = self.hang.culprit
        row: dict[str, Any] = {"time": time.time(), "host": self.host, "reported_by": self.reported_by,
                               "stalled_s": round(self.hang.stalled_s, 3), "exit_code": self.exit_code,
                               "waiting_ranks": [word.rank for word in self.hang.waiting]}
        if culprit is not None:
            row.update(rank=culprit.rank, pid=culprit.pid, phase=culprit.phase, detail=culprit.detail,
                       timeout_s=culprit.timeout_s, p50_s=culprit.p50_s, p99_s=culprit.p99_s,
                       last_split=culprit.splits)
        else:
            row.update(rank=None, phase="collective (culprit on another node)")
        row.update(process_state=self.process_state, stacks=self.stacks)
        if self.action is not None:
            row["action"] = self.action
        return row


def own_stacks() -> str:
    """faulthandler's dump of every thread of this process."""
    with tempfile.TemporaryFile() as dump:
        faulthandler.dump_traceback(dump, all_threads=True)
        dump.seek(0)
        return dump.read().decode("utf-8", "replace")


def process_state(pid: int) -> str | None:
    """What /proc says of ``pid``: "stopped by a signal", "sleeping", ...; None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as handle:
            letter = handle.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None
    return {"T": "stopped by a signal (SIGSTOP?)", "t": "stopped by a debugger", "D": "in uninterruptible I/O",
            "S": "sleeping (blocked in a system call)", "R": "running", "Z": "a zombie"}.get(letter, letter)


def publish(report: HangReport, storage: AppendOnly | None) -> None:
    """The line and stacks on stderr (one write: ranks' lines must not interleave), then the row."""
    text = report.line() + "\n"
    if report.stacks:
        text += report.stacks if report.stacks.endswith("\n") else report.stacks + "\n"
    sys.stderr.write(text)
    sys.stderr.flush()
    if storage is None:
        return
    line = (json.dumps(report.row(), sort_keys=True) + "\n").encode()
    writer = threading.Thread(target=_append, args=(storage, line), name="splitloop-hang-report", daemon=True)
    writer.start()
    writer.join(_STORAGE_WAIT_S)


def _append(storage: AppendOnly, line: bytes) -> None:
    try:
        storage.append(HANGS_FILE, line)
    except Exception as error:  # the report is on stderr already; the process ends either way
        sys.stderr.write(f"splitloop watchdog: could not append to {HANGS_FILE}: {error}\n")


def read_hangs(storage: "ReadableStorage") -> list[dict[str, Any]]:
    """The rows of the run dir's ``hangs.jsonl`` (none when there is no such file)."""
    if not storage.exists(HANGS_FILE):
        return []
    rows = []
    for line in storage.read(HANGS_FILE).decode("utf-8", "replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line torn by a process that ended while writing it
        if isinstance(row, dict):
            rows.append(row)
    return rows


def describe_hang(row: dict[str, Any]) -> str:
    """One line for ``python -m engine inspect``."""
    if row.get("rank") is None:
        return f"hang: every rank of {row.get('host')} waited in a collective for {row.get('stalled_s')} s"
    by = "itself" if row.get("reported_by") == row.get("rank") else f"rank {row.get('reported_by')}"
    action = f"; {row['action']}" if row.get("action") else ""
    return (f"hang: rank {row.get('rank')} on {row.get('host')} in phase {row.get('phase')!r} for "
            f"{row.get('stalled_s')} s after split {row.get('last_split')} (reported by {by}){action}")
