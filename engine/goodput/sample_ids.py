"""Sample ids in ledger rows: each epoch's ids as sorted runs ``[first, count]`` of consecutive
ids (a multiset: an id drawn twice starts a second run), and what a run's committed ids say:
how many samples were trained, skipped, and seen twice."""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable


def encode(batches: Iterable[tuple[int, list[int]]]) -> dict[str, list[list[int]]]:
    """``{epoch: [[first, count], ...]}`` for the (epoch, ids) of some batches."""
    by_epoch: dict[int, list[int]] = collections.defaultdict(list)
    for epoch, ids in batches:
        by_epoch[epoch].extend(ids)
    encoded: dict[str, list[list[int]]] = {}
    for epoch, ids in by_epoch.items():
        runs: list[list[int]] = []
        for value in sorted(ids):
            if runs and runs[-1][0] + runs[-1][1] == value:
                runs[-1][1] += 1
            else:
                runs.append([value, 1])
        encoded[str(epoch)] = runs
    return encoded


def decode(encoded: dict[str, list[list[int]]]) -> dict[int, list[int]]:
    return {int(epoch): [first + offset for first, count in runs for offset in range(count)]
            for epoch, runs in encoded.items()}


@dataclasses.dataclass
class SampleCount:
    """What the committed rows of one rank say. ``skipped`` counts, in each epoch the progress
    completed, the samples of the epoch never trained; ``seen_twice`` every training of a sample
    beyond its first in the same epoch."""

    trained: int = 0
    skipped: int = 0
    seen_twice: int = 0

    def add(self, other: SampleCount) -> None:
        self.trained += other.trained
        self.skipped += other.skipped
        self.seen_twice += other.seen_twice


def count(committed: Iterable[dict[str, list[list[int]]]], epochs_completed: int,
          epoch_samples: int | None) -> SampleCount:
    """Count the ids of ``committed`` rows (their ``ids`` fields) of one rank. ``epoch_samples``:
    how many ids the rank's data gives per epoch (None: unknown, skipped is not counted)."""
    per_epoch: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for encoded in committed:
        for epoch, ids in decode(encoded).items():
            per_epoch[epoch].update(ids)
    result = SampleCount()
    for epoch, counter in per_epoch.items():
        result.trained += sum(counter.values())
        result.seen_twice += sum(times - 1 for times in counter.values())
    if epoch_samples is not None:
        result.skipped = sum(max(0, epoch_samples - len(per_epoch.get(epoch, ()))) for epoch in range(epochs_completed))
    return result
