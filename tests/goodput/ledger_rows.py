"""Hand-written ledger rows: an attempt's rows from a few instants, so that a test states the
expected buckets from the instants it chose (never from the code that reads them)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from engine.goodput.rows import rank_file

BASE = 1_800_000_000.0  # a wall-clock origin; monotonic marks are BASE-free (like a real process)


class AttemptWriter:
    """Rows of one attempt whose monotonic clock reads ``t`` at wall time ``BASE + t``."""

    def __init__(self, name: str, process_start: float, rank: int = 0, beat_s: float = 1.0) -> None:
        self.name, self.rank, self.rows, self.seq = name, rank, [], 0
        self.process_start, self.beat_s = process_start, beat_s

    def row(self, event: str, at: float, **fields: Any) -> "AttemptWriter":
        self.rows.append({"v": 1, "attempt": self.name, "seq": self.seq, "event": event,
                          "wall": BASE + at, "mono": at, **fields})
        self.seq += 1
        return self

    def start(self, at: float) -> "AttemptWriter":
        mark = {"wall": BASE + self.process_start, "mono": self.process_start}
        return self.row("start", at, host="h", pid=1, rank=self.rank, world_size=1, beat_s=self.beat_s,
                        process_start=mark, imported=mark, group_ready=mark)

    def restored(self, at: float, units: int = 0, epoch_samples: int | None = 12) -> "AttemptWriter":
        return self.row("restored", at, resumed_from=None if units == 0 else f"ckpt-{units}", units=units, steps=units,
                        epoch_samples=epoch_samples, id_kind="sample indices")

    def commit(self, at: float, units: int, blocking_s: float, ids: dict[str, list[list[int]]] | None = None,
               epochs: int = 0) -> "AttemptWriter":
        return self.row("commit", at, units=units, epochs=epochs, steps=units, blocking_s=blocking_s, ids=ids or {})

    def end(self, at: float, cause: str, flush_s: float = 0.0, **fields: Any) -> "AttemptWriter":
        return self.row("end", at, cause=cause, flush_s=flush_s, units=0, error=None,
                        committed_units=fields.get("committed_units"), ids=fields.get("ids", {}))

    def lines(self) -> list[str]:
        return [json.dumps(row) for row in self.rows]


def write(run_dir: pathlib.Path, *attempts: AttemptWriter, tail: str = "") -> None:
    by_rank: dict[int, list[str]] = {}
    for attempt in attempts:
        by_rank.setdefault(attempt.rank, []).extend(attempt.lines())
    for rank, lines in by_rank.items():
        path = run_dir / rank_file(rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n" + tail)
