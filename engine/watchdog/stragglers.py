"""Stragglers: a rank whose own work per split is consistently slower than the fastest rank's.

Each rank publishes in its word the moving average of its *busy* time per split (every phase but
the waits: collectives, backward — where DDP waits for the others —, the checkpoint writer), so a
fast rank that waits for a slow one does not look slow. The node's lowest rank compares them: a
rank whose average stays at least ``factor`` times the fastest's for ``window`` of its splits is
reported once — a line on stderr and a ``stragglers.jsonl`` row (rank, host, phase, factor) — and
never killed.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any, Sequence

from engine.watchdog.word import FINISHED, Word

STRAGGLERS_FILE = "stragglers.jsonl"


@dataclasses.dataclass(frozen=True)
class Straggler:
    """Rank ``word.rank`` works ``factor`` times as long per split as the fastest rank (``fastest``)."""

    word: Word
    factor: float
    fastest: Word

    def line(self, host: str) -> str:
        return (f"splitloop watchdog: straggler: rank {self.word.rank} on {host} takes {self.factor:.2f}x as long per "
                f"split as rank {self.fastest.rank} ({self.word.busy_s * 1000:.1f} ms against "
                f"{self.fastest.busy_s * 1000:.1f} ms of its own work) over its last splits, now in phase "
                f"{self.word.phase!r} after split {self.word.splits}; it is not stopped")

    def row(self, host: str) -> dict[str, Any]:
        return {"time": time.time(), "rank": self.word.rank, "host": host, "phase": self.word.phase,
                "factor": round(self.factor, 3), "busy_s": self.word.busy_s, "fastest_rank": self.fastest.rank,
                "fastest_busy_s": self.fastest.busy_s, "split": self.word.splits}


class StragglerWatch:
    """Follows the local ranks' busy times across looks (see the module docstring)."""

    def __init__(self, factor: float, window: int, warmup: int) -> None:
        self._factor, self._window, self._warmup = factor, window, warmup
        self._slow_since: dict[int, int] = {}  # rank -> its split count when it became slow
        self._reported: set[int] = set()

    def look(self, words: Sequence[Word]) -> list[Straggler]:
        """The ranks that have just been slow for a whole window (each reported once)."""
        ranks = [word for word in words if not word.flags & FINISHED and word.splits >= self._warmup
                 and word.busy_s > 0]
        if len(ranks) < 2:
            return []
        fastest = min(ranks, key=lambda word: word.busy_s)
        found = []
        for word in ranks:
            factor = word.busy_s / fastest.busy_s
            if factor < self._factor:
                self._slow_since.pop(word.rank, None)
                continue
            since = self._slow_since.setdefault(word.rank, word.splits)
            if word.splits - since >= self._window and word.rank not in self._reported:
                self._reported.add(word.rank)
                found.append(Straggler(word, factor, fastest))
        return found


def report(straggler: Straggler, host: str, storage: Any) -> None:
    """The line on stderr and the row in ``stragglers.jsonl`` (``storage`` None: stderr only)."""
    sys.stderr.write(straggler.line(host) + "\n")
    sys.stderr.flush()
    if storage is not None:
        try:
            storage.append(STRAGGLERS_FILE, (json.dumps(straggler.row(host), sort_keys=True) + "\n").encode())
        except Exception as error:  # a report, never a reason to stop training
            sys.stderr.write(f"splitloop watchdog: could not append to {STRAGGLERS_FILE}: {error}\n")
