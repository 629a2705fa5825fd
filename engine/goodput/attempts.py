"""A rank's ledger rows as attempts, each placed on the run's time line: the wall clock of its
``start`` row plus monotonic differences inside the attempt (a clock step during an attempt
moves nothing); and the watchdog's ``hangs.jsonl`` rows."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from engine.goodput.rows import BEAT, COMMIT, END, KILLED, RESTORED, START, TRAINING, VALIDATION, LedgerStorage

HANGS_FILE = "hangs.jsonl"  # engine.watchdog.report's (engine.goodput imports nothing of the watchdog)


@dataclasses.dataclass
class Attempt:
    """One process's attempt as its ledger rows tell it (times on the run's time line, seconds)."""

    attempt: str
    host: str
    rank: int
    world_size: int
    process_start: float
    restore_begin: float
    restored: float | None
    training: float | None
    resumed_from: str | None
    resumed_units: int
    epoch_samples: int | None
    id_kind: str
    beat_s: float
    rows: list[tuple[float, dict[str, Any]]]   # commit, validation and beat rows, with their times
    end: tuple[float, dict[str, Any]] | None
    last_row: float
    cause: str = KILLED
    ended_at: float = 0.0
    hang_s: float = 0.0
    kept_until: float = 0.0                      # productive up to here; work after it was lost
    buckets: dict[str, float] = dataclasses.field(default_factory=dict)

    def timeline(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "host": self.host, "start": self.process_start, "training": self.training,
                "kept_until": self.kept_until, "end": self.ended_at, "cause": self.cause,
                "resumed_from": self.resumed_from}


def attempts_of(rows: list[dict[str, Any]]) -> list[Attempt]:
    """The attempts in one rank's rows, in the order they started."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        grouped.setdefault(str(row.get("attempt")), []).append(row)
    attempts = [attempt for attempt in map(_attempt, grouped.values()) if attempt is not None]
    # By their start rows: several fits in one process share a process start.
    return sorted(attempts, key=lambda attempt: attempt.restore_begin)


def _attempt(rows: list[dict[str, Any]]) -> Attempt | None:
    rows = sorted(rows, key=lambda row: row["seq"])
    start = next((row for row in rows if row.get("event") == START), None)
    if start is None:  # its start row was torn: nothing to place the attempt by
        return None
    wall, mono = float(start["wall"]), float(start["mono"])

    def at(mark: dict[str, Any]) -> float:
        return wall + float(mark["mono"]) - mono

    first = {row["event"]: row for row in reversed(rows)}
    restored = first.get(RESTORED)
    end = first.get(END)
    events = [(at(row), row) for row in rows if row.get("event") in (COMMIT, VALIDATION, BEAT)]
    return Attempt(
        attempt=str(start["attempt"]), host=str(start.get("host")), rank=int(start.get("rank", 0)),
        world_size=int(start.get("world_size", 1)), process_start=min(at(start["process_start"]), wall),
        restore_begin=wall, restored=None if restored is None else at(restored),
        training=None if TRAINING not in first else at(first[TRAINING]),
        resumed_from=None if restored is None else restored.get("resumed_from"),
        resumed_units=0 if restored is None else int(restored.get("units", 0)),
        epoch_samples=None if restored is None else restored.get("epoch_samples"),
        id_kind="" if restored is None else str(restored.get("id_kind")),
        beat_s=float(start.get("beat_s", 1.0)), rows=events, end=None if end is None else (at(end), end),
        last_row=max(at(row) for row in rows))


def read_hangs(storage: LedgerStorage) -> list[dict[str, Any]]:
    if not storage.exists(HANGS_FILE):
        return []
    found = []
    for line in storage.read(HANGS_FILE).decode("utf-8", "replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        # A row with an "action" reports a hung writer abandoned while training went on: no attempt ended there.
        if isinstance(row, dict) and isinstance(row.get("time"), (int, float)) and "action" not in row:
            found.append(row)
    return found
