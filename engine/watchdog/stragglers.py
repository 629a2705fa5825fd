"""Stragglers: a rank whose own work per split is consistently slower than the fastest rank's.

Each rank publishes in its word the moving average of its *busy* time per split (every phase but
the waits: collectives, backward — where DDP waits for the others —, the checkpoint writer), so a
fast rank that waits for a slow one does not look slow. The node's lowest rank compares them: a
rank whose average stays at least ``factor`` times the fastest's for ``window`` of its splits is
reported once — a line on stderr and a ``stragglers.jsonl`` row (rank, host, phase, factor) — and
never killed.

Each rank is also compared with its own history (a rank alone, or every rank of a node slowed
together, has no faster peer): a slow average of its busy time per split, updated per split
(weight :data:`HISTORY_WEIGHT`) only while the rank is not slow, so that a lasting slowdown does
not become the new normal before it is reported. A rank whose average stays ``factor`` times
that baseline for ``window`` splits is reported once the same way (``against`` says which).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any, Sequence

from engine.watchdog.word import FINISHED, Word

STRAGGLERS_FILE = "stragglers.jsonl"
HISTORY_WEIGHT = 0.02  # per split: the baseline follows a change of the normal pace over ~50 splits


@dataclasses.dataclass(frozen=True)
class Straggler:
    """Rank ``word.rank`` works ``factor`` times as long per split as the fastest rank
    (``fastest``), or, with ``fastest`` None, as its own history (``baseline_s`` per split)."""

    word: Word
    factor: float
    fastest: Word | None
    baseline_s: float = 0.0

    def line(self, host: str) -> str:
        if self.fastest is None:
            than = f"it did before ({self.word.busy_s * 1000:.1f} ms against its usual {self.baseline_s * 1000:.1f} ms"
        else:
            than = (f"rank {self.fastest.rank} ({self.word.busy_s * 1000:.1f} ms against "
                    f"{self.fastest.busy_s * 1000:.1f} ms")
        return (f"splitloop watchdog: straggler: rank {self.word.rank} on {host} takes {self.factor:.2f}x as long per "
                f"split as {than} of its own work) over its last splits, now in phase "
                f"{self.word.phase!r} after split {self.word.splits}; it is not stopped")

    def row(self, host: str) -> dict[str, Any]:
        row: dict[str, Any] = {"time": time.time(), "rank": self.word.rank, "host": host, "phase": self.word.phase,
                               "factor": round(self.factor, 3), "busy_s": self.word.busy_s, "split": self.word.splits}
        if self.fastest is None:
            row.update(against="own history", baseline_s=self.baseline_s)
        else:
            row.update(against="fastest rank", fastest_rank=self.fastest.rank, fastest_busy_s=self.fastest.busy_s)
        return row


class StragglerWatch:
    """Follows the local ranks' busy times across looks (see the module docstring)."""

    def __init__(self, factor: float, window: int, warmup: int) -> None:
        self._factor, self._window, self._warmup = factor, window, warmup
        self._slow_since: dict[int, int] = {}  # rank -> its split count when it became slow
        self._reported: set[int] = set()
        self._history: dict[int, _History] = {}

    def look(self, words: Sequence[Word]) -> list[Straggler]:
        """The ranks that have just been slow for a whole window (each reported once), against
        the fastest rank first, then against their own history."""
        ranks = [word for word in words if not word.flags & FINISHED and word.splits >= self._warmup
                 and word.busy_s > 0]
        found = self._against_the_fastest(ranks)
        for word in ranks:
            history = self._history.setdefault(word.rank, _History(word.busy_s, word.splits))
            straggler = history.look(word, self._factor, self._window)
            if straggler is not None and word.rank not in self._reported:  # one report per rank
                self._reported.add(word.rank)
                found.append(straggler)
        return found

    def _against_the_fastest(self, ranks: list[Word]) -> list[Straggler]:
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


class _History:
    """One rank's baseline busy time per split, and since which split it has been slow against it."""

    def __init__(self, busy_s: float, splits: int) -> None:
        self.baseline_s, self.splits = busy_s, splits
        self.slow_since: int | None = None

    def look(self, word: Word, factor: float, window: int) -> Straggler | None:
        advanced = word.splits - self.splits
        if advanced <= 0:
            return None  # no split since the last look (or a restart counted from a checkpoint)
        self.splits = word.splits
        ratio = word.busy_s / self.baseline_s
        if ratio < factor:
            self.slow_since = None
            self.baseline_s += min(1.0, HISTORY_WEIGHT * advanced) * (word.busy_s - self.baseline_s)
            return None
        if self.slow_since is None:
            self.slow_since = word.splits
        if word.splits - self.slow_since < window:
            return None
        return Straggler(word, ratio, None, self.baseline_s)


def report(straggler: Straggler, host: str, storage: Any) -> None:
    """The line on stderr and the row in ``stragglers.jsonl`` (``storage`` None: stderr only)."""
    sys.stderr.write(straggler.line(host) + "\n")
    sys.stderr.flush()
    if storage is not None:
        try:
            storage.append(STRAGGLERS_FILE, (json.dumps(straggler.row(host), sort_keys=True) + "\n").encode())
        except Exception as error:  # a report, never a reason to stop training
            sys.stderr.write(f"splitloop watchdog: could not append to {STRAGGLERS_FILE}: {error}\n")
